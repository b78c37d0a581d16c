"""Structured outputs: `response_format` (json_object, json_schema), vLLM's `structured_outputs` /
`guided_*`, strict tool calls, on `/v1/chat/completions` and `/v1/completions`.

The checkpoint has random weights, so unconstrained output is noise: every valid answer here is the
constraint's doing. Answers are checked with a JSON Schema validator (jsonschema), never by eye.
"""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from typing import Literal

from common import MODEL_NAME, NO_THINK, check_error_body, metrics, reasoning_of

MAX_TOKENS = 1500

# ---- a seeded generator of bounded schemas ------------------------------------------------------


def gen_schema(seed: int) -> dict:
    """A random JSON schema whose every instance is bounded (strings and arrays have a maximum,
    objects `additionalProperties: false`), so noise under the constraint must end: nested objects,
    arrays, enums, const, integer / number bounds, booleans, optional fields, `$defs` + `$ref`,
    `anyOf`, nullable types."""
    rng = random.Random(seed)
    defs: dict = {}

    def leaf() -> dict:
        k = rng.choice(["string", "integer", "number", "boolean", "enum", "const", "null_or"])
        if k == "string":
            s = {"type": "string", "maxLength": rng.randint(0, 10)}
            if rng.random() < 0.3:
                s["minLength"] = rng.randint(0, s["maxLength"])
            return s
        if k == "integer":
            lo = rng.randint(-1000, 1000)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
        if k == "number":
            lo = rng.uniform(-100, 100)
            return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0.5, 500), 2)}
        if k == "boolean":
            return {"type": "boolean"}
        if k == "enum":
            pool = ["red", "green", "blue", "a b", "ü", "x\"y", 1, 2.5, True, None]
            return {"enum": rng.sample(pool, rng.randint(1, 4))}
        if k == "const":
            return {"const": rng.choice(["fixed", 7, False])}
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}

    def node(depth: int) -> dict:
        r = rng.random()
        if depth >= 3 or r < 0.45:
            return leaf()
        if r < 0.65:
            return obj(depth + 1)
        if r < 0.8:
            hi = rng.randint(0, 3)
            return {"type": "array", "items": node(depth + 1), "maxItems": hi,
                    **({"minItems": 1} if hi > 0 and rng.random() < 0.3 else {})}
        if r < 0.9:
            return {"anyOf": [node(depth + 1), node(depth + 1)]}
        name = f"D{len(defs)}"
        defs[name] = None  # reserved: a def never refers to itself (no infinite instances)
        defs[name] = obj(depth + 1)
        return {"$ref": f"#/$defs/{name}"}

    def obj(depth: int) -> dict:
        props = {f"k{i}_{rng.choice('abcxyz')}": node(depth) for i in range(rng.randint(1, 4))}
        req = [k for k in props if rng.random() < 0.6]
        return {"type": "object", "properties": props, "required": req, "additionalProperties": False}

    root = obj(0)
    if defs:
        root["$defs"] = defs
    return root


SCHEMAS = [gen_schema(i) for i in range(50)]


def chat_json(client, schema, content="Give me data.", **kw):
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        temperature=kw.pop("temperature", 0.8),
        seed=kw.pop("seed", 1),
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        extra_body=kw.pop("extra_body", NO_THINK),
        **kw,
    )


# ---- response_format ---------------------------------------------------------------------------


def test_fifty_generated_schemas_all_valid(client):
    valid, problems = 0, []
    for i, schema in enumerate(SCHEMAS):
        jsonschema.Draft202012Validator.check_schema(schema)
        r = chat_json(client, schema, seed=i)
        c = r.choices[0]
        try:
            assert c.finish_reason == "stop", f"finish_reason {c.finish_reason}"
            v = json.loads(c.message.content)
            jsonschema.validate(v, schema)
            valid += 1
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            problems.append(f"schema {i}: {e}\n  schema: {json.dumps(schema)}\n  answer: {c.message.content!r}")
    print(f"structured outputs: {valid}/50 answers valid")
    assert valid == 50, "\n".join(problems)


def test_unconstrained_output_is_not_json(client):
    """The control: without the constraint the same model does not make JSON."""
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Give me data."}],
                                       max_tokens=40, temperature=0, extra_body=NO_THINK)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


class Item(BaseModel):
    name: str = Field(max_length=12)
    qty: int = Field(ge=0, le=1000)
    kind: Literal["tool", "food", "toy"]


class Order(BaseModel):
    customer: str = Field(max_length=20)
    items: list[Item] = Field(max_length=3)
    rush: bool
    note: str | None = Field(max_length=8)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "An order, please."}],
        response_format=Order, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, extra_body=NO_THINK)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Order), msg
    assert len(msg.parsed.items) <= 3 and all(0 <= it.qty <= 1000 for it in msg.parsed.items)
    assert msg.parsed.model_dump() == json.loads(msg.content)


@pytest.mark.parametrize("seed", range(5))
def test_json_object_answers_are_objects(client, seed):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "JSON please."}], max_tokens=400,
        temperature=1.0, seed=seed, response_format={"type": "json_object"}, extra_body=NO_THINK)
    c = r.choices[0]
    if c.finish_reason == "length":
        # Any object may be long (unbounded strings): cut, it is still the start of an object.
        assert c.message.content.startswith("{")
        return
    assert c.finish_reason == "stop"
    assert isinstance(json.loads(c.message.content), dict), c.message.content


def test_streaming_equals_non_streaming(client):
    schema = SCHEMAS[3]
    base = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Stream data."}], max_tokens=MAX_TOKENS,
                temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                extra_body=NO_THINK)
    whole = client.chat.completions.create(**base)
    chunks = list(client.chat.completions.create(stream=True, **base))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), schema)


def test_long_schema_cut_by_max_tokens_says_length(client):
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999},
                                                      "minItems": 500, "maxItems": 1000}},
              "required": ["xs"], "additionalProperties": False}
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Many numbers."}], max_tokens=30, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": schema}},
            extra_body=NO_THINK, stream=stream)
        if stream:
            chunks = [ch for ch in r if ch.choices]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "length"
        assert text.startswith('{"xs":[') and r is not None


def test_thinking_stays_free_then_json(client):
    """Thinking on: the constraint starts after `</think>` (and the blank line the template puts
    there). The reasoning here is forced by the server's test script (`[[json-think]]`: "plan it"
    then `</think>`, and the model goes on): a random model rarely closes its reasoning by itself,
    which would leave nothing to check but a cut reasoning."""
    schema = SCHEMAS[7]
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "[[json-think]] data"}], max_tokens=MAX_TOKENS,
            temperature=0.7, seed=2, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
            stream=stream)
        if stream:
            chunks = [ch for ch in r if ch.choices]
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            reasoning = "".join(reasoning_of(ch.choices[0].delta) or "" for ch in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            content, reasoning = r.choices[0].message.content, reasoning_of(r.choices[0].message)
            finish = r.choices[0].finish_reason
        assert reasoning == "plan it"
        assert finish == "stop"
        jsonschema.validate(json.loads(content), schema)


def test_thinking_unclosed_is_free_text(client):
    """Thinking on, and the random model never closes its reasoning within max_tokens: no
    constraint applied yet, so the answer is cut reasoning with a length finish (not an error)."""
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "think freely"}], max_tokens=20, temperature=0,
        response_format={"type": "json_object"})
    c = r.choices[0]
    if "</think>" in (reasoning_of(c.message) or ""):
        pytest.skip("the random model closed its reasoning")
    assert c.finish_reason == "length"


# ---- vLLM's fields -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_vllm_choice_and_regex(client, seed):
    choices = ["alpha", "beta gamma", "δ"]
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "pick"}], max_tokens=50,
                                       temperature=1.0, seed=seed,
                                       extra_body={"structured_outputs": {"choice": choices}, **NO_THINK})
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "code"}], max_tokens=50,
                                       temperature=1.0, seed=seed,
                                       extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2,4}"}, **NO_THINK})
    import re
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", r.choices[0].message.content), r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "pick"}], max_tokens=50,
                                       temperature=1.0, seed=seed, extra_body={"guided_choice": ["yes", "no"], **NO_THINK})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "g"}], max_tokens=50,
                                       temperature=1.0, seed=seed,
                                       extra_body={"structured_outputs": {"grammar": 'start: "<" W ">"\nW: /[xyz]{1,3}/'}, **NO_THINK})
    assert re.fullmatch(r"<[xyz]{1,3}>", r.choices[0].message.content)


# ---- strict tool calls -------------------------------------------------------------------------

SEARCH = {"type": "function", "function": {"name": "search", "strict": True, "parameters": {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 24}, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                   "lang": {"type": "string", "enum": ["en", "fr", "de"]},
                   "filters": {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                                            "exact": {"type": "boolean"}},
                               "required": ["year", "exact"], "additionalProperties": False},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
    "required": ["query", "limit", "lang", "filters"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book", "strict": True, "parameters": {
    "type": "object", "properties": {"seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "price": {"type": "number", "minimum": 0, "maximum": 500}},
    "required": ["seats", "price"], "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (SEARCH, BOOK)}


def check_calls(msg, finish):
    assert finish == "tool_calls", (finish, msg)
    assert len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMA_OF[call.function.name])
    return call.function.name


@pytest.mark.parametrize("think", [False, True])
def test_strict_tool_calls_required_and_named(client, think):
    names = set()
    kw = {} if think else {"extra_body": NO_THINK}
    # With thinking on the call follows the reasoning; the script closes it ([[json-think]]).
    content = "[[json-think]] find it" if think else "find it"
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                           tools=[SEARCH, BOOK], tool_choice="required", max_tokens=MAX_TOKENS,
                                           temperature=1.0, seed=seed, **kw)
        names.add(check_calls(r.choices[0].message, r.choices[0].finish_reason))
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                           tools=[SEARCH, BOOK], tool_choice={"type": "function", "function": {"name": "book"}},
                                           max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, **kw)
        assert check_calls(r.choices[0].message, r.choices[0].finish_reason) == "book"
    assert names == {"search", "book"}, names


def test_strict_tool_call_streams_the_same(client):
    base = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "find"}], tools=[SEARCH],
                tool_choice="required", max_tokens=MAX_TOKENS, temperature=0, extra_body=NO_THINK)
    whole = client.chat.completions.create(**base)
    check_calls(whole.choices[0].message, whole.choices[0].finish_reason)
    args, name = "", None
    for ch in client.chat.completions.create(stream=True, **base):
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
    assert name == "search"
    assert json.loads(args) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_pydantic_function_tool(client):
    class Lookup(BaseModel):
        term: str = Field(max_length=10)
        page: int = Field(ge=1, le=9)
        fuzzy: bool

    tool = openai.pydantic_function_tool(Lookup)
    assert tool["function"]["strict"] is True
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "look"}], tools=[tool],
                                       tool_choice="required", max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                       extra_body=NO_THINK)
    call = r.choices[0].message.tool_calls[0]
    Lookup.model_validate_json(call.function.arguments)


# ---- errors ------------------------------------------------------------------------------------


def bad(http, body, path="/v1/chat/completions"):
    body = {"model": MODEL_NAME, **body}
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "x"}])
    else:
        body.setdefault("prompt", "x")
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    return check_error_body(r.json())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_errors_name_the_problem(http, path):
    e = bad(http, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}, path)
    assert e["param"] == "response_format" and "no-such-type" in e["message"], e
    e = bad(http, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such-format-xyz"}}}}, path)
    assert "no-such-format-xyz" in e["message"] or "format" in e["message"], e
    e = bad(http, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, path)
    assert "schema" in e["message"]
    e = bad(http, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, path)
    assert "`response_format`" in e["message"] and "`guided_regex`" in e["message"], e
    e = bad(http, {"structured_outputs": {"regex": "(unclosed"}}, path)
    assert e["param"] == "structured_outputs", e
    e = bad(http, {"structured_outputs": {"choice": ["a"], "regex": "b"}}, path)
    assert "exactly one" in e["message"]


def test_unsupported_keyword_is_a_400(http):
    # A keyword llguidance does not implement: refused, named, never silently ignored.
    e = bad(http, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "dependentSchemas": {"a": {"required": ["b"]}}}}}})
    assert "dependentSchemas" in e["message"], e


def test_bad_requests_are_counted_and_compiles_recorded(http):
    schema = {"type": "object", "properties": {"z": {"type": "boolean"}}, "required": ["z"], "additionalProperties": False}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 20, **NO_THINK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}}
    before = metrics(http)
    for _ in range(2):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"])["z"] in (True, False)
    after = metrics(http)
    got = lambda m, c: m.get("lily_grammar_compile_seconds_count", cache=c)
    assert got(after, "cached") - got(before, "cached") >= 1


# ---- /v1/completions ---------------------------------------------------------------------------


def test_completions_structured(client):
    ok = 0
    for i, schema in enumerate(SCHEMAS[:10]):
        r = client.completions.create(model=MODEL_NAME, prompt="Data:", max_tokens=MAX_TOKENS, temperature=0.8, seed=i,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)
        ok += 1
    assert ok == 10
    r = client.completions.create(model=MODEL_NAME, prompt="Pick:", max_tokens=20, temperature=1.0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(model=MODEL_NAME, prompt="Obj:", max_tokens=300, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    # Streaming equals non-streaming.
    body = dict(model=MODEL_NAME, prompt="Data:", max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[1]}}})
    whole = client.completions.create(**body).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **body) if ch.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMAS[1])


# ---- the other dialects: Responses `text.format`, Anthropic `output_config.format` --------------


def test_responses_text_format(client):
    schema = SCHEMAS[11]
    r = client.responses.create(model=MODEL_NAME, input="data", reasoning={"effort": "none"}, max_output_tokens=MAX_TOKENS,
                                temperature=0.8, store=False,
                                text={"format": {"type": "json_schema", "name": "d", "schema": schema, "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)


def test_anthropic_output_config_format(server):
    import anthropic
    from common import API_KEY
    schema = SCHEMAS[12]
    ac = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    m = ac.messages.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "data"}],
                           extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError, match="output_config"):
        ac.messages.create(model=MODEL_NAME, max_tokens=20, messages=[{"role": "user", "content": "x"}],
                           extra_body={"output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}})
    ac.close()
