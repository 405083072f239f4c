"""loadtest.responses_client: chat-shaped workload bodies as Responses requests."""

from __future__ import annotations

from loadtest.responses_client import responses_body

CHAT = {
    "model": "m", "max_tokens": 8, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}],
}  # fmt: skip


def test_a_first_turn_sends_instructions_and_the_conversation() -> None:
    body = responses_body(CHAT, CHAT, None)
    assert body["instructions"] == "S" and body["max_output_tokens"] == 8 and body["stream"] is True
    assert body["input"] == [m for m in CHAT["messages"] if m["role"] != "system"]
    assert "messages" not in body and "max_tokens" not in body and "stream_options" not in body
    assert "previous_response_id" not in body


def test_a_later_turn_sends_instructions_its_message_and_the_previous_id() -> None:
    turn = {"messages": [{"role": "user", "content": "q2"}]}
    body = responses_body(CHAT, turn, "resp_1")
    assert body["previous_response_id"] == "resp_1" and body["instructions"] == "S"
    assert body["input"] == [{"role": "user", "content": "q2"}]
