#!/usr/bin/env python3
"""Time to first token of a chained Responses turn (`previous_response_id`) against the same
conversation resent in full, through `lily serve` and the OpenAI SDK of the API tests' venv:

    PY=$(scripts/api-setup | tail -n1)
    "$PY" scripts/responses-chain.py --url http://127.0.0.1:8000 [--api-key K] [--facts 150]

Turn 1 sends a long document and a question; turn 2 asks another question, in one session chained
by `previous_response_id`, in another with the whole conversation (turn 1's output items
included) as `input`. Both should find turn 1's prompt in the prefix cache: `cached` is
`usage.input_tokens_details.cached_tokens`. Run it against a server with `--cache-mem 0` to see
the uncached cost. TTFT = first streamed text or reasoning delta after the request was sent.
"""
import argparse
import time

import openai


def turn(client, **kw):
    t0, ttft, final = time.perf_counter(), None, None
    for e in client.responses.create(model="lily", stream=True, reasoning={"effort": "none"},
                                     max_output_tokens=8, temperature=0, **kw):
        if ttft is None and e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            ttft = time.perf_counter() - t0
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    u = final.usage
    return final, f"TTFT {ttft * 1000:7.0f} ms, input {u.input_tokens}, cached {u.input_tokens_details.cached_tokens}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--facts", type=int, default=150, help="length of the document (about 19 tokens a fact)")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.url + "/v1", api_key=a.api_key, max_retries=0, timeout=3600)
    doc = " ".join(f"Fact {i}: the value of item {i} is {i * 7 % 101}." for i in range(a.facts))
    q2 = "Question 2: what is item 4?"
    # Two sessions, each with a nonce that keeps other prompts out of the cache: turn 2 of each
    # finds only its own turn 1 cached.
    for how in ("chained", "resent in full"):
        q1 = f"[{time.time_ns()}] {doc}\nQuestion 1: what is item 3?"
        first, s = turn(client, input=q1)
        print(f"turn 1                  {s}")
        if how == "chained":
            _, s = turn(client, input=q2, previous_response_id=first.id, store=False)
        else:
            full = [{"role": "user", "content": q1}] + [o.model_dump(exclude_none=True) for o in first.output] \
                + [{"role": "user", "content": q2}]
            _, s = turn(client, input=full, store=False)
        print(f"turn 2, {how:<15} {s}")

if __name__ == "__main__":
    main()
