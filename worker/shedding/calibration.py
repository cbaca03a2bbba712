"""Timing the engine for the load shedder: every step the worker runs, and a start-up round.

``timed_step`` runs one engine step and reports its prompt tokens, decodes and seconds to the
shedder; ``calibrate`` runs throwaway requests before the worker takes jobs, so the shedder
starts from this device's own rates, and leaves the engine's counters at zero.
"""

from __future__ import annotations

import logging
import time

from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineRequest, RequestOutput
from tidegate.worker.shedding.load_shedder import LoadShedder

log = logging.getLogger("tidegate.worker")


def timed_step(engine: Engine, shedder: LoadShedder) -> list[RequestOutput]:
    """One engine step, timed and reported to the load shedder."""
    stats = engine.stats
    prompt0, decode0 = stats.prompt_tokens_computed, stats.decode_tokens
    preempted0 = stats.preemptions
    t0 = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - t0
    prompt, decodes = stats.prompt_tokens_computed - prompt0, stats.decode_tokens - decode0
    shedder.observe_step(prompt, decodes, seconds)
    log.debug("step: %d prompt tokens, %d decodes, %.1f ms, %d preempted, %d waiting",
              prompt, decodes, 1000 * seconds, stats.preemptions - preempted0,
              engine.num_waiting)
    return outputs


def calibrate(engine: Engine, shedder: LoadShedder) -> None:
    """Measure the rates the shedder starts from, on throwaway requests: one unmeasured round
    to warm the kernels and allocator up, then a 256-token prompt and decode steps at batch 1
    and at ``max_num_seqs``. The engine's counters are zeroed after: the metrics count jobs.

    The warm-up is the last measured round's shapes (``max_num_seqs`` short prompts, whose
    prefill is as many tokens as the long prompt's at the default 32 seats, and one decode at
    the full batch): warming more measured nothing better on the CPU, where it was half of a
    worker's start (2.2 of 4 s for the default model), and every worker pays it."""
    vocab = engine.tokenizer.vocab_size
    full = engine.config.max_num_seqs

    def prompt(i: int, n: int) -> list[int]:
        # Distinct prompts, so the prefix cache can't skip the work being measured.
        return [(7919 * (i * n + j) + i) % (vocab - 1) + 1 for j in range(n)]

    def run(batch: int, prompt_len: int, decodes: int, measure: bool) -> None:
        params = SamplingParams(max_tokens=decodes + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request(EngineRequest(f"calibrate-{measure}-{batch}-{i}",
                                             prompt(i, prompt_len), params))
        while engine.has_unfinished():
            if measure:
                timed_step(engine, shedder)
            else:
                engine.step()

    # A model with a short context (a test checkpoint) gets prompts that fit it.
    longest = max(1, min(256, engine.config.max_model_len - 10))
    run(full, min(8, longest), 1, measure=False)
    for batch, prompt_len in ((1, longest), (full, min(8, longest))):
        run(batch, prompt_len, 8, measure=True)
    engine.reset_stats()
    log.info("calibrated: prefill %.0f tok/s, decode step %.1f ms at batch 1, %.1f ms at %d",
             shedder.prefill_tok_s(), 1000 * shedder.step_s(1), 1000 * shedder.step_s(full), full)
