"""OpenAI's own Python client against a router and two tiny workers (real processes): what clients
written for OpenAI send and parse works through radixgate, errors included."""

from __future__ import annotations

import json
import signal
import threading
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai")

SYSTEM = "You are radixgate's client-compatibility assistant. Answer briefly. " * 12


@pytest.fixture(scope="module")
def fleet(launch_module):
    """A cache_aware router and two tiny workers; returns (router URL, client)."""
    workers = [launch_module.module("worker", "--kv-cache-tokens", "8192") for _ in range(2)]
    router = launch_module.router([w.url for w in workers], "--kv-events", "http")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return router.url, client


def test_chat_stream_and_usage_parse_and_a_shared_prefix_is_served_from_the_cache(fleet):
    _, client = fleet
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"}]
    first = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4)
    answer = first.parse()
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 4 and answer.choices[0].finish_reason == "length"
    messages[1]["content"] = "Second question?"
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(raw.parse())
    assert raw.headers["x-radixgate-worker"] == first.headers["x-radixgate-worker"]  # the prefix's worker
    *deltas, last = chunks
    text = "".join(c.choices[0].delta.content or "" for c in deltas if c.choices)
    assert len(text) >= 1 and last.choices == []
    assert deltas[-1].choices[0].finish_reason == "length"
    assert last.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM)  # bytes: one token each


def test_completions_with_logprobs_and_echo_parse(fleet):
    _, client = fleet
    answer = client.completions.create(
        model="tiny", prompt=["abc", "xyz"], max_tokens=3, logprobs=2, echo=True
    )
    assert [c.index for c in answer.choices] == [0, 1]
    for choice, prompt in zip(answer.choices, ["abc", "xyz"], strict=True):
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == len(lp.tokens)
        # NOTE: as OpenAI's: the sampled token is listed too, so up to logprobs + 1 entries
        assert lp.token_logprobs[0] is None and all(len(t) <= 3 for t in lp.top_logprobs[1:])


def test_forced_tool_call_and_structured_output_parse(fleet):
    from pydantic import BaseModel

    _, client = fleet
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}}}]  # fmt: skip
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0,
    )  # fmt: skip
    (call,) = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Lima")

    class Pick(BaseModel):
        colour: Literal["red", "green"]
        sure: bool

    parsed = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Pick one."}], response_format=Pick, max_tokens=64
    )
    assert isinstance(parsed.choices[0].message.parsed, Pick)


def test_responses_follow_up_retrieve_delete_and_stream_events(fleet):
    _, client = fleet
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}]
    first = client.responses.create(model="tiny", input=opening, max_output_tokens=4)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text and first.usage.output_tokens == 4
    follow = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=4)  # fmt: skip
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= len(SYSTEM)  # the same worker, its cache
    # every field OpenAI's types require (the client builds objects without checking them)
    type(follow).model_validate(follow.model_dump(exclude_unset=True))
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    with client.responses.stream(model="tiny", input="Stream this.", max_output_tokens=4) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_errors_map_to_the_clients_exception_classes(fleet):
    _, client = fleet
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=user)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=user, temperature=-1)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="y" * 20_000, max_tokens=1)
    assert long.value.code == "context_length_exceeded"


def test_a_stream_cut_off_by_a_dying_worker_raises_in_the_client(launch):
    """The worker dies mid-answer: the client raises an APIError saying so, not a short answer."""
    victim = launch.echo_backend("--decode-ms-per-token", "50")
    router = launch.router([victim.url])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.completions.create(model="echo", prompt="stream me", max_tokens=400, stream=True)
    received = []
    with pytest.raises(openai.APIError) as cut:
        for chunk in stream:
            received.append(chunk.choices[0].text)
            if len(received) == 3:
                threading.Thread(target=victim.proc.send_signal, args=(signal.SIGKILL,)).start()
    assert 3 <= len(received) < 400 and cut.value.code == "stream_broken"
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
