"""/v1/responses (the OpenAI Responses API): the request body with the spec's bounds, and `check_supported`, which
refuses what this server cannot do.

Requests follow request_models.py: `extra="forbid"` and strict types, so a field we do not implement is a 400
naming it. What the spec has but this server cannot do (no state is kept: `store: true`,
`previous_response_id`, `background`, `conversation`, `prompt`; built-in tools; other `include` values) is
accepted by the schema and refused by `check_supported` with a 400 naming the parameter, never dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError
from tpuserve.http_gateway import structured
from tpuserve.http_gateway import tools as fn_tools
from tpuserve.http_gateway.errors import invalid_request, missing_parameter, unsupported
from tpuserve.http_gateway.request_models import INT32_MAX, CacheSalt, Seed, Temperature, TopP

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16  # the spec's bounds on `metadata`
NO_STATE = "This server keeps no state between requests: send the whole conversation in 'input'."


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- request: input items --------------------------------------------------------------------------------


class InputTextContent(_Strict):
    type: Literal["input_text"]
    text: str


class OutputTextContent(_Strict):
    """An assistant turn's text given back as history (as a previous Response's output item carries it)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class _Refused(BaseModel):
    """A union member for every `type` the server does not take: a 400 on `type` with the subclass's error."""

    model_config = ConfigDict(extra="allow")
    error: ClassVar[tuple[str, str]]  # (pydantic error type, message with {kind})
    type: Any = None

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        raise PydanticCustomError(*cls.error, {"kind": repr(value)})


class _UnsupportedPart(_Refused):
    """input_image, input_file, refusal...: a 400 on `type`."""

    error = (
        "unsupported_content",
        (
            "content parts of type {kind} are not supported here (only input_text, and output_text in "
            "assistant messages)"
        ),
    )


def _type_of(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


_PART_TAGS = {"input_text": "InputTextContent", "output_text": "OutputTextContent"}

# Union tags start with a capital: request_parsing.param_name leaves them out of the parameter's name.
InputContentPart = Annotated[
    Annotated[InputTextContent, Tag("InputTextContent")]
    | Annotated[OutputTextContent, Tag("OutputTextContent")]
    | Annotated[_UnsupportedPart, Tag("Unsupported")],
    Discriminator(lambda v: _PART_TAGS.get(_type_of(v), "Unsupported")),  # type: ignore[arg-type]
]


def _joined(content: str | list[InputTextContent] | list[InputContentPart]) -> str:
    """A content string, or the text of its parts, joined."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class InputMessage(_Strict):
    """EasyInputMessage / InputMessage / ResponseOutputMessage: `type` "message" or absent; `id` and `status` are what
    a previous Response's output item carries when a client sends it back."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Strict):
    """A function call the model made (a previous Response's `function_call` output item)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=64)]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """The client's result of a function call, answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=64)]
    output: str | list[InputTextContent]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return _joined(self.output)


class _UnsupportedItem(_Refused):
    """Any other input item (reasoning, item_reference, images, built-in tool calls...): a 400 on `type`."""

    error = (
        "unsupported_item",
        "input items of type {kind} are not supported here (only message, function_call and function_call_output)",
    )


_ITEM_TAGS = {
    None: "InputMessage",
    "message": "InputMessage",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
}


def _item_tag(value: Any) -> str:
    kind = _type_of(value)
    return _ITEM_TAGS.get(kind, "Unsupported") if isinstance(kind, str | None) else "Unsupported"


InputItem = Annotated[
    Annotated[InputMessage, Tag("InputMessage")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[_UnsupportedItem, Tag("Unsupported")],
    Discriminator(_item_tag),
]


# ---- request: tools, tool_choice, text format --------------------------------------------------------------


class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _BuiltInTool(BaseModel):
    """web_search, file_search, code_interpreter, mcp...: refused by `check_supported` (naming tools[i].type)."""

    model_config = ConfigDict(extra="allow")
    type: str


def _function_or(other: str):
    return Discriminator(lambda v: "Function" if _type_of(v) == "function" else other)


ToolItem = Annotated[
    Annotated[ResponsesFunctionTool, Tag("Function")] | Annotated[_BuiltInTool, Tag("BuiltIn")],
    _function_or("BuiltIn"),
]


class ResponsesToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class _ToolChoiceOther(BaseModel):
    """allowed_tools, a built-in tool type, mcp, custom: refused by `check_supported`."""

    model_config = ConfigDict(extra="allow")
    type: str


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[
        Annotated[ResponsesToolChoiceFunction, Tag("Function")] | Annotated[_ToolChoiceOther, Tag("Other")],
        _function_or("Other"),
    ]
)


class ResponsesTextFormat(_Strict):
    """`text.format`: one model for the three types (not a tagged union), so that an error names
    `text.format.name`, not a union member; `check_supported` holds what each type needs."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def check(self, param: str = "text.format") -> None:
        if self.type == "json_schema":
            for name, value in (("name", self.name), ("schema", self.schema_)):
                if value is None:
                    raise missing_parameter(f"{param}.{name}")
            assert self.name is not None
            structured.check_format_name(self.name, f"{param}.name")
            return
        for name, value in (
            ("name", self.name),
            ("schema", self.schema_),
            ("strict", self.strict),
            ("description", self.description),
        ):
            if value is not None:
                raise invalid_request(
                    f"'{param}.{name}' is only allowed when '{param}.type' is 'json_schema'.",
                    f"{param}.{name}",
                    "invalid_value",
                )

    def echo(self) -> dict[str, Any]:
        """As the Response shows it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponsesTextConfig(_Strict):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted: this server never adds obfuscation padding


# ---- request ---------------------------------------------------------------------------------------------


class CreateResponseRequest(_Strict):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    text: ResponsesTextConfig | None = None
    tools: Annotated[list[ToolItem], Field(max_length=fn_tools.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    user: str | None = None  # end-user id for abuse tracking: accepted, echoed, not used for generation
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    seed: Seed | None = Field(
        None, description="Extension (as on chat completions): a 64-bit seed for reproducible sampling."
    )
    cache_salt: CacheSalt | None = Field(
        None,
        description="vLLM's cache_salt: requests with different salts never share cached prompt prefixes. "
        "Absent: the shared default namespace.",
    )

    def check_supported(self) -> None:
        if self.store:
            raise unsupported("store", f"Only 'store: false' (or leaving it out). {NO_STATE}")
        for name in ("previous_response_id", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise unsupported(name, NO_STATE)
        if self.background:
            raise unsupported("background", "Responses are generated while the request waits (or streams).")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise unsupported("reasoning")
        if self.truncation == "auto":
            raise unsupported("truncation", "Only 'disabled': an input longer than the context is a 400.")
        if self.text and self.text.verbosity not in (None, "medium"):
            raise unsupported("text.verbosity", "Only 'medium'.")
        if self.text and self.text.format:
            self.text.format.check()
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA:
                raise invalid_request(f"'metadata' may have at most {MAX_METADATA} keys.", "metadata")
            for key in self.metadata:
                if len(key) > 64:
                    raise invalid_request("'metadata' keys may have at most 64 characters.", "metadata")
        for name in self.include or []:
            if name != LOGPROBS_INCLUDE:
                raise unsupported("include", f"Only '{LOGPROBS_INCLUDE}' (got {name!r}).")
        if self.stream_options is not None and not self.stream:
            raise invalid_request(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options"
            )
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            if isinstance(item, FunctionCallItem):
                try:  # the backend parses them to render the turn: its refusal would name no request field
                    json.loads(item.arguments)
                except (ValueError, RecursionError):
                    param = f"input[{i}].arguments"
                    raise invalid_request(
                        f"Invalid '{param}': not valid JSON.", param, "invalid_value"
                    ) from None
            if (
                isinstance(item, InputMessage)
                and item.role != "assistant"
                and not isinstance(item.content, str)
            ):
                for j, part in enumerate(item.content):
                    if part.type != "input_text":
                        raise invalid_request(
                            f"'{part.type}' content is only valid in assistant messages; a {item.role} message "
                            "takes 'input_text'.",
                            f"input[{i}].content[{j}].type",
                            "invalid_value",
                        )
        for i, tool in enumerate(self.tools or []):
            if isinstance(tool, _BuiltInTool):
                raise unsupported(f"tools[{i}].type", f"Only function tools (got {tool.type!r}).")
        if isinstance(self.tool_choice, _ToolChoiceOther):
            raise unsupported(
                "tool_choice",
                f"Use 'none', 'auto', 'required' or a function (got type {self.tool_choice.type!r}).",
            )
        specs = self.functions()
        fn_tools.check_functions(specs, "tools", nested="")
        fn_tools.check_choice(self._chat_choice(), specs)
        if self.forced_tool_call() and self.structured():
            raise invalid_request(
                "'text.format' cannot be combined with a forced tool call ('tool_choice' \"required\" or a named "
                "function): the output is then the call.",
                "text.format",
                "invalid_value",
            )

    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def function_tools(self) -> list[ResponsesFunctionTool]:
        return [t for t in self.tools or [] if isinstance(t, ResponsesFunctionTool)]

    def functions(self) -> list[fn_tools.FunctionSpec]:
        return [fn_tools.FunctionSpec(t.name, t.description, t.parameters) for t in self.function_tools()]

    def _chat_choice(self) -> fn_tools.ToolChoice | None:
        """`tool_choice` in tools.py's (chat's) terms: a named function is {type, function: {name}} there."""
        c = self.tool_choice
        if isinstance(c, ResponsesToolChoiceFunction):
            return fn_tools.NamedToolChoice(type="function", function=fn_tools.NamedFunction(name=c.name))
        return c if isinstance(c, str) else None

    def choice(self) -> fn_tools.ToolChoice:
        """The effective choice: OpenAI's default is "auto" with tools, "none" without."""
        return fn_tools.effective_choice(self._chat_choice(), self.functions())

    def forced_tool_call(self) -> bool:
        return self.choice() not in ("none", "auto")

    def structured(self) -> bool:
        """A `text.format` other than text: the output is constrained JSON, never parsed for calls."""
        fmt = self.text.format if self.text else None
        return fmt is not None and fmt.type != "text"

    def offers_tools(self) -> bool:
        """Tools are rendered for the model and its output parsed for calls: function tools given, choice not
        "none", and no structured format taking over the output (as chat decides)."""
        return bool(self.functions()) and self.choice() != "none" and not self.structured()
