"""loadtest.answers: Responses API answers and stream events read back in chat-completions terms
(the chat and completions readers run against a server in tests/test_driver.py), and streams whose
answer is not text, served over loopback SSE."""

from __future__ import annotations

import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from loadtest.answers import chat_usage, output_text, read_completion, read_response, stream_event
from loadtest.report import RequestRecord
from tests.support import free_port

USAGE = {"prompt_tokens": 100, "completion_tokens": 9}
ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
CHAT_TOOL_CALL = [
    ROLE,
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                        "function": {"name": "search", "arguments": ""}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"q":"x"}'}}]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": USAGE},
]  # fmt: skip
CHAT_THINKING = [
    ROLE,
    {"choices": [{"index": 0, "delta": {"reasoning": "hmm", "reasoning_content": "hmm"}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    {"choices": [], "usage": USAGE},
]
CHAT_NOTHING = [
    ROLE,
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"choices": [], "usage": USAGE},
]
RESPONSES_USAGE = {"input_tokens": 100, "output_tokens": 9}
RESPONSES_TOOL_CALL = [
    {"type": "response.created", "response": {"id": "resp_1"}},
    {"type": "response.output_item.added", "output_index": 0,
     "item": {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "search", "arguments": ""}},
    {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": '{"q":"x"}'},
    {"type": "response.completed", "response": {"id": "resp_1", "output": [], "usage": RESPONSES_USAGE}},
]  # fmt: skip
RESPONSES_THINKING = [
    {"type": "response.created", "response": {"id": "resp_1"}},
    {"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1"}},
    {"type": "response.reasoning_text.delta", "item_id": "rs_1", "output_index": 0, "delta": "hmm"},
    {"type": "response.completed", "response": {"id": "resp_1", "output": [], "usage": RESPONSES_USAGE}},
]


class SSEServer:
    """A loopback server answering GET / with ``events`` as SSE (then ``[DONE]`` if ``done``)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.done = False
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for event in self.events:
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        if self.done:
            await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def sse_server():
    server = SSEServer()
    app = web.Application()
    app.router.add_get("/", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    server.url = f"http://127.0.0.1:{port}/"
    yield server
    await runner.cleanup()


@pytest.mark.parametrize(
    ("api", "events", "started"),
    [
        ("chat", CHAT_TOOL_CALL, True),
        ("chat", CHAT_THINKING, True),
        ("chat", CHAT_NOTHING, False),
        ("responses", RESPONSES_TOOL_CALL, True),
        ("responses", RESPONSES_THINKING, True),
    ],
)
async def test_an_answer_that_is_a_tool_call_or_thinking_has_a_ttft(sse_server, api, events, started):
    """The first token of a tool call or of thinking starts the answer: such requests keep their
    place in the TTFT percentiles. An answer with nothing generated has no first token."""
    sse_server.events, sse_server.done = events, api == "chat"
    rec, reply = RequestRecord(0, "g", 0.0, 100), []
    reader = read_completion if api == "chat" else read_response
    async with aiohttp.ClientSession() as session, session.get(sse_server.url) as resp:
        await reader(resp, True, rec, time.monotonic(), time.monotonic, reply)
    assert rec.ok and rec.completion_tokens == 9 and reply == []
    assert (rec.ttft_s is not None) == started


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
