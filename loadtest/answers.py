"""Reading a server's answer into a RequestRecord: chat / completions (whole or SSE chunks ending
in ``[DONE]``) and Responses API objects (whole or named events ending in ``response.completed``).
Usage is recorded in chat-completions terms whichever API answered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from loadtest.report import RequestRecord

# NOTE: an answer's first token may be thinking or a tool call rather than text; either starts it (TTFT)
CHAT_OUTPUT_KEYS = ("content", "reasoning", "reasoning_content", "tool_calls")
RESPONSES_OUTPUT_DELTAS = (
    "response.output_text.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.function_call_arguments.delta",
)


def apply_usage(rec: RequestRecord, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
    rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


async def read_completion(
    resp: aiohttp.ClientResponse, stream: bool, rec: RequestRecord, started: float, clock: Callable[[], float],
    reply: list[str],
) -> None:  # fmt: skip
    """A chat or completions answer; the reply's text goes to ``reply``."""
    if not stream:
        payload = orjson.loads(await resp.read())
        rec.ttft_s = clock() - started
        choice = payload["choices"][0]
        reply.append((choice.get("message") or {}).get("content") or choice.get("text") or "")
        apply_usage(rec, payload.get("usage"))
        return
    finished = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            finished = True
            break
        chunk = orjson.loads(data)
        if "error" in chunk:
            rec.error = "stream_error"
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text")
            if rec.ttft_s is None and (text or any(delta.get(k) for k in CHAT_OUTPUT_KEYS)):
                rec.ttft_s = clock() - started
            if text:
                reply.append(text)
        apply_usage(rec, chunk.get("usage"))
    if not finished:
        rec.error = "incomplete_stream"


async def read_response(
    resp: aiohttp.ClientResponse, stream: bool, rec: RequestRecord, started: float, clock: Callable[[], float],
    reply: list[str],
) -> str | None:  # fmt: skip
    """A Responses API answer; returns its id (None if it failed)."""
    if not stream:
        final = orjson.loads(await resp.read())
        rec.ttft_s = clock() - started
        reply.append(output_text(final))
    else:
        final = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            try:
                event = orjson.loads(line[5:])
                delta, final = stream_event(event)
            except ValueError:
                rec.error = "stream_error"
                return None
            if rec.ttft_s is None and is_output(event):
                rec.ttft_s = clock() - started
            if delta:
                reply.append(delta)
            if final is not None:
                break
        if final is None:
            rec.error = "incomplete_stream"
            return None
    apply_usage(rec, chat_usage(final.get("usage")))
    return final["id"]


def chat_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Responses usage in chat-completions names (prompt / completion tokens, cached)."""
    if not usage:
        return None
    details = usage.get("input_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
        "prompt_tokens_details": {"cached_tokens": details.get("cached_tokens")},
    }


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
    )


def is_output(event: dict[str, Any]) -> bool:
    """Whether a Responses stream event carries generated tokens: text, thinking or a tool call."""
    kind = event.get("type")
    if kind == "response.output_item.added":  # a tool call's name arrives with its item
        return (event.get("item") or {}).get("type") == "function_call"
    return kind in RESPONSES_OUTPUT_DELTAS and bool(event.get("delta"))


def stream_event(event: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(text delta, final response object) of one stream event; ValueError for an error event."""
    kind = event.get("type")
    if kind == "response.output_text.delta":
        return event.get("delta") or None, None
    if kind in ("response.completed", "response.incomplete"):
        return None, event["response"]
    if kind in ("error", "response.failed"):
        raise ValueError(f"stream ended with {kind}")
    return None, None
