"""The load driver's requests to OpenAI's Responses API: a workload's chat body as a /v1/responses
body (a later turn sends only what it adds, with ``previous_response_id``). Answers: loadtest.answers."""

from __future__ import annotations

from typing import Any


def responses_body(
    chat_body: dict[str, Any], turn_body: dict[str, Any], previous_id: str | None
) -> dict[str, Any]:
    """``chat_body`` (the whole conversation so far) as a Responses request: its system messages as
    ``instructions`` (sent with every turn: the API does not carry them over), the rest as
    ``input``; with ``previous_id`` only this turn's messages (``turn_body``), the server holding
    the earlier ones."""
    body: dict[str, Any] = {
        k: v for k, v in chat_body.items() if k not in ("messages", "max_tokens", "stream_options")
    }
    body["max_output_tokens"] = chat_body.get("max_tokens")
    system = [m["content"] for m in chat_body["messages"] if m["role"] == "system"]
    if system:
        body["instructions"] = "\n".join(system)
    messages = turn_body["messages"] if previous_id is not None else chat_body["messages"]
    if previous_id is not None:
        body["previous_response_id"] = previous_id
    body["input"] = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    return body
