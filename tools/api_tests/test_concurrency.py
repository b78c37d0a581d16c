"""Many clients at once, some hanging up mid-stream: every request ends (a full response or a clean
error, never a hang), the server keeps its books (/metrics balances and drains to zero), cancels the
work of clients that left, and still answers afterwards."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from common import MODEL_NAME, NO_THINK, make_client, settled_metrics

CLIENTS = 16
PER_REQUEST_TIMEOUT = 60


def _worker(client, i: int, barrier: threading.Barrier):
    """Returns (kind, outcome, detail)."""
    kind = ["chat", "chat-stream", "disconnect", "completion"][i % 4]
    if i % 8 == 7:
        kind = "disconnect"  # 6 of 16 streams hang up early
    barrier.wait(timeout=30)
    try:
        if kind == "chat":
            r = client.chat.completions.create(
                model=MODEL_NAME, max_tokens=16 + i, temperature=0.8, seed=i, extra_body=NO_THINK,
                messages=[{"role": "user", "content": f"client {i}: tell me something"}])
            c = r.choices[0]
            assert c.finish_reason in ("length", "stop"), c
            assert r.usage.completion_tokens <= 16 + i
            return kind, "ok", r.usage.completion_tokens
        if kind == "completion":
            r = client.completions.create(model=MODEL_NAME, prompt=f"client {i} says", max_tokens=16,
                                          temperature=0)
            assert r.choices[0].finish_reason in ("length", "stop")
            return kind, "ok", r.usage.completion_tokens
        if kind == "chat-stream":
            finish, usage = [], None
            for ch in client.chat.completions.create(
                    model=MODEL_NAME, max_tokens=24, temperature=0, stream=True, extra_body=NO_THINK,
                    stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": f"client {i}: stream please"}]):
                usage = ch.usage or usage
                finish += [c.finish_reason for c in ch.choices if c.finish_reason]
            assert len(finish) == 1 and usage is not None, (finish, usage)
            return kind, "ok", usage.completion_tokens
        # disconnect: a long scripted reply, abandoned after one or two chunks.
        stream = client.chat.completions.create(
            model=MODEL_NAME, max_tokens=1800, stream=True, extra_body=NO_THINK,
            messages=[{"role": "user", "content": f"[[long]] client {i}"}])
        n = 0
        for _ in stream:
            n += 1
            if n >= 1 + i % 2:
                break
        stream.close()
        return kind, "disconnected", n
    except (openai.RateLimitError, openai.InternalServerError) as e:
        if e.status_code in (429, 503):
            assert e.response.headers.get("retry-after"), "429/503 without Retry-After"
            return kind, f"rejected-{e.status_code}", None
        raise


def test_sixteen_clients_with_disconnects(server, http):
    before = settled_metrics(http)
    client = make_client(server, timeout=PER_REQUEST_TIMEOUT)
    barrier = threading.Barrier(CLIENTS)
    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        futs = [pool.submit(_worker, client, i, barrier) for i in range(CLIENTS)]
        results, failures = [], []
        for i, f in enumerate(futs):
            try:
                results.append(f.result(timeout=PER_REQUEST_TIMEOUT + 30))
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                failures.append(f"client {i}: {type(e).__name__}: {e}")
    elapsed = time.monotonic() - t0
    assert not failures, "\n".join(failures)
    kinds = [k for k, _, _ in results]
    outcomes = [o for _, o, _ in results]
    print(f"{CLIENTS} clients in {elapsed:.1f} s: {list(zip(kinds, outcomes))}")
    n_disc = outcomes.count("disconnected")
    assert n_disc >= 4, outcomes
    assert sum(o == "ok" for o in outcomes) >= CLIENTS // 3, f"most requests were rejected: {outcomes}"

    after = settled_metrics(http, timeout=30)
    assert after.get("lily_queue_depth") == 0, after.text
    assert after.get("lily_requests_running") == 0, "requests still running after 30 s:\n" + after.text
    recv, acc = after.balance()
    assert recv == acc, after.text

    def d(name, **labels):
        return after.get(name, **labels) - before.get(name, **labels)

    d_recv = d("lily_requests_received_total")
    d_fin = sum(after.outcome(o) - before.outcome(o) for o in ("ok", "cancelled", "error", "rejected"))
    assert d_recv == d_fin == CLIENTS, (d_recv, d_fin, after.text)
    d_cancel = after.outcome("cancelled") - before.outcome("cancelled")
    # A [[long]] reply is ~1500 tokens; clients hang up after one or two chunks, so the server must
    # notice and stop. (A disconnect that lost the race to the end of generation counts as "ok".)
    assert d_cancel >= 1, (
        f"{n_disc} streams were abandoned but no request finished as cancelled:\n{after.text}")
    client.close()

    # Still serving.
    c2 = make_client(server)
    r = c2.chat.completions.create(model=MODEL_NAME, max_tokens=32, extra_body=NO_THINK,
                                   messages=[{"role": "user", "content": "[[plain]] still there?"}])
    assert r.choices[0].message.content == "Just the answer: 4."
    c2.close()


def test_abandoned_stream_is_cancelled(server, http):
    before = settled_metrics(http)
    client = make_client(server, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=1800, stream=True, extra_body=NO_THINK,
        messages=[{"role": "user", "content": "[[long]] then hang up"}])
    got = 0
    for _ in stream:
        got += 1
        if got == 2:
            break
    stream.close()
    after = settled_metrics(http, timeout=15)
    assert after.get("lily_requests_running") == 0, "the abandoned request is still running:\n" + after.text
    assert after.outcome("cancelled") - before.outcome("cancelled") == 1, after.text
    generated = after.get("lily_generated_tokens_total") - before.get("lily_generated_tokens_total")
    assert generated < 1000, f"{generated} tokens generated for a client that left after 2 chunks"
    client.close()


def test_abandoned_non_streaming_request(server, http):
    """A non-streaming client that times out: the server should stop the work (reported as cancelled),
    and must in any case settle and keep the books balanced."""
    before = settled_metrics(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", timeout=httpx.Timeout(10, read=0.2),
                   headers={"Authorization": f"Bearer {server.args[server.args.index('--api-key') + 1]}"},
                   json={"model": MODEL_NAME, "max_tokens": 1800, **NO_THINK,
                         "messages": [{"role": "user", "content": "[[long]] non-streaming"}]})
    after = settled_metrics(http, timeout=20)
    assert after.get("lily_requests_running") == 0, after.text
    recv, acc = after.balance()
    assert recv == acc, after.text
    d_cancel = after.outcome("cancelled") - before.outcome("cancelled")
    d_ok = after.outcome("ok") - before.outcome("ok")
    assert d_cancel + d_ok == 1, after.text
    assert d_cancel == 1, "the server finished a reply nobody was waiting for (not cancelled)"
