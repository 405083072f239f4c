"""Tools in chat requests, the parts router and worker must agree on: the ``tools`` list checked,
an assistant message's ``tool_calls`` checked, and call arguments as JSON data for templates.

Pure functions; a malformed request is a ValueError (HTTP 400)."""

from __future__ import annotations

import json
from typing import Any


def check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(
                f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}"
            )
        if not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise ValueError(f"{where}[{j}].function.arguments must be a JSON string")


def normalize_tools(tools: Any) -> list[dict] | None:
    """OpenAI ``tools`` checked: None/empty for none, else a list of ``{"type": "function",
    "function": {"name": ..., "description"?: ..., "parameters"?: {...}}}``. ValueError otherwise."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ValueError("'tools' must be a list of {'type': 'function', 'function': {...}} objects")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string of at most 64 characters")
        if name in names:
            raise ValueError(f"tools[{i}]: two tools are named {name!r}")
        names.add(name)
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def call_arguments(call: dict) -> Any:
    """A message's tool call arguments as JSON data (OpenAI sends a JSON string; a string that is
    not JSON stays a string)."""
    args = call["function"].get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except (ValueError, RecursionError):  # NOTE: not JSON, nested past the stack, or digits past 4300
            return args
    return args


def encodable(text: str) -> bool:
    """No lone surrogate (JSON text may write one, ``"\\ud800"``, which no UTF-8 encodes): it can be sent."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def compact_json(value: Any) -> str:
    """``value`` as JSON text without spaces, its characters as they are; but escaped (``\\uXXXX``) where a
    string holds a lone surrogate."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text if encodable(text) else json.dumps(value, separators=(",", ":"))
