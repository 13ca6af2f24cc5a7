"""Helpers the test packages share: polling, free ports, the test extras, driving an engine to the end, counting
XLA compilations."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import socket
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
from tpuserve.sampler.config import EngineConfig

if TYPE_CHECKING:  # the gateway tests import this module too: no JAX here
    from tpuserve.sampler.api import Engine, PromptLogprobs, SlotParams, TokenOut

# One slot's outputs, one entry per token: (ids, logprobs, top_ids, top_logprobs).
Outputs = tuple[list, list, list, list]


# What the engine tests were written against where it differs from EngineConfig (what is served): 8 slots, a
# prompt's last chunk padded to 32 tokens at least, decode on 8 rows at least, N steps on the smallest bucket.
TEST_ENGINE = {"slots": 8, "min_prefill_bucket": 32, "min_batch_bucket": 8, "steps_per_call_rows": None}


def engine_config(**settings) -> EngineConfig:
    """EngineConfig with TEST_ENGINE, then `settings`, applied: a test engine's whole configuration."""
    return dataclasses.replace(EngineConfig(), **{**TEST_ENGINE, **settings})


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Polls `predicate` until it holds or `timeout` seconds pass; its last answer (callers assert it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_extra(module: str) -> ModuleType:
    """A test extra (pyproject's `[test]`: torch, hypothesis, schemathesis, ...), imported. `make test` installs
    them all, so a missing one fails (never skips) the tests that need it, naming the command that installs it.
    Call it where it is needed: in the test or fixture, or at the top of a file whose every test needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"test extra {module!r} is not installed ({e}): run `make install-test`", pytrace=False)


def run_engine(
    engine: Engine,
    requests: list[tuple[int, list[int], SlotParams]],
    want_prompt_logprobs: bool = False,
    together: bool = False,
) -> tuple[dict[int, Outputs], PromptLogprobs | None]:
    """Drive an engine directly: prefill and insert (slot, prompt ids, SlotParams) requests, `decode` until
    every one is done, release their slots. Returns per slot (ids, logprobs, top_ids, top_logprobs) lists and
    the prompt logprobs of the first request. `together`: the prompts go through one `prefill_together`."""
    out: dict[int, Outputs] = {slot: ([], [], [], []) for slot, _, _ in requests}
    live = set()
    prompt_lp = None
    prefixes = engine.prefill_together([ids for _, ids, _ in requests]) if together else None
    for k, (slot, ids, params) in enumerate(requests):
        prefix = prefixes[k] if together else engine.prefill(ids, want_prompt_logprobs)
        if prompt_lp is None:
            prompt_lp = engine.prompt_logprobs(prefix)
        first = engine.insert(prefix, slot, params)
        _append(out[slot], first)
        if not first.done:
            live.add(slot)
    while live:
        step = engine.decode()
        for n in range(step.ids.shape[0]):
            for slot in list(live):
                if step.valid[n, slot]:
                    t = step.token(n, slot)
                    _append(out[slot], t)
                    if t.done:
                        live.discard(slot)
    for slot, _, _ in requests:
        engine.release(slot)
    return out, prompt_lp


def _append(acc: Outputs, token: TokenOut) -> None:
    for values, v in zip(
        acc, (token.token_id, token.logprob, token.top_ids, token.top_logprobs), strict=True
    ):
        values.append(v)


@contextlib.contextmanager
def compiles() -> Iterator[list[str]]:
    """The XLA compilations (jax's backend_compile events) made while the block runs, listed as they happen."""
    import jax  # here: the gateway tests import this module too

    seen: list[str] = []

    def on_event(name: str, *args, **kwargs) -> None:
        if "backend_compile" in name:
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
