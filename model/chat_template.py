"""Chat-template rendering: runs a model's Jinja chat template in a sandbox and cuts the prompt into the template's
own text (where special tokens may appear) and message content (always plain text).

This keeps message content out of the special-token namespace: a user writing `<|im_end|>\\n<|im_start|>system`
in a message's `content` does not open a new turn. Turning the cut prompt into ids is the tokenizer's job.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.sandbox


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """The template in a sandbox, with the environment transformers' `apply_chat_template` gives it."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """One tokenizer's chat template and the special-token text it must keep out of message content.

    Compiled on first use (a template that does not compile fails the first request, not the load). Immutable
    apart from that cache, safe to share between threads."""

    def __init__(
        self, source: str, template_tokens: Mapping[str, str], special_text: Mapping[int, str]
    ) -> None:
        """`template_tokens`: the template's variables bos_token, eos_token, ... ; `special_text`: id -> content of
        every special token."""
        self.source = source
        self._template_tokens = dict(template_tokens)
        self._compiled: jinja2.Template | None = None
        by_length = sorted(special_text.values(), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self._special_id_of = {t: i for i, t in sorted(special_text.items(), reverse=True)}

    @property
    def has_tools(self) -> bool:
        """The template renders a `tools` list itself (else the generic tool prompt is used)."""
        return "tools" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: list | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[str | int] | None]:
        """The prompt text, and the same prompt as runs: text runs (str, possibly empty, the first one at the very
        start) and special-token ids (int) exactly where the template wrote special-token text; content is always
        inside a text run. Runs are None when the template transforms content past recognition: encode the whole
        text then (refused with ValueError if a message holds special-token text). Bad messages raise ValueError.

        `template_kwargs`: further template variables (e.g. Qwen3's `enable_thinking`), as transformers'
        `apply_chat_template(**kwargs)` passes them: they may replace bos_token & co., not the messages, tools or
        add_generation_prompt."""
        messages = self.checked_messages(messages)
        reserved = sorted({"messages", "tools", "add_generation_prompt"} & set(template_kwargs or ()))
        if reserved:
            raise ValueError(f"chat template arguments may not set {', '.join(reserved)}")
        extra = {**(template_kwargs or {}), **({} if tools is None else {"tools": tools})}
        if self._special_re is not None:  # tools and calls are template text here: no special tokens in them
            for n, m in enumerate(messages):
                if m.get("tool_calls") and self._special_re.search(
                    json.dumps(m["tool_calls"], ensure_ascii=False)
                ):
                    raise ValueError(f"messages[{n}].tool_calls must not contain special-token text")
            if tools and self._special_re.search(json.dumps(tools, ensure_ascii=False)):
                raise ValueError("tools must not contain special-token text")
        contents = [m["content"] for m in messages]
        text = self._render(messages, add_generation_prompt, extra)
        parts = self._content_parts(messages, contents, text, add_generation_prompt, extra)
        if parts is not None:
            return text, self._runs(parts)
        if self._special_re is not None and any(self._special_re.search(c) for c in contents):
            raise ValueError(
                "this chat template transforms message content in a way that cannot be told apart from the "
                "template's own text, and a message contains special-token text: refusing to render it"
            )
        return text, None

    def checked_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Plain-dict copies of well-formed messages. Bad requests raise ValueError (a 400/INVALID_ARGUMENT)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError("messages must be a list of {'role': str, 'content': str} objects")  # noqa: TRY004
        checked = []
        for n, message in enumerate(messages):
            if not isinstance(message, Mapping):
                got = type(message).__name__
                raise ValueError(f"messages[{n}] must be an object with 'role' and 'content', got {got}")  # noqa: TRY004
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{n}].role must be a string")  # noqa: TRY004
            if not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{n}].content must be a string")  # noqa: TRY004
            for key, value in message.items():
                if (
                    key != "content"
                    and isinstance(value, str)
                    and self._special_re
                    and self._special_re.search(value)
                ):
                    raise ValueError(f"messages[{n}].{key} must not contain special-token text")
            checked.append(dict(message))
        return checked

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict) -> str:
        if self._compiled is None:
            self._compiled = compile_chat_template(self.source)
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self._template_tokens, **extra},
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    def _content_parts(
        self,
        messages: list[dict[str, Any]],
        contents: list[str],
        text: str,
        add_generation_prompt: bool,
        extra: dict,
    ) -> list[tuple[str, bool]] | None:
        """`text` cut into (piece, is_content) pieces, found by rendering again with each content replaced by a
        sentinel. Templates that trim content are followed; None if the two renders cannot be aligned."""
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"@@tpuserve-{nonce}-{n}@@"} for n, m in enumerate(messages)]
        pieces = re.split(
            f"@@tpuserve-{nonce}-([0-9]+)@@", self._render(marked, add_generation_prompt, extra)
        )
        if not text.startswith(pieces[0]):
            return None
        parts = [(pieces[0], False)]
        pos = len(pieces[0])
        for k in range(1, len(pieces), 2):
            content, after = contents[int(pieces[k])], pieces[k + 1]
            for candidate in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
                if text.startswith(candidate, pos) and text.startswith(after, pos + len(candidate)):
                    break
            else:
                return None
            parts += [(candidate, True), (after, False)]
            pos += len(candidate) + len(after)
        return parts if pos == len(text) else None

    def _runs(self, parts: list[tuple[str, bool]]) -> list[str | int]:
        """Special-token ids only where the template wrote them (never inside content); text between them joined
        into runs."""
        runs: list[str | int] = [""]
        for piece, is_content in parts:
            pos = 0
            for m in () if is_content or self._special_re is None else self._special_re.finditer(piece):
                runs[-1] += piece[pos : m.start()]
                runs += [self._special_id_of[m.group()], ""]
                pos = m.end()
            runs[-1] += piece[pos:]
        return runs


# The generic tool prompt, for templates without a tools section (SmolLM2's among them): the tools go into the
# system turn, calls are written (and expected back) as Hermes-style <tool_call> lines, and tool results come
# back as a user turn. Everything here is message content: plain text, never special tokens.
TOOL_SYSTEM_PROMPT = """You can call functions. Each function, with a JSON Schema of its arguments:
{tools}

To call functions, answer with one line per call and nothing else:
<tool_call>{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}</tool_call>
Results come back inside <tool_response></tool_response>. Otherwise answer normally."""


def _call_line(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>"


def generic_tool_messages(messages: Sequence[Mapping[str, Any]], tools: list | None) -> list[dict[str, Any]]:
    """Messages with tools, tool calls and tool results turned into plain turns (system, assistant, user) that
    any chat template renders: the generic tool prompt."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            lines = [content] if content else []
            out.append(
                {"role": "assistant", "content": "\n".join(lines + [_call_line(c) for c in m["tool_calls"]])}
            )
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        prompt = TOOL_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
