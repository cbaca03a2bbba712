"""A worker's Prometheus metrics: what it runs, how fast, and how every job ended.

One ``WorkerMetrics`` per served model's service, with its own registry (so tests and several
services in one process never share counters); the process's status port exposes them all
through ``ProcessMetrics``, each series labelled with its ``model``. Latencies and outcomes are observed by the publisher as
it writes each job's events; engine state (running, waiting, KV usage, prefix-cache hits,
preemptions) is read from the engine at scrape time. Names follow vLLM's where one exists (the
monitoring guide maps them), prefixed ``tidegate_``; each family is declared once, as a
``MetricDoc``, for the code and the generated metrics reference alike.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from tidegate.operations.metric_doc import MetricDoc
from tidegate.worker.engine.engine import Engine
from tidegate.worker.service.intake import StreamIntake

# Seconds; the same spread as vLLM's request-latency buckets, down to 1 ms for token gaps.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0, 320.0, 640.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                     0.5, 0.75, 1.0, 2.5, 5.0)
# Where a job was read from, as the ``via`` label of tidegate_jobs_taken_total.
TAKEN_VIA = ("routed", "shared", "stolen", "reclaimed")
# How a job ended, as the ``reason`` label of tidegate_requests_finished_total.
OUTCOMES = ("completed", "deadline_exceeded", "cannot_meet_deadline", "cancelled",
            "dead_lettered", "error")


# Engine state, read at scrape time (``_EngineCollector``).
REQUESTS_RUNNING = MetricDoc("tidegate_requests_running", "gauge",
                             "Requests in the engine's running batch.")
REQUESTS_WAITING = MetricDoc("tidegate_requests_waiting", "gauge",
                             "Requests admitted by the worker, waiting for the engine.")
KV_USAGE = MetricDoc("tidegate_kv_cache_usage_ratio", "gauge",
                     "Fraction of KV-cache blocks in use (1 = full).")
PREFIX_QUERIES = MetricDoc("tidegate_prefix_cache_queries", "counter",
                           "Prompt tokens looked up in the prefix cache.")
PREFIX_HITS = MetricDoc("tidegate_prefix_cache_hits", "counter",
                        "Prompt tokens found in the prefix cache (not computed).")
PREFIX_HIT_RATE = MetricDoc("tidegate_prefix_cache_hit_rate", "gauge",
                            "Fraction of prompt tokens found in the prefix cache since the "
                            "worker started (hits / queries; 0 before any prompt).")
PREEMPTIONS = MetricDoc("tidegate_num_preemptions", "counter",
                        "Requests preempted (blocks freed, recomputed later).")
RANKS = MetricDoc("tidegate_worker_ranks", "gauge",
                  "Processes (and devices) of this worker: tensor x pipeline parallel size.")
# Only on a worker that speculates (--speculative).
SPEC_DRAFT_TOKENS = MetricDoc("tidegate_spec_draft_tokens", "counter",
                              "Tokens drafted by speculative decoding.")
SPEC_ACCEPTED_TOKENS = MetricDoc("tidegate_spec_accepted_tokens", "counter",
                                 "Drafted tokens the model kept (acceptance rate = "
                                 "rate(accepted) / rate(draft)).")
SPEC_VERIFY_CHUNKS = MetricDoc("tidegate_spec_verify_chunks", "counter",
                               "Verify chunks run: each gives its kept drafts and one token more "
                               "(tokens per step = (accepted + chunks) / chunks).")
SPEC_STEPS = MetricDoc("tidegate_spec_steps", "counter",
                       "Steps that drafted: the others decoded plainly, past the batch size "
                       "where speculation measured slower.")
SPEC_DRAFT_PASSES = MetricDoc("tidegate_spec_draft_passes", "counter",
                              "Forward passes of the draft model.")
# Only on a worker of several pipeline stages (--pipeline-parallel-size).
PIPELINE_OVERLAPPED = MetricDoc("tidegate_pipeline_overlapped_steps", "counter",
                                "Steps launched while an earlier step was still in the pipeline "
                                "(the stages worked on both at once).")
LOOP_CPU = MetricDoc("tidegate_worker_loop_cpu_seconds", "counter",
                     "CPU time of the worker's event-loop thread.")
JOBS_TAKEN = MetricDoc(
    "tidegate_jobs_taken", "counter",
    "Jobs this worker read from the queue, by where: routed (its own stream: prefix routing "
    "sent them here), shared (the model's shared lanes), stolen (another worker's stream, after "
    "they waited the steal delay), reclaimed (pending on a worker that stopped refreshing "
    "them).", ("via",))
# Observed by the publisher as it writes each job's events (``WorkerMetrics``).
QUEUE_WAIT = MetricDoc("tidegate_queue_wait_seconds", "histogram",
                       "Enqueue to start on a worker.")
TTFT = MetricDoc("tidegate_time_to_first_token_seconds", "histogram",
                 "Enqueue to the first generated token.")
INTER_TOKEN = MetricDoc("tidegate_inter_token_latency_seconds", "histogram",
                        "Time between a job's consecutive tokens.")
E2E = MetricDoc("tidegate_e2e_request_latency_seconds", "histogram",
                "Enqueue to the job's final event.")
PROMPT_TOKENS = MetricDoc("tidegate_prompt_tokens", "counter",
                          "Prompt tokens of the jobs that ran.")
GENERATION_TOKENS = MetricDoc("tidegate_generation_tokens", "counter", "Tokens generated.")
FINISHED = MetricDoc("tidegate_requests_finished", "counter", "Jobs ended, by outcome.",
                     ("reason",))
STEP_SECONDS = MetricDoc("tidegate_engine_step_seconds", "counter",
                         "Wall time inside engine steps.")
STEP_CPU_SECONDS = MetricDoc("tidegate_engine_host_cpu_seconds", "counter",
                             "CPU time of the engine's thread inside steps (scheduling, inputs, "
                             "outputs).")
PUBLISH_CPU_SECONDS = MetricDoc("tidegate_publisher_cpu_seconds", "counter",
                                "CPU time recording engine outputs and encoding their events.")
EVENT_WRITES = MetricDoc("tidegate_event_writes", "counter", "Event batches written to Redis.")
EVENTS_WRITTEN = MetricDoc("tidegate_events_written", "counter", "Events written to Redis.")
TAKEOVERS = MetricDoc("tidegate_jobs_taken_over", "counter",
                      "Jobs taken over from a worker that died: migrated (continued from their "
                      "last token) or restarted (run again from the start).", ("how",))
LOST_JOBS = MetricDoc("tidegate_jobs_lost", "counter",
                      "Jobs this worker dropped because another took them over while this one "
                      "could not reach Redis (their visibility timeout passed).")
MIGRATED_TOKENS = MetricDoc("tidegate_migrated_tokens", "counter",
                            "Generated tokens migrated jobs continued from.")
# Every family a worker's status port shows, each series labelled with its ``model`` too.
WORKER_METRICS = (
    QUEUE_WAIT, TTFT, INTER_TOKEN, E2E, PROMPT_TOKENS, GENERATION_TOKENS, FINISHED,
    STEP_SECONDS, STEP_CPU_SECONDS, PUBLISH_CPU_SECONDS, EVENT_WRITES, EVENTS_WRITTEN,
    TAKEOVERS, LOST_JOBS, MIGRATED_TOKENS, JOBS_TAKEN, LOOP_CPU, REQUESTS_RUNNING,
    REQUESTS_WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS, PREFIX_HIT_RATE, PREEMPTIONS, RANKS,
    SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_VERIFY_CHUNKS, SPEC_STEPS, SPEC_DRAFT_PASSES,
    PIPELINE_OVERLAPPED)


class _EngineCollector(Collector):
    """Engine state, read when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        scheduler = engine.scheduler
        queried = scheduler.prefix_query_tokens
        yield REQUESTS_RUNNING.family(engine.num_running)
        yield REQUESTS_WAITING.family(engine.num_waiting)
        yield KV_USAGE.family(engine.blocks.usage)
        yield PREFIX_QUERIES.family(queried)
        yield PREFIX_HITS.family(scheduler.prefix_hit_tokens)
        yield PREFIX_HIT_RATE.family(scheduler.prefix_hit_tokens / queried if queried else 0.0)
        yield PREEMPTIONS.family(engine.stats.preemptions)
        yield RANKS.family(engine.runner.ranks)
        if engine.speculator is not None:
            stats = engine.stats
            yield SPEC_DRAFT_TOKENS.family(stats.draft_tokens)
            yield SPEC_ACCEPTED_TOKENS.family(stats.accepted_tokens)
            yield SPEC_VERIFY_CHUNKS.family(stats.verify_chunks)
            yield SPEC_STEPS.family(stats.speculative_steps)
            yield SPEC_DRAFT_PASSES.family(stats.draft_passes)
        if engine.pipeline_depth:
            yield PIPELINE_OVERLAPPED.family(engine.stats.overlapped_steps)


class _LoopCpuCollector(Collector):
    """CPU time of the thread that created the metrics: the worker's event loop (intake,
    publisher, cancels, heartbeats), read from that thread's clock at scrape time."""

    def __init__(self) -> None:
        self.clock = time.pthread_getcpuclockid(threading.get_ident())

    def collect(self) -> Iterator[Metric]:
        yield LOOP_CPU.family(time.clock_gettime(self.clock))


class CountingHistogram(Collector):
    """A histogram that takes a value with a count: a step's token gaps are few distinct values
    observed thousands of times, which prometheus_client's ``Histogram`` would take one by one.
    Owned by the event loop's thread; a scrape (another thread) reads a consistent-enough copy.
    """

    def __init__(self, doc: MetricDoc, buckets: tuple[float, ...]) -> None:
        self.name = doc.name
        self.documentation = doc.help
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def collect(self) -> Iterator[Metric]:
        cumulative, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), list(self.counts), strict=True):
            running += n
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative,
                                    sum_value=self.sum)


class _TakenCollector(Collector):
    """Jobs the intake read, by where, read when Prometheus scrapes."""

    def __init__(self, intake: StreamIntake) -> None:
        self.intake = intake

    def collect(self) -> Iterator[Metric]:
        family = JOBS_TAKEN.family()
        for via in TAKEN_VIA:
            family.add_metric([via], self.intake.taken[via])
        yield family


class WorkerMetrics:
    def __init__(self, engine: Engine | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_wait = QUEUE_WAIT.histogram(r, LATENCY_BUCKETS)
        self.ttft = TTFT.histogram(r, LATENCY_BUCKETS)
        self.inter_token = CountingHistogram(INTER_TOKEN, TOKEN_GAP_BUCKETS)
        r.register(self.inter_token)
        self.e2e = E2E.histogram(r, LATENCY_BUCKETS)
        self.prompt_tokens = PROMPT_TOKENS.counter(r)
        self.generation_tokens = GENERATION_TOKENS.counter(r)
        self.finished = FINISHED.counter(r)
        for reason in OUTCOMES:  # every series exists from the start: rate() needs a zero
            self.finished.labels(reason=reason)
        # Where the worker's time goes: engine steps against the service beside them (one
        # Python lock serves both, so the service's CPU is what it can take from the engine).
        self.step_seconds = STEP_SECONDS.counter(r)
        self.step_cpu_seconds = STEP_CPU_SECONDS.counter(r)
        self.publish_cpu_seconds = PUBLISH_CPU_SECONDS.counter(r)
        self.event_writes = EVENT_WRITES.counter(r)
        self.events_written = EVENTS_WRITTEN.counter(r)
        self.takeovers = TAKEOVERS.counter(r)
        for how in ("migrated", "restarted"):
            self.takeovers.labels(how=how)
        self.lost_jobs = LOST_JOBS.counter(r)
        self.migrated_tokens = MIGRATED_TOKENS.counter(r)
        r.register(_LoopCpuCollector())
        if engine is not None:
            r.register(_EngineCollector(engine))

    def watch_intake(self, intake: StreamIntake) -> None:
        """Report the intake's count of jobs taken, by where (``tidegate_jobs_taken_total``)."""
        self.registry.register(_TakenCollector(intake))

    def outcome(self, reason: str) -> None:
        self.finished.labels(reason=reason).inc()


def outcome_of_finish(finish_reason: str) -> str:
    """The outcome label of a job the engine ran, from its finish reason."""
    return {"deadline": "deadline_exceeded", "cancelled": "cancelled"}.get(
        finish_reason, "completed")


class ProcessMetrics(Collector):
    """Every served model's metrics in one registry for the process's status port: the
    families of each model's registry merged by name, each sample labelled ``model``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._models: list[tuple[str, CollectorRegistry]] = []
        self.registry.register(self)

    def add(self, model: str, registry: CollectorRegistry) -> None:
        self._models.append((model, registry))

    def describe(self) -> list[Metric]:
        return []  # names vary with the models added: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model, registry in list(self._models):
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                out.samples += [Sample(s.name, {"model": model, **s.labels}, s.value,
                                       s.timestamp, s.exemplar) for s in family.samples]
        yield from merged.values()
