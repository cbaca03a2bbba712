"""The real stack as separate processes: redis-server, the API, the gateway and N workers.

Each process logs to its own file in the run directory, gets its settings through ``TIDEGATE_*``
environment variables (the same for the engine-alone run, ``worker_env``) and is stopped when the
``Stack`` closes, also on Ctrl-C or an exception; it is started in its own session (so a Ctrl-C
reaches only the benchmark, which then stops everything in order) and dies with the benchmark
should that be killed outright (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tidegate.benchmarks.harness.load.workload import Work
from tidegate.benchmarks.harness.run.processes import (
    cpu_seconds,
    free_port,
    http_ready,
    log_tail,
    spawn,
    stop_processes,
)
from tidegate.benchmarks.harness.run.redis_server import redis_answers, redis_argv

TIDEGATE = [sys.executable, "-m", "tidegate"]


@dataclass(frozen=True, slots=True)
class StackConfig:
    model: str
    device: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gb: float | None
    workers: int
    torch_threads: int | None
    cuda_graphs: bool
    aof: bool  # appendonly + appendfsync everysec, as compose/docker-compose.yml runs Redis
    redis_server: str
    api_key: str | None  # None: auth off
    default_timeout_s: float
    startup_timeout_s: float
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()  # more of the worker's command line (e.g. --lora N=P)
    # The workers' (and the engine alone's) environment only: their settings and log level.
    worker_extra_env: dict[str, str] = field(default_factory=dict)


def base_env(cfg: StackConfig, redis_url: str) -> dict[str, str]:
    """The environment every tidegate process gets (LD_LIBRARY_PATH and the rest pass through)."""
    # PYTHONSAFEPATH: the processes start in the checkout, whose folders must not hide installed
    # packages (``kernels/`` is ``tidegate.kernels``, not Hugging Face's ``kernels``).
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TIDEGATE_REDIS_URL": redis_url,
           "TIDEGATE_MODEL": cfg.model, "TIDEGATE_LOG_LEVEL": "WARNING",
           "TIDEGATE_HOST": "127.0.0.1",
           "TIDEGATE_DEFAULT_TIMEOUT_S": str(cfg.default_timeout_s)}
    if cfg.api_key is not None:
        env["TIDEGATE_API_KEYS"] = cfg.api_key
    return {**env, **cfg.extra_env}


def worker_env(cfg: StackConfig, index: int, redis_url: str, metrics_port: int) -> dict[str, str]:
    """Worker ``index``'s settings; on CUDA with several workers, one device each."""
    device = cfg.device
    if device == "cuda" and cfg.workers > 1:
        device = f"cuda:{index}"
    env = {**base_env(cfg, redis_url), "TIDEGATE_DEVICE": device, "TIDEGATE_DTYPE": cfg.dtype,
           "TIDEGATE_MAX_NUM_SEQS": str(cfg.max_num_seqs),
           "TIDEGATE_MAX_NUM_BATCHED_TOKENS": str(cfg.max_num_batched_tokens),
           "TIDEGATE_CUDA_GRAPHS": str(cfg.cuda_graphs).lower(),
           "TIDEGATE_METRICS_PORT": str(metrics_port)}
    if cfg.kv_cache_gb is not None:
        env["TIDEGATE_KV_CACHE_GB"] = str(cfg.kv_cache_gb)
    if cfg.torch_threads is not None:
        env["TIDEGATE_TORCH_THREADS"] = str(cfg.torch_threads)
    return {**env, **cfg.extra_env, **cfg.worker_extra_env}


# The worker's own accounting of its time (worker/service/metrics.py), read from its /metrics.
WORKER_TIME_METRICS = ("tidegate_engine_step_seconds", "tidegate_engine_host_cpu_seconds",
                       "tidegate_publisher_cpu_seconds", "tidegate_worker_loop_cpu_seconds",
                       "tidegate_event_writes", "tidegate_events_written",
                       "tidegate_generation_tokens")


def worker_counters(port: int, names: tuple[str, ...] = WORKER_TIME_METRICS
                    ) -> dict[str, float]:
    """A worker's counters ``names`` now, each summed over its labels (every sample carries
    ``model``) and keyed without ``tidegate_``; empty if its status port does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removesuffix("_total")
        if name in names:
            key = name.removeprefix("tidegate_")
            found[key] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return found


class StackError(RuntimeError):
    """A stack process died or never got ready; the message holds its log's tail."""


class Stack:
    """Starts the stack's processes in order and stops them all, in reverse, on ``close``."""

    def __init__(self, cfg: StackConfig, logdir: Path) -> None:
        self.cfg, self.logdir = cfg, logdir
        self.redis_port, self.api_port, self.gateway_port = free_port(), free_port(), free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.status_ports: dict[str, int] = {}

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start_front(self) -> None:
        """redis-server, the API and the gateway, ready."""
        self._start_redis()
        env = {**base_env(self.cfg, self.redis_url),
               "TIDEGATE_GATEWAY_URL": f"ws://127.0.0.1:{self.gateway_port}"}
        self._start("api", [*TIDEGATE, "api", "--port", str(self.api_port)], env)
        self._start("gateway", [*TIDEGATE, "gateway", "--port", str(self.gateway_port)], env)
        self._wait_ready({"api": f"http://127.0.0.1:{self.api_port}/readyz",
                          "gateway": f"http://127.0.0.1:{self.gateway_port}/readyz"})

    def start_workers(self) -> None:
        """``cfg.workers`` workers, each ready (model loaded, calibrated, Redis answered)."""
        urls = {}
        for i in range(self.cfg.workers):
            name, port = f"worker{i}", free_port()
            self.status_ports[name] = port
            self._start(name, [*TIDEGATE, "worker", *self.cfg.worker_args],
                        worker_env(self.cfg, i, self.redis_url, port))
            urls[name] = f"http://127.0.0.1:{port}/readyz"
        self._wait_ready(urls)

    def _start_redis(self) -> None:
        data = self.logdir / "redis-data"
        data.mkdir(exist_ok=True)
        argv = redis_argv(self.cfg.redis_server, self.redis_port, data,
                          appendfsync="everysec" if self.cfg.aof else None, maxclients=60000)
        self._start("redis", argv, dict(os.environ))
        deadline = time.monotonic() + 20
        while not redis_answers(self.redis_port):
            self.check_alive()
            if time.monotonic() > deadline:
                raise StackError("redis-server did not answer within 20 s\n"
                                 + log_tail(self.log_path("redis")))
            time.sleep(0.05)

    def log_path(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.procs[name] = spawn(argv, env, self.log_path(name))

    def _wait_ready(self, urls: dict[str, str]) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = dict(urls)
        while waiting:
            self.check_alive()
            waiting = {name: url for name, url in waiting.items() if not http_ready(url)}
            if waiting and time.monotonic() > deadline:
                name = next(iter(waiting))
                raise StackError(f"{name} not ready within {self.cfg.startup_timeout_s:.0f} s\n"
                                 + log_tail(self.log_path(name)))
            if waiting:
                time.sleep(0.25)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise StackError(f"{name} exited with {proc.returncode}; its log "
                                 f"({self.log_path(name)}) ends:\n" + log_tail(self.log_path(name)))

    def worker_time(self) -> dict[str, dict[str, float]]:
        """Each worker's time counters now (``worker_counters``)."""
        return {name: worker_counters(port) for name, port in self.status_ports.items()}

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each stack process."""
        return {name: cpu_seconds(p.pid) for name, p in self.procs.items() if p.poll() is None}

    def flush(self) -> None:
        """Empty Redis (nothing may be left for the workers that start next)."""
        with socket.create_connection(("127.0.0.1", self.redis_port), timeout=10) as s:
            s.sendall(b"FLUSHALL\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise StackError("FLUSHALL failed")

    def close(self) -> None:
        """Workers first (each drains: nothing runs by now), then API and gateway, then Redis."""
        workers = [p for n, p in self.procs.items() if n.startswith("worker")]
        servers = [p for n, p in self.procs.items() if n in ("api", "gateway")]
        for stage in (workers, servers, [p for n, p in self.procs.items() if n == "redis"]):
            stop_processes(stage)
        self.procs.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_engine_alone(cfg: StackConfig, works: dict[str, tuple[Work, bool]], timeout_s: float,
                     logdir: Path, roofline: dict[str, float] | None = None) -> dict[str, dict]:
    """The engine alone on each work (``tidegate.benchmarks.harness.engine_alone``; the flag: on its
    arrival schedule, else all at once) in one subprocess with worker 0's environment; it
    has exited, its memory freed, when this returns. Results by the works' names, and under
    "roofline" the roofline of a mix of ``roofline``'s mean_input and mean_output."""
    spec, out = logdir / "engine_alone_spec.json", logdir / "engine_alone_out.json"
    spec.write_text(json.dumps({"timeout_s": timeout_s, "runs": {
        name: {"prompts": [list(p.token_ids) for p in work.prompts],
               "output_lens": work.output_lens,
               "offsets_s": work.offsets_s if on_schedule else None,
               "formats": list(work.formats) or None}
        for name, (work, on_schedule) in works.items()}, "roofline": roofline}))
    env = worker_env(cfg, 0, "redis://127.0.0.1:1/0", 0)  # it never touches Redis
    proc = spawn([sys.executable, "-m", "tidegate.benchmarks.harness.engine_alone", str(spec), str(out)],
                 env, logdir / "engine_alone.log")
    try:
        code = proc.wait(cfg.startup_timeout_s + 3600)
    except BaseException:
        stop_processes([proc])
        raise
    if code != 0:
        raise StackError(f"the engine-alone run exited with {code}; its log ends:\n"
                         + log_tail(logdir / "engine_alone.log"))
    return json.loads(out.read_text())
