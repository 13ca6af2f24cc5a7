"""The engine thread: commands in -> admission -> slots -> decode calls -> per-request events out (JetStream's
"queues all the way down"). The waiting requests and the event loop's side of a request: admission.py.

Threads and what each owns:
  event loop thread  (the gRPC servicer) each `RequestStream` and its asyncio queue; it calls `submit`, `cancel`,
                     `stop_admission`, which only put a command on the command queue (and take a waiting place
                     from the bounded semaphore).
  engine thread      everything else here: the engine, the waiting deque, the slot table, the samples' trackers
                     and the decode call in flight. It blocks on the command queue when it has nothing to do,
                     never polls. After each turn it publishes `stats`, an immutable snapshot.
  other readers      (the metrics collector, tests) read `stats` (free slots, used KV positions) and `queued`
                     (WaitingQueue's two counters, each written by one thread).

One turn: take every waiting command, then admit, prefill, insert, decode and read back as the scheduling
policy says (scheduling.py, which also says why one decode call stays in flight or not).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from tpuserve.grpc_service import jobs
from tpuserve.grpc_service.admission import RequestStream, ShuttingDownError, WaitingQueue
from tpuserve.grpc_service.guided import Constraint, Grammars, GuidedError
from tpuserve.grpc_service.jobs import ErrorEvent, Finish, GenerationJob, PromptEvent
from tpuserve.grpc_service.running import InFlight, Running
from tpuserve.grpc_service.sample_tracker import SampleTracker
from tpuserve.grpc_service.scheduling import OVERLAP_MAX_CALL_S, Policy, wants_tokens
from tpuserve.sampler.api import Engine, EngineUnavailable, Pending, TokenOut
from tpuserve.sampler.config import EngineConfig

log = logging.getLogger(__name__)


class Stats(NamedTuple):
    free_slots: int
    used_positions: int = 0  # KV-cache positions of the samples holding slots (prompt + generated)


_SUBMIT, _CANCEL, _STOP, _UPDATE = "submit", "cancel", "stop", "update"


@dataclasses.dataclass
class WeightUpdate:
    """New weights to swap in (Engine.load_weights / weights_from_arrays), as `version`. `abort`: end the requests
    in flight at once (ABORTED) instead of finishing them on the old weights first. `done(result)` is called on
    the engine thread once: with the number of requests aborted after the swap, or with the exception that
    stopped it (the old weights still serve)."""

    weights: object
    version: str
    abort: bool
    done: Callable[[int | BaseException], None]


class Orchestrator:
    """Owns the engine on one thread; `submit` and `cancel` are called from the asyncio event loop."""

    def __init__(
        self,
        engine: Engine,
        token_bytes: Sequence[bytes],
        special_ids: frozenset[int],
        max_queue: int = EngineConfig.max_queue,
        max_queue_wait_s: float | None = EngineConfig.max_queue_wait,
        prefill_budget: int | None = EngineConfig.prefill_budget,
        grammars: Grammars | None = None,
        overlap_max_call_s: float = OVERLAP_MAX_CALL_S,
    ) -> None:
        self.engine = engine
        self.grammars = grammars  # structured outputs (None: the engine takes no token masks)
        # prompt tokens prefilled per turn while streams decode; None: one chunk
        self.policy = Policy(prefill_budget or engine.prefill_chunk, overlap_max_call_s)
        self._token_bytes = token_bytes
        self._special = frozenset(special_ids)
        self._commands: queue.SimpleQueue[tuple[str, RequestStream | WeightUpdate | None]] = (
            queue.SimpleQueue()
        )
        self._update: WeightUpdate | None = None  # weights waiting for the engine to drain (or be aborted)
        self._aborted = 0  # requests the waiting update aborted
        self._admitting = True  # event loop thread
        self._stopped = threading.Event()  # set by the engine thread when it has stopped
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.stats = Stats(engine.slots)  # published by the engine thread
        self.on_decode: Callable[[float], None] | None = None  # seconds per decode call (metrics)
        self.on_drop: Callable[[str], None] | None = None  # a queued request dropped, by gRPC status name
        self._waiting = WaitingQueue(
            max_queue, max_queue_wait_s, lambda code: self.on_drop and self.on_drop(code)
        )
        # engine thread only. A heap, lowest free slot first: occupied slots stay packed (small batch buckets)
        self._free = list(range(engine.slots))
        self._owner: dict[int, tuple[Running, int]] = {}
        self._running: dict[int, Running] = {}  # id(stream) -> state
        self._prefilling: collections.deque[Running] = collections.deque()  # slots taken, prefilling
        self._firsts: list[tuple[Running, int, Pending[TokenOut]]] = []  # inserted, first token not yet read
        self._inflight: InFlight | None = None
        self._last_read = 0.0  # when the previous decode call's outputs were read (perf_counter)
        self._call_s: float | None = None  # how long the last decode call took (None: none yet)
        self._step_s: float | None = None  # and per step
        self._closed: list[Running] = []  # finished since the last flush, events still to deliver

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
        if not self._admitting or self._stopped.is_set():
            raise ShuttingDownError("the server is shutting down and admits no new requests")
        self._waiting.reserve()  # or QueueFullError
        stream = RequestStream(job, asyncio.get_running_loop(), deadline)
        self._commands.put((_SUBMIT, stream))
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Free the request's slots before the next decode call (idempotent)."""
        self._commands.put((_CANCEL, stream))

    def update_weights(self, update: WeightUpdate) -> None:
        """Swap in new weights between two decode calls (docs/weight-updates.md): no request starts meanwhile;
        those in flight finish first on the old weights, or end at once with ABORTED (`update.abort`); the prefix
        cache is forgotten. Thread-safe; `update.done` reports the end."""
        self._commands.put((_UPDATE, update))

    def stop_admission(self) -> None:
        self._admitting = False

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still open end with an error event."""
        self._commands.put((_STOP, None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def free_slots(self) -> int:
        return self.stats.free_slots

    @property
    def queued(self) -> int:
        """Requests waiting for a slot; for metrics and tests (see WaitingQueue.queued)."""
        return self._waiting.queued

    # ---- the engine thread: the loop ------------------------------------------------------------------

    def _main(
        self, warmup: Callable[[], None] | None, on_ready: Callable[[BaseException | None], None] | None
    ):
        error: BaseException | None = None
        try:
            if warmup is not None:
                warmup()
        except BaseException as exc:
            log.exception("engine warm-up failed")
            error = exc
        self.ready.set()
        if on_ready is not None:
            on_ready(error)
        try:
            while error is None and self._await_call() and self._take_commands():
                try:
                    self._turn()
                except Exception:  # never let the engine thread die: fail what is running, keep serving
                    log.exception("engine turn failed")
                    self._fail_all("internal error in the engine loop")
                self._publish()
        finally:
            self._stopped.set()
            self._fail_all("the server is shutting down", include_queued=True)
            if self._update is not None:
                self._update.done(RuntimeError("the server is shutting down; the weights were not updated"))
                self._update = None
            self._publish()

    def _await_call(self) -> bool:
        """Wait for the call in flight when the next one must follow it (InFlight.next_after): the next turn then
        admits what arrived meanwhile and dispatches the next call at once, and reads this one's tokens while
        the device computes it. True (the loop goes on)."""
        call = self._inflight
        if call is not None and call.next_after and call.done is None:
            try:
                call.result.result()
            except Exception:  # noqa: BLE001 -- raised again where the call is read, which fails what it must
                log.debug("the decode call in flight failed; its reader reports it")
            call.done = time.perf_counter()
        return True

    def _busy(self) -> bool:
        return not self._engine_empty() or bool(self._waiting or self._update)

    def _engine_empty(self) -> bool:
        """No sequence in the engine and no call in flight: weights can swap."""
        return not (self._owner or self._prefilling or self._inflight or self._firsts)

    def _take_commands(self) -> bool:
        """Apply every waiting command; block for one when there is nothing else to do. False: stop."""
        block = not self._busy()
        while True:
            try:
                kind, stream = self._commands.get(block=block)  # idle: wait for one; busy: look and go on
            except queue.Empty:
                return True
            if kind == _STOP:
                return False
            if kind == _SUBMIT:
                self._waiting.append(stream)
            elif kind == _UPDATE:
                self._start_update(stream)
            else:
                self._cancel(stream)
            block = False

    def _start_update(self, update: WeightUpdate) -> None:
        if self._update is not None:
            update.done(RuntimeError("another weight update is in progress"))
            return
        self._update, self._aborted = update, 0
        if update.abort:
            self._aborted = len(self._running)
            # the call in flight is left to finish on the device: its outputs are nobody's now
            self._fail_all(f"aborted: the server is swapping in weights {update.version!r}", code="ABORTED")

    def _swap_weights(self) -> None:
        update, self._update = self._update, None
        assert update is not None
        try:
            self.engine.swap_weights(update.weights, update.version)
        except Exception as exc:
            log.exception("weight swap failed")
            update.done(exc)
            return
        update.done(self._aborted)

    def _turn(self) -> None:
        if self._update is not None and self._engine_empty():  # between two calls, with nothing in the engine
            self._swap_weights()
        self._admit()  # first: a request that finds a free slot now is served, however long it waited
        self._waiting.drop_expired()
        self._advance_prefills()
        self._publish()  # the slots just taken: readers see them during the decode read that follows
        previous, self._inflight = self._inflight, None
        if self._constrained_slots():  # their next masks need the tokens before: no call stays in flight
            if previous is not None:
                self._read_decode(previous)
                previous = None
            self._read_first_tokens()
            for slot, constraint in self._constrained_slots():
                self.engine.constrain(slot, constraint.mask())
        if wants_tokens(self._owner, self._firsts, previous, self._ended(previous)):
            self._dispatch_decode()
        if previous is not None:
            self._read_decode(previous)
        self._read_first_tokens()
        self._flush_outboxes()  # first tokens go out before a call dispatched behind their insert is read
        if self._inflight is not None and not self.policy.keep_in_flight(len(self._free), self._call_s):
            self._inflight.next_after = True

    def _ended(self, call: InFlight | None) -> list[int]:
        """The slots whose sample the device ended in `call`, when it is done but not read yet (its tokens are
        read after the next call is dispatched): no call is dispatched for them."""
        if call is None or call.done is None:
            return []
        try:
            done = call.result.result().done  # on the host already: waited for in _await_call
        except Exception:  # noqa: BLE001 -- raised again where the call is read
            return []
        return [
            int(s)
            for s in np.flatnonzero(done.any(axis=0))
            if call.owners.get(int(s)) == self._owner.get(int(s))
        ]

    def _constrained_slots(self) -> list[tuple[int, Constraint]]:
        """(slot, grammar) of every sample in a slot that decodes under a grammar."""
        return [
            (slot, run.constraints[index])
            for slot, (run, index) in self._owner.items()
            if index in run.constraints and not run.trackers[index].finished
        ]

    def _publish(self) -> None:
        used = sum(
            len(run.stream.job.prompt_ids) + run.trackers[i].generated for run, i in self._owner.values()
        )
        self.stats = Stats(len(self._free), used)

    # ---- commands and the waiting deque ---------------------------------------------------------------

    def _cancel(self, stream: RequestStream) -> None:
        run = self._running.get(id(stream))
        if run is None:
            self._waiting.cancel(stream)  # if it still waits, it leaves at the next pass
            return
        run.close_prefill()  # cancelled mid-prefill: the engine lets go now, not at garbage collection
        for index, tracker in enumerate(run.trackers):
            if not tracker.finished:  # in a slot, or a max_tokens = 0 request still prefilling (no slot)
                run.outbox.append(tracker.end(Finish.CANCELLED))
            self._release(run, index)
        self._close_if_done(run)

    def _admit(self) -> None:
        """Waiting requests take their slots (Policy.admits) and start their prefill."""
        while self._update is None and (stream := self._waiting.head()) is not None:
            if not self.policy.admits(stream.job, len(self._free), self.engine):
                return
            self._start(self._waiting.pop())

    # ---- the engine thread: engine calls --------------------------------------------------------------

    def _start(self, stream: RequestStream) -> None:
        job = stream.job
        stream.weight_version = self.engine.weight_version  # no swap until it has ended
        trackers = [SampleTracker(job, i, self._token_bytes, self._special) for i in range(job.n)]
        run = Running(stream, trackers, admitted=time.monotonic())
        self._running[id(stream)] = run
        for index in range(job.n if job.max_tokens > 0 else 0):
            run.slots[index] = heapq.heappop(self._free)
        try:
            if job.grammar is not None and job.max_tokens > 0:
                assert self.grammars is not None  # the servicer refuses a grammar without them
                run.constraints = {index: self.grammars.constraint(job.grammar) for index in run.slots}
            run.prefill = self.engine.prefill_steps(
                list(job.prompt_ids), job.prompt_logprobs, cache_salt=job.cache_salt
            )
        except Exception as exc:
            log.exception("prefill failed for request %s", job.request_id)
            self._fail(run, f"engine error: {exc}", _code(exc))
            return
        self._prefilling.append(run)

    def _advance_prefills(self) -> None:
        """Queue prefill steps, as many as the turn's budget (Policy.turn_budget) takes."""
        budget = self.policy.turn_budget(decoding=bool(self._owner))
        self._prefilling = collections.deque(
            self.policy.prefill_order(self._prefilling, self.engine.prefill_chunk)
        )
        while self._prefilling and (budget is None or budget > 0):
            run = self._prefilling[0]
            if not self._live(run):
                self._prefilling.popleft()
                run.close_prefill()
                continue
            group, cost = self.policy.short_prompts(self._prefilling, budget, self.engine, self._live)
            if len(group) > 1:
                if budget is not None:
                    budget -= cost
                self._prefill_together(group)
                continue
            try:
                run.stepped = True
                prefix = next(run.prefill)
            except Exception as exc:
                log.exception("prefill failed for request %s", run.stream.job.request_id)
                self._prefilling.popleft()
                self._fail(run, f"engine error: {exc}", _code(exc))
                continue
            if budget is not None:
                budget -= self.engine.prefill_cost(len(run.stream.job.prompt_ids))
            if prefix is not None:
                self._prefilling.popleft()
                self._insert(run, prefix)
                run.close_prefill()  # after the inserts: the prefix's blocks are in the slots now

    def _live(self, run: Running) -> bool:
        """Not cancelled or failed since it was admitted."""
        return self._running.get(id(run.stream)) is run

    def _prefill_together(self, group: list[Running]) -> None:
        for _ in group:
            self._prefilling.popleft()
        try:
            jobs = [r.stream.job for r in group]
            salts = [j.cache_salt for j in jobs]
            prefixes = self.engine.prefill_together([list(j.prompt_ids) for j in jobs], salts)
        except Exception as exc:
            log.exception("prefill failed for requests %s", [r.stream.job.request_id for r in group])
            for run in group:
                self._fail(run, f"engine error: {exc}", _code(exc))
            return
        for run, prefix in zip(group, prefixes, strict=True):
            self._insert(run, prefix)
            run.close_prefill()  # never started: nothing to let go, but the iterator is done with

    def _insert(self, run: Running, prefix: object) -> None:
        job = run.stream.job
        try:
            cached = int(self.engine.cached_tokens(prefix))
            for tracker in run.trackers:
                tracker.cached_tokens = cached
            if job.prompt_logprobs:
                run.outbox.append(PromptEvent(self.engine.prompt_logprobs(prefix), cached))
            if job.max_tokens == 0:
                run.outbox.extend(t.end(Finish.LENGTH) for t in run.trackers)
            for index, params in enumerate(job.samples if job.max_tokens > 0 else ()):
                slot = run.slots[index]
                self._owner[slot] = (run, index)
                constraint = run.constraints.get(index)
                allowed = None if constraint is None else constraint.mask()
                self._firsts.append((run, index, self.engine.start_insert(prefix, slot, params, allowed)))
        except Exception as exc:
            log.exception("insert failed for request %s", job.request_id)
            self._fail(run, f"engine error: {exc}", _code(exc))
            return
        self._close_if_done(run)

    def _dispatch_decode(self) -> None:
        dispatched = time.perf_counter()
        try:
            steps = self.engine.next_call_steps()
            cap = self.policy.call_steps(len(self._free), self._step_s)
            if cap is not None:
                steps = min(steps, cap)
            result = self.engine.start_decode(steps)
        except Exception as exc:
            log.exception("engine.start_decode failed")
            self._fail_all(f"engine error: {exc}", code=_code(exc))
            return
        self._inflight = InFlight(result, dict(self._owner), dispatched, steps)

    def _read_decode(self, call: InFlight) -> None:
        try:
            steps = call.result.result()
        except Exception as exc:
            log.exception("engine decode call failed")
            self._fail_all(f"engine error: {exc}", code=_code(exc))
            return
        now = call.done or time.perf_counter()
        # the call ran from its dispatch or from the end of the one before
        self._call_s = now - max(call.dispatched, self._last_read)
        self._step_s = self._call_s / max(call.steps, 1)
        if self.on_decode is not None:
            self.on_decode(self._call_s)
        self._last_read = now
        for step in range(steps.valid.shape[0]):
            for slot in steps.valid[step].nonzero()[0].tolist():
                owner = call.owners.get(slot)
                if owner is not None and owner[0].slots.get(owner[1]) == slot:  # still that sample's slot
                    self._on_token(owner[0], owner[1], steps.token(step, slot))

    def _read_first_tokens(self) -> None:
        firsts, self._firsts = self._firsts, []
        for run, index, pending in firsts:
            if run.slots.get(index) is None:
                continue  # cancelled or failed meanwhile
            try:
                token = pending.result()
            except Exception as exc:
                log.exception("insert failed for request %s", run.stream.job.request_id)
                self._fail(run, f"engine error: {exc}", _code(exc))
                continue
            self._on_token(run, index, token)

    def _on_token(self, run: Running, index: int, token: TokenOut) -> None:
        constraint = run.constraints.get(index)
        if constraint is not None and not run.trackers[index].finished:
            try:
                constraint.consume(token.token_id)
            except GuidedError as exc:
                log.error("request %s sample %d: %s", run.stream.job.request_id, index, exc)
                run.outbox.append(run.trackers[index].end(Finish.ERROR, f"structured output: {exc}"))
                self._release(run, index)
                self._close_if_done(run)
                return
        event = run.trackers[index].add(token)
        if event is not None:
            if index not in run.timed and event.tokens:
                run.timed.add(index)
                event.timing = jobs.FirstTokenTiming(run.stream.submitted, run.admitted, time.monotonic())
            run.outbox.append(event)
        if run.trackers[index].finished:
            self._release(run, index)
            self._close_if_done(run)

    def _release(self, run: Running, index: int) -> None:
        slot = run.slots.pop(index, None)
        if slot is None:
            return
        self._owner.pop(slot, None)
        try:
            self.engine.release(slot)
        except Exception:
            log.exception("engine.release(%d) failed", slot)
        heapq.heappush(self._free, slot)

    def _close_if_done(self, run: Running) -> None:
        if all(t.finished for t in run.trackers) and self._running.pop(id(run.stream), None) is not None:
            self._closed.append(run)

    def _flush_outboxes(self) -> None:
        self._publish()  # before any client hears of what this turn did
        for run in [*self._running.values(), *self._closed]:
            if run.outbox:
                run.stream.deliver(jobs.merge_events(run.outbox))
                run.outbox = []
        self._closed.clear()

    def _fail(self, run: Running, message: str, code: str = "INTERNAL") -> None:
        run.close_prefill()
        for index in list(run.slots):
            self._release(run, index)
        for tracker in run.trackers:
            tracker.finished = True
        run.outbox.append(ErrorEvent(message, code))
        self._close_if_done(run)

    def _fail_all(self, message: str, include_queued: bool = False, code: str = "INTERNAL") -> None:
        self._inflight = None
        for run in self._prefilling:  # failed ones are closed by _fail too; cancelled ones already were
            run.close_prefill()
        self._prefilling.clear()
        self._firsts = []
        for run in list(self._running.values()):
            self._fail(run, message, code)
        if include_queued:
            self._waiting.fail_all(message)
        self._flush_outboxes()


def _code(exc: BaseException) -> str:
    """The gRPC status a request failed by `exc` ends with."""
    return "UNAVAILABLE" if isinstance(exc, EngineUnavailable) else "INTERNAL"
