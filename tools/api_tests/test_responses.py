"""POST /v1/responses (OpenAI's Responses API) through the official `openai` SDK: output items,
usage, streaming events, a function-call round trip, reasoning items and `previous_response_id`.
The same engine path as /v1/chat/completions runs underneath; scripted replies come from the test
script (common.SCRIPT)."""

from __future__ import annotations

import json

import openai
import pytest

from common import MODEL_NAME

NO_REASONING = {"effort": "none"}
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]},
}
PARIS = {"city": "Paris", "days": 3}


def test_create_text(client):
    r = client.responses.create(model=MODEL_NAME, input="[[plain]] 2+2?", instructions="Be brief.",
                                reasoning=NO_REASONING, max_output_tokens=64, store=False)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "Just the answer: 4."
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief."


def test_items_input_and_incomplete(client):
    r = client.responses.create(
        model=MODEL_NAME, max_output_tokens=5, reasoning=NO_REASONING, temperature=0, store=False,
        input=[{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_reasoning_item(client):
    r = client.responses.create(model=MODEL_NAME, input="[[think-open]] 2+2?", reasoning={"effort": "high"},
                                max_output_tokens=64, store=False)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "plan it"
    assert r.output_text == "The answer is 4."
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_stream(client):
    ref = client.responses.create(model=MODEL_NAME, input="[[unicode]] hi", reasoning=NO_REASONING, store=False)
    with client.responses.stream(model=MODEL_NAME, input="[[unicode]] hi", reasoning=NO_REASONING,
                                 store=False) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == ref.output_text == final.output_text
    assert final.status == "completed" and final.usage.output_tokens == ref.usage.output_tokens


def test_stream_event_order(client):
    events = list(client.responses.create(model=MODEL_NAME, input="[[think-open]] q", stream=True,
                                          reasoning={"effort": "low"}, store=False))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    want = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
            "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    dedup = [t for i, t in enumerate(types[2:-1]) if i == 0 or t != types[2:-1][i - 1]]
    assert dedup == want, types


@pytest.mark.parametrize("chain", [False, True], ids=["items", "previous_response_id"])
def test_function_call_round_trip(client, chain):
    first = client.responses.create(model=MODEL_NAME, input="[[weather]] Weather in Paris?", tools=[WEATHER],
                                    reasoning=NO_REASONING, max_output_tokens=200, store=chain)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == PARIS
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
    if chain:
        second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=[result],
                                         tools=[WEATHER], reasoning=NO_REASONING, max_output_tokens=64)
    else:
        items = [{"role": "user", "content": "[[weather]] Weather in Paris?"}] + \
            [o.model_dump(exclude_none=True) for o in first.output] + [result]
        second = client.responses.create(model=MODEL_NAME, input=items, tools=[WEATHER],
                                         reasoning=NO_REASONING, max_output_tokens=64, store=False)
    assert second.output_text == "It is sunny."


def test_function_call_streaming(client):
    with client.responses.stream(model=MODEL_NAME, input="[[weather]] Weather?", tools=[WEATHER],
                                 reasoning=NO_REASONING, max_output_tokens=200, store=False) as s:
        args = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    call = [o for o in final.output if o.type == "function_call"][0]
    assert json.loads(args) == json.loads(call.arguments) == PARIS


def test_previous_response_id_reuses_the_prompt(client):
    first = client.responses.create(model=MODEL_NAME, input="[[plain]] 2+2?", reasoning=NO_REASONING,
                                    max_output_tokens=64)
    assert first.output_text == "Just the answer: 4."
    second = client.responses.create(model=MODEL_NAME, input="[[chained]] and again?", previous_response_id=first.id,
                                     reasoning=NO_REASONING, max_output_tokens=64)
    assert second.output_text == "Chained: 4 again."
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0, "the chained turn must reuse the cached prefix"


def test_errors(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_nope")
    assert ei.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input=[])
