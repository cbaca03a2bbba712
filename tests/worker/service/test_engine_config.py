"""The engine a worker builds from its settings: the batch limits of its device where unset
(the settings side: tests/tidegate/test_settings_batch_limits.py)."""

from __future__ import annotations

from tidegate.settings import load_settings
from tidegate.worker.service.service import engine_config


def test_a_cuda_worker_gets_the_gpu_limits_and_a_cpu_worker_the_small_ones() -> None:
    cuda = engine_config(load_settings(device="cuda"), max_model_len=4096, max_loras=0)
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == (1024, 8192)
    cpu = engine_config(load_settings(), max_model_len=4096, max_loras=0)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (32, 512)


def test_set_limits_reach_the_engine_with_a_budget_for_every_seat() -> None:
    config = engine_config(load_settings(device="cuda", max_num_seqs=2048), 4096, 0)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (2048, 8192)
    config = engine_config(load_settings(max_num_seqs=1000), 4096, 0)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1000, 1000)
