"""POST /v1/completions (a raw prompt string, no chat template), streaming and not."""

from __future__ import annotations

from common import MODEL_NAME


def test_completion_scripted(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time [[complete]]", max_tokens=32)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-"), r.id
    assert isinstance(r.created, int)
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.text == " and they lived happily ever after."
    assert c.finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens < 32
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_completion_length(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=7,
                                  temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert isinstance(c.text, str)


def test_completion_streaming_matches(client):
    kw = dict(model=MODEL_NAME, prompt="In the beginning there was", max_tokens=12, temperature=0)
    ref = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text, finish, usage = "", [], None
    for ch in chunks:
        assert ch.object == "text_completion"
        assert ch.id.startswith("cmpl-")
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += c.text or ""
            if c.finish_reason is not None:
                finish.append(c.finish_reason)
    assert len({ch.id for ch in chunks}) == 1
    assert text == ref.choices[0].text
    assert finish == [ref.choices[0].finish_reason] == ["length"]
    assert usage is not None and usage.completion_tokens == 12
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_completion_streaming_scripted(client):
    text = "".join(c.text for ch in client.completions.create(
        model=MODEL_NAME, prompt="[[complete]]", max_tokens=32, stream=True) for c in ch.choices)
    assert text == " and they lived happily ever after."


def test_completion_stop(client):
    r = client.completions.create(model=MODEL_NAME, prompt="[[complete]]", max_tokens=32,
                                  stop=["happily"])
    assert r.choices[0].text == " and they lived "
    assert r.choices[0].finish_reason == "stop"
