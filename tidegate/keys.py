"""Every Redis key, stream and channel name tidegate uses, and their lifetimes.

All keys of one job share the Redis Cluster hash tag ``{job_id}`` so a job's hash, event
stream and channel live in one slot; lane streams carry their own tag per model, lane and
partition so a lane can be split across slots. Every served model has its own lanes, adapter
registry and adapter-load reports, named by its served name
(``tidegate.model_files.served_model``).
"""

from __future__ import annotations

import re
import zlib

PREFIX = "tidegate"

# Lanes are separate streams; workers serve them in this order.
LANES: tuple[str, ...] = ("interactive", "batch")

# The consumer group every worker of one deployment joins on every lane stream.
CONSUMER_GROUP = "workers"

# A job's hash and event stream live this long while it is unfinished; a finished job's keys
# live as long as its final status's retention (``tidegate.retention``, settings
# ``*_TTL_S``), so late clients can replay.
JOB_TTL_S = 24 * 3600
# A job's event stream is capped (approximately) at this many entries: a backstop far above
# the most a job writes (one entry per token at most, ``MAX_TOKENS_LIMIT`` tokens), since
# resuming clients and a job taken over by another worker need every event. The text a job
# stores is bounded at admission instead (``max_output_tokens`` and the model's context).
EVENTS_MAXLEN = 100_000
# Lane streams: every acknowledged entry is trimmed by the event-log script (XTRIM MINID below
# the oldest entry still pending or unread); this cap, far above any admitted backlog, is a
# backstop only.
LANE_MAXLEN = 1_000_000

JOB_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def is_valid_job_id(job_id: str) -> bool:
    return bool(JOB_ID_RE.match(job_id))


def lane_stream(model: str, lane: str, partition: int = 0) -> str:
    """The job stream of one model's lane partition: only that model's workers read it; the
    tag spreads models and partitions across cluster slots."""
    return f"{PREFIX}:lane:{{{model}.{lane}.{partition}}}"


LANE_STREAM_PATTERN = f"{PREFIX}:lane:*"


def job_partition(job_id: str, partitions: int) -> int:
    """The lane partition a job is queued on: its id spread evenly over ``partitions`` (each
    partition its own slot: on a cluster a lane's traffic spreads over the shards)."""
    return zlib.crc32(job_id.encode()) % partitions if partitions > 1 else 0


def parse_lane_stream(stream: str) -> tuple[str, str, int] | None:
    """(model, lane, partition) of a ``lane_stream`` name; None for anything else. Model names
    may hold dots: the lane and partition are the last two parts."""
    head = f"{PREFIX}:lane:{{"
    if not (stream.startswith(head) and stream.endswith("}")):
        return None
    parts = stream[len(head):-1].rsplit(".", 2)
    if len(parts) != 3 or not parts[0] or parts[1] not in LANES or not parts[2].isdecimal():
        return None
    return parts[0], parts[1], int(parts[2])


def routed_stream(model: str, lane: str, worker_id: str) -> str:
    """A worker's own job stream of one model's lane: the API puts a job there when that
    worker's prefix cache most likely holds the job's prompt (``tidegate.routing``). The
    worker reads it first; after a delay any worker of the model takes what still waits."""
    return f"{PREFIX}:routed:{{{model}.{lane}.{worker_id}}}"


def routed_stream_lane(model: str, stream: str) -> tuple[str, str] | None:
    """(lane, worker id) of one of ``model``'s ``routed_stream`` names; None for anything
    else (worker ids and model names may hold dots: the model is known, the lane follows)."""
    head = f"{PREFIX}:routed:{{{model}."
    if not (stream.startswith(head) and stream.endswith("}")):
        return None
    lane, _, worker_id = stream[len(head):-1].partition(".")
    return (lane, worker_id) if lane in LANES and worker_id else None


def routed_streams(model: str) -> str:
    """Set: every routed stream of the model's workers, the dead ones' included until they are
    empty, so nothing queued there is forgotten (workers add their own at start)."""
    return f"{PREFIX}:routed-streams:{{{model}}}"


def routing_table(model: str) -> str:
    """Hash: worker id -> JSON of its latest cache announcement (``tidegate.routing.
    cache_announcement``): load, seats, block size, when it expires. Fields long expired are
    removed by the model's workers."""
    return f"{PREFIX}:routing:{{{model}}}"


def prefix_cache(worker_id: str) -> str:
    """A worker's announced prefix-cache block hashes (packed, base64), expiring with it."""
    return f"{PREFIX}:prefix-cache:{{{worker_id}}}"


def adapters(model: str) -> str:
    """Hash: adapter name -> JSON {"path", "added_ms"}: the model's durable adapter registry.
    Workers load every adapter in it at start; ``POST /v1/adapters`` and ``--lora`` add to it."""
    return f"{PREFIX}:adapters:{{{model}}}"


# "Load this adapter now" to every worker (message JSON {model, name, path}); each worker of
# that model loads it and reports in ``adapter_loads``.
ADAPTER_CHANNEL = f"{PREFIX}:adapter-load"


def adapter_loads(model: str) -> str:
    """Hash: ``adapter_load_field(name, worker)`` -> "ok" or "error: <reason>": workers' reports
    of the adapter loads ``ADAPTER_CHANNEL`` asked for, read by the API that asked."""
    return f"{PREFIX}:adapter-loads:{{{model}}}"


def adapter_load_field(name: str, worker_id: str) -> str:
    return f"{name}\0{worker_id}"


# Load reports are read within seconds of being written; they expire soon after.
ADAPTER_LOADS_TTL_S = 120


def job_hash(job_id: str) -> str:
    """Hash holding the job's spec, status and, once finished, its result."""
    return f"{PREFIX}:job:{{{job_id}}}"


def job_events(job_id: str) -> str:
    """Stream of every event the job emitted, in order, for replay to late clients; the
    entry id of event N is ``N-0`` (``tidegate.events.event_log``)."""
    return f"{PREFIX}:job:{{{job_id}}}:events"


# Live events travel on a few shared channels, not one per job: a worker publishes one message
# per channel per write (every job of a step whose id hashes there), and a gateway subscribes the
# channels of the jobs it watches. A fixed number, so every process agrees without a setting;
# each channel has its own hash tag, ready for sharded pub/sub on a Redis Cluster.
LIVE_SHARDS = 16


def live_shard(job_id: str) -> int:
    """Which live channel carries this job's events (stable across processes and versions)."""
    return zlib.crc32(job_id.encode()) % LIVE_SHARDS


def live_channel(shard: int) -> str:
    """Pub/sub channel carrying, live, the events of every job whose id hashes to ``shard``."""
    return f"{PREFIX}:live:{{s{shard}}}"


def job_live_channel(job_id: str) -> str:
    """The live channel of this job's shard."""
    return live_channel(live_shard(job_id))


# Cancel requests for running jobs are pushed to every worker on this channel (the job id is
# the message); workers also sweep their jobs' cancel flags, for requests sent while they were
# not subscribed.
CANCEL_CHANNEL = f"{PREFIX}:cancel"


def worker_heartbeat(worker_id: str) -> str:
    """Key a live worker refreshes; it expires when the worker dies. Its value is JSON: the
    worker's load, the ``model`` it serves (served name) and its ``adapters``."""
    return f"{PREFIX}:worker:{{{worker_id}}}"


WORKER_HEARTBEAT_TTL_S = 15


def dead_letter_stream(lane: str) -> str:
    """Jobs that failed ``max_deliveries`` times, with their last error, for an operator."""
    return f"{PREFIX}:dead:{{{lane}}}"


# Dead-letter streams keep about this many of the newest entries (XADD MAXLEN ~): an operator
# looks at recent failures; a storm of them must not grow Redis without bound.
DEAD_LETTER_MAXLEN = 10_000


def idempotency(tenant: str, key: str) -> str:
    """Maps a tenant's Idempotency-Key to the job it created (the key is hashed: bounded, opaque)."""
    import hashlib

    digest = hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()[:32]
    return f"{PREFIX}:idem:{{{digest}}}"


IDEMPOTENCY_TTL_S = 24 * 3600


def rate_limit(tenant: str) -> str:
    """Hash of a tenant's token buckets (requests, tokens: level and when it was read); its
    own tag, one slot per tenant. It expires once both buckets would be full again, so an
    idle tenant has no key at all (a missing bucket is a full one)."""
    return f"{PREFIX}:rate:{{{tenant}}}"


# A job pending this long without its worker refreshing it is taken over by another worker.
VISIBILITY_TIMEOUT_MS = 30_000
# After this many deliveries a job goes to the dead-letter stream instead of running again.
MAX_DELIVERIES = 3


# ---------------------------------------------------------------- batches (arq)

# arq's queue for batch orchestration. arq builds its other keys from fixed prefixes and the job
# id (``arq:job:<id>``, ``arq:result:<id>``...) and runs MULTI across them, which a Redis Cluster
# allows within one slot only: every arq key carries the tag below (the queue, its health key,
# job ids through ``batch_arq_job_id``, arq's abort set through ``BATCH_ARQ_ABORT``), so all of
# batch orchestration lives in one slot, one shard (its traffic is a few commands per batch).
BATCH_ARQ_TAG = "{tidegate-arq}"
BATCH_ARQ_QUEUE = f"{PREFIX}:arq:{BATCH_ARQ_TAG}"
BATCH_ARQ_ABORT = f"arq:abort:{BATCH_ARQ_TAG}"


def batch_arq_job_id(name: str) -> str:
    """An arq job id in batch orchestration's slot."""
    return f"{BATCH_ARQ_TAG}{name}"
BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{32}$")
# A batch's records outlive its completion by this long (results stay downloadable).
BATCH_TTL_S = 7 * 24 * 3600


def batch_hash(batch_id: str) -> str:
    """The batch's state: status, total, counts, cursor, timestamps."""
    return f"{PREFIX}:batch:{{{batch_id}}}"


def batch_lines(batch_id: str) -> str:
    """List of the input lines, normalised to {"custom_id", "body"} JSON, in input order."""
    return f"{PREFIX}:batch:{{{batch_id}}}:lines"


def batch_enqueued(batch_id: str) -> str:
    """Hash: line index -> the lane stream entry of its job (written after the entry)."""
    return f"{PREFIX}:batch:{{{batch_id}}}:enqueued"


def batch_results(batch_id: str) -> str:
    """Hash: line index -> the line's output JSON, written once per line."""
    return f"{PREFIX}:batch:{{{batch_id}}}:results"
