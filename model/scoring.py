"""Score a token sequence in-process: each token's logprob given the tokens before it, and the top-K, computed as
an engine under `rescore_exact` (EngineConfig) computes its sampled tokens' and its prompt logprobs, bit for bit,
on the same weights in the same form (what `module_for` or LoadedModel.module gives).

Why the same bits whatever the chunking: positions attend as rows of one position each (`Llama(query_rows=True)`),
as a decode step's rows do, over masked keys that add exact zeros; XLA:CPU's weight products give a row the same
arithmetic for any number of rows from 2, its norms, softmax and log-softmax from 8 (model/llama.py). So the only
requirement here is chunks of at least 8 positions, which the padding below keeps.

    model = module_for(cfg, params)  # a trainer's canonical parameters (llama.param_shapes)
    scores = score(model, token_ids)  # scores.logprobs[j]: token j+1 given tokens 0..j
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tpuserve.model.config import ModelConfig
from tpuserve.model.llama import KVCache, Llama, init_cache, module_params

TOP_K = 20  # the engine's logprob width (MAX_TOP_LOGPROBS)
MIN_ROWS = 16  # a chunk's padded size is a multiple of this (>= 8: see the module docstring)
PAGE = 16
MIN_ATTEND = 128


class Scores(NamedTuple):
    """Entry j belongs to token j+1 (the first token has none): logprobs [n-1]; top_ids, top_logprobs [n-1, K],
    sorted by logprob descending."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def module_for(cfg: ModelConfig, params: dict[str, Any], scan_layers: bool = True) -> Llama:
    """The decoder over canonical parameters (`llama.param_shapes`: what a trainer holds), in the module layout
    the engine serves them in."""
    return Llama(cfg, module_params(cfg, params, scan_layers))


@functools.partial(jax.jit, static_argnames=("graphdef", "attend_len", "k"))
def _chunk(graphdef, params, cache: KVCache, tokens, targets, start, attend_len: int, k: int):
    m = nnx.merge(graphdef, params)
    pos = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    hidden, cache = m(tokens[None], pos[None], cache, attend_len, query_rows=True)
    lp = jax.nn.log_softmax(m.logits(hidden[0]), axis=-1)
    top_vals, top_ids = jax.lax.top_k(lp, k)
    chosen = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    return cache, chosen, top_ids.astype(jnp.int32), top_vals


def score(model: Llama, token_ids: list[int] | np.ndarray, top_k: int = TOP_K, chunk: int = 128) -> Scores:
    """Logprobs of tokens 1..n-1 of `token_ids`, each given the ones before it, and the top_k alternatives;
    positions run in chunks of `chunk` (any multiple of MIN_ROWS: the numbers do not depend on it)."""
    if chunk % MIN_ROWS:
        raise ValueError(f"chunk must be a multiple of {MIN_ROWS}, got {chunk}")
    ids = np.asarray(token_ids, np.int32)
    n = len(ids)
    if n < 2:
        raise ValueError("score needs at least 2 tokens")
    graphdef, params = nnx.split(model)
    padded_len = -(-n // MIN_ROWS) * MIN_ROWS
    total = max(MIN_ATTEND, 1 << (padded_len - 1).bit_length())
    cache = init_cache(model.cfg, 1, total, model.dtype, page=PAGE)
    padded = np.zeros(total + 1, np.int32)
    padded[:n] = ids
    parts = []
    for start in range(0, n - 1, chunk):
        size = min(chunk, -(-(n - 1 - start) // MIN_ROWS) * MIN_ROWS)
        attend = max(MIN_ATTEND, 1 << (start + size - 1).bit_length())
        cache, *out = _chunk(graphdef, params, cache, padded[start : start + size],
                             padded[start + 1 : start + size + 1], np.int32(start), attend_len=attend, k=top_k)  # fmt: skip
        parts.append([np.asarray(a)[: min(size, n - 1 - start)] for a in out])
    return Scores(*(np.concatenate([p[i] for p in parts]) for i in range(3)))
