"""The submit path: validate, choose the model, admit, enqueue. ``POST /v1/jobs``, the OpenAI
routes and ``WS /v1/stream`` all call this one object, and share the connections it opens (the
Redis client, its batched view for the submit's own commands, the event hub that watches jobs).

Every served model (``tidegate.model_files.served_model``: the same list the workers serve) has
its own admission (tokenizer, context) and its own lanes. A submit is refused before anything
reaches Redis if it is invalid (422), names no served model or no registered adapter of it
(404 ``model_not_found``), is too long for the model (admission), or its model's lane is full
(``LaneFull``); the tenant's rate limits are charged
last, so a submit refused for any other reason costs nothing. Each refusal is raised as what
it is (``Refusal``, ``LaneFull``, ``ClaimInProgress``, ``RedisError``); every route turns it into
its own error shape (``tidegate.producer.submit.refusal.refusal_of`` for the native routes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import anyio.to_thread
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tidegate import keys
from tidegate.adapter_registry import AdapterRegistry
from tidegate.events.event_hub import EventHub
from tidegate.http.auth import Auth, new_stream_token, token_hash
from tidegate.jobstore import enqueue
from tidegate.model_files.model_catalog import (
    LoraMismatch,
    ModelCatalog,
    ModelChoice,
    ModelNotFound,
)
from tidegate.model_files.served_model import served_models
from tidegate.producer.errors import FieldError
from tidegate.producer.submit import idempotency
from tidegate.producer.submit.admission import Admission, AdmissionError
from tidegate.producer.submit.backlog import LaneBacklog
from tidegate.producer.submit.batched import Batched
from tidegate.producer.submit.idempotency import Claim, ClaimInProgress
from tidegate.producer.submit.prefix_routing import PrefixRouting
from tidegate.producer.submit.rate_limit import RateLimiter
from tidegate.producer.submit.refusal import Refusal, validated
from tidegate.protocol import Job, JobRequest
from tidegate.redis_conn import connect
from tidegate.settings import Settings


class SubmitPath:
    """Auth, admission, the lane backlog, rate limits and idempotency around one enqueue, and
    the Redis client and event hub the API's routes share."""

    def __init__(self, settings: Settings, *, admission: Admission | None = None,
                 admissions: Mapping[str, Admission] | None = None, auth: Auth | None = None,
                 catalog: ModelCatalog | None = None):
        """``admission``: the default model's (tests serving one model); ``admissions``: by
        served name. The models not given are loaded by ``start()``."""
        self.settings = settings
        self.auth = auth if auth is not None else Auth.from_settings(settings)
        self.catalog = catalog if catalog is not None else ModelCatalog(served_models(settings))
        self._admissions: dict[str, Admission] = dict(admissions or {})
        if admission is not None:
            self._admissions.setdefault(self.catalog.default.name, admission)
        self._loaded = False
        self.adapters = AdapterRegistry()
        self.limiter = RateLimiter.from_settings(settings, self.auth)
        self._backlog = LaneBacklog(max_backlog=settings.max_backlog,
                                    partitions=settings.lane_partitions,
                                    retry_after_s=settings.retry_after_s)
        self.routing = PrefixRouting(self.catalog.names, enabled=settings.prefix_routing)
        self._redis: aioredis.Redis | None = None
        self._batched: Batched | None = None  # the client for the submit path's commands
        self._hub: EventHub | None = None

    async def start(self) -> None:
        """Load each model's tokenizer (those not given) and open the Redis client and hub."""
        self.auth.start()
        for model in self.catalog.models:
            if model.name not in self._admissions:
                self._admissions[model.name] = await anyio.to_thread.run_sync(
                    Admission.for_model, model.spec, self.settings.max_output_tokens)
        self._loaded = True
        self._redis = connect(self.settings.redis_url)
        self._batched = Batched(self._redis)
        self._hub = EventHub(self._redis, queue_size=self.settings.watcher_queue_size,
                             backlog_bytes=self.settings.watcher_backlog_bytes)
        await self._hub.start()
        self.routing.start(self._redis)

    async def stop(self) -> None:
        await self.routing.stop()
        if self._batched is not None:
            await self._batched.close()
            self._batched = None
        if self._hub is not None:
            await self._hub.stop()
            self._hub = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    @property
    def started(self) -> bool:
        """Every admission loaded and the Redis client open (what readiness needs first)."""
        return self._loaded and self._redis is not None

    @property
    def admission(self) -> Admission:
        """The default model's admission (and tokenizer), loaded by ``start()``."""
        return self.admission_for(self.catalog.default.name)

    def admission_for(self, model: str) -> Admission:
        """A served model's admission (by served name), loaded by ``start()``."""
        admission = self._admissions.get(model) if self._loaded else None
        if admission is None:
            raise RuntimeError("SubmitPath.start() was not called")
        return admission

    async def choose(self, model: str | None, lora: str | None = None) -> ModelChoice:
        """The served model and adapter a request names, the adapter checked against the
        model's registry. ``Refusal`` 404 ``model_not_found`` naming the field at fault, or
        422 when ``model``'s adapter suffix and ``lora`` disagree."""
        try:
            choice = self.catalog.choose(model, lora)
        except ModelNotFound as exc:
            raise Refusal(404, "model_not_found", str(exc),
                          [FieldError(field=exc.field, reason=str(exc))]) from exc
        except LoraMismatch as exc:
            raise Refusal(422, "invalid_request", f"lora: {exc}",
                          [FieldError(field="lora", reason=str(exc))]) from exc
        name = choice.model.name
        if choice.adapter is not None and choice.adapter not in await self.adapters.names(
                self.redis, name):
            message = (f"the model {name!r} has no adapter {choice.adapter!r} (register it "
                       f"with POST /v1/adapters)")
            raise Refusal(404, "model_not_found", message,
                          [FieldError(field=choice.adapter_field, reason=message)])
        return choice

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("SubmitPath.start() was not called")
        return self._redis

    @property
    def hub(self) -> EventHub:
        """Multiplexes the watchers of the API's streams over one pub/sub connection."""
        if self._hub is None:
            raise RuntimeError("SubmitPath.start() was not called")
        return self._hub

    async def accept(self, tenant: str, body: Any, *,
                     rate_headers: dict[str, str] | None = None) -> tuple[Claim, str, int]:
        """Validate, admit and enqueue a submitted body for ``tenant``: (claim, status, 202),
        or the earlier job's (claim, status, 200) for a repeated ``idempotency_key`` (not
        charged to the rate limits: a retry of a job already made). ``rate_headers`` as for
        ``submit_job``.

        Raises ``Refusal``, ``LaneFull``, ``ClaimInProgress`` or ``RedisError``; ``refusal_of``
        turns each into the API's error.
        """
        job_request = validated(JobRequest, body)
        key = job_request.idempotency_key
        redis = self._submit_redis()
        if key is not None and (earlier := await idempotency.replay(redis, tenant, key)):
            return earlier.claim, earlier.status, 200
        job, prompt_ids = await self._admitted_job(job_request, tenant, rate_headers)
        claim = Claim(job_id=job.id, stream_token=new_stream_token(), created_ms=job.created_ms)
        if key is not None and not await idempotency.claim(
                redis, tenant, key, claim, ttl_s=self.settings.idempotency_ttl_s):
            twin = await idempotency.replay(redis, tenant, key)  # the concurrent submit's
            if twin is None:
                raise ClaimInProgress("a submit with this idempotency key failed just now; retry")
            return twin.claim, twin.status, 200
        try:
            await self._enqueue(job, prompt_ids, tenant=tenant,
                                stream_token=claim.stream_token)
        except BaseException:  # whatever failed (a cancel included), a retry may enqueue it
            if key is not None:
                with contextlib.suppress(RedisError):
                    await idempotency.release(redis, tenant, key, claim)
            raise
        return claim, "queued", 202

    async def submit_job(self, job_request: JobRequest, *, tenant: str,
                         rate_headers: dict[str, str] | None = None) -> Job:
        """Admit an already validated request, check its lane's backlog and ``tenant``'s rate
        limits and enqueue its job. Raises ``Refusal`` (admission, ``RateLimited``),
        ``LaneFull`` or ``RedisError``. ``rate_headers`` receives the ``x-ratelimit-*``
        headers for the answer."""
        job, prompt_ids = await self._admitted_job(job_request, tenant, rate_headers)
        await self._enqueue(job, prompt_ids, tenant=tenant)
        return job

    async def _admitted_job(self, job_request: JobRequest, tenant: str,
                            rate_headers: dict[str, str] | None) -> tuple[Job, list[int]]:
        """The job to enqueue and its prompt's token ids, once admission, the lane's backlog
        and the tenant's rate limits allow it (charged last: a submit refused for any other
        reason costs nothing)."""
        choice = await self.choose(job_request.model, job_request.lora)
        model = choice.model.name
        job_request, prompt_ids = await self._admit(job_request, model)
        await self._backlog.check(self.redis, model, job_request.lane)
        rate = await self.limiter.charge(self._submit_redis(), tenant,
                                         prompt_tokens=len(prompt_ids),
                                         max_tokens=job_request.max_tokens)
        if rate is not None and rate_headers is not None:
            rate_headers.update(rate.headers())
        job = job_request.to_job(model=model, adapter=choice.adapter,
                                 default_timeout_s=self.settings.default_timeout_s)
        return job, prompt_ids

    async def _enqueue(self, job: Job, prompt_ids: list[int], *, tenant: str,
                       stream_token: str | None = None) -> None:
        hashed = token_hash(stream_token) if stream_token is not None else None
        route = self.routing.route(job.model, prompt_ids, job.adapter)
        # A fresh job id (uuid4) has no record yet, so this always enqueues. Batched stands in
        # for the client: enqueue sends one EVALSHA (or SCRIPT LOAD first, straight through).
        where = await enqueue(self._submit_redis(), job,  # type: ignore[arg-type]
                              partition=keys.job_partition(job.id,
                                                           self.settings.lane_partitions),
                              ttl_s=self.settings.job_ttl_s, owner=tenant,
                              stream_token_hash=hashed, routed_to=route.worker_id)
        if route.worker_id is not None and where == 1:
            self.routing.fell_back(job.model, route)
        self._backlog.note_enqueued(job.model, job.lane)

    async def _admit(self, job_request: JobRequest, model: str) -> tuple[JobRequest, list[int]]:
        """The request as ``model`` admits it, and its prompt's token ids."""
        admission = self.admission_for(model)
        try:
            if admission.is_quick(job_request):
                return admission.admit(job_request)
            return await anyio.to_thread.run_sync(admission.admit, job_request)
        except AdmissionError as exc:
            fields = [FieldError(field=exc.field, reason=exc.reason)]
            raise Refusal(422, exc.type, str(exc), fields) from exc

    def _submit_redis(self) -> Batched:
        if self._batched is None:
            raise RuntimeError("SubmitPath.start() was not called")
        return self._batched

