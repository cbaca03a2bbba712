"""One process's pub/sub multiplexer: every watcher of every job over one Redis subscription.

A gateway (or API) process holds one ``EventHub``. Live events travel on a few shared channels
(``keys.live_channel``, one message per channel per worker write, a line per event:
``tidegate.events.event_log``); the first watcher of a job whose channel is not subscribed yet
subscribes the hub's single pub/sub connection to it, and the last watcher of that channel's
jobs unsubscribes it. One reader task takes every message off that connection, routes each line
by its job id (without parsing the event) and offers the event to the job's watchers, each of
which has a bounded queue: offering never blocks, so a stalled client can delay neither the
reader, nor the other clients, nor (through Redis' output buffer) the worker. A watcher whose
queue overflows, or whose backlog in bytes (its queued events plus what its consumer reports
as held for its client: a WebSocket's write buffers) passes the hub's ``backlog_bytes``, is
marked lagging and must be closed; it can resume from its last event id.

Exactness comes from the job's event stream, which workers write before they publish:
a watcher replays the stream after its resume point once the channel subscription is confirmed,
then takes live events, dropping ids it has sent and refilling from the stream when an id skips
ahead. Messages lost while the pub/sub connection was down, or on a quiet channel, are found by
the hub's poller, which reads each quiet job's stream once for all its watchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from tidegate import keys
from tidegate.cancelling import cancel_and_wait
from tidegate.events.event_feed import FeedEvent, stored_events
from tidegate.events.live_pubsub import ShardedPubSub, live_pubsub

log = logging.getLogger("tidegate.hub")

DEFAULT_QUEUE_SIZE = 1024
DEFAULT_BACKLOG_BYTES = 1 << 20
DEFAULT_POLL_S = 1.0


class Lagging(Exception):
    """The watcher fell more than its queue size behind; close it (it may resume)."""


class Watch:
    """One watcher of one job: a bounded queue the hub fills, read with ``next()``.

    State lives in the object, not in a generator frame, so ``next(timeout)`` can time out
    (an SSE keepalive, say) or be cancelled at any await without losing an event.
    """

    def __init__(self, hub: EventHub, job_id: str, after_id: int, queue_size: int):
        self.hub = hub
        self.job_id = job_id
        self.last = after_id  # the id of the last event handed to the consumer
        self.queue_size = queue_size
        self.finished = False  # the final event was handed out
        self._queue: deque[FeedEvent] = deque()  # live events from the hub: bounded
        self._ready: deque[FeedEvent] = deque()  # from the stream (replay, gap refills)
        self._replayed = False
        self._wake = asyncio.Event()
        self.lagging = asyncio.Event()  # set once: the consumer must close this watcher
        # Called once when the queue overflows: a consumer blocked sending to its client
        # would not otherwise notice.
        self.on_lag: Callable[[], object] | None = None
        # A consumer that can hand an event to its client without awaiting (a WebSocket
        # frame written straight to the transport) sets this; while the consumer is parked in
        # next() with nothing queued, the hub calls it instead of queueing and waking the
        # consumer. It returns False to refuse (the client is not keeping up, or closing):
        # the event is then queued as usual.
        self.direct: Callable[[FeedEvent], bool] | None = None
        self._parked = False  # the consumer waits in next() with nothing to hand out
        # Bytes the consumer holds for its client beyond this queue (a WebSocket's transport
        # buffer and kernel send queue: a client that stops reading fills those first, unseen
        # by the queue). The hub adds the queued events and checks the sum every half poll.
        self.backlog: Callable[[], int] | None = None
        self.backlog_due = 0.0  # loop time of the next backlog check (EventHub._check_backlogs)

    def offer(self, event: FeedEvent) -> None:
        """From the hub: queue the event or, when full, mark the watcher lagging. Never blocks."""
        if self.lagging.is_set() or event.id <= self.last:
            return
        if (self._parked and self.direct is not None and not self._queue and not self._ready
                and event.id == self.last + 1 and not event.final and self.direct(event)):
            self.last = event.id  # the final event always goes through next(): it ends the watch
            self.hub.direct_sends += 1
            return
        if len(self._queue) >= self.queue_size:
            self._lag()
        else:
            self._queue.append(event)
        self._wake.set()

    def check_backlog(self, limit_bytes: int) -> int:
        """From the hub: mark the watcher lagging once it holds more than ``limit_bytes``;
        returns what it holds."""
        if self.lagging.is_set():
            return 0
        held = sum(len(event.raw) for event in self._queue)
        if self.backlog is not None:
            held += self.backlog()
        if held > limit_bytes:
            self._lag()
            self._wake.set()
        return held

    def _lag(self) -> None:
        self.lagging.set()
        if self.on_lag is not None:
            self.on_lag()

    async def next(self, timeout: float | None = None) -> FeedEvent | None:
        """The next event (id = last + 1), or None when none came within ``timeout``.

        Raises ``StopAsyncIteration`` after the final event, ``Lagging`` once the queue
        overflowed, ``RedisError`` when the stream cannot be read.
        """
        if self.finished:
            raise StopAsyncIteration
        topic = self.hub._topics[self.job_id]  # present: this watch keeps it
        if not self._replayed:
            await self.hub._ready(topic)
            stored = await stored_events(self.hub.redis, self.job_id)
            if any(e.final and e.id <= self.last for e in stored):
                self.finished = True  # resumed after the final event: nothing more, ever
                raise StopAsyncIteration
            self._ready.extend(e for e in stored if e.id > self.last)
            self._replayed = True
        while True:
            source = self._ready if self._ready else self._queue
            if source:
                event = source[0]
                if event.id <= self.last:
                    source.popleft()
                    continue
                if event.id > self.last + 1:  # a gap: the stream has everything, in order
                    stored = await stored_events(self.hub.redis, self.job_id, self.last)
                    missed = [e for e in stored if e.id < event.id]
                    if missed:
                        self._ready.extendleft(reversed(missed))
                        continue
                source.popleft()
                self.last = event.id
                topic.saw(event.id)
                self.finished = event.final
                return event
            if self.lagging.is_set():
                raise Lagging(f"more than {self.queue_size} events behind")
            self._wake.clear()
            self._parked = True
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                return None
            finally:
                self._parked = False

    def take_ready(self, limit: int = 64) -> list[FeedEvent]:
        """Live events already queued that follow on without a gap, without awaiting: lets a
        consumer send a backlog in one go instead of one wake-up per event."""
        taken: list[FeedEvent] = []
        if self._ready or not self._replayed:
            return taken  # replay and gap refills go through next()
        queue = self._queue
        while queue and len(taken) < limit and not self.finished:
            event = queue[0]
            if event.id <= self.last:
                queue.popleft()
                continue
            if event.id != self.last + 1:
                break  # a gap: next() refills it from the stream
            queue.popleft()
            self.last = event.id
            self.finished = event.final
            taken.append(event)
        if taken:
            self.hub._topics[self.job_id].saw(self.last)
        return taken

    def encoded(self, event: FeedEvent, encode: Callable[[bytes], bytes]) -> bytes:
        """``encode(event.raw)``, computed once per event for all the job's watchers (each is
        handed the same event object in turn)."""
        topic = self.hub._topics[self.job_id]
        if topic.encoded_id != event.id:
            topic.encoded, topic.encoded_id = encode(event.raw.encode()), event.id
        return topic.encoded

    async def events(self) -> AsyncIterator[FeedEvent]:
        """Every event after the resume point, in order, ending after the final one."""
        while True:
            try:
                event = await self.next()
            except StopAsyncIteration:
                return
            assert event is not None
            yield event


@dataclass(slots=True)
class _Channel:
    """One subscribed live channel and how many watched jobs need it."""

    name: str
    jobs: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # SUBSCRIBE confirmed


@dataclass(slots=True)
class _Topic:
    """The watchers of one job."""

    channel: _Channel
    watchers: set[Watch] = field(default_factory=set)
    last_seen: int = 0  # highest event id any watcher got: where the poller reads from
    quiet_since: float = 0.0
    encoded_id: int = -1  # the event whose wire form ``encoded`` holds (Watch.encoded)
    encoded: bytes = b""

    def saw(self, event_id: int) -> None:
        if event_id > self.last_seen:
            self.last_seen = event_id


class EventHub:
    """Subscribes one pub/sub connection to the channels of watched jobs and fans them out."""

    def __init__(self, redis: aioredis.Redis, *, queue_size: int = DEFAULT_QUEUE_SIZE,
                 backlog_bytes: int = DEFAULT_BACKLOG_BYTES, poll_s: float = DEFAULT_POLL_S):
        self.redis = redis
        self.queue_size = queue_size
        self.backlog_bytes = backlog_bytes
        self.poll_s = poll_s
        self._topics: dict[str, _Topic] = {}  # job id -> topic
        self._channels: dict[str, _Channel] = {}  # subscribed (or subscribing) live channels
        self._pubsub: PubSub | ShardedPubSub | None = None
        self._subscribed = asyncio.Event()  # the reader has something to read
        self._command_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.connected = False  # the pub/sub connection is up (for readiness)
        self.direct_sends = 0  # events handed to a watcher's ``direct`` writer (no wake-up)

    @property
    def watched_jobs(self) -> int:
        return len(self._topics)

    @property
    def watchers(self) -> int:
        return sum(len(t.watchers) for t in self._topics.values())

    async def start(self) -> None:
        self._pubsub = live_pubsub(self.redis)
        self._tasks = [asyncio.create_task(self._read(), name="hub-reader"),
                       asyncio.create_task(self._poll(), name="hub-poller")]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)  # the poller's reads could drop one cancel
        self._tasks = []
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()
            self._pubsub = None

    @contextlib.asynccontextmanager
    async def watch(self, job_id: str, after_id: int = 0) -> AsyncIterator[Watch]:
        """Register a watcher of ``job_id`` for the duration of the block."""
        topic = self._topics.get(job_id)
        watch = Watch(self, job_id, after_id, self.queue_size)
        if topic is None:
            name = keys.job_live_channel(job_id)
            channel = self._channels.get(name)
            subscribe = channel is None
            if channel is None:
                channel = self._channels[name] = _Channel(name)
            channel.jobs += 1
            topic = self._topics[job_id] = _Topic(channel)
            topic.quiet_since = asyncio.get_running_loop().time()
            topic.watchers.add(watch)
            if subscribe:
                try:
                    await self._send("SUBSCRIBE", name)
                except BaseException:
                    await self._leave(job_id, topic, watch)
                    raise
        else:
            topic.watchers.add(watch)
        try:
            yield watch
        finally:
            await self._leave(job_id, topic, watch)

    async def _leave(self, job_id: str, topic: _Topic, watch: Watch) -> None:
        topic.watchers.discard(watch)
        if not topic.watchers and self._topics.get(job_id) is topic:
            del self._topics[job_id]
            channel = topic.channel
            channel.jobs -= 1
            if channel.jobs == 0 and self._channels.get(channel.name) is channel:
                del self._channels[channel.name]
                # Shielded: a watcher's task may be cancelled more than once
                # (tidegate.cancelling), and an interrupted UNSUBSCRIBE would leave the
                # connection subscribed to a channel the hub no longer reads for.
                await asyncio.shield(self._unsubscribe(channel.name))

    async def _unsubscribe(self, channel: str) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._send("UNSUBSCRIBE", channel)

    async def _ready(self, topic: _Topic) -> None:
        """Until the topic's channel subscription is confirmed (at most one poll interval: the
        replay and the poller cover anything published before it is)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.poll_s):
                await topic.channel.ready.wait()

    async def _send(self, command: str, channel: str) -> None:
        assert self._pubsub is not None, "EventHub.start() was not called"
        # One command at a time: redis-py's PubSub opens its connection on the first command,
        # and two concurrent first commands would each open one (the first then goes unread).
        async with self._command_lock:
            if command == "SUBSCRIBE":
                await self._pubsub.subscribe(channel)
                self._subscribed.set()
            else:
                await self._pubsub.unsubscribe(channel)

    def _deliver(self, topic: _Topic, event: FeedEvent) -> None:
        topic.saw(event.id)
        topic.quiet_since = asyncio.get_running_loop().time()
        for watch in topic.watchers:
            watch.offer(event)

    async def _read(self) -> None:
        """Take every message off the shared connection; rebuild it after a failure."""
        while True:
            await self._subscribed.wait()
            assert self._pubsub is not None
            try:
                msg = await self._pubsub.get_message(timeout=self.poll_s)
            except (RedisError, OSError, RuntimeError) as exc:
                await self._reconnect(exc)
                continue
            if msg is None:
                continue
            self.connected = True
            if msg["type"] == "message":
                self._route(msg["data"])
            elif msg["type"] == "subscribe":
                channel = self._channels.get(msg["channel"])
                if channel is not None:
                    channel.ready.set()

    def _route(self, message: str) -> None:
        """Offer each line's event to its job's watchers (lines of unwatched jobs are skipped
        unparsed: a channel carries the events of many jobs)."""
        topics = self._topics
        for line in message.split("\n"):
            job_id, _, rest = line.partition(" ")
            topic = topics.get(job_id)
            if topic is None:
                continue
            parts = rest.split(" ", 2)
            if len(parts) != 3 or not parts[0].isdecimal():
                log.warning("dropped a malformed live line for job %s", job_id)
                continue
            self._deliver(topic, FeedEvent(int(parts[0]), parts[1], parts[2]))

    async def _reconnect(self, exc: BaseException) -> None:
        """A new pub/sub connection subscribed to every watched channel. Anything published
        meanwhile is in the streams; the poller finds it (every topic counts as quiet)."""
        self.connected = False
        log.warning("pub/sub connection lost (%s); reconnecting", type(exc).__name__)
        old, self._pubsub = self._pubsub, live_pubsub(self.redis, fresh=True)
        if old is not None:
            with contextlib.suppress(Exception):
                await old.aclose()
        while True:
            try:
                async with self._command_lock:
                    for channel in self._channels.values():
                        channel.ready.clear()
                    for topic in self._topics.values():
                        topic.quiet_since = 0.0
                    channels = list(self._channels)
                    if channels:
                        await self._pubsub.subscribe(*channels)
                    else:
                        self._subscribed.clear()
                return
            except (RedisError, OSError) as err:
                log.debug("pub/sub reconnect failed: %s", err)
                await asyncio.sleep(self.poll_s)

    def _check_backlogs(self, now: float) -> None:
        """Cut the watchers holding more than ``backlog_bytes``. A watcher holding little is
        looked at again only after four rounds: reading a socket's send queue is a system
        call, and a watcher far below the limit cannot pass it sooner at token rates."""
        for topic in self._topics.values():
            if now - topic.quiet_since >= self.poll_s:
                continue  # a quiet job adds to nobody's backlog
            for watch in topic.watchers:
                if watch.backlog_due <= now:
                    held = watch.check_backlog(self.backlog_bytes)
                    rounds = 1 if held > self.backlog_bytes // 4 else 4
                    watch.backlog_due = now + rounds * self.poll_s / 2 - 0.01

    async def _poll(self) -> None:
        """Every half poll interval: cut the watchers holding too much, then read the stream
        of every job quiet for a poll interval, once for all its watchers."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.poll_s / 2)
            now = loop.time()
            try:
                self._check_backlogs(now)
            except Exception:  # a consumer's backlog callback: never the poller's end
                log.exception("checking watchers' backlogs failed")
            for job_id, topic in list(self._topics.items()):
                if now - topic.quiet_since < self.poll_s or not topic.watchers:
                    continue
                try:
                    events = await stored_events(self.redis, job_id, topic.last_seen)
                except (RedisError, OSError):
                    break  # Redis is down: try again next round
                topic.quiet_since = loop.time()
                for event in events:
                    self._deliver(topic, event)
