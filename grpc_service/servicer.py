"""tpuserve.v1.TextGeneration: validate, queue into the orchestrator, stream tokens; tokenizer RPCs."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from tpuserve.grpc_service.admission import QueueFullError, RequestStream, ShuttingDownError
from tpuserve.grpc_service.convert import TokenConverter
from tpuserve.grpc_service.jobs import ErrorEvent, Finish, PromptEvent, SampleEvent
from tpuserve.grpc_service.metrics import BackendMetrics
from tpuserve.grpc_service.orchestrator import Orchestrator, WeightUpdate
from tpuserve.grpc_service.settings import ServerSettings
from tpuserve.grpc_service.validation import InvalidRequest, Limits, build_job, check_token_ids, render_chat
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc
from tpuserve.sampler.api import Engine
from tpuserve.sampler.config import EngineConfig

if TYPE_CHECKING:
    from tpuserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
request_log = logging.getLogger("tpuserve.backend.requests")


def _page_counts(engine: Engine) -> pb.PageCounts | None:
    """The KV pool's pages now (engine.page_stats(), a snapshot); None for an engine without pages, or when the
    engine cannot say (GetModelInfo still answers: it carries the readiness)."""
    try:
        stats = engine.page_stats()
    except Exception:
        log.exception("engine.page_stats() failed")
        return None
    if stats is None:
        return None
    return pb.PageCounts(
        page_tokens=stats.page_tokens,
        total=stats.total,
        used=stats.used,
        shared=stats.shared,
        cached=stats.cached,
        free=stats.free,
        preemptions=stats.preemptions,
    )


class _Record:
    """What one Generate call's log line and metrics report."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self.request_id = request.request_id
        self.start = time.monotonic()
        self.code = "OK"
        self.error = ""
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt tokens, those whose KV came from the prefix cache
        self.completion_tokens = 0
        self.n = request.n or 1
        self.first_token: float | None = None
        self.finish: list[str] = []


def _prompt_of(request: pb.GenerateRequest) -> object:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        return [{"role": m.role, "content": m.content} for m in request.chat.messages]
    return None


def _versioned(msg: pb.GenerateResponse, stream: RequestStream) -> pb.GenerateResponse:
    msg.weight_version = stream.weight_version
    return msg


class _Responses:
    """One Generate call's events -> response messages, with its per-sample token counts, log record and metrics."""

    def __init__(self, job, convert: TokenConverter, rec: _Record, metrics: BackendMetrics | None) -> None:
        self.job, self.convert, self.rec, self.metrics = job, convert, rec, metrics
        self.prompt_len = len(job.prompt_ids)
        self.sent = [0] * job.n  # tokens sent per sample: the next token's index
        self.opened: set[int] = set()  # samples that have had a message (prompt_token_ids go on the first)
        self.finished = [False] * job.n

    def prompt(self, event: PromptEvent) -> pb.GenerateResponse:
        self.rec.cached_tokens = event.cached_tokens
        return pb.GenerateResponse(
            request_id=self.job.request_id,
            index=0,
            prompt_tokens=self.convert.prompt(self.job.prompt_ids, event.logprobs),
            prompt_tokens_count=self.prompt_len,
            cached_prompt_tokens_count=event.cached_tokens,
        )

    def sample(self, event: SampleEvent) -> pb.GenerateResponse:
        rec, metrics = self.rec, self.metrics
        if event.tokens:
            if rec.first_token is None:
                rec.first_token = time.monotonic()
                if metrics is not None:
                    metrics.ttft.observe(rec.first_token - rec.start)
                    if event.timing is not None:
                        metrics.observe_first_token(event.timing, rec.first_token)
            rec.completion_tokens += len(event.tokens)
            if metrics is not None:
                metrics.tokens.inc(len(event.tokens))
        if event.finish is not None:
            self._count_finish(event.finish)
            self.rec.cached_tokens = max(self.rec.cached_tokens, event.cached_tokens)
        msg = self.convert.response(self.job.request_id, event, self.sent[event.index], self.prompt_len)
        if self.job.return_prompt_token_ids and event.index not in self.opened:
            msg.prompt_token_ids.extend(self.job.prompt_ids)
        self.opened.add(event.index)
        self.sent[event.index] += len(event.tokens)
        self.finished[event.index] = event.finish is not None
        return msg

    def fail_open(self, message: str) -> list[pb.GenerateResponse]:
        out = []
        for index in (i for i, done in enumerate(self.finished) if not done):
            failed = SampleEvent(
                index, finish=Finish.ERROR, error=message, cached_tokens=self.rec.cached_tokens
            )
            failed.completion_tokens = self.sent[index]
            self._count_finish(Finish.ERROR)
            out.append(self.convert.response(self.job.request_id, failed, self.sent[index], self.prompt_len))
        self.end_all()
        return out

    def _count_finish(self, finish: Finish) -> None:
        self.rec.finish.append(finish.value)
        if self.metrics is not None:
            self.metrics.finished.labels(finish.value).inc()

    def end_all(self) -> None:
        self.finished = [True] * self.job.n

    def all_finished(self) -> bool:
        return all(self.finished)


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer: Tokenizer,
        model_id: str,
        max_n: int = EngineConfig.max_n,
        max_prompt_tokens: int | None = EngineConfig.max_prompt_tokens,
        metrics: BackendMetrics | None = None,
        log_prompts: bool = ServerSettings.log_prompts,
        served_model_names: Sequence[str] | None = None,
        admin_key: str | None = None,
    ) -> None:
        """`served_model_names`: every name the model answers to (the first is ModelInfo.model_id; default
        `model_id`). `admin_key`: the bearer key UpdateWeights needs (None: UpdateWeights is off)."""
        engine: Engine = orchestrator.engine
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names or [model_id])
        self.model_id = self.served_model_names[0]
        self.admin_key = admin_key
        self._updating = asyncio.Lock()  # one weight update at a time
        self.limits = Limits(
            vocab_size=min(tokenizer.vocab_size, engine.vocab_size),
            # a sequence must fit the KV pool too: one longer than the pool could never finish
            context_length=min(engine.max_seq_len, engine.max_prompt_len),
            max_n=min(max_n, engine.slots),  # n > slots could never be admitted
            max_top_logprobs=engine.top_k_width,
            max_prompt_tokens=max_prompt_tokens,
            pool_tokens=engine.max_prompt_len if engine.max_prompt_len < engine.max_seq_len else None,
        )
        self.created = int(time.time())
        self.readiness = "serving"  # set on the event loop thread by the server (warm-up progress, shutdown)
        self._open: set[RequestStream] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- Generate -------------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rec = _Record(request)
        inner = self._generate(request, context, rec)
        try:
            async for msg in inner:
                yield msg
        except asyncio.CancelledError:
            if rec.code == "OK":  # not already DEADLINE_EXCEEDED (set where the stream was given up)
                rec.code = "CANCELLED"
            raise
        finally:
            await inner.aclose()  # now, not at garbage collection: its `finally` frees the slots
            self._report(rec, request)

    def _report(self, rec: _Record, request: pb.GenerateRequest) -> None:
        """One JSON log line per Generate (the gateway's request id; no prompt unless asked) and the metrics."""
        now = time.monotonic()
        fields = {
            "event": "generate",
            "request_id": rec.request_id,
            "code": rec.code,
            "n": rec.n,
            "prompt_tokens": rec.prompt_tokens,
            "cached_tokens": rec.cached_tokens,
            "completion_tokens": rec.completion_tokens,
            "finish_reasons": rec.finish,
            "duration_ms": round((now - rec.start) * 1000, 2),
            "ttft_ms": None if rec.first_token is None else round((rec.first_token - rec.start) * 1000, 2),
        }
        if rec.error:
            fields["error"] = rec.error
        if self.log_prompts:
            fields["prompt"] = _prompt_of(request)
        request_log.info("generate %s %s", rec.request_id, rec.code, extra={"fields": fields})
        if self.metrics is not None:
            self.metrics.requests.labels(rec.code).inc()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, rec: _Record
    ) -> AsyncIterator[pb.GenerateResponse]:
        job = await self._job(request, context, rec)
        stream = await self._submit(job, context, rec)
        out = _Responses(job, TokenConverter(self.tokenizer, request.logprobs.enabled, request.logprobs.top_logprobs),
                         rec, self.metrics)  # fmt: skip
        self._open.add(stream)
        self._idle.clear()
        try:
            async for event in stream.events():
                if isinstance(event, PromptEvent):
                    yield _versioned(out.prompt(event), stream)
                elif isinstance(event, SampleEvent):
                    yield _versioned(out.sample(event), stream)
                elif (
                    event.code != "INTERNAL"
                ):  # dropped from the queue (deadline, max_queue_wait): nothing sent
                    out.end_all()
                    rec.code, rec.error = event.code, event.message
                    await context.abort(grpc.StatusCode[event.code], event.message)
                else:  # the engine failed: every open sample ends with ERROR, then the call with INTERNAL
                    for msg in out.fail_open(event.message):
                        yield _versioned(msg, stream)
                    rec.code, rec.error = "INTERNAL", event.message
                    await context.abort(grpc.StatusCode.INTERNAL, event.message)
        finally:
            if not out.all_finished():  # the client went away (cancel, deadline): free the slots
                remaining = context.time_remaining()
                rec.code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
                self.orchestrator.cancel(stream)
            self._open.discard(stream)
            if not self._open:
                self._idle.set()

    async def _job(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, rec: _Record):
        try:
            job = build_job(
                request, self.tokenizer, self.limits, self.tokenizer.eos_ids, self.orchestrator.grammars
            )
        except InvalidRequest as e:
            rec.code, rec.error = "INVALID_ARGUMENT", str(e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rec.request_id = job.request_id
        rec.prompt_tokens = len(job.prompt_ids)
        return job

    async def _submit(self, job, context: grpc.aio.ServicerContext, rec: _Record) -> RequestStream:
        try:
            remaining = context.time_remaining()  # None without a client deadline
            deadline = None if remaining is None else time.monotonic() + remaining
            return self.orchestrator.submit(job, deadline)
        except QueueFullError as e:
            rec.code, rec.error = "RESOURCE_EXHAUSTED", str(e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ShuttingDownError as e:
            rec.code, rec.error = "UNAVAILABLE", str(e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        raise AssertionError("unreachable: abort raises")

    def set_readiness(self, detail: str) -> None:
        self.readiness = detail

    def fail_open(self, message: str, code: str = "UNAVAILABLE") -> None:
        """End every open Generate stream with `code` (the engine cannot go on: a process of its group failed).
        On the event loop; the streams' own events after this one are not read."""
        for stream in list(self._open):
            stream.deliver([ErrorEvent(message, code)])

    async def drain(self, timeout: float) -> bool:
        """Wait for open Generate streams to end; after `timeout` cancel them (they end with CANCELLED)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            for stream in list(self._open):
                self.orchestrator.cancel(stream)
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except TimeoutError:
                pass
            return False

    # ---- tokenizer RPCs -------------------------------------------------------------------------------

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        try:
            if kind == "text":
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = self.tokenizer.encode(request.text, add_special_tokens=add)
            elif kind == "chat":
                ids = render_chat(self.tokenizer, request.chat, "chat")[1]
            else:
                raise InvalidRequest("input", "text or chat is required")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, token_bytes=[self.tokenizer.token_bytes[i] for i in ids])

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        ids = list(request.token_ids)
        try:
            check_token_ids(ids, self.limits.vocab_size, "token_ids")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.DetokenizeResponse(
            text=self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
        )

    async def RenderChat(
        self, request: pb.RenderChatRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenderChatResponse:
        try:
            prompt, ids = render_chat(self.tokenizer, request.chat, "chat")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RenderChatResponse(prompt=prompt, token_ids=ids)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        engine = self.orchestrator.engine
        caps = engine.capabilities
        return pb.ModelInfo(
            model_id=self.model_id,
            vocab_size=self.limits.vocab_size,
            context_length=self.limits.context_length,
            max_top_logprobs=self.limits.max_top_logprobs,
            eos_token_ids=list(self.tokenizer.eos_ids),
            dtype=caps.dtype,
            mesh_shape=[size for _, size in caps.mesh],
            mesh_axes=[axis for axis, _ in caps.mesh],
            slots=engine.slots,
            max_n=self.limits.max_n,
            created=self.created,
            readiness=self.readiness,
            weight_bytes=caps.weight_bytes,
            quantization=caps.quantization,
            num_processes=engine.num_processes,
            pages=_page_counts(engine),
            weight_version=engine.weight_version,
            served_model_names=self.served_model_names,
        )

    # ---- weights ----------------------------------------------------------------------------------------

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        if self.admin_key is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "weight updates are off: start the backend with --admin-key (or $TPUSERVE_ADMIN_KEY)")  # fmt: skip
        sent = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.admin_key}".encode()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "UpdateWeights needs the admin key "
                                "(metadata authorization: Bearer <key>)")  # fmt: skip
        if not request.model_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_path: a checkpoint path is required")
        version = request.weight_version or request.model_path
        success, message, aborted = await self.update_weights(
            version, path=request.model_path, abort_in_flight=request.abort_in_flight
        )
        return pb.UpdateWeightsResponse(success=success, message=message, num_aborted=aborted,
                                        weight_version=self.orchestrator.engine.weight_version)  # fmt: skip

    async def update_weights(
        self,
        version: str,
        *,
        path: str | None = None,
        params: dict[str, Any] | None = None,
        abort_in_flight: bool = False,
    ) -> tuple[bool, str, int]:
        """Load new weights (from `path`, or a trainer's `params` arrays) beside the served ones, then swap them in
        between two decode calls (Orchestrator.update_weights) -> (success, message, requests aborted). A source
        that cannot replace the served weights is (False, why, 0): the old ones keep serving."""
        engine = self.orchestrator.engine
        async with self._updating:
            start = time.perf_counter()
            try:
                if path is not None:
                    weights = await asyncio.to_thread(engine.load_weights, path)
                else:
                    weights = await asyncio.to_thread(engine.weights_from_arrays, params)
            except (ValueError, OSError, NotImplementedError) as e:  # ModelLoadError is a ValueError
                log.warning("weight update to %r refused: %s", version, e)
                return False, str(e), 0
            except Exception as e:
                log.exception("weight update to %r failed", version)
                return False, f"loading failed: {type(e).__name__}: {e}", 0
            loaded = time.perf_counter() - start
            loop = asyncio.get_running_loop()
            done: asyncio.Future[int | BaseException] = loop.create_future()
            self.orchestrator.update_weights(WeightUpdate(
                weights, version, abort_in_flight,
                lambda result: loop.call_soon_threadsafe(done.set_result, result),
            ))  # fmt: skip
            result = await done
            if isinstance(result, BaseException):
                return False, str(result), 0
            message = (f"serving weights {version!r}: loaded in {loaded:.1f} s, swapped after "
                       f"{time.perf_counter() - start - loaded:.1f} s; {result} request(s) aborted")  # fmt: skip
            log.info("%s", message)
            return True, message, result
