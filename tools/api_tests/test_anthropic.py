"""POST /v1/messages (Anthropic's Messages API) through the official `anthropic` SDK: text,
streaming, tool_use / tool_result round trips, thinking, stop sequences, usage, count_tokens,
x-api-key auth and Anthropic's error shapes. The same engine path as /v1/chat/completions runs
underneath; scripted replies come from the test script (common.SCRIPT)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from common import API_KEY, MAX_CONTEXT, MODEL_NAME

WEATHER = {
    "name": "get_weather",
    "description": "Weather forecast for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                     "required": ["city", "days"]},
}
PARIS = {"city": "Paris", "days": 3}


@pytest.fixture(scope="module")
def ac(server):
    c = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def user(text):
    return [{"role": "user", "content": text}]


def test_create_text(ac):
    m = ac.messages.create(model=MODEL_NAME, max_tokens=64, system="Be brief.", messages=user("[[plain]] 2+2?"))
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == "Just the answer: 4."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    u = m.usage
    assert u.output_tokens > 0 and u.input_tokens > 0
    assert u.cache_read_input_tokens is not None and u.cache_read_input_tokens >= 0


def test_max_tokens_and_stop_sequence(ac):
    m = ac.messages.create(model=MODEL_NAME, max_tokens=5, messages=user("Tell me a story."), extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    m = ac.messages.create(model=MODEL_NAME, max_tokens=64, messages=user("[[stop]] go"), stop_sequences=["gamma"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "gamma"
    assert m.content[0].text.strip() == "alpha beta"


def test_stream_matches_create(ac):
    ref = ac.messages.create(model=MODEL_NAME, max_tokens=64, messages=user("[[unicode]] hi"))
    with ac.messages.stream(model=MODEL_NAME, max_tokens=64, messages=user("[[unicode]] hi")) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == ref.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == ref.usage.output_tokens


def test_raw_stream_event_order(ac):
    events = [e.type for e in ac.messages.create(model=MODEL_NAME, max_tokens=64, stream=True,
                                                messages=user("[[plain]] q"))]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and events[-3] == "content_block_stop"
    assert set(events[2:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("stream", [False, True])
def test_thinking(ac, stream):
    kw = dict(model=MODEL_NAME, max_tokens=64, thinking={"type": "enabled", "budget_tokens": 32},
              messages=user("[[think-open]] 2+2?"))
    if stream:
        with ac.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = ac.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "plan it"
    assert m.content[1].text == "The answer is 4."


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(ac, stream):
    msgs = user("[[weather]] What is the weather in Paris?")
    kw = dict(model=MODEL_NAME, max_tokens=200, tools=[WEATHER], messages=msgs)
    if stream:
        with ac.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = ac.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].input == PARIS
    assert calls[0].id
    # Back with the result: the assistant message as the SDK gave it, then a tool_result.
    msgs = msgs + [{"role": "assistant", "content": m.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                 "content": [{"type": "text", "text": "sunny"}]}]}]
    m2 = ac.messages.create(model=MODEL_NAME, max_tokens=64, tools=[WEATHER], messages=msgs)
    assert m2.stop_reason == "end_turn"
    assert [b.type for b in m2.content] == ["text"] and m2.content[0].text == "It is sunny."


def test_tool_choice_forces_a_call(ac):
    m = ac.messages.create(model=MODEL_NAME, max_tokens=40, tools=[WEATHER], extra_body={"temperature": 0, "top_k": 1},
                           tool_choice={"type": "tool", "name": "get_weather"}, messages=user("hello"))
    assert any(b.type == "tool_use" and b.name == "get_weather" for b in m.content), m.content


def test_count_tokens(ac):
    n = ac.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=user("[[plain]] 2+2?"))
    m = ac.messages.create(model=MODEL_NAME, max_tokens=8, system="Be brief.", messages=user("[[plain]] 2+2?"))
    assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_errors(ac, server):
    with pytest.raises(anthropic.BadRequestError) as ei:
        ac.messages.create(model=MODEL_NAME, max_tokens=8, messages=[{"role": "system", "content": "x"}])
    body = ei.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=MODEL_NAME, max_tokens=8, messages=user("x" * (MAX_CONTEXT * 8)))
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        bad.messages.create(model=MODEL_NAME, max_tokens=8, messages=user("hi"))
    assert ei.value.body["error"]["type"] == "authentication_error"
    bad.close()


def test_x_api_key_on_openai_routes(server):
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": API_KEY})
    assert r.status_code == 200
