"""Tool (function) calling for chat completions: the request's ``tools`` and ``tool_choice``, the
grammar a forced call is generated under, and a choice's output turned into OpenAI ``tool_calls``,
whole or as stream deltas.

``tool_choice`` (default ``auto`` when there are tools):
- ``none``: plain text. The tools stay in the prompt, so the prompt and its cached prefix are the
  same as the conversation's other turns.
- ``auto``: free generation; calls are read from the text in the format ``--tool-call-parser``
  names: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what the
  built-in chat template writes, Qwen 2.5 / Hermes models) or ``llama3_json`` (the whole answer is
  ``{"name": ..., "parameters": {...}}``, several joined by ``;``, Llama 3.1+). With hermes, what
  follows a ``<tool_call>`` is also constrained to a valid call (``auto_grammar``). Where the tags
  are special tokens, the request's text shows them to this reader (worker.guided). Text that does
  not parse as a call stays content: nothing the model wrote is dropped.
- ``required``: the output is constrained (worker.guided) to a JSON list of at least one
  ``{"name": <a tool>, "parameters": <its schema>}`` (exactly one when ``parallel_tool_calls`` is
  false), each item a call; one cut off by max_tokens keeps the calls read so far, whole or streamed.
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's parameters
  schema and is that call's arguments, streamed as argument deltas as they are generated.

A message that carries calls and ended naturally finishes with ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from router.chat_tools import compact_json, normalize_tools
from worker.guided import JSON_DEFAULTS, grammar_of

PARSERS = ("hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]
    choice: str  # none | auto | required | function
    name: str | None = None  # choice == "function": the tool to call
    parallel: bool = True


def tool_request(body: dict) -> ToolRequest | None:
    """The body's tools and tool_choice, checked; None without tools. ValueError when malformed."""
    tools = normalize_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ValueError("'tool_choice' needs 'tools'")
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ValueError("'parallel_tool_calls' must be a boolean")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolRequest(tools, choice or "auto", parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    return ToolRequest(tools, "function", name, parallel)


def _params(req: ToolRequest) -> dict[str, Any]:
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in req.tools}


def auto_grammar(
    req: ToolRequest, trigger_is_special: bool, close_is_special: bool = False
) -> tuple[str, str]:
    """``auto`` with the hermes format: the text is free, but from each ``<tool_call>`` on the
    output must be one call ``{"name": <a tool>, "arguments": <its schema>}`` and ``</tool_call>``,
    so every call the model starts parses. ``trigger_is_special``: the tokenizer has
    ``<tool_call>`` as a special token (matched as that token; else as text, llguidance's lazy
    trigger); ``close_is_special`` the same for ``</tool_call>`` (else written as text, which the
    model spells)."""
    call = {
        "anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name, schema in _params(req).items()
        ],
        "x-guidance": JSON_DEFAULTS,
    }  # fmt: skip
    close = _CLOSE if close_is_special else json.dumps(_CLOSE)
    body = f"%json {json.dumps(call)} {close}"
    if trigger_is_special:
        rules = f"call: TEXT {_OPEN} {body}"
    else:
        rules = f"call_start[lazy]: TEXT {json.dumps(_OPEN)}\ncall: call_start {body}"
    calls = "call*" if req.parallel else "call?"  # NOTE: parallel_tool_calls false: one call at most
    return "tool_auto", f"%llguidance {{}}\nstart: {calls} free\nfree: TEXT\nTEXT: /(.|\\n)*/\n{rules}\n"


def forced_grammar(req: ToolRequest) -> tuple[str, str] | None:
    """(kind, grammar) the output must follow for ``required`` and a named function; else None."""
    params = _params(req)
    if req.choice == "function":
        return "tool_call", grammar_of("json_schema", params[req.name])[1]
    if req.choice != "required":
        return None
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
    }
    calls = {"type": "array", "items": item, "minItems": 1, **({} if req.parallel else {"maxItems": 1})}
    return "tool_call", grammar_of("json_schema", calls)[1]


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _as_call(obj: Any) -> dict | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a tool call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args if isinstance(args, str) else compact_json(args))


def _json_calls(text: str) -> list[dict] | None:
    """Calls from JSON objects (or one list of them) separated by ``;`` or whitespace; None unless
    all of ``text`` is calls."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item)
            if call is None:
                return None
            calls.append(call)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return calls or None


class ToolOutput:
    """One choice's text as content and tool calls: ``message`` for a whole answer, ``feed`` and
    ``flush`` for a stream (each returns chat ``delta`` objects)."""

    def __init__(self, req: ToolRequest, parser: str) -> None:
        self.req, self.parser = req, parser
        self.calls = 0  # calls emitted so far (stream) or found (whole)
        self._pending = ""  # text seen but not yet emitted
        self._in_call = False  # hermes stream: inside <tool_call> ... </tool_call>
        self._decided = False  # llama3_json stream: is the answer a call (buffer) or text (stream)?
        self._json = False  # ... decided: a call
        self._array = _CallArray() if req.choice == "required" else None  # required: streamed calls

    # ------------------------------------------------------------------ whole answers
    def message(self, text: str) -> dict:
        mode = self.req.choice
        if mode == "none":
            return {"role": "assistant", "content": text}
        if mode == "function":
            calls = [_call(self.req.name or "", text)]
        elif mode == "required":  # NOTE: read as a stream is, so one cut off by max_tokens agrees with it
            calls, text = _CallArray().calls_in(text), ""  # the calls' JSON is not content
        elif self.parser == "llama3_json":
            calls = _json_calls(text.removeprefix(_PYTHON_TAG)) or []
            text = "" if calls else text  # all of it is the calls
        else:
            text, calls = _hermes(text)
        calls = self._allowed(calls)
        self.calls = len(calls)
        if not calls:
            return {"role": "assistant", "content": text}
        content = None if mode in ("function", "required") else (text.strip() or None)
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason

    # ------------------------------------------------------------------ streams
    def feed(self, text: str) -> list[dict]:
        mode = self.req.choice
        if mode == "none":
            return [{"content": text}] if text else []
        if mode == "function":
            out = []
            if not self.calls:
                self.calls = 1
                head = _call(self.req.name or "", "")
                out.append({"tool_calls": [{"index": 0, **head}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self._array is not None:
            out = self._array.feed(text)
            self.calls = self._array.calls
            return out
        self._pending += text
        if self.parser == "llama3_json":
            return self._feed_json()
        return self._feed_hermes()

    def flush(self) -> list[dict]:
        """Whatever is still held back, at the end of the choice."""
        mode, rest, self._pending = self.req.choice, self._pending, ""
        if mode in ("none", "function"):
            return self.feed("") if mode == "function" else []
        if self._array is not None:  # NOTE: a call cut short (max_tokens) stays as far as it got
            return []
        if not rest:
            return []
        if mode == "required" or self.parser == "llama3_json" or self._in_call:
            calls = _json_calls(rest.removeprefix(_PYTHON_TAG)) if not self._in_call else _hermes_block(rest)
            if calls:
                calls = self._allowed(calls)
                return [self._delta(calls)] if calls else []
            return [{"content": (_OPEN if self._in_call else "") + rest}]
        return [{"content": rest}] if rest.strip() or not self.calls else []

    def _allowed(self, calls: list[dict]) -> list[dict]:
        """``calls`` as far as the request allows: with ``parallel_tool_calls`` false one call in all
        (the grammar allows one; text tags the model spells in its free text after it are dropped)."""
        return calls if self.req.parallel else calls[: max(0, 1 - self.calls)]

    def _delta(self, calls: list[dict]) -> dict:
        first, self.calls = self.calls, self.calls + len(calls)
        return {"tool_calls": [{"index": first + k, **c} for k, c in enumerate(calls)]}

    def _feed_json(self) -> list[dict]:
        """llama3_json: a call is buffered whole (emitted by ``flush``); an answer that turns out
        to be text streams as it comes."""
        if self.req.choice == "auto" and not self._decided:
            head = self._pending.lstrip()
            if not head or _PYTHON_TAG.startswith(head):
                return []  # too early to tell
            self._decided = True
            self._json = head.startswith(("{", "[", _PYTHON_TAG))
        if self._json:
            return []
        out, self._pending = self._pending, ""
        return [{"content": out}] if out else []

    def _feed_hermes(self) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._pending.find(_CLOSE)
                if end < 0:
                    return out
                block, self._pending = self._pending[:end], self._pending[end + len(_CLOSE) :]
                self._in_call = False
                calls = _hermes_block(block)
                if not calls:
                    out.append({"content": _OPEN + block + _CLOSE})
                elif calls := self._allowed(calls):
                    out.append(self._delta(calls))
                continue
            start = self._pending.find(_OPEN)
            if start >= 0:
                text, self._pending = self._pending[:start], self._pending[start + len(_OPEN) :]
                self._in_call = True
                if text.strip():  # NOTE: whitespace between calls is not content
                    out.append({"content": text})
                continue
            keep = _partial_suffix(self._pending, _OPEN)
            text = self._pending[: len(self._pending) - keep]
            body = text.rstrip()  # hold trailing whitespace: it may precede a call
            if body:
                out.append({"content": body})
                self._pending = self._pending[len(body) :]
            return out


class _CallArray:
    """A ``required`` answer streamed as it is generated. The grammar makes it a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects: each call's head goes out once its name is read,
    its arguments as their characters come (as a named call's do)."""

    def __init__(self) -> None:
        self.calls = 0  # heads sent
        self._depth = 0  # [ and { open at the scan position: the array is 1, an item's keys are at 2
        self._string = self._escape = False
        self._token = ""  # the string being read at depth 2 (a key or a value)
        self._key: str | None = None  # the item's current key
        self._expect_key = True  # at depth 2: the next string is a key (else its value)
        self._sent_head = False  # the current item's head went out
        self._in_args = False  # inside the current item's arguments value
        self._held = ""  # arguments read before the name (another key order)

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        args: list[str] = []  # the current call's argument characters in this piece
        for ch in text:
            if self._in_args:
                args.append(ch)
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
                    if self._depth == 2:
                        self._item_string(out)
                elif self._depth == 2:
                    self._token += ch
                continue
            if ch == '"':
                self._string, self._token = True, ""
            elif ch in "[{":
                if self._depth == 2 and self._key in ("parameters", "arguments"):
                    self._in_args = True
                    args.append(ch)
                self._depth += 1
                if self._depth == 2:  # a new item
                    self._key, self._expect_key, self._sent_head, self._held = None, True, False, ""
            elif ch in "]}":
                self._depth -= 1
                if self._in_args and self._depth == 2:
                    self._in_args = False
                    self._args(out, args)
                    args = []
            elif self._depth == 2 and ch in ":,":
                self._expect_key = ch == ","
        self._args(out, args)
        return out

    def calls_in(self, text: str) -> list[dict]:
        """The calls of a whole answer: its stream's deltas put together (a call cut off by
        max_tokens as far as it got)."""
        calls: list[dict] = []
        for delta in self.feed(text):
            for piece in delta["tool_calls"]:
                if piece["index"] == len(calls):  # a head
                    calls.append({k: v for k, v in piece.items() if k != "index"})
                else:
                    calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        return calls

    def _item_string(self, out: list[dict]) -> None:
        """A string at an item's top level ended: a key, or a value (the name: send the head)."""
        if self._expect_key:
            self._key = self._token
            return
        if self._key == "name" and not self._sent_head:
            name = json.loads(f'"{self._token}"')
            out.append({"tool_calls": [{"index": self.calls, **_call(name, "")}]})
            self.calls += 1
            self._sent_head = True
            held, self._held = self._held, ""
            self._args(out, list(held))

    def _args(self, out: list[dict], chars: list[str]) -> None:
        if not chars:
            return
        if not self._sent_head:
            self._held += "".join(chars)
            return
        out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": "".join(chars)}}]})


def _hermes_block(block: str) -> list[dict] | None:
    try:
        call = _as_call(json.loads(block))
    except json.JSONDecodeError:
        return None
    return None if call is None else [call]


_HERMES = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|$)", re.DOTALL)


def _hermes(text: str) -> tuple[str, list[dict]]:
    """(content, calls) of a hermes-format answer: every ``<tool_call>`` block that parses as a call
    is one (an unterminated last block too); the rest is content (a last, empty block aside)."""
    calls, content, last = [], [], 0
    for m in _HERMES.finditer(text):
        found = _hermes_block(m.group(1)) or []
        # NOTE: an answer cut off right after a <tool_call> shows no tag (as its stream ends)
        if found or (m.group(0) == _OPEN and m.end() == len(text)):
            content.append(text[last : m.start()])
            calls += found
            last = m.end()
    content.append(text[last:])
    return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
