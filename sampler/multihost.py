"""One model across several JAX processes (the hosts of a TPU slice), JAX's multi-controller model: every process
runs the same jitted programs in the same order, each on its own devices, and the programs' collectives join
them into one computation over the global mesh.

Process 0, the leader, serves (gRPC, orchestrator, health, metrics) through a `LeaderEngine`; the others
`follow`. Each engine call that dispatches device work (a prefill chunk, an insert, a decode call, a release, a
token mask) is first sent to every process as a command, then run locally; a follower runs the commands it
receives, in order, on its own `JaxEngine`. The outputs are read on the leader (they are replicated over the
mesh, so each process holds a whole copy).

The group itself (joining it, the channel that carries the commands, faults): process_group.py.
"""

from __future__ import annotations

import collections
import logging
import pickle
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np
from tpuserve.sampler.api import (
    Engine,
    EngineUnavailable,
    PageStats,
    Pending,
    PrefixCacheStats,
    PromptLogprobs,
    SlotParams,
    StepArrays,
    TokenOut,
)
from tpuserve.sampler.process_group import Channel

log = logging.getLogger(__name__)


# The engine commands, one place for the leader and the followers. Every public method of an engine either
# changes its state (the device's, or the host's bookkeeping that shapes later calls) and is replicated, or only
# reads it and runs on the leader alone; tests/sampler/test_multihost_commands.py checks that each is listed.
#
# REPLICATED: engine method -> the command the leader sends before it runs the method itself; every follower runs
# that command on its own engine (`_Follower`). COMPOSED: methods made of replicated ones only (each inner call
# sends its command). LEADER_ONLY: reads, and the leader's own hooks.
REPLICATED: dict[str, str] = {
    "prefill_steps": "prefill",  # then "next" per step, and "close" when closed before the prefix
    "start_insert": "insert",
    "constrain": "constrain",
    "start_decode": "decode",
    "release": "release",
    "warm_up": "ready",  # each process runs its own warm-up, then this one exchange
    "stop_group": "stop",
    "load_weights": "load_weights",  # each process loads its own shards of the new weights
    "swap_weights": "swap_weights",
}
COMPOSED: dict[str, tuple[str, ...]] = {
    "prefill": ("prefill_steps",),
    "prefill_together": ("prefill",),  # one by one on a group (Engine's default)
    "insert": ("start_insert",),
    "decode": ("start_decode",),
}
LEADER_ONLY = frozenset({
    "prompt_logprobs", "cached_tokens", "prefix_cache_stats", "next_call_steps", "prefill_cost", "mask_words",
    "page_stats", "admits", "awaits_prefill", "max_prompt_len",
    "set_fault_handler",
    # a trainer's arrays are in the leader's process only: LeaderEngine refuses them (update from a path)
    "weights_from_arrays",
    # JaxEngine's own, which the service never calls (tests, bench, warm-up): shapes and host bookkeeping
    "buckets", "chunk_plan", "together_shapes", "occupied_slots",
})  # fmt: skip
# commands that stand for no engine method: a prefill's steps, and the heartbeat
STEP_COMMANDS = ("next", "close", "noop")
COMMANDS = frozenset(REPLICATED.values()) | frozenset(STEP_COMMANDS)


class LeaderEngine(Engine):
    """The leader's engine: each call that changes the engine's state is sent to every process as its command
    (REPLICATED), then run here on `inner` (a JaxEngine over the global mesh); the rest stays local."""

    def __init__(self, inner: Any, channel: Channel) -> None:
        self.inner, self.channel = inner, channel
        for name in ("slots", "max_seq_len", "steps_per_call", "vocab_size", "top_k_width", "prefill_chunk"):
            setattr(self, name, getattr(inner, name))
        self.capabilities = inner.capabilities
        self.num_processes = channel.num_processes
        self._next_handle = 0
        # prefixes the leader let go (appended by their finalizers, on any thread): the followers drop theirs
        self._dropped: collections.deque[int] = collections.deque()

    def _send(self, op: str, *args: Any) -> None:
        assert op in COMMANDS, f"{op!r} is no engine command (multihost.COMMANDS)"
        drops = [self._dropped.popleft() for _ in range(len(self._dropped))]
        self.channel.send(pickle.dumps((drops, op, args)))

    def _call(self, op: str, args: tuple, local: Callable[[], Any]) -> Any:
        with self.channel.lock:
            self._send(op, *args)
            return local()

    def _watched(self, pending: Pending) -> Pending:
        def result():
            try:
                return pending.result()
            except Exception as e:
                self.channel.failed(
                    f"a device call of the group failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                )
                raise EngineUnavailable(self.channel.fault) from e

        return Pending(result)

    def _handle(self, prefix: Any) -> int:
        return prefix.group_handle

    def _keep(self, prefix: Any, handle: int) -> None:
        prefix.group_handle = handle
        weakref.finalize(prefix, self._dropped.append, handle)

    # ---- start-up and shutdown ----
    def warm_up(self, compile: bool = True, **kwargs: Any) -> None:
        """Every process runs the same warm-up (each follower its own, `compile` alike); then one exchange
        (compiles the broadcast, and every process is here), heartbeats and the watchdog."""
        if compile:
            self.inner.warm_up(**kwargs)
        with self.channel.lock:
            self._send(REPLICATED["warm_up"])
        self.channel.start_watching()

    def set_fault_handler(self, on_fault: Callable[[str], None]) -> None:
        self.channel.on_fault = on_fault

    def stop_group(self) -> None:
        """After the drain: the followers leave their loop and exit 0."""
        with self.channel.lock:
            self.channel.stop()
            if self.channel.fault is None:
                self._send(REPLICATED["stop_group"])

    # ---- Engine API ----
    def prefill(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> Any:
        *_, prefix = self.prefill_steps(tokens, want_prompt_logprobs, cache_salt)
        return prefix

    def prefill_steps(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> Generator[Any, None, None]:
        """Called now on every process (the engine takes the prompt's pages when called), stepped together."""
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        steps = self._call(REPLICATED["prefill_steps"], (handle, list(tokens), want_prompt_logprobs, cache_salt),
                           lambda: self.inner.prefill_steps(tokens, want_prompt_logprobs, cache_salt))  # fmt: skip
        out = self._steps(handle, steps)
        next(out)  # started: closing it from now on closes the followers' too
        return out

    def _steps(self, handle: int, steps: Generator[Any, None, None]) -> Generator[Any, None, None]:
        done = False
        try:
            yield None  # the start (`prefill_steps`)
            while not done:
                with self.channel.lock:
                    self._send("next", handle)
                    try:
                        out = next(steps)
                    except StopIteration:
                        done = True
                        return
                    if out is not None:  # the last chunk: closed now, as the followers close theirs
                        done = True
                        steps.close()
                        self._keep(out, handle)
                yield out
        finally:
            if not done:  # closed early (a cancelled request), or an error: the followers close theirs
                with self.channel.lock:
                    if self.channel.fault is None:
                        self._send("close", handle)
                    steps.close()

    def cached_tokens(self, prefix: Any) -> int:
        return self.inner.cached_tokens(prefix)

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.inner.prefix_cache_stats()

    def page_stats(self) -> PageStats | None:
        return self.inner.page_stats()

    def admits(self, prompt_len: int, samples: int) -> bool:
        return self.inner.admits(prompt_len, samples)

    def awaits_prefill(
        self, tokens: Sequence[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> bool:
        return self.inner.awaits_prefill(tokens, want_prompt_logprobs, cache_salt)

    @property
    def max_prompt_len(self) -> int:
        return self.inner.max_prompt_len

    def next_call_steps(self) -> int:
        return self.inner.next_call_steps()

    def prefill_cost(self, prompt_len: int) -> int:
        return self.inner.prefill_cost(prompt_len)

    def prompt_logprobs(self, prefix: Any) -> PromptLogprobs | None:
        return self.inner.prompt_logprobs(prefix)

    def start_insert(
        self, prefix: Any, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> Pending[TokenOut]:
        pending = self._call(REPLICATED["start_insert"], (self._handle(prefix), slot, params, allowed),
                             lambda: self.inner.start_insert(prefix, slot, params, allowed))  # fmt: skip
        return self._watched(pending)

    def insert(
        self, prefix: Any, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> TokenOut:
        return self.start_insert(prefix, slot, params, allowed).result()

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        self._call(REPLICATED["constrain"], (slot, allowed), lambda: self.inner.constrain(slot, allowed))

    def start_decode(self, max_steps: int | None = None) -> Pending[StepArrays]:
        return self._watched(self._call(REPLICATED["start_decode"], (max_steps,),
                                        lambda: self.inner.start_decode(max_steps)))  # fmt: skip

    def decode(self) -> StepArrays:
        return self.start_decode().result()

    def release(self, slot: int) -> None:
        self._call(REPLICATED["release"], (slot,), lambda: self.inner.release(slot))

    # ---- weights ----
    @property
    def weight_version(self) -> str:
        return self.inner.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        # the version at start (--weight-version): the leader answers; the followers' own is never read
        self.inner.weight_version = version

    def load_weights(self, path: str) -> Any:
        """Every process loads `path` (the same file system path on each host), the followers in their command
        loop and the leader here, under the channel's lock: a checkpoint's restore runs collectives of its own
        (Orbax's), which no other command (a decode call, a heartbeat) may interleave with. So the group serves
        nothing while it loads."""
        with self.channel.lock:
            self._next_handle += 1
            handle = self._next_handle
            self._send(REPLICATED["load_weights"], handle, str(path))
            return handle, self.inner.load_weights(path)

    def weights_from_arrays(self, params: dict[str, Any]) -> Any:
        raise NotImplementedError(
            "a multi-process group takes new weights from a path every process reads (load_weights), not from "
            "arrays in the leader's process"
        )

    def swap_weights(self, weights: Any, version: str) -> None:
        handle, inner = weights
        self._call(
            REPLICATED["swap_weights"], (handle, version), lambda: self.inner.swap_weights(inner, version)
        )


class _Stop(Exception):
    """The leader stopped the group."""


class _Follower:
    """A follower's side of every command (COMMANDS), run on its own engine in the leader's order."""

    def __init__(self, engine: Any, channel: Channel) -> None:
        self.engine, self.channel = engine, channel
        self.prefixes: dict[int, Any] = {}
        self.steps: dict[int, Iterator[Any]] = {}
        self.last: Pending | None = None  # the previous decode call, read before the next is queued
        self.loaded: tuple[int, Any] | None = None  # the last weights loaded (handle, weights), until swapped
        self.handlers: dict[str, Callable[..., None]] = {
            "prefill": self.prefill,
            "next": self.next,
            "close": self.close,
            "insert": self.insert,
            "constrain": engine.constrain,
            "decode": self.decode,
            "release": engine.release,
            "ready": lambda: channel.start_watching(),
            "stop": self.stop,
            "noop": lambda: None,
            "load_weights": self.load_weights,
            "swap_weights": self.swap_weights,
        }
        assert set(self.handlers) == COMMANDS

    def prefill(self, handle: int, tokens: list[int], want: bool, salt: str | None) -> None:
        self.steps[handle] = self.engine.prefill_steps(tokens, want, salt)

    def next(self, handle: int) -> None:
        try:
            out = next(self.steps[handle])
        except StopIteration:
            self.steps.pop(handle, None)
            return
        if out is not None:
            self.steps.pop(handle).close()
            self.prefixes[handle] = out

    def close(self, handle: int) -> None:
        it = self.steps.pop(handle, None)
        if it is not None:
            it.close()

    def insert(self, handle: int, slot: int, params: SlotParams, allowed: np.ndarray | None) -> None:
        self.engine.start_insert(self.prefixes[handle], slot, params, allowed)

    def decode(self, max_steps: int | None = None) -> None:
        if self.last is not None:
            self.last.result()
        self.last = self.engine.start_decode(max_steps)

    def load_weights(self, handle: int, path: str) -> None:
        self.loaded = None  # one set beside the served one at most (the leader swaps in its last load)
        self.loaded = (handle, self.engine.load_weights(path))

    def swap_weights(self, handle: int, version: str) -> None:
        if self.loaded is None or self.loaded[0] != handle:
            raise RuntimeError(f"weights {handle} were not loaded here")
        if self.last is not None:  # the decode calls before the swap ran on the old weights
            self.last.result()
            self.last = None
        self.engine.swap_weights(self.loaded[1], version)
        self.loaded = None

    def stop(self) -> None:
        raise _Stop


def follow(engine: Any, channel: Channel) -> int:
    """A follower's loop: run the leader's commands on `engine` (warmed up like the leader's) until "stop";
    -> 0. A fault exits the process (Channel.failed)."""
    follower = _Follower(engine, channel)
    while True:
        drops, op, args = pickle.loads(channel.receive())
        for handle in drops:
            follower.prefixes.pop(handle, None)
        try:
            handler = follower.handlers.get(op)
            if handler is None:
                raise ValueError(f"unknown command {op!r}")
            handler(*args)
        except _Stop:
            return 0
        except Exception as e:  # the leader met the same error (the same code on the same inputs) and went on
            if channel.fault is not None:
                raise
            if op in ("prefill", "next"):
                follower.steps.pop(args[0], None)
            log.info("command %s raised %s: %s (as on the leader)", op, type(e).__name__, e)
