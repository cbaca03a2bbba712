"""Start-up calibration: any number of seats, and none of its work in the engine's counters."""

from __future__ import annotations

import pytest

from tidegate.worker.engine.engine import Engine, EngineConfig
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.service.metrics import WorkerMetrics
from tidegate.worker.shedding.calibration import calibrate
from tidegate.worker.shedding.load_shedder import LoadShedder


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("random:tiny")


@pytest.mark.parametrize("max_num_seqs", [1, 1024, 2048])
def test_calibration_runs_at_any_seat_count_and_leaves_the_counters_at_zero(
        tiny: LoadedModel, max_num_seqs: int) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(
        max_model_len=2048, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
        kv_cache_gb=0.25))
    shedder = LoadShedder()
    calibrate(engine, shedder)
    assert not engine.has_unfinished()
    # The shedder learned this device's rates ...
    assert shedder.step_s(max_num_seqs) != shedder.config.initial_step_s
    assert shedder.prefill_tok_s() != shedder.config.initial_prefill_tok_s
    # ... and nothing of the warm-up shows in what the worker exports.
    stats = engine.stats
    assert (stats.steps, stats.decode_tokens, stats.prompt_tokens_computed,
            stats.preemptions) == (0, 0, 0, 0)
    registry = WorkerMetrics(engine).registry
    samples = {s.name: s.value for m in registry.collect() for s in m.samples}
    assert samples["tidegate_prefix_cache_queries_total"] == 0
    assert samples["tidegate_prefix_cache_hits_total"] == 0
    assert samples["tidegate_num_preemptions_total"] == 0


@pytest.mark.parametrize("max_model_len", [16, 256])
def test_calibration_fits_a_short_context(tiny: LoadedModel, max_model_len: int) -> None:
    # A model whose context is shorter than the 256-token calibration prompt (a test
    # checkpoint of 256 positions) still starts.
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(
        max_model_len=max_model_len, max_num_seqs=4, kv_cache_gb=0.05))
    calibrate(engine, LoadShedder())
    assert not engine.has_unfinished() and engine.stats.steps == 0
