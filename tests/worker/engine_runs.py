"""Driving an engine in tests: add requests, step until nothing is left, collect outputs."""

from __future__ import annotations

from collections.abc import Sequence

from tidegate.worker.engine.engine import Engine, EngineRequest, RequestOutput


def run_to_end(engine: Engine, reqs: Sequence[EngineRequest] = (),
               max_steps: int = 20_000) -> dict[str, list[RequestOutput]]:
    """Every output by request id, in order; fails if the engine is still busy after
    ``max_steps`` steps (a hang is a failure, not a timeout)."""
    for r in reqs:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")
