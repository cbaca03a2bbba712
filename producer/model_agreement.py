"""Whether the API and the live workers agree on the models: every role must be given the same
model list (``--model``, ``--models-file``, ``TIDEGATE_MODELS``), and when they are not, a job
for a worker's model is refused here while this API's models may have no worker at all.

``ModelAgreement`` turns what the workers' heartbeats say into one warning each time the set of
models that live workers serve and this API does not changes (not once a second). Plain Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence


class ModelAgreement:
    """Compares the live workers' models with ``served`` (this API's names, the default first)."""

    def __init__(self, served: Sequence[str]):
        self.served = list(served)
        self._foreign: frozenset[str] = frozenset()

    def observe(self, worker_models: Iterable[str | None]) -> str | None:
        """The warning to log now, or None: models live workers serve that this API does not,
        named with their worker counts, when that set differs from the last one seen (a
        heartbeat without a model served the default model)."""
        counts = Counter(m if m is not None else self.served[0] for m in worker_models)
        foreign = frozenset(m for m in counts if m not in self.served)
        changed, self._foreign = foreign != self._foreign, foreign
        if not changed or not foreign:
            return None
        theirs = ", ".join(f"{m} ({counts[m]} worker{'s' if counts[m] > 1 else ''})"
                           for m in sorted(foreign))
        idle = [m for m in self.served if not counts[m]]
        ours = f"; none serves {', '.join(idle)}, which this API queues jobs for" if idle else ""
        return (f"live workers serve models this API was not started with: {theirs}{ours}. "
                f"Jobs naming them are refused here: give the API and the workers the same "
                f"--model list (or TIDEGATE_MODELS, --models-file)")
