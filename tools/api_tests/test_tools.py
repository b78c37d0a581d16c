"""Tool calls: Qwen's XML tool-call format parsed into OpenAI `tool_calls` (typed by the tool's
JSON schema), streamed as deltas, and sent back in the next turn with a `tool` message."""

from __future__ import annotations

import json

import pytest

from common import MODEL_NAME, NO_THINK, reasoning_of

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
TRIP = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "description": "Plan a trip",
        "parameters": {
            "type": "object",
            "properties": {
                "stops": {"type": "array", "items": {"type": "string"}},
                "budget": {"type": "number"},
                "flexible": {"type": "boolean"},
                "note": {"type": "string"},
            },
            "required": ["stops"],
        },
    },
}
TOOLS = [WEATHER, TRIP]
PARIS = {"city": "Paris", "days": 3}


def ask(client, trigger, think=False, **kw):
    body = {} if think else NO_THINK
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"{trigger} What is the weather in Paris?"}],
        tools=TOOLS, extra_body=body, **kw)


def assert_no_markup(text):
    for tag in ("<tool_call>", "</tool_call>", "<function=", "<parameter="):
        assert tag not in (text or ""), f"tool-call markup leaked into content: {text!r}"


def reassemble(stream):
    """Chat stream -> (content, reasoning, {index: call}, finish reasons, first deltas)."""
    content, reasoning, calls, finish, firsts = "", "", {}, [], {}
    for ch in stream:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += reasoning_of(d) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    firsts[tc.index] = tc
                    calls[tc.index] = {"id": tc.id, "type": tc.type, "name": "", "arguments": ""}
                entry = calls[tc.index]
                if tc.function is not None:
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
            if c.finish_reason is not None:
                finish.append(c.finish_reason)
    return content, reasoning, calls, finish, firsts


def test_tool_call_parsed(client):
    r = ask(client, "[[weather]]")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert not c.message.content, repr(c.message.content)
    tcs = c.message.tool_calls
    assert tcs and len(tcs) == 1, c.message
    tc = tcs[0]
    assert tc.type == "function"
    assert isinstance(tc.id, str) and tc.id
    assert tc.function.name == "get_weather"
    args = json.loads(tc.function.arguments)
    assert args == PARIS
    assert type(args["days"]) is int, "days is an integer in the schema: must be a JSON number"


def test_tool_call_after_reasoning(client):
    r = ask(client, "[[weather-think]]", think=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert reasoning_of(c.message) == "I should call the tool."
    assert_no_markup(c.message.content)
    assert not c.message.content
    assert json.loads(c.message.tool_calls[0].function.arguments) == PARIS


def test_tool_call_with_preamble_text(client):
    r = ask(client, "[[weather-preamble]]")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert (c.message.content or "").strip() == "Let me check."
    assert json.loads(c.message.tool_calls[0].function.arguments) == PARIS


def test_two_tool_calls(client):
    r = ask(client, "[[two-calls]]")
    tcs = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert [t.function.name for t in tcs] == ["get_weather", "get_weather"]
    assert [json.loads(t.function.arguments) for t in tcs] == [PARIS, {"city": "London", "days": 1}]
    assert tcs[0].id != tcs[1].id


def test_schema_types_array_number_boolean_multiline_string(client):
    r = ask(client, "[[trip]]")
    tc = r.choices[0].message.tool_calls[0]
    assert tc.function.name == "plan_trip"
    args = json.loads(tc.function.arguments)
    assert args == {"stops": ["Paris", "Lyon"], "budget": 1200.5, "flexible": True,
                    "note": "window seat <near> the \"front\" & aisle,\nplease"}, args


@pytest.mark.parametrize("as_sdk_object", [False, True], ids=["dict", "sdk-message-object"])
def test_tool_round_trip(client, as_sdk_object):
    user = {"role": "user", "content": "[[weather]] What is the weather in Paris?"}
    r = client.chat.completions.create(model=MODEL_NAME, messages=[user], tools=TOOLS,
                                       max_tokens=200, extra_body=NO_THINK)
    msg = r.choices[0].message
    tc = msg.tool_calls[0]
    if as_sdk_object:
        # What most client code does: append the SDK's message object as it came back (its null
        # fields `refusal`, `audio`, `function_call`, ... included).
        assistant = msg
    else:
        assistant = {"role": "assistant", "content": msg.content or "",
                     "tool_calls": [{"id": tc.id, "type": "function",
                                     "function": {"name": tc.function.name,
                                                  "arguments": tc.function.arguments}}]}
    tool = {"role": "tool", "tool_call_id": tc.id, "content": "sunny"}
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=[user, assistant, tool],
                                        tools=TOOLS, max_tokens=64, extra_body=NO_THINK)
    c2 = r2.choices[0]
    assert c2.message.content == "It is sunny.", c2.message
    assert c2.finish_reason == "stop"
    assert not c2.message.tool_calls


def test_tool_call_streaming(client):
    ref = ask(client, "[[weather]]").choices[0].message.tool_calls[0]
    content, reasoning, calls, finish, firsts = reassemble(ask(client, "[[weather]]", stream=True))
    assert finish == ["tool_calls"]
    assert_no_markup(content)
    assert content.strip() == ""
    assert list(calls) == [0]
    first = firsts[0]
    assert first.id and first.type == "function", first
    assert first.function is not None and first.function.name == "get_weather", first
    call = calls[0]
    assert call["name"] == "get_weather", "the name must come whole, once, in the first delta"
    assert json.loads(call["arguments"]) == PARIS
    assert json.loads(call["arguments"]) == json.loads(ref.function.arguments)


def test_two_tool_calls_streaming(client):
    content, _, calls, finish, firsts = reassemble(ask(client, "[[two-calls]]", stream=True))
    assert finish == ["tool_calls"]
    assert_no_markup(content)
    assert sorted(calls) == [0, 1]
    assert calls[0]["id"] and calls[1]["id"] and calls[0]["id"] != calls[1]["id"]
    assert [json.loads(calls[i]["arguments"]) for i in (0, 1)] == [PARIS, {"city": "London", "days": 1}]


def test_tool_call_streaming_with_reasoning(client):
    content, reasoning, calls, finish, _ = reassemble(ask(client, "[[weather-think]]", think=True,
                                                          stream=True))
    assert finish == ["tool_calls"]
    assert reasoning == "I should call the tool."
    assert_no_markup(content)
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    assert json.loads(calls[0]["arguments"]) == PARIS


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_cut_by_max_tokens(client, stream):
    """A tool call cut off half-way is no tool call: a clean "length" finish, no crash."""
    r = ask(client, "[[weather]]", max_tokens=12, stream=stream)
    if stream:
        content, _, calls, finish, _ = reassemble(r)
        assert finish == ["length"]
        for call in calls.values():  # whatever was streamed must at least name the function
            assert call["name"] == "get_weather"
    else:
        c = r.choices[0]
        assert c.finish_reason == "length"
        assert r.usage.completion_tokens == 12


def test_unknown_tool_name_does_not_break(client):
    """The model calls a function that is not among the tools: any clean answer will do."""
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=200, extra_body=NO_THINK,
        tools=[TRIP], messages=[{"role": "user", "content": "[[weather]] weather?"}])
    assert r.choices[0].finish_reason in ("tool_calls", "stop")
