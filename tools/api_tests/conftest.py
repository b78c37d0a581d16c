"""Fixtures of the black-box API tests: `lily serve` on a tiny synthetic checkpoint, driven through the
official OpenAI Python SDK (and raw httpx where the SDK would hide what is on the wire).

Nothing is built here. The binary is $LILY_BIN (default <repo>/target/release/lily); `scripts/test`
builds it first. Once per session a tiny model is synthesized into a temporary directory, a test
script (`--test-script`) is written, and one server is started on a free port with an API key. The
synthetic weights are random, so unscripted prompts produce noise text; prompts that contain one of
the triggers of `common.SCRIPT` make the server teacher-force that exact reply (then end of turn), so the
parsing paths (reasoning, tool calls, stops, streaming) get deterministic text to work on.

Every test checks afterwards that the server is still alive and printed no panic; the session ends
by stopping the server with SIGTERM and failing if it crashed, panicked or did not exit.

Environment: LILY_BIN, LILY_API_BACKEND (default cpu), LILY_API_THREADS, LILY_API_STARTUP_TIMEOUT
(seconds, default 120), LILY_API_SERVE_ARGS (extra `lily serve` flags, shell-split).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from common import API_KEY, MAX_CONTEXT, MODEL_NAME, SCRIPT, make_client

ROOT = pathlib.Path(__file__).resolve().parents[2]

# ---- the server --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: pathlib.Path
    args: list[str]
    _log: object = field(repr=False, default=None)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_death(self) -> str:
        rc = self.proc.poll()
        how = f"signal {-rc}" if rc is not None and rc < 0 else f"exit status {rc}"
        return f"lily serve died ({how}); its output ends with:\n{self.tail()}"

    def stop(self) -> list[str]:
        """SIGTERM, wait; returns the problems found (crash, panic, no exit)."""
        problems = []
        if not self.alive():
            problems.append(self.describe_death())
        else:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=15)
                if rc not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
                    problems.append(f"lily serve exited with status {rc} on SIGTERM:\n{self.tail()}")
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                problems.append(f"lily serve did not exit within 15 s of SIGTERM:\n{self.tail()}")
        if self._log is not None:
            self._log.close()
        if "panicked" in self.log():
            problems.append(f"lily serve panicked during the session:\n{self.tail(120)}")
        return problems


def lily_bin() -> pathlib.Path:
    return pathlib.Path(os.environ.get("LILY_BIN", ROOT / "target" / "release" / "lily"))


def start_server(workdir: pathlib.Path, model_dir: pathlib.Path, script: pathlib.Path | None,
                 extra: list[str] = (), name: str = "server") -> Server:
    """Starts `lily serve` and waits until /health answers (fails with its output otherwise)."""
    binary = lily_bin()
    timeout = float(os.environ.get("LILY_API_STARTUP_TIMEOUT", "120"))
    last_log = ""
    for attempt in range(3):  # a free port can be taken between probing and binding: retry
        port = _free_port()
        args = [str(binary), "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                "--port", str(port), "--api-key", API_KEY,
                "--backend", os.environ.get("LILY_API_BACKEND", "cpu")]
        if os.environ.get("LILY_API_THREADS"):
            args += ["--threads", os.environ["LILY_API_THREADS"]]
        if script is not None:
            args += ["--test-script", str(script)]
        args += list(extra) + shlex.split(os.environ.get("LILY_API_SERVE_ARGS", ""))
        log_path = workdir / f"{name}-{attempt}.log"
        log = open(log_path, "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        srv = Server(proc, f"http://127.0.0.1:{port}", log_path, args, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not srv.alive():
                break
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
                if r.status_code == 200:
                    return srv
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            srv.proc.kill()
            srv.proc.wait()
            log.close()
            pytest.fail(f"lily serve did not answer GET /health within {timeout:.0f} s\n"
                        f"command: {shlex.join(args)}\noutput:\n{srv.tail()}", pytrace=False)
        log.close()
        last_log = srv.log()
        if "in use" not in last_log.lower():
            break
    pytest.fail(f"lily serve exited before answering /health (status {srv.proc.returncode})\n"
                f"command: {shlex.join(args)}\noutput:\n{last_log[-6000:]}", pytrace=False)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("lily-api")


@pytest.fixture(scope="session")
def model_dir(workdir) -> pathlib.Path:
    binary = lily_bin()
    if not binary.exists():
        pytest.fail(f"no lily binary at {binary} (cargo build --release -p lily-cli, or set LILY_BIN)",
                    pytrace=False)
    help_ = subprocess.run([str(binary), "serve", "--help"], capture_output=True, text=True)
    if help_.returncode != 0:
        pytest.fail(f"{binary} has no working `serve` subcommand:\n{help_.stderr[-2000:]}", pytrace=False)
    out = workdir / MODEL_NAME
    r = subprocess.run([str(binary), "synth", "--preset", "tiny", "--out", str(out), "--seed", "0"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"lily synth failed:\n{r.stderr[-3000:]}", pytrace=False)
    return out


@pytest.fixture(scope="session")
def script_path(workdir) -> pathlib.Path:
    p = workdir / "test-script.json"
    p.write_text(json.dumps(SCRIPT, ensure_ascii=False, indent=1))
    return p


@pytest.fixture(scope="session")
def server(workdir, model_dir, script_path):
    srv = start_server(workdir, model_dir, script_path,
                       ["--max-context", str(MAX_CONTEXT), "--queue", "64"])
    yield srv
    problems = srv.stop()
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def small_queue_server(workdir, model_dir, script_path):
    srv = start_server(workdir, model_dir, script_path, ["--max-context", str(MAX_CONTEXT), "--queue", "1"],
                       name="queue-server")
    yield srv
    problems = srv.stop()
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture
def spawn_server(workdir, model_dir, script_path):
    """Starts servers of a test's own (killed at the end if still running)."""
    started = []

    def spawn(extra=(), name="own-server") -> Server:
        srv = start_server(workdir, model_dir, script_path,
                           ["--max-context", str(MAX_CONTEXT), *extra], name=name)
        started.append(srv)
        return srv

    yield spawn
    for srv in started:
        if srv.alive():
            srv.proc.kill()
            srv.proc.wait(timeout=10)
        if srv._log is not None:
            srv._log.close()


@pytest.fixture(autouse=True)
def _server_health(request):
    """Attributes a crash or a panic to the test during which it happened."""
    names = [n for n in ("server", "small_queue_server") if n in request.fixturenames]
    if not names:
        yield
        return
    srv: Server = request.getfixturevalue(names[0])
    if not srv.alive():
        pytest.fail("the server is dead (it died during an earlier test): " + srv.describe_death(),
                    pytrace=False)
    before = len(srv.log())
    yield
    if not srv.alive():
        pytest.fail(srv.describe_death(), pytrace=False)
    new = srv.log()[before:]
    if "panicked" in new:
        pytest.fail(f"lily serve panicked during this test:\n{new[-4000:]}", pytrace=False)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    c = make_client(server)
    yield c
    c.close()


@pytest.fixture(scope="session")
def http(server) -> httpx.Client:
    """Raw HTTP with the API key, for what the SDK would not send or would hide."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as c:
        yield c


