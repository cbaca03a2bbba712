"""Batched LoRA (``tidegate.kernels.reference.lora``): the reference against the row-by-row definition and against
weights merged the way PEFT merges them, and the Triton kernels against the reference: rows of
several adapters, of ranks below the stack's, and of none, in one call; packed projections of
one to three segments (on column tiles and straddling them); RMSNorm fused on the input; one
``LoraRows`` shared by stacks of any shape. Without CUDA the Triton kernels run in the
interpreter (``tests/conftest.py`` sets TRITON_INTERPRET; ``TIDEGATE_KERNELS=triton`` makes
``lora_rows`` build their layout), in float32 and float16."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import pytest
import torch

from tidegate.kernels import ops
from tidegate.kernels.gpu import lora_triton
from tidegate.kernels.gpu.lora_triton import (
    BLOCK_M,
    DIRECT_ROWS,
    add_lora_triton,
    row_tiles,
    shrink_splits,
)
from tidegate.kernels.ops import lora_rows
from tidegate.kernels.reference.lora import NO_ADAPTER, LoraStack, Norm, add_lora_ref, rms_norm_f32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def stack_of(ranks: list[int], k: int, n: int, max_rank: int, segments: tuple[int, ...] = (),
             seed: int = 0, dtype: torch.dtype = torch.float32) -> LoraStack:
    """Adapters of the given ranks, each segment zero-padded to ``max_rank``; scale alpha / r,
    alpha = 2r."""
    g = torch.Generator().manual_seed(seed)
    count = len(segments) + 1
    a = torch.zeros(len(ranks), count * max_rank, k)
    b = torch.zeros(len(ranks), n, max_rank)
    for i, r in enumerate(ranks):
        for s in range(count):
            a[i, s * max_rank:s * max_rank + r] = torch.randn(r, k, generator=g) / k ** 0.5
        b[i, :, :r] = torch.randn(n, r, generator=g) / r ** 0.5
    scale = torch.tensor([2.0] * len(ranks))
    return LoraStack(a.to(DEVICE, dtype), b.to(DEVICE, dtype), scale.to(DEVICE), segments)


def norm_of(k: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Norm:
    gain = 1 + 0.2 * torch.randn(k, generator=torch.Generator().manual_seed(seed))
    return gain.to(DEVICE, dtype), EPS


def definition(x: torch.Tensor, stack: LoraStack, index: torch.Tensor,
               norm: Norm | None) -> torch.Tensor:
    """What each row adds, row by row and segment by segment, in float64."""
    bounds, r = stack.bounds, stack.rank
    out = torch.zeros(x.shape[0], stack.b.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        i = int(index[t])
        if i == NO_ADAPTER:
            continue
        u = x[t].double()
        if norm is not None:
            u = u / (u.pow(2).mean() + norm[1]).sqrt() * norm[0].double()
        for s, (lo, hi) in enumerate(pairwise(bounds)):
            h = stack.a[i, s * r:(s + 1) * r].double() @ u
            out[t, lo:hi] = float(stack.scale[i]) * (stack.b[i, lo:hi].double() @ h)
    return out


@pytest.fixture
def triton_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``lora_rows`` builds the Triton layout (off CUDA: for the interpreter)."""
    monkeypatch.setenv("TIDEGATE_KERNELS", "triton")
    yield


SEGMENTS = {"plain": (), "gate_up": (48,), "qkv": (64, 96)}


@pytest.mark.parametrize("segments", SEGMENTS.values(), ids=SEGMENTS.keys())
@pytest.mark.parametrize("normed", [False, True])
def test_reference_equals_the_definition(segments: tuple[int, ...], normed: bool) -> None:
    k, n = 24, 128
    stack = stack_of([4, 8, 2], k, n, max_rank=8, segments=segments)
    x = 3 * torch.randn(11, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    index = torch.tensor([0, 2, NO_ADAPTER, 1, 1, 0, NO_ADAPTER, 2, 0, 1, 2], device=DEVICE)
    norm = norm_of(k) if normed else None
    y0 = torch.randn(11, n, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y = y0.clone()
    add_lora_ref(y, x, stack, lora_rows(index, 3), norm)
    torch.testing.assert_close(y, (y0 + definition(x, stack, index, norm)).float(),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(y[index == NO_ADAPTER], y0[index == NO_ADAPTER])


@pytest.mark.parametrize("segments", SEGMENTS.values(), ids=SEGMENTS.keys())
def test_reference_equals_merged_weights(segments: tuple[int, ...]) -> None:
    k, n = 24, 128
    stack = stack_of([4, 8, 2], k, n, max_rank=8, segments=segments)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, k, generator=g).to(DEVICE)
    base = torch.randn(n, k, generator=g).to(DEVICE)
    index = torch.tensor([0, 2, NO_ADAPTER, 1, 1, 0, NO_ADAPTER, 2, 0, 1, 2], device=DEVICE)
    y = x @ base.T
    add_lora_ref(y, x, stack, lora_rows(index, 3))
    r = stack.rank
    for t in range(x.shape[0]):
        i = int(index[t])
        merged = base.clone()
        if i != NO_ADAPTER:
            # PEFT's merge, each packed projection on its own: W + scale * B @ A.
            for s, (lo, hi) in enumerate(pairwise(stack.bounds)):
                merged[lo:hi] += stack.scale[i] * stack.b[i, lo:hi] @ stack.a[i, s * r:(s + 1) * r]
        torch.testing.assert_close(y[t], x[t] @ merged.T, rtol=1e-5, atol=1e-5)


# (segments, N): on column tiles (16 divides every offset), and straddling them.
SHAPES = {"plain": ((), 96), "qkv": ((64, 96), 128), "gate_up_straddle": ((40,), 80),
          "qkv_straddle": ((10, 37), 70)}


@pytest.mark.usefixtures("triton_rows")
@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("segments", "n"), SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("normed", [False, True])
def test_triton_equals_the_reference(tokens: int, dtype: torch.dtype, segments: tuple[int, ...],
                                     n: int, normed: bool) -> None:
    k = 600  # not a multiple of the 64-deep K steps; split in two when the rows are few
    stack = stack_of([16, 8, 4], k, n, max_rank=16, segments=segments, dtype=dtype)
    g = torch.Generator().manual_seed(tokens)
    x = 3 * torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    index = torch.randint(-1, 3, (tokens,), generator=g).to(DEVICE)
    if tokens == 1:
        index[0] = 1
    norm = norm_of(k, dtype=dtype) if normed else None
    y0 = torch.randn(tokens, n, generator=g).to(DEVICE, dtype)
    want, got = y0.clone(), y0.clone()
    rows = lora_rows(index, 3)
    add_lora_ref(want, x, stack, rows, norm)
    add_lora_triton(got, x, stack, rows, norm)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    untouched = index == NO_ADAPTER
    assert torch.equal(got[untouched], y0[untouched])


@pytest.mark.usefixtures("triton_rows")
@pytest.mark.parametrize(("segments", "n"), [SHAPES["qkv"], SHAPES["qkv_straddle"]],
                         ids=["qkv", "qkv_straddle"])
def test_prefill_sized_steps_take_the_wide_tiles(monkeypatch: pytest.MonkeyPatch,
                                                 segments: tuple[int, ...], n: int) -> None:
    """From ``WIDE_ROWS`` rows the layout pads each adapter's run to ``WIDE_BLOCK_M`` and the
    expand's column tiles widen to ``WIDE_BLOCK_N``: lowered here to reach them at small sizes."""
    monkeypatch.setattr(lora_triton, "WIDE_ROWS", 48)
    tokens, k = 70, 200
    stack = stack_of([16, 8, 4], k, n, max_rank=16, segments=segments)
    g = torch.Generator().manual_seed(9)
    x = 3 * torch.randn(tokens, k, generator=g).to(DEVICE)
    index = torch.randint(-1, 3, (tokens,), generator=g).to(DEVICE)
    norm = norm_of(k)
    y0 = torch.randn(tokens, n, generator=g).to(DEVICE)
    rows = lora_rows(index, 3)
    assert rows.layout is not None and rows.layout.block_m == lora_triton.WIDE_BLOCK_M
    want, got = y0.clone(), y0.clone()
    add_lora_ref(want, x, stack, rows, norm)
    add_lora_triton(got, x, stack, rows, norm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fewer = lora_rows(index[:40], 3).layout
    assert fewer is not None and fewer.block_m == BLOCK_M


@pytest.mark.usefixtures("triton_rows")
@pytest.mark.parametrize(("segments", "n", "group"), [((), 300, 512), ((128,), 256, 128),
                                                      ((64, 192), 256, 64)],
                         ids=["plain", "gate_up", "qkv"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_an_expand_program_may_cover_many_column_tiles(
        monkeypatch: pytest.MonkeyPatch, segments: tuple[int, ...], n: int, group: int,
        tokens: int) -> None:
    """Few programs wanted: each sums the shrink's partials once and walks its columns (a
    group never crosses a segment offset; a ragged last group is masked)."""
    monkeypatch.setattr(lora_triton, "EXPAND_PROGRAMS", 1)
    block_n, straddle = lora_triton.column_tile(segments)
    assert lora_triton.column_group(n, segments, block_n, straddle, 1) == group
    k = 200
    stack = stack_of([16, 8, 4], k, n, max_rank=16, segments=segments)
    g = torch.Generator().manual_seed(tokens)
    x = 3 * torch.randn(tokens, k, generator=g).to(DEVICE)
    index = torch.randint(-1, 3, (tokens,), generator=g).to(DEVICE)
    if tokens == 1:
        index[0] = 2
    y0 = torch.randn(tokens, n, generator=g).to(DEVICE)
    want, got = y0.clone(), y0.clone()
    rows = lora_rows(index, 3)
    add_lora_ref(want, x, stack, rows, norm_of(k))
    add_lora_triton(got, x, stack, rows, norm_of(k))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_shrink_splits_k_for_few_rows_only() -> None:
    assert shrink_splits(row_tiles(7), 600) == (2, 320)  # the cases above
    assert shrink_splits(row_tiles(40), 600) == (2, 320)
    assert shrink_splits(row_tiles(1), 4096) == (16, 256)
    assert shrink_splits(row_tiles(16), 4096) == (16, 256)
    assert shrink_splits(row_tiles(1), 14336) == (16, 896)
    assert shrink_splits(row_tiles(256), 4096) == (8, 512)
    assert shrink_splits(row_tiles(3000), 4096) == (2, 2048)  # 47 wide tiles
    assert shrink_splits(row_tiles(16384), 4096) == (1, 4096)


@pytest.mark.usefixtures("triton_rows")
@pytest.mark.parametrize("tokens", [1, DIRECT_ROWS, DIRECT_ROWS + 1, 100])
def test_the_layout_holds_each_row_once_in_a_tile_count_known_on_the_host(tokens: int) -> None:
    index = torch.randint(-1, 3, (tokens,), generator=torch.Generator().manual_seed(tokens))
    layout = lora_rows(index.to(DEVICE), 3).layout
    assert layout is not None
    tiles = (tokens if tokens <= DIRECT_ROWS
             else -(-(tokens + 4 * (BLOCK_M - 1)) // BLOCK_M))  # each of 4 runs padded
    assert layout.slots.numel() == tiles * BLOCK_M and layout.block_expert.numel() == tiles
    slots = layout.slots.cpu().view(tiles, BLOCK_M)
    adapters = layout.block_expert.cpu()
    held = slots[slots < tokens]
    assert sorted(held.tolist()) == list(range(tokens))
    routed = torch.where(index == NO_ADAPTER, 3, index)
    for tile in range(tiles):
        rows = slots[tile][slots[tile] < tokens]
        assert torch.all(routed[rows.long()] == adapters[tile])


@pytest.mark.usefixtures("triton_rows")
@pytest.mark.parametrize("tokens", [1, DIRECT_ROWS + 3])
def test_rows_without_adapters_are_left_alone(tokens: int) -> None:
    stack = stack_of([8, 4], 64, 64, max_rank=8, segments=(32,))
    x = torch.randn(tokens, 64).to(DEVICE)
    y0 = torch.randn(tokens, 64).to(DEVICE)
    y = y0.clone()
    add_lora_triton(y, x, stack, lora_rows(torch.full((tokens,), NO_ADAPTER, device=DEVICE), 2),
                    norm_of(64))
    assert torch.equal(y, y0)


@pytest.mark.usefixtures("triton_rows")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_stack_of_one_adapter(dtype: torch.dtype) -> None:
    stack = stack_of([16], 96, 48, max_rank=16, segments=(16, 32), dtype=dtype)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(21, 96, generator=g).to(DEVICE, dtype)
    index = torch.tensor([0, -1] * 10 + [0], device=DEVICE)
    want, got = torch.zeros(21, 48, device=DEVICE, dtype=dtype), torch.zeros(
        21, 48, device=DEVICE, dtype=dtype)
    rows = lora_rows(index, 1)
    add_lora_ref(want, x, stack, rows, norm_of(96, dtype=dtype))
    add_lora_triton(got, x, stack, rows, norm_of(96, dtype=dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.usefixtures("triton_rows")
def test_a_batch_of_one_adapter_equals_each_row_alone() -> None:
    k, n = 64, 64
    stack = stack_of([8, 8], k, n, max_rank=8)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    index = torch.tensor([1] * 20, device=DEVICE)
    together = torch.zeros(20, n, device=DEVICE)
    add_lora_triton(together, x, stack, lora_rows(index, 2))
    for t in range(20):
        alone = torch.zeros(1, n, device=DEVICE)
        add_lora_triton(alone, x[t:t + 1], stack, lora_rows(index[t:t + 1], 2))
        torch.testing.assert_close(together[t:t + 1], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("triton_rows")
@pytest.mark.parametrize("tokens", [9, 33])
def test_rows_built_once_serve_stacks_of_any_shape(tokens: int) -> None:
    """One ``LoraRows`` for a step's projections of different K, N and segments gives what
    each call gets from rows of its own."""
    g = torch.Generator().manual_seed(7)
    index = torch.randint(-1, 3, (tokens,), generator=g).to(DEVICE)
    shared = lora_rows(index, 3)
    for k, n, segments, normed in [(64, 128, (64, 96), True), (64, 96, (48,), True),
                                   (64, 64, (), False), (96, 64, (), False)]:
        stack = stack_of([8, 4, 8], k, n, max_rank=8, segments=segments, seed=k + n)
        x = torch.randn(tokens, k, generator=g).to(DEVICE)
        norm = norm_of(k) if normed else None
        once, fresh = (torch.zeros(tokens, n, device=DEVICE) for _ in range(2))
        ops.add_lora(once, x, stack, shared, norm)
        ops.add_lora(fresh, x, stack, lora_rows(index, 3), norm)
        assert torch.equal(once, fresh)
        want = torch.zeros(tokens, n, device=DEVICE)
        add_lora_ref(want, x, stack, shared, norm)
        torch.testing.assert_close(once, want, rtol=1e-5, atol=1e-5)


def test_the_fused_norm_is_rms_norm_in_float32() -> None:
    x = 3 * torch.randn(4, 32, dtype=torch.float16)
    gain, eps = norm_of(32)
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            * gain.cpu())
    torch.testing.assert_close(rms_norm_f32(x, (gain.cpu(), eps)), want)


def test_ops_serves_the_reference_off_cuda_and_checks_shapes() -> None:
    stack = stack_of([4], 8, 8, max_rank=4)
    x = torch.randn(3, 8).to(DEVICE)
    y = torch.zeros(3, 8, device=DEVICE)
    rows = lora_rows(torch.tensor([0, -1, 0], device=DEVICE), 1)
    ops.add_lora(y, x, stack, rows)
    assert torch.count_nonzero(y[1]) == 0 and torch.count_nonzero(y[0]) > 0
    with pytest.raises(ValueError, match="do not fit"):
        ops.add_lora(torch.zeros(3, 9, device=DEVICE), x, stack, rows)
    with pytest.raises(ValueError, match="built for 2 adapters"):
        ops.add_lora(y, x, stack, lora_rows(torch.zeros(3, dtype=torch.long, device=DEVICE), 2))
    with pytest.raises(ValueError, match="norm gain"):
        ops.add_lora(y, x, stack, rows, (torch.ones(9, device=DEVICE), EPS))
    with pytest.raises(ValueError, match="must be \\[T\\] integers"):
        lora_rows(torch.zeros(3, 1, dtype=torch.long), 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA rows always carry the layout")
def test_rows_built_for_the_reference_are_refused_by_triton() -> None:
    stack = stack_of([4], 8, 8, max_rank=4)
    rows = lora_rows(torch.tensor([0]), 1)
    assert rows.layout is None
    with pytest.raises(ValueError, match="no Triton layout"):
        add_lora_triton(torch.zeros(1, 8), torch.randn(1, 8), stack, rows)


@pytest.mark.parametrize(("a", "b", "segments", "match"), [
    ((1, 65, 8), (1, 8, 65), (), "rank 65"),
    ((1, 12, 8), (1, 8, 4), (2, 4, 6), "4 segments"),
    ((1, 7, 8), (1, 8, 3), (4,), "does not hold 2 segments"),
    ((1, 8, 8), (1, 8, 2), (4,), "do not stack"),
    ((1, 12, 8), (1, 8, 4), (5, 5), "rise strictly"),
    ((1, 8, 8), (1, 8, 4), (8,), "rise strictly"),
    ((1, 8, 8), (1, 8, 4), (0,), "rise strictly")])
def test_stacks_that_do_not_fit_are_refused(a: tuple[int, ...], b: tuple[int, ...],
                                            segments: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LoraStack(torch.zeros(a), torch.zeros(b), torch.ones(a[0]), segments)


def test_a_stack_knows_its_rank_and_bounds() -> None:
    stack = LoraStack(torch.zeros(2, 48, 8), torch.zeros(2, 40, 16), torch.ones(2), (16, 24))
    assert (stack.rank, stack.num_segments, stack.bounds) == (16, 3, (0, 16, 24, 40))
