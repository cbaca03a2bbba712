"""``KernelCompiles``: Triton's compiles counted, and on a GPU none after a worker's warm-up.

A compile mid-run stalls the step and every job waiting behind it: after the burst of a
benchmark, the first job of a quiet spell (alone in its batch, with a context the warm-up never
had) waited a second for its first token while the decode kernel compiled for a new split
count. On a GPU the test runs the worker's engine and warm-up (``build_engine``, ``calibrate``)
and then the shapes of such a spell: one request alone, others arriving while it decodes, with
contexts and batch sizes that make every split count; not one kernel may compile.
"""

from __future__ import annotations

import pytest
import torch

from tidegate.kernels.gpu.kernel_compiles import Compile, KernelCompiles, kernel_compiles
from tidegate.protocol import SamplingParams
from tidegate.settings import Settings
from tidegate.worker.engine.engine import EngineRequest
from tidegate.worker.service.service import build_engine
from tidegate.worker.shedding.calibration import calibrate
from tidegate.worker.shedding.load_shedder import LoadShedder, ShedderConfig


def test_compiles_after_the_warmup_are_counted_apart_and_reported() -> None:
    watch = KernelCompiles()
    late: list[Compile] = []
    watch.on_late = late.append
    watch.before("k1")
    watch.after("k1", "_prefill_kernel")
    watch.warmed_up()
    watch.after("k2", "_decode_split_kernel")  # no start seen: counted, 0 s
    assert (watch.count, watch.late) == (2, 1)
    assert [c.kernel for c in watch.recent] == ["_prefill_kernel", "_decode_split_kernel"]
    assert [(c.kernel, c.seconds, c.after_warmup) for c in late] == [
        ("_decode_split_kernel", 0.0, True)]
    assert watch.recent[0].seconds >= 0.0 and not watch.recent[0].after_warmup


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles on a GPU only")
def test_a_quiet_spell_after_the_warmup_compiles_no_kernel() -> None:
    watch = kernel_compiles()
    settings = Settings(model="random:tiny", device="cuda", dtype="bfloat16", max_num_seqs=64,
                        max_num_batched_tokens=2048, kv_cache_gb=0.5, metrics_port=0)
    engine = build_engine(settings)
    calibrate(engine, LoadShedder(ShedderConfig()))
    before = watch.count
    vocab = engine.tokenizer.vocab_size

    def add(name: str, length: int, tokens: int) -> None:
        prompt = [(31 * len(name) + 7 * j) % (vocab - 1) + 1 for j in range(length)]
        engine.add_request(EngineRequest(name, prompt, SamplingParams(
            max_tokens=tokens, ignore_eos=True)))

    def steps(n: int) -> None:
        for _ in range(n):
            engine.step()

    # One job alone (a batch of one, an odd context), then others arriving while it decodes:
    # mixed steps whose decode rows and longest context move the split count through its range.
    add("alone", 1732, 40)
    steps(6)
    for i, length in enumerate((300, 901, 1900, 17, 1023, 513)):
        add(f"next-{i}", length, 24)
        steps(3)
    for i in range(40):  # a wave of short ones beside them
        add(f"wave-{i}", 5 + i, 8 + i % 5)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    late = list(watch.recent)[-(watch.count - before):] if watch.count > before else []
    assert watch.count == before, [(c.kernel, round(c.seconds, 2)) for c in late]
