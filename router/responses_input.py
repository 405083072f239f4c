"""OpenAI Responses API, the parts router and worker must agree on: a request's ``instructions`` and
``input`` as chat messages (what the prompt is, hence its prefix), and response ids that name the
worker holding the conversation (so a stateless router sends ``previous_response_id`` there).

Pure functions; a problem with the input is a ValueError (HTTP 400)."""

from __future__ import annotations

import uuid
from typing import Any

import mmh3

RESPONSE_PREFIX = "resp_"
TAG_CHARS = 10  # hex digits naming a worker in a response id (40 bits)
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def worker_tag(url: str) -> str:
    """The tag of the worker advertised as ``url`` (trailing slash ignored)."""
    h = mmh3.hash64(url.rstrip("/").encode(), signed=False)[0]
    return f"{h:016x}"[:TAG_CHARS]


def new_response_id(tag: str) -> str:
    return RESPONSE_PREFIX + tag + uuid.uuid4().hex


def tag_of(response_id: Any) -> str | None:
    """The worker tag inside a response id of ours; None for anything else."""
    if not isinstance(response_id, str) or not response_id.startswith(RESPONSE_PREFIX):
        return None
    tag = response_id[len(RESPONSE_PREFIX) : len(RESPONSE_PREFIX) + TAG_CHARS]
    return tag if len(tag) == TAG_CHARS and all(c in "0123456789abcdef" for c in tag) else None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"unsupported content part {kind!r}: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError("message 'content' must be a string or a list of text parts")


def chat_tools(tools: Any) -> list[dict] | None:
    """The Responses API's function tools (``{"type": "function", "name", "description",
    "parameters"}``) in chat's shape (``{"type": "function", "function": {...}}``)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ValueError("'tools' must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ValueError(f"tools[{i}]: only function tools are supported, got {kind!r}")
        if "function" in tool and "name" not in tool:  # NOTE: chat's shape: told in this API's terms
            raise ValueError(f"tools[{i}]: a Responses API function tool has 'name', 'description' and "
                             "'parameters' at its top level ({'type': 'function', 'name': ...}), not under "
                             "'function'")  # fmt: skip
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """The Responses API's ``tool_choice`` (``{"type": "function", "name": N}`` for one tool) in chat's shape."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        if not isinstance(choice.get("name"), str):
            raise ValueError(
                "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _thinking_turn(thought: str) -> dict[str, Any]:
    """An assistant turn of thinking alone (no assistant message or call took it)."""
    return {"role": "assistant", "content": "", "reasoning_content": thought}


def input_messages(input_: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of message, ``function_call``, ``function_call_output`` and
    ``reasoning`` items) as chat messages: function calls are the ``tool_calls`` of the assistant
    message they follow (one turn's message and calls, as a response's output has them), a call's
    output is a ``tool`` message, and a reasoning item's text is the next assistant message's
    ``reasoning_content`` (the name chat templates read); a reasoning item no assistant message or call
    follows (an answer cut off while thinking) is an assistant turn of its own with no content, as the
    stored conversation of that response has it."""
    if isinstance(input_, str):
        if not input_:
            raise ValueError("'input' is empty")
        return [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise ValueError("'input' must be a non-empty string or list of messages")
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the next assistant message
    for item in input_:
        if not isinstance(item, dict):
            raise ValueError("each 'input' item must be an object")
        kind = item.get("type", "message")
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):  # fmt: skip
                raise ValueError("a reasoning item's 'content' (or 'summary') must be a list of text parts")
            thought = (thought or "") + "".join(p["text"] for p in parts)
            continue
        if kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not all(isinstance(v, str) and v for v in (call_id, name)) or not isinstance(args, str):
                raise ValueError("a function_call item needs string 'call_id', 'name' and 'arguments'")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":  # NOTE: one turn's message and calls: one message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, (str, list)):
                raise ValueError(
                    "a function_call_output item needs string 'call_id' and 'output' (text or text parts)"
                )
            if thought:  # NOTE: no assistant turn took it: a turn of its own
                out.append(_thinking_turn(thought))
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(output)})
        elif kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise ValueError(f"unsupported role {item.get('role')!r}")
            if thought and role != "assistant":  # NOTE: no assistant turn took it: a turn of its own
                out.append(_thinking_turn(thought))
            out.append({"role": role, "content": _text(item.get("content"))})
        else:
            raise ValueError(f"unsupported input item type {kind!r}: messages, function_call, "
                             "function_call_output and reasoning are")  # fmt: skip
        if thought is not None:  # NOTE: it belongs to the assistant's turn that follows it, if one does
            if out[-1]["role"] == "assistant":  # (after any thinking that turn had: a call joins it)
                out[-1]["reasoning_content"] = out[-1].get("reasoning_content", "") + thought
            thought = None
    if thought:
        out.append(_thinking_turn(thought))
    return out


def template_options(body: dict[str, Any]) -> dict[str, Any]:
    """The chat options (router.tokenization.chat_options) a Responses body asks for: its
    ``reasoning.effort`` as chat's ``reasoning_effort``."""
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return {} if effort is None else {"reasoning_effort": effort}


def prompt_messages(instructions: Any, history: list[dict[str, Any]], input_: Any) -> list[dict[str, Any]]:
    """The conversation to render: ``instructions`` as a system message (they are not carried over
    from a previous response), then the earlier turns, then this request's input."""
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError("'instructions' must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    return system + history + input_messages(input_)
