"""The stack as separate processes, each of which can be SIGKILLed and brought back.

``ChaosStack`` is the serving benchmark's ``Stack`` with Redis kept on disk the strict way
(``appendonly yes``, ``appendfsync always``: every acknowledged write survives a SIGKILL) in its
own directory, and with what a chaos run does to it: kill a worker and start another in its
place, kill Redis and start it again on the same port from the same AOF, kill the gateway and
start it again on the same port. Killed processes leave ``procs``; one that leaves it any other
way (it exited by itself) is reported by ``unexpected_exits``; ``holding`` says which workers
hold a job right now, so that a kill can be aimed at one.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import redis

from tidegate import keys
from tidegate.benchmarks.harness.run.processes import free_port, http_ready, log_tail
from tidegate.benchmarks.harness.run.redis_server import redis_answers, redis_argv
from tidegate.benchmarks.harness.run.stack import (
    TIDEGATE,
    Stack,
    StackConfig,
    StackError,
    base_env,
    worker_env,
)

# A worker's consumer name: host-pid-hex6 (tidegate.worker.service.service.new_worker_id).
_CONSUMER_PID = re.compile(r"-(\d+)-[0-9a-f]{6}(?:-|$)")


class ChaosStack(Stack):
    def __init__(self, cfg: StackConfig, logdir: Path) -> None:
        super().__init__(cfg, logdir)
        self.workers_started = 0
        self.exits: list[str] = []  # processes that exited without being killed, with log tails

    # ---------------------------------------------------------------- Redis

    def _start_redis(self) -> None:
        data = self.logdir / "redis-data"
        data.mkdir(exist_ok=True)
        self._start("redis", redis_argv(self.cfg.redis_server, self.redis_port, data,
                                        appendfsync="always", maxclients=60000),
                    dict(os.environ))
        deadline = time.monotonic() + 30
        while not redis_answers(self.redis_port):  # also while it loads the AOF (-LOADING)
            self._alive_or_raise("redis")
            if time.monotonic() > deadline:
                raise StackError("redis-server did not answer within 30 s\n"
                                 + log_tail(self.log_path("redis")))
            time.sleep(0.02)

    def kill_redis(self) -> None:
        self.kill("redis")

    def start_redis(self) -> None:
        self._start_redis()

    # ---------------------------------------------------------------- workers

    def start_worker(self) -> str:
        """One more worker (not waited for: ``ready`` says when it is)."""
        name, port = f"worker{self.workers_started}", free_port()
        self.workers_started += 1
        self.status_ports[name] = port
        self._start(name, [*TIDEGATE, "worker"],
                    worker_env(self.cfg, 0, self.redis_url, port))
        return name

    def start_workers(self) -> None:
        names = [self.start_worker() for _ in range(self.cfg.workers)]
        self.wait_ready(names)

    def worker_names(self) -> list[str]:
        return [n for n in self.procs if n.startswith("worker")]

    # ---------------------------------------------------------------- gateway

    def kill_gateway(self) -> None:
        self.kill("gateway")

    def start_gateway(self) -> None:
        env = base_env(self.cfg, self.redis_url)
        self._start("gateway", [*TIDEGATE, "gateway", "--port", str(self.gateway_port)], env)

    # ---------------------------------------------------------------- any process

    def kill(self, name: str) -> None:
        """SIGKILL: a crash, not a shutdown."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(10)
        self.status_ports.pop(name, None)

    def ready_url(self, name: str) -> str:
        port = {"api": self.api_port, "gateway": self.gateway_port}.get(name)
        return f"http://127.0.0.1:{port or self.status_ports[name]}/readyz"

    def is_ready(self, name: str) -> bool:
        return name in self.procs and http_ready(self.ready_url(name))

    def wait_ready(self, names: list[str], timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.cfg.startup_timeout_s)
        waiting = list(names)
        while waiting:
            for name in waiting:
                self._alive_or_raise(name)
            waiting = [name for name in waiting if not http_ready(self.ready_url(name))]
            if waiting and time.monotonic() > deadline:
                raise StackError(f"{waiting[0]} not ready in time\n"
                                 + log_tail(self.log_path(waiting[0])))
            if waiting:
                time.sleep(0.1)

    def holding(self) -> set[str]:
        """The workers holding a job now: read from a lane or a routed stream by the workers'
        group and not yet acknowledged (empty when Redis cannot say)."""
        pids: set[int] = set()
        client = redis.Redis.from_url(self.redis_url, decode_responses=True,
                                      socket_timeout=2)
        try:
            for pattern in (f"{keys.PREFIX}:lane:*", f"{keys.PREFIX}:routed:*"):
                for stream in client.scan_iter(match=pattern, _type="STREAM"):
                    try:
                        summary = client.xpending(stream, keys.CONSUMER_GROUP)
                    except redis.ResponseError:  # no group yet
                        continue
                    for consumer in summary.get("consumers") or []:
                        found = _CONSUMER_PID.search(consumer["name"])
                        if found and int(consumer["pending"]) > 0:
                            pids.add(int(found.group(1)))
        except redis.RedisError:  # Redis is down (a restart): nobody can be told apart
            return set()
        finally:
            client.close()
        return {name for name, proc in self.procs.items()
                if name.startswith("worker") and proc.pid in pids}

    def unexpected_exits(self) -> list[str]:
        """Names of processes that exited by themselves since the last call (taken out)."""
        gone = [name for name, proc in self.procs.items() if proc.poll() is not None]
        for name in gone:
            proc = self.procs.pop(name)
            self.status_ports.pop(name, None)
            self.exits.append(f"{name} exited with {proc.returncode}:\n"
                              + log_tail(self.log_path(name)))
        return gone

    def _alive_or_raise(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            raise StackError(f"{name} is not running; its log ends:\n"
                             + log_tail(self.log_path(name)))
