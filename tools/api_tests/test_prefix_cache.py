"""The prefix cache changes speed, never results: a conversation replayed against servers with the
cache on (the shared one; one snapshotting every 64 tokens) gives the same greedy tokens and the
same logprobs as a server with `--cache-mem 0`, while `cached_tokens` shows the cache was used."""

from __future__ import annotations

import pytest

from common import MODEL_NAME, NO_THINK, make_client

TOL = 2e-3  # logprob, absolute: the same math, only split into different prefill chunks

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(30))


def run_conversation(client):
    """Four requests that share prefixes; returns [((text, [(token, logprob, top-5 logprobs)]), usage)]."""
    out = []

    def ask(messages):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                           temperature=0, logprobs=True, top_logprobs=5,
                                           extra_body=NO_THINK)
        c = r.choices[0]
        lps = [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in c.logprobs.content]
        out.append(((c.message.content, lps), r.usage))
        return c.message.content

    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where do rivers go?"}]
    reply = ask(turn1)
    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "And where do they start?"}]
    ask(turn2)
    ask(turn2)  # the same request again: its whole prompt is cached
    # Shares only the system prompt with the others.
    ask([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a lake?"}])
    return out


def assert_same(ref, got, label):
    for i, (((ref_text, ref_lp), _), ((text, lp), _)) in enumerate(zip(ref, got)):
        assert text == ref_text, f"{label}, request {i}: greedy text differs from the uncached server"
        for j, (a, b) in enumerate(zip(ref_lp, lp)):
            assert a[0] == b[0], f"{label}, request {i}, token {j}: {a[0]!r} vs {b[0]!r}"
            assert b[1] == pytest.approx(a[1], abs=TOL), (label, i, j, a, b)
            assert b[2] == pytest.approx(a[2], abs=TOL), (label, i, j, a, b)


def test_cache_does_not_change_results(server, spawn_server):
    no_cache = spawn_server(["--cache-mem", "0"], name="no-cache")
    fine = spawn_server(["--snapshot-every", "64"], name="snapshot-64")
    results = {}
    for label, srv in [("no-cache", no_cache), ("shared", server), ("snapshot-64", fine)]:
        c = make_client(srv)
        results[label] = run_conversation(c)
        c.close()
    ref = results["no-cache"]
    assert all(u.prompt_tokens_details.cached_tokens == 0 for _, u in ref), \
        "--cache-mem 0 still reports cached tokens"
    for label in ("shared", "snapshot-64"):
        got = results[label]
        cached = [u.prompt_tokens_details.cached_tokens for _, u in got]
        prompts = [u.prompt_tokens for _, u in got]
        print(label, "cached", cached, "of", prompts)
        assert cached[2] > 0 and cached[2] <= prompts[2], (label, cached, prompts)
        assert_same(ref, got, label)
