"""``RankProcesses``: the processes of one parallel worker, started and watched by rank 0.

Rank 0 is the worker process itself (Redis, scheduling, its own share); it starts ranks 1..N-1
as child processes (``spawn``), each loading its share and following rank 0's steps. A rank
that dies takes the whole worker down: rank 0 watches its children and, when one exits
unasked, kills the rest and exits at once, as a killed worker would (its jobs are reclaimed by
the other workers once their visibility timeout passes); a child whose parent is gone exits
by itself. Start-up fails with a message naming what is missing (devices, a rank that could
not load its share).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import NoReturn

import torch

from tidegate.worker.parallel.layout import ParallelLayout
from tidegate.worker.parallel.model_group import ModelGroup, is_peer_lost, multicast_off

log = logging.getLogger("tidegate.parallel")

# Exit status of a worker whose rank died: the supervisor (compose, Kubernetes) restarts it.
RANK_LOST_EXIT = 3


class ParallelStartError(RuntimeError):
    """A parallel worker that cannot start here (the message says why)."""


@dataclass(frozen=True, slots=True)
class ShareSpec:
    """What every rank loads: the model and how (rank 0's settings, picklable)."""

    model: str
    device: str  # "cpu" or "cuda": rank r takes cuda:r
    dtype: str  # "auto" or a torch dtype's name
    quantize: str | None
    seed: int
    engine: object  # tidegate.worker.engine.engine.EngineConfig
    torch_threads: int | None = None


def rank_device(device: str, rank: int) -> torch.device:
    kind = torch.device(device).type
    return torch.device(f"cuda:{rank}") if kind == "cuda" else torch.device("cpu")


def check_devices(layout: ParallelLayout, device: str) -> None:
    """Raise ``ParallelStartError`` unless this host has a device for every rank."""
    if torch.device(device).type != "cuda":
        if torch.device(device).type != "cpu":
            raise ParallelStartError(f"--device {device}: parallel workers run on cuda or cpu")
        return
    if torch.device(device).index not in (None, 0):
        raise ParallelStartError(f"--device {device}: a parallel worker's ranks take cuda:0 "
                                 f"to cuda:{layout.world - 1}; give --device cuda")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < layout.world:
        raise ParallelStartError(
            f"--tensor-parallel-size {layout.tp} x --pipeline-parallel-size {layout.pp} needs "
            f"{layout.world} CUDA devices; this host has {have}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankProcesses:
    def __init__(self, layout: ParallelLayout, spec: ShareSpec) -> None:
        """Start ranks 1..N-1; rank 0 (the caller) then joins the group at ``init_method``."""
        check_devices(layout, spec.device)
        multicast_off()  # children inherit the environment, so they start with it too
        self.layout = layout
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self._closing = threading.Event()
        self._lost_lock = threading.Lock()
        self._reaping = threading.Lock()
        for rank in range(1, layout.world):
            proc = ctx.Process(target=follower_main, name=f"tidegate-rank{rank}",
                               args=(layout, rank, self.init_method, spec, os.getpid()),
                               daemon=True)
            proc.start()
            self.procs.append(proc)
        self._watch = threading.Thread(target=self._watch_ranks, name="rank-watch",
                                       daemon=True)
        self._watch.start()

    def _watch_ranks(self) -> None:
        dead = self._exited(timeout_s=None)
        if dead is None or self._closing.is_set():
            return
        self.lost(dead)

    def _exited(self, timeout_s: float | None) -> str | None:
        """Which rank's process exited and how, waiting up to ``timeout_s`` (None: until
        one does); None if none did in that time."""
        sentinels = {p.sentinel: p for p in self.procs}
        ready = wait(list(sentinels), timeout=timeout_s)
        if not ready:
            return None
        dead = sentinels[ready[0]]
        # The sentinel closes as the process exits, before it can be reaped: wait for its
        # status (else exitcode reads None). One thread at a time: the watcher and the
        # runner may both ask, and a second waitpid on a reaped child reads no status.
        with self._reaping:
            dead.join(timeout=1.0)
            code = dead.exitcode
        return (f"rank {dead.name.removeprefix('tidegate-rank')} (pid {dead.pid}) exited "
                f"with status {code}")

    def collective_failed(self, detail: str) -> NoReturn:
        """Rank 0's runner found a peer's connection closed. A killed rank's sockets close a
        moment before its process is gone, so this often comes before the watcher sees the
        exit: give it a second, and report the rank and its exit status (what the operator
        needs) rather than the transport's message, unless no rank process exited."""
        self.lost(self._exited(timeout_s=1.0) or f"a collective failed ({detail})")

    def lost(self, reason: str) -> NoReturn:
        """A rank is gone (its process exited, or a collective found its peer closed): stop
        the whole worker at once, as a killed worker stops; its jobs are reclaimed by other
        workers. Called by the watcher or by rank 0's runner, whichever notices first."""
        with self._lost_lock:
            log.error("%s: stopping this worker (its jobs are reclaimed by other workers)",
                      reason)
            self.kill()
            logging.shutdown()
            # The engine thread may be inside a collective that never ends: no clean exit.
            os._exit(RANK_LOST_EXIT)

    def kill(self) -> None:
        """Kill every rank (start-up failed, or the worker is going down anyway)."""
        self._closing.set()
        with self._reaping:  # see close()
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(timeout=5)

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for ranks told to stop (``Engine.close``); kill what is left after
        ``timeout_s``."""
        self._closing.set()
        deadline = time.monotonic() + timeout_s
        # The watcher wakes as the ranks exit and reaps too: reaping one at a time, each
        # status is recorded before anyone else asks. (A join whose waitpid found the child
        # already reaped by the other thread, before that thread stored the status, read
        # None and left the rank listed as alive: a clean-clone run saw "a rank outlived
        # Engine.close".)
        with self._reaping:
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


def _exit_with_parent(parent: int) -> None:
    """A child whose rank 0 is gone (killed: no stop message) exits by itself."""
    while True:
        if os.getppid() != parent:
            os._exit(RANK_LOST_EXIT)
        time.sleep(0.2)


def follower_main(layout: ParallelLayout, rank: int, init_method: str, spec: ShareSpec,
                  parent: int) -> None:
    """A child rank: join the group, load the share, follow rank 0 until told to stop."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    from tidegate.worker.engine.engine import EngineConfig, build_runner
    from tidegate.worker.models.loaders.loader import load_model
    from tidegate.worker.parallel.follower import Follower
    from tidegate.worker.parallel.rank_share import RankShare
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    device = rank_device(spec.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    group = ModelGroup(layout.place(rank), device, init_method)
    dtype = None if spec.dtype == "auto" else getattr(torch, spec.dtype)
    loaded = load_model(spec.model, device=device, dtype=dtype, seed=spec.seed, packed=False,
                        quantize=spec.quantize, share=RankShare(layout.place(rank)))
    assert isinstance(spec.engine, EngineConfig)
    loaded.model.connect(group if layout.tp > 1 else None)
    _spec, runner, _draft = build_runner(loaded.model, spec.engine, None, group)
    follower = Follower(runner, group)
    try:
        follower.run()
    except RuntimeError as exc:
        if not _group_lost(exc, parent):
            raise  # a fault of this rank's own: its traceback, then rank 0 sees it exit
        log.error("rank %d: the group is gone (%s); exiting", rank,
                  str(exc).splitlines()[0][:200])
        logging.shutdown()
        os._exit(RANK_LOST_EXIT)
    group.close()


def _group_lost(exc: RuntimeError, parent: int) -> bool:
    """Whether a collective failed because another rank is gone (rank 0 killed: its child is
    re-parented within a moment; a sibling killed: the connection closed)."""
    if is_peer_lost(exc):
        return True
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            return True
        time.sleep(0.05)
    return False
