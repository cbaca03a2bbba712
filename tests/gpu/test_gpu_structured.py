"""Structured outputs on a real GPU: the Triton grammar-mask kernel at Llama-3's vocabulary and
a full batch of masks, and constrained requests through the engine with CUDA graphs and async
scheduling. Skipped without CUDA.

The kernel only writes -inf over disallowed logits, so it must equal the plain-torch reference
exactly. The engine runs a random model in float32 (its near-uniform logits would let bf16
rounding flip near-ties): with CUDA graph decode steps, deferred sampling under masks and
async scheduling, every request must get what the eager, read-first engine gives it, and every
constrained output must be what its format says.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.engine.test_engine_structured import FORMATS, conforms
from tests.worker.engine.test_sampler import row
from tidegate.kernels import ops
from tidegate.kernels.gpu.token_bitmask_triton import apply_token_bitmask_triton
from tidegate.kernels.reference.token_bitmask import apply_token_bitmask_ref
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from tidegate.worker.engine.grammar_masks import TokenMask
from tidegate.worker.engine.sampler import Sampler
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LLAMA3_VOCAB = 128256


def random_bits(rows: int, words: int) -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, device="cuda")
    return bits.to(torch.int32)


@pytest.mark.parametrize(("batch", "words"), [
    (256, LLAMA3_VOCAB // 32),  # every row masked, the mask as wide as the vocabulary
    (320, LLAMA3_VOCAB // 32),  # 256 of 320 rows masked, in shuffled order
    (320, 4000),  # a mask narrower than the (padded) vocabulary
])
def test_triton_mask_kernel_equals_the_reference_at_llama3_vocab(batch: int,
                                                                 words: int) -> None:
    logits = torch.randn(batch, LLAMA3_VOCAB, device="cuda")
    rows = torch.randperm(batch, device="cuda")[:256]
    bits = random_bits(256, words)
    ref, tri = logits.clone(), logits.clone()
    apply_token_bitmask_ref(ref, bits, rows)
    apply_token_bitmask_triton(tri, bits, rows)
    assert torch.equal(tri, ref)
    untouched = torch.ones(batch, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert torch.equal(tri[untouched], logits[untouched])
    if words * 32 < LLAMA3_VOCAB:
        assert bool((tri[rows][:, words * 32:] == float("-inf")).all())
    # The dispatcher serves CUDA tensors with the Triton kernel.
    served = logits.clone()
    ops.apply_token_bitmask(served, bits, rows)
    assert torch.equal(served, ref)


def test_the_sampler_on_the_gpu_picks_the_cpus_tokens_under_masks_and_bias() -> None:
    vocab, n = LLAMA3_VOCAB, 8
    logits = 3 * torch.randn(n, vocab)
    bits = torch.randint(-(2**31), 2**31, (4, vocab // 32), dtype=torch.int64).to(torch.int32)
    mask = TokenMask([0, 2, 5, 7], bits.pin_memory())
    biases: list[dict[int, float]] = [{}, {int(logits[1].argmin()): 100},
                                      {int(logits[2].argmax()): -100}, {}] * 2
    rows = [row(f"r{i}", logit_bias=b or None) for i, b in enumerate(biases)]
    cpu = Sampler("cpu")(logits.clone(), rows, TokenMask(mask.rows, bits)).token_ids
    gpu = Sampler("cuda")(logits.cuda(), rows, mask).token_ids
    assert gpu == cpu
    assert gpu[1] == int(logits[1].argmin())


def requests() -> list[EngineRequest]:
    out = []
    for n, (kind, fmt) in enumerate(FORMATS.items()):
        ids = [(37 * n + 11 * i) % 250 + 3 for i in range(10 + n)]
        out.append(EngineRequest(f"{kind}-greedy", ids, SamplingParams(
            max_tokens=200, response_format=fmt)))
        out.append(EngineRequest(f"{kind}-seeded", ids[::-1], SamplingParams(
            max_tokens=200, temperature=0.8, seed=n, response_format=fmt)))
    out.append(EngineRequest("free", list(range(40, 60)), SamplingParams(
        max_tokens=32, ignore_eos=True)))
    return out


def run(loaded: LoadedModel, *, cuda_graphs: bool, overlapped: bool
        ) -> dict[str, tuple[list[int], str, str | None]]:
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, kv_cache_gb=0.25,
        cuda_graphs=cuda_graphs, async_output=overlapped, async_scheduling=overlapped))
    assert (engine.runner.graphs is not None) is cuda_graphs
    for req in requests():
        engine.add_request(req)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert len(engine.grammars) == 0
    if overlapped:
        assert engine.stats.scheduled_ahead > 0
    return {rid: ([o.token_id for o in os_ if o.token_id is not None], os_[-1].output_text,
                  os_[-1].finish_reason) for rid, os_ in outs.items()}


def test_graphs_and_async_scheduling_give_the_eager_engines_constrained_outputs() -> None:
    loaded = load_model("random:smollm2-135m", device="cuda", dtype=torch.float32)
    fast = run(loaded, cuda_graphs=True, overlapped=True)
    eager = run(loaded, cuda_graphs=False, overlapped=False)
    assert fast == eager
    for rid, (tokens, text, reason) in eager.items():
        kind = rid.split("-")[0]
        if kind == "free":
            assert reason == "length" and len(tokens) == 32
            continue
        assert reason == "stop", (rid, text)
        conforms(kind, text)
