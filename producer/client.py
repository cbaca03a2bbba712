"""The Python client: submit jobs over HTTP to the API, follow their events from the gateway.

``Client`` is async; ``SyncClient`` runs one on a private event-loop thread for scripts. Every
failure is a ``tidegate.producer.errors`` exception, and bad input raises ``InvalidRequest`` before any
network call. With an ``api_key`` every call carries ``Authorization: Bearer <key>``; a job's
stream is opened with its stream token too.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypedDict, TypeVar, Unpack
from urllib.parse import quote, urlencode

import httpx
from pydantic import ValidationError
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from tidegate.log_redactor import REDACTOR
from tidegate.producer.errors import (
    Forbidden,
    InvalidRequest,
    JobNotFound,
    ServiceUnavailable,
    TidegateError,
    Unauthorized,
    error_from_response,
)
from tidegate.protocol import ChatMessage, Event, JobRequest, JobResult, Lane, is_final, parse_event

T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
FINAL_STATUSES = frozenset({"done", "error", "rejected"})
# Close codes after which a reconnect, resuming after the last event seen, can succeed.
RETRYABLE_CLOSE_CODES = frozenset({1001, 1006, 1011, 1012, 1013})
MAX_RECONNECTS = 5
MAX_FRAME_BYTES = 16 * 1024 * 1024


class SubmitOptions(TypedDict, total=False):
    """Everything ``submit`` takes besides the prompt; omitted fields get server defaults."""

    messages: Sequence[ChatMessage | Mapping[str, Any]]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: str | list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int  # the chosen token's logprob and this many alternatives per token
    logit_bias: Mapping[int, float]  # token id -> added to its logit
    # {"type": "json_object" | "json_schema" | "regex" | "choice" | "grammar", ...}
    response_format: Mapping[str, Any]
    tools: Sequence[Mapping[str, Any]]  # OpenAI's tool objects; the calls come back in
    tool_choice: str | Mapping[str, Any]  # the result's ``tool_calls``
    parallel_tool_calls: bool
    timeout_s: float  # the job's deadline, relative to now
    deadline_ms: int  # or an absolute one, unix ms
    lane: Lane
    priority: int  # -100..100, higher runs first within a lane
    idempotency_key: str  # a repeat with the same key returns the same job
    model: str  # a served model's name or alias, or "base:ADAPTER" (default: the first model)
    lora: str  # a LoRA adapter registered on the model


def build_request(prompt: str | None = None, **options: Unpack[SubmitOptions]) -> JobRequest:
    """The request ``submit`` would send; ``InvalidRequest`` if it is malformed."""
    fields = {k: v for k, v in {"prompt": prompt, **options}.items() if v is not None}
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc) from exc


class Client:
    """Async client of one tidegate deployment; use as ``async with Client(url) as client``."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str | None = None,
                 timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s  # per HTTP request and per WebSocket handshake
        self.auth_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s,
                                       headers=self.auth_headers)
        # websockets logs its handshake headers (and frames) at DEBUG: this library does not own
        # its process's logging, so it redacts only the records of the loggers it drives.
        REDACTOR.filter_loggers("websockets.client")
        if api_key:
            REDACTOR.add_secret(api_key)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def submit(self, prompt: str | None = None, **options: Unpack[SubmitOptions]) -> Handle:
        """Enqueue a job; the handle follows its events and result."""
        request = build_request(prompt, **options)
        body = await self._call("POST", "/v1/jobs",
                                json=request.model_dump(mode="json", exclude_unset=True))
        return Handle(self, body["id"], body["stream_url"], body.get("stream_token"))

    async def get(self, job_id: str) -> JobResult:
        """The job's current status and, once finished, its result; ``JobNotFound`` if none."""
        return JobResult.model_validate(await self._call("GET", f"/v1/jobs/{quote(job_id, safe='')}"))

    async def cancel(self, job_id: str) -> str:
        """Cancel a job: "cancelled" (it was still queued) or "cancelling" (its worker stops
        it within a step). ``Conflict`` (with ``job_status``) if it had already finished."""
        body = await self._call("POST", f"/v1/jobs/{quote(job_id, safe='')}/cancel")
        return str(body["status"])

    def handle(self, job_id: str, stream_url: str | None = None,
               stream_token: str | None = None) -> Handle:
        """A handle on a job submitted earlier; the stream is assumed beside the API."""
        if stream_url is None:
            ws_base = "ws" + self.base_url.removeprefix("http")  # http: -> ws:, https: -> wss:
            stream_url = f"{ws_base}/v1/jobs/{quote(job_id, safe='')}/stream"
        return Handle(self, job_id, stream_url, stream_token)

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:  # refused, reset, timed out
            raise ServiceUnavailable(f"cannot reach {self.base_url}: {exc!r}") from exc
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.is_success and isinstance(body, dict):
            return body
        raise error_from_response(response.status_code, body, response.headers.get("retry-after"))


class Handle:
    """One submitted job: its id, where its events stream, and its final result."""

    def __init__(self, client: Client, job_id: str, stream_url: str,
                 stream_token: str | None = None):
        self.id = job_id
        self.stream_url = stream_url
        self.stream_token = stream_token  # lets anyone holding it watch this job's stream
        self._client = client
        self._saw_final = False  # events() reached the end: result() need not stream again

    def __repr__(self) -> str:
        return f"Handle(id={self.id!r})"

    async def events(self, *, after_id: int = 0) -> AsyncIterator[Event]:
        """The job's events with id > ``after_id`` in order, ending after the final one.

        A dropped connection is resumed after the last event seen. Leaving early: wrap in
        ``contextlib.aclosing`` so the connection closes at once.
        """
        last, failures = after_id, 0
        while True:
            try:
                async with contextlib.aclosing(self._connection_events(last)) as stream:
                    async for event in stream:
                        last, failures = event.id, 0
                        final = is_final(event)
                        self._saw_final |= final
                        yield event
                        if final:
                            return
                reason = "the stream closed before the final event"
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else 1006
                if code == 4404:
                    raise JobNotFound(f"no job with id {self.id!r}") from exc
                if code in (4401, 4403):
                    kind = Unauthorized if code == 4401 else Forbidden
                    why = exc.rcvd.reason if exc.rcvd else ""
                    raise kind(f"may not watch job {self.id!r}: {why}", status=code) from exc
                if code not in RETRYABLE_CLOSE_CODES:
                    raise TidegateError(f"stream closed with {code}: {exc.rcvd}") from exc
                reason = f"stream closed with {code}"
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                reason = f"cannot reach the gateway: {exc!r}"
            failures += 1
            if failures > MAX_RECONNECTS:
                raise ServiceUnavailable(f"{reason} ({self.stream_url})")
            await asyncio.sleep(min(2.0, 0.05 * 2**failures))

    async def cancel(self) -> str:
        """Cancel the job: see ``Client.cancel``."""
        return await self._client.cancel(self.id)

    async def _connection_events(self, after_id: int) -> AsyncIterator[Event]:
        query: dict[str, str | int] = {"last_event_id": after_id} if after_id else {}
        headers = self._client.auth_headers
        if self.stream_token is not None:  # enough on its own: the key need not travel
            query["token"], headers = self.stream_token, {}
        url = self.stream_url + (f"?{urlencode(query)}" if query else "")
        async with ws_connect(url, open_timeout=self._client.timeout_s, max_size=MAX_FRAME_BYTES,
                              additional_headers=headers) as ws:
            async for raw in ws:
                try:
                    event = parse_event(raw)
                except ValidationError as exc:
                    raise TidegateError(f"malformed event from the gateway: {raw!r:.200}") from exc
                if event.id > after_id:
                    yield event

    async def result(self, timeout_s: float | None = None) -> JobResult:
        """The job's final state; ``TimeoutError`` after ``timeout_s``.

        A failed job is a result too (``status`` "error" or "rejected", with ``error``), not an
        exception. Follows the event stream to the final event, or polls the API if the
        gateway is gone.
        """
        async with asyncio.timeout(timeout_s):
            try:
                if not self._saw_final:
                    async for _ in self.events():
                        pass
            except ServiceUnavailable:
                pass  # the API may still answer; the poll below decides
            return await self._poll_until_final()

    async def _poll_until_final(self) -> JobResult:
        delay_s = 0.02
        while (result := await self._client.get(self.id)).status not in FINAL_STATUSES:
            await asyncio.sleep(delay_s)
            delay_s = min(1.0, delay_s * 2)
        return result


class SyncClient:
    """``Client`` for synchronous code: the same calls, run on a private event-loop thread."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str | None = None,
                 timeout_s: float = 30.0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="tidegate-client")
        self._thread.start()
        self._client = Client(base_url, api_key=api_key, timeout_s=timeout_s)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def submit(self, prompt: str | None = None, **options: Unpack[SubmitOptions]) -> SyncHandle:
        return SyncHandle(self, self._run(self._client.submit(prompt, **options)))

    def get(self, job_id: str) -> JobResult:
        return self._run(self._client.get(job_id))

    def cancel(self, job_id: str) -> str:
        return self._run(self._client.cancel(job_id))

    def handle(self, job_id: str, stream_url: str | None = None,
               stream_token: str | None = None) -> SyncHandle:
        return SyncHandle(self, self._client.handle(job_id, stream_url, stream_token))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


class SyncHandle:
    """``Handle`` for synchronous code."""

    def __init__(self, client: SyncClient, handle: Handle):
        self.id = handle.id
        self.stream_url = handle.stream_url
        self.stream_token = handle.stream_token
        self._client = client
        self._handle = handle

    def __repr__(self) -> str:
        return f"SyncHandle(id={self.id!r})"

    def events(self, *, after_id: int = 0) -> Iterator[Event]:
        """The job's events in order, ending after the final one."""
        stream = self._handle.events(after_id=after_id)
        try:
            while True:
                try:
                    yield self._client._run(_next(stream))
                except StopAsyncIteration:
                    return
        finally:
            self._client._run(stream.aclose())

    def result(self, timeout_s: float | None = None) -> JobResult:
        return self._client._run(self._handle.result(timeout_s))

    def cancel(self) -> str:
        return self._client._run(self._handle.cancel())


async def _next(stream: AsyncIterator[T]) -> T:
    return await anext(stream)  # run_coroutine_threadsafe takes coroutines, not awaitables
