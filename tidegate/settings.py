"""Settings every role reads from the environment (``TIDEGATE_*``) or the command line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tidegate.protocol import MAX_TOKENS_LIMIT

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """A worker's seats and its step's token budget."""

    max_num_seqs: int
    max_num_batched_tokens: int


# Unset batch limits follow the device. On the CPU every step runs on the host's cores: few
# seats, small steps. On a GPU decode reads the weights once for the whole batch, so seats are
# nearly free until the KV cache is full (the scheduler admits what fits), and a step of 8192
# tokens already runs the matrices at the tensor cores' rate while it delays running decodes
# half as long as 16,384 would (benchmarks/results/serving/mixed_load.md).
CPU_BATCH = BatchLimits(max_num_seqs=32, max_num_batched_tokens=512)
CUDA_BATCH = BatchLimits(max_num_seqs=1024, max_num_batched_tokens=8192)


def batch_limits(device: str, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None) -> BatchLimits:
    """The limits given, the device's defaults for the others; the step's budget raised to at
    least the seats, so every running request can decode in a step."""
    default = CUDA_BATCH if device.startswith("cuda") else CPU_BATCH
    seqs = max_num_seqs or default.max_num_seqs
    return BatchLimits(seqs, max(max_num_batched_tokens or default.max_num_batched_tokens, seqs))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIDEGATE_", extra="ignore")

    # REDIS_URL (unprefixed, the common convention) also works; see `load_settings`.
    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        description="the Redis server (redis://, rediss://) or cluster (redis+cluster://host:port"
                    "[,host:port...]); REDIS_URL is read too when TIDEGATE_REDIS_URL is unset")
    model: str = Field(default="smollm2", description="smollm2 | HF dir | .gguf | Hub id | random:<preset>")
    # Several served models (``tidegate.model_files.served_model``): "spec" or "name=spec" each
    # (TIDEGATE_MODELS: a comma list or a JSON list; the CLI: --model repeated), or a TOML/JSON
    # file of models with their own engine options and adapters. The first is the default.
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="several served models, \"spec\" or \"name=spec\" each (a comma list or a "
                    "JSON list); the first is the default; empty: model alone")
    models_file: str | None = Field(
        default=None, description="a TOML or JSON file of models to serve, each with its own "
                                  "engine options and adapters")
    loras: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="LoRA adapters of the first model, NAME=PATH each (a PEFT directory on the "
                    "worker)")
    max_loras: int = Field(default=4, ge=0,
                           description="LoRA adapters resident on the device at once (0: LoRA off)")
    max_lora_rank: int = Field(default=16, ge=1, le=64, description="the largest adapter rank served")
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="cpu | cuda[:N]")
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16|float16)$",
                       description="auto: float32 on CPU, bfloat16 on CUDA")
    weights: str = Field(default="auto", pattern="^(auto|packed|dequantized)$",
                         description="quantized matrices (GGUF, GPTQ, AWQ, compressed-"
                                     "tensors): auto (kept packed where a kernel reads them), "
                                     "packed, or dequantized to dtype")
    quantize: str = Field(default="none", pattern="^(none|fp8|rtn-int8|rtn-int4)$",
                          description="round a float model's projections at load: fp8 (e4m3, "
                                      "W8A8 on CUDA), rtn-int8, rtn-int4 (groups of 128)")
    cpu_activations: str = Field(default="auto", pattern="^(auto|float|int8)$",
                                 description="what the CPU multiplies packed matrices with: "
                                             "int8 (rows rounded to 8-bit blocks, integer dot "
                                             "products, as llama.cpp), float (the dequantized "
                                             "model's outputs exactly), auto: int8")
    # A worker of several processes on one host (``tidegate.worker.parallel``): each stage's layers
    # split over tensor_parallel_size devices, the layers over pipeline_parallel_size stages.
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64,
        description="devices each pipeline stage's layers are split over (one process each)")
    pipeline_parallel_size: int = Field(
        default=1, ge=1, le=64, description="pipeline stages the model's layers are split into")
    # Speculative decoding (tidegate.worker.speculative): verified in the batch.
    speculative: str = Field(default="none", pattern="^(none|ngram|draft:.+)$",
                             description="none | ngram (prompt-lookup drafts) | draft:<model> "
                                         "(a draft model: a spec as --model takes)")
    num_speculative_tokens: int = Field(default=4, ge=1, le=16,
                                        description="tokens drafted per step and request")
    speculative_max_batch: int | None = Field(
        default=None, ge=1,
        description="speculate at batch sizes up to this; unset: wherever it measures faster "
                    "than plain decoding")
    max_num_seqs: int | None = Field(
        default=None, ge=1,
        description=f"requests batched at once; unset: {CPU_BATCH.max_num_seqs} on CPU, "
                    f"{CUDA_BATCH.max_num_seqs} on CUDA")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1,
        description=f"tokens one engine step computes at most (prompt chunks and decodes "
                    f"together); unset: {CPU_BATCH.max_num_batched_tokens} on CPU, "
                    f"{CUDA_BATCH.max_num_batched_tokens} on CUDA")
    # Stall-free batching (tidegate.worker.shedding.step_budget): prompt chunks sized from the
    # measured step costs so a step that decodes stays near this long.
    max_step_ms: float = Field(
        default=0.0, ge=0, le=10_000,
        description="a step that decodes for running requests takes about this long at most: "
                    "prompt chunks beside the decodes are sized from the measured step costs to "
                    "fit (at least 512 tokens a step); set it to bound the time per output "
                    "token under long prompts; 0: off, every step takes up to "
                    "max_num_batched_tokens")
    block_size: int = Field(default=16, ge=1, le=256,
                            description="tokens per KV-cache block (paging and prefix-cache unit)")
    kv_cache_gb: float | None = Field(default=None, gt=0,
                                      description="KV-cache size in GiB; unset: 2 GiB on CPU, "
                                                  "kv_cache_memory_fraction on CUDA")
    kv_cache_memory_fraction: float = Field(
        default=0.9, gt=0, le=1,
        description="CUDA, with kv_cache_gb unset: the share of the device memory free after "
                    "the weights load that the KV cache takes")
    kv_cache_dtype: str = Field(default="auto", pattern="^(auto|fp8|int8)$",
                                description="auto: the model's dtype; fp8: e4m3 (CUDA), twice "
                                            "the tokens in the same memory; int8: 8-bit heads "
                                            "with a scale each (CPU), 3.8x float32's tokens")
    prefix_caching: bool = Field(default=True,
                                 description="reuse the KV blocks of prompt prefixes seen before")
    cuda_graphs: bool = Field(default=True,
                              description="CUDA: replay decode steps from CUDA graphs captured at "
                                          "start-up (false: eager steps)")
    metrics_port: int = Field(default=9400, ge=0, le=65535,
                              description="the worker's /metrics, /healthz and /readyz port (on "
                                          "host); 0 turns them off")
    load_shedding: bool = Field(default=True,
                                description="reject jobs the worker can no longer finish before "
                                            "their deadline (a rejected event) instead of running "
                                            "them late")
    shedding_safety: float = Field(default=1.25, ge=1.0, le=10.0,
                                   description="finish-time estimates are multiplied by this "
                                               "before they are compared with deadlines")
    # Set it below the core count when other busy processes share the machine: spinning threads
    # that lose their core stall every parallel op.
    torch_threads: int | None = Field(
        default=None, ge=1, description="CPU threads for torch; unset: torch's default, one per "
                                        "core")
    visibility_timeout_s: float = Field(
        default=30.0, gt=0,
        description="a job pending this long without its worker refreshing it is reclaimed by "
                    "another worker")
    max_deliveries: int = Field(
        default=3, ge=1,
        description="deliveries in a row that end before a token, then the dead-letter stream")
    drain_timeout_s: float = Field(default=30.0, ge=0, description="SIGTERM grace period")
    default_timeout_s: float = Field(
        default=300.0, gt=0, description="a job's deadline, in seconds from its submit, when it "
                                         "sets no timeout_s")
    host: str = Field(default="127.0.0.1", description="the address servers bind")
    port: int = Field(default=8000, ge=0, lt=65536,
                      description="the port the API (or the gateway) serves on")
    gateway_url: str | None = Field(
        default=None, description="base URL clients stream from (ws:// or wss://); unset: the "
                                  "API's own address with the ws scheme")
    lane_partitions: int = Field(
        default=1, ge=1, description="streams per model and lane (each its own cluster hash "
                                     "tag), spreading one lane over Redis Cluster shards")
    # Prefix-aware routing (tidegate.routing): workers announce their prefix caches, the API
    # sends each job to the worker holding most of its prompt, on that worker's own stream.
    prefix_routing: bool = Field(
        default=True,
        description="send each job to the worker holding most of its prompt in its prefix "
                    "cache; false on the API: every job to the shared lanes; false on a worker: "
                    "it announces nothing and reads no stream of its own (it still takes others' "
                    "waiting jobs)")
    steal_delay_ms: int = Field(
        default=200, ge=0, le=60_000,
        description="how long a routed job waits on its worker's stream before any idle worker "
                    "of the model may take it")
    # 10 ms is below what a reader notices and above a small model's step on a CPU (a GPU step
    # of a large batch takes longer anyway).
    stream_interval_ms: float = Field(
        default=10.0, ge=0, le=1000,
        description="a worker writes its events at most this often (0: as soon as the previous "
                    "write landed); a job's start, first token and end go at once regardless; "
                    "tokens generated meanwhile leave as one event")
    watcher_queue_size: int = Field(
        default=1024, ge=1, description="events a watcher (WebSocket or SSE client) may fall "
                                        "behind before it is cut off (close code 1013)")
    watcher_backlog_bytes: int = Field(
        default=1 << 20, ge=4096,
        description="bytes a watcher may have waiting (its queued events, on a WebSocket also "
                    "its connection's write buffer and kernel send queue) before it is cut "
                    "with 1013")
    job_ttl_s: int = Field(
        default=24 * 3600, ge=60,
        description="how long a queued or running job's keys (hash, event stream) live; every "
                    "write refreshes it; once the job ends, its final status's retention applies")
    # Retention of a finished job's keys (``tidegate.retention``), by how it ended. Results are
    # what clients come back for; a rejection or a cancel is told to the client at once (the
    # 202's stream, or the cancel's answer), so minutes cover a late look. Redis memory in the
    # steady state is about the sum over statuses of rate x retention x bytes per job
    # (benchmarks/results/serving/soak.md).
    result_ttl_s: int = Field(default=24 * 3600, ge=1,
                              description="retention of a done job's keys")
    error_ttl_s: int = Field(default=3600, ge=1, description="retention of a failed job's keys")
    rejected_ttl_s: int = Field(default=300, ge=1,
                                description="retention of a rejected job's keys")
    cancelled_ttl_s: int = Field(default=300, ge=1,
                                 description="retention of a cancelled job's keys")
    # A claim is about 260 bytes; past its job's retention it is released anyway, so above
    # result_ttl_s it only costs memory.
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=1,
                                   description="how long an Idempotency-Key returns its job")
    # With the model's context it bounds the text stored per job (result, done event, token
    # events).
    max_output_tokens: int = Field(
        default=MAX_TOKENS_LIMIT, ge=1, le=MAX_TOKENS_LIMIT,
        description="the most new tokens one job may ask for (422 on a max_tokens beyond it)")
    log_level: str = Field(default="INFO",
                           description="DEBUG, INFO, WARNING, ERROR; TRACE: uvicorn's protocol "
                                       "traces too")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, repr=False,
        description="API keys (a comma list or a JSON list); with api_keys_file unset too, auth "
                    "is off (local development)")
    api_keys_file: str | None = Field(
        default=None, description="a file of API keys, one a line ('#' comments), each "
                                  "optionally with its own rate limits and the word admin")
    # Auth off (no key configured at all): the admin routes are open (local development).
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, repr=False,
        description="keys that may also call the admin routes (POST /v1/adapters), in "
                    "api_keys' forms; they are valid API keys too")
    max_backlog: int = Field(default=10_000, ge=1,
                             description="per model and lane, jobs waiting or unacknowledged "
                                         "above which submits are refused (429)")
    retry_after_s: int = Field(default=2, ge=1,
                               description="the Retry-After a full lane's 429 carries")
    # Held in Redis across API replicas (producer/submit/rate_limit.py).
    rate_limit_requests_per_s: float | None = Field(
        default=None, gt=0, description="each tenant's (API key's) default request rate; a "
                                        "keys-file line may set its own; unset: unlimited")
    rate_limit_tokens_per_min: int | None = Field(
        default=None, gt=0,
        description="each tenant's default tokens per minute, charged as prompt tokens + "
                    "max_tokens at submit (as OpenAI counts them at admission); unset: unlimited")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        """A cluster URL (``redis+cluster://host:port[,host:port]``) must name its nodes."""
        from tidegate.redis_conn import cluster_nodes, is_cluster_url

        if is_cluster_url(value):
            cluster_nodes(value)  # ValueError: the field's reason
        return value

    @field_validator("api_keys", "admin_keys", "models", "loras", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        """A comma-separated string (the usual env form) or a JSON list, blanks dropped."""
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else text.split(",")
        if isinstance(value, list | tuple):
            return [item.strip() if isinstance(item, str) else item for item in value
                    if not isinstance(item, str) or item.strip()]
        return value

    def batch(self) -> BatchLimits:
        """The worker's seats and step budget: those set, the device's defaults for the rest."""
        return batch_limits(self.device, self.max_num_seqs, self.max_num_batched_tokens)


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit (non-None) overrides from the CLI on top."""
    import os

    base: dict[str, object] = {}
    if "TIDEGATE_REDIS_URL" not in os.environ and os.environ.get("REDIS_URL"):
        base["redis_url"] = os.environ["REDIS_URL"]
    base.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**base)  # type: ignore[arg-type]
