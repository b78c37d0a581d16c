#!/usr/bin/env python3
"""Time to first token and decode tokens/s through `lily serve` (HTTP, streaming), as an agent
sees them: POST /v1/completions with a prompt of token ids, `stream: true`, usage included.

    scripts/serve-bench.py --url http://127.0.0.1:8000 --prompt 4096 --tokens 128 --rounds 2

Each request gets a fresh prompt (the ids of the bench contract, offset per request, so the prefix
cache never serves it); greedy (`temperature: 0`) and the checkpoint's default sampling (no
sampling fields) alternate, `--rounds` times each. TTFT = first streamed token after the request
was sent; decode tok/s = (completion tokens - 1) / (last token - first token). Standard library
only (runs on the device image as is).
"""
import argparse
import http.client
import json
import statistics
import sys
import time
import urllib.parse


def prompt_ids(n, vocab, offset):
    # The bench contract's synthetic ids ((i · 2654435761 mod 2^32) mod vocab), shifted per request.
    return [((i + offset) * 2654435761 % (1 << 32)) % vocab for i in range(n)]


def one(url, body):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    data = json.dumps(body)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"serve-bench: HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        ev = json.loads(payload)
        if ev.get("usage"):
            usage = ev["usage"]
        if any(c.get("text") for c in ev.get("choices", [])):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
    conn.close()
    if first is None or usage is None:
        sys.exit("serve-bench: the stream carried no tokens or no usage")
    n = usage["completion_tokens"]
    return first - t0, (n - 1) / (last - first) if n > 1 and last > first else float("nan"), n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=248077, help="ids below the padding rows")
    a = ap.parse_args()
    modes = [("greedy", {"temperature": 0}), ("default sampling", {})]
    res = {m: [] for m, _ in modes}
    k = 0
    for r in range(a.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for name, extra in order:
            k += 1
            body = {"prompt": prompt_ids(a.prompt, a.vocab, 7919 * k), "max_tokens": a.tokens, "stream": True, "stream_options": {"include_usage": True}}
            body.update(extra)
            ttft, tps, n = one(a.url, body)
            res[name].append((ttft, tps))
            print(f"round {r + 1} {name:<17} prompt {a.prompt} ttft {ttft * 1e3:8.1f} ms  decode {tps:7.1f} tok/s ({n} tokens)", flush=True)
    for name, rows in res.items():
        print(f"median {name:<17} ttft {statistics.median(t for t, _ in rows) * 1e3:8.1f} ms  decode {statistics.median(s for _, s in rows):7.1f} tok/s")


if __name__ == "__main__":
    main()
