"""Ending tasks that talk to Redis: cancel them, and cancel again until every one has ended.

On Python 3.11 ``asyncio.wait_for`` returns its result when the operation it waits on finished
just as the cancellation arrived, and the cancellation is lost (3.12 rebuilt ``wait_for`` on
``asyncio.timeout``). redis-py wraps every command's send in ``wait_for`` when the connection has
a socket timeout, which ``tidegate.redis_conn`` always sets, so one ``cancel()`` of a task in
the middle of a Redis command is sometimes dropped and the task runs on (117 of 400 in a probe):
a relay kept streaming after refusing a frame, a watcher outlived its client. Cancelling again
ends it, since each loss needs the same race once more.

``tidegate.redis_cancellation`` now raises the cancellation redis-py's send loses, so a single
``cancel()`` (arq's on SIGTERM, a library's) ends such a task; this helper still guards the
awaits of other libraries that 3.11's ``wait_for`` wraps.
"""

from __future__ import annotations

import asyncio

RECANCEL_S = 0.02  # how long a cancelled task may run on before it is cancelled again


async def cancel_and_wait(*tasks: asyncio.Task[object], recancel_s: float = RECANCEL_S) -> None:
    """Cancel the tasks and return once all have ended, cancelling those still running every
    ``recancel_s``. Their results and exceptions are left for the caller to read."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
