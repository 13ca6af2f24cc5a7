"""The engine thread: admission queue -> slots -> generate -> per-request event queues (JetStream's pattern).

One thread owns the engine. Between `generate` calls it releases the slots of cancelled requests, admits
queued requests into free slots (one prefill per request, one insert per sample), then runs `generate` and
hands each slot's tokens to its sample. It never waits on the network: events reach the asyncio side through
`loop.call_soon_threadsafe` into each request's `asyncio.Queue`.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from tpuserve.grpc_service.jobs import ErrorEvent, Event, Finish, GenerationJob, PromptEvent, SampleEvent
from tpuserve.grpc_service.sample import SampleTracker
from tpuserve.sampler.api import Engine, StepArrays, TokenOut

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The admission queue is full; the servicer answers RESOURCE_EXHAUSTED."""


class ShuttingDownError(Exception):
    """The server no longer admits requests; the servicer answers UNAVAILABLE."""


class RequestStream:
    """The asyncio side of one request: its events, in order, until every sample has finished."""

    def __init__(
        self, job: GenerationJob, loop: asyncio.AbstractEventLoop, deadline: float | None = None
    ) -> None:
        self.job = job
        self.cancelled = False  # cancelled by the client, or dropped from the queue: never (again) in a slot
        self.submitted = time.monotonic()
        self.deadline = deadline  # time.monotonic() by which the client stops waiting (its gRPC deadline)
        self._loop = loop
        self._queue: asyncio.Queue[list[Event]] = asyncio.Queue()

    def deliver(self, events: list[Event]) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, events)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def events(self) -> AsyncIterator[Event]:
        open_samples = self.job.n
        while open_samples > 0:
            for event in await self._queue.get():
                yield event
                if isinstance(event, ErrorEvent):
                    return
                if isinstance(event, SampleEvent) and event.finish is not None:
                    open_samples -= 1


@dataclass
class _Running:
    stream: RequestStream
    trackers: list[SampleTracker]
    slots: dict[int, int] = field(default_factory=dict)  # sample index -> slot, while it holds one
    outbox: list[Event] = field(default_factory=list)


class Orchestrator:
    """Owns the engine on one thread; `submit` and `cancel` are called from the asyncio event loop."""

    def __init__(
        self,
        engine: Engine,
        token_bytes: Sequence[bytes],
        special_ids: frozenset[int],
        max_queue: int = 256,
        idle_wait_s: float = 1.0,
        max_queue_wait_s: float | None = None,
    ) -> None:
        self.engine = engine
        self._token_bytes = token_bytes
        self._special = frozenset(special_ids)
        self._queue: queue.Queue[RequestStream] = queue.Queue(maxsize=max_queue)
        self._cancels: collections.deque[RequestStream] = collections.deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._admitting = True
        self._idle_wait_s = idle_wait_s
        if max_queue_wait_s is not None and max_queue_wait_s <= 0:
            raise ValueError(f"max_queue_wait must be positive seconds (or unset), not {max_queue_wait_s}")
        self.max_queue_wait_s = max_queue_wait_s  # longer without a slot: RESOURCE_EXHAUSTED
        # a heap: the lowest free slot first, so live slots stay packed and decode runs on a small batch bucket
        self._free = list(range(engine.slots))
        self._owner: dict[int, tuple[_Running, int]] = {}
        self._running: dict[int, _Running] = {}  # id(stream) -> state
        self._head: RequestStream | None = None  # dequeued, waiting for enough free slots
        self._closed: list[_Running] = []  # finished since the last flush, events still to deliver
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.on_generate: Callable[[float], None] | None = None  # seconds per generate call (metrics)
        # a queued request dropped before a slot, by gRPC status name (metrics)
        self.on_drop: Callable[[str], None] | None = None

    # ---- called from the event loop -------------------------------------------------------------------

    def start(
        self,
        warmup: Callable[[], None] | None = None,
        on_ready: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Start the engine thread; it runs `warmup` first (it owns the engine), then `on_ready(error)`.

        A warm-up that raises stops the thread: `on_ready` gets the exception and nothing is served."""
        self._thread = threading.Thread(
            target=self._main, args=(warmup, on_ready), name="engine", daemon=True
        )
        self._thread.start()

    def submit(self, job: GenerationJob, deadline: float | None = None) -> RequestStream:
        """Queue `job`. `deadline` (time.monotonic()): when its client stops waiting; a request still queued
        then is dropped before it takes a slot, like one that waited longer than `max_queue_wait_s`."""
        if not self._admitting:
            raise ShuttingDownError("the server is shutting down and admits no new requests")
        stream = RequestStream(job, asyncio.get_running_loop(), deadline)
        try:
            self._queue.put_nowait(stream)
        except queue.Full:
            raise QueueFullError(
                f"the server is at capacity: {self._queue.maxsize} requests are already waiting; retry later"
            ) from None
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Free the request's slots before the next generate call (idempotent)."""
        if not stream.cancelled:
            stream.cancelled = True
            self._cancels.append(stream)
            self._wake.set()

    def stop_admission(self) -> None:
        self._admitting = False

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still open end with an error event."""
        self._admitting = False
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (not yet dropped or cancelled); for metrics and tests."""
        head = self._head
        with self._queue.mutex:
            waiting = sum(not s.cancelled for s in self._queue.queue)
        return waiting + (head is not None and not head.cancelled)

    # ---- the engine thread ----------------------------------------------------------------------------

    def _main(
        self, warmup: Callable[[], None] | None, on_ready: Callable[[BaseException | None], None] | None
    ) -> None:
        error: BaseException | None = None
        try:
            if warmup is not None:
                warmup()
        except BaseException as exc:
            log.exception("engine warm-up failed")
            error = exc
            self._stopping.set()
        self.ready.set()
        if on_ready is not None:
            on_ready(error)
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                self._step()
            except Exception:  # never let the engine thread die: fail what is running, keep serving
                log.exception("engine step failed")
                self._fail_all("internal error in the engine loop")
            if not self._owner and not self._has_queued():
                self._wake.wait(self._idle_wait_s)
        self._fail_all("the server is shutting down", include_queued=True)

    def _has_queued(self) -> bool:
        return self._head is not None or not self._queue.empty() or bool(self._cancels)

    def _step(self) -> None:
        self._apply_cancels()
        self._admit()  # first: a request that finds a free slot now is served, however long it waited
        self._drop_expired()
        if self._owner:
            t0 = time.perf_counter()
            try:
                steps = self.engine.generate()
            except Exception as exc:
                log.exception("engine.generate failed")
                self._fail_all(f"engine error: {exc}")
                return
            if self.on_generate is not None:
                self.on_generate(time.perf_counter() - t0)
            self._dispatch(steps)
        self._flush_outboxes()

    def _apply_cancels(self) -> None:
        while self._cancels:
            stream = self._cancels.popleft()
            run = self._running.get(id(stream))
            if run is None:
                continue  # still queued (skipped at admission) or already finished
            for index in list(run.slots):
                run.outbox.append(run.trackers[index].end(Finish.CANCELLED))
                self._release(run, index)
            self._close_if_done(run)

    def _expiry(self, stream: RequestStream, now: float) -> ErrorEvent | None:
        """Why a queued request must not wait any longer (its client's deadline, max_queue_wait), or None."""
        if stream.deadline is not None and now >= stream.deadline:
            return ErrorEvent("the request's deadline passed while it waited for a slot", "DEADLINE_EXCEEDED")
        if self.max_queue_wait_s is not None and now - stream.submitted >= self.max_queue_wait_s:
            return ErrorEvent(
                f"no slot was free within max_queue_wait = {self.max_queue_wait_s:g} s; retry later",
                "RESOURCE_EXHAUSTED",
            )
        return None

    def _drop(self, stream: RequestStream, event: ErrorEvent) -> None:
        stream.cancelled = True  # admission skips it
        stream.deliver([event])
        if self.on_drop is not None:
            self.on_drop(event.code)

    def _drop_expired(self) -> None:
        """After admission: end every request still waiting past its deadline or `max_queue_wait_s`, and take the
        ended and client-cancelled ones out of the queue (they would count against `max_queue`)."""
        now = time.monotonic()
        with self._queue.mutex:
            waiting = list(self._queue.queue)
        if self._head is not None:
            waiting.append(self._head)
        for stream in waiting:
            if not stream.cancelled and (event := self._expiry(stream, now)) is not None:
                self._drop(stream, event)
        if self._head is not None and self._head.cancelled:
            self._head = None
        with self._queue.mutex:  # only this thread takes from the queue; submit() may append meanwhile
            if any(s.cancelled for s in self._queue.queue):
                live = [s for s in self._queue.queue if not s.cancelled]
                self._queue.queue.clear()
                self._queue.queue.extend(live)
                self._queue.not_full.notify_all()

    def _admit(self) -> None:
        while True:
            if self._head is None:
                try:
                    self._head = self._queue.get_nowait()
                except queue.Empty:
                    return
            stream = self._head
            if stream.cancelled:
                self._head = None
                continue
            now = time.monotonic()
            if stream.deadline is not None and now >= stream.deadline:
                # its client has stopped waiting: no slot for it. (max_queue_wait is not checked here: a request
                # that finds a free slot is served however long it waited.)
                self._head = None
                self._drop(stream, self._expiry(stream, now))
                continue
            if stream.job.max_tokens > 0 and len(self._free) < stream.job.n:
                return  # first come, first served: wait for slots
            self._head = None
            self._start(stream)

    def _start(self, stream: RequestStream) -> None:
        job = stream.job
        trackers = [SampleTracker(job, i, self._token_bytes, self._special) for i in range(job.n)]
        run = _Running(stream, trackers)
        self._running[id(stream)] = run
        try:
            prefix = self.engine.prefill(list(job.prompt_ids), job.prompt_logprobs)
            if job.prompt_logprobs:
                run.outbox.append(PromptEvent(self.engine.prompt_logprobs(prefix)))
            if job.max_tokens == 0:
                run.outbox.extend(t.end(Finish.LENGTH) for t in trackers)
            for index, params in enumerate(job.samples if job.max_tokens > 0 else ()):
                slot = heapq.heappop(self._free)
                run.slots[index] = slot
                self._owner[slot] = (run, index)
                self._on_token(run, index, self.engine.insert(prefix, slot, params))
        except Exception as exc:
            log.exception("prefill/insert failed for request %s", job.request_id)
            self._fail(run, f"engine error: {exc}")
            return
        self._close_if_done(run)

    def _dispatch(self, steps: StepArrays) -> None:
        for step in range(steps.valid.shape[0]):
            for slot in steps.valid[step].nonzero()[0].tolist():
                owner = self._owner.get(slot)
                if owner is not None:
                    self._on_token(owner[0], owner[1], steps.token(step, slot))

    def _on_token(self, run: _Running, index: int, token: TokenOut) -> None:
        event = run.trackers[index].add(token)
        if event is not None:
            run.outbox.append(event)
        if run.trackers[index].finished:
            self._release(run, index)
            self._close_if_done(run)

    def _release(self, run: _Running, index: int) -> None:
        slot = run.slots.pop(index, None)
        if slot is None:
            return
        self._owner.pop(slot, None)
        try:
            self.engine.release(slot)
        except Exception:
            log.exception("engine.release(%d) failed", slot)
        heapq.heappush(self._free, slot)

    def _close_if_done(self, run: _Running) -> None:
        if all(t.finished for t in run.trackers) and self._running.pop(id(run.stream), None) is not None:
            self._closed.append(run)

    def _flush_outboxes(self) -> None:
        for run in [*self._running.values(), *self._closed]:
            if run.outbox:
                run.stream.deliver(run.outbox)
                run.outbox = []
        self._closed.clear()

    def _fail(self, run: _Running, message: str) -> None:
        for index in list(run.slots):
            self._release(run, index)
        for tracker in run.trackers:
            tracker.finished = True
        run.outbox.append(ErrorEvent(message))
        self._close_if_done(run)

    def _fail_all(self, message: str, include_queued: bool = False) -> None:
        for run in list(self._running.values()):
            self._fail(run, message)
        if include_queued:
            pending = [self._head] if self._head is not None else []
            self._head = None
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            for stream in pending:
                stream.deliver([ErrorEvent(message)])
        self._flush_outboxes()
