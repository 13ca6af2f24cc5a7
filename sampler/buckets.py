"""The static shapes the engine compiles and serves on: prefill chunk sizes, attended lengths, decode batch rows
and the steps each decode call makes on each batch. Shapes are static so serving never compiles; the buckets let
a call's cost follow the live load (a prompt's length, the occupied slots, the longest sequence)."""

from __future__ import annotations

from dataclasses import dataclass

from tpuserve.sampler.config import EngineConfig

MIN_BATCH_BUCKET = 2  # one row takes another kernel (a matrix-vector product) that rounds differently
# The smallest chunk whose positions' results do not depend on the chunk: on XLA:CPU a chunk of 16 or more
# positions computes each position's keys, values and hidden state with the same arithmetic whatever the chunk's
# start, size or attended length (its products take the positions as rows, see model/llama.py's attention), while
# fewer than 8 rows round norms, rotary embedding and softmax differently (measured; the prefix cache's tests check
# it). So a prompt whose pages can be shared is prefilled in chunks of at least this many positions, from any
# position: a cache hit leaves a tail of 20 tokens to a 32-position chunk, not to a 64-position one.
SHARED_CHUNK = 16
# Prompts of up to this many tokens neither read nor name cached pages: several of them are prefilled by one
# program (`together_shapes`), which is what keeps many new short requests cheap, and a page of a prompt that
# short saves little.
SMALL_PROMPT = 32


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


@dataclass(frozen=True)
class Buckets:
    """Every shape of an engine's programs, from its EngineConfig."""

    chunk: int  # C: prompts are prefilled in chunks of at most C tokens
    max_seq_len: int
    chunk_sizes: list[int]  # a chunk is padded to one of these (>= SHARED_CHUNK unless the prompt is small)
    attend: list[int]  # attended lengths (a call attends over the smallest that covers its longest sequence)
    batch: list[int]  # decode rows (the smallest that covers the occupied slots)
    call_steps: dict[int, int]  # batch rows -> the steps a decode call makes on them

    @property
    def small_prompt(self) -> int:
        """Prompts of up to this many tokens (SMALL_PROMPT, or every prompt when no chunk size reaches
        SHARED_CHUNK) are not shared."""
        if all(s < SHARED_CHUNK for s in self.chunk_sizes):
            return self.max_seq_len
        return max((s for s in self.chunk_sizes if s <= SMALL_PROMPT), default=0)

    @classmethod
    def of(cls, cfg: EngineConfig) -> Buckets:
        chunk = min(cfg.prefill_chunk, cfg.max_seq_len)
        # the last, partial chunk: padded to the smallest power of two >= min_prefill_bucket
        chunk_sizes = power_of_two_buckets(min(cfg.min_prefill_bucket, chunk), chunk)
        attend = power_of_two_buckets(min(cfg.min_attend_bucket, cfg.max_seq_len), cfg.max_seq_len)
        # None: always all slots. Never below 2 rows (a 1-row product rounds differently).
        smallest = max(cfg.min_batch_bucket or cfg.slots, MIN_BATCH_BUCKET)
        batch = power_of_two_buckets(min(smallest, cfg.slots), cfg.slots)
        # N = steps_per_call on buckets of up to steps_per_call_rows rows (default: the smallest), fewer on larger
        # ones (rows x steps no more than N x those rows, but at least min_steps_per_call), so a call lasts about
        # as long whatever the load and a request that arrives waits for about one such call, not for N steps of
        # 64 rows.
        n = cfg.steps_per_call
        floor = min(cfg.min_steps_per_call, n)
        work = n * max(cfg.steps_per_call_rows or 0, batch[0])
        call_steps = {b: max(floor, min(n, work // b)) for b in batch}
        return cls(chunk, cfg.max_seq_len, chunk_sizes, attend, batch, call_steps)

    def chunk_plan(self, n: int, first: int = 0) -> list[tuple[int, int, int, int]]:
        """(start, real tokens, padded size, attended length) of each chunk of an n-token prompt from position
        `first`: chunks of C, padded to at least SHARED_CHUNK unless the whole prompt is small."""
        sizes = self.chunk_sizes
        if n > self.small_prompt:
            sizes = [s for s in sizes if s >= SHARED_CHUNK]
        plan = []
        for start in range(first, n, self.chunk):
            real = min(self.chunk, n - start)
            size = bucket_for(real, sizes)
            plan.append((start, real, size, bucket_for(min(start + size, self.max_seq_len), self.attend)))
        return plan

    def chunk_shapes(self) -> set[tuple[int, int]]:
        """(padded size, attended length) of every chunk a prompt can meet, from any first position."""
        shapes = {
            (size, bucket_for(size, self.attend)) for size in self.chunk_sizes if size <= self.small_prompt
        }
        for size in self.chunk_sizes:
            if size >= SHARED_CHUNK or self.small_prompt == self.max_seq_len:
                shapes |= {(size, bucket_for(min(start + size, self.max_seq_len), self.attend))
                           for start in range(self.max_seq_len)}  # fmt: skip
        return shapes

    def together_shapes(self) -> list[tuple[int, int]]:
        """(rows, padded size) of every program that prefills several short prompts at once: prompts padded to
        one size bucket, at most C rows of tokens in all, 2, 4, ... prompts (a short prompt fills few rows of a
        product, so one program over several costs less than one each); only small prompts (a prompt whose pages
        can be shared is prefilled alone, in chunks of at least SHARED_CHUNK)."""
        C = self.chunk
        return [(rows, size) for size in self.chunk_sizes if C // size >= 2 and size <= self.small_prompt
                for rows in power_of_two_buckets(2, C // size)]  # fmt: skip
