"""How long a finished job's keys stay in Redis, by how it ended.

A job's hash and event stream (one ``{job_id}`` slot) live ``unfinished_s`` while the job is
queued or running (every write refreshes it); the write that stores the final event sets the
retention of its final status on both keys. Written where the final status is written: the
event-log script (``tidegate.events.event_log``, the worker's results, errors, rejections and cancels)
and the cancel script (``tidegate.jobstore``, a job cancelled while queued).

In the steady state Redis holds about ``sum(rate_s x ttl_s x bytes_per_job)`` over the final
statuses (``benchmarks/results/serving/soak.md`` measures the bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidegate import keys

if TYPE_CHECKING:
    from tidegate.settings import Settings


@dataclass(frozen=True, slots=True)
class Retention:
    """Seconds a job's keys live, per final status (and while it is unfinished)."""

    unfinished_s: int = keys.JOB_TTL_S
    result_s: int = keys.JOB_TTL_S  # done: stop, length or deadline (the partial text counts)
    error_s: int = 3600  # failed: invalid job, dead-lettered, engine error
    rejected_s: int = 300  # never ran: deadline passed, shed, cannot meet the deadline
    cancelled_s: int = 300  # done with finish_reason ``cancelled``

    def __post_init__(self) -> None:
        for name in ("unfinished_s", "result_s", "error_s", "rejected_s", "cancelled_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"retention {name} must be at least 1 s")

    @classmethod
    def from_settings(cls, settings: Settings) -> Retention:
        """``TIDEGATE_JOB_TTL_S``, ``_RESULT_TTL_S``, ``_ERROR_TTL_S``, ``_REJECTED_TTL_S``,
        ``_CANCELLED_TTL_S``."""
        return cls(unfinished_s=settings.job_ttl_s, result_s=settings.result_ttl_s,
                   error_s=settings.error_ttl_s, rejected_s=settings.rejected_ttl_s,
                   cancelled_s=settings.cancelled_ttl_s)

    def final_s(self, status: str, finish_reason: str | None = None) -> int:
        """The retention of a job that ended with ``status`` (and, if done, ``finish_reason``)."""
        if status == "rejected":
            return self.rejected_s
        if status == "error" or finish_reason == "error":
            return self.error_s
        if finish_reason == "cancelled":
            return self.cancelled_s
        return self.result_s
