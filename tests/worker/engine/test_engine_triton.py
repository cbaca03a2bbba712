"""The engine with every kernel on its Triton path (the interpreter on a CPU, the GPU where
there is one) produces the plain-torch engine's greedy tokens: chunked prefill, decode, and
prefix-cache hits all go through the Triton kernels behind ``tidegate.kernels.ops``, and so do the one-row
decode steps' fused projections (norm, SiLU and residual add in the weight stream)."""

from __future__ import annotations

import pytest
import torch

import tidegate.kernels.gpu.linear_triton as linear_triton
import tidegate.kernels.gpu.paged_attention_triton as attention_triton
import tidegate.kernels.gpu.rmsnorm_triton as rmsnorm_triton
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def greedy_tokens(mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    monkeypatch.setenv("TIDEGATE_KERNELS", mode)
    loaded = load_model("random:tiny", device=DEVICE, dtype=torch.float32, seed=3)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_gb=0.01,
        cuda_graphs=False))
    shared = list(range(10, 42))  # two full blocks: the later requests hit the prefix cache
    prompts = [shared + [50 + i] * (3 + 9 * i) for i in range(4)] + [list(range(300, 303))]
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(
            max_tokens=10, ignore_eos=True)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    assert engine.stats.prompt_tokens_computed < sum(map(len, prompts))  # prefix hits happened
    return tokens


def test_triton_kernels_give_the_reference_engines_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"attention": 0, "rms_norm": 0, "skinny_linear": 0}
    for module, name, key in ((attention_triton, "paged_attention_triton", "attention"),
                              (rmsnorm_triton, "rms_norm_triton", "rms_norm"),
                              (linear_triton, "skinny_linear_triton", "skinny_linear")):
        real = getattr(module, name)

        def counted(*args: object, _real=real, _key=key, **kwargs: object) -> object:
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    reference = greedy_tokens("reference", monkeypatch)
    assert calls == {"attention": 0, "rms_norm": 0, "skinny_linear": 0}
    assert greedy_tokens("triton", monkeypatch) == reference
    # The last request decodes alone: its one-row projections take the fused GEMV kernel.
    assert all(n > 0 for n in calls.values()), calls
    assert all(len(t) == 10 for t in reference.values())
