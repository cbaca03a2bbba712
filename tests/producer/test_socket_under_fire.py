"""``WS /v1/stream`` against hostile clients (issue 14): refusals whose reason is non-ASCII
text still close with their code, the reason cut to the protocol's 123 bytes."""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.producer.test_socket_submit import frames_until_close

pytestmark = pytest.mark.timeout(30)


async def test_a_refusal_naming_non_ascii_input_still_closes_with_4400(stack: str) -> None:
    async with ws_connect(stack.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(json.dumps({"type": "générer" * 30}))
        frames, code = await frames_until_close(ws)
        reason = ws.close_reason or ""
    assert code == 4400
    assert frames[0]["error"]["fields"][0]["field"] == "type"
    assert frames[0]["error"]["message"].startswith(reason)
    assert 100 < len(reason.encode()) <= 123
