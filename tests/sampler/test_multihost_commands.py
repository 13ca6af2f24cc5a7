"""A multi-process group by construction: every public engine method either changes the engine's state and is
replicated to the followers by its command (sampler/multihost.py REPLICATED, or COMPOSED of replicated ones), or
runs on the leader alone (LEADER_ONLY). A new engine method that is in neither list fails here, and the
commands the leader sends replay on a follower as the same engine calls."""

from __future__ import annotations

import inspect
import pickle
import threading

import numpy as np
from tpuserve.sampler import multihost
from tpuserve.sampler.api import Capabilities, Engine, Pending, SlotParams, TokenOut
from tpuserve.sampler.multihost import COMMANDS, COMPOSED, LEADER_ONLY, REPLICATED, LeaderEngine


def _public(cls: type) -> set[str]:
    """The public methods and properties of `cls` (its data attributes, e.g. `slots`, are not calls)."""
    names = set()
    for name in dir(cls):
        if name.startswith("_"):
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, property | staticmethod | classmethod) or inspect.isfunction(value):
            names.add(name)
    return names


def test_every_public_engine_method_is_replicated_or_leader_only():
    from tpuserve.sampler.engine import JaxEngine

    listed = set(REPLICATED) | set(COMPOSED) | LEADER_ONLY
    unlisted = (_public(Engine) | _public(JaxEngine)) - listed
    assert not unlisted, (
        f"engine methods in none of multihost's REPLICATED, COMPOSED, LEADER_ONLY: {unlisted}"
    )
    assert not set(REPLICATED) & (set(COMPOSED) | LEADER_ONLY) and not set(COMPOSED) & LEADER_ONLY
    for parts in COMPOSED.values():
        assert set(parts) <= set(REPLICATED) | set(COMPOSED)


def test_the_leader_overrides_every_replicated_method_and_forwards_nothing_else():
    for name in REPLICATED:
        assert name in vars(LeaderEngine), f"LeaderEngine.{name} is Engine's: it would not be replicated"
    assert not hasattr(LeaderEngine, "__getattr__")
    assert set(REPLICATED.values()) <= COMMANDS


class _Prefix:
    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens


class _Recording(Engine):
    """An engine that logs each state-changing call (a prefix is its prompt)."""

    def __init__(self) -> None:
        self.slots, self.max_seq_len, self.steps_per_call, self.vocab_size = 2, 64, 2, 64
        self.prefill_chunk = 4
        self.capabilities = Capabilities(structured_outputs=True)
        self.log: list[tuple] = []

    def prefill_steps(self, tokens, want_prompt_logprobs=False, cache_salt=None):
        self.log.append(("prefill_steps", tuple(tokens), want_prompt_logprobs, cache_salt))
        for _ in range(len(tokens) // self.prefill_chunk):
            self.log.append(("step",))
            yield None
        yield _Prefix(tuple(tokens))

    def prefill(self, tokens, want_prompt_logprobs=False, cache_salt=None):
        *_, prefix = self.prefill_steps(tokens, want_prompt_logprobs, cache_salt)
        return prefix

    def prompt_logprobs(self, prefix):
        return None

    def start_insert(self, prefix, slot, params, allowed=None):
        self.log.append(
            ("insert", prefix.tokens, slot, params, None if allowed is None else allowed.tolist())
        )
        return Pending.ready(TokenOut(1, -0.5, np.zeros(1), np.zeros(1), False))

    def insert(self, prefix, slot, params, allowed=None):
        return self.start_insert(prefix, slot, params, allowed).result()

    def constrain(self, slot, allowed):
        self.log.append(("constrain", slot, None if allowed is None else allowed.tolist()))

    def start_decode(self, max_steps=None):
        self.log.append(("decode", max_steps))
        return Pending.ready("decoded")

    def decode(self):
        return self.start_decode().result()

    def release(self, slot):
        self.log.append(("release", slot))

    def load_weights(self, path):
        self.log.append(("load_weights", path))
        return f"weights of {path}"

    def swap_weights(self, weights, version):
        self.log.append(("swap_weights", weights, version))


class _Channel:
    """process_group.Channel's interface, in one process: what the leader sends, replayed to a follower."""

    def __init__(self, sent: list[bytes] | None = None) -> None:
        self.lock, self.num_processes, self.fault, self.on_fault = threading.RLock(), 2, None, None
        self.sent: list[bytes] = []
        self._replay = iter(sent or [])

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)

    def receive(self) -> bytes:
        return next(self._replay)

    def start_watching(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def failed(self, message: str) -> None:
        self.fault = message


LOADED: list = []
# each replicated method, called through the leader; a method added to REPLICATED needs its call here
CALLS = {
    "prefill_steps": lambda e, prefix: list(e.prefill_steps([1, 2, 3, 4, 5, 6], True, "salt")),
    "start_insert": lambda e, prefix: e.start_insert(prefix, 1, SlotParams(max_tokens=3, seed=7)).result(),
    "constrain": lambda e, prefix: e.constrain(1, np.array([5, 6], np.int32)),
    "start_decode": lambda e, prefix: e.start_decode(3).result(),  # a shortened call: max_steps is replayed
    "release": lambda e, prefix: e.release(1),
    "load_weights": lambda e, prefix: LOADED.append(e.load_weights("/ckpt/step-2")),
    "swap_weights": lambda e, prefix: e.swap_weights(LOADED.pop(), "step-2"),  # what load_weights loaded
    "warm_up": lambda e, prefix: e.warm_up(compile=False),
    "stop_group": lambda e, prefix: e.stop_group(),
}


def test_each_replicated_call_sends_its_command_and_a_follower_replays_the_same_engine_calls():
    assert set(CALLS) == set(REPLICATED)
    inner, channel = _Recording(), _Channel()
    leader = LeaderEngine(inner, channel)
    leader.insert(leader.prefill_together([[4, 4]])[0], 0, SlotParams(max_tokens=1))  # COMPOSED ones
    leader.decode()
    prefix = leader.prefill([9, 9])
    for name, call in CALLS.items():  # stop_group last: a follower stops there
        before = len(channel.sent)
        call(leader, prefix)
        ops = [pickle.loads(payload)[1] for payload in channel.sent[before:]]
        assert ops[:1] == [REPLICATED[name]], f"{name} sent {ops}"

    follower = _Recording()
    assert multihost.follow(follower, _Channel(channel.sent)) == 0
    assert follower.log == inner.log
