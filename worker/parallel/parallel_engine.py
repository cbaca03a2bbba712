"""``start_parallel_engine``: rank 0's engine of a tensor- or pipeline-parallel worker.

Starts the other ranks (``RankProcesses``), joins their group, loads rank 0's share
(``RankShare``), builds its runner over the group and hands the engine that runner wrapped
(``ParallelRunner``), so every step the engine takes the other ranks follow; ``Engine.close``
stops and waits for them. The engine owns the runner's interface and never imports this side.
The worker (``tidegate.worker.service.service.build_engine``) and the tests start parallel
engines here.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from tidegate.worker.engine.engine import Engine, EngineConfig, build_runner
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.parallel.layout import ParallelLayout
from tidegate.worker.parallel.model_group import ModelGroup
from tidegate.worker.parallel.parallel_runner import ParallelRunner
from tidegate.worker.parallel.rank_processes import RankProcesses, ShareSpec, rank_device
from tidegate.worker.parallel.rank_share import RankShare

log = logging.getLogger("tidegate.parallel")


def start_parallel_engine(model: str, layout: ParallelLayout, config: EngineConfig, *,
                          device: str = "cpu", dtype: str = "auto", quantize: str | None = None,
                          seed: int = 0, torch_threads: int | None = None) -> Engine:
    """Every rank loads ``model`` (its share; quantized files dequantized, random weights
    drawn with ``seed``) on its device: ``cuda:rank``, or the CPU with gloo."""
    if dist.is_initialized():
        raise ValueError("this process runs a tensor- or pipeline-parallel engine already: "
                         "one per process (start a worker per parallel model)")
    if config.max_loras:
        raise ValueError("LoRA adapters are not served by tensor- or pipeline-parallel "
                         "workers (max_loras must be 0)")
    place = layout.place(0)
    dev = rank_device(device, 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ranks = RankProcesses(layout, ShareSpec(model, device, dtype, quantize, seed, config,
                                            torch_threads))
    try:
        group = ModelGroup(place, dev, ranks.init_method)
        loaded = load_model(model, device=dev, dtype=None if dtype == "auto"
                            else getattr(torch, dtype), seed=seed, packed=False,
                            quantize=quantize, share=RankShare(place))
        loaded.model.connect(group if layout.tp > 1 else None)
        _, own, _ = build_runner(loaded.model, config, None, group)
        runner = ParallelRunner(own, group)
        engine = Engine(loaded.model, loaded.tokenizer, config, runner=runner)
    except BaseException:
        ranks.kill()
        raise
    runner.on_lost = ranks.collective_failed
    engine.on_close.append(ranks.close)
    engine.on_close.append(group.close)
    log.info("loaded %s as %d ranks (tensor parallel %d x pipeline %d) in %.1fs; rank 0 "
             "holds %.1f MB of weights", loaded.source.name, layout.world, layout.tp,
             layout.pp, loaded.load_s, loaded.weight_bytes() / 1e6)
    return engine
