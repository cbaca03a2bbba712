"""Fuzzing in CI: ``tidegate up`` (API, gateway, a worker; auth on with two keys) driven by
generated input for about a minute: every HTTP operation of its served OpenAPI document
(schemathesis, valid and schema-breaking cases), the ``/v1/stream`` and watch WebSockets and
the SSE endpoint (hypothesis: random frames, Unicode and huge query parameters, nesting).
No 5xx, no hang, no dropped socket, and the stack's whole log (every process, INFO and up) holds
no traceback and no ERROR line. ``benchmarks/serving/fuzz.py`` is the long run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RedisServer
from tidegate.benchmarks.serving.fuzz import Budget, run
from tidegate.benchmarks.serving.fuzzing.stack import tidegate_up
from tidegate.benchmarks.serving.fuzzing.tally import Tally, log_problems

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_generated_input_gets_no_5xx_no_hang_and_no_traceback(
        redis_server: RedisServer, tmp_path: Path) -> None:
    redis_server.flush()
    log = tmp_path / "stack.log"
    tally = Tally()
    with tidegate_up(redis_server.url, log) as stack:
        run(stack, Budget(http_examples=10, socket_examples=120), tally)
    problems = log_problems(log)
    assert tally.server_errors == [], tally.server_errors
    assert tally.hangs == [], tally.hangs
    assert tally.broken == [], tally.broken
    assert problems.tracebacks == 0, problems.exceptions
    assert problems.error_lines == []
    assert tally.requests >= 500 and len(tally.by_target) >= 17, tally.summary()
