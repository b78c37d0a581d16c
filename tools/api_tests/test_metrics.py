"""GET /metrics: the Prometheus names the contract lists, and counters that move by exactly what a
request did."""

from __future__ import annotations

import httpx
import openai
import pytest

from common import MODEL_NAME, NO_THINK, metrics, settled_metrics

REQUIRED = [
    "lily_requests_received_total", "lily_requests_finished_total", "lily_queue_depth",
    "lily_requests_running", "lily_prompt_tokens_total", "lily_generated_tokens_total",
    "lily_time_to_first_token_seconds_sum", "lily_time_to_first_token_seconds_count",
    "lily_prefill_tokens_per_second", "lily_decode_tokens_per_second",
    "lily_prefix_cache_hits_total", "lily_prefix_cache_misses_total",
]


def test_metrics_names_and_format(http):
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    m = metrics(http)
    missing = [n for n in REQUIRED if n not in m.names()]
    assert not missing, f"missing from /metrics: {missing}\n{r.text}"
    assert "# TYPE lily_time_to_first_token_seconds summary" in r.text
    for outcome in ("ok", "cancelled", "error", "rejected"):
        assert f'outcome="{outcome}"' in r.text, f"no finished_total sample for outcome={outcome}"


def test_metrics_balance_at_rest(http):
    m = settled_metrics(http)
    recv, acc = m.balance()
    assert recv == acc, m.text
    assert m.get("lily_queue_depth") == 0 and m.get("lily_requests_running") == 0


def test_counters_follow_a_request(client, http):
    before = settled_metrics(http)
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=5, temperature=0,
                                       extra_body=NO_THINK,
                                       messages=[{"role": "user", "content": "Count to ten."}])
    after = settled_metrics(http)

    def d(name, **labels):
        return after.get(name, **labels) - before.get(name, **labels)

    assert d("lily_requests_received_total") == 1
    assert d("lily_requests_finished_total", outcome="ok") == 1
    assert d("lily_prompt_tokens_total") == r.usage.prompt_tokens
    assert d("lily_generated_tokens_total") == r.usage.completion_tokens == 5
    assert d("lily_time_to_first_token_seconds_count") == 1
    assert d("lily_time_to_first_token_seconds_sum") > 0
    assert d("lily_prefix_cache_hits_total") + d("lily_prefix_cache_misses_total") >= 1
    assert after.get("lily_decode_tokens_per_second") >= 0
    assert after.get("lily_prefill_tokens_per_second") >= 0


def test_failed_requests_keep_the_balance(client, http):
    before = settled_metrics(http)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                       messages=[{"role": "user", "content": "word " * 5000}])
    r = http.post("/v1/chat/completions", content=b"{bad json")
    assert r.status_code == 400
    after = settled_metrics(http)
    recv, acc = after.balance()
    assert recv == acc, after.text
    assert after.outcome("ok") == before.outcome("ok")


def test_metrics_needs_key(server):
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
