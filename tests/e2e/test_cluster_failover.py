"""A Redis Cluster under the whole stack, with its parts killed: `tidegate api`, `tidegate
gateway` and two `tidegate worker`s (random:tiny) as processes on a local cluster of 3 masters
and 3 replicas, jobs submitted and followed over the gateway with the Python client.

- A worker SIGKILLed mid-run loses no job: its entries are reclaimed by the other worker. The
  API spreads the jobs over three lane partitions (three slots), and both workers read them all.
- A master SIGKILLed (the one serving the interactive lane's slot), its replica promoted: every
  accepted job ends done and every client's stream equals the stored result; API, gateway and
  workers reconnect by themselves and the stack takes new jobs. Before the kill the master's
  writes are paused until its replica has them all: what this test checks is tidegate's side
  of a failover, not Redis' asynchronous replication window (docs/guides/operations/redis-cluster.md).
- Every script the stack ran touched one slot (MONITOR on every master, the keys of each
  EVAL/EVALSHA hashed), as a cluster requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from redis.cluster import key_slot

from tests.conftest import free_port
from tests.redis_cluster import ClusterServers
from tests.stack_process import TIDEGATE, heartbeat_of, stop, wait_until
from tidegate import keys
from tidegate.producer.client import Client, ServiceUnavailable
from tidegate.redis_conn import connect_sync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SERVED = "random_tiny"
PARTITIONS = 3  # the API spreads jobs over three lane partitions (slots), workers read all
ENV = {"TIDEGATE_MODEL": "random:tiny", "TIDEGATE_VISIBILITY_TIMEOUT_S": "4",
       "TIDEGATE_LOG_LEVEL": "WARNING", "TIDEGATE_TORCH_THREADS": "1",
       "TIDEGATE_MAX_NUM_SEQS": "16", "TIDEGATE_LANE_PARTITIONS": str(PARTITIONS)}


@dataclass
class Proc:
    popen: subprocess.Popen
    log: Path

    def assert_running(self) -> None:
        assert self.popen.poll() is None, (
            f"{self.log.name} exited with {self.popen.returncode}:\n"
            f"{self.log.read_text(errors='replace')[-4000:]}")


@dataclass
class Fleet:
    cluster: ClusterServers
    api: str
    api_proc: Proc
    gateway_proc: Proc
    workers: dict[str, Proc] = field(default_factory=dict)  # worker id -> process

    def all_running(self) -> None:
        for proc in (self.api_proc, self.gateway_proc, *self.workers.values()):
            proc.assert_running()


def _start(log: Path, *args: str, url: str, **env: str) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen([*TIDEGATE, *args],
                                 env={**os.environ, "TIDEGATE_REDIS_URL": url, **ENV, **env},
                                 stdout=out, stderr=subprocess.STDOUT)
    return Proc(popen, log)


@contextlib.contextmanager
def running_fleet(cluster: ClusterServers, logs: Path, workers: int = 2, **env: str
                  ) -> Iterator[Fleet]:
    cluster.flush()
    # Every node as a seed: the client still finds the cluster when one of them is dead.
    url = "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in cluster.startup_nodes)
    api_port, gateway_port = free_port(), free_port()
    api = _start(logs / "api.log", "api", "--port", str(api_port), url=url,
                 TIDEGATE_GATEWAY_URL=f"ws://127.0.0.1:{gateway_port}", **env)
    gateway = _start(logs / "gateway.log", "gateway", "--port", str(gateway_port), url=url,
                     **env)
    fleet = Fleet(cluster, f"http://127.0.0.1:{api_port}", api, gateway)
    try:
        for i in range(workers):
            proc = _start(logs / f"worker{i}.log", "worker", url=url, **env)
            wait_until(lambda p=proc: heartbeat_of(url, p.popen.pid) or p.popen.poll() is not None,
                       "a worker to heartbeat")
            proc.assert_running()
            worker_id = heartbeat_of(url, proc.popen.pid)
            assert worker_id is not None
            fleet.workers[worker_id] = proc
        wait_until(lambda: _ready(fleet.api) and _ready(f"http://127.0.0.1:{gateway_port}"),
                   "the API and the gateway")
        yield fleet
    finally:
        for proc in (*fleet.workers.values(), gateway, api):
            stop(proc.popen)


def _ready(base: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Followed:
    job_id: str | None  # None: never accepted (the API answered 503 throughout)
    streamed: str = ""
    text: str = ""
    status: str = ""
    event_ids: list[int] = field(default_factory=list)


async def _one(client: Client, n: int, max_tokens: int, patience_s: float = 60) -> Followed:
    """Submit (retrying while the API answers 503, as a backend service would), then follow."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            handle = await client.submit(prompt=f"Job {n}: count onwards.", max_tokens=max_tokens,
                                         temperature=0.8, seed=n)
            break
        except ServiceUnavailable:
            if time.monotonic() > deadline:
                return Followed(None)
            await asyncio.sleep(0.2)
    out = Followed(handle.id)
    async for event in handle.events():
        out.event_ids.append(event.id)
        if event.type == "token":
            out.streamed += event.text
    result = await handle.result(timeout_s=120)
    out.text, out.status = result.text or "", result.status
    return out


async def _run(api: str, jobs: int, max_tokens: int, during: object = None) -> list[Followed]:
    """``jobs`` jobs at once; ``during`` (a blocking callable) runs in a thread meanwhile."""
    async with Client(api, timeout_s=60) as client:
        tasks = [asyncio.create_task(_one(client, n, max_tokens)) for n in range(jobs)]
        if during is not None:
            await asyncio.to_thread(during)  # type: ignore[arg-type]
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)


def _check_exact(outcomes: list[Followed]) -> None:
    accepted = [o for o in outcomes if o.job_id is not None]
    assert accepted, "no job was accepted"
    for o in accepted:
        assert o.status == "done", (o.job_id, o.status)
        assert o.streamed == o.text, o.job_id
        assert o.event_ids == list(range(o.event_ids[0], o.event_ids[0] + len(o.event_ids)))


def _nothing_pending(url: str) -> bool:
    client = connect_sync(url, decode_responses=True)
    try:
        for lane, partition in ((lane, p) for lane in keys.LANES for p in range(PARTITIONS)):
            stream = keys.lane_stream(SERVED, lane, partition)
            if client.exists(stream) and client.xpending(stream, keys.CONSUMER_GROUP)["pending"]:
                return False
        return True
    finally:
        client.close()


def _added_per_partition(url: str) -> list[int]:
    """Entries ever added to each interactive lane partition (acked ones are trimmed)."""
    client = connect_sync(url, decode_responses=True)
    try:
        return [client.xinfo_stream(keys.lane_stream(SERVED, "interactive", p))["entries-added"]
                for p in range(PARTITIONS)]
    finally:
        client.close()


class Monitor:
    """MONITOR on every master: each EVAL/EVALSHA the stack sends, with its keys."""

    def __init__(self, ports: list[int]):
        self.scripts: list[list[str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(p,), daemon=True)
                         for p in ports]
        for t in self._threads:
            t.start()

    def _watch(self, port: int) -> None:
        client = redis.Redis(port=port, decode_responses=True)
        with contextlib.suppress(redis.RedisError, OSError), client.monitor() as m:
            while not self._stop.is_set():
                command = m.next_command()["command"].split(" ")
                if command[0].upper() in ("EVAL", "EVALSHA") and len(command) > 2:
                    self.scripts.append(command[3:3 + int(command[2])])

    def close(self) -> None:
        self._stop.set()


def test_a_killed_worker_loses_no_job_and_every_script_touches_one_slot(
        redis_cluster: ClusterServers, tmp_path: Path) -> None:
    # Prefix routing off: every job on the lane's partitions (on, in the failover test below).
    with running_fleet(redis_cluster, tmp_path, TIDEGATE_PREFIX_ROUTING="false") as fleet:
        monitor = Monitor([port for port, _, _ in redis_cluster.masters()])
        victim_id, victim = next(iter(fleet.workers.items()))

        def kill_a_busy_worker() -> None:
            client = connect_sync(redis_cluster.url, decode_responses=True)
            try:  # once the victim runs jobs, mid-run
                wait_until(lambda: any(
                    client.hget(keys.job_hash(k.split("{")[1].split("}")[0]), "worker")
                    == victim_id for k in client.scan_iter(match=keys.job_hash("*"))),
                    "the victim to run a job", timeout_s=60)
            finally:
                client.close()
            victim.popen.kill()

        outcomes = asyncio.run(_run(fleet.api, jobs=24, max_tokens=300,
                                    during=kill_a_busy_worker))
        monitor.close()
        _check_exact(outcomes)
        assert all(o.job_id is not None for o in outcomes)
        wait_until(lambda: _nothing_pending(redis_cluster.url), "no entry pending", 30)
        assert all(n > 0 for n in _added_per_partition(redis_cluster.url))  # spread by the API
        del fleet.workers[victim_id]
        fleet.all_running()
    # Every script call named keys of one slot (Redis refuses others: none was refused).
    assert len(monitor.scripts) > 24
    crossing = [k for k in monitor.scripts if len({key_slot(x.encode()) for x in k}) > 1]
    assert crossing == []
    # The job scripts (enqueue, claim, event writes) keyed by the job's hash tag.
    assert any(k and k[0].startswith("tidegate:job:{") for k in monitor.scripts)


def test_a_master_killed_and_its_replica_promoted_loses_no_accepted_job(
        redis_cluster: ClusterServers, tmp_path: Path) -> None:
    lane = keys.lane_stream(SERVED, "interactive", 0)
    with running_fleet(redis_cluster, tmp_path) as fleet:
        killed: list[int] = []

        def fail_over_the_lane_master() -> None:
            time.sleep(1.0)  # jobs queued and running
            port = redis_cluster.master_for_key(lane)
            master = redis.Redis(port=port)
            master.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
            offset = master.info("replication")["master_repl_offset"]
            [replica] = redis_cluster.replicas_of(port)
            replica_client = redis.Redis(port=replica)
            wait_until(lambda: replica_client.info("replication").get(
                "slave_repl_offset", -1) >= offset, "the replica to catch up", 10)
            replica_client.close()
            master.close()
            killed.append(redis_cluster.kill_master_of(lane))

        outcomes = asyncio.run(_run(fleet.api, jobs=30, max_tokens=200,
                                    during=fail_over_the_lane_master))
        assert killed and redis_cluster.master_for_key(lane) != killed[0]
        _check_exact(outcomes)
        assert sum(o.job_id is not None for o in outcomes) >= 30 * 0.9  # few 503s, if any
        fleet.all_running()
        # The stack goes on by itself: new jobs run on the promoted replica's slots.
        after = asyncio.run(_run(fleet.api, jobs=6, max_tokens=16))
        _check_exact(after)
        assert all(o.job_id is not None for o in after)
        wait_until(lambda: _nothing_pending(redis_cluster.url), "no entry pending", 30)
