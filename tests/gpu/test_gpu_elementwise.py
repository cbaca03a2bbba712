"""The elementwise Triton kernels in bfloat16 on a real GPU, at the model's shapes.

Each kernel is compared with the float32 reference on the same bfloat16 inputs by relative
error ||out - ref|| / ||ref|| (bfloat16 keeps 8 bits: 1e-2 leaves room for its rounding but not
for a wrong element); the KV store only moves data, so it must match exactly. Last, all four run
inside one captured CUDA graph, as the model's decode step runs them.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import BF16_REL_ERR, rel_err
from tidegate.kernels.cpu.paged_attention import store_kv_ref
from tidegate.kernels.gpu.activation_triton import silu_and_mul_triton
from tidegate.kernels.gpu.kv_store_triton import store_kv_triton
from tidegate.kernels.gpu.rmsnorm_triton import rms_norm_triton
from tidegate.kernels.gpu.rotary_triton import rotary_triton
from tidegate.kernels.reference.activation import silu_and_mul_ref
from tidegate.kernels.reference.rmsnorm import rms_norm_ref
from tidegate.kernels.reference.rotary import cos_sin_cache, rotary_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = [1, 256, 4096]
HIDDEN, HQ, HK, D, INTER = 4096, 32, 8, 128, 14336
MAX_POS = 8192
BLOCK_SIZE = 16


def fused_qkv(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fused, q, k, v): q/k/v [T, H, D] views of one bfloat16 [T, (Hq + 2Hk) * D] projection."""
    fused = torch.randn(tokens, (HQ + 2 * HK) * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = fused.split([HQ * D, HK * D, HK * D], dim=-1)
    return fused, q.view(tokens, HQ, D), k.view(tokens, HK, D), v.view(tokens, HK, D)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_bf16(tokens: int, with_residual: bool) -> None:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) if with_residual else None
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)

    normed, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
    want_normed, want_residual = rms_norm_ref(
        x.float(), weight.float(), 1e-5, None if residual is None else residual.float()
    )

    assert normed.dtype == torch.bfloat16
    assert rel_err(normed, want_normed) < BF16_REL_ERR
    assert rel_err(new_residual, want_residual) < BF16_REL_ERR


@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_bf16(tokens: int) -> None:
    fused, q, k, _ = fused_qkv(tokens)
    positions = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    cache = cos_sin_cache(D, MAX_POS, 500000.0, None).cuda()
    want_q, want_k = rotary_ref(q.float(), k.float(), positions, cache)
    v_before = fused[:, (HQ + HK) * D:].clone()

    out_q, out_k = rotary_triton(q, k, positions, cache)

    assert out_q is q and out_k is k
    assert rel_err(q, want_q) < BF16_REL_ERR
    assert rel_err(k, want_k) < BF16_REL_ERR
    assert torch.equal(fused[:, (HQ + HK) * D:], v_before)


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_bf16(tokens: int) -> None:
    x = torch.randn(tokens, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    out = silu_and_mul_triton(x)
    assert out.shape == (tokens, INTER) and out.dtype == torch.bfloat16
    assert rel_err(out, silu_and_mul_ref(x.float())) < BF16_REL_ERR


@pytest.mark.parametrize("tokens", TOKENS)
def test_store_kv_bf16_exact(tokens: int) -> None:
    _, _, key, value = fused_qkv(tokens)
    num_blocks = tokens // BLOCK_SIZE + 8
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
    slots[::7] = -1
    shape = (num_blocks, BLOCK_SIZE, HK, D)
    key_cache = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    value_cache = torch.full_like(key_cache, float("nan"))
    want_key, want_value = key_cache.clone(), value_cache.clone()

    store_kv_triton(key, value, key_cache, value_cache, slots)
    store_kv_ref(key, value, want_key, want_value, slots)

    torch.testing.assert_close(key_cache, want_key, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, want_value, rtol=0, atol=0, equal_nan=True)


def test_all_four_in_a_cuda_graph() -> None:
    tokens, num_blocks = 64, 16
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    fused, q, k, v = fused_qkv(tokens)
    positions = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    cache = cos_sin_cache(D, MAX_POS, 500000.0, None).cuda()
    gate_up = torch.randn(tokens, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, HK, D, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
        rotary_triton(q, k, positions, cache)
        store_kv_triton(k, v, key_cache, value_cache, slots)
        return normed, new_residual, silu_and_mul_triton(gate_up)

    # Compile (and let the allocator settle) outside the capture, on a side stream as required.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, new_residual, act = step()

    # Fresh inputs, copied into the captured buffers; the replay must see them.
    for t in (x, residual, fused, gate_up):
        t.copy_(torch.randn_like(t))
    positions.copy_(torch.randint(0, MAX_POS, (tokens,), device="cuda"))
    slots.copy_(torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens])
    slots[::5] = -1
    want_normed, want_residual = rms_norm_ref(x.float(), weight.float(), 1e-5, residual.float())
    want_q, want_k = rotary_ref(q.float(), k.float(), positions, cache)
    want_act = silu_and_mul_ref(gate_up.float())
    want_key, want_value = key_cache.clone(), value_cache.clone()
    store_kv_ref(want_k.to(torch.bfloat16), v, want_key, want_value, slots)

    graph.replay()
    torch.cuda.synchronize()

    assert rel_err(normed, want_normed) < BF16_REL_ERR
    assert rel_err(new_residual, want_residual) < BF16_REL_ERR
    assert rel_err(q, want_q) < BF16_REL_ERR and rel_err(k, want_k) < BF16_REL_ERR
    assert rel_err(act, want_act) < BF16_REL_ERR
    # k went through the kernel's rotation, so compare the cache with what the kernel stored.
    assert torch.equal(key_cache.view(-1, HK, D)[slots[slots >= 0]], k[slots >= 0])
    assert rel_err(key_cache, want_key) < BF16_REL_ERR
    assert torch.equal(value_cache, want_value)
