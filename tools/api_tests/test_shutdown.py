"""SIGTERM while generations are in flight: the server stops promptly and cleanly, the streaming
client's stream ends (no hang), a queued client gets an answer, and nothing panics."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai

from common import MODEL_NAME, NO_THINK, make_client


def test_sigterm_with_requests_in_flight(spawn_server):
    srv = spawn_server(name="shutdown-server")
    client = make_client(srv, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=1800, stream=True, extra_body=NO_THINK,
        messages=[{"role": "user", "content": "[[long]] running when the server stops"}])
    chunks = iter(stream)
    next(chunks)

    queued = {}

    def waiting_client():
        try:
            r = client.chat.completions.create(
                model=MODEL_NAME, max_tokens=1800, extra_body=NO_THINK,
                messages=[{"role": "user", "content": "[[long]] queued when the server stops"}])
            queued["result"] = f"200 finish={r.choices[0].finish_reason}"
        except openai.APIStatusError as e:
            queued["result"] = f"{e.status_code} {e.message}"
        except Exception as e:  # noqa: BLE001
            queued["result"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=waiting_client, daemon=True)
    t.start()
    time.sleep(0.2)  # let it reach the queue

    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    ended = "finished"
    try:
        for _ in chunks:
            pass
    except Exception as e:  # noqa: BLE001 - an error event or a closed connection both end it
        ended = f"{type(e).__name__}: {e}"
    stream_s = time.monotonic() - t0
    rc = srv.proc.wait(timeout=20)
    exit_s = time.monotonic() - t0
    t.join(timeout=20)
    print(f"stream ended after {stream_s:.2f} s ({ended}); queued client: {queued.get('result')}; "
          f"exit {rc} after {exit_s:.2f} s")
    assert not t.is_alive(), "the queued client still waits after the server exited"
    assert rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM), srv.tail()
    assert exit_s < 10, f"shutdown took {exit_s:.1f} s"
    assert "panicked" not in srv.log(), srv.tail()
    assert queued["result"].startswith("503") or "Connection" in queued["result"], queued
    client.close()
    try:
        httpx.get(srv.url + "/health", timeout=2)
        raise AssertionError("the server still answers after it exited")
    except httpx.TransportError:
        pass
