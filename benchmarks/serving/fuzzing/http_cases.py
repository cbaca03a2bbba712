"""Every HTTP operation of the served OpenAPI document, driven by schemathesis-generated cases
(valid ones and ones that break the schema), each sent to the real server and judged: an
answer below 500 within the bound, never a 5xx or a hang.

A job that a valid ``POST /v1/jobs`` queued is cancelled at once (through the API, counted as a
request too), so the worker is not left with thousands of generated jobs to run; the
OpenAI routes wait for their jobs, whose size the tiny model's 2048-token context bounds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tidegate.benchmarks.serving.fuzzing.stack import FuzzStack
from tidegate.benchmarks.serving.fuzzing.tally import Tally

HANG_S = 30.0  # no answer (headers and whole body) within this: a hang


def operations(stack: FuzzStack) -> Iterator[Any]:
    """The document's HTTP operations (WebSocket upgrades are the socket fuzzers')."""
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        if not operation.definition.raw.get("x-websocket"):
            yield operation


def fuzz_http(stack: FuzzStack, tally: Tally, *, examples: int) -> None:
    """``examples`` cases per operation and generation mode (positive, negative)."""
    session = requests.Session()
    jobs: list[str] = []  # ids of the jobs accepted so far
    for operation in operations(stack):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(stack, tally, session, operation, mode, examples, jobs)


def _fuzz_operation(stack: FuzzStack, tally: Tally, session: requests.Session, operation: Any,
                    mode: GenerationMode, examples: int, jobs: list[str]) -> None:
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck), derandomize=False)
    def send(case: Any) -> None:
        nonlocal calls
        calls += 1
        # Most calls carry a tenant's key (to get past auth); every 8th goes with whatever
        # the case has (none, or a generated header).
        headers = None if calls % 8 == 0 else stack.auth(calls % 2)
        _aim(case, calls, jobs)
        _send(stack, tally, session, operation, case, headers, jobs)

    try:
        send()
    except Unsatisfiable:  # no input to break: an operation without parameters or a body
        if mode is GenerationMode.POSITIVE:
            raise


def _aim(case: Any, calls: int, jobs: list[str]) -> None:
    """Point some cases at what exists, so they get past the lookup: a random job id or model
    name is almost always a 404, which says nothing about what lies behind it."""
    if "job_id" in (case.path_parameters or {}) and jobs and calls % 2:
        case.path_parameters["job_id"] = jobs[calls % len(jobs)]
    if isinstance(case.body, dict) and "model" in case.body and calls % 4:
        case.body["model"] = "tidegate"


def _send(stack: FuzzStack, tally: Tally, session: requests.Session, operation: Any, case: Any,
          headers: dict[str, str] | None, jobs: list[str]) -> None:
    target = f"{operation.method.upper()} {operation.path}"
    started = time.monotonic()
    try:
        response = case.call(base_url=stack.base_url, session=session, headers=headers,
                             timeout=(5, HANG_S))
    except requests.Timeout:
        tally.record(target, "http hang", time.monotonic() - started)
        return tally.hang(f"{target}: no answer in {HANG_S:.0f} s\n{_describe(case)}")
    except requests.RequestException as exc:
        tally.record(target, "http broken", time.monotonic() - started)
        return tally.broke(f"{target}: {type(exc).__name__}: {exc}\n{_describe(case)}")
    latency = time.monotonic() - started
    status = response.status_code
    tally.record(target, f"http {status}", latency)
    if status >= 500:
        if status == 504 and _own_deadline(case) and "deadline" in response.text:
            tally.deadline_answers += 1  # the deadline it asked for passed before a worker ran it
        else:
            tally.server_error(f"{target} -> {status} {response.text[:500]}\n{_describe(case)}")
    if target == "POST /v1/jobs" and status == 202:
        jobs.append(response.json()["id"])
        _cancel(stack, tally, session, jobs[-1], headers)


def _cancel(stack: FuzzStack, tally: Tally, session: requests.Session, job_id: str,
            headers: dict[str, str] | None) -> None:
    started = time.monotonic()
    response = session.post(f"{stack.base_url}/v1/jobs/{job_id}/cancel",
                            headers=headers or stack.auth(), timeout=(5, HANG_S))
    tally.record("POST /v1/jobs/{job_id}/cancel", f"http {response.status_code}",
                 time.monotonic() - started)
    if response.status_code >= 500:
        tally.server_error(f"cancel {job_id} -> {response.status_code} {response.text[:500]}")


def _own_deadline(case: Any) -> bool:
    body = case.body if isinstance(case.body, dict) else {}
    return "timeout_s" in body or "deadline_ms" in body


def _describe(case: Any) -> str:
    try:
        return case.as_curl_command()
    except Exception:  # a case that cannot be spelled as curl (binary body ...): its parts
        return repr({"path": case.path_parameters, "query": case.query,
                     "headers": case.headers, "body": case.body})[:1500]
