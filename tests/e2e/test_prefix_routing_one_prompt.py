"""Prefix routing when one prompt dominates, through real processes (the fleet of
test_prefix_routing_stack with eight seats a worker, so 48 clients fill it): every worker
serves a share, the dominant prompt's worker passing its jobs on as it fills (another worker
computes the prefix too) and idle workers stealing what waited on a full worker's stream."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import RedisServer
from tests.e2e.test_prefix_routing_stack import (
    MODEL,
    PREFIX_TOKENS,
    Fleet,
    run_jobs,
    running_fleet,
)
from tidegate.benchmarks.serving.prefix_routing import workload
from tidegate.model_files.model_source import resolve_model
from tidegate.model_files.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Fleet]:
    with running_fleet(redis_server, tmp_path_factory.mktemp("one-prompt-logs"),
                       TIDEGATE_MAX_NUM_SEQS="8") as out:
        yield out


def test_one_dominant_prompt_keeps_every_worker_busy(fleet: Fleet) -> None:
    tokenizer = load_tokenizer(resolve_model(MODEL))
    bodies = workload(tokenizer, prompts=1, prefix_tokens=PREFIX_TOKENS, jobs=100, seed=2)
    bodies += workload(tokenizer, prompts=4, prefix_tokens=PREFIX_TOKENS, jobs=20, seed=3)
    before = fleet.taken()
    results, _ = run_jobs(fleet, bodies, concurrency=48, max_tokens=16)
    assert [r["status"] for r in results] == ["done"] * len(bodies)
    shares = fleet.ran_on([r["id"] for r in results])
    assert set(shares) == set(fleet.workers) and min(shares.values()) >= 12, shares
    after = fleet.taken()
    # Every job was taken from a worker's own stream: routed there (the dominant prompt's
    # worker full, another computes it too), or stolen after waiting on a full worker's.
    own = sum(after[w].get(v, 0) - before[w].get(v, 0) for w in after for v in after[w]
              if v in ("routed", "stolen"))
    assert own == len(bodies), after
