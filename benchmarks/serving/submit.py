"""Submit throughput: how many ``POST /v1/jobs`` one ``tidegate api`` process answers per second.

Starts a redis-server (free port, AOF ``appendfsync everysec`` as in compose) and one
``python -m tidegate api`` process per model and auth setting, then drives ``POST /v1/jobs``
as fast as it answers from a fixed number of keep-alive connections. Reported per scenario:
submits/s, latency p50/p99, 2xx and other answers, the CPU the API process used (from
``/proc/<pid>/stat``: share of one core, and microseconds per submit), redis-server's and the
load generator's CPU, and what else was busy on the machine meanwhile.

Scenarios: ``plain`` (a short prompt), ``chat`` (system + user messages, rendered by the chat
template), ``idem`` (a plain prompt with a fresh ``Idempotency-Key`` header on every request:
every answer is a 202), ``auth`` (a plain prompt with ``Authorization: Bearer``, the API started
with ``TIDEGATE_API_KEYS``), ``limits`` (as ``auth``, with per-tenant rate limits far above the
load: every submit runs the bucket script, none is refused), ``long`` (a ~1,500-character
prompt: 1,500 tokens for random:tiny, ~300 for smollm2).

Nothing consumes the lane, so the API runs with ``TIDEGATE_MAX_BACKLOG`` far above what a run
enqueues (no 429 can come) and Redis is flushed before every run; after each run the lane
stream's length is compared with the 2xx answers counted (202s: every submit is new).

    python -m tidegate.benchmarks.serving.submit                                  # both models, all scenarios
    python -m tidegate.benchmarks.serving.submit --models random:tiny --scenarios plain --duration 5
    python -m tidegate.benchmarks.serving.submit --api-cpus 0 --load-cpus 1       # API alone on core 0
    python -m tidegate.benchmarks.serving.submit --generator python --requests 20000

Load generators: ``wrk`` (C; ``apt-get install wrk``) with a generated Lua script, the default
when installed; ``python``, a raw asyncio HTTP/1.1 keep-alive client (uses a core's worth of
Python itself, so on a small machine it measures less). wrk stops at a time limit and drops the
requests in flight then (at most one per connection): those may have been enqueued without
being counted, so with wrk the lane may hold up to ``--connections`` entries more than the 2xx
counted. The Python generator sends exactly ``--requests`` and waits for every answer: there the
two numbers must be equal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from tidegate import keys
from tidegate.benchmarks.harness.measure import record
from tidegate.benchmarks.harness.run.processes import (
    ROOT,
    cpu_seconds,
    free_port,
    http_ready,
    machine_busy,
    safe_env,
    stop_processes,
    wait_until,
)
from tidegate.benchmarks.harness.run.redis_server import RedisServer
from tidegate.model_files.served_model import default_name

SCENARIOS = ("plain", "chat", "idem", "auth", "long", "limits")
# How the API is started for a scenario (the others: no key, no limit): auth, extra env.
API_CONFIGS: dict[str, tuple[bool, dict[str, str]]] = {
    "auth": (True, {}),
    "limits": (True, {"TIDEGATE_RATE_LIMIT_REQUESTS_PER_S": "1000000000",
                      "TIDEGATE_RATE_LIMIT_TOKENS_PER_MIN": "1000000000000"}),
}
API_KEYS = ("bench-key-one", "bench-key-two", "bench-key-three")
PROMPT = "Write a haiku about the tide coming in over the mudflats."
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]
LONG_PROMPT = " ".join(["The tide came in over the mudflats and the birds lifted."] * 26)
def lane_of(model: str) -> str:
    """The interactive lane of the API's model (its served name)."""
    return keys.lane_stream(default_name(model), "interactive")


def body_of(scenario: str) -> dict:
    if scenario == "chat":
        return {"messages": MESSAGES, "max_tokens": 64}
    if scenario == "long":
        return {"prompt": LONG_PROMPT, "max_tokens": 64}
    return {"prompt": PROMPT, "max_tokens": 64}


# ---------------------------------------------------------------- processes


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


class RedisProc(RedisServer):
    """The harness's redis-server with the AOF as compose runs it, pinned to ``cpus``; its data
    in ``workdir``."""

    def __init__(self, workdir: Path, cpus: str | None):
        super().__init__(appendfsync="everysec", data_dir=workdir, prefix=pinned([], cpus))
        self.client = redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def stop(self) -> None:
        self.client.close()
        super().stop()


class ApiProc:
    def __init__(self, redis_url: str, model: str, *, auth: bool, cpus: str | None,
                 log_path: Path, max_backlog: int, extra_env: dict[str, str]):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = safe_env(TIDEGATE_MAX_BACKLOG=str(max_backlog), **extra_env)
        env.pop("TIDEGATE_API_KEYS_FILE", None)
        if auth:
            env["TIDEGATE_API_KEYS"] = ",".join(API_KEYS)
        else:
            env.pop("TIDEGATE_API_KEYS", None)
        cmd = [sys.executable, "-m", "tidegate", "api", "--redis-url", redis_url,
               "--model", model, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(pinned(cmd, cpus), cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        # taskset execs the command, so the pid is the API's own.
        wait_until(lambda: http_ready(f"{self.base}/readyz"), 120, f"tidegate api ({model})",
                   proc=self.proc)

    def stop(self) -> None:
        stop_processes([self.proc], timeout_s=20)
        self.log.close()


# ---------------------------------------------------------------- load generators


@dataclass
class Load:
    requests: int  # answers received
    ok: int  # 2xx answers
    other: int  # non-2xx answers
    errors: int  # socket errors and timeouts
    seconds: float
    p50_ms: float
    p99_ms: float
    statuses: dict[str, int] = field(default_factory=dict)


WRK_LUA = """
local body = %(body)s
local base_headers = %(headers)s
local idem = %(idem)s
local tag = "%(tag)s"
local counter = 0
local tid = 0
local threads = {}
function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end
function init(args)
  tid = wrk.thread:get("tid") or 0
end
function request()
  local headers = {}
  for k, v in pairs(base_headers) do headers[k] = v end
  if idem then
    counter = counter + 1
    headers["Idempotency-Key"] = tag .. "-" .. tid .. "-" .. counter
  end
  return wrk.format("POST", "/v1/jobs", headers, body)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write("WRK_JSON " .. string.format(
    '{"requests": %%d, "duration_us": %%d, "non2xx": %%d, "connect": %%d, "read": %%d, ' ..
    '"write": %%d, "timeout": %%d, "p50_us": %%d, "p99_us": %%d}',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)) .. "\\n")
end
"""


def lua_string(text: str) -> str:
    return "[==[" + text + "]==]"


def run_wrk(base: str, scenario: str, headers: dict[str, str], *, connections: int,
            duration_s: float, threads: int, cpus: str | None, workdir: Path) -> Load:
    lua_headers = "{" + ", ".join(f'["{k}"] = {lua_string(v)}' for k, v in headers.items()) + "}"
    script = workdir / f"submit-{scenario}.lua"
    script.write_text(WRK_LUA % {"body": lua_string(json.dumps(body_of(scenario))),
                                 "headers": lua_headers,
                                 "idem": "true" if scenario == "idem" else "false",
                                 "tag": uuid.uuid4().hex[:12]})
    cmd = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(duration_s))}s",
           "--timeout", "10s", "-s", str(script), base + "/v1/jobs"]
    out = subprocess.run(pinned(cmd, cpus), capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("WRK_JSON "))
    r = json.loads(line[len("WRK_JSON "):])
    errors = r["connect"] + r["read"] + r["write"] + r["timeout"]
    return Load(requests=r["requests"], ok=r["requests"] - r["non2xx"], other=r["non2xx"],
                errors=errors, seconds=r["duration_us"] / 1e6, p50_ms=r["p50_us"] / 1000,
                p99_ms=r["p99_us"] / 1000)


async def _python_load(port: int, scenario: str, headers: dict[str, str], *, connections: int,
                       total: int, time_limit_s: float) -> Load:
    body = json.dumps(body_of(scenario)).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    fixed = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             f"{head}Content-Length: {len(body)}\r\n").encode()
    tag = uuid.uuid4().hex[:12]
    issued = 0
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors = 0
    stop_at = time.monotonic() + time_limit_s

    async def one_connection(index: int) -> None:
        nonlocal issued, errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while issued < total and time.monotonic() < stop_at:
                issued += 1
                extra = (f"Idempotency-Key: {tag}-{issued}\r\n".encode()
                         if scenario == "idem" else b"")
                started = time.perf_counter()
                writer.write(fixed + extra + b"\r\n" + body)
                status_line = await reader.readline()
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - started)
                status = status_line.split(b" ", 2)[1].decode() if status_line else "none"
                statuses[status] = statuses.get(status, 0) + 1
        except (OSError, asyncio.IncompleteReadError, IndexError):
            errors += 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(one_connection(i) for i in range(connections)))
    seconds = time.perf_counter() - started
    latencies.sort()
    ok = sum(n for s, n in statuses.items() if s.startswith("2"))
    done = len(latencies)
    return Load(requests=done, ok=ok, other=done - ok, errors=errors, seconds=seconds,
                p50_ms=1000 * latencies[done // 2] if done else 0.0,
                p99_ms=1000 * latencies[min(done - 1, int(done * 0.99))] if done else 0.0,
                statuses=statuses)


def run_python(port: int, scenario: str, headers: dict[str, str], *, connections: int,
               total: int, time_limit_s: float) -> Load:
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(_python_load(port, scenario, headers, connections=connections, total=total,
                               time_limit_s=time_limit_s))


# ---------------------------------------------------------------- runs


@dataclass
class Result:
    model: str
    scenario: str
    repeat: int
    generator: str
    connections: int
    submits_per_s: float
    p50_ms: float
    p99_ms: float
    ok: int
    other: int
    errors: int
    lane_entries: int
    api_cpu_share: float  # of one core
    api_us_per_submit: float
    redis_cpu_share: float
    load_cpu_share: float | None  # wrk's or this process's (python generator)
    machine_busy_cores: float  # the whole machine, both cores together
    seconds: float


def one_run(args: argparse.Namespace, rds: RedisProc, api: ApiProc, model: str, scenario: str,
            repeat: int, workdir: Path) -> Result:
    rds.client.flushall()
    headers = {"Content-Type": "application/json"}
    if scenario in API_CONFIGS:
        headers["Authorization"] = f"Bearer {API_KEYS[1]}"
    api_cpu0, redis_cpu0 = cpu_seconds(api.proc.pid), cpu_seconds(rds.proc.pid)
    busy0, self0, children0 = machine_busy()[0], time.process_time(), os.times()
    wall0 = time.perf_counter()
    if args.generator == "wrk":
        load = run_wrk(api.base, scenario, headers, connections=args.connections,
                       duration_s=args.duration, threads=args.threads, cpus=args.load_cpus,
                       workdir=workdir)
    else:
        load = run_python(api.port, scenario, headers, connections=args.connections,
                          total=args.requests, time_limit_s=args.duration * 10)
    wall = time.perf_counter() - wall0
    api_cpu = cpu_seconds(api.proc.pid) - api_cpu0
    redis_cpu = cpu_seconds(rds.proc.pid) - redis_cpu0
    busy = machine_busy()[0] - busy0
    if args.generator == "wrk":
        t = os.times()
        load_cpu = (t.children_user - children0.children_user
                    + t.children_system - children0.children_system)
    else:
        load_cpu = time.process_time() - self0
    time.sleep(0.3)  # the API finishes the enqueues of requests wrk dropped at its stop
    lane = rds.client.xlen(lane_of(model))
    return Result(
        model=model, scenario=scenario, repeat=repeat, generator=args.generator,
        connections=args.connections, submits_per_s=load.ok / load.seconds,
        p50_ms=load.p50_ms, p99_ms=load.p99_ms, ok=load.ok, other=load.other,
        errors=load.errors, lane_entries=lane, api_cpu_share=api_cpu / wall,
        api_us_per_submit=1e6 * api_cpu / max(lane, 1), redis_cpu_share=redis_cpu / wall,
        load_cpu_share=load_cpu / wall, machine_busy_cores=busy / wall, seconds=wall)


def check_counts(r: Result, generator: str, connections: int) -> str:
    extra = r.lane_entries - r.ok
    if generator == "python":
        return "ok" if extra == 0 else f"MISMATCH: lane {r.lane_entries} != 2xx {r.ok}"
    if 0 <= extra <= connections:
        return "ok" if extra == 0 else f"ok (+{extra} in flight at wrk's stop)"
    return f"MISMATCH: lane {r.lane_entries} vs 2xx {r.ok}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["random:tiny", "smollm2"])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS[:4]), choices=SCENARIOS)
    p.add_argument("--generator", choices=["wrk", "python"],
                   default="wrk" if shutil.which("wrk") else "python")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run (wrk)")
    p.add_argument("--requests", type=int, default=20_000, help="per run (python generator)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the runs")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--api-cpus", help="taskset CPU list for the API process, e.g. 0")
    p.add_argument("--load-cpus", help="taskset CPU list for wrk, e.g. 1")
    p.add_argument("--redis-cpus", help="taskset CPU list for redis-server, e.g. 1")
    p.add_argument("--max-backlog", type=int, default=1_000_000_000)
    p.add_argument("--out", type=Path, help="write every run's numbers here as JSON")
    args = p.parse_args()
    if args.generator == "wrk" and not shutil.which("wrk"):
        p.error("wrk is not installed (apt-get install wrk), or use --generator python")
    if args.load_cpus and args.generator == "python":
        os.sched_setaffinity(0, {int(c) for c in args.load_cpus.split(",")})

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tidegate-submit-") as tmp:
        workdir = Path(tmp)
        rds = RedisProc(workdir, args.redis_cpus)
        try:
            for model in args.models:
                for config in ("open", *API_CONFIGS):
                    scenarios = [s for s in args.scenarios
                                 if (s if s in API_CONFIGS else "open") == config]
                    if not scenarios:
                        continue
                    auth, env = API_CONFIGS.get(config, (False, {}))
                    api = ApiProc(rds.url, model, auth=auth, cpus=args.api_cpus,
                                  log_path=workdir / "api.log", max_backlog=args.max_backlog,
                                  extra_env=env)
                    try:
                        for scenario in scenarios:
                            if args.warmup > 0:
                                warm = argparse.Namespace(**{**vars(args),
                                                             "duration": args.warmup,
                                                             "requests": 2000})
                                one_run(warm, rds, api, model, scenario, 0, workdir)
                            for repeat in range(1, args.repeat + 1):
                                r = one_run(args, rds, api, model, scenario, repeat, workdir)
                                results.append(r)
                                print(f"{model:12} {scenario:6} #{repeat} "
                                      f"{r.submits_per_s:7.0f}/s p50 {r.p50_ms:6.2f} ms "
                                      f"p99 {r.p99_ms:6.2f} ms 2xx {r.ok} other {r.other} "
                                      f"err {r.errors} | API {100 * r.api_cpu_share:4.0f}% "
                                      f"{r.api_us_per_submit:5.0f} us/submit, redis "
                                      f"{100 * r.redis_cpu_share:3.0f}%, load "
                                      f"{100 * (r.load_cpu_share or 0):3.0f}%, machine "
                                      f"{r.machine_busy_cores:.2f} cores | lane "
                                      f"{check_counts(r, args.generator, args.connections)}",
                                      flush=True)
                    finally:
                        api.stop()
        finally:
            rds.stop()

    print("\n| model | scenario | submits/s (median, min-max) | p50 ms | p99 ms | non-2xx "
          "| API CPU (of a core) | API us/submit |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for scenario in args.scenarios:
            runs = [r for r in results if r.model == model and r.scenario == scenario]
            if not runs:
                continue
            rates = [r.submits_per_s for r in runs]
            print(f"| {model} | {scenario} | {statistics.median(rates):,.0f} "
                  f"({min(rates):,.0f}-{max(rates):,.0f}) "
                  f"| {statistics.median(r.p50_ms for r in runs):.2f} "
                  f"| {statistics.median(r.p99_ms for r in runs):.2f} "
                  f"| {sum(r.other + r.errors for r in runs)} "
                  f"| {100 * statistics.median(r.api_cpu_share for r in runs):.0f}% "
                  f"| {statistics.median(r.api_us_per_submit for r in runs):.0f} |")
    if args.out:
        args.out.write_text(json.dumps({**record.record(),
                                        "args": {k: str(v) for k, v in vars(args).items()},
                                        "runs": [asdict(r) for r in results]}, indent=1))
    bad = [r for r in results if check_counts(r, args.generator, args.connections)
           .startswith("MISMATCH")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
