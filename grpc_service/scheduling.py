"""The engine thread's scheduling policy: who takes the free slots, how much prompt is prefilled per turn while
others decode, which short prompts go through one `prefill_together`, whether another decode call is worth
dispatching, and whether it may stay in flight. orchestrator.py holds the mechanics that carry these out (the
slot table, the engine calls, the events).

One turn: admit waiting requests into free slots, first come first served (they are then prefilled chunk by
chunk: while others decode, at most about `prefill_budget` prompt tokens a turn, so a running stream never waits
for more than about one chunk; prompts of one chunk go before a longer one in progress, and consecutive prompts
shorter than a chunk go through one `prefill_together`);
insert them (the first token is sampled there); dispatch the next decode call unless nobody can use it; read back
the previous call and the new first tokens; hand each request its events.

A request that arrives while streams decode waits for the decode call on the device before its prefill runs.
With a slot free (someone may arrive), a call therefore makes about `light_call_s` worth of steps, at least one
(`call_steps`): one step on XLA:CPU, where a step lasts 30-80 ms at 1-16 rows, several on an accelerator. With
every slot taken nobody can arrive into one, and the engine's own fused steps per call (8 at few rows) spare
each call's fixed cost.

One call stays in flight (call k+1 is dispatched before call k is read, so detokenizing and streaming overlap the
device) while no slot is free, or while calls are short (`overlap_max_call_s`: an accelerator's). With a slot
free and longer calls (XLA:CPU), the next call is dispatched only once the one in flight is done: a request
arriving meanwhile is then prefilled right after that call, instead of after the one queued behind it too. The
device waits meanwhile for the host to take the commands and dispatch the next call (about a millisecond); the
done call's tokens are read, detokenized and streamed while the next one computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tpuserve.grpc_service.jobs import GenerationJob
    from tpuserve.grpc_service.running import InFlight
    from tpuserve.grpc_service.sample_tracker import SampleTracker
    from tpuserve.sampler.api import Engine

# With a slot free, a decode call makes at most about this long's worth of steps (seconds; at least one step):
# a request arriving meanwhile waits for the rest of the call before its prefill.
LIGHT_CALL_S = 0.02
# With a slot free, a decode call stays in flight only when calls last at most this long (seconds): the overlap
# saves the host's work per call (a millisecond or two), and costs a request that arrives meanwhile one more
# call's wait before its prefill. An XLA:CPU step lasts tens of milliseconds (there the overlap made time to first
# token worse); an accelerator's, a few.
OVERLAP_MAX_CALL_S = 0.025


class Run(Protocol):
    """What the policy reads of an admitted request (orchestrator's _Running)."""

    trackers: list[SampleTracker]
    stepped: bool  # a prefill step has run

    @property
    def job(self) -> GenerationJob: ...


@dataclass(frozen=True)
class Policy:
    prefill_budget: int  # prompt tokens prefilled per turn while streams decode
    overlap_max_call_s: float = OVERLAP_MAX_CALL_S
    light_call_s: float = LIGHT_CALL_S

    def admits(self, job: GenerationJob, free_slots: int, engine: Engine) -> bool:
        """Whether the request at the head of the queue starts now: first come, first served, so it waits for
        its n slots (a max_tokens = 0 request needs none), the engine's room for its prompt (`Engine.admits`)
        and any prefill in progress that computes the prompt's next uncached pages (`Engine.awaits_prefill`: it
        then reads them from the prefix cache), and those behind it wait too."""
        samples = job.n if job.max_tokens > 0 else 0
        return (
            free_slots >= samples
            and engine.admits(len(job.prompt_ids), samples)
            and not engine.awaits_prefill(job.prompt_ids, job.prompt_logprobs, job.cache_salt)
        )

    def prefill_order(self, prefilling: Iterable[Run], chunk: int) -> list[Run]:
        """The prefill queue in the order its prompts are computed: prompts of one chunk not started yet go
        before a longer prompt in progress (each in arrival order), so a short request arriving behind a
        3,000-token prompt waits for about a chunk of it, not for all of it. The long prompt goes on as soon as
        they are done; new short ones come only as slots free up, so it is never held back for long."""
        runs = list(prefilling)
        short = {id(r) for r in runs if not r.stepped and len(r.job.prompt_ids) <= chunk}
        return [r for r in runs if id(r) in short] + [r for r in runs if id(r) not in short]

    def turn_budget(self, decoding: bool) -> int | None:
        """Prompt tokens to prefill this turn: every step when nothing decodes (None), else about the budget (at
        least one step), so running streams wait at most about one chunk between two decode calls."""
        return self.prefill_budget if decoding else None

    def short_prompts(
        self, prefilling: Iterable[Run], budget: int | None, engine: Engine, is_live: Callable[[Run], bool]
    ) -> tuple[list[Run], int]:
        """The live runs at the head of the prefill queue whose prompts can be prefilled together (not started,
        shorter than one chunk, no prompt logprobs), as many as the turn's budget takes (at least one), and
        their prefill cost."""
        group: list[Run] = []
        cost = 0
        for run in prefilling:
            n = len(run.job.prompt_ids)
            if run.stepped or run.job.prompt_logprobs or n >= engine.prefill_chunk:
                break
            if not is_live(run):
                break
            if budget is not None and group and cost >= budget:
                break
            group.append(run)
            cost += engine.prefill_cost(n)
        return group, cost

    def call_steps(self, free_slots: int, step_s: float | None) -> int | None:
        """The most steps the next decode call may make: with a slot free, about `light_call_s` worth (at least
        one), so a request arriving meanwhile soon gets its prefill; None (the engine's own number) when every
        slot is taken, or before a call has been timed."""
        if not free_slots or step_s is None:
            return None
        return max(1, int(self.light_call_s / max(step_s, 1e-9)))

    def keep_in_flight(self, free_slots: int, last_call_s: float | None) -> bool:
        """Whether the call just dispatched may stay in flight past this turn: yes when no request could take a
        slot before the next call anyway, or when calls are short."""
        return not free_slots or last_call_s is None or last_call_s <= self.overlap_max_call_s


def wants_tokens(
    owners: Mapping[int, tuple[Run, int]],
    firsts: Iterable[tuple[Run, int, object]],
    in_flight: InFlight | None,
    ended: Iterable[int] = (),
) -> bool:
    """Whether another decode call can make a token someone wants: not when every sample in a slot (`owners`:
    slot -> (run, sample)) reaches its max_tokens with the tokens already on their way (`firsts`: inserted, the
    first token not yet read; the call in flight), or ended in the call in flight (`ended`: the slots the device
    marked done in a call that is done but not read yet, e.g. on an end-of-sequence token). A call nobody needs
    would keep the device busy, and a request arriving next would wait for it."""
    coming_first = {(id(run), index) for run, index, _ in firsts}
    ended = set(ended)
    for slot, (run, index) in owners.items():
        if slot in ended:
            continue
        tracker = run.trackers[index]
        coming = int((id(run), index) in coming_first)
        owner = in_flight.owners.get(slot) if in_flight is not None else None
        if owner is not None and owner[0] is run and owner[1] == index:
            coming += in_flight.steps
        if tracker.generated + coming < tracker.max_tokens:
            return True
    return False
