"""The Redis client as the submit path uses it: the commands of concurrent submits share one
pipeline (``Batched``)."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tidegate.redis_conn import is_cluster


class Batched:
    """The Redis client as the submit path uses it: the commands that concurrent submits make
    (GET, SET, HGET, EVALSHA) go to Redis together, in one pipeline.

    What a round trip costs this process in redis-py (a pooled connection, a write, a read:
    about 100 us of CPU) is paid once per pipeline instead of once per command: while one
    pipeline is on its way, the commands made meanwhile wait for the next, so a lone command
    goes at once and a busy API sends dozens per round trip. Each caller still gets its own
    command's answer (or error) only once Redis has run it, exactly as from the client; a
    pipeline is no transaction, so each command is what it was alone (an enqueue is still its
    one atomic script). Any other command goes straight to the client. (Redis Cluster: a
    pipeline may mix slots, redis-py's cluster pipeline splits it by node.)
    """

    def __init__(self, redis: aioredis.Redis):
        self._redis = redis
        self.tidegate_cluster = is_cluster(redis)  # what it wraps (tidegate.redis_conn)
        self._waiting: list[_Command] = []
        self._sender: asyncio.Task[None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("get", args, kwargs)

    async def set(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("set", args, kwargs)

    async def hget(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("hget", args, kwargs)

    async def evalsha(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("evalsha", args, kwargs)

    async def close(self) -> None:
        """Wait for what is on its way (the server stops taking requests first)."""
        if self._sender is not None:
            await asyncio.shield(self._sender)

    async def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        loop = asyncio.get_running_loop()
        command = _Command(method, args, kwargs, loop.create_future())
        self._waiting.append(command)
        if self._sender is None:
            self._sender = loop.create_task(self._send_all())
        return await command.answer

    async def _send_all(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    await self._send(batch)
                except BaseException as exc:  # a bug or a cancellation: no caller waits forever
                    for command in batch:
                        command.fail(exc if isinstance(exc, Exception) else
                                     RedisError("the API is shutting down"))
                    raise
        finally:
            self._sender = None
            for command in self._waiting:  # only after a cancellation: the loop empties it
                command.fail(RedisError("the API is shutting down"))
            self._waiting = []

    async def _send(self, batch: list[_Command]) -> None:
        if len(batch) == 1:
            command = batch[0]
            try:
                answer = await getattr(self._redis, command.method)(*command.args,
                                                                    **command.kwargs)
            except RedisError as exc:
                command.fail(exc)
            else:
                command.succeed(answer)
            return
        pipe = self._redis.pipeline(transaction=False)
        for command in batch:
            if command.method == "evalsha":  # what evalsha sends; a cluster pipeline lacks it
                pipe.execute_command("EVALSHA", *command.args, **command.kwargs)
            else:
                getattr(pipe, command.method)(*command.args, **command.kwargs)
        try:
            answers = await pipe.execute(raise_on_error=False)
        except RedisError as exc:
            for command in batch:
                command.fail(exc)
            return
        for command, answer in zip(batch, answers, strict=True):
            if isinstance(answer, Exception):
                command.fail(answer)
            else:
                command.succeed(answer)


class _Command:
    """One caller's command and the future it awaits."""

    __slots__ = ("answer", "args", "kwargs", "method")

    def __init__(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 answer: asyncio.Future[Any]):
        self.method, self.args, self.kwargs, self.answer = method, args, kwargs, answer

    def succeed(self, answer: Any) -> None:
        if not self.answer.done():  # a caller cancelled meanwhile (its client left) has gone
            self.answer.set_result(answer)

    def fail(self, exc: BaseException) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)
