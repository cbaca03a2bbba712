"""Batched LoRA, each row its own adapter: the plain-torch reference, the stacks and the rows.

A projection's adapters are stacked (``LoraStack``): ``a`` [L, S*R, K] (PEFT's ``lora_A``, the
shrink), ``b`` [L, N, R] (``lora_B``, the expand) and ``scale`` [L] (``alpha / r``, or
``alpha / sqrt(r)`` for rsLoRA). A packed projection (qkv, gate_up) holds S segments side by
side: segment s shrinks with rows s*R:(s+1)*R of ``a`` and expands into the columns of y from
``segments[s - 1]`` up to the next offset. An adapter of rank r < R fills the first r rows of
each segment's ``a`` and columns of its ``b``; the rest stay zero, so one stack serves every
rank up to R. A step names each row's adapter once (``tidegate.kernels.ops.lora_rows``: ``NO_ADAPTER`` for the base
model alone) and every projection's call shares those ``LoraRows``; each row gets
``y += scale * (x @ a.T) @ b.T`` from its own adapter, with x optionally RMS-normalized first
(``norm``). The Triton version is ``tidegate.kernels.gpu.lora_triton``; ``tidegate.kernels.ops.add_lora`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from tidegate.kernels.reference.moe import ExpertLayout

NO_ADAPTER = -1
MAX_RANK = 64
MAX_SEGMENTS = 3  # qkv, the most a decoder packs into one projection

# (gain [K], eps) of the RMSNorm applied to x before the shrink.
Norm = tuple[torch.Tensor, float]


@dataclass(frozen=True, slots=True)
class LoraStack:
    """One projection's adapters, stacked (see the module docstring)."""

    a: torch.Tensor  # [L, S*R, K]: segment s's shrink is rows s*R:(s+1)*R
    b: torch.Tensor  # [L, N, R]
    scale: torch.Tensor  # [L] float32
    segments: tuple[int, ...] = ()  # [S - 1]: the columns of y where segments 1.. start

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(int(s) for s in self.segments))
        n_a, width, _ = self.a.shape
        n_b, n_dim, rank_b = self.b.shape
        count = len(self.segments) + 1
        if count > MAX_SEGMENTS:
            raise ValueError(f"{count} segments; at most {MAX_SEGMENTS} are served")
        if width % count:
            raise ValueError(f"a {tuple(self.a.shape)} does not hold {count} segments")
        if not (n_a == n_b == self.scale.shape[0]) or width // count != rank_b:
            raise ValueError(f"a {tuple(self.a.shape)}, b {tuple(self.b.shape)} and scale "
                             f"{tuple(self.scale.shape)} do not stack")
        if rank_b > MAX_RANK:
            raise ValueError(f"rank {rank_b} is above the largest supported, {MAX_RANK}")
        bounds = self.bounds
        if any(lo >= hi for lo, hi in pairwise(bounds)):
            raise ValueError(f"segments {self.segments} must rise strictly inside (0, {n_dim})")

    @property
    def num_adapters(self) -> int:
        return self.a.shape[0]

    @property
    def num_segments(self) -> int:
        return len(self.segments) + 1

    @property
    def rank(self) -> int:
        """R, each segment's rank (the stack's largest adapter rank)."""
        return self.a.shape[1] // self.num_segments

    @property
    def bounds(self) -> tuple[int, ...]:
        """(0, *segments, N): segment s expands into columns bounds[s]:bounds[s + 1]."""
        return (0, *self.segments, self.b.shape[1])


@dataclass(frozen=True, slots=True)
class LoraRows:
    """A step's rows and their adapters, built once per step by ``tidegate.kernels.ops.lora_rows`` and shared by
    every projection's ``add_lora`` of that step (a few hundred calls)."""

    index: torch.Tensor  # [T]: each row's adapter, NO_ADAPTER for the base model alone
    num_adapters: int  # L: the stacks these rows index hold L adapters each
    # The Triton kernels' rows sorted by adapter (``tidegate.kernels.gpu.lora_triton.lora_layout``); None
    # where the reference serves.
    layout: ExpertLayout | None = None

    @property
    def tokens(self) -> int:
        return self.index.shape[0]


def check_lora(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows,
               norm: Norm | None = None) -> None:
    """ValueError naming the first shape that does not fit."""
    tokens, k = x.shape
    if y.shape != (tokens, stack.b.shape[1]) or stack.a.shape[2] != k:
        raise ValueError(f"y {tuple(y.shape)}, x {tuple(x.shape)} do not fit the stack "
                         f"(a {tuple(stack.a.shape)}, b {tuple(stack.b.shape)})")
    if rows.tokens != tokens:
        raise ValueError(f"rows index {tuple(rows.index.shape)} must be [{tokens}]")
    if rows.num_adapters != stack.num_adapters:
        # The rows route NO_ADAPTER to adapter num_adapters: it must be past the stack's last.
        raise ValueError(f"rows were built for {rows.num_adapters} adapters, the stack holds "
                         f"{stack.num_adapters}")
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"norm gain {tuple(norm[0].shape)} must be [{k}]")


def rms_norm_f32(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """x * rsqrt(mean(x**2) + eps) * gain, all in float32 (no rounding to x's dtype)."""
    gain, eps = norm
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gain.float()


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows,
                 norm: Norm | None = None) -> None:
    """In place: ``y[t] += scale[i] * (u[t] @ a[i].T) @ b[i].T`` with i = rows.index[t], for
    every row with an adapter, segment by segment; u = x, or ``rms_norm_f32(x, norm)``.
    Computed in float32, added once. y [T, N], x [T, K]."""
    check_lora(y, x, stack, rows, norm)
    inputs = x.float() if norm is None else rms_norm_f32(x, norm)
    rank = stack.rank
    for adapter in rows.index.unique().tolist():
        if adapter == NO_ADAPTER:
            continue
        picked = (rows.index == adapter).nonzero().squeeze(1)
        h = inputs[picked] @ stack.a[adapter].float().T  # [rows, S*R]
        b = stack.b[adapter].float()  # [N, R]
        delta = torch.cat([h[:, s * rank:(s + 1) * rank] @ b[lo:hi].T
                           for s, (lo, hi) in enumerate(pairwise(stack.bounds))], dim=1)
        y[picked] = (y[picked].float() + delta * stack.scale[adapter]).to(y.dtype)
