"""The chaos loop: SIGKILLs workers, Redis and the gateway on a schedule, and brings them back.

``ChaosPlan`` spreads its worker kills, Redis restarts and gateway restarts evenly over the
run's first ``duration_s`` (interleaved, never two at once). ``ChaosMonkey.carry_out`` carries
the plan out on a ``ChaosStack``:

* worker kill: once at least ``min_ready_workers`` are ready (so kills never take all capacity
  at once), SIGKILL the longest-running one that holds a job (read, not yet acknowledged) and
  start a fresh worker in its place at once;
* Redis restart: SIGKILL, ``outage_s`` of nothing, then ``redis-server`` again on the same
  port from the same AOF;
* gateway restart: SIGKILL, then a new gateway on the same port;
* worker pause: SIGSTOP a worker for ``pause_s`` (past the visibility timeout: a long GC pause,
  a partition), so another worker takes its jobs over, then SIGCONT: it wakes up still
  believing it runs them.

Between actions, and after them until told to stop (``keep_up``), it replaces any process that
exited by itself (``ChaosStack.unexpected_exits``; the run reports them). Every action is
logged with its time, for the report.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from dataclasses import dataclass, field

from tidegate.benchmarks.harness.run.chaos_stack import ChaosStack


@dataclass(frozen=True, slots=True)
class ChaosPlan:
    duration_s: float  # actions are spread over this long after the start
    worker_kills: int
    redis_restarts: int
    gateway_restarts: int
    worker_pauses: int = 0
    pause_s: float = 0.0  # how long a paused worker stays stopped
    outage_s: tuple[float, float] = (0.5, 1.5)  # Redis is away this long (uniform)
    min_ready_workers: int = 2
    seed: int = 0

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds after the start, action) in time order; ties broken kills first."""
        actions = [("worker", self.worker_kills), ("redis", self.redis_restarts),
                   ("gateway", self.gateway_restarts), ("pause", self.worker_pauses)]
        timeline = [((i + 0.5) * self.duration_s / n, order, kind)
                    for order, (kind, n) in enumerate(actions) for i in range(n)]
        return [(at, kind) for at, _, kind in sorted(timeline)]


@dataclass(slots=True)
class ChaosLog:
    worker_kills: int = 0
    redis_restarts: int = 0
    gateway_restarts: int = 0
    worker_pauses: int = 0
    outages_s: list[float] = field(default_factory=list)  # Redis down, SIGKILL to answering
    replaced: list[str] = field(default_factory=list)  # exited by themselves, started again
    timeline: list[tuple[float, str]] = field(default_factory=list)


# How long a kill waits for a ready worker that holds a job before taking any ready worker.
HOLD_WAIT_S = 10.0


class ChaosMonkey:
    def __init__(self, stack: ChaosStack, plan: ChaosPlan) -> None:
        self.stack, self.plan = stack, plan
        self.rng = random.Random(plan.seed)
        self.log = ChaosLog()
        self._started: dict[str, float] = {}  # worker name -> when it was started
        self.t0 = time.monotonic()

    def note(self, what: str) -> None:
        self.log.timeline.append((round(time.monotonic() - self.t0, 2), what))

    async def carry_out(self, stop: asyncio.Event) -> None:
        """Carry the plan out (unless ``stop`` is set first)."""
        self.t0 = time.monotonic()
        for name in self.stack.worker_names():
            self._started.setdefault(name, self.t0)
        for at, kind in self.plan.schedule():
            while time.monotonic() - self.t0 < at:
                if stop.is_set():
                    return
                await self._replace_exited()
                await asyncio.sleep(0.1)
            await {"worker": self.kill_worker, "redis": self.restart_redis,
                   "gateway": self.restart_gateway, "pause": self.pause_worker}[kind](stop)

    async def keep_up(self, stop: asyncio.Event) -> None:
        """Replace processes that exit by themselves until ``stop``."""
        while not stop.is_set():
            await self._replace_exited()
            await asyncio.sleep(0.2)

    async def kill_worker(self, stop: asyncio.Event) -> None:
        victim = await self._victim(stop)
        if victim is None:
            return
        self.stack.kill(victim)
        self.log.worker_kills += 1
        fresh = self.stack.start_worker()
        self._started[fresh] = time.monotonic()
        self.note(f"SIGKILL {victim}; started {fresh}")

    async def pause_worker(self, stop: asyncio.Event) -> None:
        victim = await self._victim(stop)
        if victim is None:
            return
        proc = self.stack.procs[victim]
        proc.send_signal(signal.SIGSTOP)
        self.note(f"SIGSTOP {victim}")
        await asyncio.sleep(self.plan.pause_s)
        proc.send_signal(signal.SIGCONT)
        self.log.worker_pauses += 1
        self.note(f"SIGCONT {victim} after {self.plan.pause_s} s")

    async def _victim(self, stop: asyncio.Event) -> str | None:
        """Once ``min_ready_workers`` are ready, the longest-running ready worker that holds a
        job (after ``HOLD_WAIT_S`` without one, the longest-running ready one); None: stopped.
        Aimed at a job: on a fast model a worker is between jobs often enough that four kills
        of whichever worker came first caught no job mid-run (a clean run's chaos test)."""
        waiting_since: float | None = None
        while not stop.is_set():
            await self._replace_exited()
            names = self.stack.worker_names()
            ready = [n for n in names
                     if await asyncio.to_thread(self.stack.is_ready, n)]
            if len(ready) >= self.plan.min_ready_workers:
                holding = await asyncio.to_thread(self.stack.holding)
                busy = [n for n in ready if n in holding]
                waiting_since = waiting_since or time.monotonic()
                if busy or time.monotonic() - waiting_since > HOLD_WAIT_S:
                    return min(busy or ready, key=lambda n: self._started.get(n, 0.0))
            await asyncio.sleep(0.05)
        return None

    async def restart_redis(self, stop: asyncio.Event) -> None:
        down_at = time.monotonic()
        self.stack.kill_redis()
        self.note("SIGKILL redis")
        await asyncio.sleep(self.rng.uniform(*self.plan.outage_s))
        await asyncio.to_thread(self.stack.start_redis)
        self.log.redis_restarts += 1
        self.log.outages_s.append(round(time.monotonic() - down_at, 2))
        self.note(f"redis back after {self.log.outages_s[-1]} s")

    async def restart_gateway(self, stop: asyncio.Event) -> None:
        self.stack.kill_gateway()
        self.note("SIGKILL gateway")
        self.stack.start_gateway()
        await asyncio.to_thread(self.stack.wait_ready, ["gateway"])
        self.log.gateway_restarts += 1
        self.note("gateway back")

    async def _replace_exited(self) -> None:
        for name in self.stack.unexpected_exits():
            self.log.replaced.append(name)
            self.note(f"{name} exited by itself; starting another")
            if name.startswith("worker"):
                self._started[self.stack.start_worker()] = time.monotonic()
            elif name == "gateway":
                self.stack.start_gateway()
            elif name == "redis":
                await asyncio.to_thread(self.stack.start_redis)
            elif name == "api":
                raise RuntimeError("the API exited by itself:\n" + self.stack.exits[-1])
