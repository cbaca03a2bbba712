"""Every family on the GPU in bf16: logits of a causal pass against the CPU's float32 on the
same checkpoint, and the paged engine (Triton kernels, CUDA graphs) against its own eager
steps; the windowed, soft-capped attention and the fused MoE kernel in bf16. Skipped without
CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import rel_err
from tests.worker.hf_oracle import causal_logits
from tests.worker.models.family_checkpoints import FAMILIES, write_family
from tidegate.kernels.gpu.moe_triton import moe_triton
from tidegate.kernels.reference.moe import moe_ref
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[256, *b"The tide gate opens at dawn and closes at dusk. Why?"],
           [256, *b"Short one."], [256, *b"A third prompt, of middling length here."]]
# bf16 weights and activations through a 2-3 layer model with weights far from init: 0.2-3.2%
# measured on the H200 (the most for Mixtral, where bf16 router logits may pick another
# expert for a token).
LOGITS_REL_ERR = 5e-2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bf16_logits_and_engine(tmp_path: Path, name: str) -> None:
    _, path = write_family(name, tmp_path / "m")
    cpu = load_model(str(path))
    gpu = load_model(str(path), device="cuda", dtype=torch.bfloat16)
    for ids in PROMPTS:
        want = causal_logits(cpu.model, ids)
        got = causal_logits(gpu.model, ids).cpu()
        assert rel_err(got, want) < LOGITS_REL_ERR

    def tokens(graphs: bool) -> dict[str, list[int]]:
        engine = Engine(gpu.model, gpu.tokenizer, EngineConfig(
            max_model_len=256, num_blocks=64, block_size=16, max_num_seqs=4,
            cuda_graphs=graphs))
        for i, ids in enumerate(PROMPTS):
            engine.add_request(EngineRequest(f"r{i}", ids, SamplingParams(
                max_tokens=20, ignore_eos=True)))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.token_id is not None:
                    out.setdefault(o.request_id, []).append(o.token_id)
        return out

    eager, graphed = tokens(False), tokens(True)
    assert all(len(t) == 20 for t in graphed.values())
    assert graphed == eager


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (300, 8, 2),
                                                          (64, 128, 8)])
def test_fused_moe_bf16(tokens: int, experts: int, top_k: int) -> None:
    hidden, inter = 1024, 768
    router = torch.randn(experts, hidden, device="cuda") / hidden ** 0.5
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5
    x = torch.randn(tokens, hidden, device="cuda")
    x, router, w13, w2 = (t.bfloat16() for t in (x, router, w13, w2))
    # The reference on the same bf16 tensors routes from the same bf16 logits; what differs
    # is summation order and the kernel's bf16 intermediate.
    want = moe_ref(x, router, w13, w2, top_k)
    got = moe_triton(x, router, w13, w2, top_k)
    assert rel_err(got, want) < 1e-2
