"""Fan-out benchmark: N WebSocket clients watching M jobs on one gateway process.

A synthetic publisher writes token events the way a worker does (``tidegate.events.event_log``: every
10 ms one batch, each event stored in its job's stream, then one message per live channel) at
R events/s spread over the M jobs; every event carries
its publish time, so each client measures publish -> receive latency. Reported per N:
delivered messages/s, latency p50/p99, the gateway's CPU and its memory per connection.

    python -m tidegate.benchmarks.serving.fanout                       # 1k, 5k, 10k clients, 20k msg/s
    python -m tidegate.benchmarks.serving.fanout --connections 2000 --delivered 5000 --duration 10

The clients run in separate processes (``--client-procs``) so the gateway process is measured
alone; all of it shares this machine's cores, so client and publisher CPU is part of the load.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis.asyncio as aioredis

from tidegate.benchmarks.harness.measure import record
from tidegate.benchmarks.harness.run.processes import (
    ROOT,
    cpu_seconds,
    free_port,
    http_ready,
    safe_env,
    wait_until,
)
from tidegate.benchmarks.harness.run.redis_server import RedisServer
from tidegate.events.event_log import EventBatch, EventLog
from tidegate.jobstore import enqueue
from tidegate.protocol import DoneEvent, JobRequest, Timings, Usage, token_event_json


def raise_file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# ---------------------------------------------------------------- processes


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_gateway(port: int, redis_url: str) -> subprocess.Popen:
    env = safe_env(TIDEGATE_REDIS_URL=redis_url, TIDEGATE_LOG_LEVEL="WARNING",
                   TIDEGATE_PORT=str(port))
    proc = subprocess.Popen([sys.executable, "-m", "tidegate", "gateway", "--port", str(port)],
                            env=env, cwd=ROOT)
    try:
        wait_until(lambda: http_ready(f"http://127.0.0.1:{port}/healthz"), 30, "the gateway",
                   proc=proc, interval_s=0.2)
    except RuntimeError:
        proc.kill()
        raise
    return proc


# ---------------------------------------------------------------- clients


def client_proc(url_base: str, jobs: list[str], count: int, offset: int,
                ready: mp.Event, results: mp.Queue) -> None:  # type: ignore[type-arg]
    raise_file_limit()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_clients(url_base, jobs, count, offset, ready, results))


class LeanClient(asyncio.Protocol):
    """A minimal WebSocket client: handshake, then unmasked server frames parsed by hand.

    The clients share this machine's cores with the gateway; the ``websockets`` library
    spends ~30 us of Python per received frame, this ~5 us, so the gateway gets the CPU.
    """

    def __init__(self, path: str, on_event, ready: asyncio.Future) -> None:  # noqa: ANN001
        self.path, self.on_event, self.ready = path, on_event, ready
        self.buf = b""
        self.handshaken = False
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:  # noqa: ANN001
        self.transport = transport
        key = base64.b64encode(os.urandom(16)).decode()
        transport.write((f"GET {self.path} HTTP/1.1\r\nHost: bench\r\nUpgrade: websocket\r\n"
                         f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                         f"Sec-WebSocket-Version: 13\r\n\r\n").encode())

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        if not self.handshaken:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if not sep:
                self.buf = buf
                return
            if b" 101 " not in head.split(b"\r\n", 1)[0]:
                self.ready.set_exception(RuntimeError(head[:80].decode(errors="replace")))
                return
            self.handshaken, buf = True, rest
        pos, n = 0, len(buf)
        while n - pos >= 2:
            opcode, length = buf[pos] & 0x0F, buf[pos + 1] & 0x7F
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
            if opcode == 1:
                if self.ready.done():
                    self.on_event(payload)
                else:  # the replayed ``queued``: this client is registered
                    self.ready.set_result(None)
            elif opcode == 8:
                if self.transport is not None:
                    self.transport.close()
            elif opcode == 9 and self.transport is not None:  # ping -> masked pong
                mask = os.urandom(4)
                body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                self.transport.write(bytes([0x8A, 0x80 | len(payload)]) + mask + body)
        self.buf = buf[pos:]

    def connection_lost(self, exc) -> None:  # noqa: ANN001
        if not self.closed.done():
            self.closed.set_result(None)


async def _clients(url_base: str, jobs: list[str], count: int, offset: int,
                   ready: mp.Event, results: mp.Queue) -> None:  # type: ignore[type-arg]
    loop = asyncio.get_running_loop()
    host, port = url_base.removeprefix("ws://").split(":")
    latencies: list[float] = []
    stats = {"received": 0, "first_ns": 0, "last_ns": 0}
    gate = asyncio.Semaphore(100)  # connect in waves: the accept backlog is finite

    def on_event(payload: bytes) -> None:
        now = time.time_ns()
        event = json.loads(payload)
        if event["type"] != "token":
            return
        stats["received"] += 1
        stats["first_ns"] = stats["first_ns"] or now
        stats["last_ns"] = now
        latencies.append((now - int(event["text"])) / 1e6)

    async def open_one(i: int) -> LeanClient:
        path = f"/v1/jobs/{jobs[(offset + i) % len(jobs)]}/stream"
        async with gate:
            for attempt in range(20):
                first = loop.create_future()
                try:
                    _, proto = await loop.create_connection(
                        lambda: LeanClient(path, on_event, first), host, int(port))  # noqa: B023
                    await asyncio.wait_for(first, 60)
                    return proto
                except OSError:
                    await asyncio.sleep(0.05 * (attempt + 1))
        raise RuntimeError("could not connect")

    conns = await asyncio.gather(*(open_one(i) for i in range(count)))
    ready.set()
    await asyncio.gather(*(c.closed for c in conns))
    results.put({**stats, "latencies": latencies})


# ---------------------------------------------------------------- publisher


async def publish_for(redis: aioredis.Redis, jobs: list[str], rate: float,
                      duration_s: float) -> int:
    """Token events at ``rate``/s over the jobs, round robin, written as a worker writes them:
    every 10 ms one batch (one script call: each event stored, then one message per live
    channel); returns how many."""
    log = EventLog(redis)
    next_id = dict.fromkeys(jobs, 2)
    sent = 0
    start = time.perf_counter()
    tick = 0.01
    while (elapsed := time.perf_counter() - start) < duration_s:
        due = int(elapsed * rate) - sent
        if due > 0:
            batch = EventBatch()
            for k in range(due):
                job = jobs[(sent + k) % len(jobs)]
                event_id = next_id[job]
                next_id[job] += 1
                raw = token_event_json(event_id, job, event_id - 2, str(time.time_ns()), [0])
                batch.add_event(job, event_id, "token", raw)
            await log.write(batch)
            sent += due
        await asyncio.sleep(tick)
    batch = EventBatch()  # the final events close every client
    for job in jobs:
        batch.add_event(job, next_id[job], "done", DoneEvent(
            id=next_id[job], job_id=job, finish_reason="length", text="",
            usage=Usage(prompt_tokens=1, completion_tokens=0, total_tokens=1),
            timings=Timings(queue_ms=0, ttft_ms=0, total_ms=0, decode_tokens_per_s=0),
        ).model_dump_json())
    await log.write(batch)
    return sent


# ---------------------------------------------------------------- one run


@dataclass
class Result:
    connections: int
    jobs: int
    target_delivered_per_s: float
    published_per_s: float
    delivered_per_s: float
    expected: int
    received: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    gateway_cpu_pct: float
    gateway_rss_mb: float
    kib_per_connection: float
    connect_s: float


def run(n: int, jobs_n: int, delivered: float, duration_s: float, procs: int,
        redis_url: str, gateway_port: int) -> Result:
    gateway = start_gateway(gateway_port, redis_url)
    try:
        return asyncio.run(_run(n, jobs_n, delivered, duration_s, procs, redis_url,
                                gateway_port, gateway.pid))
    finally:
        gateway.terminate()
        gateway.wait(30)


async def _run(n: int, jobs_n: int, delivered: float, duration_s: float, procs: int,
               redis_url: str, port: int, gateway_pid: int) -> Result:
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await redis.flushall()
    jobs = []
    for _ in range(jobs_n):
        job = JobRequest(prompt="fanout").to_job(model="fanout", default_timeout_s=3600)
        await enqueue(redis, job)
        jobs.append(job.id)
    rss0 = proc_rss_mb(gateway_pid)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    readies = []
    workers = []
    t0 = time.perf_counter()
    for p in range(procs):
        share = n // procs + (1 if p < n % procs else 0)
        ready = ctx.Event()
        w = ctx.Process(target=client_proc, args=(f"ws://127.0.0.1:{port}", jobs, share,
                                                  p * (n // procs), ready, results))
        w.start()
        workers.append(w)
        readies.append(ready)
    for ready in readies:
        while not ready.wait(0.1):
            await asyncio.sleep(0)
            if not all(w.is_alive() for w in workers):
                raise RuntimeError("a client process died while connecting")
    connect_s = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    rss1 = proc_rss_mb(gateway_pid)
    rate = delivered * jobs_n / n  # events/s published so that n clients receive `delivered`/s
    cpu0 = cpu_seconds(gateway_pid)
    w0 = time.perf_counter()
    sent = await publish_for(redis, jobs, rate, duration_s)
    wall = time.perf_counter() - w0
    cpu1 = cpu_seconds(gateway_pid)
    outs = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
    await redis.aclose()
    lat = sorted(x for o in outs for x in o["latencies"])
    received = sum(o["received"] for o in outs)
    first = min(o["first_ns"] for o in outs if o["first_ns"])
    last = max(o["last_ns"] for o in outs)
    per_job = n / jobs_n
    return Result(
        connections=n, jobs=jobs_n, target_delivered_per_s=delivered, published_per_s=round(sent / wall, 1),
        delivered_per_s=round(received / max((last - first) / 1e9, 1e-9), 1),
        expected=int(round(sent * per_job)), received=received,
        p50_ms=round(statistics.median(lat), 2), p99_ms=round(lat[int(len(lat) * 0.99)], 2),
        max_ms=round(lat[-1], 2), gateway_cpu_pct=round(100 * (cpu1 - cpu0) / wall, 1),
        gateway_rss_mb=round(rss1, 1), kib_per_connection=round((rss1 - rss0) * 1024 / n, 1),
        connect_s=round(connect_s, 1))


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    ns = [r.connections for r in results]
    a.plot(ns, [r.p50_ms for r in results], "o-", label="p50")
    a.plot(ns, [r.p99_ms for r in results], "o-", label="p99")
    a.axhline(100, color="grey", ls="--", lw=1, label="target p99")
    a.set_xlabel("WebSocket connections")
    a.set_ylabel("publish -> receive latency (ms)")
    a.legend()
    b.plot(ns, [r.target_delivered_per_s for r in results], "k:", lw=1, label="asked msg/s")
    b.plot(ns, [r.delivered_per_s for r in results], "o-", label="delivered msg/s")
    b.set_xlabel("WebSocket connections")
    b.set_ylabel("messages/s")
    b.set_ylim(0, 1.25 * max(r.target_delivered_per_s for r in results))
    b2 = b.twinx()
    b2.plot(ns, [r.gateway_cpu_pct for r in results], "s--", color="tab:red", label="gateway CPU %")
    b2.set_ylabel("gateway CPU % (one core = 100)")
    b2.set_ylim(0, 110)
    b.legend(loc="upper left")
    b2.legend(loc="lower right")
    fig.suptitle("tidegate gateway fan-out (one process, 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, nargs="+", default=[1000, 5000, 10000])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--delivered", type=float, nargs="+", default=[20000],
                    help="target delivered msg/s (several: a sweep at each connection count)")
    ap.add_argument("--duration", type=float, default=20)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--redis-url", default=None, help="default: start a redis-server")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serving/fanout.json"))
    ap.add_argument("--plot", default=str(ROOT / "benchmarks/results/serving/fanout.png"))
    args = ap.parse_args()
    raise_file_limit()
    redis_server = None
    redis_url = args.redis_url
    if redis_url is None:
        redis_server = RedisServer(maxclients=50000)
        redis_url = redis_server.url
    results = []
    try:
        for n in args.connections:
            for rate in args.delivered:
                r = run(n, args.jobs, rate, args.duration, args.client_procs, redis_url,
                        free_port())
                print(json.dumps(asdict(r)), flush=True)
                results.append(r)
    finally:
        if redis_server is not None:
            redis_server.stop()
    Path(args.out).write_text(json.dumps({
        **record.record(), "cpus": os.cpu_count(),
        "results": [asdict(r) for r in results]}, indent=2))
    if args.plot:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
