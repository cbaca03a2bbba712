"""redis-py's asyncio Redis Cluster client, safe across a failover when many tasks share it.

When a command meets a dead node (or a cluster-down reply), redis-py 5's cluster client calls
its own ``aclose()`` so that the next command reads the slot map again. That closes every
connection of every node, including those other tasks are using at that moment: their commands
then fail inside redis-py (``AttributeError`` on a connection whose writer is gone, or a
pipeline finding no default node), errors no caller can tell from a bug. A worker shares one
client among its intake, event writer, heartbeat and announcer, so every failover broke it.

The same happens when the map is read again: redis-py builds new node objects for every node
and disconnects the old ones at once, in-flight commands and all.

``ClusterClient`` keeps the re-read and drops the mass closes: an ``aclose()`` made by
redis-py itself while running a command only marks the slot map stale (the failed connection
was already dropped by its own command; the next command reads the map again); node objects the
new map replaces or drops are disconnected ``RETIRE_S`` later, once whatever ran on them has
ended (the longest command is a blocking read, well under that). An ``aclose()`` from its owner
closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextvars import ContextVar
from typing import Any

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, NodesManager, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

# Set while redis-py runs a command of this task: an aclose() then comes from redis-py.
_running: ContextVar[bool] = ContextVar("tidegate_cluster_running", default=False)


# How long a node object replaced in the slot map keeps its connections for the commands
# still running on them.
RETIRE_S = 60.0


class ClusterClient(RedisCluster):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nodes_manager.__class__ = _Nodes  # only set_nodes differs
        self._refresh_lock = asyncio.Lock()

    async def refresh_slots(self) -> None:
        """Read the slot map again now (after a failover the client learns it only when a
        command of its own fails): for the connections tidegate keeps outside this client
        (pub/sub, arq). One refresh at a time: two at once corrupt the node table."""
        async with self._refresh_lock:
            try:
                await self.initialize()
                await self.nodes_manager.initialize()
            except RuntimeError as exc:  # redis-py's own re-initialization ran meanwhile
                raise RedisConnectionError(
                    f"cluster slot map changed while reading it: {exc}") from exc

    async def _execute_command(self, target_node: ClusterNode, *args: Any, **kwargs: Any
                               ) -> Any:
        token = _running.set(True)
        try:
            return await super()._execute_command(target_node, *args, **kwargs)
        finally:
            _running.reset(token)

    async def aclose(self) -> None:
        if _running.get():
            self.reread_slots()
            return
        await super().aclose()

    def reread_slots(self) -> None:
        """Read the slot map again before the next command (a caller saw a node fail)."""
        self._initialize = True

    async def publish(self, channel: str, message: str) -> int:
        """Classic PUBLISH (redis-py's cluster client lacks the method): sent to the node of the
        channel's slot, which the cluster broadcasts to every node's subscribers."""
        return await self.execute_command("PUBLISH", channel, message)

    async def spublish(self, channel: str, message: str) -> int:
        """Sharded PUBLISH on the shard serving the channel's slot."""
        return await self.execute_command("SPUBLISH", channel, message)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None
                 ) -> ClusterPipeline:
        super().pipeline(transaction, shard_hint)  # its checks: no transaction, no hint
        return _Pipeline(self)


class _Pipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True
                      ) -> list[Any]:
        token = _running.set(True)
        try:
            return await super().execute(raise_on_error, allow_redirections)
        finally:
            _running.reset(token)


class _Nodes(NodesManager):
    """redis-py's node table, retiring replaced node objects late instead of at once."""

    __slots__ = ()  # redis-py's has slots: the same layout, so the class can be swapped

    def set_nodes(self, old: dict[str, ClusterNode], new: dict[str, ClusterNode],
                  remove_old: bool = False) -> None:
        retired = []
        if remove_old:
            retired += [old.pop(name) for name in list(old) if name not in new]
        for name, node in new.items():
            if name in old and old[name] is not node:
                retired.append(old[name])
            old[name] = node
        if retired:
            task = asyncio.get_running_loop().create_task(_retire(retired))
            _retiring.add(task)
            task.add_done_callback(_retiring.discard)


async def _retire(nodes: list[ClusterNode]) -> None:
    await asyncio.sleep(RETIRE_S)
    for node in nodes:
        with contextlib.suppress(Exception):
            await node.disconnect()


_retiring: set[asyncio.Task[None]] = set()  # referenced until done (the loop keeps weak refs)
