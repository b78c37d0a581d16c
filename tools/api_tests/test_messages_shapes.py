"""The messages real clients send (issue 16): several system messages, leading or in the middle,
`name` fields, content parts, and the fields OpenAI clients add. The scripted replies fire only when
the prompt renders as intended (the triggers in common.SCRIPT include the rendered turns)."""

from __future__ import annotations

import openai
import pytest

from common import MODEL_NAME, NO_THINK


def test_langchain_two_system_messages(client):
    """langchain-openai's `[("system", a), ("system", b), ("human", q)]`: one system block."""
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=32, extra_body=NO_THINK,
        messages=[{"role": "system", "content": "First rule."},
                  {"role": "system", "content": "Second rule."},
                  {"role": "user", "content": "[[two-systems]] q"}])
    assert r.choices[0].message.content == "Two systems, one block."


@pytest.mark.parametrize("stream", [False, True])
def test_system_message_in_the_middle(client, stream):
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "hello", "name": "ann"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
            {"role": "system", "content": [{"type": "text", "text": "Mid rule."}]},
            {"role": "user", "content": [{"type": "text", "text": "[[mid-system]] "}, {"type": "text", "text": "go"}]}]
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=32, messages=msgs, stream=stream,
        parallel_tool_calls=False, user="u-1", metadata={"k": "v"}, store=False, service_tier="auto",
        extra_body=NO_THINK)
    text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
    assert text == "Folded into the user turn."


def test_system_message_last(client):
    """A system message after the last user message: served, not a 400."""
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=4, extra_body=NO_THINK,
        messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "late system prompt"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_template_error_says_things_once(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                       messages=[{"role": "system", "content": "only a system prompt"}])
    msg = ei.value.body["message"] if isinstance(ei.value.body, dict) and "message" in ei.value.body \
        else ei.value.response.json()["error"]["message"]
    assert msg.count("chat template") == 1, msg
    assert "No user query" in msg, msg
