"""A full queue: with `--queue 1`, a burst of requests gets some 429/503 answers with Retry-After
and an OpenAI-shaped error body, never a hang; the rest complete, and /metrics counts the rejects.
Runs its own server (the shared one has a deep queue)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from common import API_KEY, MODEL_NAME, NO_THINK, settled_metrics

BURST = 8


def test_full_queue_rejects_with_retry_after(small_queue_server):
    srv = small_queue_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    barrier = threading.Barrier(BURST)

    def one(i):
        barrier.wait(timeout=30)
        return httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=60,
                          json={"model": MODEL_NAME, "max_tokens": 300, **NO_THINK,
                                "messages": [{"role": "user", "content": f"[[long]] burst {i}"}]})

    with httpx.Client(base_url=srv.url, headers=headers, timeout=30) as http:
        before = settled_metrics(http)
        with ThreadPoolExecutor(BURST) as pool:
            responses = list(pool.map(one, range(BURST), timeout=120))
        statuses = [r.status_code for r in responses]
        rejected = [r for r in responses if r.status_code in (429, 503)]
        assert all(s in (200, 429, 503) for s in statuses), statuses
        assert rejected, f"{BURST} simultaneous requests with --queue 1 and none rejected: {statuses}"
        assert any(s == 200 for s in statuses), statuses
        for r in rejected:
            assert r.headers.get("retry-after"), f"{r.status_code} without Retry-After: {r.headers}"
            e = r.json()["error"]
            assert e["message"] and "type" in e and "code" in e, e
        for r in responses:
            if r.status_code == 200:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        after = settled_metrics(http)
        recv, acc = after.balance()
        assert recv == acc, after.text
        assert after.outcome("rejected") - before.outcome("rejected") == len(rejected), after.text
        assert after.outcome("ok") - before.outcome("ok") == BURST - len(rejected), after.text
        # And it serves again once the burst is over.
        r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 32, **NO_THINK,
                      "messages": [{"role": "user", "content": "[[plain]] after the burst"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Just the answer: 4."
