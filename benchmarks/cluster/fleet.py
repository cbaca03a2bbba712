"""Fleet benchmark (issue 24): the queue-and-stream layer on ONE Redis server against a Redis
Cluster of 3 masters, driven through the whole stack, side by side in one run.

Each mode starts a fresh fleet: Redis (one ``redis-server``, or 3 cluster masters joined by
``redis-cli --cluster create``; AOF ``everysec`` as production runs it), ``--apis`` x ``tidegate
api``, ``--gateways`` x ``tidegate gateway`` and ``--workers`` x ``tidegate worker``
(``random:tiny`` on the CPU, one torch thread, prefix routing off: every job on the shared
lane). Everything but the Redis URL is the same in both modes (``redis://`` against
``redis+cluster://``).

Load: ``--client-procs`` processes (one asyncio loop each) submit jobs at their share of an
offered rate (jobs/s, evenly spaced) over HTTP to the APIs round robin, and open
``--watchers-per-job`` WebSocket watchers per job on the stream URL the API answers (API i
hands out gateway i % G). A step offers its rate for ``--warmup`` + ``--duration`` seconds;
what the watchers receive and what every process spends is measured over the last
``--duration`` seconds; then the step's jobs drain (every job must end with its ``done``
event; what is left after ``--drain`` seconds is cancelled and reported). Rates: ``--rates``, or
a ramp from ``--start-rate`` doubling until the delivered token events/s stops rising by more
than 5%. Capacity = the most token events/s delivered; one more step then runs at 80% of the
job rate sustained at capacity (its tokens/s over ``--max-tokens``: every job runs to it), where
the delivery latency is the figure of merit.

Latency: a probe process writes synthetic token events for a few probe jobs every
``--probe-interval-ms`` exactly as a worker writes them (``EventLog.write``: stored, then
published; sharded pub/sub on a cluster), each carrying its publish time, and watches them
through every gateway: publish -> receive over the real path while the fleet loads it.

CPU: every process's user+system time over each step's window (``/proc``), by group (Redis per
shard, APIs, gateways, workers, clients, probe) and the machine's busy share (``/proc/stat``), so
what saturates is visible; the sizing figures (token events/s per Redis shard, events per gateway
CPU-second, jobs per API CPU-second) are derived from these. Where the fleet (workers, gateways,
clients, the machine) saturates before Redis, the capacity is the fleet's: the busiest process
says which, and ``projected_redis_limit_token_events_per_s`` extrapolates Redis' own limit from
its CPU per event (when its busiest master was at least 20% busy).

    python -m tidegate.benchmarks.cluster.fleet                                    # both modes, ramp, defaults
    python -m tidegate.benchmarks.cluster.fleet --modes server cluster --workers 2 --apis 1 --gateways 1 \\
        --client-procs 1 --rates 5 10 --duration 5 --max-tokens 32  # a 2-core smoke run
    python -m tidegate.benchmarks.cluster.plot_fleet benchmarks/results/cluster/fleet.json

Output: ``--out`` (JSON: config, machine, per-mode steps, capacity, the 80% step, the
cluster/server ratio) and a table on stdout. Logs of every process go to ``--logdir``
(default: a fresh temp dir), their tails printed when something fails.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.load.http import Pool  # noqa: E402
from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.harness.run.processes import (  # noqa: E402
    cpu_seconds,
    die_with_parent,
    free_port,
    http_ready,
    log_tail,
    machine_busy,
    spawn,
    stop_processes,
)
from tidegate.benchmarks.harness.run.redis_server import redis_answers, redis_argv  # noqa: E402
from tidegate.benchmarks.harness.run.stack import worker_counters  # noqa: E402

TIDEGATE = [sys.executable, "-m", "tidegate"]
MODEL = "random:tiny"
BUCKET_S = 0.1  # the clients count what they receive in buckets this long
RAMP_GAIN = 1.05  # the ramp stops when a doubling gains less than this
LATENCY_TARGET_MS = 50.0
# Redis' limit is projected from its CPU at capacity only where its busiest master was this busy
PROJECT_MIN_REDIS_PCT = 20.0
RATIO_TARGET = 2.5
FINAL_TYPES = (b'"type":"done"', b'"type":"error"', b'"type":"rejected"')
ID_RE = re.compile(rb'"id":(\d+)')
WORDS = ("harbour bridge river market garden engine library winter summer letter station "
         "mountain village doctor kitchen window museum ocean forest signal lantern").split()


class FleetError(RuntimeError):
    """A fleet process died, never got ready, or a step could not run; the message says
    which, with log tails."""


# ============================================================================ small helpers


def raise_file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.5))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_ports(count: int) -> list[int]:
    """Ports p with p and its cluster bus p + 10000 free (and below 65536)."""
    chosen: list[int] = []
    taken: set[int] = set()
    rng = random.Random()
    for _ in range(20_000):
        port = rng.randrange(20000, 55535)
        if {port, port + 10000} & taken:
            continue
        if bindable(port) and bindable(port + 10000):
            chosen.append(port)
            taken |= {port, port + 10000}
            if len(chosen) == count:
                return chosen
    raise FleetError(f"found only {len(chosen)} of {count} free port pairs for the cluster")


WORKER_COUNTERS = ("tidegate_events_written", "tidegate_event_writes",
                   "tidegate_generation_tokens", "tidegate_engine_step_seconds",
                   "tidegate_publisher_cpu_seconds")


# ============================================================================ the fleet


@dataclass
class FleetConfig:
    mode: str  # "server" | "cluster"
    shards: int
    replicas: int
    workers: int
    apis: int
    gateways: int
    max_num_seqs: int
    max_batched: int
    torch_threads: int
    kv_cache_gb: float
    stream_interval_ms: float | None
    max_backlog: int | None
    redis_server: str
    redis_cli: str
    startup_timeout_s: float
    extra_env: dict[str, str] = field(default_factory=dict)


class Fleet:
    """Redis (server or cluster), the APIs, the gateways and the workers of one mode; every
    process logs to ``logdir`` and is stopped by ``close`` (also on Ctrl-C)."""

    def __init__(self, cfg: FleetConfig, logdir: Path) -> None:
        self.cfg, self.logdir = cfg, logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis_ports: dict[str, int] = {}  # name -> port
        self.redis_roles: dict[str, str] = {}  # name -> "master" | "replica"
        self.api_ports: list[int] = []
        self.gateway_ports: list[int] = []
        self.worker_ports: dict[str, int] = {}
        self.redis_url = ""

    # -------------------------------------------------------------- start

    def start(self) -> None:
        t0 = time.monotonic()
        if self.cfg.mode == "cluster":
            self._start_cluster()
        else:
            self._start_server()
        self.gateway_ports = [free_port() for _ in range(self.cfg.gateways)]
        self.api_ports = [free_port() for _ in range(self.cfg.apis)]
        base = self._base_env()
        # Workers first: they take longest to be ready (torch import, the model).
        for i in range(self.cfg.workers):
            port = free_port()
            name = f"worker{i}"
            self.worker_ports[name] = port
            env = {**base, "TIDEGATE_METRICS_PORT": str(port),
                   "TIDEGATE_TORCH_THREADS": str(self.cfg.torch_threads),
                   "TIDEGATE_MAX_NUM_SEQS": str(self.cfg.max_num_seqs),
                   "TIDEGATE_MAX_NUM_BATCHED_TOKENS": str(self.cfg.max_batched),
                   "TIDEGATE_KV_CACHE_GB": str(self.cfg.kv_cache_gb),
                   "TIDEGATE_DEVICE": "cpu", "OMP_NUM_THREADS": str(self.cfg.torch_threads)}
            if self.cfg.stream_interval_ms is not None:
                env["TIDEGATE_STREAM_INTERVAL_MS"] = str(self.cfg.stream_interval_ms)
            self._start(name, [*TIDEGATE, "worker"], env)
        for i, port in enumerate(self.gateway_ports):
            self._start(f"gateway{i}", [*TIDEGATE, "gateway", "--port", str(port)], base)
        for i, port in enumerate(self.api_ports):
            gw = self.gateway_ports[i % len(self.gateway_ports)]
            env = {**base, "TIDEGATE_GATEWAY_URL": f"ws://127.0.0.1:{gw}"}
            self._start(f"api{i}", [*TIDEGATE, "api", "--port", str(port)], env)
        urls = {f"api{i}": f"http://127.0.0.1:{p}/readyz" for i, p in enumerate(self.api_ports)}
        urls |= {f"gateway{i}": f"http://127.0.0.1:{p}/readyz"
                 for i, p in enumerate(self.gateway_ports)}
        urls |= {name: f"http://127.0.0.1:{p}/readyz" for name, p in self.worker_ports.items()}
        self._wait_ready(urls)
        self._wait_heartbeats()
        self.startup_s = round(time.monotonic() - t0, 1)

    def _base_env(self) -> dict[str, str]:
        env = {**os.environ, "TIDEGATE_REDIS_URL": self.redis_url,
               "TIDEGATE_MODEL": MODEL, "TIDEGATE_LOG_LEVEL": "WARNING",
               "TIDEGATE_HOST": "127.0.0.1", "TIDEGATE_PREFIX_ROUTING": "false",
               "TIDEGATE_DEFAULT_TIMEOUT_S": "900",
               # a step's leftovers are cancelled: nothing worth a long drain at the end
               "TIDEGATE_DRAIN_TIMEOUT_S": "5"}
        for name in ("TIDEGATE_API_KEYS", "TIDEGATE_API_KEYS_FILE", "TIDEGATE_ADMIN_KEYS"):
            env.pop(name, None)  # auth off: the clients hold no key
        if self.cfg.max_backlog is not None:
            env["TIDEGATE_MAX_BACKLOG"] = str(self.cfg.max_backlog)
        return {**env, **self.cfg.extra_env}

    def _redis_argv(self, port: int, data: Path) -> list[str]:
        return [*redis_argv(self.cfg.redis_server, port, data, appendfsync="everysec",
                            maxclients=60000), "--tcp-backlog", "4096"]

    def _spawn_redis(self, name: str, argv: list[str], port: int) -> None:
        self._start(name, argv, dict(os.environ))
        self.redis_ports[name] = port
        deadline = time.monotonic() + 20
        while not redis_answers(port):
            self.check_alive()
            if time.monotonic() > deadline:
                raise FleetError(f"{name} did not answer within 20 s\n"
                                 + log_tail(self.log_path(name)))
            time.sleep(0.05)

    def _start_server(self) -> None:
        port = free_port()
        data = self.logdir / "redis-data" / "shard0"
        data.mkdir(parents=True, exist_ok=True)
        self._spawn_redis("redis0", self._redis_argv(port, data), port)
        self.redis_roles["redis0"] = "master"
        for r in range(self.cfg.replicas):
            rport = free_port()
            rdata = self.logdir / "redis-data" / f"replica{r}"
            rdata.mkdir(parents=True, exist_ok=True)
            self._spawn_redis(f"redis0-replica{r}", [*self._redis_argv(rport, rdata),
                                                     "--replicaof", "127.0.0.1", str(port),
                                                     "--repl-diskless-sync-delay", "0"], rport)
            self.redis_roles[f"redis0-replica{r}"] = "replica"
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        if self.cfg.replicas:
            self._wait(lambda: self._replicas_synced(list(self.redis_ports.values())),
                       "the replica to sync")

    def _start_cluster(self) -> None:
        import redis

        n = self.cfg.shards * (1 + self.cfg.replicas)
        ports = cluster_ports(n)
        for i, port in enumerate(ports):
            data = self.logdir / "redis-data" / f"node{port}"
            data.mkdir(parents=True, exist_ok=True)
            argv = [*self._redis_argv(port, data), "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000",
                    "--repl-diskless-sync-delay", "0"]
            self._spawn_redis(f"node{i}", argv, port)
        cli = shutil.which(self.cfg.redis_cli) or self.cfg.redis_cli
        create = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", str(self.cfg.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=120)
        (self.logdir / "cluster-create.log").write_text(create.stdout + create.stderr)
        if create.returncode != 0:
            raise FleetError(f"redis-cli --cluster create failed:\n{create.stdout[-2000:]}"
                             f"{create.stderr[-2000:]}")

        def cluster_ok() -> bool:
            for port in ports:
                c = redis.Redis(port=port, decode_responses=True, socket_timeout=2)
                try:
                    info = c.cluster("info")
                finally:
                    c.close()
                if (info.get("cluster_state") != "ok"
                        or int(info.get("cluster_slots_ok", 0)) != 16384
                        or int(info.get("cluster_known_nodes", 0)) != n):
                    return False
            return True

        self._wait(cluster_ok, "cluster_state:ok on every node")

        def roles() -> tuple[list[tuple[int, int]], list[int]] | None:
            """([(first slot, port)] of the masters serving slots, [replica ports]) once every
            node sees the same ``shards`` masters and ``shards * replicas`` replicas (redis-cli
            makes the replicas after the join: they show as empty masters for a moment)."""
            seen = set()
            for port in ports:
                c = redis.Redis(port=port, decode_responses=True, socket_timeout=2)
                try:
                    text = c.execute_command("CLUSTER", "NODES")  # two words: the raw text
                finally:
                    c.close()
                masters, replicas = [], []
                for line in text.splitlines():
                    f = line.split()
                    if len(f) < 8:
                        continue
                    node_port = int(f[1].split("@")[0].rsplit(":", 1)[1])
                    slots = [s for s in f[8:] if not s.startswith("[")]
                    if "master" in f[2].split(",") and slots:
                        masters.append((min(int(s.split("-")[0]) for s in slots), node_port))
                    elif "slave" in f[2].split(","):
                        replicas.append(node_port)
                seen.add((tuple(sorted(masters)), tuple(sorted(replicas))))
            if len(seen) != 1:
                return None
            masters_t, replicas_t = seen.pop()
            if (len(masters_t) != self.cfg.shards
                    or len(replicas_t) != self.cfg.shards * self.cfg.replicas):
                return None
            return list(masters_t), list(replicas_t)

        self._wait(lambda: roles() is not None, "every node to agree on masters and replicas")
        if self.cfg.replicas:
            self._wait(lambda: self._replicas_synced(ports), "the replicas to sync")
        found = roles()
        assert found is not None
        masters, replicas = found
        by_port = {port: name for name, port in self.redis_ports.items()}
        renamed: dict[str, subprocess.Popen] = {}
        ports_by_name: dict[str, int] = {}
        for i, (_, port) in enumerate(sorted(masters)):
            renamed[f"redis{i}"] = self.procs.pop(by_port[port])
            ports_by_name[f"redis{i}"] = port
            self.redis_roles[f"redis{i}"] = "master"
        for i, port in enumerate(sorted(replicas)):
            renamed[f"redis-replica{i}"] = self.procs.pop(by_port[port])
            ports_by_name[f"redis-replica{i}"] = port
            self.redis_roles[f"redis-replica{i}"] = "replica"
        for old, port in self.redis_ports.items():  # keep the log names findable
            new = next(k for k, p in ports_by_name.items() if p == port)
            with contextlib.suppress(OSError):
                self.log_path(old).rename(self.log_path(new))
        self.procs = {**renamed, **self.procs}
        self.redis_ports = ports_by_name
        seeds = ",".join(f"127.0.0.1:{p}" for _, p in sorted(masters))
        self.redis_url = f"redis+cluster://{seeds}"

    def _replicas_synced(self, ports: list[int]) -> bool:
        import redis

        for port in ports:
            c = redis.Redis(port=port, decode_responses=True, socket_timeout=2)
            try:
                repl = c.info("replication")
            finally:
                c.close()
            if repl.get("role") == "slave" and (repl.get("master_link_status") != "up"
                                                or repl.get("master_sync_in_progress")):
                return False
        return True

    def _wait(self, ready, what: str, timeout_s: float = 60) -> None:  # noqa: ANN001
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                if ready():
                    return
            except (redis.RedisError, OSError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise FleetError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.1)

    def _wait_ready(self, urls: dict[str, str]) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = dict(urls)
        while waiting:
            self.check_alive()
            waiting = {name: url for name, url in waiting.items() if not http_ready(url)}
            if waiting and time.monotonic() > deadline:
                name = next(iter(waiting))
                raise FleetError(f"{name} not ready within {self.cfg.startup_timeout_s:.0f} s "
                                 f"(also waiting: {sorted(waiting)})\n"
                                 + log_tail(self.log_path(name)))
            if waiting:
                time.sleep(0.25)

    def _wait_heartbeats(self) -> None:
        """Every worker's heartbeat key is in Redis (scanned on every master of a cluster)."""
        from tidegate import keys
        from tidegate.redis_conn import connect_sync

        client = connect_sync(self.redis_url, decode_responses=True)
        try:
            pattern = keys.worker_heartbeat("*")
            self._wait(lambda: len(list(client.scan_iter(match=pattern, count=1000)))
                       >= self.cfg.workers, f"{self.cfg.workers} worker heartbeats",
                       timeout_s=self.cfg.startup_timeout_s)
        finally:
            client.close()

    # -------------------------------------------------------------- running

    def log_path(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.procs[name] = spawn(argv, env, self.log_path(name))

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise FleetError(f"{name} exited with {proc.returncode}; its log "
                                 f"({self.log_path(name)}) ends:\n"
                                 + log_tail(self.log_path(name), 25))

    def groups(self) -> dict[str, dict[str, int]]:
        """Process group -> {name: pid}."""
        out: dict[str, dict[str, int]] = {"redis": {}, "redis_replica": {}, "api": {},
                                          "gateway": {}, "worker": {}}
        for name, proc in self.procs.items():
            if name.startswith("redis"):
                group = "redis" if self.redis_roles.get(name) == "master" else "redis_replica"
            else:
                group = name.rstrip("0123456789")
            out[group][name] = proc.pid
        return out

    def worker_counters(self) -> dict[str, dict[str, float]]:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.worker_ports))) as pool:
            futures = {name: pool.submit(worker_counters, port, WORKER_COUNTERS)
                       for name, port in self.worker_ports.items()}
            return {name: f.result() for name, f in futures.items()}

    def close(self) -> None:
        """Workers first (nothing runs by now: they drain at once), then APIs and gateways,
        then Redis."""
        workers = [p for n, p in self.procs.items() if n.startswith("worker")]
        servers = [p for n, p in self.procs.items()
                   if n.startswith("api") or n.startswith("gateway")]
        redis_procs = [p for n, p in self.procs.items() if n.startswith(("redis", "node"))]
        for stage in (workers, servers, redis_procs):
            stop_processes(stage, timeout_s=35)
        self.procs.clear()


# ============================================================================ WebSocket client


class WsConn(asyncio.Protocol):
    """A minimal WebSocket client connection: the handshake, then the server's unmasked frames
    parsed by hand (the ``websockets`` library costs several times more Python per frame, and
    the clients share the machine with the fleet). Text frames go to ``sink.on_text``; the
    close code to ``sink.close_code``; ``closed`` resolves when the connection ends."""

    def __init__(self, request: bytes, sink: Any) -> None:
        self.request, self.sink = request, sink
        self.buf = b""
        self.frag = b""
        self.handshaken = False
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:  # noqa: ANN001
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        if not self.handshaken:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if not sep:
                self.buf = buf
                return
            if b" 101 " not in head.split(b"\r\n", 1)[0]:
                self.sink.handshake_error = head.split(b"\r\n", 1)[0].decode(errors="replace")
                self._abort()
                return
            self.handshaken, buf = True, rest
        pos, n = 0, len(buf)
        while n - pos >= 2:
            b0, length = buf[pos], buf[pos + 1] & 0x7F
            head = 2
            if length == 126:
                if n - pos < 4:
                    break
                length, head = int.from_bytes(buf[pos + 2:pos + 4], "big"), 4
            elif length == 127:
                if n - pos < 10:
                    break
                length, head = int.from_bytes(buf[pos + 2:pos + 10], "big"), 10
            if n - pos < head + length:
                break
            payload = buf[pos + head:pos + head + length]
            pos += head + length
            opcode, fin = b0 & 0x0F, b0 & 0x80
            if opcode in (0, 1):
                if not fin:
                    self.frag += payload
                    continue
                if self.frag:
                    payload, self.frag = self.frag + payload, b""
                self.sink.on_text(payload)
            elif opcode == 8:
                self.sink.close_code = (int.from_bytes(payload[:2], "big")
                                        if len(payload) >= 2 else 1005)
                self._send(0x88, payload[:2])  # echo the close, then hang up
                self._abort(graceful=True)
                return
            elif opcode == 9:
                self._send(0x8A, payload)
        self.buf = buf[pos:]

    def _send(self, first: int, payload: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        mask = os.urandom(4)
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.transport.write(bytes([first, 0x80 | len(payload)]) + mask + body)

    def _abort(self, graceful: bool = False) -> None:
        if self.transport is not None:
            if graceful:
                self.transport.close()
            else:
                self.transport.abort()

    def connection_lost(self, exc) -> None:  # noqa: ANN001
        if not self.closed.done():
            self.closed.set_result(None)


def ws_request(host: str, port: int, path: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\n\r\n").encode()


class StreamWatch:
    """One watcher of one job's stream: connects, takes the events, resumes after a cut (with
    ``last_event_id``) up to ``max_reconnects`` times; ``run`` returns once the final event came
    (True) or it gave up (False). Subclasses count what arrives (``on_event``)."""

    max_reconnects = 5

    def __init__(self, host: str, port: int, path: str, token: str | None) -> None:
        self.host, self.port, self.path, self.token = host, port, path, token
        self.last_id = 0
        self.final = False
        self.close_code: int | None = None
        self.handshake_error: str | None = None
        self.reconnects = 0
        self.conn: WsConn | None = None

    def on_text(self, payload: bytes) -> None:
        m = ID_RE.search(payload)
        if m is not None:
            event_id = int(m.group(1))
            if event_id <= self.last_id:
                return
            self.last_id = event_id
        if any(t in payload for t in FINAL_TYPES):
            self.final = True
        self.on_event(payload)

    def on_event(self, payload: bytes) -> None:
        pass

    async def run(self) -> bool:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            query = []
            if self.last_id:
                query.append(f"last_event_id={self.last_id}")
            if self.token:
                query.append(f"token={self.token}")
            path = self.path + ("?" + "&".join(query) if query else "")
            self.close_code, self.handshake_error = None, None
            try:
                _, conn = await loop.create_connection(
                    lambda: WsConn(ws_request(self.host, self.port, path), self),  # noqa: B023
                    self.host, self.port)
                self.conn = conn
                try:
                    await conn.closed
                finally:
                    if conn.transport is not None:
                        conn.transport.abort()
            except OSError:
                pass
            if self.final:
                return True
            if self.close_code in (4401, 4403, 4404, 4400):
                return False
            failures += 1
            self.reconnects += 1
            if failures > self.max_reconnects:
                return False
            await asyncio.sleep(min(1.0, 0.05 * 2 ** failures))

    def abort(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.abort()


# ============================================================================ load clients


@dataclass
class StepPlan:
    index: int
    rate: float  # jobs/s offered by all client processes together
    t_start: float  # wall time of the first submit
    submit_s: float  # submits for this long
    drain_s: float  # then waits this long at most for the jobs to end


class StepCounts:
    """What one client process saw in one step, by bucket of BUCKET_S from the step's start."""

    def __init__(self, n_buckets: int) -> None:
        self.n = n_buckets
        self.token_events = [0] * n_buckets  # delivered to watchers (every watcher)
        self.tokens = [0] * n_buckets
        self.done = [0] * n_buckets  # jobs whose final event reached watcher 0
        self.submitted = [0] * n_buckets  # POSTs sent
        self.accepted = [0] * n_buckets  # 202s

    def bucket(self, t_rel: float) -> int:
        return min(self.n - 1, max(0, int(t_rel / BUCKET_S)))


class JobWatch(StreamWatch):
    def __init__(self, host: str, port: int, path: str, token: str | None, job: JobRecord,
                 counts: StepCounts, t0: float, first: bool) -> None:
        super().__init__(host, port, path, token)
        self.job, self.counts, self.t0, self.first = job, counts, t0, first
        self.tokens = 0

    def on_event(self, payload: bytes) -> None:
        if self.first and self.job.first_frame == 0.0:
            self.job.first_frame = time.time()
        if b'"type":"token"' in payload:
            now = time.time()
            b = self.counts.bucket(now - self.t0)
            at = payload.rfind(b'"token_ids":[')
            n = payload.count(b",", at, payload.find(b"]", at)) + 1 if at >= 0 else 1
            self.counts.token_events[b] += 1
            self.counts.tokens[b] += n
            self.tokens += n
            if self.first and self.job.first_token == 0.0:
                self.job.first_token = now
        elif self.final and self.first:
            now = time.time()
            self.job.done = now
            self.job.status = ("done" if b'"type":"done"' in payload else
                               "error" if b'"type":"error"' in payload else "rejected")
            self.counts.done[self.counts.bucket(now - self.t0)] += 1


@dataclass(slots=True)
class JobRecord:
    submit: float = 0.0  # wall time the POST went out
    accepted: float = 0.0
    first_frame: float = 0.0  # watcher 0's first event (the replayed ``queued``)
    first_token: float = 0.0
    done: float = 0.0
    status: str = ""
    job_id: str = ""
    api: int = 0


def client_proc(index: int, procs: int, api_ports: list[int], spread_over: list[int],
                watchers: int, max_tokens: int, max_inflight: int, conn,  # noqa: ANN001
                log_path: str) -> None:
    die_with_parent()
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    raise_file_limit()
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    try:
        asyncio.run(_client_main(index, procs, api_ports, spread_over, watchers, max_tokens,
                                 max_inflight, conn))
    except Exception:
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send({"error": traceback.format_exc()})


async def _client_main(index: int, procs: int, api_ports: list[int], spread_over: list[int],
                       watchers: int, max_tokens: int, max_inflight: int,
                       conn) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    pools = [Pool("127.0.0.1", port, size=256) for port in api_ports]
    serial = 0
    conn.send({"ready": True})
    while True:
        cmd = await loop.run_in_executor(None, conn.recv)
        if cmd[0] == "stop":
            break
        plan: StepPlan = cmd[1]
        result = await _client_step(index, procs, pools, spread_over, plan, watchers,
                                    max_tokens, max_inflight, serial)
        serial += 1
        conn.send(result)
    for pool in pools:
        pool.close()


async def _client_step(index: int, procs: int, pools: list[Pool], spread_over: list[int],
                       plan: StepPlan, watchers: int, max_tokens: int, max_inflight: int,
                       serial: int) -> dict[str, Any]:
    """One step's submits and watchers. ``spread_over``: gateway ports to spread the watchers
    over by job (the stream URL's path and token kept); empty: the stream URL as answered."""
    loop = asyncio.get_running_loop()
    t0 = plan.t_start
    n_buckets = int(math.ceil((plan.submit_s + plan.drain_s + 5) / BUCKET_S)) + 1
    counts = StepCounts(n_buckets)
    jobs: list[JobRecord] = []
    tasks: set[asyncio.Task] = set()
    errors: dict[str, int] = {}
    lag: list[float] = []
    all_watches: list[JobWatch] = []
    skipped = 0
    short = 0  # jobs done whose watcher 0 got fewer tokens than max_tokens
    rng = random.Random(index * 7919 + serial)

    def err(kind: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1

    async def one_job(n: int) -> None:
        nonlocal short
        api = (n * procs + index) % len(pools)
        rec = JobRecord(submit=time.time(), api=api)
        jobs.append(rec)
        counts.submitted[counts.bucket(rec.submit - t0)] += 1
        words = " ".join(rng.choice(WORDS) for _ in range(6))
        body = json.dumps({"prompt": f"Tell me about the {words} ({n}).",
                           "max_tokens": max_tokens, "temperature": 0.8,
                           "ignore_eos": True}).encode()
        try:
            resp = await pools[api].request("POST", "/v1/jobs", body)
        except (OSError, asyncio.IncompleteReadError, Exception) as exc:  # noqa: BLE001
            err(f"submit:{type(exc).__name__}")
            return
        if resp.status not in (200, 202):
            err(f"http:{resp.status}")
            return
        rec.accepted = time.time()
        counts.accepted[counts.bucket(rec.accepted - t0)] += 1
        answer = json.loads(resp.body)
        rec.job_id = answer["id"]
        url = urlsplit(answer["stream_url"])
        port = spread_over[(n * procs + index) % len(spread_over)] if spread_over else url.port
        ws = [JobWatch(url.hostname or "127.0.0.1", port or 80, url.path,
                       answer.get("stream_token"), rec, counts, t0, k == 0)
              for k in range(watchers)]
        all_watches.extend(ws)
        ok = await asyncio.gather(*(w.run() for w in ws))
        if not all(ok):
            err("watch_failed")
            for w in ws:
                if w.handshake_error:
                    err(f"handshake:{w.handshake_error[:40]}")
        if rec.status == "done" and ws[0].tokens != max_tokens:
            short += 1

    # Evenly spaced over all processes: process i submits at (i + procs * n) / rate.
    interval = procs / plan.rate if plan.rate > 0 else float("inf")
    next_t = t0 + index / plan.rate if plan.rate > 0 else float("inf")
    end = t0 + plan.submit_s
    n = 0
    while next_t < end:
        delay = next_t - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.time()
        while next_t <= now and next_t < end:  # catch up when the loop was late
            lag.append((now - next_t) * 1000)
            if len(tasks) >= max_inflight:
                skipped += 1
            else:
                task = loop.create_task(one_job(n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            n += 1
            next_t += interval
    deadline = end + plan.drain_s
    while tasks and time.time() < deadline:
        await asyncio.wait(set(tasks), timeout=max(0.05, min(1.0, deadline - time.time())))
    unfinished = [rec.job_id for rec in jobs if rec.job_id and not rec.done]
    if tasks:
        for w in all_watches:
            w.abort()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Cancel what is still queued or running, so the next step starts clean.
        async def cancel(rec_id: str, api: int) -> None:
            with contextlib.suppress(Exception):
                await pools[api].request("POST", f"/v1/jobs/{rec_id}/cancel")
        recs = [rec for rec in jobs if rec.job_id and not rec.done]
        for i in range(0, len(recs), 200):
            await asyncio.gather(*(cancel(r.job_id, r.api) for r in recs[i:i + 200]))
    finished = [rec for rec in jobs if rec.done]
    return {
        "counts": {"token_events": counts.token_events, "tokens": counts.tokens,
                   "done": counts.done, "submitted": counts.submitted,
                   "accepted": counts.accepted},
        "jobs": [(rec.submit - t0, rec.accepted - rec.submit if rec.accepted else -1.0,
                  rec.first_token - rec.submit if rec.first_token else -1.0,
                  rec.done - rec.submit if rec.done else -1.0,
                  rec.first_frame - rec.accepted if rec.first_frame and rec.accepted else -1.0)
                 for rec in jobs],
        "statuses": {s: sum(1 for r in finished if r.status == s)
                     for s in {r.status for r in finished}},
        "errors": errors, "skipped": skipped, "unfinished": len(unfinished), "short": short,
        "reconnects": sum(w.reconnects for w in all_watches),
        "lag_ms_p99": pct(lag, 0.99) or 0.0, "lag_ms_max": round(max(lag), 2) if lag else 0.0,
    }


# ============================================================================ latency probe


class ProbeWatch(StreamWatch):
    max_reconnects = 1000

    def __init__(self, host: str, port: int, path: str, samples: list[tuple[float, float]],
                 gateway: int) -> None:
        super().__init__(host, port, path, None)
        self.samples, self.gateway = samples, gateway
        self.received = 0

    def on_event(self, payload: bytes) -> None:
        if b'"type":"token"' not in payload:
            return
        now = time.time_ns()
        at = payload.find(b'"text":"') + 8
        sent = int(payload[at:payload.index(b'"', at)])
        self.samples.append((now / 1e9, (now - sent) / 1e6))
        self.received += 1


def probe_proc(redis_url: str, gateway_ports: list[int], jobs: int, interval_ms: float,
               conn, log_path: str) -> None:  # noqa: ANN001
    die_with_parent()
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise_file_limit()
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    try:
        asyncio.run(_probe_main(redis_url, gateway_ports, jobs, interval_ms, conn))
    except Exception:
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send({"error": traceback.format_exc()})


def probe_job_ids(n: int) -> list[str]:
    """``n`` fresh job ids on distinct live channels (so the probe crosses every shard it can)."""
    from tidegate import keys

    ids: list[str] = []
    used: set[int] = set()
    salt = os.urandom(4).hex()
    k = 0
    while len(ids) < n:
        job = f"probe-{salt}-{k}"
        k += 1
        shard = keys.live_shard(job)
        if shard in used and len(used) < keys.LIVE_SHARDS:
            continue
        used.add(shard)
        ids.append(job)
    return ids


async def _probe_main(redis_url: str, gateway_ports: list[int], n_jobs: int,
                      interval_ms: float, conn) -> None:  # noqa: ANN001
    from tidegate import keys
    from tidegate.events.event_log import EventBatch, EventLog
    from tidegate.protocol import DoneEvent, JobRequest, Timings, Usage, token_event_json
    from tidegate.redis_conn import connect

    loop = asyncio.get_running_loop()
    redis = connect(redis_url)
    log = EventLog(redis)
    jobs = probe_job_ids(n_jobs)
    for job in jobs:
        spec = JobRequest(prompt="probe").to_job(model="probe", default_timeout_s=3600,
                                                 job_id=job)
        await redis.hset(keys.job_hash(job), mapping={"status": "running",
                                                      "job": spec.model_dump_json()})
        await redis.expire(keys.job_hash(job), 3 * 3600)
    samples: list[tuple[float, float]] = []
    watches = [ProbeWatch("127.0.0.1", port, f"/v1/jobs/{job}/stream", samples, g)
               for job in jobs for g, port in enumerate(gateway_ports)]
    runs = [loop.create_task(w.run()) for w in watches]
    next_id = dict.fromkeys(jobs, 1)
    stop = asyncio.Event()
    errors = 0

    async def publish() -> None:
        nonlocal errors
        tick = interval_ms / 1000
        next_t = time.monotonic()
        while not stop.is_set():
            batch = EventBatch()
            for job in jobs:
                event_id = next_id[job]
                next_id[job] += 1
                raw = token_event_json(event_id, job, event_id - 1, str(time.time_ns()), [0])
                batch.add_event(job, event_id, "token", raw)
            try:
                await log.write(batch)
            except Exception as exc:  # noqa: BLE001 - a failed write is counted, ids move on
                errors += 1
                print(f"probe write failed: {exc!r}", flush=True)
            next_t += tick
            now = time.monotonic()
            if next_t < now:  # late: skip the ticks missed rather than bursting
                next_t = now + tick - ((now - next_t) % tick)
            await asyncio.sleep(next_t - now)

    publisher = loop.create_task(publish())
    # Ready once every watcher has had an event.
    deadline = time.monotonic() + 60
    while any(w.received == 0 for w in watches):
        if time.monotonic() > deadline:
            raise RuntimeError("probe watchers got no event within 60 s: "
                               f"{[(w.port, w.close_code, w.handshake_error) for w in watches]}")
        await asyncio.sleep(0.05)
    conn.send({"ready": True, "jobs": jobs, "watchers": len(watches)})
    while True:
        cmd = await loop.run_in_executor(None, conn.recv)
        if cmd[0] == "window":
            a, b = cmd[1], cmd[2]
            lat = [ms for t, ms in samples if a <= t <= b]
            samples[:] = [(t, ms) for t, ms in samples if t > b]
            conn.send({"latencies": lat, "errors": errors,
                       "reconnects": sum(w.reconnects for w in watches),
                       "expected_per_s": len(watches) * 1000 / interval_ms})
        elif cmd[0] == "stop":
            break
    stop.set()
    await publisher
    batch = EventBatch()
    for job in jobs:
        batch.add_event(job, next_id[job], "done", DoneEvent(
            id=next_id[job], job_id=job, finish_reason="length", text="",
            usage=Usage(prompt_tokens=1, completion_tokens=0, total_tokens=1),
            timings=Timings(queue_ms=0, ttft_ms=0, total_ms=0, decode_tokens_per_s=0),
        ).model_dump_json())
    with contextlib.suppress(Exception):
        await log.write(batch)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 5)
    for w in watches:
        w.abort()
    for r in runs:
        r.cancel()
    with contextlib.suppress(Exception):
        await redis.aclose()


# ============================================================================ one mode


class Driver:
    """The client and probe processes of one mode, and the steps they run."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet, logdir: Path) -> None:
        self.args, self.fleet, self.logdir = args, fleet, logdir
        self.ctx = mp.get_context("spawn")
        self.clients: list[tuple[Any, Any]] = []  # (process, connection)
        self.probe: tuple[Any, Any] | None = None

    def start(self) -> None:
        a = self.args
        for i in range(a.client_procs):
            parent, child = self.ctx.Pipe()
            spread = ([] if a.apis % a.gateways == 0 else self.fleet.gateway_ports)
            p = self.ctx.Process(target=client_proc, name=f"fleet-client{i}", daemon=True, args=(
                i, a.client_procs, self.fleet.api_ports, spread, a.watchers_per_job,
                a.max_tokens, a.max_inflight, child, str(self.logdir / f"client{i}.log")))
            p.start()
            self.clients.append((p, parent))
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=probe_proc, name="fleet-probe", daemon=True, args=(
            self.fleet.redis_url, self.fleet.gateway_ports, a.probe_jobs, a.probe_interval_ms,
            child, str(self.logdir / "probe.log")))
        p.start()
        self.probe = (p, parent)
        for name, (proc, c) in [*((f"client{i}", pc) for i, pc in enumerate(self.clients)),
                                ("probe", self.probe)]:
            answer = self._recv(proc, c, 90, name)
            if "error" in answer:
                raise FleetError(f"{name} failed to start:\n{answer['error']}")

    def _recv(self, proc, conn, timeout_s: float, name: str) -> dict:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise FleetError(f"{name} exited with {proc.exitcode}; its log ends:\n"
                                 + log_tail(self.logdir / f"{name}.log", 25))
            self.fleet.check_alive()
            if time.monotonic() > deadline:
                raise FleetError(f"{name} did not answer within {timeout_s:.0f} s; its log:\n"
                                 + log_tail(self.logdir / f"{name}.log", 25))
        return conn.recv()

    def pids(self) -> dict[str, dict[str, int]]:
        groups = self.fleet.groups()
        groups["client"] = {f"client{i}": p.pid for i, (p, _) in enumerate(self.clients)}
        groups["probe"] = {"probe": self.probe[0].pid} if self.probe else {}
        return groups

    def snapshot(self) -> dict[str, Any]:
        t = time.time()
        cpu = {}
        for members in self.pids().values():
            for name, pid in members.items():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    cpu[name] = cpu_seconds(pid)
        busy, total = machine_busy()
        return {"t": t, "cpu": cpu, "busy": busy, "total": total}

    def run_step(self, index: int, rate: float, label: str) -> dict[str, Any]:
        t_call = time.monotonic()
        row = self._run_step(index, rate, label)
        row["step_wall_s"] = round(time.monotonic() - t_call, 1)
        return row

    def _run_step(self, index: int, rate: float, label: str) -> dict[str, Any]:
        a = self.args
        warm, dur = a.warmup, a.duration
        t_start = time.time() + 0.3
        plan = StepPlan(index, rate, t_start, warm + dur, a.drain)
        for _, c in self.clients:
            c.send(("step", plan))
        a0, b0 = t_start + warm, t_start + warm + dur
        sleep_until(a0)
        self.fleet.check_alive()
        s0, w0 = self.snapshot(), self.fleet.worker_counters()
        sleep_until(b0)
        s1, w1 = self.snapshot(), self.fleet.worker_counters()
        outs = []
        for i, (proc, c) in enumerate(self.clients):
            out = self._recv(proc, c, a.drain + 60, f"client{i}")
            if "error" in out:
                raise FleetError(f"client{i} failed:\n{out['error']}")
            outs.append(out)
        proc, c = self.probe
        c.send(("window", a0, b0))
        probe = self._recv(proc, c, 30, "probe")
        self.fleet.check_alive()
        return summarize_step(label, rate, plan, outs, probe, s0, s1, w0, w1, self.pids(),
                              self.args, self.fleet)

    def stop(self) -> None:
        for _, c in [*self.clients, *([self.probe] if self.probe else [])]:
            with contextlib.suppress(Exception):
                c.send(("stop",))
        for proc, _ in [*self.clients, *([self.probe] if self.probe else [])]:
            proc.join(3)  # a client in the middle of a step (Ctrl-C) reads no command
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
        self.clients, self.probe = [], None


def summarize_step(label: str, rate: float, plan: StepPlan, outs: list[dict], probe: dict,
                   s0: dict, s1: dict, w0: dict, w1: dict, pids: dict[str, dict[str, int]],
                   args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    k = args.watchers_per_job
    lo = int(round(args.warmup / BUCKET_S))
    hi = int(round((args.warmup + args.duration) / BUCKET_S))
    dur = args.duration

    def total(name: str) -> int:
        return sum(sum(o["counts"][name][lo:hi]) for o in outs)

    delivered = total("token_events")
    tokens = total("tokens")
    done = total("done")
    submitted_all = sum(sum(o["counts"]["submitted"]) for o in outs)
    accepted_all = sum(sum(o["counts"]["accepted"]) for o in outs)
    window_s = s1["t"] - s0["t"]
    cpu: dict[str, Any] = {}
    for group, members in pids.items():
        per = {name: round(100 * (s1["cpu"].get(name, 0) - s0["cpu"].get(name, 0)) / window_s, 1)
               for name in members if name in s0["cpu"] and name in s1["cpu"]}
        if per:
            cpu[group] = {"total_pct": round(sum(per.values()), 1),
                          "max_pct": max(per.values()), "per_process": per}
    busy_pct = 100 * (s1["busy"] - s0["busy"]) / max(1e-9, s1["total"] - s0["total"])

    def wsum(name: str) -> float:
        return sum(w1.get(w, {}).get(name, 0) - w0.get(w, {}).get(name, 0) for w in w1)

    jobs = [j for o in outs for j in o["jobs"] if args.warmup <= j[0] < args.warmup + dur]
    ttft = [j[2] * 1000 for j in jobs if j[2] >= 0]
    e2e = [j[3] * 1000 for j in jobs if j[3] >= 0]
    submit_ms = [j[1] * 1000 for j in jobs if j[1] >= 0]
    watch_ms = [j[4] * 1000 for j in jobs if j[4] >= 0]
    lat = probe["latencies"]
    errors: dict[str, int] = {}
    for o in outs:
        for kind, n in o["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    statuses: dict[str, int] = {}
    for o in outs:
        for s, n in o["statuses"].items():
            statuses[s] = statuses.get(s, 0) + n
    redis_cpu_s = sum(s1["cpu"].get(n, 0) - s0["cpu"].get(n, 0) for n in pids["redis"])
    gw_cpu_s = sum(s1["cpu"].get(n, 0) - s0["cpu"].get(n, 0) for n in pids["gateway"])
    api_cpu_s = sum(s1["cpu"].get(n, 0) - s0["cpu"].get(n, 0) for n in pids["api"])
    accepted_win = total("accepted")
    produced = delivered / k
    row = {
        "label": label, "offered_jobs_per_s": round(rate, 2),
        "submitted_jobs_per_s": round(total("submitted") / dur, 2),
        "accepted_jobs_per_s": round(accepted_win / dur, 2),
        "completed_jobs_per_s": round(done / dur, 2),
        "delivered_token_events_per_s": round(delivered / dur, 1),
        "produced_token_events_per_s": round(produced / dur, 1),
        "tokens_per_s": round(tokens / k / dur, 1),
        "tokens_per_event": round(tokens / delivered, 2) if delivered else None,
        "watch_opens_per_s": round(accepted_win * k / dur, 1),
        "worker": {  # the workers' own counters (all events, not only tokens)
            "events_written_per_s": round(wsum("events_written") / window_s, 1),
            "event_writes_per_s": round(wsum("event_writes") / window_s, 1),
            "generation_tokens_per_s": round(wsum("generation_tokens") / window_s, 1),
            # share of the window inside engine steps / spent publishing, mean over workers
            "engine_busy_pct": round(100 * wsum("engine_step_seconds") / window_s
                                     / max(1, len(w1)), 1),
            "publisher_cpu_pct": round(100 * wsum("publisher_cpu_seconds") / window_s
                                       / max(1, len(w1)), 1),
        },
        "latency_ms": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
                       "max": round(max(lat), 2) if lat else None, "samples": len(lat),
                       "expected_samples": int(probe["expected_per_s"] * dur),
                       "probe_write_errors": probe["errors"],
                       "probe_reconnects": probe["reconnects"]},
        # client-side, jobs submitted in the window: the POST, the 202 -> watcher 0's first
        # event (WebSocket connect + handshake + replay), submit -> first token, -> done
        "jobs_ms": {"submit_p50": pct(submit_ms, 0.5), "submit_p99": pct(submit_ms, 0.99),
                    "watch_open_p50": pct(watch_ms, 0.5), "watch_open_p99": pct(watch_ms, 0.99),
                    "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
                    "e2e_p50": pct(e2e, 0.5), "e2e_p99": pct(e2e, 0.99)},
        "cpu_pct": cpu, "machine_busy_pct": round(busy_pct, 1),
        "per_cpu_second": {
            "token_events_per_redis_cpu_s": round(produced / redis_cpu_s, 1) if redis_cpu_s
            else None,
            "delivered_events_per_gateway_cpu_s": round(delivered / gw_cpu_s, 1) if gw_cpu_s
            else None,
            "jobs_per_api_cpu_s": round(accepted_win / api_cpu_s, 1) if api_cpu_s else None,
        },
        "totals": {"submitted": submitted_all, "accepted": accepted_all,
                   "statuses": statuses, "unfinished": sum(o["unfinished"] for o in outs),
                   "short_jobs": sum(o["short"] for o in outs),
                   "skipped_inflight_cap": sum(o["skipped"] for o in outs),
                   "watch_reconnects": sum(o["reconnects"] for o in outs), "errors": errors},
        "client_lag_ms": {"p99": max(o["lag_ms_p99"] for o in outs),
                          "max": max(o["lag_ms_max"] for o in outs)},
        "window_s": round(window_s, 2),
    }
    busiest = max(((name, pct_) for g, d in cpu.items() for name, pct_ in d["per_process"].items()),
                  key=lambda x: x[1], default=("-", 0))
    row["busiest_process"] = {"name": busiest[0], "cpu_pct": busiest[1]}
    return row


def run_mode(args: argparse.Namespace, mode: str, logdir: Path, deadline: float) -> dict:
    cfg = FleetConfig(mode=mode, shards=1 if mode == "server" else args.shards,
                      replicas=args.replicas, workers=args.workers, apis=args.apis,
                      gateways=args.gateways, max_num_seqs=args.max_num_seqs,
                      max_batched=args.max_batched, torch_threads=args.torch_threads,
                      kv_cache_gb=args.kv_cache_gb,
                      stream_interval_ms=args.stream_interval_ms, max_backlog=args.max_backlog,
                      redis_server=args.redis_server, redis_cli=args.redis_cli,
                      startup_timeout_s=args.startup_timeout)
    mode_dir = logdir / mode
    mode_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(cfg, mode_dir)
    driver = Driver(args, fleet, mode_dir)
    steps: list[dict] = []
    t_mode = time.monotonic()
    try:
        print(f"[{mode}] starting the fleet (logs: {mode_dir})", flush=True)
        fleet.start()
        driver.start()
        print(f"[{mode}] ready in {fleet.startup_s} s: {fleet.redis_url}; "
              f"{cfg.workers} workers, {cfg.apis} APIs, {cfg.gateways} gateways, "
              f"{args.client_procs} client procs", flush=True)
        step_s = 0.3 + args.warmup + args.duration + 3  # + a short drain
        saturated = False
        print_header(mode)

        def room_for(n_steps: int) -> bool:
            per_step = max([step_s, *(s["step_wall_s"] for s in steps)])
            return time.monotonic() + n_steps * per_step + 20 < deadline

        if args.rates:
            for rate in args.rates:
                if steps and not room_for(2):
                    print(f"[{mode}] out of time: skipping the remaining rates", flush=True)
                    break
                steps.append(driver.run_step(len(steps), rate, "rate"))
                print_row(mode, steps[-1])
        else:
            rate = args.start_rate
            while len(steps) < args.max_steps:
                steps.append(driver.run_step(len(steps), rate, "ramp"))
                print_row(mode, steps[-1])
                got = steps[-1]["delivered_token_events_per_s"]
                if len(steps) > 1 and got < RAMP_GAIN * steps[-2]["delivered_token_events_per_s"]:
                    saturated = True  # doubling the offer gained less than 5%
                    break
                if rate * 2 > args.max_rate:
                    print(f"[{mode}] --max-rate reached", flush=True)
                    break
                if not room_for(2):
                    print(f"[{mode}] out of time: ramp stopped", flush=True)
                    break
                rate *= 2
        cap_step = max(steps, key=lambda s: s["delivered_token_events_per_s"])
        at80 = None
        if not args.skip_80:
            # The job rate the fleet sustained at capacity: its tokens/s over the tokens of
            # a job (every job runs to max_tokens). Not the jobs completed in the window: past
            # saturation those lag (many jobs in flight, few ending within the window).
            rate80 = 0.8 * cap_step["tokens_per_s"] / args.max_tokens
            if rate80 > 0:
                at80 = driver.run_step(len(steps), rate80, "80%")
                print_row(mode, at80)
    except KeyboardInterrupt:
        print(f"[{mode}] interrupted: stopping everything", file=sys.stderr, flush=True)
        raise
    except BaseException:
        print(f"[{mode}] FAILED; logs in {mode_dir}", file=sys.stderr, flush=True)
        print_tails(mode_dir)
        raise
    finally:
        t_stop = time.monotonic()
        driver.stop()
        fleet.close()
        print(f"[{mode}] fleet stopped in {time.monotonic() - t_stop:.1f} s", flush=True)
    capacity = cap_step["delivered_token_events_per_s"]
    produced = cap_step["produced_token_events_per_s"]
    shards = cfg.shards
    redis_cpu = cap_step["cpu_pct"].get("redis", {})
    gw_cpu = cap_step["cpu_pct"].get("gateway", {})
    api_cpu = cap_step["cpu_pct"].get("api", {})
    per_redis_cpu_s = cap_step["per_cpu_second"]["token_events_per_redis_cpu_s"]
    if redis_cpu.get("max_pct", 0) < PROJECT_MIN_REDIS_PCT:
        per_redis_cpu_s = None  # Redis nearly idle: its fixed costs (polls, heartbeats) rule
    sizing = {
        "token_events_per_s_per_redis_shard_at_capacity": round(produced / shards, 1),
        # Redis' own limit, extrapolated linearly from its CPU at capacity: every master at
        # 100% of a core (only a figure when the fleet, not Redis, saturated first)
        "projected_redis_limit_token_events_per_s": round(per_redis_cpu_s * shards, 1)
        if per_redis_cpu_s else None,
        "redis_shard_cpu_pct_at_capacity": redis_cpu.get("per_process"),
        "token_events_per_redis_cpu_s": cap_step["per_cpu_second"]["token_events_per_redis_cpu_s"],
        "delivered_events_per_s_per_gateway_at_capacity": round(capacity / cfg.gateways, 1),
        "gateway_cpu_pct_at_capacity": gw_cpu.get("per_process"),
        "delivered_events_per_gateway_cpu_s":
            cap_step["per_cpu_second"]["delivered_events_per_gateway_cpu_s"],
        "jobs_per_s_per_api_at_capacity": round(cap_step["accepted_jobs_per_s"] / cfg.apis, 2),
        "api_cpu_pct_at_capacity": api_cpu.get("per_process"),
        "jobs_per_api_cpu_s": cap_step["per_cpu_second"]["jobs_per_api_cpu_s"],
        "tokens_per_s_per_worker_at_capacity": round(cap_step["tokens_per_s"] / cfg.workers, 1),
        "busiest_process_at_capacity": cap_step["busiest_process"],
    }
    return {
        "mode": mode, "redis_url": fleet.redis_url, "shards": shards, "replicas": cfg.replicas,
        "startup_s": getattr(fleet, "startup_s", None),
        "wall_s": round(time.monotonic() - t_mode, 1), "steps": steps,
        "capacity": {"delivered_token_events_per_s": capacity,
                     "produced_token_events_per_s": produced,
                     "tokens_per_s": cap_step["tokens_per_s"],
                     "completed_jobs_per_s": cap_step["completed_jobs_per_s"],
                     "sustained_jobs_per_s": round(cap_step["tokens_per_s"] / args.max_tokens, 2),
                     "offered_jobs_per_s": cap_step["offered_jobs_per_s"],
                     "step": steps.index(cap_step),
                     # the ramp ended because doubling the offer gained < 5% (with --rates:
                     # because the last rate delivered < 5% more than the one before)
                     "saturated": saturated or (len(steps) >= 2 and (
                         steps[-1]["delivered_token_events_per_s"]
                         < RAMP_GAIN * steps[-2]["delivered_token_events_per_s"]))},
        "at_80pct": at80,
        "latency_at_80pct_ms": at80["latency_ms"] if at80 else None,
        "latency_target_met": (at80["latency_ms"]["p99"] is not None
                               and at80["latency_ms"]["p99"] <= LATENCY_TARGET_MS)
        if at80 else None,
        "sizing": sizing,
    }


# ============================================================================ printing


COLS = ("step", "offer/s", "sub/s", "done/s", "tokEv/s dlv", "tokEv/s prod", "tok/s", "p50ms",
        "p99ms", "redis%", "gw%", "api%", "wrk%", "cli%", "busy%", "unfin", "err")


def print_header(mode: str) -> None:
    print(f"[{mode}] " + " ".join(f"{c:>11}" if i else f"{c:>5}" for i, c in enumerate(COLS)),
          flush=True)


def _cpu(row: dict, group: str) -> str:
    g = row["cpu_pct"].get(group)
    if not g:
        return "-"
    # per-process maximum (what saturates first), and the group's total
    return f"{g['max_pct']:.0f}/{g['total_pct']:.0f}"


def print_row(mode: str, row: dict) -> None:
    lat = row["latency_ms"]
    errs = sum(row["totals"]["errors"].values()) + row["totals"]["skipped_inflight_cap"]
    cells = [row["label"], row["offered_jobs_per_s"], row["submitted_jobs_per_s"],
             row["completed_jobs_per_s"], row["delivered_token_events_per_s"],
             row["produced_token_events_per_s"], row["tokens_per_s"], lat["p50"], lat["p99"],
             _cpu(row, "redis"), _cpu(row, "gateway"), _cpu(row, "api"), _cpu(row, "worker"),
             _cpu(row, "client"), row["machine_busy_pct"], row["totals"]["unfinished"], errs]
    print(f"[{mode}] " + " ".join(f"{str(c):>11}" if i else f"{str(c):>5}"
                                  for i, c in enumerate(cells)), flush=True)


def print_tails(logdir: Path) -> None:
    for path in sorted(logdir.glob("*.log")):
        with contextlib.suppress(OSError):
            if path.stat().st_size == 0:
                continue
        print(f"--- {path.name} (tail) ---\n{log_tail(path, 12)}", file=sys.stderr, flush=True)


def print_summary(out: dict) -> None:
    print("\nsummary (token events/s: produced by the workers = delivered / watchers per job; "
          "CPU % as max-per-process/group-total, 100 = one core)")
    for mode, m in out["modes"].items():
        cap = m["capacity"]
        s = m["sizing"]
        lat = m["latency_at_80pct_ms"] or {}
        print(f"  {mode:7} capacity {cap['delivered_token_events_per_s']:>10} delivered "
              f"({cap['produced_token_events_per_s']} produced, {cap['tokens_per_s']} tokens/s, "
              f"{cap['sustained_jobs_per_s']} jobs/s)"
              f"{'' if cap['saturated'] else ' [NOT saturated]'}"
              f"; at 80%: p50 {lat.get('p50')} ms p99 {lat.get('p99')} ms "
              f"(target <= {LATENCY_TARGET_MS:.0f}: "
              f"{'met' if m['latency_target_met'] else 'NOT met'})")
        print(f"          per Redis shard {s['token_events_per_s_per_redis_shard_at_capacity']} "
              f"token events/s (CPU {s['redis_shard_cpu_pct_at_capacity']}); "
              f"{s['token_events_per_redis_cpu_s']} per Redis CPU-s (Redis limit projected: "
              f"{s['projected_redis_limit_token_events_per_s']}); per gateway "
              f"{s['delivered_events_per_s_per_gateway_at_capacity']} events/s, "
              f"{s['delivered_events_per_gateway_cpu_s']} per CPU-s; per API "
              f"{s['jobs_per_s_per_api_at_capacity']} jobs/s, {s['jobs_per_api_cpu_s']} per CPU-s;"
              f" busiest {s['busiest_process_at_capacity']}")
    if "ratio" in out:
        r = out["ratio"]
        print(f"  cluster/server capacity: {r['cluster_over_server']}x "
              f"(target >= {RATIO_TARGET}: {'met' if r['target_met'] else 'NOT met'})"
              + (f"; Redis' own limits projected from their CPU: "
                 f"{r['projected_redis_limit_cluster_over_server']}x"
                 if "projected_redis_limit_cluster_over_server" in r else ""))


# ============================================================================ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--mode", choices=("server", "cluster"), help="one mode only")
    ap.add_argument("--modes", nargs="+", choices=("server", "cluster"),
                    default=["server", "cluster"], help="modes to run in turn (default both)")
    ap.add_argument("--shards", type=int, default=3, help="cluster masters (default 3)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="replicas per master (cluster) or of the server (default 0)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--apis", type=int, default=3,
                    help="API i hands out gateway i %% G's stream URLs (when --apis is not a "
                         "multiple of --gateways, the clients spread the watchers over the "
                         "gateways by job instead, so none idles)")
    ap.add_argument("--gateways", type=int, default=3)
    ap.add_argument("--client-procs", type=int, default=3)
    ap.add_argument("--watchers-per-job", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="tokens per job (ignore_eos: every job runs to it)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched", type=int, default=1024,
                    help="TIDEGATE_MAX_NUM_BATCHED_TOKENS of the workers")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25,
                    help="per worker (random:tiny keeps ~0.5 kB per token: 0.25 GB holds "
                         "~500k tokens; tidegate's CPU default is 2 GB)")
    ap.add_argument("--stream-interval-ms", type=float, default=None,
                    help="the workers' TIDEGATE_STREAM_INTERVAL_MS (default: tidegate's, 10)")
    ap.add_argument("--max-backlog", type=int, default=None,
                    help="TIDEGATE_MAX_BACKLOG (default: tidegate's); past it submits get 429")
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help="offered jobs/s per step (default: a ramp)")
    ap.add_argument("--start-rate", type=float, default=50.0)
    ap.add_argument("--max-rate", type=float, default=20000.0)
    ap.add_argument("--max-steps", type=int, default=8, help="ramp steps at most")
    ap.add_argument("--skip-80", action="store_true", help="no step at 80%% of capacity")
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per step")
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of each step's load before the measurement")
    ap.add_argument("--drain", type=float, default=30.0,
                    help="seconds a step's jobs may take to end after its last submit; "
                         "what is left is cancelled")
    ap.add_argument("--max-inflight", type=int, default=None,
                    help="unfinished jobs per client process before submits are skipped "
                         "(default: from the open-file limit)")
    ap.add_argument("--probe-jobs", type=int, default=6)
    ap.add_argument("--probe-interval-ms", type=float, default=20.0)
    ap.add_argument("--time-budget", type=float, default=510.0,
                    help="seconds for the whole run: ramps stop early to stay inside it")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--redis-cli", default="redis-cli")
    ap.add_argument("--logdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cluster" / "fleet.json")
    args = ap.parse_args(argv)
    if args.mode:
        args.modes = [args.mode]
    args.warmup = round(args.warmup / BUCKET_S) * BUCKET_S
    args.duration = max(BUCKET_S, round(args.duration / BUCKET_S) * BUCKET_S)
    for exe in (args.redis_server, *(["cluster"] if "cluster" in args.modes else [])):
        name = args.redis_cli if exe == "cluster" else exe
        if shutil.which(name) is None and not Path(name).exists():
            ap.error(f"{name} not found (give --redis-server / --redis-cli)")
    limit = raise_file_limit()
    if args.max_inflight is None:
        args.max_inflight = max(50, (limit - 256) // (args.watchers_per_job + 1))
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="fleet-"))
    logdir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (a timeout's kill) stops everything as Ctrl-C does.
    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in background
    version = subprocess.run([shutil.which(args.redis_server) or args.redis_server, "--version"],
                             capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    machine = record.machine()
    out: dict[str, Any] = {
        **record.record(argv, __spec__.name),
        "machine": {**machine, "nproc": machine["cpus"], "redis": version, "open_files": limit},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": {"cluster_over_server": RATIO_TARGET, "p99_ms_at_80pct": LATENCY_TARGET_MS},
        "logdir": str(logdir), "modes": {},
    }
    print(f"fleet benchmark: modes {args.modes}, logs in {logdir}; nproc "
          f"{out['machine']['nproc']}, open files {limit}", flush=True)
    out["config"]["watchers_spread_by_clients"] = args.apis % args.gateways != 0
    if args.apis % args.gateways:
        print(f"note: {args.apis} APIs do not map evenly onto {args.gateways} gateways: the "
              "clients spread each job's watchers over the gateways themselves", flush=True)
    try:
        for i, mode in enumerate(args.modes):
            left = args.time_budget - (time.monotonic() - t0)
            deadline = time.monotonic() + left / (len(args.modes) - i)
            out["modes"][mode] = run_mode(args, mode, logdir, deadline)
    except KeyboardInterrupt:
        print("interrupted: everything stopped", file=sys.stderr)
        return 130
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        out["wall_s"] = round(time.monotonic() - t0, 1)
        if out["modes"]:
            modes = out["modes"]
            if "server" in modes and "cluster" in modes:
                s = modes["server"]["capacity"]["delivered_token_events_per_s"]
                c = modes["cluster"]["capacity"]["delivered_token_events_per_s"]
                ratio = round(c / s, 2) if s else None
                out["ratio"] = {"cluster_over_server": ratio,
                                "target_met": ratio is not None and ratio >= RATIO_TARGET}
                ps = modes["server"]["sizing"]["projected_redis_limit_token_events_per_s"]
                pc = modes["cluster"]["sizing"]["projected_redis_limit_token_events_per_s"]
                if ps and pc:
                    out["ratio"]["projected_redis_limit_cluster_over_server"] = round(pc / ps, 2)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1) + "\n")
    print_summary(out)
    print(f"wrote {args.out} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
