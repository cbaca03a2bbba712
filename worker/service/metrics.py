"""A worker's Prometheus metrics: what it runs, how fast, and how every job ended.

One ``WorkerMetrics`` per served model's service, with its own registry (so tests and several
services in one process never share counters); the process's status port exposes them all
through ``ProcessMetrics``, each series labelled with its ``model``. Latencies and outcomes are observed by the publisher as
it writes each job's events; engine state (running, waiting, KV usage, prefix-cache hits,
preemptions) is read from the engine at scrape time. Names follow vLLM's where one exists (the
README maps them), prefixed ``tidegate_``.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

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


class _EngineCollector(Collector):
    """Engine state, read when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield GaugeMetricFamily("tidegate_requests_running",
                                "Requests in the engine's running batch.", engine.num_running)
        yield GaugeMetricFamily("tidegate_requests_waiting",
                                "Requests admitted by the worker, waiting for the engine.",
                                engine.num_waiting)
        yield GaugeMetricFamily("tidegate_kv_cache_usage_ratio",
                                "Fraction of KV-cache blocks in use (1 = full).",
                                engine.blocks.usage)
        scheduler = engine.scheduler
        yield CounterMetricFamily("tidegate_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  scheduler.prefix_query_tokens)
        yield CounterMetricFamily("tidegate_prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not computed).",
                                  scheduler.prefix_hit_tokens)
        queried = scheduler.prefix_query_tokens
        yield GaugeMetricFamily("tidegate_prefix_cache_hit_rate",
                                "Fraction of prompt tokens found in the prefix cache since the "
                                "worker started (hits / queries; 0 before any prompt).",
                                scheduler.prefix_hit_tokens / queried if queried else 0.0)
        yield CounterMetricFamily("tidegate_num_preemptions",
                                  "Requests preempted (blocks freed, recomputed later).",
                                  engine.stats.preemptions)
        yield GaugeMetricFamily("tidegate_worker_ranks",
                                "Processes (and devices) of this worker: tensor x pipeline "
                                "parallel size.", engine.runner.ranks)
        if engine.speculator is not None:
            stats = engine.stats
            yield CounterMetricFamily("tidegate_spec_draft_tokens",
                                      "Tokens drafted by speculative decoding.",
                                      stats.draft_tokens)
            yield CounterMetricFamily("tidegate_spec_accepted_tokens",
                                      "Drafted tokens the model kept (acceptance rate = "
                                      "rate(accepted) / rate(draft)).", stats.accepted_tokens)
            yield CounterMetricFamily("tidegate_spec_verify_chunks",
                                      "Verify chunks run: each gives its kept drafts and one "
                                      "token more (tokens per step = (accepted + chunks) / "
                                      "chunks).", stats.verify_chunks)
            yield CounterMetricFamily("tidegate_spec_steps",
                                      "Steps that drafted: the others decoded plainly, past the "
                                      "batch size where speculation measured slower.",
                                      stats.speculative_steps)
            yield CounterMetricFamily("tidegate_spec_draft_passes",
                                      "Forward passes of the draft model.", stats.draft_passes)
        if engine.pipeline_depth:
            yield CounterMetricFamily("tidegate_pipeline_overlapped_steps",
                                      "Steps launched while an earlier step was still in the "
                                      "pipeline (the stages worked on both at once).",
                                      engine.stats.overlapped_steps)


class _LoopCpuCollector(Collector):
    """CPU time of the thread that created the metrics: the worker's event loop (intake,
    publisher, cancels, heartbeats), read from that thread's clock at scrape time."""

    def __init__(self) -> None:
        self.clock = time.pthread_getcpuclockid(threading.get_ident())

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("tidegate_worker_loop_cpu_seconds",
                                  "CPU time of the worker's event-loop thread.",
                                  time.clock_gettime(self.clock))


class CountingHistogram(Collector):
    """A histogram that takes a value with a count: a step's token gaps are few distinct values
    observed thousands of times, which prometheus_client's ``Histogram`` would take one by one.
    Owned by the event loop's thread; a scrape (another thread) reads a consistent-enough copy.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
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
        family = CounterMetricFamily(
            "tidegate_jobs_taken",
            "Jobs this worker read from the queue, by where: routed (its own stream: prefix "
            "routing sent them here), shared (the model's shared lanes), stolen (another "
            "worker's stream, after they waited the steal delay), reclaimed (pending on a "
            "worker that stopped refreshing them).", labels=["via"])
        for via in TAKEN_VIA:
            family.add_metric([via], self.intake.taken[via])
        yield family


class WorkerMetrics:
    def __init__(self, engine: Engine | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_wait = Histogram(
            "tidegate_queue_wait_seconds", "Enqueue to start on a worker.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "tidegate_time_to_first_token_seconds", "Enqueue to the first generated token.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = CountingHistogram(
            "tidegate_inter_token_latency_seconds", "Time between a job's consecutive tokens.",
            TOKEN_GAP_BUCKETS)
        r.register(self.inter_token)
        self.e2e = Histogram(
            "tidegate_e2e_request_latency_seconds", "Enqueue to the job's final event.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "tidegate_prompt_tokens", "Prompt tokens of the jobs that ran.", registry=r)
        self.generation_tokens = Counter(
            "tidegate_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(
            "tidegate_requests_finished", "Jobs ended, by outcome.", ["reason"], registry=r)
        for reason in OUTCOMES:  # every series exists from the start: rate() needs a zero
            self.finished.labels(reason=reason)
        # Where the worker's time goes: engine steps against the service beside them (one
        # Python lock serves both, so the service's CPU is what it can take from the engine).
        self.step_seconds = Counter(
            "tidegate_engine_step_seconds", "Wall time inside engine steps.", registry=r)
        self.step_cpu_seconds = Counter(
            "tidegate_engine_host_cpu_seconds",
            "CPU time of the engine's thread inside steps (scheduling, inputs, outputs).",
            registry=r)
        self.publish_cpu_seconds = Counter(
            "tidegate_publisher_cpu_seconds",
            "CPU time recording engine outputs and encoding their events.", registry=r)
        self.event_writes = Counter(
            "tidegate_event_writes", "Event batches written to Redis.", registry=r)
        self.events_written = Counter(
            "tidegate_events_written", "Events written to Redis.", registry=r)
        self.takeovers = Counter(
            "tidegate_jobs_taken_over",
            "Jobs taken over from a worker that died: migrated (continued from their last "
            "token) or restarted (run again from the start).", ["how"], registry=r)
        for how in ("migrated", "restarted"):
            self.takeovers.labels(how=how)
        self.lost_jobs = Counter(
            "tidegate_jobs_lost",
            "Jobs this worker dropped because another took them over while this one could not "
            "reach Redis (their visibility timeout passed).", registry=r)
        self.migrated_tokens = Counter(
            "tidegate_migrated_tokens", "Generated tokens migrated jobs continued from.",
            registry=r)
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
