"""The chaos client's SSE reading (events split where the format says, and nowhere else) and
its judgement of a quiet stream (a stall only once the job's last events must have arrived)."""

from __future__ import annotations

import json
import time

import httpx

from tidegate.benchmarks.harness.load.patient_client import (
    QUIET_S,
    STALL_AFTER_END_S,
    PatientClient,
    sse_data,
)


async def test_sse_data_splits_at_newlines_only() -> None:
    # U+0085 (NEL) and U+2028 are line breaks to str.splitlines() and to httpx's aiter_lines,
    # and JSON leaves them unescaped: random-weight models do generate them.
    events = [{"id": 1, "text": "a\x85b"}, {"id": 2, "text": "c\u2028d\x1ce"}]
    body = "retry: 1000\n\n: keepalive\n\n" + "".join(
        f"id: {e['id']}\ndata: {json.dumps(e, ensure_ascii=False)}\r\n\n" for e in events)
    raw = body.encode()
    chunks = [raw[i:i + 7] for i in range(0, len(raw), 7)]  # cut anywhere, mid-character too

    class Chunked(httpx.AsyncByteStream):
        async def __aiter__(self):  # noqa: ANN204 - httpx's stream protocol
            for chunk in chunks:
                yield chunk

    response = httpx.Response(200, stream=Chunked(),
                              headers={"content-type": "text/event-stream; charset=utf-8"})
    assert [json.loads(d) async for d in sse_data(response)] == events


async def test_a_quiet_stream_is_a_stall_only_once_its_job_ended_long_enough_ago() -> None:
    now_ms = time.time() * 1000
    answers = {
        "running": {"status": "running"},
        "ended-long-ago": {"status": "done", "created_ms": now_ms - 20_000,
                           "timings": {"total_ms": 10_000}},
        # Ended 1 s ago: its last events may still be on their way.
        "just-ended": {"status": "done", "created_ms": now_ms - 3_000,
                       "timings": {"total_ms": 2_000}},
        "rejected": {"status": "rejected", "created_ms": now_ms - 1_000},
    }

    def api(request: httpx.Request) -> httpx.Response:
        job = request.url.path.rsplit("/", 1)[1]
        if job == "down":
            raise httpx.ConnectError("the API is away")
        return httpx.Response(200, json=answers[job])

    client = PatientClient("http://api", "ws://gateway")
    await client.http.aclose()
    client.http = httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(api))
    try:
        judged = {job: await client.stalled_since_end(job) for job in [*answers, "down"]}
    finally:
        await client.close()
    assert judged == {"running": False, "ended-long-ago": True, "just-ended": False,
                      "rejected": True, "down": False}
    assert STALL_AFTER_END_S < QUIET_S  # a stall is still caught on the next quiet stretch
