"""``reference/metrics.md``: every metric family each process exports, from their declarations.

Each exporting module declares its families as ``MetricDoc`` constants and registers its
collectors from them; this page lists those declarations per process. The stack's tests scrape
each process and check that every family it shows is listed here (``documented_names``).
"""

from __future__ import annotations

from tidegate.commands.reference.markdown import code, page_head, sentence, table
from tidegate.operations.metric_doc import MetricDoc
from tidegate.operations.operator_routes import QUEUE_METRICS
from tidegate.producer.submit.prefix_routing import ROUTED_JOBS
from tidegate.producer.submit.rate_limit import RATE_LIMITED
from tidegate.streaming.gateway import GATEWAY_METRICS
from tidegate.worker.service.metrics import WORKER_METRICS

PAGE = "reference/metrics.md"

# (section, where it is scraped, the families)
PROCESSES: tuple[tuple[str, str, tuple[MetricDoc, ...]], ...] = (
    ("The queue", "`GET /metrics` of the API, the gateway and `tidegate up`: the queue as "
     "Redis holds it, sampled at scrape time (what KEDA's redis-streams scaler reads). Only "
     "`tidegate_redis_up` while Redis cannot be read.", QUEUE_METRICS),
    ("The API's submits", "`GET /metrics` of the API (and of `tidegate up`): what this API "
     "process refused and routed.", (RATE_LIMITED, ROUTED_JOBS)),
    ("The gateway", "`GET /metrics` of the gateway (and of `tidegate up`): its watchers.",
     GATEWAY_METRICS),
    ("The worker", "`GET /metrics` on the worker's status port (`TIDEGATE_METRICS_PORT`, "
     "9400): every series also carries the label `model`, the served model it belongs to. The "
     "`tidegate_spec_*` families appear on a worker that speculates, "
     "`tidegate_pipeline_overlapped_steps` on one of several pipeline stages.", WORKER_METRICS),
)


def documented_names() -> set[str]:
    return {doc.name for _, _, docs in PROCESSES for doc in docs}


def page() -> str:
    out = page_head("Metrics", "the metric declarations (`MetricDoc`)",
                    "Prometheus text exposition. Counters show `_total` (and `_created`) after "
                    "the names below; histograms show `_bucket`, `_sum` and `_count`. No metric "
                    "names a job or an API key: a tenant appears as its tenant id, a hash "
                    "prefix of its key.")
    for title, where, docs in PROCESSES:
        out += [f"## {title}", "", where, ""]
        out.append(table(("metric", "type", "labels", "description"),
                         [(code(d.exposed_name), d.kind, ", ".join(map(code, d.labels)),
                           sentence(d.help)) for d in docs]))
    return "\n".join(out)


def gaps() -> list[str]:
    # MetricDoc refuses an empty help; a name declared twice with different texts is a gap.
    seen: dict[str, MetricDoc] = {}
    missing = []
    for _, _, docs in PROCESSES:
        for doc in docs:
            if doc.name in seen and seen[doc.name] != doc:
                missing.append(f"metric {doc.name} is declared twice, differently")
            seen[doc.name] = doc
    return missing
