"""What one client saw of one job's event stream, checked against every promise of the protocol.

A ``StreamCheck`` takes a job's events in the order a client received them, across however many
connections (each resumed with ``last_event_id``), and records every breach: an event id that is
not the previous one plus one (a duplicate or a gap), an event of another job, a stream that does
not begin with ``queued``, a second final event or anything after the final one, a token event
whose ``index`` is not the number of tokens the client holds (tokens duplicated or missing), a
``done`` whose text is not the concatenation of the streamed texts or whose token count is not
the streamed one.

A job taken over from a dead worker shows one of two events. ``restarted``: the run starts again,
so the client drops what it had and token indices restart at 0. ``migrated``: the new worker
continues where the old one stopped, keeping ``kept_tokens`` generated tokens, which must be
exactly the tokens the client holds; indices go on from there. Both are counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

FINAL_TYPES = frozenset({"done", "error", "rejected"})
MAX_PROBLEMS = 8


@dataclass(slots=True)
class StreamCheck:
    """One client's view of one job; ``problems`` lists what broke (empty: all held)."""

    job_id: str
    last_id: int = 0  # id of the last event received: a resume asks for what follows it
    final: dict | None = None
    finals: int = 0
    tokens: int = 0  # generated tokens the client holds (sum of len(token_ids) since a restart)
    text_parts: list[str] = field(default_factory=list)
    restarts: int = 0
    migrations: int = 0
    kept: list[int] = field(default_factory=list)  # each migration's kept_tokens
    duplicate_tokens: int = 0  # token positions received again
    missing_tokens: int = 0  # token positions skipped
    duplicate_events: int = 0
    missing_events: int = 0
    stalls: int = 0  # times the stream went quiet although the job had ended
    stalled_at: list[float] = field(default_factory=list)  # time.monotonic() of each
    problems: list[str] = field(default_factory=list)

    def problem(self, what: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(what)

    @property
    def done(self) -> bool:
        return self.finals > 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def on_raw(self, raw: str | bytes) -> None:
        """One frame as received; a frame that is not a JSON event is a problem."""
        try:
            event = json.loads(raw)
        except ValueError:
            self.problem(f"not JSON: {raw[:80]!r}")
            return
        if not isinstance(event, dict) or not isinstance(event.get("id"), int):
            self.problem(f"not an event: {str(raw)[:80]}")
            return
        self.on_event(event)

    def on_event(self, event: dict) -> None:
        if not self._in_sequence(event):
            return
        kind = event.get("type")
        if self.done:
            self.problem(f"{kind} event {event['id']} after the final event")
            return
        if event["id"] == 1 and kind != "queued":
            self.problem(f"the stream begins with {kind}, not queued")
        if kind == "token":
            self._token(event)
        elif kind == "restarted":
            self.restarts += 1
            self.tokens, self.text_parts = 0, []
        elif kind == "migrated":
            self._migrated(event)
        elif kind in FINAL_TYPES:
            self.finals += 1
            self.final = event
            if kind == "done":
                self._done(event)

    def _in_sequence(self, event: dict) -> bool:
        """Ids go 1, 2, 3, ...: an id at or below the last one is a duplicate (dropped), one
        further on a gap (taken, and the sequence goes on from it)."""
        if event.get("job_id") != self.job_id:
            self.problem(f"event of job {event.get('job_id')} on {self.job_id}'s stream")
            return False
        if event["id"] <= self.last_id:
            self.duplicate_events += 1
            self.problem(f"event id {event['id']} again after {self.last_id}")
            return False
        if event["id"] != self.last_id + 1:
            self.missing_events += event["id"] - self.last_id - 1
            self.problem(f"event id {event['id']} after {self.last_id}")
        self.last_id = event["id"]
        return True

    def _token(self, event: dict) -> None:
        index, ids = event.get("index"), event.get("token_ids")
        if not isinstance(index, int) or not isinstance(ids, list) or not ids:
            self.problem(f"token event {event['id']} without index or token_ids")
            return
        if index < self.tokens:
            self.duplicate_tokens += min(self.tokens - index, len(ids))
            self.problem(f"token index {index} when {self.tokens} tokens are held")
        elif index > self.tokens:
            self.missing_tokens += index - self.tokens
            self.problem(f"token index {index} when {self.tokens} tokens are held")
        self.tokens = index + len(ids)
        self.text_parts.append(event.get("text", ""))

    def _migrated(self, event: dict) -> None:
        self.migrations += 1
        kept = event.get("kept_tokens")
        if isinstance(kept, int):
            self.kept.append(kept)
        if not isinstance(event.get("attempt"), int) or event["attempt"] < 2:
            self.problem(f"migrated event {event['id']} with attempt {event.get('attempt')}")
        if kept != self.tokens:
            self.problem(f"migrated keeping {kept} tokens when {self.tokens} are held")
            if isinstance(kept, int) and kept < self.tokens:
                self.duplicate_tokens += self.tokens - kept  # they will come again
            elif isinstance(kept, int):
                self.missing_tokens += kept - self.tokens
            if isinstance(kept, int):  # counted once: later indices go by the new worker's word
                self.tokens = kept

    def _done(self, event: dict) -> None:
        if event.get("text") != self.text:
            self.problem(f"done text ({len(event.get('text') or '')} chars) is not the streamed "
                         f"text ({len(self.text)} chars)")
        completion = (event.get("usage") or {}).get("completion_tokens")
        if completion != self.tokens:
            self.problem(f"done says {completion} tokens, {self.tokens} were streamed")

    def stalled(self, quiet_s: float, at: float) -> None:
        """The connection sent nothing for ``quiet_s`` while the job had already ended."""
        self.stalls += 1
        self.stalled_at.append(at)
        self.problem(f"stream quiet for {quiet_s:.0f} s after event {self.last_id} although "
                     "the job had ended")

    def finish(self) -> None:
        """The client stopped following: no final event is a problem."""
        if not self.done:
            self.problem(f"no final event (last event {self.last_id})")
