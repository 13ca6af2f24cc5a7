"""The engine interface that the service layer drives. Pure Python + numpy: no JAX here, so a fake engine
with hand-computable outputs can stand in for the real one in service tests (JetStream's pattern)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

MAX_TOP_LOGPROBS = 20  # K: the server-wide logprob width computed on the device

T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    """The engine cannot run any more calls (a process of its group failed): requests end with UNAVAILABLE, not
    INTERNAL, and the process is about to exit."""


class Pending(Generic[T]):
    """A result the device may still be computing (JAX dispatch is asynchronous): `result()` waits for it and
    copies it to the host, once. The engine thread dispatches the next call before it reads this one."""

    def __init__(self, wait: Callable[[], T]) -> None:
        self._wait: Callable[[], T] | None = wait
        self._value: T | None = None

    @classmethod
    def ready(cls, value: T) -> Pending[T]:
        done = cls(lambda: value)
        done.result()
        return done

    def result(self) -> T:
        if self._wait is not None:
            self._value, self._wait = self._wait(), None
        return self._value  # type: ignore[return-value]


@dataclass(frozen=True)
class SlotParams:
    """Per-sample sampling and stopping parameters; traced as arrays on the device, never static."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


@dataclass
class TokenOut:
    """One sampled token on the host: `top_ids`/`top_logprobs` are [K], sorted by logprob descending."""

    token_id: int
    logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    done: bool


@dataclass
class StepArrays:
    """Host copy of one `decode` call: N fused steps over B slots.

    ids, logprobs: [N, B]; top_ids, top_logprobs: [N, B, K]; valid: [N, B] (a real token for that slot at that
    step); done: [N, B] (the slot finished on this token: a stop id or max_tokens reached).
    """

    ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    valid: np.ndarray
    done: np.ndarray

    def token(self, step: int, slot: int) -> TokenOut:
        return TokenOut(
            token_id=int(self.ids[step, slot]),
            logprob=float(self.logprobs[step, slot]),
            top_ids=self.top_ids[step, slot],
            top_logprobs=self.top_logprobs[step, slot],
            done=bool(self.done[step, slot]),
        )


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens 1..L-1, each given its prefix (token 0 has none).

    logprobs: [L-1]; top_ids, top_logprobs: [L-1, K], each row sorted by logprob descending; entry j belongs to
    prompt token j+1.
    """

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's counters since start (cumulative) and its size now; hit rate = hit / lookup tokens."""

    lookup_tokens: int = 0  # prompt tokens looked up (every prompt of an engine with the cache on)
    hit_tokens: int = 0  # of those, tokens whose KV came from the cache
    cached_bytes: int = 0  # device bytes held by cached blocks now
    capacity_bytes: int = 0  # the configured budget (prefix_cache_bytes)
    evictions: int = 0  # blocks evicted (least recently used) to make room


@dataclass(frozen=True)
class PageStats:
    """The KV pool's pages now (and preemptions since start): `free` counts pages an allocation can take (free ones
    and cached ones nobody holds); `shared`, pages held more than once (a prefix read by several sequences)."""

    page_tokens: int = 0  # positions per page
    total: int = 0
    used: int = 0  # held by a prefill, a prefix or a slot
    shared: int = 0
    cached: int = 0  # named by the prefix cache (held or not)
    free: int = 0
    preemptions: int = 0  # sequences moved to host memory to make room (they resume where they stopped)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do and what it holds, declared by the engine: the service reads this and never probes
    the engine's attributes. The defaults describe an engine of none of these (a test double)."""

    structured_outputs: bool = False  # takes token masks (`constrain`, insert's `allowed`)
    dtype: str = ""  # the KV cache's dtype
    mesh: tuple[tuple[str, int], ...] = ()  # (axis name, size) of the device mesh; () on one device
    weight_bytes: int = 0  # device bytes of the weights as the programs hold them
    kv_cache_bytes: int = 0  # device bytes of the KV pool
    quantization: str = ""  # how the weights are held (model.quant), "" when not said


class Engine(abc.ABC):
    """prefill -> insert (per sample) -> decode (N steps, all slots) -> release.

    One thread drives an engine. `start_insert` / `start_decode` dispatch without waiting, so that thread can
    queue the next device call before it reads this one back; an engine without asynchronous dispatch (the fake
    engine of the service tests) inherits versions that compute at once."""

    slots: int
    max_seq_len: int
    steps_per_call: int  # the most steps one decode call makes
    vocab_size: int
    top_k_width: int = MAX_TOP_LOGPROBS
    prefill_chunk: int  # prompt tokens one prefill step computes at most
    num_processes: int = 1  # JAX processes the engine's programs span (sampler/multihost.py)
    capabilities: Capabilities = Capabilities()

    @property
    def mask_words(self) -> int:
        """int32 words of one token bitmask (structured outputs)."""
        return -(-self.vocab_size // 32)

    @abc.abstractmethod
    def prefill(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> Any:
        """Run the prompt once; the returned prefix can be inserted into several slots (n samples).

        With a prefix cache, cached blocks of the prompt are reused; `cache_salt` names the namespace (prompts
        with different salts never share blocks; None = the default namespace)."""

    def prefill_steps(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> Generator[Any, None, None]:
        """`prefill` one chunk per `next()`: None until the last step yields the prefix. The engine thread puts
        decode calls between the chunks of a long prompt, so running streams never wait for a whole prompt.
        Closing the iterator early (a cancelled request) lets go of what it holds."""
        yield self.prefill(tokens, want_prompt_logprobs, cache_salt)

    def prefill_together(
        self, prompts: list[list[int]], cache_salts: list[str | None] | None = None
    ) -> list[Any]:
        """The prefixes of several prompts, each shorter than `prefill_chunk` (so none holds a full prefix-cache
        block) and without prompt logprobs: the same as `prefill` of each, computed together where the engine
        can (short prompts fill few of a product's rows, so one program over several costs less than one each).
        Default: one by one."""
        salts = cache_salts or [None] * len(prompts)
        return [self.prefill(tokens, cache_salt=salt) for tokens, salt in zip(prompts, salts, strict=True)]

    def cached_tokens(self, prefix: Any) -> int:
        """Prompt tokens of this prefix whose KV came from the prefix cache (OpenAI's usage `cached_tokens`)."""
        return 0

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """None when the engine has no prefix cache (or it is off). Read from any thread (a snapshot)."""
        return None

    def page_stats(self) -> PageStats | None:
        """None when the engine does not page its KV cache. Read from any thread (a snapshot)."""
        return None

    def awaits_prefill(
        self, tokens: Sequence[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> bool:
        """Whether this prompt would find more of itself in the prefix cache by waiting for a prefill in progress
        (the scheduler then starts it after that prefill, not beside it)."""
        return False

    def admits(self, prompt_len: int, samples: int) -> bool:
        """Whether a request of `samples` samples and a prompt within `max_prompt_len` may start its prefill now
        (`prefill_steps` takes the prompt's KV room when called): the room must be there, and sequences moved out
        to make room come back first."""
        return True

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt the engine can hold (its context, or its whole pool if smaller)."""
        return self.max_seq_len

    def next_call_steps(self) -> int:
        """Steps the next decode call will make (its output's N): steps_per_call unless the engine varies it
        with the load."""
        return self.steps_per_call

    def prefill_cost(self, prompt_len: int) -> int:
        """Prompt positions one prefill step computes for a prompt of this length (its padded chunk)."""
        return min(prompt_len, self.prefill_chunk)

    @abc.abstractmethod
    def prompt_logprobs(self, prefix: Any) -> PromptLogprobs | None:
        """Prompt logprobs of a prefix made with want_prompt_logprobs=True, else None."""

    @abc.abstractmethod
    def insert(
        self, prefix: Any, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> TokenOut:
        """Put a prefix into a free slot and sample its first token with the slot's parameters; `allowed`
        (structured outputs): the token bitmask the first token must pass (see `constrain`)."""

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        """Structured outputs: the occupied slot's next token must pass `allowed`, a token bitmask of
        `mask_words` int32 words (token t = bit t % 32 of word t // 32, llguidance's layout); None lifts it.
        While any occupied slot is constrained a decode call makes one step (the host computes the next mask
        from the token it made). Released slots are free again."""
        raise NotImplementedError(f"{type(self).__name__} has no structured outputs")

    @abc.abstractmethod
    def decode(self) -> StepArrays:
        """N fused decode steps for every active slot."""

    @abc.abstractmethod
    def release(self, slot: int) -> None:
        """Free a slot (finished or cancelled); it takes no part in the next decode call."""

    def start_insert(
        self, prefix: Any, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> Pending[TokenOut]:
        return Pending.ready(self.insert(prefix, slot, params, allowed))

    def start_decode(self, max_steps: int | None = None) -> Pending[StepArrays]:
        """Dispatch the next decode call: `next_call_steps()` steps, or fewer when `max_steps` (at least 1) says
        so (the service shortens calls while a request could arrive). Outputs of a slot released meanwhile are to
        be ignored."""
        return Pending.ready(self.decode())

    # -- weights (docs/weight-updates.md) ---------------------------------------------------------------------
    weight_version: str = "default"  # the version of the weights being served; swap_weights sets it

    def load_weights(self, path: str) -> Any:
        """New weights from a file or directory, loaded as start-up loaded the served ones (dtype, quantization,
        placement) beside them and checked against them: -> an opaque set for `swap_weights`. Runs on any thread
        (it reads nothing the engine thread changes). A source that cannot replace the served weights raises
        ValueError (tpuserve.model.config.ModelLoadError) naming the first mismatch."""
        raise NotImplementedError(f"{type(self).__name__} cannot update its weights")

    def weights_from_arrays(self, params: dict[str, Any]) -> Any:
        """As `load_weights`, from a trainer's arrays in the canonical layout (`tpuserve.model.llama.param_shapes`
        names and shapes, any placement): placed on the engine's devices as the served weights are."""
        raise NotImplementedError(f"{type(self).__name__} cannot update its weights")

    def swap_weights(self, weights: Any, version: str) -> None:
        """Serve `weights` (from load_weights / weights_from_arrays) from the next call on, as `version`. On the
        engine thread, with no sequence in the engine (the service drains or aborts them first): the prefix
        cache's pages are forgotten (they hold the old weights' keys and values)."""
        raise NotImplementedError(f"{type(self).__name__} cannot update its weights")

    def set_fault_handler(self, on_fault: Callable[[str], None]) -> None:
        """`on_fault(message)` runs (on any thread) when the engine can run no more calls: a process of its group
        failed. An engine of one process never calls it."""

    def stop_group(self) -> None:
        """After the server's drain: the other processes of the engine's group stop. None for one process."""
