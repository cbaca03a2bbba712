"""LoRA adapters in the engine on a GPU, in bf16: each adapter's greedy tokens against the CPU
engine's float32 (itself equal to HF transformers + peft, tests/worker/engine/test_engine_lora),
and a batch mixing three adapters and the base replayed from CUDA graphs against eager steps.
Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.engine.test_engine_lora import ADAPTERS, NEW_TOKENS, checkpoints, greedy
from tidegate.worker.engine.engine import Engine, EngineConfig
from tidegate.worker.models.loaders.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
__all__ = ["checkpoints"]  # the PEFT directories, a module fixture shared with the CPU tests


def engine_on(checkpoints: Path, device: str, dtype: torch.dtype, **config: object) -> Engine:
    loaded = load_model(str(checkpoints / "base"), device=device, dtype=dtype)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(  # type: ignore[arg-type]
        max_model_len=256, num_blocks=64, max_loras=4, max_lora_rank=16, **config))
    for name in ADAPTERS:
        engine.add_adapter(name, str(checkpoints / name))
    return engine


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens until the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_bf16_adapters_agree_with_the_cpu_float32_engine(checkpoints: Path) -> None:
    """bf16 rounding may flip a near-tie and the texts then part; a wrong adapter (missing,
    another row's, unscaled) parts from the first token."""
    requests = {name: name for name in ADAPTERS} | {"base": None}
    cpu = greedy(engine_on(checkpoints, "cpu", torch.float32), requests)
    gpu = greedy(engine_on(checkpoints, "cuda", torch.bfloat16), requests)
    agree = {rid: agreement(cpu[rid], gpu[rid]) for rid in requests}
    print(agree)
    assert all(n >= 1 for n in agree.values()), agree
    assert sum(agree.values()) >= 0.5 * NEW_TOKENS * len(requests), agree
    assert len({tuple(t) for t in gpu.values()}) == len(requests)  # each adapter matters


def test_cuda_graph_replay_of_mixed_adapters_gives_the_eager_tokens(checkpoints: Path) -> None:
    """Two of each adapter and two base rows decode together, from graphs captured with
    adapters, then eagerly: the same kernels on the same rows."""
    requests = {f"r{i}": adapter for i, adapter in enumerate([None, *ADAPTERS] * 2)}
    graphs = greedy(engine_on(checkpoints, "cuda", torch.bfloat16, cuda_graphs=True), requests)
    eager = greedy(engine_on(checkpoints, "cuda", torch.bfloat16, cuda_graphs=False), requests)
    same = sum(a == b for rid in requests for a, b in zip(graphs[rid], eager[rid], strict=True))
    assert same >= 0.95 * NEW_TOKENS * len(requests)
    assert all(graphs[rid][:4] == eager[rid][:4] for rid in requests)
