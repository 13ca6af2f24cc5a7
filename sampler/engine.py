"""JaxEngine: the real engine behind `sampler.api.Engine` — continuous batching over B slots with static shapes."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tpuserve.model.llama import cache_bytes
from tpuserve.model.loader import LoadedModel
from tpuserve.model.sharding import cache_sharding
from tpuserve.sampler.api import MAX_TOP_LOGPROBS, Engine, PromptLogprobs, SlotParams, StepArrays, TokenOut
from tpuserve.sampler.programs import ProgramConfig, build_programs
from tpuserve.sampler.state import MAX_STOP_IDS, init_decode_state

log = logging.getLogger(__name__)


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
    cache: object           # KVCache [L, 1, Lp, Hkv, D] on the device
    last_logits: jax.Array  # [V]
    prompt_len: int
    prompt: tuple | None    # device arrays (logprobs [Lp-1], top_ids [Lp-1, K], top_logprobs [Lp-1, K])


class JaxEngine(Engine):
    def __init__(
        self,
        loaded: LoadedModel,
        slots: int = 8,
        max_seq_len: int = 512,
        steps_per_call: int = 8,
        min_prefill_bucket: int = 32,
        prefill_chunk: int = 512,
        min_attend_bucket: int = 128,
        min_batch_bucket: int | None = None,
        processed_logprobs: bool = False,
        cache_dtype: str | None = None,
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
        self.attend_buckets = power_of_two_buckets(min(min_attend_bucket, max_seq_len), max_seq_len)
        # Decode on fewer rows when only low slots are live. Off by default: XLA's matmul sums in a different order
        # for a different row count, so bucketing trades bit-exact batch invariance for single-stream latency.
        self.batch_buckets = power_of_two_buckets(min(min_batch_bucket or slots, slots), slots)
        module = loaded.module()
        self.graphdef, self.params = nnx.split(module)  # split once; programs merge inside jit
        dtype = jnp.dtype(cache_dtype) if cache_dtype else module.embed.value.dtype
        self.cache_dtype = dtype
        self.kv_cache_bytes = cache_bytes(loaded.config, slots, max_seq_len, dtype)
        state = init_decode_state(loaded.config, slots, max_seq_len, dtype)
        if mesh is not None:  # cache by the sharding rules, the small per-slot arrays replicated
            replicated = NamedSharding(mesh, PartitionSpec())
            kv = cache_sharding(loaded.config, mesh, slots, max_seq_len)
            shardings = jax.tree.map(lambda _: replicated, state)
            shardings = shardings.replace(cache=type(state.cache)(kv, kv))
            state = jax.device_put(state, shardings)
        self.state = state
        self.mesh = mesh
        cfg = ProgramConfig(K=MAX_TOP_LOGPROBS, steps=steps_per_call, chunk=prefill_chunk,
                            processed_logprobs=processed_logprobs)  # fmt: skip
        self._prefill, self._insert, self._decode, self._release = build_programs(self.graphdef, cfg, max_seq_len)
        self._lengths = np.zeros(slots, np.int64)  # host mirror of the device lengths
        self._active = np.zeros(slots, bool)
        self._lock = threading.Lock()  # the engine is driven by one thread; the lock guards misuse
        log.info("KV cache: %d slots x %d positions, %s, %.1f MiB", slots, max_seq_len, dtype.name,
                 self.kv_cache_bytes / 2**20)  # fmt: skip

    # -- Engine API ---------------------------------------------------------------------------------------------
    def prefill(self, tokens: list[int], want_prompt_logprobs: bool = False) -> Prefix:
        n = len(tokens)
        if not 0 < n <= self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens: must be 1..{self.max_seq_len}")
        bucket = bucket_for(n, self.prefill_buckets)
        padded = np.zeros(bucket, np.int32)
        padded[:n] = tokens
        with self._lock:
            cache, last_logits, prompt = self._prefill(
                self.params, jnp.asarray(padded), jnp.int32(n), bucket=bucket, want_prompt_logprobs=want_prompt_logprobs
            )
        return Prefix(cache, last_logits, n, prompt)

    def prompt_logprobs(self, prefix: Prefix) -> PromptLogprobs | None:
        if prefix.prompt is None:
            return None
        chosen, top_ids, top_vals = (np.asarray(a) for a in prefix.prompt)
        n = prefix.prompt_len - 1
        return PromptLogprobs(chosen[:n], top_ids[:n], top_vals[:n])

    def insert(self, prefix: Prefix, slot: int, params: SlotParams) -> TokenOut:
        if len(params.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request")
        stop = np.full(MAX_STOP_IDS, -1, np.int32)
        stop[: len(params.stop_ids)] = params.stop_ids
        slot_params = {
            "temperature": jnp.float32(params.temperature),
            "top_p": jnp.float32(params.top_p),
            "top_k": jnp.int32(params.top_k),
            "min_p": jnp.float32(params.min_p),
            "keys": jax.random.key_data(jax.random.PRNGKey(params.seed % 2**63)).astype(jnp.uint32),
            "max_tokens": jnp.int32(params.max_tokens),
            "stop_ids": jnp.asarray(stop),
        }
        with self._lock:
            self.state, out = self._insert(
                self.state, prefix.cache, prefix.last_logits, jnp.int32(slot), jnp.int32(prefix.prompt_len), slot_params
            )
            token_id, lp, top_ids, top_vals, done = jax.device_get(out)
            self._lengths[slot] = prefix.prompt_len
            self._active[slot] = not bool(done)
        return TokenOut(int(token_id), float(lp), np.asarray(top_ids), np.asarray(top_vals), bool(done))

    def generate(self) -> StepArrays:
        with self._lock:
            live = np.flatnonzero(self._active)
            longest = int(self._lengths[live].max()) if live.size else 0
            attend = bucket_for(min(longest + self.steps_per_call, self.max_seq_len), self.attend_buckets)
            batch = bucket_for(int(live.max()) + 1 if live.size else 1, self.batch_buckets)
            self.state, outs = self._decode(self.params, self.state, attend_len=attend, batch=batch)
            ids, lps, top_ids, top_vals, valid, done = (self._pad(np.asarray(a)) for a in outs)
            self._lengths += valid.sum(axis=0)
            self._active &= ~done.any(axis=0)
        return StepArrays(ids, lps, top_ids, top_vals, valid, done)

    def _pad(self, a: np.ndarray) -> np.ndarray:
        """[N, batch, ...] -> [N, slots, ...]: slots past the batch bucket were not run (valid/done False)."""
        if a.shape[1] == self.slots:
            return a
        out = np.zeros((a.shape[0], self.slots) + a.shape[2:], a.dtype)
        out[:, : a.shape[1]] = a
        return out

    def release(self, slot: int) -> None:
        with self._lock:
            self.state = self._release(self.state, jnp.int32(slot))
            self._active[slot] = False

    # -- start-up -----------------------------------------------------------------------------------------------
    def warm_up(self, prompt_logprobs: bool = True) -> None:
        """Compile every program the serving loop can call: prefill per bucket (with and without prompt
        logprobs), insert per bucket, decode per (attended-length, batch) bucket. Leaves all slots free."""
        params = SlotParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=5, seed=0)
        for bucket in self.prefill_buckets:
            for want in (False, True) if prompt_logprobs else (False,):
                prefix = self.prefill([1] * bucket, want_prompt_logprobs=want)
            self.insert(prefix, 0, params)
            self.release(0)
        for attend in self.attend_buckets:
            for batch in self.batch_buckets:
                with self._lock:
                    self.state, outs = self._decode(self.params, self.state, attend_len=attend, batch=batch)
                    jax.block_until_ready(outs)
        self._lengths[:] = 0
        self._active[:] = False
