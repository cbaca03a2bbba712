"""Routed experts: the sorted grouped-GEMM reference against a token-by-token loop, the
expert-sorted layout exactly, and the fused Triton kernels against the reference.

Without CUDA the Triton kernels run in the interpreter (``tests/conftest.py`` sets
TRITON_INTERPRET), in float32 and float16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidegate.kernels.gpu.moe_triton import MoeTiles, default_tiles, expert_layout, moe_triton
from tidegate.kernels.reference.moe import moe_ref, route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weights(experts: int, hidden: int, inter: int, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    return router, w13, w2


def token_by_token(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   top_k: int, renormalize: bool, activation: str) -> torch.Tensor:
    """The definition: each token, each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ router.T, -1)
        top, idx = probs.topk(top_k)
        if renormalize:
            top = top / top.sum()
        for w, e in zip(top.tolist(), idx.tolist(), strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
            out[t] += w * (w2[e] @ (act * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_reference_equals_the_token_by_token_definition(renormalize: bool,
                                                        activation: str) -> None:
    router, w13, w2 = weights(6, 32, 24)
    x = torch.randn(19, 32, generator=torch.Generator().manual_seed(1))
    got = moe_ref(x, router, w13, w2, 2, renormalize=renormalize, activation=activation)
    want = token_by_token(x, router, w13, w2, 2, renormalize, activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_renormalizes_over_the_chosen_experts() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    r = route(logits, 2, renormalize=True)
    assert r.experts.tolist() == [[0, 1]]
    p = torch.softmax(logits, -1)[0].tolist()
    assert r.weights[0].tolist() == pytest.approx([p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])])
    assert route(logits, 2, renormalize=False).weights[0].tolist() == pytest.approx(p[:2])


@pytest.mark.parametrize("block_m", [4, 16])
def test_layout_puts_every_pair_once_in_its_experts_padded_run(block_m: int) -> None:
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [4, 3], [3, 0]])
    layout = expert_layout(experts, 6, block_m)
    slots, owner = layout.slots.tolist(), layout.block_expert.tolist()
    pairs = experts.numel()
    assert sorted(s for s in slots if s < pairs) == list(range(pairs))
    flat = experts.reshape(-1).tolist()
    for row, pair in enumerate(slots):
        if pair < pairs:
            assert owner[row // block_m] == flat[pair]  # each row in its expert's tile
    used = [e for e in owner if e < 6]
    assert used == sorted(used)  # runs in expert order
    for e in range(6):  # each expert's run: as many tiles as its pairs need
        assert used.count(e) == -(-flat.count(e) // block_m)
    assert all(e == 6 for e in owner[len(used):])  # tiles past the runs do nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "top_k", "activation"), [
    (1, 2, "silu"), (7, 2, "silu"), (40, 3, "gelu_tanh"), (130, 2, "silu"), (600, 2, "silu")])
def test_triton_equals_the_reference(dtype: torch.dtype, tokens: int, top_k: int,
                                     activation: str) -> None:
    # Hidden and intermediate sizes not multiples of the tiles; one token takes a tile per
    # pair, 7 and 40 tokens 16-row tiles, 130 64-row ones and 600 128-row ones.
    router, w13, w2 = (t.to(DEVICE, dtype) for t in weights(8, 80, 72, seed=tokens))
    x = torch.randn(tokens, 80, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    want = moe_ref(x.float(), router.float(), w13.float(), w2.float(), top_k,
                   activation=activation)
    got = moe_triton(x, router, w13, w2, top_k, activation=activation)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_tile_policy_widens_with_the_rows_per_expert() -> None:
    assert default_tiles(2, 8).block_m == 16
    assert default_tiles(1024 * 8, 128) == MoeTiles(64, 128, 64, 8, 4)
    assert default_tiles(2048, 8) == MoeTiles(128, 128, 64, 8, 3)


def test_triton_refuses_mismatched_shapes() -> None:
    router, w13, w2 = weights(4, 32, 16)
    with pytest.raises(ValueError, match="w2 must be"):
        moe_triton(torch.zeros(2, 32), router, w13, w2[:, :, :8], 2)
