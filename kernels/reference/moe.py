"""Routed experts (mixture of experts): the router's top-k choice and the experts' gated MLPs.

``route`` turns router logits into each token's ``top_k`` experts and weights (softmax over all
experts in float32, the top k kept, renormalized over them where the model says so: Mixtral
always, Qwen3-MoE by ``norm_topk_prob``). ``moe_ref`` is the plain-torch reference the fused
kernel (``moe_triton``) is checked against: the (token, expert) pairs sorted by expert, one
GEMM pair per expert over its contiguous run of tokens, each result weighed and added back to
its token.

Weights: ``w13`` [E, 2I, H] (each expert's gate rows, then its up rows), ``w2`` [E, H, I].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidegate.kernels.reference.activation import gelu_and_mul_ref, silu_and_mul_ref


@dataclass(frozen=True, slots=True)
class Routing:
    weights: torch.Tensor  # [T, k] float32: each chosen expert's weight
    experts: torch.Tensor  # [T, k] int64: the chosen experts, by falling weight


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Pairs (token * k + slot) sorted by expert, each expert's run padded to ``block_m``: the
    rows the grouped kernels (``tidegate.kernels.gpu.moe_triton``, ``lora_triton``) take, kept
    here beside the types the references share."""

    slots: torch.Tensor  # [L] int32: the pair in each padded row, num_pairs where empty
    block_expert: torch.Tensor  # [L / block_m] int32: each tile's expert, E past the last
    block_m: int
    num_pairs: int


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Router logits [T, E] -> each token's top-k experts and their weights."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts)


def check_moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int) -> None:
    """ValueError naming the first shape that does not fit."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    e, h = router.shape
    if x.shape[1] != h:
        raise ValueError(f"x has {x.shape[1]} features, the router {h}")
    if w13.dim() != 3 or w13.shape[0] != e or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [{e}, 2I, {h}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (e, h, w13.shape[1] // 2):
        raise ValueError(f"w2 must be [{e}, {h}, {w13.shape[1] // 2}], got {tuple(w2.shape)}")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k must be in 1..{e}, got {top_k}")


def gated(h: torch.Tensor, activation: str) -> torch.Tensor:
    """[N, 2I] gate then up -> act(gate) * up, [N, I]."""
    return gelu_and_mul_ref(h) if activation == "gelu_tanh" else silu_and_mul_ref(h)


def moe_ref(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            top_k: int, *, renormalize: bool = True, activation: str = "silu") -> torch.Tensor:
    """x [T, H] -> sum over each token's top-k experts of weight * expert(x), [T, H] in x's
    dtype (sums in float32)."""
    check_moe(x, router, w13, w2, top_k)
    routing = route(x @ router.T, top_k, renormalize)
    flat = routing.experts.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, slot) pairs, grouped by expert
    counts = torch.bincount(flat, minlength=router.shape[0]).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    weights = routing.weights.reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        h = gated(x[tokens] @ w13[expert].T, activation)
        y = (h @ w2[expert].T).float() * weights[pairs, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)
