"""POST /v1/chat/completions through the OpenAI SDK: response shapes, usage, streaming, reasoning
split, stops, logprobs, seeds, and GET /v1/models."""

from __future__ import annotations

import time

import openai
import pytest

from common import MAX_CONTEXT, MODEL_NAME, NO_THINK, UNICODE_REPLY, extra, reasoning_of

# Unscripted prompts: the random weights answer with noise text.
NOISE = "Tell me a story about a lighthouse keeper."


def chat(client, content, **kw):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], **kw)


def collect(stream):
    """Consumes a chat stream; returns its chunks and what they add up to."""
    out = {"chunks": [], "content": "", "reasoning": "", "finish": [], "usage": None, "roles": [],
           "deltas": []}
    for ch in stream:
        out["chunks"].append(ch)
        if ch.usage is not None:
            out["usage"] = ch.usage
        for c in ch.choices:
            d = c.delta
            if d.role:
                out["roles"].append(d.role)
            if d.content:
                out["content"] += d.content
                out["deltas"].append(d.content)
            r = reasoning_of(d)
            if r:
                out["reasoning"] += r
            if c.finish_reason is not None:
                out["finish"].append(c.finish_reason)
    return out


def text_of(resp):
    m = resp.choices[0].message
    return (m.content or "", reasoning_of(m) or "")


# ---- shapes and usage ---------------------------------------------------------------------------


def test_non_streaming_shape_and_usage(client):
    t0 = int(time.time())
    r = chat(client, NOISE, max_tokens=8, temperature=0, extra_body=NO_THINK)
    assert r.id.startswith("chatcmpl-"), r.id
    assert r.object == "chat.completion"
    assert isinstance(r.created, int) and abs(r.created - t0) <= 10, r.created
    assert isinstance(r.model, str) and r.model
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert not c.message.tool_calls
    # max_tokens reached on noise text: "length", and exactly max_tokens generated.
    assert c.finish_reason == "length"
    u = r.usage
    assert u.completion_tokens == 8
    assert u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None, "usage.prompt_tokens_details missing"
    cached = u.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= u.prompt_tokens, cached


def test_scripted_reply_ends_with_stop(client):
    r = chat(client, "[[plain]] What is 2+2?", max_tokens=64, extra_body=NO_THINK)
    c = r.choices[0]
    assert c.message.content == "Just the answer: 4."
    assert not reasoning_of(c.message)
    assert c.finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 64


def test_any_model_name_is_accepted(client):
    r = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "[[plain]] hi"}],
        max_tokens=32, extra_body=NO_THINK)
    assert r.choices[0].message.content == "Just the answer: 4."


def test_multi_turn_with_system_message(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "[[plain]] and 2+2?"}]},
        ],
        max_tokens=32, extra_body=NO_THINK)
    assert r.choices[0].message.content == "Just the answer: 4."


def test_prompt_tokens_grow_with_the_prompt(client):
    short = chat(client, "[[plain]] hi", max_tokens=32, extra_body=NO_THINK)
    long = chat(client, "[[plain]] hi " + "and more words " * 20, max_tokens=32, extra_body=NO_THINK)
    assert long.usage.prompt_tokens > short.usage.prompt_tokens + 20


def test_max_tokens_one(client):
    r = chat(client, "[[plain]] hi", max_tokens=1, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 1
    assert r.choices[0].message.content == "J"


def test_generation_stops_at_the_context_end(client):
    """A forced reply (~1500 tokens) longer than the room the prompt leaves: generation must end
    cleanly with "length" when the context is full, streaming or not."""
    prompt = "[[long]] " + " ".join(f"w{i}" for i in range(520))
    p = chat(client, prompt, max_tokens=1, extra_body=NO_THINK).usage.prompt_tokens
    room = MAX_CONTEXT - p
    assert 8 <= room <= 100, f"test setup: prompt is {p} tokens, wanted a little under {MAX_CONTEXT}"

    # No max_tokens: the default is whatever the context leaves.
    r = chat(client, prompt, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == p
    assert 1 <= r.usage.completion_tokens <= room, (p, r.usage)

    # max_tokens past the end of the context: rejected up front, or clamped to the context.
    try:
        r2 = chat(client, prompt, max_tokens=room + 100, extra_body=NO_THINK)
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded", e.body
    else:
        assert r2.choices[0].finish_reason == "length"
        assert r2.usage.completion_tokens == r.usage.completion_tokens, (r.usage, r2.usage)

    s = collect(chat(client, prompt, stream=True, stream_options={"include_usage": True},
                     extra_body=NO_THINK))
    assert s["finish"] == ["length"]
    assert s["usage"].completion_tokens == r.usage.completion_tokens
    assert s["content"] == r.choices[0].message.content


def test_context_boundary_off_by_one(client):
    """Each digit is one token (Qwen's pre-tokenizer splits numbers into digits), so the prompt can
    be sized exactly: one free position still gives one token; none left is a 400."""
    def prompt(k):
        return "[[plain]] " + "7" * k

    p0 = chat(client, prompt(1), max_tokens=1, extra_body=NO_THINK).usage.prompt_tokens
    p1 = chat(client, prompt(2), max_tokens=1, extra_body=NO_THINK).usage.prompt_tokens
    assert p1 == p0 + 1, "test setup: a digit is not one token"
    k = MAX_CONTEXT - 1 - (p0 - 1)  # prompt of MAX_CONTEXT - 1 tokens
    r = chat(client, prompt(k), max_tokens=1, extra_body=NO_THINK)
    assert r.usage.prompt_tokens == MAX_CONTEXT - 1
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    r = chat(client, prompt(k), extra_body=NO_THINK)  # default max_tokens: what is left
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, prompt(k + 1), max_tokens=1, extra_body=NO_THINK)  # MAX_CONTEXT tokens
    assert ei.value.code == "context_length_exceeded"


# ---- streaming ----------------------------------------------------------------------------------


def test_streaming_matches_non_streaming(client):
    kw = dict(max_tokens=16, temperature=0, extra_body=NO_THINK)
    prompt = "Describe the sea at night."
    ref = chat(client, prompt, **kw)
    s = collect(chat(client, prompt, stream=True, stream_options={"include_usage": True}, **kw))
    chunks = s["chunks"]
    assert len(chunks) >= 3, chunks
    ids = {ch.id for ch in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    first = chunks[0]
    assert first.choices and first.choices[0].delta.role == "assistant", first
    assert s["roles"] == ["assistant"], "role must be sent once, in the first delta"
    # Exactly one chunk carries finish_reason, then one usage chunk with no choices closes the stream.
    assert s["finish"] == [ref.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None, last
    assert all(ch.usage is None for ch in chunks[:-1])
    # Same greedy request, same text and counts.
    assert (s["content"], s["reasoning"]) == text_of(ref)
    assert s["usage"].completion_tokens == ref.usage.completion_tokens == 16
    assert s["usage"].prompt_tokens == ref.usage.prompt_tokens
    assert s["usage"].total_tokens == s["usage"].prompt_tokens + s["usage"].completion_tokens
    assert s["usage"].prompt_tokens_details is not None
    assert s["usage"].prompt_tokens_details.cached_tokens is not None


def test_streaming_without_usage_option_has_no_usage_chunk(client):
    s = collect(chat(client, "[[plain]] hi", stream=True, max_tokens=32, extra_body=NO_THINK))
    assert s["usage"] is None
    assert all(ch.choices for ch in s["chunks"]), "no empty-choices chunk without include_usage"
    assert s["content"] == "Just the answer: 4."
    assert s["finish"] == ["stop"]


def test_multibyte_text_streams_intact(client):
    r = chat(client, "[[unicode]] greet me", max_tokens=64, extra_body=NO_THINK)
    assert r.choices[0].message.content == UNICODE_REPLY
    s = collect(chat(client, "[[unicode]] greet me", stream=True, max_tokens=64, extra_body=NO_THINK))
    assert s["content"] == UNICODE_REPLY
    assert all("\ufffd" not in d for d in s["deltas"]), f"a delta split a character: {s['deltas']}"


def test_seeded_sampling_streams_the_same_text(client):
    kw = dict(max_tokens=16, temperature=1.0, seed=99, extra_body=NO_THINK)
    ref = chat(client, "Sing a song.", **kw)
    s = collect(chat(client, "Sing a song.", stream=True, **kw))
    assert (s["content"], s["reasoning"]) == text_of(ref)


# ---- stop sequences -----------------------------------------------------------------------------


def test_stop_sequence(client):
    r = chat(client, "[[stop]] list", max_tokens=64, stop=["gamma"], extra_body=NO_THINK)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.message.content.rstrip() == "alpha beta", repr(c.message.content)
    s = collect(chat(client, "[[stop]] list", stream=True, max_tokens=64, stop=["gamma"],
                     extra_body=NO_THINK))
    assert s["finish"] == ["stop"]
    # No partial stop string ("ga", "gam") may leak into the stream before the match is known.
    assert s["content"] == c.message.content, (s["content"], s["deltas"])


def test_stop_inside_multibyte_text(client):
    r = chat(client, "[[unicode]] greet me", max_tokens=64, stop=["世界", "🎉"], extra_body=NO_THINK)
    assert r.choices[0].message.content == "Grüße, "
    assert r.choices[0].finish_reason == "stop"
    s = collect(chat(client, "[[unicode]] greet me", stream=True, max_tokens=64, stop=["世界"],
                     extra_body=NO_THINK))
    assert s["content"] == "Grüße, ", s["deltas"]


def test_several_stops_earliest_wins(client):
    r = chat(client, "[[stop]] list", max_tokens=64, stop=["delta", "beta", "epsilon"],
             extra_body=NO_THINK)
    assert r.choices[0].message.content == "alpha "


# ---- reasoning ----------------------------------------------------------------------------------


@pytest.mark.parametrize("trigger", ["[[think]]", "[[think-open]]"])
def test_reasoning_split(client, trigger):
    r = chat(client, f"{trigger} What is 2+2?", max_tokens=64)
    m = r.choices[0].message
    assert m.content == "The answer is 4.", repr(m.content)
    assert reasoning_of(m) == "plan it", m
    assert extra(m, "reasoning") == "plan it", "the `reasoning` alias is missing or differs"
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("trigger", ["[[think]]", "[[think-open]]"])
def test_reasoning_split_streaming(client, trigger):
    s = collect(chat(client, f"{trigger} What is 2+2?", stream=True, max_tokens=64))
    # The deltas add up to exactly what the non-streaming message holds.
    assert s["content"] == "The answer is 4.", s["deltas"]
    assert s["reasoning"] == "plan it", s["reasoning"]
    for ch in s["chunks"]:
        for c in ch.choices:
            for piece in (c.delta.content or "", reasoning_of(c.delta) or ""):
                assert "<think>" not in piece and "</think>" not in piece, ch
    assert s["finish"] == ["stop"]


def test_thinking_disabled_everything_is_content(client):
    r = chat(client, "[[plain]] What is 2+2?", max_tokens=64, extra_body=NO_THINK)
    m = r.choices[0].message
    assert m.content == "Just the answer: 4."
    assert not reasoning_of(m)
    s = collect(chat(client, "[[plain]] What is 2+2?", stream=True, max_tokens=64, extra_body=NO_THINK))
    assert s["content"] == "Just the answer: 4." and s["reasoning"] == ""


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs(client):
    r = chat(client, "Name three colours.", max_tokens=6, temperature=0, logprobs=True,
             top_logprobs=3, extra_body=NO_THINK)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert c.logprobs is not None and c.logprobs.content is not None
    entries = c.logprobs.content
    assert len(entries) == r.usage.completion_tokens == 6
    for e in entries:
        assert isinstance(e.token, str)
        assert e.logprob <= 0.0
        assert len(e.top_logprobs) == 3, e
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True), tops
        assert all(t <= 0.0 for t in tops)
        # Greedy: the chosen token is the most likely one.
        assert e.logprob == pytest.approx(tops[0], abs=1e-4), e


def test_logprobs_of_a_forced_reply(client):
    r = chat(client, "[[plain]] hi", max_tokens=64, logprobs=True, top_logprobs=2, extra_body=NO_THINK)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens, (len(entries), r.usage)
    assert all(e.logprob <= 0.0 and len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries).startswith("Just the answer: 4.")


@pytest.mark.parametrize("top", [0, 20])
def test_top_logprobs_bounds(client, top):
    r = chat(client, "Name three colours.", max_tokens=3, temperature=0, logprobs=True,
             top_logprobs=top, extra_body=NO_THINK)
    for e in r.choices[0].logprobs.content:
        assert len(e.top_logprobs) == top
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)


def test_no_logprobs_unless_asked(client):
    r = chat(client, "[[plain]] hi", max_tokens=32, extra_body=NO_THINK)
    assert r.choices[0].logprobs is None


def test_logprobs_streaming(client):
    n = 0
    for ch in chat(client, "Name three colours.", stream=True, max_tokens=5, temperature=0,
                   logprobs=True, top_logprobs=2, extra_body=NO_THINK):
        for c in ch.choices:
            if c.logprobs is not None and c.logprobs.content:
                for e in c.logprobs.content:
                    assert len(e.top_logprobs) == 2
                    n += 1
    assert n == 5


# ---- sampling -----------------------------------------------------------------------------------


def test_seed_reproducible(client):
    def sample(seed):
        r = chat(client, "Write a poem about rain.", max_tokens=16, temperature=1.0, seed=seed,
                 extra_body=NO_THINK)
        return text_of(r)

    a = sample(1234)
    assert a == sample(1234), "same seed, same sampled text"
    outs = {sample(s) for s in (1, 2, 3, 4)}
    assert len(outs) >= 2, f"four seeds gave the same text: is the seed ignored? {outs}"


def test_sampling_parameters_accepted(client):
    r = chat(client, "[[plain]] x", max_tokens=32, temperature=0.7, top_p=0.9, presence_penalty=0.5,
             frequency_penalty=0.2, extra_body={**NO_THINK, "top_k": 10, "min_p": 0.05,
                                                "repetition_penalty": 1.1})
    assert r.choices[0].message.content == "Just the answer: 4."


# ---- prefix cache -------------------------------------------------------------------------------


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "[[plain]] " + " ".join(f"fact {i} is about the number {i * 7}." for i in range(40))
    a = chat(client, prompt, max_tokens=32, extra_body=NO_THINK)
    b = chat(client, prompt, max_tokens=32, extra_body=NO_THINK)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > 200
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= b.usage.prompt_tokens, (
        f"second identical prompt reused no cached tokens ({cached}/{b.usage.prompt_tokens})")
    assert b.choices[0].message.content == "Just the answer: 4."


# ---- models -------------------------------------------------------------------------------------


def test_models_list(client):
    ms = client.models.list()
    ids = [m.id for m in ms.data]
    assert ids == [MODEL_NAME], ids
    m = ms.data[0]
    assert m.object == "model"
    assert m.owned_by == "lily"
    assert isinstance(m.created, int)
