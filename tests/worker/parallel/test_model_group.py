"""The process group's operations between real processes (gloo): the step message (small,
and larger than its buffer), the collectives, the KV agreement, a long idle wait."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import torch

from tidegate.worker.parallel.layout import ParallelLayout
from tidegate.worker.parallel.model_group import MESSAGE_BYTES, ModelGroup
from tidegate.worker.parallel.rank_processes import free_port


def _rank(rank: int, init: str, results: Any) -> None:
    group = ModelGroup(ParallelLayout(tp=2).place(rank), torch.device("cpu"), init,
                       timeout_s=1.0)
    out: dict[str, object] = {}
    if rank == 0:
        time.sleep(3.0)  # idle longer than the timeout: the others keep waiting
        group.broadcast({"step": 1})
        group.broadcast(list(range(3 * MESSAGE_BYTES // 4)))  # past one buffer
    else:
        out["small"] = group.broadcast()
        out["large"] = len(group.broadcast())
    x = torch.full((2, 3), float(rank + 1))
    out["sum"] = group.all_reduce(x.clone()).tolist()
    out["gathered"] = group.all_gather_columns(x).tolist()
    out["min"] = group.min_int(100 + rank)
    results.put((rank, out))
    group.close()


def test_two_ranks_talk() -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, init, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got[1]["small"] == {"step": 1}
    assert got[1]["large"] == 3 * MESSAGE_BYTES // 4
    for rank in (0, 1):
        assert got[rank]["sum"] == [[3.0] * 3] * 2
        assert got[rank]["gathered"] == [[1.0] * 3 + [2.0] * 3] * 2
        assert got[rank]["min"] == 100
