"""Where Redis's bytes go: every tidegate key's ``MEMORY USAGE``, by kind and by job status.

Kinds follow ``tidegate/keys.py``: a job's hash and event stream (grouped by how the job ended:
done, cancelled, rejected, error, or still queued/running), lane streams (with their entry
count), idempotency claims, dead-letter streams, batch keys, worker heartbeats. Run it against
a live Redis::

    python -m tidegate.benchmarks.harness.run.footprint redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

import redis

from tidegate import keys

_P = keys.PREFIX


def key_kind(name: str) -> tuple[str, str | None]:
    """(kind, job id or None) of a key name built by ``tidegate.keys``."""
    if name.startswith(f"{_P}:job:{{"):
        job_id = name[len(f"{_P}:job:{{"):].split("}", 1)[0]
        return ("job_events" if name.endswith(":events") else "job_hash"), job_id
    for prefix, kind in ((f"{_P}:lane:", "lane_stream"), (f"{_P}:idem:", "idempotency"),
                         (f"{_P}:dead:", "dead_letter"), (f"{_P}:batch:", "batch"),
                         (f"{_P}:worker:", "heartbeat")):
        if name.startswith(prefix):
            return kind, None
    return "other", None


def job_class(record: dict[str, str]) -> str:
    """done | cancelled | rejected | error | queued | running | partial (events without a hash)."""
    status = record.get("status")
    if status is None:
        return "partial"
    if status == "done":
        reason = json.loads(record.get("result", "{}")).get("finish_reason")
        return "cancelled" if reason == "cancelled" else "done"
    return status


def measure(client: redis.Redis) -> dict[str, Any]:
    """Bytes and counts by kind, and per job class the mean bytes of its hash and events."""
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"keys": 0, "bytes": 0})
    jobs: dict[str, dict[str, int]] = defaultdict(dict)  # job id -> {kind: bytes}
    lane_entries = 0
    ttls: dict[str, list[int]] = defaultdict(list)
    for name in client.scan_iter(match=f"{_P}:*", count=1000):
        size = client.memory_usage(name, samples=0)
        if size is None:  # expired between SCAN and MEMORY USAGE
            continue
        kind, job_id = key_kind(name)
        kinds[kind]["keys"] += 1
        kinds[kind]["bytes"] += size
        if job_id is not None:
            jobs[job_id][kind] = size
        if kind == "lane_stream":
            lane_entries += client.xlen(name)
    classes: dict[str, dict[str, float]] = {}
    pipe = client.pipeline(transaction=False)
    ids = list(jobs)
    for job_id in ids:
        pipe.hmget(keys.job_hash(job_id), ["status", "result"])
        pipe.ttl(keys.job_hash(job_id))
    answers = pipe.execute()
    by_class: dict[str, list[dict[str, int]]] = defaultdict(list)
    for i, job_id in enumerate(ids):
        status, result = answers[2 * i]
        record = {k: v for k, v in (("status", status), ("result", result)) if v is not None}
        cls = job_class(record)
        by_class[cls].append(jobs[job_id])
        if answers[2 * i + 1] is not None and answers[2 * i + 1] >= 0:
            ttls[cls].append(int(answers[2 * i + 1]))
    for cls, sizes in sorted(by_class.items()):
        n = len(sizes)
        hashes = sum(s.get("job_hash", 0) for s in sizes)
        events = sum(s.get("job_events", 0) for s in sizes)
        classes[cls] = {"jobs": n, "hash_bytes_mean": round(hashes / n),
                        "events_bytes_mean": round(events / n),
                        "bytes_per_job": round((hashes + events) / n),
                        "ttl_s_max": max(ttls[cls], default=-1)}
    info = client.info("memory")
    return {"kinds": dict(kinds), "lane_entries": lane_entries, "jobs_by_status": classes,
            "used_memory": int(info["used_memory"]), "dbsize": int(client.dbsize())}


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0"
    print(json.dumps(measure(redis.Redis.from_url(url, decode_responses=True)), indent=2))


if __name__ == "__main__":
    main()
