"""A model with weight-only integer projections on a real GPU: the Triton integer kernels in
the engine (prefill GEMMs, fused few-row decode projections, CUDA graphs), against the same
integers on the CPU's native kernel in float32. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import rel_err
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.decoder import CausalAttention
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.models.online_quantization import quantize_loaded

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def int_model(device: str, dtype: torch.dtype, bits: int, group: int | None) -> LoadedModel:
    torch.manual_seed(0)
    loaded = load_model("random:smollm2-135m", device="cpu", dtype=torch.float32)
    quantize_loaded(loaded.model, bits, group)  # on the CPU: both devices get these integers
    if device != "cpu":
        gpu = load_model("random:smollm2-135m", device=device, dtype=dtype)
        cpu_layers = loaded.model.layers
        gpu.model.load_state_dict({k: v.to(dtype) for k, v in loaded.model.state_dict().items()},
                                  strict=False)
        for cpu_layer, gpu_layer in zip(cpu_layers, gpu.model.layers, strict=True):
            for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                module = getattr(cpu_layer, attr)
                assert isinstance(module.weight, IntWeight)
                replacement = type(module)(module.weight.to(device))
                setattr(gpu_layer, attr, replacement)
        return gpu
    return loaded


@pytest.mark.parametrize(("bits", "group"), [(4, 64), (8, None)])
@pytest.mark.parametrize("tokens", [1, 200])
def test_forward_matches_the_cpu_kernel(bits: int, group: int | None, tokens: int) -> None:
    cpu = int_model("cpu", torch.float32, bits, group)
    gpu = int_model("cuda", torch.bfloat16, bits, group)
    ids = torch.randint(0, cpu.config.vocab_size, (tokens,))
    pos = torch.arange(tokens)
    want = cpu.model.compute_logits(cpu.model(ids, pos, CausalAttention()))
    got = gpu.model.compute_logits(gpu.model(ids.cuda(), pos.cuda(), CausalAttention()))
    assert rel_err(got.cpu(), want) < 3e-2


def test_engine_graphs_replay_the_eager_integer_kernels() -> None:
    loaded = int_model("cuda", torch.bfloat16, 4, 64)

    def greedy(cuda_graphs: bool, max_num_seqs: int) -> list[list[int]]:
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
            max_model_len=512, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
            kv_cache_gb=0.25, cuda_graphs=cuda_graphs))
        for i in range(4):
            engine.add_request(EngineRequest(f"r{i}", [100 + 7 * i + j for j in range(30)],
                                             SamplingParams(max_tokens=16, ignore_eos=True)))
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        while engine.has_unfinished():
            for o in engine.step():
                if o.token_id is not None:
                    out[o.request_id].append(o.token_id)
        return [out[f"r{i}"] for i in range(4)]

    for seqs in (1, 4):  # one row per decode (fused norm/SiLU/add kernels), and four
        graphs, eager = greedy(True, seqs), greedy(False, seqs)
        same = sum(a == b for g, e in zip(graphs, eager, strict=True)
                   for a, b in zip(g, e, strict=True))
        assert same >= 0.9 * 64, (graphs, eager)
