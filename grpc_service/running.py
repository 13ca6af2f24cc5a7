"""The engine thread's record of each admitted request and of the decode call in flight (orchestrator.py)."""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass, field

from tpuserve.grpc_service.admission import RequestStream
from tpuserve.grpc_service.guided import Constraint
from tpuserve.grpc_service.jobs import Event, GenerationJob
from tpuserve.grpc_service.sample_tracker import SampleTracker
from tpuserve.sampler.api import Pending, StepArrays

log = logging.getLogger("tpuserve.grpc_service.orchestrator")


@dataclass(eq=False)
class Running:
    """One admitted request on the engine thread: its samples' trackers, the slots they hold, its prefill."""

    stream: RequestStream
    trackers: list[SampleTracker]
    admitted: float
    slots: dict[int, int] = field(default_factory=dict)  # sample index -> slot, while it holds one
    outbox: list[Event] = field(default_factory=list)
    timed: set[int] = field(default_factory=set)  # samples whose first token has been timed
    prefill: Generator[object, None, None] | None = None  # the engine's prefill steps, until inserted
    stepped: bool = False  # a prefill step has run (no longer to be prefilled together with others)
    constraints: dict[int, Constraint] = field(default_factory=dict)  # structured outputs: sample -> grammar

    @property
    def job(self) -> GenerationJob:
        return self.stream.job

    def close_prefill(self) -> None:
        """Close the engine's prefill steps (what the engine holds for them, e.g. prefix-cache blocks, is let
        go); idempotent, harmless on a finished iterator. Every run that leaves prefilling passes here."""
        steps, self.prefill = self.prefill, None
        if steps is not None:
            try:
                steps.close()
            except Exception:
                log.exception("closing the prefill of request %s failed", self.stream.job.request_id)


@dataclass
class InFlight:
    """The decode call dispatched and not yet read."""

    result: Pending[StepArrays]
    owners: dict[int, tuple[Running, int]]  # slot -> (request, sample) when the call was dispatched
    dispatched: float  # time.perf_counter()
    steps: int  # tokens the call makes per sample at most
    # the next call is dispatched only once this one is done (scheduling.py): the engine thread waits for it before
    # it takes new commands, so a request that arrived meanwhile is prefilled before the next call
    next_after: bool = False
    done: float | None = None  # when it was seen done (perf_counter), if it was waited for
