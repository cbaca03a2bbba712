"""The chaos client's SSE reading: events split where the format says, and nowhere else."""

from __future__ import annotations

import json

import httpx

from tidegate.benchmarks.harness.load.patient_client import sse_data


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
