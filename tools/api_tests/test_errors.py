"""Errors surface as the SDK's own exception types, with OpenAI-shaped bodies; auth."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from common import MODEL_NAME, NO_THINK, check_error_body, make_client


def long_text(words: int) -> str:
    rng = random.Random(7)
    vocab = ["apple", "river", "stone", "cloud", "music", "paper", "light", "garden"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def error_obj(exc: openai.APIStatusError) -> dict:
    """The `error` object of the response body."""
    return check_error_body(exc.response.json())


# ---- context length -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_exceeded_chat(client, stream):
    prompt = long_text(3000)  # ~8000 tokens, far over --max-context
    with pytest.raises(openai.BadRequestError) as ei:
        r = client.chat.completions.create(model=MODEL_NAME, stream=stream, max_tokens=8,
                                           messages=[{"role": "user", "content": prompt}])
        if stream:
            list(r)
    exc = ei.value
    assert exc.status_code == 400
    assert exc.code == "context_length_exceeded", exc.body
    e = error_obj(exc)
    assert e["type"] == "invalid_request_error"


def test_context_length_exceeded_completions(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL_NAME, prompt=long_text(3000), max_tokens=8)
    assert ei.value.code == "context_length_exceeded"


def test_server_fine_after_oversized_prompt(client):
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=32, extra_body=NO_THINK,
                                       messages=[{"role": "user", "content": "[[plain]] ok?"}])
    assert r.choices[0].message.content == "Just the answer: 4."


# ---- invalid requests ---------------------------------------------------------------------------


USER = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("kwargs", [
    {"messages": USER, "extra_body": {"temperature": "hot"}},
    {"messages": USER, "max_tokens": -1},
    {"messages": "hello"},
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"content": "hi"}]},
    {"messages": USER, "extra_body": {"top_p": "most"}},
    {"messages": USER, "extra_body": {"stop": 42}},
    {"messages": USER, "extra_body": {"stream": "yes"}},
    {"messages": USER, "extra_body": {"tools": "get_weather"}},
], ids=["temperature-string", "max_tokens-negative", "messages-string", "messages-empty",
        "unknown-role", "no-role", "top_p-string", "stop-number", "stream-string", "tools-string"])
def test_bad_request(client, kwargs):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL_NAME, **kwargs)
    e = error_obj(ei.value)
    assert e["type"] == "invalid_request_error", e


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "only a system prompt"}],
    [{"role": "assistant", "content": "I speak first"}],
], ids=["system-only", "assistant-only"])
def test_conversation_the_template_rejects(client, messages):
    """The chat template raises on these: a 400 naming the problem, not a 500."""
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert error_obj(ei.value)["type"] == "invalid_request_error"


def test_bad_request_completions(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=None)


# ---- auth ---------------------------------------------------------------------------------------


def test_wrong_key(server):
    bad = make_client(server, key="not-the-key")
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.models.list()
    assert ei.value.status_code == 401
    error_obj(ei.value)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4)
    bad.close()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "lily-test-key-7f3a"},
                                     {"Authorization": "Basic bGlseQ=="},
                                     {"Authorization": "Bearer"}, {"Authorization": "Bearer wrong-key"}],
                         ids=["none", "no-scheme", "basic", "empty-bearer", "wrong-key"])
def test_missing_or_malformed_auth_header(server, headers):
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/v1/chat/completions",
                                {"model": MODEL_NAME, "messages": USER, "max_tokens": 4}),
                               ("GET", "/metrics", None)]:
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
        if path.startswith("/v1"):
            assert r.json()["error"]["message"], r.text


def test_health_needs_no_key(server):
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200
    assert r.json()["status"] == "ok", r.text
