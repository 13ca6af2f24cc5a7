"""Function tools, shared by chat completions and the Responses API: the request models, what the backend gets
(`tools_json`, and the grammar for a forced call), and the parser that turns generated text into tool calls.

The backend renders the tools with the chat template's tools section, or with the generic tool prompt that asks
for Hermes-style lines `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (docs/http-api.md: tool calls). A forced
call (`tool_choice` "required" or a named function) is constrained by a JSON Schema for the bare JSON form
`{"name": ..., "arguments": {...}}` (a list of them for "required" with parallel calls), so it always parses.
The parser accepts both forms; "none" offers no tools at all (as vLLM does by default), so the answer is text.

For the Responses API (flat tools: {type: "function", name, description, parameters, strict}), build
`FunctionSpec`s and call: `check_functions(specs, param)`, `check_choice(choice, specs, param)`,
`tools_json(specs)`, `forced_call_grammar(specs, choice, parallel)`, `parse_tool_calls(text, names)` (or
`ToolCallStream` when streaming) and `new_call_id()`.
"""

from __future__ import annotations

import copy
import json
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from tpuserve.http_gateway.errors import invalid_request, missing_parameter, unsupported
from tpuserve.http_gateway.structured import check_format_name, check_schema_depth, guided_json_schema
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}  # a function without `parameters`
_ID_ALPHABET = string.ascii_letters + string.digits
_DEF_KEYS = ("$defs", "definitions")  # where a pydantic / draft-07 schema keeps the targets of its $refs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- request models (chat shape) ---------------------------------------------------------------------------


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: forced calls are always constrained, "auto" ones never are


class ChatTool(BaseModel):
    """One entry of chat's `tools`. Other tool types (custom, built-in) are refused by `chat_functions`, which
    names their type; so extra keys are let through here only to be reported there."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    function: FunctionDefinition | None = None


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceMode = Literal["none", "auto", "required"]
ToolChoice = ToolChoiceMode | NamedToolChoice


@dataclass(frozen=True)
class FunctionSpec:
    """A function tool, whichever API it came from."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


def chat_functions(tools: Sequence[ChatTool], param: str = "tools") -> list[FunctionSpec]:
    """Chat's `tools` as FunctionSpecs; a tool of another type, or with fields we do not know, is a 400 naming it."""
    specs = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if tool.type != "function":
            raise unsupported(
                f"{where}.type", f"Only 'function' tools are supported, not '{tool.type[:40]}'."
            )
        if tool.model_extra:
            extra = min(tool.model_extra)
            raise invalid_request(
                f"Unrecognized request argument supplied: {where}.{extra}",
                f"{where}.{extra}",
                "unknown_parameter",
            )
        if tool.function is None:
            raise missing_parameter(f"{where}.function")
        f = tool.function
        specs.append(FunctionSpec(f.name, f.description, f.parameters))
    return specs


def check_functions(specs: Sequence[FunctionSpec], param: str = "tools", nested: str = ".function") -> None:
    """Names the spec allows, each once; `nested` is where the name sits in one entry (chat: `.function`)."""
    if len(specs) > MAX_TOOLS:
        raise invalid_request(
            f"Invalid '{param}': at most {MAX_TOOLS} tools are allowed.", param, "array_above_max_length"
        )
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        check_format_name(spec.name, f"{param}[{i}]{nested}.name")
        if spec.parameters is not None:
            check_schema_depth(spec.parameters, f"{param}[{i}]{nested}.parameters")
        if spec.name in seen:
            raise invalid_request(
                f"Invalid '{param}': the function name '{spec.name}' is used twice.",
                f"{param}[{i}]{nested}.name",
                "invalid_value",
            )
        seen.add(spec.name)


def check_choice(
    choice: ToolChoice | None, specs: Sequence[FunctionSpec], param: str = "tool_choice"
) -> None:
    """A choice other than "none" needs tools; a named function must be one of them."""
    if choice is None or choice == "none":
        return
    if not specs:
        raise invalid_request(
            f"Invalid value for '{param}': '{param}' is only allowed when 'tools' are specified.",
            param,
            "invalid_value",
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {s.name for s in specs}:
        raise invalid_request(
            f"Invalid value for '{param}': no function named '{choice.function.name[:80]}' is in 'tools'.",
            param,
            "invalid_value",
        )


def effective_choice(choice: ToolChoice | None, specs: Sequence[FunctionSpec]) -> ToolChoice:
    """OpenAI's defaults: "auto" when tools are given, "none" otherwise."""
    if choice is None:
        return "auto" if specs else "none"
    return choice


# ---- what the backend gets -----------------------------------------------------------------------------------


def tools_json(specs: Sequence[FunctionSpec]) -> str:
    """The proto's `ChatMessages.tools_json`: OpenAI's chat `tools` list, which chat templates expect."""
    out = []
    for s in specs:
        function: dict[str, Any] = {"name": s.name}
        if s.description is not None:
            function["description"] = s.description
        function["parameters"] = s.parameters if s.parameters is not None else EMPTY_ARGUMENTS
        out.append({"type": "function", "function": function})
    return json.dumps(out, ensure_ascii=False)


def forced_call_grammar(
    specs: Sequence[FunctionSpec], choice: ToolChoice, parallel: bool, param: str = "tools"
) -> pb.GuidedDecoding | None:
    """The constraint for "required" (one call, or a list of calls when `parallel`) and for a named function
    (exactly one call of it); None for "auto" and "none". The arguments follow each function's `parameters`;
    their `$defs` move to the root, where their `$ref`s point."""
    if isinstance(choice, NamedToolChoice):
        chosen = [s for s in specs if s.name == choice.function.name]
        parallel = False
    elif choice == "required":
        chosen = list(specs)
    else:
        return None
    defs: dict[str, dict[str, Any]] = {}
    calls = [_call_schema(s, defs, param) for s in chosen]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": one} if parallel else dict(one)
    for key, targets in defs.items():
        if targets:
            schema[key] = targets
    return guided_json_schema(schema, param)


def _call_schema(spec: FunctionSpec, defs: dict[str, dict[str, Any]], param: str) -> dict[str, Any]:
    arguments = copy.deepcopy(spec.parameters) if spec.parameters else dict(EMPTY_ARGUMENTS)
    for key in _DEF_KEYS:
        targets = arguments.pop(key, None) or {}
        if not isinstance(targets, dict):
            raise invalid_request(
                f"Invalid '{param}': '{key}' in the parameters of '{spec.name}' must be an object.",
                param,
                "invalid_value",
            )
        for name, target in targets.items():
            known = defs.setdefault(key, {})
            if name in known and known[name] != target:
                raise invalid_request(
                    f"Invalid '{param}': the schema definition '{key}/{name}' differs between functions; forced "
                    "calls need one meaning per name.",
                    param,
                    "invalid_value",
                )
            known[name] = target
    return {
        "type": "object",
        "properties": {"name": {"const": spec.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ---- generated text -> tool calls ----------------------------------------------------------------------------


def new_call_id() -> str:
    """A tool call id in OpenAI's form: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    """A sample's text split into content (None when there is none) and its tool calls."""

    content: str | None
    calls: list[ParsedCall]


def parse_tool_calls(text: str, names: Sequence[str]) -> ParsedOutput | None:
    """The tool calls in `text`, or None when it is no tool call (it is then all content).

    Two forms: `<tool_call>{json}</tool_call>` blocks (content is the text before the first block; the blocks
    may be separated by whitespace only; the last may lack its closing tag), or the whole text being one bare
    JSON call `{"name": ..., "arguments": {...}}` or a list of them. A call of a function not in `names`, or
    JSON that does not parse, makes the whole text content."""
    start = text.find(TOOL_CALL_OPEN)
    if start >= 0:
        calls = _blocks(text[start:], names)
        content = text[:start]
        return ParsedOutput(content if content.strip() else None, calls) if calls else None
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply for the parser
        return None
    items = value if isinstance(value, list) else [value]
    calls = _calls(items, names)
    return ParsedOutput(None, calls) if calls else None


def _blocks(text: str, names: Sequence[str]) -> list[ParsedCall] | None:
    items = []
    rest = text
    while rest:
        if not rest.startswith(TOOL_CALL_OPEN):
            return None
        body_start = len(TOOL_CALL_OPEN)
        end = rest.find(TOOL_CALL_CLOSE, body_start)
        body = rest[body_start:] if end < 0 else rest[body_start:end]
        try:
            items.append(json.loads(body))
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply for the parser
            return None
        rest = "" if end < 0 else rest[end + len(TOOL_CALL_CLOSE) :].lstrip()
    return _calls(items, names)


def _calls(items: list[Any], names: Sequence[str]) -> list[ParsedCall] | None:
    calls = []
    for item in items:
        if not isinstance(item, dict) or set(item) - {"name", "arguments", "parameters"}:
            return None
        name = item.get("name")
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply for the parser
                return None
        if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
            return None
        try:
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
        except RecursionError:  # as deep as the parser allows, deeper than the encoder does
            return None
    return calls or None


# ---- streaming ---------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """Text and the tokens that made it (whatever the caller's token type), released together."""

    text: str
    tokens: list[Any] = field(default_factory=list)


class ToolCallStream:
    """One sample's streamed text when it may hold tool calls: text that cannot belong to a call is released as
    it comes; the rest is held until the sample ends and then parsed as a whole, as `parse_tool_calls` parses
    the non-streamed text (so both give the same content and calls).

    Held: leading whitespace; everything from a leading `{` or `[` (a bare JSON call); everything from the first
    `<tool_call>`, and a trailing piece of text that may begin one. Pieces are released whole (the backend's
    messages keep text and tokens aligned), so each released piece's tokens are exactly its text's."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._released = ""
        self._held: list[Piece] = []
        self._hold_all = False

    def feed(self, piece: Piece) -> list[Piece]:
        """Pieces safe to show as content now (in order)."""
        self._held.append(piece)
        if self._hold_all:
            return []
        text = self._released + "".join(p.text for p in self._held)
        safe = self._safe_end(text)
        out = []
        end = len(self._released)
        while self._held and end + len(self._held[0].text) <= safe:
            p = self._held.pop(0)
            end += len(p.text)
            out.append(p)
        self._released = text[:end]
        return out

    def _safe_end(self, text: str) -> int:
        """How much of `text` is content whatever comes next. Nothing is released before some non-whitespace
        content: whitespace alone before the calls is no content (`parse_tool_calls` says None)."""
        if not self._released and text.lstrip().startswith(("{", "[")):
            self._hold_all = True
            return 0
        safe = text.find(TOOL_CALL_OPEN)
        if safe >= 0:
            self._hold_all = True
        else:
            safe = len(text) - _open_prefix_len(text)
        return safe if text[:safe].strip() else 0

    def finish(self) -> tuple[ParsedOutput | None, Piece]:
        """At the sample's end: the parse of the whole text (None: no calls), and the rest to send: the content
        not yet released (with calls: the part of `parsed.content` after what was released; without: all held
        text) with every held token."""
        held = "".join(p.text for p in self._held)
        tokens = [t for p in self._held for t in p.tokens]
        self._held = []
        parsed = parse_tool_calls(self._released + held, self.names)
        rest = held if parsed is None else (parsed.content or "")[len(self._released) :]
        self._released += rest
        return parsed, Piece(rest, tokens)

    @property
    def released(self) -> str:
        return self._released


def _open_prefix_len(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>` (0 if none)."""
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return k
    return 0
