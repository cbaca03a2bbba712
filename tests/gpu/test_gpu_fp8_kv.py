"""The FP8 KV cache (``--kv-cache-dtype fp8``: e4m3, scale 1) on a real GPU.

The store kernels write e4m3 values saturated to +-448 (what ``torch``'s cast gives in range);
the attention kernels read them against a float32 reference on the same e4m3 values, so only
the kernels' own rounding is measured; the engine on an FP8 cache holds twice the tokens of
bf16 in the same memory, replays its graphs as it runs eagerly, and its greedy tokens stay
close to the bf16 cache's. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import BF16_REL_ERR, rel_err
from tests.gpu.test_gpu_attention import BLOCK_SIZE, HK, D, decode_contexts, paged_step, reference
from tidegate.kernels.gpu.kv_store_triton import store_kv_triton
from tidegate.kernels.gpu.paged_attention_triton import (
    default_num_splits,
    paged_attention_triton,
    paged_decode_attention_triton,
)
from tidegate.kernels.gpu.rotary_triton import rotary_store_kv_triton
from tidegate.kernels.reference.rotary import cos_sin_cache, rotary_ref
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8 = torch.float8_e4m3fn


def test_store_saturates_into_e4m3() -> None:
    t, slots = 64, 4 * BLOCK_SIZE
    key = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16) * 100  # past +-448 too
    value = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(slots // BLOCK_SIZE, BLOCK_SIZE, HK, D, device="cuda", dtype=FP8)
    vc = torch.zeros_like(kc)
    slot_mapping = torch.randperm(slots, device="cuda")[:t]
    store_kv_triton(key, value, kc, vc, slot_mapping)
    flat_k, flat_v = kc.view(slots, HK, D)[slot_mapping], vc.view(slots, HK, D)[slot_mapping]
    assert torch.isfinite(flat_k.float()).all() and flat_k.float().abs().max() == 448
    # Within one e4m3 step (1/8 of a normal value; 2**-9 below the normals) of the saturated
    # value: the kernel's conversion may round ties differently from torch's.
    for got, want in ((flat_k, key.float().clamp(-448, 448)), (flat_v, value.float())):
        torch.testing.assert_close(got.float(), want, rtol=0.125, atol=2**-9)


def test_rotary_store_writes_the_rotated_keys_in_e4m3() -> None:
    t, hq, slots = 40, 32, 4 * BLOCK_SIZE
    q = torch.randn(t, hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 1000, (t,), device="cuda")
    cache = cos_sin_cache(D, 2048, 500000.0, None).cuda()
    kc = torch.zeros(slots // BLOCK_SIZE, BLOCK_SIZE, HK, D, device="cuda", dtype=FP8)
    vc = torch.zeros_like(kc)
    slot_mapping = torch.randperm(slots, device="cuda")[:t]
    _, want_k = rotary_ref(q.clone(), k.clone(), positions, cache)
    rotary_store_kv_triton(q, k, v, positions, cache, kc, vc, slot_mapping)
    got = kc.view(slots, HK, D)[slot_mapping].float()
    # One e4m3 step is 1/8 of the value: a wrong rotation would be off by whole values.
    assert rel_err(got, want_k.float()) < 0.05
    torch.testing.assert_close(vc.view(slots, HK, D)[slot_mapping].float(), v.float(),
                               rtol=0.125, atol=2**-9)


def fp8_step(seqs: list[tuple[int, int]], seed: int):  # noqa: ANN201
    q, kc, vc, meta = paged_step(seqs, seed=seed)
    return q, kc.to(FP8), vc.to(FP8), meta  # NaN stays NaN: a stray read still fails


def test_decode_reads_the_fp8_cache() -> None:
    q, kc, vc, meta = fp8_step(decode_contexts(64, seed=4), seed=4)
    splits = default_num_splits(meta.max_seq_len, 64, HK)
    out = paged_decode_attention_triton(q, kc, vc, meta.block_tables, meta.seq_lens,
                                        D**-0.5, splits)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out, reference(q, kc, vc, meta)) < BF16_REL_ERR


def test_prefill_reads_the_fp8_cache() -> None:
    q, kc, vc, meta = fp8_step([(1536, 512)] * 2 + [(512, 512)], seed=5)
    out = paged_attention_triton(q, kc, vc, meta, D**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(q, kc, vc, meta)) < BF16_REL_ERR


def greedy(engine: Engine, n: int = 6, tokens: int = 24) -> list[list[int]]:
    for i in range(n):
        engine.add_request(EngineRequest(f"r{i}", [100 + 13 * i + j for j in range(40)],
                                         SamplingParams(max_tokens=tokens, ignore_eos=True)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                out[o.request_id].append(o.token_id)
    return [out[f"r{i}"] for i in range(n)]


def test_the_engine_holds_twice_the_tokens_and_decodes_alike() -> None:
    torch.manual_seed(0)
    loaded = load_model("random:smollm2-135m", device="cuda", dtype=torch.bfloat16)

    def engine(kv: str, cuda_graphs: bool = True) -> Engine:
        return Engine(loaded.model, loaded.tokenizer, EngineConfig(
            max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_gb=0.25,
            kv_cache_dtype=kv, cuda_graphs=cuda_graphs))

    bf16, fp8 = engine("auto"), engine("fp8")
    assert fp8.kv_spec.num_tokens >= 2 * bf16.kv_spec.num_tokens - BLOCK_SIZE
    assert fp8.runner.kv_cache.dtype == FP8
    want, got = greedy(bf16), greedy(fp8)
    eager = greedy(engine("fp8", cuda_graphs=False))
    same = sum(a == b for g, e in zip(got, eager, strict=True) for a, b in zip(g, e, strict=True))
    assert same >= 0.9 * 6 * 24
    # Random weights have flat logits, so e4m3's rounding flips near-ties sooner than on a
    # trained model; a broken cache would disagree from the first token everywhere.
    assert sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) >= 5
