"""The WebSocket and SSE endpoints driven by hypothesis: random first and later frames on
``/v1/stream``, random paths, query parameters (Unicode, huge), headers and frames on the
gateway's ``/v1/jobs/{id}/stream``, random parameters and ``Last-Event-ID`` headers on
``/v1/jobs/{id}/events``.

Every session must end within the bound with a close code the protocol names (1000, 1013,
44xx) or an HTTP status below 500: a 1006 (the server dropped the connection), a 1011 (an
exception in a handler) or a 5xx is a failure, recorded with the input that caused it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import connect

from tidegate.benchmarks.serving.fuzzing.stack import FuzzStack
from tidegate.benchmarks.serving.fuzzing.tally import Tally

HANG_S = 30.0
CLOSE_CODES = {1000, 1013, 4400, 4401, 4403, 4404, 4409, 4429}
UNICODE_DIGITS = ["²", "١٢", "٣", "𝟘", "߀", "৯", "Ⅻ", "①"]

# Any code point, lone surrogates included (json.dumps escapes them: "\ud800").
text = st.text(st.characters(exclude_categories=()), max_size=40)
# A text frame as such is UTF-8 on the wire: any code point a client can send.
frame_text = st.text(max_size=40)
leaves = (st.none() | st.booleans() | st.integers() | text
          | st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(text, inner, max_size=4), max_leaves=12)
HOSTILE_FRAMES = [
    "[" * 100_000 + "]" * 100_000,
    '{"type": "generate", "request": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"type": NaN}', '{"type": "ping", "data": Infinity}', "\ufeff{}", "",
    '{"type": "generate", "request": {"prompt": "hi", "stop": ["\\ud800"]}}',
    '{"type": "resume", "job_id": "x", "last_event_id": ' + "9" * 5000 + "}",
    '{"type": "ping", "data": "' + "x" * (1 << 20) + '"}',
]


@dataclass(frozen=True, slots=True)
class Jobs:
    """Finished jobs to watch: tenant A's (ids, tokens) and one of tenant B's."""

    ids: list[str]
    tokens: list[str]
    other_tenants: str


def finished_jobs(stack: FuzzStack, n: int = 2) -> Jobs:
    with httpx.Client(base_url=stack.base_url, timeout=HANG_S) as http:
        answers = [http.post("/v1/jobs", json={"prompt": f"fuzz {i}", "max_tokens": 3},
                             headers=stack.auth(0)).json() for i in range(n)]
        other = http.post("/v1/jobs", json={"prompt": "b", "max_tokens": 2},
                          headers=stack.auth(1)).json()
        for job, tenant in [*((a, 0) for a in answers), (other, 1)]:
            deadline = time.monotonic() + 60
            while http.get(f"/v1/jobs/{job['id']}",
                           headers=stack.auth(tenant)).json()["status"] in ("queued", "running"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"job {job['id']} did not finish")
                time.sleep(0.1)
    return Jobs([a["id"] for a in answers], [a["stream_token"] for a in answers], other["id"])


def dumps(value: Any) -> str:
    return json.dumps(value)  # ensure_ascii: lone surrogates travel as escapes


def request_bodies() -> st.SearchStrategy[Any]:
    """Mostly near-valid ``POST /v1/jobs`` bodies (small jobs), some anything at all."""
    near = st.fixed_dictionaries({"prompt": st.sampled_from(["hi", "say x"]) | text}, optional={
        "max_tokens": st.integers(-2, 6) | json_values,
        "stop": st.lists(text, max_size=3) | text | json_values,
        "temperature": st.floats(-1, 3) | json_values,
        "lane": st.sampled_from(["interactive", "batch"]) | text,
        "timeout_s": st.floats(0.5, 60) | json_values,
        "idempotency_key": st.sampled_from(["fuzz-1", "fuzz-2"]) | text,
        "seed": st.integers(), "colour": text})
    return near | json_values


def submit_frames(stack: FuzzStack, jobs: Jobs) -> st.SearchStrategy[str | bytes]:
    keys = st.sampled_from([stack.keys[0], stack.keys[1], "wrong-key"]) | json_values
    structured = st.fixed_dictionaries(
        {"type": st.sampled_from(["generate", "resume", "ping"]) | text},
        optional={"request": request_bodies(), "api_key": keys,
                  "job_id": st.sampled_from([*jobs.ids, jobs.other_tenants]) | text | json_values,
                  "last_event_id": st.integers(-2, 10) | st.integers() | json_values,
                  "token": st.sampled_from(jobs.tokens) | text | json_values, "extra": text})
    return st.one_of(structured.map(dumps), frame_text, json_values.map(dumps),
                     st.sampled_from(HOSTILE_FRAMES), st.binary(max_size=64))


def later_frames() -> st.SearchStrategy[str | bytes]:
    pings = st.fixed_dictionaries({"type": st.just("ping")}, optional={"data": json_values})
    return st.one_of(pings.map(dumps), frame_text, json_values.map(dumps),
                     st.binary(max_size=16), st.sampled_from(HOSTILE_FRAMES))


def query_values() -> st.SearchStrategy[str]:
    return st.one_of(st.integers(-5, 10**20).map(str), st.sampled_from(UNICODE_DIGITS), text,
                     st.integers(100, 4000).map(lambda n: "9" * n))


def fuzz_submit_socket(stack: FuzzStack, tally: Tally, jobs: Jobs, *, examples: int) -> None:
    """``/v1/stream``: a random first frame, then up to two more, with or without a key."""
    @given(first=submit_frames(stack, jobs), later=st.lists(later_frames(), max_size=2),
           auth=st.sampled_from([None, 0, 1]))
    @_settings(examples)
    def session(first: str | bytes, later: list[str | bytes], auth: int | None) -> None:
        headers = stack.auth(auth) if auth is not None else None
        _session(tally, "WS /v1/stream", f"{stack.ws_url}/v1/stream", headers, [first, *later])

    session()


def fuzz_watch_socket(stack: FuzzStack, tally: Tally, jobs: Jobs, *, examples: int) -> None:
    """``/v1/jobs/{id}/stream``: random job ids, query parameters, keys and frames."""
    @given(job=st.sampled_from([*jobs.ids, jobs.other_tenants]) | text,
           query=_queries(jobs), auth=st.sampled_from([None, 0, 1]),
           frames=st.lists(later_frames(), max_size=2))
    @_settings(examples)
    def session(job: str, query: dict[str, str], auth: int | None,
                frames: list[str | bytes]) -> None:
        headers = stack.auth(auth) if auth is not None else None
        url = f"{stack.ws_url}/v1/jobs/{_quoted(job)}/stream{_query_string(query)}"
        _session(tally, "WS /v1/jobs/{job_id}/stream", url, headers, frames)

    session()


def fuzz_sse(stack: FuzzStack, tally: Tally, jobs: Jobs, *, examples: int) -> None:
    """``/v1/jobs/{id}/events``: random job ids, query parameters, keys, ``Last-Event-ID``."""
    printable = st.binary(max_size=40).filter(lambda b: not set(b) & {0, 10, 13})
    # A header is bytes: a lone surrogate goes as its (invalid) UTF-8 bytes, not as an
    # error in the fuzzer itself.
    last_event_id = (st.none() | query_values().map(
        lambda v: v.encode("utf-8", "surrogatepass")) | printable)

    @given(job=st.sampled_from([*jobs.ids, jobs.other_tenants]) | text, query=_queries(jobs),
           auth=st.sampled_from([None, 0, 1]), header=last_event_id)
    @_settings(examples)
    def request(job: str, query: dict[str, str], auth: int | None, header: bytes | None) -> None:
        headers: dict[str, Any] = dict(stack.auth(auth)) if auth is not None else {}
        if header is not None:
            headers["Last-Event-ID"] = header.strip(b" \t")
        url = f"{stack.base_url}/v1/jobs/{_quoted(job)}/events{_query_string(query)}"
        _sse(tally, url, headers)

    request()


def _queries(jobs: Jobs) -> st.SearchStrategy[dict[str, str]]:
    return st.fixed_dictionaries({}, optional={
        "last_event_id": query_values(),
        "token": st.sampled_from(jobs.tokens) | text, "x": text})


def _quoted(value: str) -> str:
    return quote(value, safe="", errors="surrogatepass")


def _query_string(query: dict[str, str]) -> str:
    return "?" + urlencode(query, errors="surrogatepass") if query else ""


def _settings(examples: int) -> Any:
    return settings(max_examples=examples, phases=[Phase.generate], database=None,
                    deadline=None, suppress_health_check=list(HealthCheck))


def _session(tally: Tally, target: str, url: str, headers: dict[str, str] | None,
             frames: list[str | bytes]) -> None:
    started = time.monotonic()
    detail = f"{target}: {url[:300]} headers={headers} frames={[f[:200] for f in frames]!r}"
    try:
        with connect(url, additional_headers=headers, open_timeout=HANG_S, close_timeout=5,
                     max_size=None) as ws:
            for frame in frames:
                ws.send(frame)
            deadline = started + HANG_S
            while True:
                ws.recv(timeout=max(0.0, deadline - time.monotonic()))
    except InvalidStatus as exc:  # refused before the upgrade
        status = exc.response.status_code
        tally.record(target, f"ws http {status}", time.monotonic() - started)
        if status >= 500:
            tally.server_error(f"{detail} -> HTTP {status}")
        return
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd is not None else 1006
        tally.record(target, f"ws {code}", time.monotonic() - started)
        if code == 1011:
            tally.server_error(f"{detail} -> close 1011 {exc.rcvd}")
        elif code not in CLOSE_CODES:
            tally.broke(f"{detail} -> close {code} {exc.rcvd}")
        return
    except TimeoutError:
        tally.record(target, "ws hang", time.monotonic() - started)
        return tally.hang(f"{detail} -> still open after {HANG_S:.0f} s")
    except (InvalidHandshake, OSError) as exc:
        tally.record(target, "ws broken", time.monotonic() - started)
        return tally.broke(f"{detail} -> {type(exc).__name__}: {exc}")


def _sse(tally: Tally, url: str, headers: dict[str, Any]) -> None:
    target = "GET /v1/jobs/{job_id}/events (hypothesis)"
    started = time.monotonic()
    detail = f"{target}: {url[:300]} headers={headers}"
    try:
        with httpx.stream("GET", url, headers=headers, timeout=HANG_S) as response:
            for _ in response.iter_bytes():
                if time.monotonic() - started > HANG_S:
                    raise httpx.ReadTimeout("the stream outlived the bound")
    except httpx.TimeoutException:
        tally.record(target, "sse hang", time.monotonic() - started)
        return tally.hang(f"{detail} -> no end in {HANG_S:.0f} s")
    except httpx.LocalProtocolError:
        return  # a header value the client itself refuses to send: no request made
    except httpx.HTTPError as exc:
        tally.record(target, "sse broken", time.monotonic() - started)
        return tally.broke(f"{detail} -> {type(exc).__name__}: {exc}")
    tally.record(target, f"http {response.status_code}", time.monotonic() - started)
    if response.status_code >= 500:
        tally.server_error(f"{detail} -> {response.status_code}")
