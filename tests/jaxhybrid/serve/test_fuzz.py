"""A fuzzer against a live `python -m jaxhybrid.serve` (the embedded model, behind `--api-key`).

What a client can send must never hurt the server, and every refusal must be one an OpenAI client can read.
Requests come from four sources:

- schemathesis cases from the server's own /openapi.json: every operation, the bodies its schema allows
  (positive) and those it does not (negative);
- hypothesis-built bodies for what the schema leaves open: unknown fields, free-form `messages`, token-id
  prompts, `logit_bias`, `stop`/`bad_words`/`allowed_token_ids` lists, NaN and infinities, 64-bit and larger
  integers, lone surrogates written as `\\ud800` escapes into the JSON text;
- raw requests: non-JSON bodies, odd content types, deep nesting, over-long numbers, unknown routes and methods;
- a pinned table, so each edge value (2**63, 2**64, 10**20, ...) reaches each field on every run, whatever
  hypothesis draws.

Every answer is checked: no status >= 500 (503 included: the engine is healthy), every 4xx an OpenAI error body
`{"error": {"message", "type", "param", "code"}}` whose code is its status, no traceback in any body and no 5xx
error event inside a stream. A request that gets no answer in REQUEST_TIMEOUT is abandoned (a slow but legal
request is only noted); it is a failure when the server then cannot answer the canary, and the wedged server is
replaced (at most MAX_RESTARTS times) so that one run still shows every finding. Afterwards /health answers, the
canary completes within a bound taken from its time at the start, and /metrics drains to zero; /health is polled
throughout and must never take more than HEALTH_BOUND.

Each test collects its failures, deduplicated by (problem, method, route, status) with the smallest request that
shows each, and asserts the list is empty: one run prints them all. Bounded: a fixed number of examples per
operation and strategy, derandomized with no database under CI (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

from tests.jaxhybrid.serve.server_process import ServerProcess

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CI = bool(os.environ.get("CI"))
SCHEMA_EXAMPLES = 25  # per operation and generation mode
BODY_EXAMPLES = 40  # per hypothesis strategy
REQUEST_TIMEOUT = 6.0  # seconds a request may take (a stream is cut at its first chunk after it)
HEALTH_BOUND = 1.0  # seconds: /health answers from the event loop alone, whatever the fuzzer sent
HEALTH_INTERVAL = 0.25
MAX_RESTARTS = 4  # each costs about REQUEST_TIMEOUT + the canary bound + a start (~3 s, compiles cached)
CANARY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/tokenize", "/detokenize")
GET_PATHS = ("/health", "/metrics", "/version", "/v1/models")
HUGE = (2**63 - 1, 2**63, 2**64, 10**20, -(2**63) - 1)
SURROGATES = ("\ud800", "x\udfffy")
OTHER_ROUTE = "<other route>"
VARYING = re.compile(r"\\u[0-9a-f]{4}|\d+")  # what differs between two logs of one exception: \udXXX, numbers
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b(?::.*)?$", re.MULTILINE)


# -- requests, answers and failures ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """One request: method, path, body bytes and content type (None: no content-type header)."""

    method: str
    path: str
    content: bytes = b""
    content_type: str | None = "application/json"
    params: dict[str, Any] = field(default_factory=dict)
    key: bool = True  # sent with the Bearer key (without it /v1/* is a 401, which must be OpenAI-shaped too)

    def describe(self) -> str:
        shown = self.content[:200].decode("utf-8", "backslashreplace") + ("..." if len(self.content) > 200 else "")
        kind = "" if self.content_type == "application/json" else f" [content-type: {self.content_type}]"
        kind += "" if self.key else " [no key]"
        return f"{self.method} {self.path}{kind} {shown}"


def json_probe(path: str, body: Any) -> Probe:
    """`body` as JSON text: NaN and infinities as Python writes them, lone surrogates as `\\udXXX` escapes."""
    return Probe("POST", path, json.dumps(body).encode())


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    text: str


@dataclass(frozen=True)
class Failure:
    problem: str
    probe: Probe
    status: int | None
    answer: str
    cause: str = ""  # the last exception the server logged for this request, if any

    def key(self) -> tuple[str, ...]:
        """Two failures are the same one when these agree (any method on a route the server does not have)."""
        method = "*" if route(self.probe.path) == OTHER_ROUTE else self.probe.method
        return self.problem, method, route(self.probe.path), str(self.status), VARYING.sub("_", self.cause)

    def describe(self) -> str:
        cause = f"  [server log: {self.cause[:160]}]" if self.cause else ""
        return f"{self.status or '---'} {self.problem}: {self.probe.describe()}  ->  {self.answer[:160]!r}{cause}"


def big_int_fields(probe: Probe) -> set[str]:
    """The top-level fields of a JSON object body that hold an integer beyond 32 bits, alone or in a list."""
    try:
        body = json.loads(probe.content)
    except (ValueError, RecursionError):
        return set()
    if not isinstance(body, dict):
        return set()
    return {name for name, value in body.items()
            if any(type(v) is int and abs(v) >= 2**31 for v in (value if isinstance(value, list) else [value]))}


def route(path: str) -> str:
    return path if path in POST_PATHS + GET_PATHS else OTHER_ROUTE


def last_exception(log: str) -> str:
    """The last `SomeError: message` line of a piece of the server's log ("" if none)."""
    found = EXCEPTION_LINE.findall(log)
    return found[-1].strip() if found else ""


def openai_error(text: str, status: int) -> bool:
    """`{"error": {"message": str, "type": str, "param": str | None, "code": status}}`."""
    try:
        error = json.loads(text)["error"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return False
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and isinstance(error["param"], str | None)
            and type(error.get("code")) is int and error["code"] == status)


def stream_5xx(text: str) -> bool:
    """Whether a server-sent-events body carries an error event with a code >= 500."""
    for line in text.splitlines():
        try:
            event = json.loads(line.removeprefix("data: ")) if line.startswith("data: {") else None
        except (ValueError, RecursionError):
            continue
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), int) and error["code"] >= 500:
            return True
    return False


def problems(probe: Probe, reply: Reply) -> list[str]:
    found = []
    if reply.status >= 500:
        found.append("5xx")
    elif reply.status >= 400 and probe.method != "HEAD" and not openai_error(reply.text, reply.status):
        found.append("4xx without an OpenAI error body")
    if "Traceback" in reply.text or 'File "' in reply.text:
        found.append("traceback text in the body")
    if reply.content_type.startswith("text/event-stream") and stream_5xx(reply.text):
        found.append("a 5xx error event in the stream")
    return found


def summary(failures: list[Failure], outcomes: Counter[int | str]) -> str:
    groups: dict[tuple[str, ...], list[Failure]] = {}
    for failure in failures:
        groups.setdefault(failure.key(), []).append(failure)
    seen = ", ".join(f"{outcome}: {count}" for outcome, count in sorted(outcomes.items(), key=str))
    lines = [f"{len(groups)} distinct failures ({len(failures)} in all; {outcomes.total()} requests, answers {seen})"]
    for key in sorted(groups):
        smallest = min(groups[key], key=lambda f: len(f.probe.content) + len(f.probe.path))
        lines.append(f"  x{len(groups[key])} {smallest.describe()}")
    return "\n".join(lines)


# -- the server ---------------------------------------------------------------------------------------------------

class Target:
    """The live server, replaced when a request leaves it unable to answer the canary."""

    def __init__(self, directory: Path, cache: Path):
        self.directory, self.cache = directory, cache
        self.restarts = 0
        self.replacing = False  # the health poller skips the gap
        self.gone = False  # wedged once more than MAX_RESTARTS allow: nothing more is sent
        self.wedged_by: dict[str, set[str]] = {}  # path -> fields whose huge integers wedged the server there
        self.server = self._start()
        # a connection per request: one the server closes after an answer is never blamed on the next request
        self.client = httpx.Client(timeout=REQUEST_TIMEOUT, limits=httpx.Limits(max_keepalive_connections=0))
        try:
            self.canary_bound = self._canary_bound()
        except BaseException:
            self.close()
            raise
        self.log_seen = 0  # bytes of the current server's log already read
        self.new_log()

    def _start(self) -> ServerProcess:
        return ServerProcess(["--api-key", KEY], self.directory / f"server-{self.restarts}.log", self.cache)

    def _canary_bound(self) -> float:
        """5x the slowest of three canaries at the start (after a warm-up one), plus 2 s. The 5x covers the
        load of the fuzzing itself and of a neighbouring test worker on the other of CI's two cores; the 2 s
        cover a request the fuzzer just abandoned, whose abort lands only between engine steps."""
        times = [self.canary(60.0) for _ in range(4)][1:]
        if None in times:
            raise RuntimeError(f"the canary failed on a fresh server:\n{self.server.log()}")
        return 5 * max(times) + 2.0

    def canary(self, timeout: float) -> float | None:
        """Seconds the greedy canary took to a 200, or None without one within `timeout`."""
        start = time.monotonic()
        try:
            response = self.client.post(f"{self.server.url}/v1/completions", json=CANARY, headers=AUTH,
                                        timeout=timeout)
        except httpx.TransportError:
            return None
        seconds = time.monotonic() - start
        return seconds if response.status_code == 200 and seconds <= timeout else None

    def send(self, probe: Probe) -> Reply | str:
        """The server's answer, or why there is none: "timeout" or the transport error's name."""
        headers = {**(AUTH if probe.key else {}), **({"content-type": probe.content_type} if probe.content_type
                                                     else {})}
        deadline = time.monotonic() + REQUEST_TIMEOUT
        try:
            with self.client.stream(probe.method, f"{self.server.url}{probe.path}", content=probe.content,
                                    headers=headers, params=probe.params) as response:
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if time.monotonic() > deadline:
                        return "timeout"
                return Reply(response.status_code, response.headers.get("content-type", ""),
                             body.decode("utf-8", "replace"))
        except httpx.TimeoutException:
            return "timeout"
        except httpx.TransportError as error:
            return type(error).__name__

    def new_log(self) -> str:
        """What the current server logged since the last call."""
        with open(self.server.log_path, "rb") as log:
            log.seek(self.log_seen)
            new = log.read()
        self.log_seen += len(new)
        return new.decode("utf-8", "replace")

    def healthy(self) -> bool:
        return self.server.process.poll() is None and self.canary(self.canary_bound) is not None

    def replace(self) -> None:
        """Kill the wedged server and start another, or give up after MAX_RESTARTS."""
        self.replacing = True
        try:
            self.server.stop(signal.SIGKILL, timeout=30)
            if self.restarts >= MAX_RESTARTS:
                self.gone = True
                return
            self.restarts += 1
            self.server = self._start()
            self.log_seen = 0
            self.new_log()
        finally:
            self.replacing = False

    def close(self) -> int:
        self.client.close()
        return self.server.stop(timeout=30)


class HealthPoller(threading.Thread):
    """GET /health every HEALTH_INTERVAL through the fuzzing; keeps each answer that was not a quick 200."""

    def __init__(self, target: Target):
        super().__init__(daemon=True)
        self.target = target
        self.halt = threading.Event()
        self.polls = 0
        self.worst = 0.0
        self.bad: list[tuple[str, float, int | str]] = []

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.halt.wait(HEALTH_INTERVAL):
                self._poll(client)

    def _poll(self, client: httpx.Client) -> None:
        server = self.target.server
        if self.target.replacing or self.target.gone:
            return
        start = time.monotonic()
        try:
            outcome: int | str = client.get(f"{server.url}/health").status_code
        except httpx.TransportError as error:
            outcome = type(error).__name__
        seconds = time.monotonic() - start
        if self.target.replacing or server is not self.target.server:
            return  # the server was replaced meanwhile
        self.polls += 1
        self.worst = max(self.worst, seconds)
        if outcome != 200 or seconds > HEALTH_BOUND:
            self.bad.append((time.strftime("%H:%M:%S"), round(seconds, 2), outcome))

    def stop(self) -> None:
        self.halt.set()
        self.join(15)


class Fuzzer:
    """Sends probes and collects what is wrong with each answer; never raises, so hypothesis runs every example."""

    def __init__(self, target: Target):
        self.target = target
        self.failures: list[Failure] = []
        self.notes: list[str] = []
        self.outcomes: Counter[int | str] = Counter()  # status or why there was none -> requests

    def check(self, probe: Probe) -> None:
        if self._skipped(probe):
            return
        self.target.new_log()  # what earlier requests left there is not this one's
        reply = self.target.send(probe)
        self.outcomes[reply.status if isinstance(reply, Reply) else reply] += 1
        if isinstance(reply, Reply):
            # the server logs a 5xx's exception before it answers it
            cause = last_exception(self.target.new_log()) if reply.status >= 500 else ""
            self.failures += [Failure(p, probe, reply.status, reply.text, cause if p == "5xx" else "")
                              for p in problems(probe, reply)]
        else:
            self._no_answer(probe, reply)

    def _skipped(self, probe: Probe) -> bool:
        """Nothing is sent once the server is gone, nor what would wedge it again the way it was wedged."""
        why = ("the server is gone" if self.target.gone else "like a request that wedged the server"
               if big_int_fields(probe) & self.target.wedged_by.get(probe.path, set()) else "")
        if why:
            self.outcomes[f"not sent: {why}"] += 1
        return bool(why)

    def _no_answer(self, probe: Probe, why: str) -> None:
        healthy = self.target.healthy()
        cause = last_exception(self.target.new_log())
        if healthy and why == "timeout":  # slow but legal (a long generation) and abandoned: the server goes on
            self.notes.append(f"no answer in {REQUEST_TIMEOUT} s, then the canary passed: {probe.describe()}")
        elif healthy:
            self.failures.append(Failure(f"no answer ({why})", probe, None, "", cause))
        else:
            self.failures.append(Failure(f"no answer ({why}), then no canary: the server was replaced", probe,
                                         None, "", cause))
            self.target.wedged_by.setdefault(probe.path, set()).update(big_int_fields(probe))
            self.target.replace()

    def assert_clean(self, extra: list[str] | None = None) -> None:
        report = "\n".join([*(extra or []), summary(self.failures, self.outcomes), *self.notes,
                            f"server logs: {self.target.directory}"])
        print(report)
        assert self.outcomes, "nothing was sent"
        assert not self.failures and not extra and not self.target.gone, report


def explore(strategy: st.SearchStrategy[Probe], fuzz: Fuzzer, examples: int) -> None:
    """Send `examples` probes drawn from `strategy`."""
    @settings(max_examples=examples, derandomize=CI, database=None, deadline=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(probe: Probe) -> None:
        fuzz.check(probe)

    run()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    tmp = tmp_path_factory.mktemp("fuzz")
    target = Target(tmp, tmp_path_factory.getbasetemp() / "compile-cache")
    yield target
    code = target.close()
    assert target.gone or code in (0, -15), target.server.log()


@pytest.fixture(scope="module")
def health(target: Target) -> Iterator[HealthPoller]:
    poller = HealthPoller(target)
    poller.start()
    yield poller
    poller.stop()


@pytest.fixture
def fuzz(target: Target, health: HealthPoller) -> Fuzzer:
    return Fuzzer(target)


# -- strategies ---------------------------------------------------------------------------------------------------

ODD_TEXT = ("a\ud800\udc00", "<|mamba_checkpoint|>", "<|endoftext|>", "<|im_start|>", "\x00", " ",
            "é🙂", "{{ raise }}", "{% for x in y %}")
INTS = st.one_of(st.integers(-2, 300), st.sampled_from(HUGE), st.integers())
FLOATS = st.one_of(st.floats(-2, 2), st.floats(allow_nan=True, allow_infinity=True))
COUNT = st.one_of(st.integers(0, 4), INTS)  # often valid (n, logprobs, top_k, ...), often not
UNIT = st.one_of(st.floats(0.01, 1), FLOATS)
TOKEN = st.one_of(st.integers(0, 4095), INTS)  # the embedded model's vocabulary is 4096
TEXT = st.one_of(st.text(max_size=8), st.sampled_from(ODD_TEXT),
                 st.lists(st.sampled_from(ODD_TEXT) | st.text(max_size=3), max_size=3).map("".join))
# a lone surrogate in a few fields only: the server refuses any body holding one, so most bodies go further
RISKY_TEXT = st.one_of(TEXT, TEXT, st.sampled_from(SURROGATES))
JSON = st.recursive(st.none() | st.booleans() | INTS | FLOATS | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
EXTRA = st.dictionaries(TEXT, JSON, max_size=2)  # unknown fields: accepted and ignored


def loose(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the field's own type, sometimes any JSON value."""
    return st.one_of(strategy, strategy, strategy, JSON)


def some_of(fields: dict[str, st.SearchStrategy], typed: bool) -> st.SearchStrategy[dict]:
    """Up to four of `fields`: few enough that a request often gets past its first refusal."""
    names = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries(
        {name: fields[name] if typed else loose(fields[name]) for name in chosen}))


def bodies(required: dict[str, st.SearchStrategy], fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """Half with every value of its field's type (the request gets further in), half with any of them any JSON;
    always a few unknown fields."""
    def built(typed: bool) -> st.SearchStrategy[dict]:
        base = st.fixed_dictionaries({name: value if typed else loose(value) for name, value in required.items()})
        return st.builds(lambda base, chosen, extra: {**extra, **base, **chosen}, base, some_of(fields, typed), EXTRA)

    return built(True) | built(False)


PROMPT = st.one_of(RISKY_TEXT, st.lists(TOKEN, min_size=1, max_size=4),
                   st.lists(st.lists(TOKEN, max_size=3), max_size=3), st.lists(RISKY_TEXT, max_size=3))
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "refusal"]) | TEXT},
                             optional={"text": loose(TEXT), "image_url": JSON, "refusal": TEXT})
MESSAGE = st.builds(lambda message, extra: {**extra, **message}, st.fixed_dictionaries(
    {"role": loose(st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | TEXT),
     "content": loose(st.one_of(RISKY_TEXT, st.none(), st.lists(PART, max_size=2)))},
    optional={"name": TEXT, "tool_calls": JSON, "tool_call_id": TEXT}), st.dictionaries(TEXT, JSON, max_size=1))
PLAIN_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                       "content": RISKY_TEXT | st.lists(PART, min_size=1, max_size=2)})
MESSAGES = st.one_of(st.lists(PLAIN_MESSAGE, min_size=1, max_size=3),  # often past validation, into the template
                     st.lists(loose(MESSAGE), max_size=3))
SAMPLING = {
    "model": st.sampled_from(["jaxhybrid-default", "", "gpt-4"]), "n": COUNT, "top_k": COUNT, "max_tokens": COUNT,
    "seed": INTS, "min_tokens": COUNT, "prompt_logprobs": COUNT, "truncate_prompt_tokens": COUNT,
    "temperature": UNIT, "top_p": UNIT, "min_p": UNIT, "repetition_penalty": FLOATS,
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "stop": RISKY_TEXT | st.lists(RISKY_TEXT, max_size=3),
    "stop_token_ids": st.lists(TOKEN, max_size=3), "allowed_token_ids": st.lists(TOKEN, max_size=3),
    "logit_bias": st.dictionaries(RISKY_TEXT | TOKEN.map(str), FLOATS, max_size=3),
    "bad_words": st.lists(RISKY_TEXT, max_size=3),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "cache_salt": TEXT, "request_id": TEXT,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "truncation_side": st.sampled_from(["left", "right", "middle"]), "logprob_token_ids": st.lists(TOKEN, max_size=2),
}
CHAT = {**SAMPLING, "logprobs": st.booleans(), "top_logprobs": COUNT, "max_completion_tokens": COUNT,
        "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(), "echo": st.booleans(),
        "chat_template_kwargs": st.dictionaries(TEXT, JSON, max_size=2), "tools": JSON, "tool_choice": JSON,
        "prompt_token_ids": st.lists(TOKEN, max_size=3), "response_format": JSON}
TOKENIZE = {"model": SAMPLING["model"], "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(),
            "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans()}
SHORT = {"max_tokens": st.sampled_from([0, 1, 2])}  # cheap by default; a drawn max_tokens overrides it
BODIES = {
    "/v1/completions": bodies({"prompt": PROMPT, **SHORT},
                              {**SAMPLING, "logprobs": COUNT, "echo": st.booleans(), "suffix": TEXT, "best_of": COUNT,
                               "add_special_tokens": st.booleans()}),
    "/v1/chat/completions": bodies({"messages": MESSAGES, **SHORT}, CHAT),
    "/v1/chat/completions/batch": bodies({"messages": st.lists(MESSAGES, min_size=1, max_size=3), **SHORT}, CHAT),
    "/tokenize": st.one_of(bodies({"prompt": RISKY_TEXT}, TOKENIZE), bodies({"messages": MESSAGES}, TOKENIZE),
                           bodies({}, {**TOKENIZE, "prompt": RISKY_TEXT, "messages": MESSAGES})),
    "/detokenize": bodies({"tokens": st.lists(TOKEN, max_size=4)}, {"model": SAMPLING["model"]}),
}


def nested(depth: int, key: bytes = b"prompt") -> bytes:
    return b'{"' + key + b'": ' + b"[" * depth + b"]" * depth + b"}"


NON_JSON = st.one_of(
    st.binary(max_size=24),
    RISKY_TEXT.map(lambda text: text.encode("utf-8", "surrogatepass")),  # a raw surrogate is invalid UTF-8
    st.sampled_from([b"", b"null", b"true", b'"prompt"', b"[1, 2]", b"1e999", b"NaN", b"-Infinity", b"{", b"{}}",
                     b"\xef\xbb\xbf{}", b'{"prompt": "a", "prompt": 7}', b'{"prompt": "\\ud800"}',
                     b'{"prompt": "\\udc00\\ud800"}', b'{"prompt": "a\\u0000b"}', b'{"prompt": "\xff"}',
                     b'{"messages": "\\ud800"}', b'{"tokens": [1e999]}', b'{"\\ud800": 1}', b"\xff\xfe{\x00}\x00"]),
    st.one_of(st.integers(0, 3000), st.sampled_from([63, 64, 65, 1000, 5000])).map(nested),
    st.integers(4200, 4400).map(lambda digits: b'{"prompt": "a", "max_tokens": ' + b"7" * digits + b"}"),
)
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=utf-16", None])
RAW = st.builds(Probe, st.just("POST"), st.sampled_from(POST_PATHS), NON_JSON, CONTENT_TYPES)
SEGMENT = st.text("abcdefghijklmnopqrstuvwxyz0123456789-._~%", min_size=1, max_size=8)
PATHS = st.one_of(
    st.sampled_from([*POST_PATHS, *GET_PATHS, "/", "/v1", "/v1/", "/v1/completions/", "/v2/completions",
                     "//v1/completions", "/v1/models/jaxhybrid-default", "/v1/embeddings", "/docs", "/openapi.json",
                     "/v1/chat/completions/batch/1", "/%2e%2e/health", "/v1/%00", "/v1/%ff", "/tokenize/"]),
    st.lists(SEGMENT, min_size=1, max_size=3).map(lambda segments: "/" + "/".join(segments)),
    st.lists(SEGMENT, max_size=2).map(lambda segments: "/v1/" + "/".join(segments)),
)
ROUTES = st.builds(Probe, st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]), PATHS,
                   st.sampled_from([b"", b"{}", json.dumps(CANARY).encode()]), key=st.booleans())


def pinned() -> Iterator[Probe]:
    """Each edge value in each field it reaches, on every run."""
    completion = {"prompt": "Hello", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    for value in HUGE:
        for name in ("n", "top_k", "max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens",
                     "min_tokens", "best_of"):
            yield json_probe("/v1/completions", {**completion, name: value})
        for name in ("top_logprobs", "max_completion_tokens", "n", "top_k", "seed", "prompt_logprobs"):
            yield json_probe("/v1/chat/completions", {**chat, "logprobs": True, name: value})
        for name, shaped in (("stop_token_ids", [value]), ("allowed_token_ids", [value]), ("logit_bias", {value: 1}),
                             ("prompt", [value]), ("prompt", [[value]]), ("logprob_token_ids", [value])):
            yield json_probe("/v1/completions", {**completion, name: shaped})
        yield json_probe("/v1/chat/completions", {"messages": [], "prompt_token_ids": [value], "max_tokens": 2})
        yield json_probe("/v1/chat/completions/batch", {**chat, "messages": [chat["messages"]], "top_k": value})
        yield json_probe("/detokenize", {"tokens": [value]})
    for text in SURROGATES:
        yield from surrogate_probes(text)


def surrogate_probes(text: str) -> Iterator[Probe]:
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    for name, value in (("prompt", text), ("prompt", [text]), ("stop", text), ("stop", [text]), ("bad_words", [text]),
                        ("cache_salt", text), ("model", text), ("request_id", text), ("user", text),
                        ("logit_bias", {text: 1}), (text, 1), ("extra", text)):
        yield json_probe("/v1/completions", {"prompt": "Hello", "max_tokens": 2, name: value})
    for message in ({"role": "user", "content": text}, {"role": text, "content": "Hello"},
                    {"role": "user", "content": [{"type": "text", "text": text}]},
                    {"role": "user", "content": "Hello", "name": text}):
        yield json_probe("/v1/chat/completions", {**chat, "messages": [message]})
        yield json_probe("/v1/chat/completions/batch", {**chat, "messages": [[message]]})
        yield json_probe("/tokenize", {"messages": [message]})
    yield json_probe("/v1/chat/completions", {**chat, "chat_template_kwargs": {text: text}})
    yield json_probe("/tokenize", {"prompt": text})
    yield json_probe("/detokenize", {"tokens": [1], "model": text})


# -- schemathesis -------------------------------------------------------------------------------------------------

def case_probe(case: Case) -> Probe:
    """A schemathesis case as a probe, sent by our own client (whose deadline also bounds a stream, where
    `case.call`'s timeout is per read)."""
    kwargs = case.as_transport_kwargs(base_url="http://fuzz")
    url = httpx.URL(kwargs["url"])
    headers = {name.lower(): value for name, value in kwargs.get("headers", {}).items()}
    if "json" in kwargs:
        content = json.dumps(kwargs["json"]).encode()
    else:
        data = kwargs.get("data")
        content = (b"" if data is None else data if isinstance(data, bytes)
                   else data.encode("utf-8", "surrogatepass") if isinstance(data, str) else json.dumps(data).encode())
    return Probe(kwargs["method"].upper(), url.raw_path.decode("ascii"), content, headers.get("content-type"),
                 dict(kwargs.get("params") or {}))


def modes(operation: schemathesis.APIOperation) -> list[GenerationMode]:
    """Negative cases need something to break: a GET without parameters has none."""
    if len(operation.body) or any(True for _ in operation.iter_parameters()):
        return [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    return [GenerationMode.POSITIVE]


# -- tests --------------------------------------------------------------------------------------------------------

def test_schemathesis_cases_from_the_servers_openapi(target: Target, fuzz: Fuzzer) -> None:
    schema = schemathesis.openapi.from_url(f"{target.server.url}/openapi.json", timeout=10)
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for mode in modes(operation):
            explore(operation.as_strategy(generation_mode=mode).map(case_probe), fuzz, SCHEMA_EXAMPLES)
    expected = {f"POST {path}" for path in POST_PATHS} | {f"GET {path}" for path in GET_PATHS}
    missing = expected - {operation.label for operation in operations}
    fuzz.assert_clean([f"the schema lacks {sorted(missing)}"] if missing else [])


def test_raw_bodies_and_content_types(fuzz: Fuzzer) -> None:
    explore(RAW, fuzz, BODY_EXAMPLES)
    fuzz.assert_clean()


def test_unknown_routes_and_methods(fuzz: Fuzzer) -> None:
    explore(ROUTES, fuzz, BODY_EXAMPLES)
    fuzz.assert_clean()


def test_pinned_edge_values(fuzz: Fuzzer) -> None:
    for probe in pinned():
        fuzz.check(probe)
    fuzz.assert_clean()


@pytest.mark.parametrize("path", BODIES)
def test_hypothesis_bodies(fuzz: Fuzzer, path: str) -> None:
    explore(BODIES[path].map(lambda body: json_probe(path, body)), fuzz, BODY_EXAMPLES)
    fuzz.assert_clean()


def test_the_server_is_well_after_the_fuzzing(target: Target, health: HealthPoller) -> None:
    """Last in the module: /health, the canary in its bound, nothing left in the engine, /health always quick."""
    found = [] if not (target.restarts or target.gone) else [
        f"the server was wedged {target.restarts + target.gone} times and replaced (see the failures above)"]
    if not target.gone:
        found += after_fuzzing(target)
    health.stop()
    if health.bad:
        found.append(f"/health was slow or failed {len(health.bad)} of {health.polls} times: {health.bad[:8]}")
    if not health.polls:
        found.append("/health was never polled")
    print(f"canary bound {target.canary_bound:.2f} s; /health polled {health.polls} times, worst {health.worst:.3f} s")
    assert not found, "\n".join(found)


def after_fuzzing(target: Target) -> list[str]:
    found = []
    status = httpx.get(f"{target.server.url}/health", timeout=HEALTH_BOUND + 5).status_code
    if status != 200:
        found.append(f"/health answered {status}")
    if target.canary(target.canary_bound) is None:
        found.append(f"the canary got no 200 within {target.canary_bound:.1f} s")
    drained = target.server.wait_drained()
    if any(drained.values()):
        found.append(f"/metrics did not drain: {drained}")
    return found
