"""Requests on their way to a slot: the event loop's `RequestStream` of each request, and the FIFO of those
waiting for slots (`WaitingQueue`).

`WaitingQueue.reserve` runs on the event loop thread (it takes a waiting place or refuses the request at once);
every other method runs on the engine thread, which owns the deque. `queued` is two counters, each written by one
thread (requests reserved; requests that left the deque).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Callable

from tpuserve.grpc_service.jobs import ErrorEvent, Event, GenerationJob, SampleEvent


class QueueFullError(Exception):
    """The admission queue is full; the servicer answers RESOURCE_EXHAUSTED."""


class ShuttingDownError(Exception):
    """The server no longer admits requests; the servicer answers UNAVAILABLE."""


class RequestStream:
    """The event loop's side of one request: its events, in order, until every sample has finished."""

    def __init__(
        self, job: GenerationJob, loop: asyncio.AbstractEventLoop, deadline: float | None = None
    ) -> None:
        self.job = job
        self.submitted = time.monotonic()
        self.deadline = deadline  # time.monotonic() by which the client stops waiting (its gRPC deadline)
        # the weights that compute it: set by the engine thread when it starts, before its first event
        self.weight_version = ""
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


class WaitingQueue:
    """Requests waiting for slots, first come first served, at most `max_queue` of them.

    A request leaves it to take its slots (`pop`), because its client went away (`cancel`, then the next pass),
    or dropped with an error event: its gRPC deadline passed, or it waited longer than `max_wait_s` (checked only
    for requests that cannot be admitted now: one that finds free slots is served however long it waited)."""

    def __init__(self, max_queue: int, max_wait_s: float | None, on_drop: Callable[[str], None]) -> None:
        if max_wait_s is not None and max_wait_s <= 0:
            raise ValueError(f"max_queue_wait must be positive seconds (or unset), not {max_wait_s}")
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self._on_drop = on_drop  # gRPC status name of each drop (metrics)
        self._places = threading.BoundedSemaphore(max_queue)
        self._reserved = 0  # event loop thread only
        self._left = 0  # engine thread only
        self._deque: collections.deque[RequestStream] = collections.deque()  # engine thread only
        self._cancelled: set[int] = set()  # id() of waiting streams whose client went away

    # ---- event loop thread ----------------------------------------------------------------------------

    def reserve(self) -> None:
        """Take a waiting place for a request about to be submitted, or raise QueueFullError."""
        if not self._places.acquire(blocking=False):
            raise QueueFullError(
                f"the server is at capacity: {self.max_queue} requests are already waiting; retry later"
            )
        self._reserved += 1

    @property
    def queued(self) -> int:
        """Requests waiting (one whose client went away counts until the engine thread has taken it out)."""
        return self._reserved - self._left

    # ---- engine thread --------------------------------------------------------------------------------

    def __bool__(self) -> bool:
        return bool(self._deque)

    def append(self, stream: RequestStream) -> None:
        self._deque.append(stream)

    def cancel(self, stream: RequestStream) -> bool:
        """Mark a waiting request as gone (it leaves at the next pass); False if it is not waiting."""
        if any(s is stream for s in self._deque):
            self._cancelled.add(id(stream))
            return True
        return False

    def head(self) -> RequestStream | None:
        """The first request still worth a slot: cancelled ones leave, and ones whose deadline passed are
        dropped, on the way."""
        while self._deque:
            stream = self._deque[0]
            if id(stream) in self._cancelled:
                self._leave(stream)
            elif (event := self._expiry(stream, time.monotonic(), max_wait=False)) is not None:
                self._drop(stream, event)
            else:
                return stream
        return None

    def pop(self) -> RequestStream:
        """The head leaves to take its slots."""
        stream = self._deque[0]
        self._leave(stream)
        return stream

    def drop_expired(self) -> None:
        """After admission: drop every request still waiting past its deadline or `max_wait_s`, and take the
        client-cancelled ones out."""
        now = time.monotonic()
        for stream in list(self._deque):
            if id(stream) in self._cancelled:
                self._leave(stream)
            elif (event := self._expiry(stream, now)) is not None:
                self._drop(stream, event)

    def fail_all(self, message: str) -> None:
        while self._deque:
            stream = self.pop()
            stream.deliver([ErrorEvent(message)])

    def _leave(self, stream: RequestStream) -> None:
        self._deque.remove(stream)
        self._cancelled.discard(id(stream))
        self._left += 1
        self._places.release()

    def _expiry(self, stream: RequestStream, now: float, max_wait: bool = True) -> ErrorEvent | None:
        if stream.deadline is not None and now >= stream.deadline:
            return ErrorEvent("the request's deadline passed while it waited for a slot", "DEADLINE_EXCEEDED")
        if max_wait and self.max_wait_s is not None and now - stream.submitted >= self.max_wait_s:
            return ErrorEvent(
                f"no slot was free within max_queue_wait = {self.max_wait_s:g} s; retry later",
                "RESOURCE_EXHAUSTED",
            )
        return None

    def _drop(self, stream: RequestStream, event: ErrorEvent) -> None:
        self._leave(stream)  # `queued` no longer counts it when the client hears of it
        stream.deliver([event])
        self._on_drop(event.code)
