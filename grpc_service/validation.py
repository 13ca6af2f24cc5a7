"""GenerateRequest -> GenerationJob, or InvalidRequest naming the offending field."""

from __future__ import annotations

import json
import math
import secrets
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpuserve.grpc_service.jobs import GenerationJob
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.sampler.api import MAX_TOP_LOGPROBS, SlotParams
from tpuserve.sampler.state import MAX_STOP_IDS, SEED_RANGE

if TYPE_CHECKING:
    from tpuserve.grpc_service.guided import Grammars
    from tpuserve.model.tokenizer import Tokenizer


class InvalidRequest(ValueError):
    """A client error; the servicer answers INVALID_ARGUMENT with "<field>: <message>"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # the tokenizer's ids are 0..vocab_size-1
    context_length: int  # prompt + generated tokens: the engine's S, or its KV pool's tokens when fewer
    max_n: int
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_prompt_tokens: int | None = None  # the server's own cap (below the context length); None = none
    pool_tokens: int | None = None  # the longest prompt the engine's KV pool can hold, when below the context


def _json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequest(field, f"not valid JSON: {e}") from None


def _message(m: pb.ChatMessage, field: str) -> dict[str, Any]:
    """One message in the shape chat templates (transformers' apply_chat_template) read."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _json(c.arguments, f"{field}.tool_calls[{k}].arguments")}}
            for k, c in enumerate(m.tool_calls)
        ]  # fmt: skip
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def chat_messages(
    chat: pb.ChatMessages, field: str = "chat"
) -> tuple[list[dict[str, Any]], bool, list | None, dict[str, Any] | None]:
    """Messages as the tokenizer's `render_chat` takes them, add_generation_prompt (default true), the tools
    (None when none are offered) and the further chat-template arguments (None when none)."""
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    messages = [_message(m, f"{field}.messages[{n}]") for n, m in enumerate(chat.messages)]
    tools = _json(chat.tools_json, f"{field}.tools_json") if chat.tools_json else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequest(f"{field}.tools_json", "must be a JSON list of tool objects")
    kwargs = None
    if chat.chat_template_kwargs_json:
        kwargs = _json(chat.chat_template_kwargs_json, f"{field}.chat_template_kwargs_json")
        if not isinstance(kwargs, dict):
            raise InvalidRequest(f"{field}.chat_template_kwargs_json", "must be a JSON object")
    return messages, add, tools or None, kwargs or None


def render_chat(tokenizer: Tokenizer, chat: pb.ChatMessages, field: str) -> tuple[str, list[int]]:
    messages, add, tools, kwargs = chat_messages(chat, field)
    if not messages:
        raise InvalidRequest(f"{field}.messages", "at least one message is required")
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=add, tools=tools, template_kwargs=kwargs)
    except ValueError as e:
        raise InvalidRequest(field, str(e)) from None


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                field, f"token id {token} at position {position} is outside the vocabulary [0, {vocab_size})"
            )


def prompt_ids(request: pb.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("prompt.text", "the prompt is empty")
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = tokenizer.encode(request.text, add_special_tokens=add)
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequest("prompt.token_ids", "the prompt is empty")
        check_token_ids(ids, limits.vocab_size, "prompt.token_ids")
    elif kind == "chat":
        ids = render_chat(tokenizer, request.chat, "prompt.chat")[1]
    else:
        raise InvalidRequest("prompt", "a prompt is required: text, token_ids or chat")
    if not ids:
        raise InvalidRequest("prompt", "the prompt has no tokens")
    if limits.pool_tokens is not None and len(ids) > limits.pool_tokens:
        raise InvalidRequest(
            "prompt",
            f"the prompt has {len(ids)} tokens, more than this server's KV cache holds ({limits.pool_tokens} tokens)",
        )
    if len(ids) > limits.context_length:
        raise InvalidRequest(
            "prompt",
            f"the prompt has {len(ids)} tokens, more than the context length {limits.context_length}",
        )
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            "prompt",
            f"the prompt has {len(ids)} tokens, more than this server's max_prompt_tokens {limits.max_prompt_tokens}",
        )
    return ids


MAX_CACHE_SALT = 256  # characters, as the gateway's bound


def _cache_salt(request: pb.GenerateRequest) -> str | None:
    if not request.HasField("cache_salt"):
        return None
    if not 0 < len(request.cache_salt) <= MAX_CACHE_SALT:
        raise InvalidRequest("cache_salt", f"1 to {MAX_CACHE_SALT} characters, got {len(request.cache_salt)}")
    return request.cache_salt


def _sampling(s: pb.SamplingParams) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    if s.HasField("temperature"):
        if not s.temperature >= 0 or math.isinf(s.temperature):
            raise InvalidRequest("sampling.temperature", f"must be a number >= 0, got {s.temperature}")
        out["temperature"] = s.temperature
    if s.HasField("top_p"):
        if not 0 < s.top_p <= 1:
            raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
        out["top_p"] = s.top_p
    if s.HasField("top_k"):
        if s.top_k < 0:
            raise InvalidRequest("sampling.top_k", f"must be >= 0 (0 disables it), got {s.top_k}")
        out["top_k"] = s.top_k
    if s.HasField("min_p"):
        if not 0 <= s.min_p <= 1:
            raise InvalidRequest("sampling.min_p", f"must be in [0, 1], got {s.min_p}")
        out["min_p"] = s.min_p
    return out


def _max_tokens(request: pb.GenerateRequest, prompt_len: int, limits: Limits) -> int:
    stopping, room = request.stopping, limits.context_length - prompt_len
    if not stopping.HasField("max_tokens"):
        if room <= 0:
            raise InvalidRequest(
                "prompt",
                f"the prompt has {prompt_len} tokens and fills the context length {limits.context_length}",
            )
        return room
    m = stopping.max_tokens
    if m < 0:
        raise InvalidRequest("stopping.max_tokens", f"must be >= 0, got {m}")
    if m == 0 and not request.logprobs.prompt_logprobs:
        raise InvalidRequest(
            "stopping.max_tokens", "0 is only allowed with logprobs.prompt_logprobs (scoring)"
        )
    if m > room:
        raise InvalidRequest(
            "stopping.max_tokens",
            f"the prompt has {prompt_len} tokens and max_tokens is {m}: {prompt_len + m} exceeds the context "
            f"length {limits.context_length}",
        )
    return m


def stop_ids(
    stopping: pb.StoppingCriteria, eos_ids: tuple[int, ...]
) -> tuple[frozenset[int], tuple[int, ...]]:
    """(the EOS ids that end a sample, every id the engine stops at). The request's stop ids and the model's EOS
    ids (unless `ignore_eos`) share the engine's MAX_STOP_IDS places."""
    eos = frozenset() if stopping.ignore_eos else frozenset(eos_ids)
    ids = tuple(sorted(eos | set(stopping.stop_token_ids)))
    if len(ids) > MAX_STOP_IDS:
        with_eos = f", counting the model's end-of-sequence ids {sorted(eos)}" if eos else ""
        raise InvalidRequest(
            "stopping.stop_token_ids",
            f"at most {MAX_STOP_IDS} distinct stop ids{with_eos}; this request has {len(ids)}",
        )
    return eos, ids


def _grammar(request: pb.GenerateRequest, grammars: Grammars | None) -> str | None:
    if not request.HasField("guided"):
        return None
    if grammars is None:
        raise InvalidRequest("guided", "this server has no structured outputs")
    from tpuserve.grpc_service.guided import GuidedError

    try:
        return grammars.compile(request.guided)
    except GuidedError as e:
        raise InvalidRequest(e.field, str(e)) from None


def build_job(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer,
    limits: Limits,
    eos_ids: tuple[int, ...],
    grammars: Grammars | None = None,
) -> GenerationJob:
    """Validate everything before the request takes a place in the queue."""
    n = request.n or 1
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest("n", f"must be in 1..{limits.max_n}, got {request.n}")
    top = request.logprobs.top_logprobs
    if not 0 <= top <= limits.max_top_logprobs:
        raise InvalidRequest("logprobs.top_logprobs", f"must be in 0..{limits.max_top_logprobs}, got {top}")
    sampling = _sampling(request.sampling)
    cache_salt = _cache_salt(request)
    stopping = request.stopping
    if any(not s for s in stopping.stop):
        raise InvalidRequest("stopping.stop", "stop strings must not be empty")
    check_token_ids(list(stopping.stop_token_ids), limits.vocab_size, "stopping.stop_token_ids")
    eos, stops = stop_ids(stopping, eos_ids)
    ids = prompt_ids(request, tokenizer, limits)
    max_tokens = _max_tokens(request, len(ids), limits)
    grammar = _grammar(request, grammars)

    seed = request.sampling.seed if request.sampling.HasField("seed") else secrets.randbelow(SEED_RANGE)
    samples = tuple(  # sample i's seed is seed + i, wrapping within the engine's 64-bit seeds
        SlotParams(max_tokens=max_tokens, seed=(seed + i) % SEED_RANGE, stop_ids=stops, **sampling)
        for i in range(n)
    )
    return GenerationJob(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=tuple(ids),
        samples=samples,
        stop=tuple(stopping.stop),
        include_stop_str=stopping.include_stop_str,
        stop_token_ids=frozenset(stopping.stop_token_ids),
        eos_ids=eos,
        prompt_logprobs=request.logprobs.prompt_logprobs,
        cache_salt=cache_salt,
        grammar=grammar,
        return_prompt_token_ids=request.return_prompt_token_ids,
    )
