"""Constants, the test script and helpers shared by the API test files (fixtures: conftest.py)."""

from __future__ import annotations

import time

import httpx
import openai

API_KEY = "lily-test-key-7f3a"
MAX_CONTEXT = 2048
MODEL_NAME = "lily-tiny"  # the model directory's file name: what /v1/models must list
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}

# ---- the test script: substring of the rendered prompt -> exact reply (first match wins) ----------

WEATHER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
LONDON_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n"
    "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>"
)
TRIP_CALL = (
    "<tool_call>\n<function=plan_trip>\n<parameter=stops>\n[\"Paris\", \"Lyon\"]\n</parameter>\n"
    "<parameter=budget>\n1200.5\n</parameter>\n<parameter=flexible>\ntrue\n</parameter>\n"
    "<parameter=note>\nwindow seat <near> the \"front\" & aisle,\nplease\n</parameter>\n</function>\n</tool_call>"
)
UNICODE_REPLY = "Grüße, 世界! 🎉 café — naïve"
# ~1500 tokens: long enough that a client can disconnect long before the reply is complete.
LONG_REPLY = " ".join(["the cat sat on the mat."] * 150)

SCRIPT = [
    # Must come first: the second turn of a tool conversation still contains the first turn's trigger.
    {"when": "<tool_response>", "reply": "It is sunny."},
    # A chained Responses turn (test_responses.py): fires only when the earlier turn is in the prompt.
    {"when": "<|im_start|>assistant\nJust the answer: 4.<|im_end|>\n<|im_start|>user\n[[chained]]", "reply": "Chained: 4 again."},
    # Several system messages (test_messages_shapes.py): the triggers include how they render.
    {"when": "<|im_start|>system\nFirst rule.\n\nSecond rule.<|im_end|>\n<|im_start|>user\n[[two-systems]]",
     "reply": "Two systems, one block."},
    {"when": "<|im_start|>user\nMid rule.\n\n[[mid-system]]", "reply": "Folded into the user turn."},
    {"when": "[[think]]", "reply": "<think>\nplan it\n</think>\n\nThe answer is 4."},
    # What a real model emits: the generation prompt already ends with "<think>\n".
    {"when": "[[think-open]]", "reply": "plan it\n</think>\n\nThe answer is 4."},
    {"when": "[[plain]]", "reply": "Just the answer: 4."},
    {"when": "[[stop]]", "reply": "alpha beta gamma delta epsilon"},
    {"when": "[[unicode]]", "reply": UNICODE_REPLY},
    {"when": "[[weather]]", "reply": WEATHER_CALL},
    {"when": "[[weather-think]]", "reply": "<think>\nI should call the tool.\n</think>\n\n" + WEATHER_CALL},
    {"when": "[[weather-preamble]]", "reply": "Let me check.\n\n" + WEATHER_CALL},
    {"when": "[[two-calls]]", "reply": WEATHER_CALL + "\n" + LONDON_CALL},
    {"when": "[[trip]]", "reply": TRIP_CALL},
    {"when": "[[complete]]", "reply": " and they lived happily ever after."},
    {"when": "[[long]]", "reply": LONG_REPLY},
    # Structured outputs with thinking on (test_structured.py): the reasoning is forced and closed,
    # then the model goes on (`open`: no end of turn) under the constraint, which starts after
    # `</think>`. A random model would rarely close its reasoning by itself.
    {"when": "[[json-think]]", "reply": "plan it\n</think>", "open": True},
]


# ---- helpers ------------------------------------------------------------


def make_client(srv, key: str = API_KEY, timeout: float = 60.0) -> openai.OpenAI:
    """An SDK client for the server `srv` (conftest.Server). max_retries=0: a retried request
    would hide the server's first answer."""
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def extra(obj, name):
    """A non-OpenAI field of an SDK object (reasoning_content, reasoning), or None."""
    if obj is None:
        return None
    ex = getattr(obj, "model_extra", None) or {}
    if name in ex:
        return ex[name]
    return getattr(obj, name, None)


def reasoning_of(obj):
    return extra(obj, "reasoning_content")


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format -> {(name, frozenset(labels)): value}."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_s, value_s = rest.rsplit("}", 1)
            labels = {}
            for part in _split_labels(labels_s):
                k, v = part.split("=", 1)
                labels[k.strip()] = v.strip().strip('"')
        else:
            name, value_s = line.split(None, 1)
            labels = {}
        value_s = value_s.split()[0]  # drop an optional timestamp
        out[(name.strip(), frozenset(labels.items()))] = float(value_s)
    return out


def _split_labels(s: str):
    parts, cur, q = [], "", False
    for ch in s:
        if ch == '"':
            q = not q
        if ch == "," and not q:
            if cur.strip():
                parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


class Metrics:
    def __init__(self, text: str):
        self.text = text
        self.samples = parse_metrics(text)

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}

    def get(self, name: str, **labels) -> float:
        want = frozenset((k, str(v)) for k, v in labels.items())
        total, found = 0.0, False
        for (n, ls), v in self.samples.items():
            if n == name and want <= ls:
                total += v
                found = True
        if not found:
            raise KeyError(f"metric {name}{labels or ''} not in /metrics:\n{self.text}")
        return total

    def outcome(self, outcome: str) -> float:
        try:
            return self.get("lily_requests_finished_total", outcome=outcome)
        except KeyError:
            return 0.0

    def balance(self) -> tuple[float, float]:
        """(received, finished over all outcomes + queued + running): equal when consistent."""
        return (self.get("lily_requests_received_total"),
                self.get("lily_requests_finished_total") + self.get("lily_queue_depth")
                + self.get("lily_requests_running"))


def metrics(http: httpx.Client) -> Metrics:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    return Metrics(r.text)


def settled_metrics(http: httpx.Client, timeout: float = 20.0) -> Metrics:
    """/metrics once nothing is queued or running (requests still winding down after a
    disconnect are given `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m.get("lily_queue_depth") == 0 and m.get("lily_requests_running") == 0:
            recv, acc = m.balance()
            if recv == acc or time.monotonic() > deadline:
                return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def check_error_body(body) -> dict:
    """OpenAI's error shape: `{"error": {message, type, param, code}}` with a non-empty message.
    Returns the error object."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    e = body["error"]
    for k in ("message", "type", "param", "code"):
        assert k in e, f"error object lacks {k!r}: {body}"
    assert isinstance(e["message"], str) and e["message"]
    return e
