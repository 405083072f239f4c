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
_TEXT_PARTS = ("input_text", "output_text", "text")


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
                or part.get("type") not in _TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"unsupported content part {kind!r}: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError("message 'content' must be a string or a list of text parts")


def input_messages(input_: Any) -> list[dict[str, str]]:
    """``input`` (a string, or a list of message items) as chat messages."""
    if isinstance(input_, str):
        if not input_:
            raise ValueError("'input' is empty")
        return [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise ValueError("'input' must be a non-empty string or list of messages")
    out = []
    for item in input_:
        if not isinstance(item, dict):
            raise ValueError("each 'input' item must be an object")
        if item.get("type", "message") != "message":
            raise ValueError(f"unsupported input item type {item.get('type')!r}: only messages are supported")
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ValueError(f"unsupported role {item.get('role')!r}")
        out.append({"role": role, "content": _text(item.get("content"))})
    return out


def prompt_messages(instructions: Any, history: list[dict[str, str]], input_: Any) -> list[dict[str, str]]:
    """The conversation to render: ``instructions`` as a system message (they are not carried over
    from a previous response), then the earlier turns, then this request's input."""
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError("'instructions' must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    return system + history + input_messages(input_)
