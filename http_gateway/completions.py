"""/v1/completions (legacy): prompts (text, token ids, batched) -> completions, with the legacy logprobs.

One backend `Generate` per prompt; choice index = prompt_index * n + sample. Every generated token has a logprob
entry, including the EOS that ended the sample (it adds no text; `completion_tokens` counts it). `echo` prepends
the prompt, and with `logprobs` its tokens (the first one's logprob and top_logprobs are null).
`best_of` samples more and keeps the n with the highest mean token logprob.
`return_token_ids` (vLLM's extension) adds each choice's `prompt_token_ids` and `token_ids` (the generated ids,
as many as its generated logprob entries; streamed: the prompt's on the choice's first chunk, then each chunk's).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tpuserve.http_gateway import observability, proto_mapping
from tpuserve.http_gateway.backend_messages import collect, finish_reason, messages
from tpuserve.http_gateway.backends import BackendPool, GenerateStream
from tpuserve.http_gateway.completion_objects import Completion, CompletionChoice, Usage
from tpuserve.http_gateway.logprobs import CompletionLogprobs, finite
from tpuserve.http_gateway.request_models import CompletionRequest
from tpuserve.http_gateway.sse import sse_stream
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

DEFAULT_MAX_TOKENS = 16


@dataclass
class PromptJob:
    """One prompt of the request and its backend stream."""

    index: int
    prompt: str | list[int]
    stream: GenerateStream
    text: str | None = None  # the prompt as text; needed for echo and for text_offset


def to_proto(req: CompletionRequest, prompt: str | list[int], request_id: str) -> pb.GenerateRequest:
    want_logprobs = req.logprobs is not None or _ranks(req)
    msg = pb.GenerateRequest(
        request_id=request_id,
        sampling=proto_mapping.sampling(req.temperature, req.top_p, req.seed),
        stopping=proto_mapping.stopping(
            DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens, req.stop_list()
        ),
        logprobs=pb.LogprobOptions(
            enabled=want_logprobs,
            top_logprobs=req.logprobs or 0,
            prompt_logprobs=bool(req.echo and req.logprobs is not None),
        ),
        n=req.best_of or req.n or 1,
        return_prompt_token_ids=bool(req.return_token_ids),
    )
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
    return proto_mapping.cache_salt(msg, req.cache_salt)


def _ranks(req: CompletionRequest) -> bool:
    return req.best_of is not None and req.best_of > (req.n or 1)


async def create(pool: BackendPool, req: CompletionRequest) -> Completion | AsyncIterator[str]:
    request_id = observability.new_request_id("cmpl")
    prompts = req.prompts()
    streams = await _start_all(pool, req, prompts, request_id)
    if req.return_token_ids and not req.stream:  # collected whole: the prompt ids are noted on the way
        streams = [proto_mapping.PromptIdsTap(s) for s in streams]  # type: ignore[misc]
    jobs = [PromptJob(i, p, s) for i, (p, s) in enumerate(zip(prompts, streams, strict=True))]
    try:
        await _prompt_texts(pool, req, jobs)
    except BaseException:
        for job in jobs:
            job.stream.cancel()
        raise
    if req.stream:
        return sse_stream(_chunks(jobs, req, request_id))
    return await _complete(jobs, req, request_id)


async def _start_all(
    pool: BackendPool, req: CompletionRequest, prompts: list[str | list[int]], request_id: str
) -> list[GenerateStream]:
    """Start every prompt's stream; if one fails (or we are cancelled), cancel the others."""
    tasks = [
        asyncio.ensure_future(pool.generate(req.model, to_proto(req, p, f"{request_id}-{i}")))
        for i, p in enumerate(prompts)
    ]
    try:
        await asyncio.wait(tasks)
        failed = [t.exception() for t in tasks if t.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                t.result().cancel()
            else:
                t.cancel()
        raise


async def _prompt_texts(pool: BackendPool, req: CompletionRequest, jobs: list[PromptJob]) -> None:
    """Prompt text where it is needed: echoed, or its length as the first text_offset."""
    if not (req.echo or req.logprobs is not None):
        return
    for job in jobs:
        if isinstance(job.prompt, str):
            job.text = job.prompt
        else:
            job.text = await pool.detokenize(req.model, job.prompt)


def _new_logprobs(
    req: CompletionRequest, job: PromptJob, prompt_tokens: list[pb.Token]
) -> CompletionLogprobs:
    """A choice's logprobs, with the echoed prompt's entries already in."""
    lp = CompletionLogprobs(req.logprobs or 0)
    raw = job.prompt if isinstance(job.prompt, str) else None
    lp.prompt(job.text or "", prompt_tokens if req.echo else None, raw)
    return lp


def _echo(req: CompletionRequest, job: PromptJob) -> str:
    return (job.text or "") if req.echo else ""


def mean_logprob(tokens: list[pb.Token]) -> float:
    """`best_of`'s ranking: the mean logprob of the generated tokens (-inf for none)."""
    vals = [finite(t.logprob) for t in tokens if t.HasField("logprob")]
    return sum(vals) / len(vals) if vals else float("-inf")


async def _complete(jobs: list[PromptJob], req: CompletionRequest, request_id: str) -> Completion:
    n = req.n or 1
    gens = await asyncio.gather(*(collect(job.stream, req.best_of or n) for job in jobs))
    choices: list[CompletionChoice] = []
    prompt_tokens = cached_tokens = completion_tokens = 0
    for job, gen in zip(jobs, gens, strict=True):  # each prompt counted once, whatever n
        prompt_tokens += gen.prompt_tokens_count
        cached_tokens += gen.cached_prompt_tokens_count
        samples = [gen.samples[i] for i in sorted(gen.samples)]
        completion_tokens += sum(s.final.completion_tokens_count for s in samples if s.final is not None)
        if _ranks(req):
            samples.sort(key=lambda s: -mean_logprob(s.tokens))  # stable: ties keep sample order
        for j, s in enumerate(samples[:n]):
            assert s.final is not None
            logprobs = None
            if req.logprobs is not None:
                lp = _new_logprobs(req, job, gen.prompt_tokens)
                for t in s.tokens:
                    lp.add(t)
                logprobs = lp.out()
            choice = CompletionChoice(
                index=job.index * n + j,
                text=_echo(req, job) + s.text,
                logprobs=logprobs,
                finish_reason=finish_reason(s.final),
            )
            if req.return_token_ids:
                assert isinstance(job.stream, proto_mapping.PromptIdsTap)
                choice.prompt_token_ids = job.stream.ids
                choice.token_ids = [t.token_id for t in s.tokens]
            choices.append(choice)
    # the weights' version (prompts of a list may meet different backends: the first one's)
    fingerprint = next((s.final.weight_version for g in gens for s in g.samples.values() if s.final), "")
    out = Completion(
        id=request_id,
        object="text_completion",
        created=int(time.time()),
        model=req.model,
        choices=choices,
        usage=Usage.of(prompt_tokens, completion_tokens, cached_tokens),
    )
    if fingerprint:
        out.system_fingerprint = fingerprint
    return out


async def _merged(jobs: list[PromptJob]) -> AsyncIterator[tuple[PromptJob, pb.GenerateResponse]]:
    """All prompts' messages as they arrive."""
    if len(jobs) == 1:
        async for msg in messages(jobs[0].stream):
            yield jobs[0], msg
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(job: PromptJob) -> None:
        try:
            async for msg in messages(job.stream):
                await queue.put((job, msg))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((job, e))
        finally:
            await queue.put((job, done))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield job, item
    finally:
        for t in tasks:
            t.cancel()
        for job in jobs:
            job.stream.cancel()


async def _chunks(jobs: list[PromptJob], req: CompletionRequest, request_id: str) -> AsyncIterator[str]:
    created = int(time.time())
    n = req.n or 1
    include_usage = req.include_usage()
    prompt_tokens: dict[int, list[pb.Token]] = {}
    logprobs: dict[int, CompletionLogprobs] = {}
    started: set[int] = set()
    ids_sent: set[int] = set()  # choices whose prompt_token_ids went out
    prompt_counts: dict[int, int] = {}  # prompt index -> its prompt tokens (each prompt once, whatever n)
    cached_counts: dict[int, int] = {}  # prompt index -> of those, the prefix cache's
    completion_tokens = 0

    fingerprint = ""  # the weights' version, from the backend's messages

    def chunk(choice: CompletionChoice) -> str:
        # No "usage": null here: the spec's completion object (shared by chunks) has a non-null usage.
        c = Completion(
            id=request_id, object="text_completion", created=created, model=req.model, choices=[choice]
        )
        if fingerprint:
            c.system_fingerprint = fingerprint
        return c.dump()

    async for job, msg in _merged(jobs):
        fingerprint = msg.weight_version or fingerprint
        if msg.prompt_tokens:
            prompt_tokens[job.index] = list(msg.prompt_tokens)
        index = job.index * n + msg.index
        text = msg.text
        lp = logprobs.get(index)
        seen = len(lp.tokens) if lp is not None else 0  # entries sent in earlier chunks
        # the choice's first chunk after the prompt ids arrive carries them
        first = bool(req.return_token_ids and msg.prompt_token_ids) and index not in ids_sent
        if index not in started:
            started.add(index)
            text = _echo(req, job) + text
            if req.logprobs is not None:
                lp = logprobs[index] = _new_logprobs(req, job, prompt_tokens.get(job.index, []))
        if lp is not None:
            for t in msg.tokens:
                lp.add(t)
        if msg.finished:
            prompt_counts[job.index] = msg.prompt_tokens_count
            cached_counts[job.index] = msg.cached_prompt_tokens_count
            completion_tokens += msg.completion_tokens_count
        if not (text or msg.tokens or msg.finished or first):
            continue
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=None if lp is None else lp.out(seen),
            finish_reason=finish_reason(msg) if msg.finished else None,
        )
        if req.return_token_ids:
            if first:
                ids_sent.add(index)
                choice.prompt_token_ids = list(msg.prompt_token_ids)
            choice.token_ids = [t.token_id for t in msg.tokens]
        yield chunk(choice)
    if include_usage:
        last = Completion(
            id=request_id,
            object="text_completion",
            created=created,
            model=req.model,
            choices=[],
            usage=Usage.of(sum(prompt_counts.values()), completion_tokens, sum(cached_counts.values())),
        )
        if fingerprint:
            last.system_fingerprint = fingerprint
        yield last.dump()
