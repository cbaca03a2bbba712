"""A client that rides out outages the way a careful user's code does.

``PatientClient`` submits with an ``Idempotency-Key`` and retries until the API answers (so a
submit lost in a Redis outage or a dropped connection makes one job, never two), follows a job
over the gateway's WebSocket or SSE route and reconnects after any drop with the id of the last
event it received, and reads the stored result, retrying while Redis is away. Each job's events
go through a ``StreamCheck``; nothing is retried past ``patience_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlencode

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from tidegate.benchmarks.harness.load.stream_check import StreamCheck

RETRY_S = 0.3  # between attempts while a service is away
# A stream quiet this long is looked into: if the job ended meanwhile, long enough ago that its
# last events must have arrived, the stream stalled (a breach: the client would wait for ever)
# and the client resumes on a new connection.
QUIET_S = 10.0
# How long after its end a job's final event must have reached a live follower. A job that
# ended just before a quiet stretch ran out (a short job, after a long wait in the queue) may
# still have its events on their way through a loaded gateway: a clean run of the chaos test
# counted such a job as stalled, whose events came a moment later on the same connection.
STALL_AFTER_END_S = 5.0
FINAL_STATUSES = frozenset({"done", "error", "rejected"})
# Close codes that end a follow for good (a malformed request, refused credentials, no job).
REFUSED_CLOSES = frozenset({4400, 4401, 4403, 4404})


class GaveUp(Exception):
    """The service did not answer within the client's patience."""


@dataclass(slots=True)
class Accepted:
    job_id: str
    stream_token: str
    submits: int  # attempts it took (1: accepted at once)


class PatientClient:
    def __init__(self, api_url: str, gateway_url: str, *, patience_s: float = 300) -> None:
        self.gateway_url = gateway_url.rstrip("/")  # ws://host:port
        self.patience_s = patience_s
        self.http = httpx.AsyncClient(base_url=api_url, timeout=30,
                                      limits=httpx.Limits(max_connections=64))
        self.sse = httpx.AsyncClient(base_url=self.gateway_url.replace("ws://", "http://"),
                                     timeout=httpx.Timeout(30, read=None),
                                     limits=httpx.Limits(max_connections=None))
        # Answers other than 200/202 by route and status ("submit 503"), failed connections
        # as "submit down": what the outages cost, and any 5xx that is not an outage's 503.
        self.answers: Counter[str] = Counter()

    async def close(self) -> None:
        await self.http.aclose()
        await self.sse.aclose()

    async def submit(self, body: dict, key: str) -> Accepted:
        """Submit until accepted (202, or 200 for a retry the first try had made); any other
        4xx is the request's fault and ends it."""
        deadline = time.monotonic() + self.patience_s
        for attempt in itertools.count(1):
            try:
                r = await self.http.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            except httpx.TransportError:
                r = None
            self._note("submit", r)
            if r is not None and r.status_code in (200, 202):
                got = r.json()
                return Accepted(got["id"], got["stream_token"], attempt)
            if r is not None and r.status_code not in (409, 429, 500, 502, 503, 504):
                raise GaveUp(f"submit answered {r.status_code}: {r.text[:200]}")
            await self._wait(deadline, "submit")
        raise AssertionError("unreachable")

    async def result(self, job_id: str) -> dict:
        """``GET /v1/jobs/{id}`` once it is final."""
        deadline = time.monotonic() + self.patience_s
        while True:
            try:
                r = await self.http.get(f"/v1/jobs/{job_id}")
            except httpx.TransportError:
                r = None
            self._note("result", r)
            if r is not None and r.status_code == 200 and r.json()["status"] in FINAL_STATUSES:
                return r.json()
            if r is not None and r.status_code not in (200, 500, 502, 503, 504):
                raise GaveUp(f"GET answered {r.status_code}: {r.text[:200]}")
            await self._wait(deadline, "result")

    async def stalled_since_end(self, job_id: str) -> bool:
        """Whether the API says the job ended at least ``STALL_AFTER_END_S`` ago (False if it
        cannot tell now). A job without timings (rejected) counts from when it was asked."""
        try:
            r = await self.http.get(f"/v1/jobs/{job_id}")
        except httpx.TransportError:
            return False
        if r.status_code != 200 or r.json()["status"] not in FINAL_STATUSES:
            return False
        got = r.json()
        timings, created = got.get("timings"), got.get("created_ms")
        if not timings or created is None:
            return True
        ended_s = (created + timings["total_ms"]) / 1000  # the server's clock: wall time
        return time.time() - ended_s >= STALL_AFTER_END_S

    async def follow_ws(self, job: Accepted, check: StreamCheck) -> int:
        """Follow over the WebSocket until the final event; returns the reconnects it took."""
        deadline, reconnects = time.monotonic() + self.patience_s, -1
        while not check.done:
            reconnects += 1
            url = f"{self.gateway_url}/v1/jobs/{job.job_id}/stream?{self._query(job, check)}"
            try:
                async with connect(url, max_size=None, open_timeout=10, close_timeout=2) as ws:
                    while not check.done:
                        try:
                            async with asyncio.timeout(QUIET_S):
                                raw = await ws.recv()
                        except TimeoutError:
                            if await self.stalled_since_end(job.job_id):
                                check.stalled(QUIET_S, time.monotonic())
                                break
                            continue  # queued, running, or just ended: keep listening
                        check.on_raw(raw)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else 1006
                if code in REFUSED_CLOSES:
                    check.problem(f"closed with {code} {exc.rcvd.reason if exc.rcvd else ''}")
                    return reconnects
            except InvalidStatus as exc:  # the gateway answered the upgrade with an error
                if exc.response.status_code not in (500, 502, 503, 504):
                    check.problem(f"WebSocket refused with HTTP {exc.response.status_code}")
                    return reconnects
            except (OSError, InvalidHandshake, TimeoutError):
                pass  # the gateway is down or restarting
            if not check.done:
                await self._wait(deadline, "follow")
        return reconnects

    async def follow_sse(self, job: Accepted, check: StreamCheck) -> int:
        """Follow over Server-Sent Events, resuming with ``Last-Event-ID``."""
        deadline, reconnects = time.monotonic() + self.patience_s, -1
        while not check.done:
            reconnects += 1
            path = f"/v1/jobs/{job.job_id}/events?{self._query(job, check)}"
            try:
                # Quiet means no event: the gateway's keepalive comments do not count.
                async with asyncio.timeout(QUIET_S) as quiet, self.sse.stream("GET", path) as r:
                    if r.status_code in (400, 401, 403, 404):
                        check.problem(f"SSE refused with HTTP {r.status_code}")
                        return reconnects
                    if r.status_code == 200:
                        async for data in sse_data(r):
                            check.on_raw(data)
                            quiet.reschedule(asyncio.get_running_loop().time() + QUIET_S)
            except TimeoutError:  # resumed on a new connection
                if await self.stalled_since_end(job.job_id):
                    check.stalled(QUIET_S, time.monotonic())
            except (httpx.TransportError, OSError):
                pass
            if not check.done:
                await self._wait(deadline, "follow")
        return reconnects

    def _note(self, route: str, r: httpx.Response | None) -> None:
        if r is None:
            self.answers[f"{route} down"] += 1
        elif r.status_code not in (200, 202):
            self.answers[f"{route} {r.status_code}"] += 1

    @staticmethod
    def _query(job: Accepted, check: StreamCheck) -> str:
        params = {"token": job.stream_token}
        if check.last_id:
            params["last_event_id"] = str(check.last_id)
        return urlencode(params)

    @staticmethod
    async def _wait(deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise GaveUp(f"{what}: no answer within the client's patience")
        await asyncio.sleep(RETRY_S)


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """Each event's ``data``, lines ending at LF (or CRLF) as the gateway writes them.

    Not ``aiter_lines``: it also splits at U+0085, U+2028 and the like, which JSON leaves
    unescaped, so an event whose text holds one would be cut in two.
    """
    buffer, data = "", []
    async for chunk in response.aiter_text():
        buffer += chunk
        *lines, buffer = buffer.split("\n")
        for line in lines:
            line = line.removesuffix("\r")
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif not line and data:
                yield "\n".join(data)
                data = []
