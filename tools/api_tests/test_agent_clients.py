"""Real agent clients against `lily serve` (issue 16): the OpenAI Agents SDK (`openai-agents`) on its
default Responses model and on its chat-completions model, and LangChain's `ChatOpenAI`
(`langchain-openai`). Scripted replies come from the test script (common.SCRIPT): `[[plain]]` is a
text reply, `[[weather]]` a get_weather call, and a prompt with a tool result in it is answered
"It is sunny.", so an agent loop (call, run the tool, send the result back, final answer) is
deterministic."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_default_openai_client, set_tracing_disabled)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from common import API_KEY, MODEL_NAME, NO_THINK

PARIS = {"city": "Paris", "days": 3}

set_tracing_disabled(True)  # no trace export to api.openai.com


# ---- OpenAI Agents SDK ------------------------------------------------------------------------------


def _agent_run(srv, make_agent, prompt, streamed=False):
    """Runs an agent in a fresh event loop with lily as the SDK's default client; returns
    (final_output, the RunResult)."""

    async def go():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        set_default_openai_client(client, use_for_tracing=False)
        try:
            agent = make_agent(client)
            if streamed:
                res = Runner.run_streamed(agent, prompt, max_turns=4)
                deltas = []
                async for ev in res.stream_events():
                    if ev.type == "raw_response_event" and getattr(ev.data, "type", "") == \
                            "response.output_text.delta":
                        deltas.append(ev.data.delta)
                return res.final_output, res, "".join(deltas)
            res = await Runner.run(agent, prompt, max_turns=4)
            return res.final_output, res, None
        finally:
            await client.close()

    return asyncio.run(go())


RESPONSES_SETTINGS = ModelSettings(reasoning={"effort": "none"}, max_tokens=200)
CHAT_SETTINGS = ModelSettings(extra_body=NO_THINK, max_tokens=200)


def _model(api, client):
    """The Agent's `model`: a name (the SDK's default, the Responses API through the default
    client) or an explicit chat-completions model."""
    if api == "responses":
        return MODEL_NAME
    return OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client)


def _settings(api):
    return RESPONSES_SETTINGS if api == "responses" else CHAT_SETTINGS


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_text(server, api):
    out, res, _ = _agent_run(server, lambda c: Agent(name="Helper", instructions="Be brief.",
                                                     model=_model(api, c), model_settings=_settings(api)),
                             "[[plain]] What is 2+2?")
    assert out == "Just the answer: 4."
    assert len(res.raw_responses) == 1
    assert res.raw_responses[0].usage.output_tokens > 0


def test_agents_sdk_streamed(server):
    out, res, deltas = _agent_run(server, lambda c: Agent(name="Helper", instructions="Be brief.",
                                                          model=MODEL_NAME, model_settings=RESPONSES_SETTINGS),
                                  "[[plain]] What is 2+2?", streamed=True)
    assert out == deltas == "Just the answer: 4."


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_function_tool(server, api):
    calls = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        calls.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    out, res, _ = _agent_run(server, lambda c: Agent(name="Weather", instructions="Use the tools.",
                                                     tools=[get_weather], model=_model(api, c),
                                                     model_settings=_settings(api)),
                             "[[weather]] What is the weather in Paris?")
    assert calls == [PARIS], "the SDK must run the tool once with the parsed, typed arguments"
    assert out == "It is sunny."
    assert len(res.raw_responses) == 2  # the call, then the answer to the tool's result
    kinds = [i.type for i in res.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds


# ---- LangChain ChatOpenAI -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(server):
    return ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model=MODEL_NAME, max_retries=0,
                      timeout=60, max_tokens=200, extra_body=NO_THINK)


def test_langchain_invoke(chat):
    m = chat.invoke("[[plain]] What is 2+2?")
    assert isinstance(m, AIMessage) and m.content == "Just the answer: 4."
    assert m.response_metadata.get("finish_reason") == "stop"
    assert m.usage_metadata and m.usage_metadata["output_tokens"] > 0


def test_langchain_stream(chat):
    chunks = list(chat.stream("[[unicode]] hi"))
    assert len(chunks) > 1
    text = "".join(c.content for c in chunks)
    assert text == chat.invoke("[[unicode]] hi").content
    assert "世界" in text


def test_langchain_two_system_messages(chat):
    m = chat.invoke([("system", "First rule."), ("system", "Second rule."),
                     ("human", "[[two-systems]] go")])
    assert m.content == "Two systems, one block."


def test_langchain_bind_tools(chat):
    @tool
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        return f"sunny in {city}"

    llm = chat.bind_tools([get_weather])
    q = HumanMessage("[[weather]] What is the weather in Paris?")
    m = llm.invoke([q])
    assert len(m.tool_calls) == 1, m
    tc = m.tool_calls[0]
    assert tc["name"] == "get_weather" and tc["args"] == PARIS and tc["id"]
    assert m.response_metadata.get("finish_reason") == "tool_calls"
    result = get_weather.invoke(tc)
    assert isinstance(result, ToolMessage) and result.tool_call_id == tc["id"]
    final = llm.invoke([q, m, result])
    assert final.content == "It is sunny." and not final.tool_calls

    # Streamed: the call's chunks add up to the same call.
    acc = None
    for ch in llm.stream([q]):
        acc = ch if acc is None else acc + ch
    assert [(c["name"], c["args"]) for c in acc.tool_calls] == [("get_weather", PARIS)]
