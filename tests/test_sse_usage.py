"""The router's SSE usage scanner: usage found wherever the stream is cut, bytes passed on as
they came, and with ``strip`` the usage-only event taken out (the client did not ask for it)."""

from __future__ import annotations

import orjson
import pytest

from router.proxy import SSEUsageScanner
from router.request_parsing import parse_request, with_stream_usage
from router.tokenization import ByteTokenizer

CHUNK = b'data: {"choices": [{"index": 0, "text": "the usage of words"}]}\n\n'
USAGE = (
    b'data: {"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = CHUNK + CHUNK + USAGE + DONE


def run(scanner: SSEUsageScanner, pieces: list[bytes]) -> bytes:
    return b"".join(scanner.feed(p) for p in pieces) + scanner.flush()


@pytest.mark.parametrize("cut", range(0, len(STREAM), 7))
def test_usage_is_found_and_only_the_usage_event_is_stripped_wherever_the_stream_is_cut(cut):
    pieces = [STREAM[:cut], STREAM[cut : cut + 50], STREAM[cut + 50 :]]
    passthrough = SSEUsageScanner()
    assert run(passthrough, pieces) == STREAM
    assert (passthrough.usage.prompt_tokens, passthrough.usage.cached_tokens) == (7, 3)
    strip = SSEUsageScanner(strip=True)
    assert run(strip, pieces) == CHUNK + CHUNK + DONE
    assert strip.usage.cached_tokens == 3


def test_byte_by_byte_and_crlf_events():
    stream = STREAM.replace(b"\n", b"\r\n")
    strip = SSEUsageScanner(strip=True)
    assert run(strip, [stream[i : i + 1] for i in range(len(stream))]) == (CHUNK + CHUNK + DONE).replace(
        b"\n", b"\r\n"
    )
    assert strip.usage.prompt_tokens == 7


def test_a_chunk_with_choices_and_usage_is_kept():
    both = b'data: {"choices": [{"index": 0, "text": "x"}], "usage": {"prompt_tokens": 2}}\n\n'
    strip = SSEUsageScanner(strip=True)
    assert run(strip, [both + DONE]) == both + DONE
    assert strip.usage.prompt_tokens == 2


@pytest.mark.parametrize(
    ("options", "strip", "sent"),
    [
        (None, True, {"include_usage": True}),
        ({"include_usage": False}, True, {"include_usage": True}),
        ({"include_usage": True}, False, {"include_usage": True}),
        # vLLM's continuous_usage_stats counts only with include_usage: not sent where the router adds it
        ({"continuous_usage_stats": True}, True, {"include_usage": True}),
        (
            {"include_usage": True, "continuous_usage_stats": True},
            False,
            {"include_usage": True, "continuous_usage_stats": True},
        ),
    ],
)
def test_the_router_asks_for_usage_where_the_client_did_not(options, strip, sent):
    body = {"prompt": "hi", "stream": True, "max_tokens": 3}
    if options is not None:
        body["stream_options"] = options
    raw = orjson.dumps(body)
    out, must_strip = with_stream_usage(parse_request(raw, False, ByteTokenizer()))
    assert must_strip == strip
    assert orjson.loads(out) == {**body, "stream_options": sent}
    if not strip:
        assert out == raw  # sent as it came


def _large_chat_answer(prompt: int, cached: int) -> dict:
    """A non-stream answer of a few hundred KB (logprobs), a "usage" string in its text and tokens."""
    entry = {"token": "usage", "logprob": -0.5, "top_logprobs": [{"token": '"usage": {', "logprob": -1.0}]}
    return {"id": "x", "choices": [{"index": 0, "message": {"content": '{"usage": {"prompt_tokens": 1}}'},
                                    "logprobs": {"content": [entry] * 4000}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 4000,
                      "prompt_tokens_details": {"cached_tokens": cached}}}  # fmt: skip


def test_a_large_answers_usage_is_read_from_its_usage_object_alone() -> None:
    from router.proxy import Usage, body_usage

    chat = orjson.dumps(_large_chat_answer(900, 512))
    assert len(chat) > 1 << 18 and body_usage(chat) == Usage(900, 512)
    responses = orjson.dumps({"output": [{"content": [{"text": "x" * 300_000}]}], "status": "completed",
                              "usage": {"input_tokens": 70, "input_tokens_details": {"cached_tokens": 64}}})  # fmt: skip
    assert body_usage(responses) == Usage(70, 64)
    assert body_usage(b'{"usage": {"prompt_tokens": 5}}') == Usage(5, 0)  # small: parsed whole
    assert body_usage(chat[:-40]) is None and body_usage(b"not json") is None


def test_a_large_event_cut_into_many_chunks_gives_its_usage_and_passes_on_whole() -> None:
    event = {"type": "response.completed", "response": {"output": [{"text": "y" * 400_000}],
             "usage": {"input_tokens": 33, "input_tokens_details": {"cached_tokens": 16}}}}  # fmt: skip
    data = b"event: response.completed\ndata: " + orjson.dumps(event) + b"\n\n"
    for strip in (False, True):
        scanner = SSEUsageScanner(strip)
        out = b"".join(scanner.feed(data[i : i + 4096]) for i in range(0, len(data), 4096)) + scanner.flush()
        assert out == data and (scanner.usage.prompt_tokens, scanner.usage.cached_tokens) == (33, 16)


@pytest.mark.parametrize(
    "event, code",
    [
        (
            {"error": {"message": "draining", "type": "service_unavailable", "code": "shutting_down"}},
            "shutting_down",
        ),
        ({"type": "error", "sequence_number": 4, "code": "stream_broken", "message": "cut"}, "stream_broken"),
        (
            {"type": "response.failed", "response": {"error": {"code": "server_error", "type": "engine"}}},
            "engine",
        ),
        ({"type": "response.completed", "response": {"status": "completed", "error": None}}, None),
    ],
)
def test_the_error_event_that_ends_a_stream_is_noted(event, code):
    """Chat and completions error chunks, a Responses stream's error and response.failed events:
    their code is what the access log names; a response's ``"error": null`` is none."""
    scanner = SSEUsageScanner()
    line = b"data: " + orjson.dumps(event) + b"\n\n"
    run(scanner, [CHUNK, line[:20], line[20:], DONE])
    assert scanner.error == code
