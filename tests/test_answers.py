"""loadtest.answers: Responses API answers and stream events read back in chat-completions terms
(the chat and completions readers run against a server in tests/test_driver.py)."""

from __future__ import annotations

import pytest

from loadtest.answers import chat_usage, output_text, stream_event


def test_answers_and_events_read_back() -> None:
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 2}
    assert chat_usage(usage) == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert chat_usage(None) is None
    response = {
        "id": "resp_1",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}],
    }
    assert output_text(response) == "hi"
    assert stream_event({"type": "response.output_text.delta", "delta": "h"}) == ("h", None)
    assert stream_event({"type": "response.created", "response": {}}) == (None, None)
    assert stream_event({"type": "response.completed", "response": response}) == (None, response)
    with pytest.raises(ValueError):
        stream_event({"type": "error", "message": "boom"})
