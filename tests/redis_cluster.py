"""A real local Redis Cluster for the tests: six redis-server processes (3 masters, 3 replicas)
joined by ``redis-cli --cluster create``, whose masters a test may SIGKILL to force a failover.

Every state change waits on what the nodes themselves report (``CLUSTER INFO``, ``CLUSTER
NODES``, ``INFO replication``) instead of sleeping, so a busy two-core machine is only slower,
never flaky. The session fixtures that own one of these live in ``tests/conftest.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from redis.cluster import key_slot

from tests.ports import free_port

HOST = "127.0.0.1"
NODES = 6
SLOTS = 16384
WAIT_S = 30.0
POLL_S = 0.05

SlotRange = tuple[int, int]


def free_cluster_ports(count: int) -> list[int]:
    """Ports ``p`` with ``p`` and ``p + 10000`` (the cluster bus) both free and distinct."""
    return [free_port(with_bus=True) for _ in range(count)]


def cluster_executables() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)``, or None when either is not installed."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        return None
    return server, cli


@dataclass(frozen=True)
class NodeView:
    """One line of ``CLUSTER NODES`` as one node sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None  # None for a master
    slots: tuple[SlotRange, ...]

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})

    @property
    def is_master(self) -> bool:
        return "master" in self.flags


def _parse_nodes(text: str) -> dict[str, NodeView]:
    views: dict[str, NodeView] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        # "127.0.0.1:30001@40001" or, from 7.0 on, "127.0.0.1:30001@40001,hostname".
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        slots: list[SlotRange] = []
        for entry in fields[8:]:
            if entry.startswith("["):  # a slot being imported or migrated, not served
                continue
            low, _, high = entry.partition("-")
            slots.append((int(low), int(high or low)))
        views[fields[0]] = NodeView(
            node_id=fields[0], port=port, flags=frozenset(fields[2].split(",")),
            master_id=None if fields[3] == "-" else fields[3], slots=tuple(sorted(slots)),
        )
    return views


@dataclass
class ClusterServers:
    """Six redis-server processes in cluster mode the tests own (not redis-py's RedisCluster).

    A test may kill the master of a key (its replica takes over) and restart it (it comes back
    as the new master's replica). AOF keeps each node's data across a restart.
    """

    workdir: Path
    server_exe: str
    cli_exe: str
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    node_ids: dict[int, str] = field(default_factory=dict)

    # -- addresses ---------------------------------------------------------------------------

    @property
    def live_ports(self) -> list[int]:
        return [p for p in self.ports if p in self.procs and self.procs[p].poll() is None]

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """The nodes running now: a client started from these reaches the whole cluster."""
        return [(HOST, port) for port in self.live_ports]

    @property
    def url(self) -> str:
        """``redis+cluster://`` at the first live master: the scheme the app reads as cluster
        mode. A master, not any node, so the address stays a master's until a test kills it."""
        masters = {port for port, _, _ in self.masters()}
        port = next((p for p in self.live_ports if p in masters), self.live_ports[0])
        return f"redis+cluster://{HOST}:{port}"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start six nodes, join them as three master/replica pairs, wait until all is served."""
        self.ports = free_cluster_ports(NODES)
        try:
            for port in self.ports:
                self._spawn(port)
            create = subprocess.run(
                [self.cli_exe, "--cluster", "create", *(f"{HOST}:{p}" for p in self.ports),
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=120,
            )
            if create.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create failed:\n{create.stdout}{create.stderr}")
            for port in self.ports:
                self.node_ids[port] = self._query(port, "CLUSTER", "MYID")
            self._wait(self._healthy, "the new cluster to serve every slot with synced replicas")
        except BaseException:
            self.stop()  # no orphan redis-server outlives a failed start
            raise

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs.clear()

    def kill_master_of(self, key: str) -> int:
        """SIGKILL the master serving ``key``; return once its replica serves the slot and every
        surviving node reports the cluster ok. Returns the killed node's port."""
        slot = key_slot(key.encode())
        port = self.master_for_key(key)
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)
        self.procs[port] = proc  # kept (exited) so that restart() knows the node was ours

        def promoted() -> bool:
            views = self._views()
            dead_id = self.node_ids[port]
            for seen in views.values():
                owner = _owner(seen, slot)
                # Every survivor must have given up on the dead node and agree on the new owner.
                if owner is None or owner.port == port or not seen[dead_id].failing:
                    return False
            return self._consistent(views) and self._all_ok()

        self._wait(promoted, f"a replica to take over slot {slot} from the killed master {port}")
        return port

    def restart(self, port: int) -> None:
        """Start a killed node again from its own dir and nodes.conf: it rejoins as a replica."""
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            raise RuntimeError(f"node {port} is running")
        self._spawn(port)
        self._wait(self._healthy, f"node {port} to rejoin the cluster as a synced replica")

    def flush(self) -> None:
        """Bring back every killed node, wait until the cluster is whole, then empty it.

        Tests share one session cluster: the next test must find six nodes and no keys.
        """
        for port in self.ports:
            if port not in self.live_ports:
                self._spawn(port)
        self._wait(self._healthy, "the cluster to be whole before flushing it")
        for port, _, _ in self.masters():
            client = self._client(port)
            client.flushall()
            # The replica gets the FLUSHALL too before a test reads from it or fails over to it.
            client.execute_command("WAIT", 1, int(WAIT_S * 1000))
            client.close()

    # -- topology, read live -----------------------------------------------------------------

    def masters(self) -> list[tuple[int, str, list[SlotRange]]]:
        """``(port, node id, slot ranges)`` of each master serving slots, by its first slot."""
        view = self._views()[self.live_ports[0]]
        served = [v for v in view.values() if v.is_master and v.slots and not v.failing]
        served.sort(key=lambda v: v.slots[0])
        return [(v.port, v.node_id, list(v.slots)) for v in served]

    def replicas_of(self, master_port: int) -> list[int]:
        """Ports of the healthy replicas of the master on ``master_port``."""
        view = self._views()[self.live_ports[0]]
        master_id = self.node_ids[master_port]
        return sorted(v.port for v in view.values()
                      if v.master_id == master_id and not v.failing)

    def master_for_key(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        slot = key_slot(key.encode())
        owner = _owner(self._views()[self.live_ports[0]], slot)
        if owner is None:
            raise RuntimeError(f"no live master serves slot {slot}")
        return owner.port

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self, port: int) -> None:
        node_dir = self.workdir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.server_exe, "--port", str(port), "--bind", HOST, "--protected-mode", "no",
             "--dir", str(node_dir), "--logfile", str(node_dir / "redis.log"),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             # A dead master is flagged after 1 s, and any replica may replace it at once
             # however long ago it last heard from it (validity factor 0).
             "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0",
             "--cluster-allow-reads-when-down", "no",
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
             # Redis 7 waits 5 s before a diskless full sync to batch replicas: we have one each.
             "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self._wait(lambda: self._query(port, "PING"), f"redis-server to start on port {port}")

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(host=HOST, port=port, decode_responses=True,
                           socket_timeout=2, socket_connect_timeout=2)

    def _query(self, port: int, *args: str) -> str:
        # Sent as separate words, so redis-py applies no reply parser and the text comes raw.
        # A connection per question: one to a node killed since would only raise.
        client = self._client(port)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def _views(self) -> dict[int, dict[str, NodeView]]:
        """``CLUSTER NODES`` as each live node sees it, by that node's port."""
        return {p: _parse_nodes(self._query(p, "CLUSTER", "NODES")) for p in self.live_ports}

    def _all_ok(self) -> bool:
        for port in self.live_ports:
            info = dict(line.split(":", 1) for line in
                        self._query(port, "CLUSTER", "INFO").splitlines() if ":" in line)
            if (info.get("cluster_state") != "ok"
                    or info.get("cluster_slots_ok") != str(SLOTS)
                    or info.get("cluster_known_nodes") != str(NODES)):
                return False
        return True

    def _consistent(self, views: dict[int, dict[str, NodeView]]) -> bool:
        """Every live node agrees which node serves which slots."""
        maps = {frozenset((v.node_id, v.slots) for v in view.values() if v.is_master and v.slots
                          and not v.failing)
                for view in views.values()}
        return len(maps) == 1

    def _healthy(self) -> bool:
        """All six nodes up, seen up by all, three masters with one synced replica each."""
        if len(self.live_ports) != NODES or not self._all_ok():
            return False
        views = self._views()
        if not self._consistent(views):
            return False
        for view in views.values():
            if any(v.failing for v in view.values()):
                return False
            masters = [v for v in view.values() if v.is_master and v.slots]
            replicas = [v for v in view.values() if not v.is_master]
            if len(masters) != NODES // 2 or len(replicas) != NODES // 2:
                return False
            if {r.master_id for r in replicas} != {m.node_id for m in masters}:
                return False
        for port in self.live_ports:
            client = self._client(port)
            try:
                repl = client.info("replication")
            finally:
                client.close()
            if repl["role"] == "slave" and (repl.get("master_link_status") != "up"
                                            or repl.get("master_sync_in_progress")):
                return False
        return True

    def _wait(self, ready: Callable[[], object], what: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except (redis.RedisError, KeyError, IndexError):
                pass  # a node still loading or just killed: ask again
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL_S)


def _owner(view: dict[str, NodeView], slot: int) -> NodeView | None:
    """The non-failing master serving ``slot`` in one node's view."""
    for node in view.values():
        if node.is_master and not node.failing and any(lo <= slot <= hi for lo, hi in node.slots):
            return node
    return None


def start_cluster(workdir: Path) -> ClusterServers:
    """A started cluster in ``workdir``, or a pytest skip when redis is not installed."""
    exes = cluster_executables()
    if exes is None:
        pytest.skip("redis-server and redis-cli are needed: apt-get install -y redis-server")
    cluster = ClusterServers(workdir=workdir, server_exe=exes[0], cli_exe=exes[1])
    cluster.start()
    return cluster
