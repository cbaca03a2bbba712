"""The cancellation redis-py's command send loses on Python 3.11, raised again.

redis-py sends every command under ``asyncio.wait_for`` when the connection has a socket
timeout, which ``tidegate.redis_conn`` always sets. On Python 3.11, ``wait_for`` returns
normally when the send it waits on finishes just as a ``cancel()`` of the calling task arrives,
and that cancellation is lost (CPython gh-86296; 3.12 rebuilt ``wait_for`` on
``asyncio.timeout``). A task that loops over Redis commands then runs on as if never cancelled.
arq cancels a running job once on SIGTERM: ``tidegate batch-worker`` stopping in the middle of
a 10,000-line batch went on queuing every line for 15 s, past a pod's 30 s grace period on a
slow host, and once killed, arq's lock on the step held the batch for two more minutes.

The task still counts the request (``Task.cancelling()``), so the send is wrapped: when the
count grew while the send ran, the connection is closed (the command's reply will never be
read, and a reused connection would hand it to the next command) and ``CancelledError`` is
raised, as if the cancellation had landed on the send itself. Nothing changes on 3.12 and later.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio.connection import AbstractConnection

_MARK = "_tidegate_keeps_cancellation"


def keep_cancellation() -> None:
    """Wrap redis-py's asyncio send (every connection class: plain, TLS, Unix socket, cluster
    nodes, arq's) once per process; a no-op on Python 3.12 and later."""
    if sys.version_info >= (3, 12):
        return
    send: Callable[..., Awaitable[None]] = AbstractConnection.send_packed_command
    if getattr(send, _MARK, False):
        return

    @functools.wraps(send)
    async def send_packed_command(self: AbstractConnection, command: Any,
                                  check_health: bool = True) -> None:
        task = asyncio.current_task()
        requested = task.cancelling() if task is not None else 0
        await send(self, command, check_health)
        if task is not None and task.cancelling() > requested:
            await self.disconnect(nowait=True)
            raise asyncio.CancelledError()

    setattr(send_packed_command, _MARK, True)
    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
