"""Tool (function) calling for chat completions: the request's ``tools`` and ``tool_choice``, the
grammar a forced call is generated under, and a choice's output turned into OpenAI ``tool_calls``,
whole or as stream deltas.

``tool_choice`` (default ``auto`` when there are tools):
- ``none``: plain text. The tools stay in the prompt, so the prompt and its cached prefix are the
  same as the conversation's other turns.
- ``auto``: free generation; calls are read from the text in the format ``--tool-call-parser``
  names: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what the
  built-in chat template writes, Qwen 2.5 / Hermes models), ``llama3_json`` (the whole answer is
  ``{"name": ..., "parameters": {...}}``, several joined by ``;``, Llama 3.1+), ``mistral``
  (``[TOOL_CALLS]`` and then a JSON list of ``{"name": ..., "arguments": {...}}``, Mistral 7B v0.3 /
  Nemo, or ``[TOOL_CALLS]name[ARGS]{...}`` per call, the tokenizers that have ``[ARGS]``: Mistral
  Small 3.1+) or ``granite`` (``<|tool_call|>`` and such a list, Granite 3). With hermes, mistral
  and granite, what follows the opening tag is also constrained to valid calls (``auto_grammar``,
  ``tagged_auto_grammar``); with llama3_json an answer that opens with
  ``{`` (``llama3_auto_grammar``). Where the tags are special tokens, the request's text shows them
  to this reader (worker.guided). Text that does not parse as a call stays content: nothing the
  model wrote is dropped.
- ``required``: the output is constrained (worker.guided) to a JSON list of at least one
  ``{"name": <a tool>, "parameters": <its schema>}`` (exactly one when ``parallel_tool_calls`` is
  false), each item a call; one cut off by max_tokens keeps the calls read so far, whole or streamed.
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's parameters
  schema and is that call's arguments, streamed as argument deltas as they are generated.

A message that carries calls and ended naturally finishes with ``tool_calls``. Call ids are ``call_``
and 24 hex digits; with ``mistral`` 9 letters and digits, the only ids Mistral's chat templates
accept when the calls come back in the next turn.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from router.chat_tools import compact_json, encodable, normalize_tools
from worker.guided import JSON_DEFAULTS, check_schema, grammar_of
from worker.reasoning import CALL_CLOSE, CALL_OPEN

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GRANITE_CALLS = "<|tool_call|>"
# the parsers whose calls come last, after a tag: the tag that opens them
CALL_TAGS = {"mistral": MISTRAL_CALLS, "granite": GRANITE_CALLS}
_ALNUM = string.ascii_letters + string.digits


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
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # NOTE: null is the default, as OpenAI's schema has it
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
    """Each tool's parameters' schema by its name, checked as a response format's is (check_schema)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in req.tools}
    for schema in params.values():
        check_schema(schema)
    return params


def auto_grammar(
    req: ToolRequest, trigger_is_special: bool, close_is_special: bool = False
) -> tuple[str, str]:
    """``auto`` with the hermes format: the text is free, but from each ``<tool_call>`` on the
    output must be one call ``{"name": <a tool>, "arguments": <its schema>}`` and ``</tool_call>``,
    so every call the model starts parses; a newline may come before and after the call's JSON (the
    layout Qwen's and Hermes' templates write and teach). ``trigger_is_special``: the tokenizer has
    ``<tool_call>`` as a special token (matched as that token; else as text, llguidance's lazy
    trigger); ``close_is_special`` the same for ``</tool_call>`` (else written as text, which the
    model spells)."""
    call = {**_call_schema(_params(req), "arguments"), "x-guidance": JSON_DEFAULTS}
    close = _CLOSE if close_is_special else json.dumps(_CLOSE)
    newline = json.dumps("\n") + "?"
    body = f"{newline} %json {json.dumps(call)} {newline} {close}"
    if trigger_is_special:
        rules = f"call: TEXT {_OPEN} {body}"
    else:
        rules = f"call_start[lazy]: TEXT {json.dumps(_OPEN)}\ncall: call_start {body}"
    calls = "call*" if req.parallel else "call?"  # NOTE: parallel_tool_calls false: one call at most
    return "tool_auto", f"%llguidance {{}}\nstart: {calls} free\nfree: TEXT\nTEXT: /(.|\\n)*/\n{rules}\n"


def tagged_auto_grammar(req: ToolRequest, tag: str, calls_id: int | None, args_id: int | None = None,
                        call_id_id: int | None = None) -> tuple[str, str]:  # fmt: skip
    """``auto`` with the mistral or granite format: free text, and from each ``tag`` (``[TOOL_CALLS]``,
    ``<|tool_call|>``) on valid calls. ``calls_id``: the id of the tag's special token (None: the tag
    is text, llguidance's lazy trigger). With ``args_id`` (the tokenizer has ``[ARGS]``: Mistral
    Small 3.1+) each call is ``[TOOL_CALLS]<name>[ARGS]<arguments>``, optionally ``[CALL_ID]`` and a
    9-character id after the name where the tokenizer has that token (``call_id_id``); else the tag
    and a JSON list of ``{"name", "arguments"}`` objects (one object at most without
    parallel_tool_calls)."""
    params = _params(req)
    if args_id is None:
        calls = _call_list(_call_schema(params, "arguments"), req.parallel)
        body = '" "? %json ' + json.dumps({**calls, "x-guidance": JSON_DEFAULTS})
    else:
        call_id = f"(<[{call_id_id}]> /[A-Za-z0-9]{{9}}/)? " if call_id_id is not None else ""
        body = "(" + " | ".join(
            f"{json.dumps(name)} {call_id}<[{args_id}]> %json {json.dumps({**schema, 'x-guidance': JSON_DEFAULTS})}"
            for name, schema in params.items()
        ) + ")"  # fmt: skip
    if calls_id is not None:
        rules = f"call: TEXT <[{calls_id}]> {body}"
    else:
        rules = f"call_start[lazy]: TEXT {json.dumps(tag)}\ncall: call_start {body}"
    calls_rule = "call*" if req.parallel else "call?"
    return "tool_auto", (
        f"%llguidance {{}}\nstart: {calls_rule} free\nfree: TEXT\nTEXT: /(.|\\n)*/\n{rules}\n"
    )


def llama3_auto_grammar(req: ToolRequest, tag_is_special: bool) -> tuple[str, str]:
    """``auto`` with the llama3_json format: an answer that opens with ``{`` (or with the
    ``<|python_tag|>`` special token, where the tokenizer has it: ``tag_is_special``) is calls, each
    ``{"name": <a tool>, "parameters": <its schema>}``, joined by ``; `` (one call without
    parallel_tool_calls); any other answer is free text."""
    call = {**_call_schema(_params(req), "parameters"), "x-guidance": JSON_DEFAULTS}
    more = '("; " call)*' if req.parallel else ""
    tag = f"{PYTHON_TAG}? " if tag_is_special else ""
    # NOTE: free text may open with whitespace, not with whitespace and then "{" (a call the reader would
    # read, unchecked by the grammar), and may be whitespace alone
    return "tool_auto", (
        f"%llguidance {{}}\nstart: {tag}call {more} | FREE?\ncall: %json {json.dumps(call)}\n"
        "FREE: /\\s*[^{\\s](.|\\n)*|\\s+/\n"
    )


def forced_grammar(req: ToolRequest) -> tuple[str, str] | None:
    """(kind, grammar) the output must follow for ``required`` and a named function; else None."""
    params = _params(req)
    if req.choice == "function":
        return "tool_call", grammar_of("json_schema", params[req.name])[1]
    if req.choice != "required":
        return None
    calls = _call_list(_call_schema(params, "parameters"), req.parallel)
    return "tool_call", grammar_of("json_schema", calls)[1]


def _call_schema(params: dict[str, Any], args_key: str) -> dict:
    """One call of one of the tools (``params``: _params'): ``{"name": <the tool>, <args_key>: <its
    parameters' schema>}``.
    Each tool's schema is a resource of its own (an ``$id``, unless it has one), so its local
    references (``#/$defs/X``, ``#``, anchors: pydantic writes them) name its own parts, not the
    grammar's root nor another tool's."""
    calls = []
    for i, (name, schema) in enumerate(params.items()):
        own = schema if "$id" in schema else {"$id": f"urn:radixgate:tool:{i}", **schema}
        calls.append({"type": "object", "properties": {"name": {"const": name}, args_key: own},
                      "required": ["name", args_key], "additionalProperties": False})  # fmt: skip
    return {"anyOf": calls}


def _call_list(item: dict, parallel: bool) -> dict:
    """A JSON list of at least one ``item`` (exactly one without parallel_tool_calls)."""
    return {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _as_call(obj: Any) -> dict | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a tool call; None if it is not one (a name of
    a lone surrogate neither: no tool has one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not encodable(obj["name"]):
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
    ``flush`` for a stream (each returns chat ``delta`` objects). ``parser``: a --tool-call-parser, or
    ``harmony``: the calls the harmony splitter marked (worker.reasoning), read as hermes' are."""

    def __init__(self, req: ToolRequest, parser: str) -> None:
        self.req, self.parser = req, parser
        self.calls = 0  # calls emitted so far (stream) or found (whole)
        self._pending = ""  # text seen but not yet emitted
        self._in_call = False  # hermes stream: inside <tool_call> ... </tool_call>
        # hermes' tags, or the marks around the calls the harmony splitter (worker.reasoning) reads off
        # gpt-oss's messages: no text the model writes spells them, so every one is a call
        harmony = parser == "harmony"
        self._open, self._close = (CALL_OPEN, CALL_CLOSE) if harmony else (_OPEN, _CLOSE)
        # NOTE: parallel_tool_calls false: after its one call a tag is text; a harmony call past it is dropped
        self._single = not req.parallel and not harmony
        self._end = _TagScan(self._close)  # hermes stream: where the block read so far ends
        self._before = ""  # hermes stream: whitespace before the block (content if it does not parse)
        self._decided = False  # llama3_json stream: is the answer a call (buffer) or text (stream)?
        self._json = False  # ... decided: a call
        self._array = _CallArray() if req.choice == "required" else None  # required: streamed calls
        self._tag = CALL_TAGS.get(parser)  # mistral, granite: the tag that opens the calls

    @property
    def forced(self) -> bool:
        """Does the request force calls (``required``, a named function)? Then its answer has no content."""
        return self.req.choice in ("function", "required")

    # ------------------------------------------------------------------ whole answers
    def message(self, text: str) -> dict:
        mode = self.req.choice
        if mode == "none":
            return {"role": "assistant", "content": text}
        if mode == "function":  # NOTE: an answer cut off before its arguments began holds no call
            text = text.lstrip()  # the grammar lets whitespace come first (after the thinking): not arguments
            calls = [_call(self.req.name or "", text)] if text else []
        elif mode == "required":  # NOTE: read as a stream is, so one cut off by max_tokens agrees with it
            calls, text = _CallArray().calls_in(text), ""  # the calls' JSON is not content
        elif self.parser == "llama3_json":
            calls = _json_calls(text.removeprefix(PYTHON_TAG)) or []
            text = "" if calls else text  # all of it is the calls
        elif self._tag is not None:
            text, calls = _tagged(text, self._tag, not self.req.parallel)
        else:
            text, calls = _hermes(text, self._single, self._open, self._close)
        calls = self._allowed(calls)
        self.calls = len(calls)
        if self.forced:  # NOTE: none of the text is content (cut off before a call: no call, no content)
            return {
                "role": "assistant",
                "content": None,
                **({"tool_calls": self._ids(calls)} if calls else {}),
            }
        if not calls:
            return {"role": "assistant", "content": text}
        # NOTE: the whitespace the text opens with is kept, as a stream sends it; what ends it is the call's
        content = text.rstrip() or None
        return {"role": "assistant", "content": content, "tool_calls": self._ids(calls)}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason

    # ------------------------------------------------------------------ streams
    def feed(self, text: str) -> list[dict]:
        return self._delta_ids(self._feed(text))

    def flush(self) -> list[dict]:
        """Whatever is still held back, at the end of the choice."""
        return self._delta_ids(self._flush())

    def _ids(self, calls: list[dict]) -> list[dict]:
        """``calls`` with ids in the parser's style: Mistral's templates take 9 letters and digits (an
        id the model wrote after ``[CALL_ID]`` is kept when it is one)."""
        if self.parser == "mistral":
            for call in calls:
                if not (len(call["id"]) == 9 and call["id"].isascii() and call["id"].isalnum()):
                    call["id"] = "".join(secrets.choice(_ALNUM) for _ in range(9))
        return calls

    def _delta_ids(self, deltas: list[dict]) -> list[dict]:
        if self.parser != "mistral":  # NOTE: every streamed piece passes here; only mistral restyles ids
            return deltas
        for delta in deltas:
            self._ids([c for c in delta.get("tool_calls", ()) if "id" in c])  # a call's head
        return deltas

    def _feed(self, text: str) -> list[dict]:
        mode = self.req.choice
        if mode == "none":
            return [{"content": text}] if text else []
        if mode == "function":
            if not self.calls:  # NOTE: whitespace the grammar lets come first is not arguments
                text = text.lstrip()
            if not text:  # NOTE: no call before its first argument text (the model may still be thinking)
                return []
            out = []
            if not self.calls:
                self.calls = 1
                out.append({"tool_calls": [{"index": 0, **_call(self.req.name or "", "")}]})
            return [*out, {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if self._array is not None:
            out = self._array.feed(text)
            if self.req.parallel:
                self.calls = self._array.calls
                return out
            # NOTE: one call in all, as the whole answer keeps (the grammar lets the model write one)
            self.calls = min(1, self._array.calls)
            kept = [[tc for tc in d["tool_calls"] if tc["index"] == 0] for d in out]
            return [{"tool_calls": tcs} for tcs in kept if tcs]
        self._pending += text
        if self.parser == "llama3_json":
            return self._feed_json()
        if self._tag is not None:
            return self._feed_tagged()
        return self._feed_hermes()

    def _flush(self) -> list[dict]:
        mode, rest, self._pending = self.req.choice, self._pending, ""
        if mode in ("none", "function"):
            return []
        if self._array is not None:  # NOTE: a call cut short (max_tokens) stays as far as it got
            return []
        if not rest:  # NOTE: a stream cut right after <tool_call> shows no tag, as a whole answer
            return [{"content": self._before}] if self._in_call and self._before and not self.calls else []
        if self._tag is not None and mode == "auto":
            # NOTE: rest starts at the tag once one was read (and the whitespace held before it)
            content, calls = _tagged(rest, self._tag, not self.req.parallel)
            calls = self._allowed(calls)
            content = content.rstrip() if calls else content  # NOTE: as a whole answer's content ends
            out = [{"content": content}] if content.strip() or (not calls and not self.calls) else []
            return out + ([self._delta(calls)] if calls else [])
        if mode == "required" or self.parser == "llama3_json" or self._in_call:
            calls = _json_calls(rest.removeprefix(PYTHON_TAG)) if not self._in_call else _hermes_block(rest)
            if calls:
                calls = self._allowed(calls)
                return [self._delta(calls)] if calls else []
            return [{"content": (self._before + self._open if self._in_call else "") + rest}]
        return [{"content": rest}] if rest.strip() or not self.calls else []

    def _allowed(self, calls: list[dict]) -> list[dict]:
        """``calls`` as far as the request allows: with ``parallel_tool_calls`` false one call in all
        (the grammar allows one; the readers leave a tag the model spells in its free text after it
        as text, content)."""
        return calls if self.req.parallel else calls[: max(0, 1 - self.calls)]

    def _delta(self, calls: list[dict]) -> dict:
        first, self.calls = self.calls, self.calls + len(calls)
        return {"tool_calls": [{"index": first + k, **c} for k, c in enumerate(calls)]}

    def _feed_json(self) -> list[dict]:
        """llama3_json: a call is buffered whole (emitted by ``flush``); an answer that turns out
        to be text streams as it comes."""
        if self.req.choice == "auto" and not self._decided:
            head = self._pending.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []  # too early to tell
            self._decided = True
            self._json = head.startswith(("{", "[", PYTHON_TAG))
        if self._json:
            return []
        out, self._pending = self._pending, ""
        return [{"content": out}] if out else []

    def _feed_tagged(self) -> list[dict]:
        """mistral, granite: text streams up to the tag; from there on the calls are read whole at the
        end (``flush``), as they all come last."""
        if self._in_call:
            return []
        start = self._pending.find(self._tag)  # type: ignore[arg-type]
        self._in_call = start >= 0
        keep = len(self._pending) - start if self._in_call else _partial_suffix(self._pending, self._tag)  # type: ignore[arg-type]
        # NOTE: whitespace before the tag is held with it: content only if the calls do not parse
        body = self._pending[: len(self._pending) - keep].rstrip()
        self._pending = self._pending[len(body) :]
        return [{"content": body}] if body else []

    def _feed_hermes(self) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._end.find(self._pending)
                if end < 0:
                    return out
                block, self._pending = self._pending[:end], self._pending[end + len(self._close) :]
                self._in_call, before, self._before = False, self._before, ""
                calls = _hermes_block(block, self._close)
                if not calls:
                    out.append({"content": before + self._open + block + self._close})
                elif calls := self._allowed(calls):
                    out.append(self._delta(calls))
                continue
            # NOTE: parallel_tool_calls false: after its one call a tag is text (as in a whole answer)
            start = self._pending.find(self._open) if not (self._single and self.calls) else -1
            if start >= 0:
                text, self._pending = self._pending[:start], self._pending[start + len(self._open) :]
                self._in_call, self._end = True, _TagScan(self._close)
                # NOTE: whitespace before a call is not content; it is held, as content only if the
                # block does not parse (as in a whole answer)
                body = text.rstrip()
                if body:
                    out.append({"content": body})
                self._before = text[len(body) :]
                continue
            keep = _partial_suffix(self._pending, self._open)
            text = self._pending[: len(self._pending) - keep]
            body = text.rstrip()  # hold trailing whitespace: it may precede a call
            if body:
                out.append({"content": body})
                self._pending = self._pending[len(body) :]
            return out


class _JsonStrings:
    """Whether JSON text read a character at a time is inside a string (escapes followed)."""

    def __init__(self) -> None:
        self.inside = self._escape = False

    def read(self, ch: str) -> bool:
        """Read ``ch``; True when it belongs to a string, its quotes included."""
        if not self.inside:
            self.inside = ch == '"'
            return self.inside
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self.inside = False
        return True


class _CallArray:
    """A ``required`` answer streamed as it is generated. The grammar makes it a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects: each call's head goes out once its name is read,
    its arguments as their characters come (as a named call's do)."""

    def __init__(self) -> None:
        self.calls = 0  # heads sent
        self._depth = 0  # [ and { open at the scan position: the array is 1, an item's keys are at 2
        self._strings = _JsonStrings()
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
            opened = not self._strings.inside
            if self._strings.read(ch):
                if opened:
                    self._token = ""
                elif not self._strings.inside and self._depth == 2:  # its closing quote
                    self._item_string(out)
                elif self._depth == 2:  # NOTE: as written, escapes too: the name is read as JSON
                    self._token += ch
                continue
            if ch in "[{":
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
            name = name if encodable(name) else self._token  # NOTE: a lone surrogate: as the model escaped it
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


def _hermes_block(block: str, close: str = _CLOSE) -> list[dict] | None:
    # NOTE: a block cut off (max_tokens) inside its spelled-out close tag is the call before it, as one cut
    # a token earlier is
    block = block[: len(block) - _partial_suffix(block, close)]
    try:
        call = _as_call(json.loads(block))
    except json.JSONDecodeError:
        return None
    return None if call is None else [call]


class _TagScan:
    """Where ``tag`` first stands outside a JSON string (a call's argument may spell it) in a text
    that only grows (a stream's block so far), scanned once: ``find`` goes on where it stopped."""

    def __init__(self, tag: str) -> None:
        self.tag, self.pos = tag, 0
        self._strings = _JsonStrings()

    def find(self, text: str) -> int:
        i = self.pos
        while i < len(text):
            ch = text[i]
            # NOTE: a character outside strings and not a quote changes no state: stopping at one is safe
            if not self._strings.read(ch) and ch == self.tag[0]:
                if text.startswith(self.tag, i):
                    self.pos = i
                    return i
                if self.tag.startswith(text[i:]):
                    break  # NOTE: the tag's start at the end: wait for the rest
            i += 1
        self.pos = i
        return -1


def _split_outside_strings(text: str, tag: str) -> list[str]:
    """``text`` split at each ``tag`` outside a JSON string."""
    parts, scan, last = [], _TagScan(tag), 0
    while (i := scan.find(text)) >= 0:
        parts.append(text[last:i])
        last = scan.pos = i + len(tag)
    parts.append(text[last:])
    return parts


def _hermes(
    text: str, single: bool = False, open_tag: str = _OPEN, close: str = _CLOSE
) -> tuple[str, list[dict]]:
    """(content, calls) of a hermes-format answer: every ``<tool_call>`` block (up to the first
    ``</tool_call>`` outside a JSON string) that parses as a call is one (an unterminated last block
    too); the rest is content (a last, empty block aside). ``single``: the first call is the only
    one, the text after it content whatever it spells. ``open_tag``, ``close``: the tags (the harmony
    reader's marks instead)."""
    calls, content, last, start = [], [], 0, 0
    while not (single and calls) and (start := text.find(open_tag, start)) >= 0:
        body = start + len(open_tag)
        end = _TagScan(close).find(text[body:])
        block = text[body:] if end < 0 else text[body : body + end]
        after = len(text) if end < 0 else body + end + len(close)
        found = _hermes_block(block, close) or []
        # NOTE: an answer cut off right after a <tool_call> shows no tag (as its stream ends)
        if found or after == body == len(text):
            # NOTE: whitespace before a call is not content (as a stream leaves it out)
            content.append(text[last:start].rstrip() if found else text[last:start])
            calls += found
            last = after
        start = after
    content.append(text[last:])
    return "".join(content), calls


def _tagged(text: str, tag: str, single: bool = False) -> tuple[str, list[dict]]:
    """(content, calls) of a mistral- or granite-format answer: each ``tag`` followed by a JSON list
    (or object) of calls or (mistral) by ``name[ARGS]{...}`` (``name[CALL_ID]id[ARGS]{...}``) gives
    calls, and text the model wrote after them is content (the grammar lets it); the text before the
    first, and any part that does not open with calls (a call cut off by max_tokens), with its tag,
    is content. ``single``: the first calls found are the only ones, later tags text."""
    content, found_tag, rest = text.partition(tag)
    if not found_tag:
        return text, []
    calls: list[dict] = []
    for part in _split_outside_strings(rest, tag):
        found = None if single and calls else _tagged_calls(part)
        if found:
            # NOTE: whitespace before a call is not content (a stream holds it with the tag)
            content = content.rstrip() + found[1]
            calls += found[0]
        else:
            content += tag + part
    return content, calls


def _tagged_calls(part: str) -> tuple[list[dict], str] | None:
    """The calls the text after a tag opens with, and the text after them; None if it opens with none."""
    text = part.lstrip()
    if not text.startswith(("[", "{")):
        return _mistral_call(part)
    whole = _json_calls(text)  # NOTE: objects joined by ";" too
    if whole:
        return whole, ""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    calls = [_as_call(item) for item in (value if isinstance(value, list) else [value])]
    if not calls or None in calls:
        return None
    return calls, text[end:]  # type: ignore[return-value]


def _mistral_call(part: str) -> tuple[list[dict], str] | None:
    """``name[ARGS]{...}`` or ``name[CALL_ID]id[ARGS]{...}`` as a call (its id kept), and the text
    after it; None if it is not one."""
    head, tag, args = part.partition(MISTRAL_ARGS)
    name, _, call_id = head.partition(MISTRAL_CALL_ID)
    name = name.strip()
    if not tag or not name:
        return None
    args = args.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(args)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    call = _call(name, compact_json(value))
    if call_id.strip():
        call["id"] = call_id.strip()
    return [call], args[end:]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
