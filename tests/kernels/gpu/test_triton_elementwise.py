"""The elementwise Triton kernels (RMSNorm, rotary, SiLU-and-mul, KV store) against their
plain-torch references.

Without CUDA they run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET), so
shapes stay small. Inputs are strided views (fused qkv, padded rows) as the model passes them;
every fresh output the wrappers allocate, and every cache, starts as NaN, so an element a
kernel fails to write fails the comparison. bfloat16 is left to ``tests/gpu``: the
interpreter's bfloat16 is unreliable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tidegate.kernels import ops
from tidegate.kernels.cpu.paged_attention import store_kv_ref
from tidegate.kernels.gpu.activation_triton import silu_and_mul_triton
from tidegate.kernels.gpu.kv_store_triton import store_kv_triton
from tidegate.kernels.gpu.rmsnorm_triton import rms_norm_triton
from tidegate.kernels.gpu.rotary_triton import rotary_store_kv_triton, rotary_triton
from tidegate.kernels.reference.activation import silu_and_mul_ref
from tidegate.kernels.reference.rmsnorm import rms_norm_ref
from tidegate.kernels.reference.rotary import cos_sin_cache, rotary_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
MAX_POS = 256


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    # float16: a different float32 rounding upstream may move the result by one or two ulps.
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floating-point ``torch.empty`` tensors start as NaN while the test runs."""
    empty = torch.empty

    def nan_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32, device=DEVICE).to(dtype)


def fused_qkv(tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, pad: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fused [T, Hq*D + 2*Hk*D + pad], q, k, v) with q/k/v [T, H, D] views into fused."""
    fused = randn(tokens, (hq + 2 * hk) * d + pad, dtype=dtype)
    q, k, v, _ = fused.split([hq * d, hk * d, hk * d, pad], dim=-1)
    return fused, q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)


# --- RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (37, 1000), (3, 64)])
def test_rms_norm_matches_reference(poisoned_empty: None, tokens: int, hidden: int,
                                    with_residual: bool, dtype: torch.dtype) -> None:
    # Rows of wider tensors: a row stride != H, as a slice of a fused projection would have.
    x = randn(tokens, hidden + 24, dtype=dtype)[:, :hidden]
    residual = randn(tokens, hidden + 8, dtype=dtype)[:, :hidden] if with_residual else None
    weight = (1 + 0.1 * randn(hidden, dtype=torch.float32)).to(dtype)
    x_before = x.clone()
    residual_before = None if residual is None else residual.clone()

    normed, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    want_normed, want_residual = rms_norm_ref(x, weight, 1e-6, residual)

    assert normed.is_contiguous() and normed.dtype == dtype
    torch.testing.assert_close(normed, want_normed, **tolerances(dtype))
    # The residual sum is rounded the same way in both: exactly equal.
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    assert torch.equal(x, x_before)
    if residual is not None:
        assert torch.equal(residual, residual_before)
        assert new_residual.data_ptr() not in (x.data_ptr(), residual.data_ptr())


def test_rms_norm_float32_weight_promotes_like_reference() -> None:
    x = randn(5, 96, dtype=torch.float16)
    weight = 1 + 0.1 * randn(96, dtype=torch.float32)
    normed, _ = rms_norm_triton(x, weight, 1e-5)
    want, _ = rms_norm_ref(x, weight, 1e-5)
    assert normed.dtype == want.dtype == torch.float32
    torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)


# --- rotary -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hq", "hk", "d"),
    [(1, 4, 2, 64), (37, 6, 2, 80), (5, 3, 3, 16)],  # D=80: a half (40) that is no power of 2
)
def test_rotary_in_place_on_fused_qkv(tokens: int, hq: int, hk: int, d: int,
                                      dtype: torch.dtype) -> None:
    fused, q, k, v = fused_qkv(tokens, hq, hk, d, dtype, pad=8)
    positions = torch.randint(0, MAX_POS, (tokens,), device=DEVICE)
    cache = cos_sin_cache(d, MAX_POS, 10000.0, None).to(DEVICE)
    want_q, want_k = rotary_ref(q, k, positions, cache)
    v_and_pad = fused[:, (hq + hk) * d:].clone()

    out_q, out_k = rotary_triton(q, k, positions, cache)

    assert out_q is q and out_k is k
    torch.testing.assert_close(q, want_q, **tolerances(dtype))
    torch.testing.assert_close(k, want_k, **tolerances(dtype))
    assert torch.equal(fused[:, (hq + hk) * d:], v_and_pad)  # v and the row padding untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_padded_head_stride(dtype: torch.dtype) -> None:
    # Head stride != D (heads padded to D + 8), separate q and k tensors with different strides.
    tokens, d = 7, 32
    q_store = randn(tokens, 4, d + 8, dtype=dtype)
    k_store = randn(tokens, 2, d + 16, dtype=dtype)
    q, k = q_store[..., :d], k_store[..., :d]
    positions = torch.randint(0, MAX_POS, (tokens,), device=DEVICE, dtype=torch.int32)
    cache = cos_sin_cache(d, MAX_POS, 500000.0, None).to(DEVICE)
    want_q, want_k = rotary_ref(q, k, positions.long(), cache)
    q_pad, k_pad = q_store[..., d:].clone(), k_store[..., d:].clone()

    rotary_triton(q, k, positions, cache)

    torch.testing.assert_close(q, want_q, **tolerances(dtype))
    torch.testing.assert_close(k, want_k, **tolerances(dtype))
    assert torch.equal(q_store[..., d:], q_pad) and torch.equal(k_store[..., d:], k_pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hq", "hk", "d"), [(1, 4, 2, 64), (9, 6, 2, 80)])
def test_rotary_with_kv_store_is_rotary_then_store(tokens: int, hq: int, hk: int, d: int,
                                                   dtype: torch.dtype) -> None:
    """One launch: q and k rotated in place as ``rotary_triton`` does, and the rotated k with v
    written to the cache slots as ``store_kv_triton`` does (padding slots skipped)."""
    num_blocks, block_size = 4, 4
    fused, q, k, v = fused_qkv(tokens, hq, hk, d, dtype, pad=8)
    positions = torch.randint(0, MAX_POS, (tokens,), device=DEVICE)
    cache = cos_sin_cache(d, MAX_POS, 10000.0, None).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    if tokens > 1:
        slots[1] = -1
    shape = (num_blocks, block_size, hk, d)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = key_cache.clone()
    want_fused = fused.clone()
    want_key, want_value = key_cache.clone(), value_cache.clone()
    wq, wk, wv = (want_fused[:, a:b].view(tokens, h, d) for a, b, h in (
        (0, hq * d, hq), (hq * d, (hq + hk) * d, hk), ((hq + hk) * d, (hq + 2 * hk) * d, hk)))
    rotary_triton(wq, wk, positions, cache)
    store_kv_triton(wk, wv, want_key, want_value, slots)

    out_q, out_k = rotary_store_kv_triton(q, k, v, positions, cache, key_cache, value_cache,
                                          slots)

    assert out_q is q and out_k is k
    assert torch.equal(fused, want_fused)  # same rotation, in place; v and padding untouched
    torch.testing.assert_close(key_cache, want_key, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, want_value, rtol=0, atol=0, equal_nan=True)
    assert not key_cache.view(-1, hk * d)[slots[slots >= 0]].isnan().any()


# --- SiLU-and-mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 576), (37, 1000), (3, 2500)])  # 2500: 3 blocks
def test_silu_and_mul_matches_reference(poisoned_empty: None, tokens: int, inter: int,
                                        dtype: torch.dtype) -> None:
    x = 2 * randn(tokens, 2 * inter + 16, dtype=dtype)[:, : 2 * inter]  # row stride != 2I
    x_before = x.clone()

    out = silu_and_mul_triton(x)

    assert out.shape == (tokens, inter) and out.dtype == dtype and out.is_contiguous()
    # The kernel computes in float32 and rounds once, so compare with the float32 reference.
    torch.testing.assert_close(out, silu_and_mul_ref(x.float()).to(dtype), **tolerances(dtype))
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=5e-3, atol=5e-3)
    assert torch.equal(x, x_before)


# --- KV store ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16),
     (torch.float32, torch.float16)],
)
@pytest.mark.parametrize(("tokens", "hk", "d", "num_blocks", "block_size"),
                         [(1, 2, 64, 3, 4), (37, 2, 48, 12, 4), (9, 3, 16, 4, 8)])
def test_store_kv_matches_reference(tokens: int, hk: int, d: int, num_blocks: int,
                                    block_size: int, src_dtype: torch.dtype,
                                    cache_dtype: torch.dtype) -> None:
    _, _, key, value = fused_qkv(tokens, 4, hk, d, src_dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    if tokens > 1:
        slots[:: max(tokens // 4, 2)] = -1  # padding tokens, the first among them
    shape = (num_blocks, block_size, hk, d)
    key_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    value_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    want_key, want_value = key_cache.clone(), value_cache.clone()

    store_kv_triton(key, value, key_cache, value_cache, slots)
    store_kv_ref(key, value, want_key, want_value, slots)

    # Exact, NaN in the same places: only the mapped slots were written, the rest untouched.
    torch.testing.assert_close(key_cache, want_key, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, want_value, rtol=0, atol=0, equal_nan=True)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    for cache in (key_cache, value_cache):
        flat = cache.view(-1, hk * d)
        assert not flat[written].isnan().any()
        assert flat[~written].isnan().all()


# --- argument checks --------------------------------------------------------------------------


def _wrong_rms_norm() -> None:
    rms_norm_triton(randn(2, 8, dtype=torch.float32), randn(7, dtype=torch.float32), 1e-6)


def _wrong_rotary() -> None:
    cache = cos_sin_cache(16, MAX_POS, 10000.0, None).to(DEVICE)
    q, k = randn(2, 4, 16, dtype=torch.float32), randn(2, 2, 8, dtype=torch.float32)
    rotary_triton(q, k, torch.zeros(2, dtype=torch.long, device=DEVICE), cache)


def _wrong_silu() -> None:
    silu_and_mul_triton(randn(2, 7, dtype=torch.float32))


def _wrong_store_kv() -> None:
    key = randn(2, 2, 8, dtype=torch.float32)
    cache = torch.zeros(2, 4, 3, 8, device=DEVICE)
    store_kv_triton(key, key, cache, cache.clone(),
                    torch.zeros(2, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize(("call", "argument"), [
    (_wrong_rms_norm, "weight"), (_wrong_rotary, "k"), (_wrong_silu, "x"),
    (_wrong_store_kv, "key_cache"),
])
def test_wrong_shape_raises(call: Callable[[], None], argument: str) -> None:
    with pytest.raises(ValueError, match=rf"^{argument} must"):
        call()


def test_slot_mapping_shape_and_positions_dtype_checked() -> None:
    key = randn(3, 2, 8, dtype=torch.float32)
    cache = torch.zeros(2, 4, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="^slot_mapping must have shape"):
        store_kv_triton(key, key, cache, cache.clone(),
                        torch.zeros(2, dtype=torch.long, device=DEVICE))
    q = randn(3, 2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="^positions must be int64"):
        rotary_triton(q, q.clone(), torch.zeros(3, device=DEVICE),
                      cos_sin_cache(8, MAX_POS, 10000.0, None).to(DEVICE))


# --- dispatch ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "in_place"), [("triton", True), ("reference", False)])
def test_ops_rotary_dispatch(monkeypatch: pytest.MonkeyPatch, mode: str,
                             in_place: bool) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", mode)
    _, q, k, _ = fused_qkv(3, 4, 2, 16, torch.float32)
    positions = torch.arange(3, device=DEVICE) + 5
    cache = cos_sin_cache(16, MAX_POS, 10000.0, None).to(DEVICE)
    want_q, want_k = rotary_ref(q, k, positions, cache)

    out_q, out_k = ops.rotary(q, k, positions, cache)

    assert (out_q is q) is in_place and (out_k is k) is in_place
    torch.testing.assert_close(out_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, want_k, rtol=1e-5, atol=1e-5)


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of the Triton wrappers called while the test runs with TIDEGATE_KERNELS=triton."""
    from tidegate.kernels.gpu import activation_triton, kv_store_triton, rmsnorm_triton

    monkeypatch.setenv("TIDEGATE_KERNELS", "triton")
    calls: list[str] = []
    for module, name in ((rmsnorm_triton, "rms_norm_triton"),
                         (activation_triton, "silu_and_mul_triton"),
                         (kv_store_triton, "store_kv_triton")):
        real = getattr(module, name)

        def spy(*args: object, _real: Callable[..., object] = real, _name: str = name) -> object:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(module, name, spy)
    yield calls


def test_ops_reach_triton_kernels(triton_calls: list[str]) -> None:
    x = randn(4, 64, dtype=torch.float32)
    weight = randn(64, dtype=torch.float32)
    residual = randn(4, 64, dtype=torch.float32)
    normed, new_residual = ops.rms_norm(x, weight, 1e-6, residual)
    want_normed, want_residual = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_residual, want_residual)

    gate_up = randn(4, 96, dtype=torch.float32)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), silu_and_mul_ref(gate_up),
                               rtol=1e-5, atol=1e-5)

    _, _, key, value = fused_qkv(4, 2, 2, 16, torch.float32)
    slots = torch.tensor([5, -1, 0, 9], device=DEVICE)
    key_cache = torch.zeros(3, 4, 2, 16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    want_key, want_value = key_cache.clone(), value_cache.clone()
    ops.store_kv(key, value, key_cache, value_cache, slots)
    store_kv_ref(key, value, want_key, want_value, slots)
    assert torch.equal(key_cache, want_key) and torch.equal(value_cache, want_value)

    assert triton_calls == ["rms_norm_triton", "silu_and_mul_triton", "store_kv_triton"]
