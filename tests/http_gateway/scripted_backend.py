"""A scripted TextGeneration backend over a real grpc.aio server, for gateway tests without a model.

Its tokenizer is tiny and byte-level: specials `<|endoftext|>` (0), `<|im_start|>` (1), `<|im_end|>` (2, the EOS),
some whole-word tokens (" How" twice, as ids DUP_A and DUP_B, to exercise equal-string alternatives), and one
token per byte (so an emoji or a CJK character is split across tokens with partial UTF-8 bytes).

What a sample generates is scripted by the prompt (the last chat message, or the completion prompt's text):
- `say:<text>` generates <text> (up to a newline) and then the EOS; no directive: DEFAULT_REPLY then the EOS;
- `loop:<text>` repeats <text> without an EOS (finish by max_tokens); `slow:` before it sleeps per token;
- `fail:<CODE>:<message>` aborts with that gRPC status; `failmid:` aborts after the first message;
  `endwith:<REASON>` ends every sample after its first token with FINISH_REASON_<REASON> (ERROR, CANCELLED);
- `cached:<k>` anywhere in it: the prefix cache "had" min(k, prompt tokens - 1) of the prompt
  (cached_prompt_tokens_count, on every message that has prompt_tokens_count); without it, 0.

Requests are checked as the real backend checks them where the gateway relies on it: a `guided` JSON schema that
is not valid JSON Schema, or has a `$ref` that is not a local pointer to something in it, is INVALID_ARGUMENT
"guided.json_schema: <why>" (the output itself is still the script's: tests script JSON or tool calls with
`say:`). `return_prompt_token_ids` puts the prompt's ids on each sample's first message.

Logprobs are hand-computable: sample s, token j: `logprob(j, s) = -(0.1 * (j % 5 + 1)) / (s + 1)` (later
samples are "better", for best_of); alternatives (`alternatives`) put the sampled token first, except at
j % 4 == 3 where two tokens rank above it; one alternative is always -inf, one is the EOS, one a partial byte.
Text is released by the real backend's detokenizer (`IncrementalDetokenizer`): at token boundaries, complete
characters only, stop string prefixes held back, the stop string cut (tokens that began before it are kept).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import grpc
import jsonschema
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tpuserve.grpc_service.detokenize import Delta, IncrementalDetokenizer
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc

MODEL_ID = "scripted-model"
CREATED = 1_700_000_000
DEFAULT_REPLY = "Hello! How can I assist you today?"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = 2
WORDS = [
    "Hello",
    "!",
    " How",
    " can",
    " I",
    " assist",
    " you",
    " today",
    "?",
    " How",
    " maybe",
    " perhaps",
    "user",
    "assistant",
    "system",
    "Hi",
    " there",
    " world",
]
WORD_BASE = len(SPECIALS)
DUP_A = WORD_BASE + WORDS.index(" How")
DUP_B = WORD_BASE + len(WORDS) - 1 - WORDS[::-1].index(" How")
ID_HI1 = WORD_BASE + WORDS.index(" maybe")
ID_HI2 = WORD_BASE + WORDS.index(" perhaps")
ID_NEGINF = WORD_BASE + WORDS.index(" world")
BYTE_BASE = WORD_BASE + len(WORDS)
VOCAB_SIZE = BYTE_BASE + 256
MAX_TOP = 20
MAX_N = 16
CONTEXT = 4096


def token_bytes(tid: int) -> bytes:
    if tid < WORD_BASE:
        return b""
    if tid < BYTE_BASE:
        return WORDS[tid - WORD_BASE].encode()
    return bytes([tid - BYTE_BASE])


TOKEN_BYTES = [token_bytes(i) for i in range(VOCAB_SIZE)]


def is_special(tid: int) -> bool:
    return tid < WORD_BASE


def encode(text: str, parse_special: bool) -> list[int]:
    """Greedy longest match over words, byte fallback; special-token text parsed only if asked."""
    raw = text.encode()
    words = sorted(
        ((w.encode(), WORD_BASE + i) for i, w in enumerate(WORDS) if WORD_BASE + i != DUP_B),
        key=lambda x: -len(x[0]),
    )
    specials = [(s.encode(), i) for i, s in enumerate(SPECIALS)]
    out, pos = [], 0
    while pos < len(raw):
        for table in ((specials if parse_special else []), words):
            hit = next(((w, i) for w, i in table if raw.startswith(w, pos)), None)
            if hit:
                out.append(hit[1])
                pos += len(hit[0])
                break
        else:
            out.append(BYTE_BASE + raw[pos])
            pos += 1
    return out


def decode(ids: list[int]) -> str:
    return b"".join(SPECIALS[i].encode() if is_special(i) else token_bytes(i) for i in ids).decode(
        "utf-8", errors="replace"
    )


def render_chat(messages: list[pb.ChatMessage]) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += [1] + encode(f"{m.role}\n", False) + encode(m.content, False) + [EOS] + encode("\n", False)
    return ids + [1] + encode("assistant\n", False)


def logprob(j: int, s: int) -> float:
    return -(0.1 * (j % 5 + 1)) / (s + 1)


def alternatives(tid: int, lp: float, j: int) -> list[tuple[int, float]]:
    """(id, logprob) of the top MAX_TOP alternatives, sorted descending; includes the sampled token."""
    cands: list[tuple[int, float]] = []
    if j % 4 == 3:
        cands += [(ID_HI1, lp + 0.05), (ID_HI2, lp + 0.02)]
    cands.append((tid, lp))
    others = [DUP_A, DUP_B, EOS, BYTE_BASE + 0xF0] + [BYTE_BASE + b for b in b"abcdefghijklmnopqrstuvwxyz"]
    used = {c[0] for c in cands}
    extra = [o for o in others if o not in used and o != ID_NEGINF]
    cands += [(o, lp - 0.3 - 0.1 * i) for i, o in enumerate(extra)]
    cands = cands[: MAX_TOP - 1] + [(ID_NEGINF, float("-inf"))]
    return sorted(cands, key=lambda c: -c[1])


def make_token(tid: int, index: int, lp: float | None, j: int, opts: pb.LogprobOptions) -> pb.Token:
    tok = pb.Token(
        index=index,
        token_id=tid,
        token_bytes=token_bytes(tid),
        special=is_special(tid),
        special_text=SPECIALS[tid] if is_special(tid) else "",
    )
    if opts.enabled and lp is not None:
        tok.logprob = lp
        for aid, alp in alternatives(tid, lp, j)[: opts.top_logprobs]:
            tok.top_logprobs.append(
                pb.TopLogprob(
                    token_id=aid,
                    token_bytes=token_bytes(aid),
                    logprob=alp,
                    special=is_special(aid),
                    special_text=SPECIALS[aid] if is_special(aid) else "",
                )
            )
    return tok


@dataclass
class Script:
    ids: list[int]
    eos: bool = True
    loop: bool = False
    slow: bool = False
    fail: tuple[grpc.StatusCode, str] | None = None
    fail_mid: bool = False
    end_with: int = 0  # a FinishReason that ends every sample after its first token

    def token(self, j: int) -> int:
        """The sample's token j: the script's ids, then EOS (a loop repeats them)."""
        if self.loop:
            return self.ids[j % len(self.ids)]
        return self.ids[j] if j < len(self.ids) else EOS


def script_for(text: str) -> Script:
    slow = "slow:" in text
    if "endwith:" in text:
        reason = text.split("endwith:", 1)[1].split()[0]
        return Script(encode("ab", False), end_with=pb.FinishReason.Value(f"FINISH_REASON_{reason}"))
    if "fail:" in text:
        code, _, message = text.split("fail:", 1)[1].partition(":")
        return Script([], fail=(grpc.StatusCode[code.strip()], message.strip()))
    for key in ("say:", "loop:"):
        if key in text:
            body = text.split(key, 1)[1].split("\n", 1)[0]
            return Script(
                encode(body, False),
                eos=key == "say:",
                loop=key == "loop:",
                slow=slow,
                fail_mid="failmid:" in text,
            )
    return Script(encode(DEFAULT_REPLY, False), slow=slow, fail_mid="failmid:" in text)


def guided_error(guided: pb.GuidedDecoding) -> str | None:
    """Why the real backend would refuse this grammar (None: it takes it), in its message form."""
    if guided.WhichOneof("kind") != "json_schema":
        return None
    try:
        schema = json.loads(guided.json_schema)
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except (ValueError, jsonschema.SchemaError) as e:
        return f"guided.json_schema: {getattr(e, 'message', e)}"
    for ref in _refs(schema):
        if not ref.startswith("#"):
            return f"guided.json_schema: unsupported $ref {ref!r} (only local references are)"
        try:
            node = schema
            for part in filter(None, ref[1:].split("/")):
                node = node[part]
        except (KeyError, TypeError):
            return f"guided.json_schema: $ref {ref!r} points to nothing"
    return None


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def cached_for(text: str, prompt_len: int) -> int:
    """The `cached:<k>` directive: the prompt tokens the backend reports as read from its prefix cache."""
    if "cached:" not in text:
        return 0
    digits = text.split("cached:", 1)[1].split()[0]
    return max(0, min(int(digits), prompt_len - 1))


def detokenizer(stopping: pb.StoppingCriteria) -> IncrementalDetokenizer[pb.Token]:
    """One sample's text, released by the backend's own detokenizer (grpc_service/detokenize.py): the gateway's
    stop-string and partial-character tests test those rules, not a copy of them."""
    return IncrementalDetokenizer(TOKEN_BYTES, range(WORD_BASE), stopping.stop, stopping.include_stop_str)


def _message(
    request: pb.GenerateRequest,
    script: Script,
    detok: IncrementalDetokenizer[pb.Token],
    j: int,
    s: int,
    max_tokens: int,
) -> pb.GenerateResponse:
    """Sample `s` at its token `j`: what the detokenizer releases, and the finish reason when the sample ends."""
    msg = pb.GenerateResponse(request_id=request.request_id, index=s)
    if j >= max_tokens:
        delta, msg.finish_reason = detok.flush(), pb.FINISH_REASON_LENGTH
    elif script.end_with and j == 1:
        delta, msg.finish_reason = Delta(), script.end_with
        msg.error_message = "engine failed" if script.end_with == pb.FINISH_REASON_ERROR else ""
    else:
        tid = script.token(j)
        delta = detok.add(tid, make_token(tid, j, logprob(j, s), j, request.logprobs))
        eos = tid == EOS and script.eos
        if delta.stop is not None:
            msg.finish_reason, msg.stop_reason = pb.FINISH_REASON_STOP, delta.stop
        elif eos or j + 1 >= max_tokens:
            rest = detok.flush()
            delta = Delta(delta.items + rest.items, delta.text + rest.text)
            msg.finish_reason = pb.FINISH_REASON_EOS if eos else pb.FINISH_REASON_LENGTH
    msg.tokens.extend(delta.items)
    msg.text = delta.text
    msg.finished = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return msg


class ScriptedServicer(pb_grpc.TextGenerationServicer):
    def __init__(self, model_id: str = MODEL_ID) -> None:
        self.model_id = model_id
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        kind = request.WhichOneof("prompt")
        if kind == "chat":
            prompt_ids = render_chat(list(request.chat.messages))
            script_text = request.chat.messages[-1].content
        elif kind == "text":
            prompt_ids = encode(request.text, True)
            script_text = request.text
        else:
            prompt_ids = list(request.token_ids.ids)
            script_text = decode(prompt_ids)
        script = script_for(script_text)
        if script.fail:
            await context.abort(*script.fail)
        n = request.n or 1
        if n > MAX_N:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"n must be at most {MAX_N}")
        if request.logprobs.top_logprobs > MAX_TOP:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"top_logprobs must be at most {MAX_TOP}")
        if any(i >= VOCAB_SIZE for i in prompt_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token id out of range")
        why = guided_error(request.guided) if request.HasField("guided") else None
        if why is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        has_max = request.stopping.HasField("max_tokens")
        max_tokens = request.stopping.max_tokens if has_max else CONTEXT - len(prompt_ids)
        opts = request.logprobs
        cached = cached_for(script_text, len(prompt_ids))
        try:
            if opts.prompt_logprobs:
                prompt = [
                    make_token(t, p, None if p == 0 else -1.0 - 0.01 * p, p, opts)
                    for p, t in enumerate(prompt_ids)
                ]
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    index=0,
                    prompt_tokens=prompt,
                    prompt_tokens_count=len(prompt_ids),
                    cached_prompt_tokens_count=cached,
                )
            first = set(range(n)) if request.return_prompt_token_ids else set()
            async for msg in self._samples(request, context, script, n, max_tokens, len(prompt_ids)):
                if msg.finished:
                    msg.cached_prompt_tokens_count = cached
                if msg.index in first:
                    first.discard(msg.index)
                    msg.prompt_token_ids.extend(prompt_ids)
                yield msg
        except (asyncio.CancelledError, GeneratorExit):
            # a cancel lands as CancelledError at an await, or as GeneratorExit when it finds the generator
            # suspended at a `yield` (grpc.aio then closes it): both mean the client's call was cancelled
            self.cancelled.append(request.request_id)
            raise

    async def _samples(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        script: Script,
        n: int,
        max_tokens: int,
        prompt_len: int,
    ):
        detoks = [detokenizer(request.stopping) for _ in range(n)]
        live = set(range(n))
        j = 0
        sent = 0
        while live:
            for s in sorted(live):
                msg = _message(request, script, detoks[s], j, s, max_tokens)
                if msg.finished:
                    msg.prompt_tokens_count = prompt_len
                    msg.completion_tokens_count = detoks[s].released_tokens
                    live.discard(s)
                elif not (msg.tokens or msg.text):
                    continue
                if script.fail_mid and sent == 1:
                    await context.abort(grpc.StatusCode.INTERNAL, "engine failed mid-stream")
                yield msg
                sent += 1
                if script.slow:
                    await asyncio.sleep(0.01)
            j += 1

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        ids = [i for i in request.token_ids if not (request.skip_special_tokens and is_special(i))]
        return pb.DetokenizeResponse(text=decode(ids))

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        if request.WhichOneof("input") == "chat":
            ids = render_chat(list(request.chat.messages))
        else:
            ids = encode(request.text, True)
        return pb.TokenizeResponse(token_ids=ids, token_bytes=[token_bytes(i) for i in ids])

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context):
        return pb.ModelInfo(
            model_id=self.model_id,
            vocab_size=VOCAB_SIZE,
            context_length=CONTEXT,
            max_top_logprobs=MAX_TOP,
            eos_token_ids=[EOS],
            slots=8,
            max_n=MAX_N,
            created=CREATED,
        )


class ScriptedBackend:
    """Runs the scripted servicer (and grpc health, SERVING) on 127.0.0.1 in a thread with its own loop."""

    def __init__(self, model_id: str = MODEL_ID) -> None:
        self.servicer = ScriptedServicer(model_id)
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self.health: health.aio.HealthServicer | None = None

    def start(self) -> ScriptedBackend:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._serve(ready))

        self._thread = threading.Thread(target=run, name="scripted-backend", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("scripted backend did not start")
        return self

    async def _serve(self, ready: threading.Event) -> None:
        server = grpc.aio.server()
        pb_grpc.add_TextGenerationServicer_to_server(self.servicer, server)
        self.health = health.aio.HealthServicer()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.address = f"127.0.0.1:{port}"
        self._stop = asyncio.Event()
        ready.set()
        await self._stop.wait()
        await server.stop(0)

    def set_serving(self, serving: bool) -> None:
        """Switch the gRPC health status (as a backend does before and after its warm-up)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self.health.set("", status), self._loop).result(5)

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread:
            self._thread.join(10)
