"""JaxEngine: the real engine behind `sampler.api.Engine` — continuous batching over B slots with static shapes.

Decode runs on the smallest batch bucket (power of two, at least 2 rows) that covers the occupied slots, and
attends over the smallest length bucket that covers the longest sequence, so its cost follows the live load. A
request's tokens and logprobs do not depend on the bucket (see model/llama.py on the [out, in] weight layout).
Calls are dispatched without waiting (`start_generate`, `start_insert`): host copies of their small outputs
start at once and are read when the caller asks, so host work overlaps the next device call.

Driven by one thread (the orchestrator's engine thread, which also runs `warm_up`); nothing here is shared.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tpuserve.model.llama import cache_bytes
from tpuserve.model.loader import LoadedModel
from tpuserve.model.sharding import cache_sharding
from tpuserve.sampler.api import (
    MAX_TOP_LOGPROBS,
    Engine,
    Pending,
    PromptLogprobs,
    SlotParams,
    StepArrays,
    TokenOut,
)
from tpuserve.sampler.programs import ProgramConfig, build_programs
from tpuserve.sampler.state import init_decode_state, slot_sampling

log = logging.getLogger(__name__)

MIN_BATCH_BUCKET = 2  # one row takes another kernel (a matrix-vector product) that rounds differently


def power_of_two_buckets(smallest: int, largest: int) -> list[int]:
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= 2
    return out + [largest]


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class Prefix:
    cache: object  # KVCache [L, 1, Hkv, Lp, D] on the device
    last_logits: jax.Array  # [V]
    prompt_len: int
    prompt: tuple | None  # device arrays (logprobs [Lp-1], top_ids [Lp-1, K], top_logprobs [Lp-1, K])


def _host_copy(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        leaf.copy_to_host_async()


class JaxEngine(Engine):
    def __init__(
        self,
        loaded: LoadedModel,
        slots: int = 8,
        max_seq_len: int = 512,
        steps_per_call: int = 8,
        min_steps_per_call: int = 1,
        min_prefill_bucket: int = 32,
        prefill_chunk: int = 512,
        min_attend_bucket: int = 128,
        min_batch_bucket: int | None = 8,
        processed_logprobs: bool = False,
        cache_dtype: str | None = None,
        scan_layers: bool = True,
        mesh=None,
    ):
        self.config = loaded.config
        self.slots = slots
        self.max_seq_len = max_seq_len
        self.steps_per_call = steps_per_call
        self.vocab_size = loaded.config.vocab_size
        self.top_k_width = MAX_TOP_LOGPROBS
        self.processed_logprobs = processed_logprobs
        self.prefill_buckets = power_of_two_buckets(min(min_prefill_bucket, max_seq_len), max_seq_len)
        self.prefill_chunk = min(prefill_chunk, max_seq_len)
        self.attend_buckets = power_of_two_buckets(min(min_attend_bucket, max_seq_len), max_seq_len)
        # None: always all slots. Buckets never go below 2 rows (a 1-row product rounds differently).
        smallest = max(min_batch_bucket or slots, MIN_BATCH_BUCKET)
        self.batch_buckets = power_of_two_buckets(min(smallest, slots), slots)
        # N per batch bucket: steps_per_call on the smallest, fewer on larger ones (rows x steps no more than the
        # smallest bucket's, but at least min_steps_per_call), so a call lasts about as long whatever the load
        # and a request that arrives waits for about one such call, not for N steps of 64 rows.
        floor = min(min_steps_per_call, steps_per_call)
        work = steps_per_call * self.batch_buckets[0]
        self.call_steps = {b: max(floor, work // b) for b in self.batch_buckets}
        module = loaded.module(scan_layers=scan_layers, mesh=mesh)
        self.graphdef, self.params = nnx.split(module)  # split once; programs merge inside jit
        dtype = jnp.dtype(cache_dtype) if cache_dtype else module.embed.value.dtype
        self.cache_dtype = dtype
        self.kv_cache_bytes = cache_bytes(loaded.config, slots, max_seq_len, dtype)
        self.mesh = mesh
        self.state = self._place(init_decode_state(loaded.config, slots, max_seq_len, dtype))
        cfg = ProgramConfig(K=MAX_TOP_LOGPROBS, chunk=prefill_chunk,
                            max_seq_len=max_seq_len, processed_logprobs=processed_logprobs)  # fmt: skip
        self.programs = build_programs(self.graphdef, cfg)
        # Host bookkeeping, never read back from the device: which slots hold a sample, and an upper bound of
        # each one's length (what the dispatched calls can have written), for the batch and attention buckets.
        self._occupied = np.zeros(slots, bool)
        self._length_bound = np.zeros(slots, np.int64)
        log.info("KV cache: %d slots x %d positions, %s, %.1f MiB", slots, max_seq_len, dtype.name,
                 self.kv_cache_bytes / 2**20)  # fmt: skip

    def _place(self, state):
        if self.mesh is None:
            return state
        replicated = NamedSharding(self.mesh, PartitionSpec())  # the small per-slot arrays
        kv = cache_sharding(self.config, self.mesh, self.slots, self.max_seq_len)
        shardings = jax.tree.map(lambda _: replicated, state)
        shardings = shardings.replace(cache=type(state.cache)(kv, kv))
        return jax.device_put(state, shardings)

    # -- Engine API ---------------------------------------------------------------------------------------------
    def prefill_steps(self, tokens: list[int], want_prompt_logprobs: bool = False) -> Iterator[Prefix | None]:
        """Dispatch the prompt chunk by chunk: each `next()` queues one chunk (None) until the last yields the
        Prefix. A prompt within one chunk is one program."""
        n = len(tokens)
        if not 0 < n <= self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens: must be 1..{self.max_seq_len}")
        bucket = bucket_for(n, self.prefill_buckets)
        padded = np.zeros(bucket, np.int32)
        padded[:n] = tokens
        p = self.programs
        if bucket <= self.prefill_chunk:
            cache, last_logits, prompt = p.prefill(self.params, padded, np.int32(n), bucket=bucket,
                                                   want_prompt_logprobs=want_prompt_logprobs)  # fmt: skip
        else:
            cache, hidden = None, []
            for start in range(0, bucket, self.prefill_chunk):
                chunk = padded[start : start + self.prefill_chunk]
                cache, h = p.prefill_chunk(self.params, cache, chunk, start=start, bucket=bucket)
                hidden.append(h)
                if start + self.prefill_chunk < bucket:
                    yield None
            last_logits, prompt = p.prefill_finish(self.params, jnp.concatenate(hidden), padded, np.int32(n),
                                                   want_prompt_logprobs=want_prompt_logprobs)  # fmt: skip
        if prompt is not None:
            _host_copy(prompt)
        yield Prefix(cache, last_logits, n, prompt)

    def prefill(self, tokens: list[int], want_prompt_logprobs: bool = False) -> Prefix:
        *_, prefix = self.prefill_steps(tokens, want_prompt_logprobs)
        return prefix

    def prefill_cost(self, prompt_len: int) -> int:
        return min(bucket_for(prompt_len, self.prefill_buckets), self.prefill_chunk)

    def prompt_logprobs(self, prefix: Prefix) -> PromptLogprobs | None:
        if prefix.prompt is None:
            return None
        chosen, top_ids, top_vals = (np.asarray(a) for a in prefix.prompt)
        n = prefix.prompt_len - 1
        return PromptLogprobs(chosen[:n], top_ids[:n], top_vals[:n])

    def start_insert(self, prefix: Prefix, slot: int, params: SlotParams) -> Pending[TokenOut]:
        one = slot_sampling(params)  # ValueError for a bad seed or too many stop ids, before anything runs
        self.state, (out, done) = self.programs.insert(
            self.state, prefix.cache, prefix.last_logits, np.int32(slot), np.int32(prefix.prompt_len), one
        )
        _host_copy((out, done))
        self._occupied[slot] = True
        self._length_bound[slot] = prefix.prompt_len

        def read() -> TokenOut:
            token_id, lp, top_ids, top_vals = (np.asarray(a) for a in out)
            return TokenOut(int(token_id), float(lp), top_ids, top_vals, bool(done))

        return Pending(read)

    def insert(self, prefix: Prefix, slot: int, params: SlotParams) -> TokenOut:
        return self.start_insert(prefix, slot, params).result()

    def buckets(self) -> tuple[int, int, int]:
        """(attend_len, batch, steps) of the next decode call: they cover every occupied slot for its steps."""
        live = np.flatnonzero(self._occupied)
        longest = int(self._length_bound[live].max()) if live.size else 0
        batch = bucket_for(int(live.max()) + 1 if live.size else 1, self.batch_buckets)
        steps = self.call_steps[batch]
        attend = bucket_for(min(longest + steps, self.max_seq_len), self.attend_buckets)
        return attend, batch, steps

    def next_call_steps(self) -> int:
        return self.buckets()[2]

    def start_generate(self) -> Pending[StepArrays]:
        attend, batch, steps = self.buckets()
        self.state, (out, valid, done) = self.programs.decode(
            self.params, self.state, attend_len=attend, batch=batch, steps=steps
        )
        _host_copy((out, valid, done))
        self._length_bound[self._occupied] += steps

        def read() -> StepArrays:
            ids, lps, top_ids, top_vals = (self._pad(np.asarray(a)) for a in out)
            return StepArrays(
                ids, lps, top_ids, top_vals, self._pad(np.asarray(valid)), self._pad(np.asarray(done))
            )

        return Pending(read)

    def generate(self) -> StepArrays:
        return self.start_generate().result()

    def _pad(self, a: np.ndarray) -> np.ndarray:
        """[N, batch, ...] -> [N, slots, ...]: slots past the batch bucket were not run (valid/done False)."""
        if a.shape[1] == self.slots:
            return a
        out = np.zeros((a.shape[0], self.slots) + a.shape[2:], a.dtype)
        out[:, : a.shape[1]] = a
        return out

    @property
    def occupied_slots(self) -> list[int]:
        """Slots holding a sample (inserted, not yet released)."""
        return np.flatnonzero(self._occupied).tolist()

    def release(self, slot: int) -> None:
        self.state = self.programs.release(self.state, np.int32(slot))
        self._occupied[slot] = False
        self._length_bound[slot] = 0

    # -- start-up -----------------------------------------------------------------------------------------------
    def warm_up_stages(self, prompt_logprobs: bool = True) -> list[tuple[str, Callable[[], None]]]:
        """What warm-up runs, stage by stage: prefill + insert per prompt bucket (with and without prompt
        logprobs), decode per (attended-length, batch) bucket. Each stage compiles its programs (or loads them
        from the compilation cache); prefill and insert also run once, decode programs are only compiled."""
        params = SlotParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=5, seed=0)

        def prefill(bucket: int) -> None:
            for want in (False, True) if prompt_logprobs else (False,):
                prefix = self.prefill([1] * bucket, want_prompt_logprobs=want)
            self.insert(prefix, 0, params)
            self.release(0)

        def decode(attend: int, batch: int) -> None:
            # compiled (or loaded from the cache), not run: a 64-row decode over 512 positions runs for seconds,
            # and the call later finds this executable (the same arguments' shapes and placement)
            steps = self.call_steps[batch]
            self.programs.decode.lower(
                self.params, self.state, attend_len=attend, batch=batch, steps=steps
            ).compile()

        stages = [(f"prefill bucket {b}", functools.partial(prefill, b)) for b in self.prefill_buckets]
        stages += [(f"decode {a} positions x {b} rows x {self.call_steps[b]} steps", functools.partial(decode, a, b))
                   for a in self.attend_buckets for b in self.batch_buckets]  # fmt: skip
        return stages

    def warm_up(
        self, prompt_logprobs: bool = True, progress: Callable[[int, int, str, float], None] | None = None
    ) -> None:
        """Compile every program the serving loop can call (`warm_up_stages`); leaves all slots free.
        `progress(k, n, stage, seconds)` is called after each stage."""
        stages = self.warm_up_stages(prompt_logprobs)
        for k, (name, run) in enumerate(stages, start=1):
            start = time.perf_counter()
            run()
            if progress is not None:
                progress(k, len(stages), name, time.perf_counter() - start)
        self._occupied[:] = False
        self._length_bound[:] = 0
