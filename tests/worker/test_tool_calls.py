"""Tool calling: request checks, calls read from text (whole and streamed, which must agree), forced
calls generated under a grammar by a real worker, tool turns in the prompt and its cache."""

from __future__ import annotations

import functools
import itertools
import json
import re

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tokenization import ByteTokenizer, HFTokenizer
from worker.tool_calls import ToolOutput, ToolRequest, tool_request

from .test_server import serve

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "maximum": 999},
                "b": {"type": "integer", "maximum": 999},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]


# ---------------------------------------------------------------------- request checks
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": {"a": 1}}, "must be a list"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools\\[0\\]"),
        ({"tools": [WEATHER, WEATHER]}, "two tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tool_choice": "required"}, "needs 'tools'"),
    ],
)
def test_malformed_tool_requests_are_refused(body, message) -> None:
    with pytest.raises(ValueError, match=message):
        tool_request(body)


def test_tool_choice_defaults_to_auto() -> None:
    assert tool_request({}) is None
    assert tool_request({"tools": TOOLS}) == ToolRequest(TOOLS, "auto")
    named = tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert (named.choice, named.name) == ("function", "add")


# ---------------------------------------------------------------------- reading calls
def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
    ]


def test_hermes_calls_and_the_text_around_them() -> None:
    out = ToolOutput(ToolRequest(TOOLS, "auto"), "hermes")
    text = ('Let me check.\n<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')  # fmt: skip
    message = out.message(text)
    assert message["content"] == "Let me check."
    assert calls_of(message) == [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_without_parallel_calls_a_second_hermes_block_is_content_not_dropped() -> None:
    text = ('<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>\n'
            '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}</tool_call>')  # fmt: skip
    request = ToolRequest(TOOLS, "auto", parallel=False)
    whole = ToolOutput(request, "hermes").message(text)
    assert calls_of(whole) == [("add", {"a": 1, "b": 2})]
    assert whole["content"] == text[text.index("\n") :]  # the second block as the model wrote it
    for pieces in ([text], list(text)):
        assert streamed(ToolOutput(request, "hermes"), pieces) == (whole["content"], calls_of(whole))


def test_text_that_is_not_a_call_stays_content() -> None:
    out = ToolOutput(ToolRequest(TOOLS, "auto"), "hermes")
    text = "<tool_call>{broken</tool_call> and more"
    assert out.message(text) == {"role": "assistant", "content": text}
    assert out.finish_reason("stop") == "stop"


def test_llama3_json_calls() -> None:
    out = ToolOutput(ToolRequest(TOOLS, "auto"), "llama3_json")
    message = out.message(
        '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}'
    )
    assert message["content"] is None
    assert calls_of(message) == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert ToolOutput(ToolRequest(TOOLS, "auto"), "llama3_json").message("{ not a call") == {
        "role": "assistant",
        "content": "{ not a call",
    }


def streamed(out: ToolOutput, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Replay stream deltas into (content, calls) as a client does."""
    deltas = [d for p in pieces for d in out.feed(p)] + out.flush()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            entry["name"] += c.get("function", {}).get("name", "")
            entry["arguments"] += c.get("function", {}).get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))  # indices 0, 1, ... in order
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]


def cut(text: str, cuts: list[int]) -> list[str]:
    """``text`` in pieces at the positions ``cuts`` name (modulo its length), as a stream brings it."""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


# an argument that spells the closing tag
SPELLED_CLOSE = (
    'Run it.<tool_call>{"name":"add","arguments":{"s":"</tool_call>","t":"\\"</tool_call>"}}</tool_call>'
)
HERMES_TEXTS = [
    'Sure.<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>',
    'A <tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call> B <tool_call>{"name":"x","arguments":{}}</tool_call>',
    "no calls at all, just < and <tool and <tool_c",
    '<tool_call>{"name":"add","arguments":{"a":1}}',  # unterminated (cut by max_tokens)
    "<tool_call>not json</tool_call> tail",
    'Let me look.<tool_call>{"name":"add","arguments":{}}</tool_call> <tool_call>',  # cut off at a tag
    'Checking.\n<tool_call>{"name":"add","arguments":{}}</tool_call>\nDone.',  # whitespace before a call
    SPELLED_CLOSE,
]
# answers whose <tool_call> blocks do not parse: the stream is the text, whitespace and all
NOT_CALLS = [
    'Let me check. <tool_call>{"name":"add","argu',  # cut off by max_tokens
    "See:\n<tool_call>not json</tool_call> ok",
    "one \n\t<tool_call>[1]</tool_call>\n two <tool_call>{",
    "no calls at all, just < and <tool and <tool_c",
]


@pytest.mark.parametrize("tail", ["", "<", "</tool_ca", "</tool_call"])
def test_a_call_cut_off_inside_its_close_tag_is_the_call(tail) -> None:
    """max_tokens cutting a spelled-out </tool_call>: the call was content (its markup), while a cut a token
    earlier kept it a call; whole and streamed alike."""
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}' + tail
    whole = ToolOutput(ToolRequest(TOOLS, "auto"), "hermes").message(text)
    assert calls_of(whole) == [("add", {"a": 1, "b": 2})] and not whole.get("content"), whole
    for cuts in ([], [5], [len(text) - 2], list(range(0, len(text), 3))):
        content, calls = streamed(ToolOutput(ToolRequest(TOOLS, "auto"), "hermes"), cut(text, cuts))
        assert (content, calls) == ("", [("add", {"a": 1, "b": 2})]), cuts


def test_a_closing_tag_inside_an_argument_string_does_not_end_the_call() -> None:
    """The grammar lets an argument spell </tool_call> (or [TOOL_CALLS]); the call ends at the tag
    outside its JSON strings."""
    message = ToolOutput(ToolRequest(TOOLS, "auto"), "hermes").message(SPELLED_CLOSE)
    assert message["content"] == "Run it."
    assert calls_of(message) == [("add", {"s": "</tool_call>", "t": '"</tool_call>'})]
    text = '[TOOL_CALLS][{"name":"add","arguments":{"s":"see [TOOL_CALLS] doc"}}]'
    message = ToolOutput(ToolRequest(TOOLS, "auto"), "mistral").message(text)
    assert message["content"] is None and calls_of(message) == [("add", {"s": "see [TOOL_CALLS] doc"})]


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(NOT_CALLS), cuts=st.lists(st.integers(0, 60), max_size=12))
def test_a_streamed_answer_without_calls_is_its_whole_text(text, cuts) -> None:
    assert ToolOutput(ToolRequest(TOOLS, "auto"), "hermes").message(text) == {
        "role": "assistant",
        "content": text,
    }
    assert streamed(ToolOutput(ToolRequest(TOOLS, "auto"), "hermes"), cut(text, cuts)) == (text, [])


GRANITE_TEXTS = [
    'Sure. <|tool_call|>[{"name":"add","arguments":{"a":1,"b":2}}, {"name":"add","arguments":{"a":3,"b":4}}]',
    '<|tool_call|>[{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}]',
    "no call here, just <| and <|tool",
    '<|tool_call|>[{"name":"add","arguments":{"a":1',  # cut off by max_tokens
]


@settings(max_examples=80, deadline=None)
@given(
    parser_text=st.sampled_from(
        [("hermes", t) for t in HERMES_TEXTS] + [("granite", t) for t in GRANITE_TEXTS]
    ),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_streamed_calls_agree_with_the_whole_answer(parser_text, cuts) -> None:
    parser, text = parser_text
    pieces = cut(text, cuts)
    whole = ToolOutput(ToolRequest(TOOLS, "auto"), parser).message(text)
    content, calls = streamed(ToolOutput(ToolRequest(TOOLS, "auto"), parser), pieces)
    assert calls == calls_of(whole)
    assert content == (whole["content"] or "")


REQUIRED_TEXT = (
    '[{"name":"add","parameters":{"a":1,"b":2}},'
    '{"name":"get_weather","parameters":{"city":"O\\"s}l[o","unit":"c"}}]'
)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=12), parser=st.sampled_from(["hermes", "llama3_json"]))
def test_streamed_required_calls_come_as_generated_and_agree_with_the_whole_answer(cuts, parser) -> None:
    text = REQUIRED_TEXT
    pieces = cut(text, cuts)
    whole = ToolOutput(ToolRequest(TOOLS, "required"), parser).message(text)
    out = ToolOutput(ToolRequest(TOOLS, "required"), parser)
    content, calls = streamed(out, pieces)
    assert content == "" and calls == calls_of(whole) == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": 'O"s}l[o', "unit": "c"}),
    ]
    assert out.finish_reason("stop") == "tool_calls"
    # without parallel calls, one call in all, streamed as whole (the stream sent every call the text held)
    single = ToolOutput(ToolRequest(TOOLS, "required", parallel=False), parser)
    content, calls = streamed(single, pieces)
    assert content == "" and calls == calls_of(
        single_whole := ToolOutput(ToolRequest(TOOLS, "required", parallel=False), parser).message(text)
    )
    assert calls == [("add", {"a": 1, "b": 2})] and len(single_whole["tool_calls"]) == 1 and single.calls == 1


def raw_calls(message_or_deltas: dict | list[dict]) -> list[tuple[str, str]]:
    """(name, arguments text) of a message's calls, or of stream deltas put together."""
    if isinstance(message_or_deltas, dict):
        return [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message_or_deltas.get("tool_calls", [])
        ]
    calls: dict[int, list[str]] = {}
    for d in message_or_deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], ["", ""])
            entry[0] += c.get("function", {}).get("name", "")
            entry[1] += c.get("function", {}).get("arguments", "")
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def test_a_required_answer_cut_off_gives_the_calls_so_far_whole_as_streamed() -> None:
    for end in range(len(REQUIRED_TEXT) + 1):
        text = REQUIRED_TEXT[:end]
        whole = ToolOutput(ToolRequest(TOOLS, "required"), "hermes")
        message = whole.message(text)
        stream = ToolOutput(ToolRequest(TOOLS, "required"), "hermes")
        deltas = stream.feed(text) + stream.flush()
        assert raw_calls(message) == raw_calls(deltas), text
        assert message["content"] is None  # a forced call's answer has no content, with calls or without
        assert whole.finish_reason("length") == "length" and whole.calls == stream.calls
    assert raw_calls(ToolOutput(ToolRequest(TOOLS, "required"), "hermes").message(REQUIRED_TEXT[:83])) == [
        ("add", '{"a":1,"b":2}'), ("get_weather", '{"cit')]  # fmt: skip


@pytest.mark.parametrize("name", ['say"hi', "C:\\run", "tab\there", "ünï"])
def test_a_required_calls_name_with_escapes_comes_back_as_the_tools_name(name) -> None:
    text = json.dumps([{"name": name, "parameters": {"a": 1}}])
    whole = ToolOutput(ToolRequest(TOOLS, "required"), "hermes").message(text)
    assert calls_of(whole) == [(name, {"a": 1})]
    assert streamed(ToolOutput(ToolRequest(TOOLS, "required"), "hermes"), list(text)) == (
        "",
        [(name, {"a": 1})],
    )


def test_a_required_call_is_sent_before_the_answer_ends() -> None:
    out = ToolOutput(ToolRequest(TOOLS, "required"), "hermes")
    assert out.feed('[{"name":"ad') == []
    head, args = out.feed('d","parameters":{"a"')
    assert head["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert out.feed(":1") == [{"tool_calls": [{"index": 0, "function": {"arguments": ":1"}}]}]


def test_streamed_llama3_json_calls_come_whole() -> None:
    text = '[{"name":"add","parameters":{"a":1,"b":2}}]'
    out = ToolOutput(ToolRequest(TOOLS, "auto"), "llama3_json")
    assert out.feed(text[:20]) == [] and out.feed(text[20:]) == []
    assert streamed(out, []) == ("", [("add", {"a": 1, "b": 2})])
    plain = ToolOutput(ToolRequest(TOOLS, "auto"), "llama3_json")
    assert streamed(plain, ["  Hel", "lo"]) == ("  Hello", [])


# ---------------------------------------------------------------------- prompts
def test_byte_template_puts_tools_first_and_renders_tool_turns() -> None:
    tok = ByteTokenizer()
    turn = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]  # fmt: skip
    text = tok.render_chat(turn, TOOLS)
    assert text.startswith("<|tools|>\n[{") and text.endswith("<|tool|>\n5\n<|assistant|>\n")
    assert '<|assistant|>\n<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>\n' in text
    # the rendered call is what the hermes parser reads back
    assert calls_of(
        ToolOutput(ToolRequest(TOOLS, "auto"), "hermes").message(text.split("<|assistant|>\n")[1])
    ) == [("add", {"a": 2, "b": 3})]
    # without tools, the prompt is the plain template
    assert tok.render_chat(turn[:1]) == "<|user|>\n2+3?\n<|assistant|>\n"


def test_hf_template_gets_tools_and_arguments_as_data(tmp_path) -> None:
    from .conftest import write_tokenizer

    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}T={{ tools | map(attribute='function') | map(attribute='name') | join(',') }};{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %};"
        "{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
        }
    ]
    assert (
        HFTokenizer(str(tmp_path)).render_chat(messages, TOOLS)
        == 'T=get_weather,add;assistant:[add {"a": 1}];'
    )


# ---------------------------------------------------------------------- a real worker
@pytest.fixture(scope="module")
def worker():
    with serve() as live:
        yield httpx.Client(base_url=live.url, timeout=120)


MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_named_tool_choice_gives_schema_valid_arguments(worker) -> None:
    for seed in range(3):
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "temperature": 1.0, "seed": seed,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
        choice = worker.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        [(name, args)] = calls_of(choice["message"])
        assert name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
        assert choice["message"]["tool_calls"][0]["id"].startswith("call_")


def test_required_tool_choice_gives_calls_of_known_tools(worker) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "tool_choice": "required",
            "parallel_tool_calls": False, "n": 3, "temperature": 1.0, "seed": 5}  # fmt: skip
    for choice in worker.post("/v1/chat/completions", json=body).json()["choices"]:
        if choice["finish_reason"] == "length":  # a long random integer ran out of tokens: the call so far
            assert choice["message"]["content"] is None
            assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} <= {"get_weather", "add"}
            continue
        [(name, args)] = calls_of(choice["message"])
        assert name in ("get_weather", "add")
        assert set(args) == ({"city", "unit"} if name == "get_weather" else {"a", "b"})


def test_a_required_answer_cut_off_by_max_tokens_gives_the_same_calls_whole_and_streamed(worker) -> None:
    body = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 40,
        "temperature": 0,
    }
    choice = worker.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    calls = raw_calls(choice["message"])
    assert calls and {name for name, _ in calls} <= {"get_weather", "add"}
    deltas, finish = [], None
    with worker.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed_choice = json.loads(line[6:])["choices"][0]
                deltas.append(streamed_choice["delta"])
                finish = streamed_choice["finish_reason"] or finish
    assert (raw_calls(deltas), finish) == (calls, "length")


def test_streamed_named_call_equals_the_whole_answer(worker) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "add"}}}  # fmt: skip
    whole = worker.post("/v1/chat/completions", json=body).json()["choices"][0]
    name, arguments, finish, contents = "", "", None, []
    with worker.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if "content" in choice["delta"]:
                    contents.append(choice["delta"]["content"])
                for call in choice["delta"].get("tool_calls", []):
                    assert call["index"] == 0
                    name += call.get("function", {}).get("name", "")
                    arguments += call["function"].get("arguments", "")
                finish = choice["finish_reason"] or finish
    assert finish == whole["finish_reason"] == "tool_calls"
    # no content, whole or streamed (the role chunk's was "": an SDK's stream put together read "")
    assert whole["message"]["content"] is None and contents == [None]
    assert (name, arguments) == (whole["message"]["tool_calls"][0]["function"]["name"],
                                 whole["message"]["tool_calls"][0]["function"]["arguments"])  # fmt: skip


def test_tool_turns_reuse_the_cached_prefix_and_none_keeps_the_prompt(worker) -> None:
    first = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "temperature": 0,
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    answer = worker.post("/v1/chat/completions", json=first).json()
    follow = [*MESSAGES, answer["choices"][0]["message"],
                         {"role": "tool", "tool_call_id": answer["choices"][0]["message"]["tool_calls"][0]["id"],
                          "content": '{"temp": 3}'},
    ]  # fmt: skip
    second = worker.post("/v1/chat/completions", json={"messages": follow, "tools": TOOLS, "max_tokens": 4})
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    page = worker.get("/v1/cache/info").json()["block_size"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= answer["usage"]["prompt_tokens"] // page * page
    # tool_choice none: the same prompt as auto (tools rendered), so the same cached prefix
    auto = worker.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1}
    ).json()
    none = worker.post("/v1/chat/completions",
                       json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1, "tool_choice": "none"}).json()  # fmt: skip
    plain = worker.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert none["usage"]["prompt_tokens"] == auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert "tool_calls" not in none["choices"][0]["message"]


def metric(client: httpx.Client, series: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_constrained_requests_and_tool_calls(worker) -> None:
    forced = 'radixgate_worker_constrained_requests_total{kind="tool_call"}'
    before = metric(worker, forced), metric(worker, "radixgate_worker_tool_calls_total")
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "n": 2, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    worker.post("/v1/chat/completions", json=body)
    worker.post("/v1/chat/completions", json={**body, "stream": True})
    assert metric(worker, forced) == before[0] + 2  # one per request
    assert metric(worker, "radixgate_worker_tool_calls_total") == before[1] + 4  # one per choice


def test_tool_errors_are_400_and_the_worker_keeps_serving(worker) -> None:
    bad = [
        {"messages": MESSAGES, "tools": [{"type": "function"}]},
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "x"}},
        },
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
    ]
    for body in bad:
        r = worker.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert (
        worker.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    )


# ---------------------------------------------------------------------- auto calls under a grammar
def test_auto_calls_in_free_text_always_parse() -> None:
    """tool_choice auto (hermes): text is free, and whatever follows a <tool_call> the model writes
    is a call to one of the tools with arguments of its schema. Random walks that start calls often."""
    import random

    import numpy as np

    from router.tokenization import ByteTokenizer
    from worker.guided import GuideCompiler, allowed_mask
    from worker.tool_calls import auto_grammar

    req = ToolRequest(TOOLS, "auto")
    guide = GuideCompiler(ByteTokenizer(), 257).compile(*auto_grammar(req, trigger_is_special=False))
    calls_seen = 0
    for seed in range(6):
        rng, m, out = random.Random(seed), guide.matcher(), b""
        while len(out) < 3000:
            allowed = set(np.flatnonzero(allowed_mask([m], 257)[0].numpy()).tolist())
            if len(out) >= 400 and ByteTokenizer.EOS in allowed:  # NOTE: ended where a call is not open
                break
            want = b"<tool_call>"[len(out) - out.rfind(b"<") :] if b"<" in out[-11:] else b"<"
            nxt = (
                want[0] if want and want[0] in allowed and rng.random() < 0.9 else rng.choice(sorted(allowed))
            )
            if nxt == ByteTokenizer.EOS:
                break
            assert m.consume_token(nxt)
            out += bytes([nxt])
        text = out.decode("utf-8", errors="replace")
        if "<tool_call>" in text and text.count("</tool_call>") == text.count("<tool_call>"):
            message = ToolOutput(req, "hermes").message(text)
            assert len(message["tool_calls"]) == text.count("<tool_call>")
            for name, args in calls_of(message):
                params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
                assert set(args) == set(params["required"])
            calls_seen += len(message["tool_calls"])
    assert calls_seen >= 3


def test_auto_calls_may_have_the_newlines_qwens_template_puts_around_their_json() -> None:
    """<tool_call>\n{...}\n</tool_call>, as Qwen's and Hermes' templates write calls and ask for them: the
    grammar refused the newlines, pushing such models off their own format at every call."""
    from worker.guided import GuideCompiler, allowed_mask
    from worker.tool_calls import auto_grammar

    req = ToolRequest(TOOLS, "auto")
    guide = GuideCompiler(ByteTokenizer(), 257).compile(*auto_grammar(req, trigger_is_special=False))
    call = '{"name":"add","arguments":{"a":1,"b":2}}'
    for text in (f"<tool_call>\n{call}\n</tool_call>", f"<tool_call>{call}</tool_call>",
                 f"Sure.<tool_call>\n{call}</tool_call>"):  # fmt: skip
        m = guide.matcher()
        assert m.consume_tokens(list(text.encode())) and allowed_mask([m], 257)[0][ByteTokenizer.EOS], text
        assert calls_of(ToolOutput(req, "hermes").message(text)) == [("add", {"a": 1, "b": 2})]
    m = guide.matcher()
    assert not m.consume_tokens(list(f"<tool_call>\n\n{call}".encode()))  # one newline, not any whitespace


def test_a_call_whose_arguments_escape_a_lone_surrogate_is_answered_not_a_500(worker) -> None:
    """JSON text may write "\\ud800", which decodes to no character UTF-8 has: the call's arguments were
    re-encoded with it raw and the answer failed to encode (a 500; a stream cut off). They keep the escape."""
    text = '<tool_call>{"name": "add", "arguments": {"a": "\\ud800", "b": 2}}</tool_call>'
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "guided_regex": re.escape(text)}
    r = worker.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a":"\\ud800","b":2}'}
    assert json.loads(call["function"]["arguments"]) == {"a": "\ud800", "b": 2}
    assert streamed_answer(worker, body)[1] == [("add", {"a": "\ud800", "b": 2})]
    named = ToolOutput(ToolRequest(TOOLS, "auto"), "hermes").message(
        '<tool_call>{"name": "a\\udc00", "arguments": {}}</tool_call>'
    )
    assert "tool_calls" not in named  # no tool has such a name: the text stays content, as written
    assert named["content"] == '<tool_call>{"name": "a\\udc00", "arguments": {}}</tool_call>'


def test_a_special_tool_call_token_is_matched_as_that_token(tmp_path) -> None:
    from tokenizers import AddedToken, Tokenizer

    from router.tokenization import HFTokenizer
    from worker.guided import GuideCompiler
    from worker.tool_calls import auto_grammar

    from .conftest import write_tokenizer

    write_tokenizer(tmp_path)
    assert not GuideCompiler(HFTokenizer(str(tmp_path)), 400).special_token("<tool_call>")
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<tool_call>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path))
    compiler = GuideCompiler(hf, hf.vocab_size)
    assert compiler.special_token("<tool_call>")
    m = compiler.compile(*auto_grammar(ToolRequest(TOOLS, "auto"), trigger_is_special=True)).matcher()
    assert m.consume_tokens(hf.encode_prompt("Let me check.")[1:])  # [1:]: no BOS
    assert m.consume_token(hf._tok.token_to_id("<tool_call>"))
    assert m.consume_tokens(
        hf._tok.encode('{"name":"add","arguments":{"a":1,"b":2}}', add_special_tokens=False).ids
    )
    assert not m.is_error()


def test_auto_tools_are_constrained_unless_a_format_is_asked(worker) -> None:
    series = 'radixgate_worker_constrained_requests_total{kind="tool_auto"}'
    before = metric(worker, series)
    r = worker.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 8})
    assert r.status_code == 200 and metric(worker, series) == before + 1
    # an explicit format wins over the auto tool grammar
    fmt = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "response_format": {"type": "json_object"},
           "temperature": 0}  # fmt: skip
    body = worker.post("/v1/chat/completions", json=fmt).json()
    assert metric(worker, series) == before + 1
    assert body["choices"][0]["message"]["content"].startswith("{")


# ---------------------------------------------------------------------- tags that are added tokens
@pytest.fixture(scope="module", params=[True, False], ids=["special-tags", "text-tags"])
def tagged(request, tmp_path_factory):
    """A worker whose tokenizer has <tool_call> and </tool_call> as added tokens, special (Hermes 2
    Pro) or not (Qwen 2.5 / 3); yields (client, checkpoint directory, the two tags' ids)."""
    from .conftest import TOOL_TAGS, save_tool_tag_checkpoint

    directory = save_tool_tag_checkpoint(tmp_path_factory.mktemp("tagged"), special=request.param)
    tags = [HFTokenizer(str(directory))._tok.token_to_id(t) for t in TOOL_TAGS]
    with serve(model=str(directory)) as live:
        yield httpx.Client(base_url=live.url, timeout=120), directory, tags


def streamed_answer(client: httpx.Client, body: dict) -> tuple[str, list[tuple[str, dict]], str | None]:
    """A streamed chat answer as a client puts it together: (content, calls, finish_reason)."""
    content, calls, finish = "", {}, None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                content += choice["delta"].get("content") or ""
                for c in choice["delta"].get("tool_calls", []):
                    entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                    entry["name"] += c.get("function", {}).get("name", "")
                    entry["arguments"] += c.get("function", {}).get("arguments", "")
                finish = choice["finish_reason"] or finish
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], finish


def test_auto_calls_are_read_when_the_tags_are_added_tokens(tagged) -> None:
    """The model opens a call with its own <tool_call> token (pushed by logit_bias): the grammar
    allows it, the reader sees the tags, the answer is that call (the arguments the model wrote),
    whole and streamed, and no tag shows as content."""
    client, _, (open_id, _) = tagged
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 150, "temperature": 0,
            "logit_bias": {str(open_id): 100}, "stop": ["</tool_call>"]}  # fmt: skip
    choice = client.post("/v1/chat/completions", json={**body, "logprobs": True}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    [(name, args)] = calls_of(choice["message"])
    written = bytes(b for entry in choice["logprobs"]["content"] for b in entry["bytes"]).decode()
    assert written.startswith(("<tool_call>{", "<tool_call>\n{"))
    assert json.loads(written.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": name, "arguments": args}  # fmt: skip
    assert name == "get_weather" and set(args) == {"city", "unit"}
    assert streamed_answer(client, body) == ("", [(name, args)], "tool_calls")


def test_auto_calls_follow_one_another_when_the_tags_are_added_tokens(tagged) -> None:
    """After a call's </tool_call> the text is free again: the model opens the next call."""
    client, _, (open_id, _) = tagged
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
            "logit_bias": {str(open_id): 100}}  # fmt: skip
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls = calls_of(choice["message"])
    assert len(calls) >= 2 and {name for name, _ in calls} == {"get_weather"}, choice
    content, streamed_calls, finish = streamed_answer(client, body)
    assert (streamed_calls, finish) == (calls, choice["finish_reason"])
    assert content.split() == (choice["message"]["content"] or "").split()


def test_parallel_tool_calls_false_gives_one_call_at_most(tagged) -> None:
    """The same push into calls as above, with parallel_tool_calls false: one call, whole and
    streamed (the grammar allows one; a tag spelled in the free text after it is not a call)."""
    client, _, (open_id, _) = tagged
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
            "logit_bias": {str(open_id): 100}, "parallel_tool_calls": False}  # fmt: skip
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls = calls_of(choice["message"])
    assert len(calls) == 1 and calls[0][0] == "get_weather", choice
    _, streamed_calls, _ = streamed_answer(client, body)
    assert streamed_calls == calls


def test_a_call_is_closed_with_the_models_own_close_tag_token(tagged) -> None:
    """Both tags are tokens of the model's: the answer opens and closes the call with them (one
    token each), not with the close tag spelled out piece by piece."""
    client, directory, (open_id, close_id) = tagged
    bias = {str(open_id): 100}
    if HFTokenizer(str(directory))._tok.get_added_tokens_decoder()[close_id].special:
        bias[str(close_id)] = 100  # NOTE: else a text token, which free text may hold anywhere
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 150, "temperature": 0, "logprobs": True,
            "logit_bias": bias}  # fmt: skip
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert calls_of(choice["message"]), choice  # (calls follow one another up to max_tokens)
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert tokens[0] == "<tool_call>" and "</tool_call>" in tokens, tokens


def test_auto_grammar_allows_the_models_own_tag_tokens(tagged) -> None:
    """Under tool_choice auto the tag tokens are allowed where a call opens and closes, and the
    text is free again after a call, whether the tags are special tokens or not."""
    from worker.guided import GuideCompiler, allowed_mask
    from worker.tool_calls import auto_grammar

    _, directory, (open_id, close_id) = tagged
    tok = HFTokenizer(str(directory))
    compiler = GuideCompiler(tok, tok.vocab_size)
    special = compiler.special_token("<tool_call>")
    assert special == tok._tok.get_added_tokens_decoder()[open_id].special
    req = ToolRequest([WEATHER], "auto")
    # (grammar, is the close the model's own token?): a special close is spelled unless it is named
    cases = [(auto_grammar(req, special), not special)]
    if special:
        cases.append((auto_grammar(req, True, close_is_special=True), True))
    for grammar, close_is_the_token in cases:
        m = compiler.compile(*grammar).matcher()
        close: list[int] = []
        for newline in (True, False):  # a second call after the first, its JSON without the newlines
            assert allowed_mask([m], tok.vocab_size)[0][open_id]
            assert m.consume_token(open_id)
            body = '{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}'
            if newline:
                body = "\n" + body + "\n"
            assert m.consume_tokens(tok._tok.encode(body, add_special_tokens=False).ids)
            if newline:  # then the close is forced
                close = m.compute_ff_tokens()
                assert tok.decode(close, skip_special_tokens=False) == "</tool_call>"
                assert (close == [close_id]) == close_is_the_token
            assert allowed_mask([m], tok.vocab_size)[0][close[0]]
            assert m.consume_tokens(close) and not m.is_error()
            assert allowed_mask([m], tok.vocab_size)[0][tok.eos_token_ids].all()


# ---------------------------------------------------------------------- the mistral format
MISTRAL_TEXTS = [
    'Sure. [TOOL_CALLS] [{"name":"add","arguments":{"a":1,"b":2}}, {"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}]',
    '[TOOL_CALLS]add[ARGS]{"a":1,"b":2}[TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]{"a": 3, "b": 4}',
    '[TOOL_CALLS][{"name":"add","arguments":{"a":1,"b":2}}]',
    "no calls at all, just [ and [TOOL and [TOOL_CALL",
    "a tag and then text: [TOOL_CALLS] not a call",
    '[TOOL_CALLS]add{"a":1}',  # no [ARGS]
    '[TOOL_CALLS]add[ARGS]{"a":1',  # cut off by max_tokens
    'A[TOOL_CALLS]add[ARGS]{"a":1,"b":2}[TOOL_CALLS]add[ARGS]{"a":3',  # the calls made, the last cut off
    # text after the calls (the grammar lets the model write it): the calls, and it as content
    'Ok [TOOL_CALLS] [{"name":"add","arguments":{"a":1,"b":2}}] and then some text ',
    'pre [TOOL_CALLS]add[ARGS]{"a":1,"b":2} mid [TOOL_CALLS]add[ARGS]{"a":3,"b":4} done.',
    'pre [TOOL_CALLS][{"name":"add","arguments":{"a":1,"b":2}}] mid [TOOL_CALLS][{"name":"add","arguments":{"a":3,"b":4}}]',
]


def test_mistral_calls_in_both_formats_and_text_that_is_not_one() -> None:
    def message(text: str, parallel: bool = True) -> dict:
        return ToolOutput(ToolRequest(TOOLS, "auto", parallel=parallel), "mistral").message(text)

    first = message(MISTRAL_TEXTS[0])
    assert first["content"] == "Sure."
    assert calls_of(first) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    second = message(MISTRAL_TEXTS[1])
    assert second["content"] is None and calls_of(second) == [
        ("add", {"a": 1, "b": 2}),
        ("add", {"a": 3, "b": 4}),
    ]
    assert second["tool_calls"][1]["id"] == "abc123XYZ"  # the model's own id, a valid one, is kept
    for message_ in (first, second):
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message_["tool_calls"])
    assert calls_of(message(MISTRAL_TEXTS[0], parallel=False)) == [("add", {"a": 1, "b": 2})]
    for text in MISTRAL_TEXTS[3:-4]:  # nothing the model wrote is dropped when it is not a call
        assert message(text) == {"role": "assistant", "content": text}
    cut = message(MISTRAL_TEXTS[-4])  # a call cut off by max_tokens stays content, with its tag
    assert calls_of(cut) == [("add", {"a": 1, "b": 2})] and cut["content"] == 'A[TOOL_CALLS]add[ARGS]{"a":3'
    after, between, listed = (message(text) for text in MISTRAL_TEXTS[-3:])
    assert calls_of(after) == [("add", {"a": 1, "b": 2})] and after["content"] == "Ok and then some text"
    for both in (between, listed):
        assert calls_of(both) == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert between["content"] == "pre mid done." and listed["content"] == "pre mid"
    one = message(MISTRAL_TEXTS[-2], parallel=False)  # one call: a tag after it is text
    assert calls_of(one) == [("add", {"a": 1, "b": 2})]
    assert one["content"] == 'pre mid [TOOL_CALLS]add[ARGS]{"a":3,"b":4} done.'
    hermes_ids = ToolOutput(ToolRequest(TOOLS, "required"), "hermes").message(REQUIRED_TEXT)["tool_calls"]
    assert all(c["id"].startswith("call_") for c in hermes_ids)  # other parsers keep OpenAI's form


@settings(max_examples=80, deadline=None)
@given(text=st.sampled_from(MISTRAL_TEXTS), cuts=st.lists(st.integers(0, 200), max_size=12),
       parallel=st.booleans())  # fmt: skip
def test_streamed_mistral_agrees_with_the_whole_answer(text, cuts, parallel) -> None:
    pieces = cut(text, cuts)
    whole = ToolOutput(ToolRequest(TOOLS, "auto", parallel=parallel), "mistral").message(text)
    out = ToolOutput(ToolRequest(TOOLS, "auto", parallel=parallel), "mistral")
    deltas = [d for p in pieces for d in out.feed(p)] + out.flush()
    heads = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in heads)
    content, calls = streamed(ToolOutput(ToolRequest(TOOLS, "auto", parallel=parallel), "mistral"), pieces)
    assert calls == calls_of(whole)
    assert content == (whole["content"] or "")


SPACED_CALL = '{"name":"add","arguments":{"a":1,"b":2}}'


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [("hermes", f"\n\nOk. <tool_call>{SPACED_CALL}</tool_call>", "\n\nOk."),
     ("hermes", f"<tool_call>{SPACED_CALL}</tool_call>\n\nThen.", "\n\nThen."),
     ("granite", f"\n\nOk. <|tool_call|>[{SPACED_CALL}]", "\n\nOk."),
     ("mistral", f"\n Ok. [TOOL_CALLS][{SPACED_CALL}]", "\n Ok."),
     ("mistral", f"[TOOL_CALLS][{SPACED_CALL}] ", None)],
)  # fmt: skip
def test_the_whitespace_that_opens_the_content_beside_calls_is_kept_whole_as_streamed(parser, text, content):
    whole = ToolOutput(ToolRequest(TOOLS, "auto"), parser).message(text)
    assert whole["content"] == content and calls_of(whole) == [("add", {"a": 1, "b": 2})]
    for pieces in ([text], list(text)):
        assert streamed(ToolOutput(ToolRequest(TOOLS, "auto"), parser), pieces) == (
            content or "",
            calls_of(whole),
        )


def test_a_named_call_begins_with_its_arguments() -> None:
    """A named ``tool_choice``'s call has no head before its first argument text (a stream sent one
    while the model still thought); an answer cut off before it holds no call, whole or streamed."""
    named = ToolRequest(TOOLS, "function", name="add")
    out = ToolOutput(named, "hermes")
    assert out.feed("") == [] and out.flush() == [] and out.finish_reason("length") == "length"
    whole = ToolOutput(named, "hermes")
    assert (
        whole.message("") == {"role": "assistant", "content": None}
        and whole.finish_reason("length") == "length"
    )
    out = ToolOutput(named, "hermes")
    deltas = out.feed("") + out.feed('{"a":') + out.feed("") + out.feed("1}") + out.flush()
    assert (
        raw_calls(deltas) == raw_calls(ToolOutput(named, "hermes").message('{"a":1}')) == [("add", '{"a":1}')]
    )
    assert (
        sum("id" in c for d in deltas for c in d["tool_calls"]) == 1
        and out.finish_reason("stop") == "tool_calls"
    )
    # whitespace the grammar lets come first (after a thinking model's </think>) is not the arguments:
    # OpenAI's SDK parses a strict tool's arguments on every delta and failed on whitespace alone
    out = ToolOutput(named, "hermes")
    deltas = out.feed("\n") + out.feed(" \t") + out.feed('{"a":') + out.feed(" 1}") + out.flush()
    pieces = [
        c["function"]["arguments"] for d in deltas for c in d["tool_calls"] if c["function"]["arguments"]
    ]
    assert pieces == ['{"a":', " 1}"]
    assert raw_calls(ToolOutput(named, "hermes").message('\n \t{"a": 1}')) == [("add", '{"a": 1}')]
    assert (
        ToolOutput(named, "hermes").message(" \n") == {"role": "assistant", "content": None}
        and out.calls == 1
    )


def test_mistral_auto_grammar_takes_calls_in_the_tokenizers_format(tmp_path) -> None:
    """From [TOOL_CALLS] on only a call of a known tool with schema-valid arguments is allowed: a
    JSON list where the tokenizer lacks [ARGS], else <name>[ARGS]<arguments> (an optional [CALL_ID]
    and 9-character id between); the tags are shown to the reader; the text is free before."""
    from worker.guided import GuideCompiler, allowed_mask
    from worker.tool_calls import MISTRAL_CALLS, tagged_auto_grammar

    from .conftest import save_mistral_tools_checkpoint

    req = ToolRequest([WEATHER], "auto")
    for tags in [("[TOOL_CALLS]",), ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")]:
        tok = HFTokenizer(str(save_mistral_tools_checkpoint(tmp_path / str(len(tags)), tags)))
        compiler = GuideCompiler(tok, tok.vocab_size)
        ids = [compiler.special_id(t) for t in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")]
        guide = compiler.compile(*tagged_auto_grammar(req, MISTRAL_CALLS, *ids))
        assert guide.shown == {i for i in ids if i is not None}

        def enc(text: str, tok: HFTokenizer = tok) -> list[int]:
            return tok._tok.encode(text, add_special_tokens=False).ids

        m = guide.matcher()
        assert m.consume_tokens(enc("Let me look that up. "))
        assert allowed_mask([m], tok.vocab_size)[0][ids[0]]
        assert m.consume_token(ids[0])
        if ids[1] is None:
            assert not m.deep_copy().consume_tokens(enc(' [{"name":"get_time"'))
            assert m.consume_tokens(enc(' [{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}]'))
        else:
            assert not m.deep_copy().consume_tokens(enc("get_time"))
            assert m.consume_tokens(enc("get_weather"))
            with_id = m.deep_copy()
            assert with_id.consume_token(ids[2]) and with_id.consume_tokens(enc("abc123XYZ"))
            assert with_id.consume_token(ids[1]) and not with_id.is_error()
            assert m.consume_token(ids[1])
            assert not m.deep_copy().consume_tokens(enc('{"town":'))
            assert m.consume_tokens(enc('{"city":"Oslo","unit":"c"}'))
        assert not m.is_error()
        assert allowed_mask([m], tok.vocab_size)[0][tok.eos_token_ids].all()  # the answer may end
    # a tokenizer without the tag (the built-in byte one): the tag is text, a lazy trigger
    compiler = GuideCompiler(ByteTokenizer(), ByteTokenizer().vocab_size)
    m = compiler.compile(*tagged_auto_grammar(req, MISTRAL_CALLS, None)).matcher()
    assert m.consume_tokens(list(b"Checking. [TOOL_CALLS]"))
    assert not m.deep_copy().consume_tokens(list(b" not a call"))
    assert m.consume_tokens(list(b' [{"name":"get_weather","arguments":{"city":"Oslo","unit":"f"}}]'))


@pytest.fixture(scope="module", params=[("[TOOL_CALLS]",), ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")],
                ids=["list-format", "args-format"])  # fmt: skip
def mistral(request, tmp_path_factory):
    """A worker with --tool-call-parser mistral whose tokenizer has Mistral's tool tags as special
    tokens and whose template checks call ids as Mistral's do; yields (client, the [TOOL_CALLS] id, EOS ids)."""
    from .conftest import save_mistral_tools_checkpoint

    directory = save_mistral_tools_checkpoint(tmp_path_factory.mktemp("mistral"), request.param)
    tok = HFTokenizer(str(directory))
    with serve(model=str(directory), tool_call_parser="mistral") as live:
        yield (
            httpx.Client(base_url=live.url, timeout=120),
            tok._tok.token_to_id("[TOOL_CALLS]"),
            tok.eos_token_ids,
        )


def test_mistral_calls_are_read_and_their_ids_pass_the_next_turns_template(mistral) -> None:
    """The model opens with its [TOOL_CALLS] token (pushed by logit_bias, and EOS after it): the
    grammar makes a valid call, the reader sees the tag, the answer is that call whole and streamed;
    its id goes back in the next turn through a template that takes only Mistral's ids (and refuses
    OpenAI's form: a 400, the worker serving on)."""
    client, calls_id, eos = mistral
    bias = {str(calls_id): 100, **{str(e): 40 for e in eos}}
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 120, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": bias}  # fmt: skip
    choice = client.post("/v1/chat/completions", json={**body, "logprobs": True}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    [(name, args)] = calls_of(choice["message"])
    assert name == "get_weather" and set(args) == {"city", "unit"}
    assert choice["logprobs"]["content"][0]["token"] == "[TOOL_CALLS]"
    [call] = choice["message"]["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    assert streamed_answer(client, body) == ("", [(name, args)], "tool_calls")

    def next_turn(call_id: str) -> httpx.Response:
        turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{**call, "id": call_id}]},
                {"role": "tool", "tool_call_id": call_id, "content": "12 C, clear"}]  # fmt: skip
        return client.post(
            "/v1/chat/completions", json={"messages": turn, "tools": [WEATHER], "max_tokens": 4}
        )

    assert next_turn(call["id"]).status_code == 200
    refused = next_turn("call_" + "0" * 24)
    assert refused.status_code == 400 and "9 letters and digits" in refused.text
    assert next_turn(call["id"]).status_code == 200


# ---------------------------------------------------------------------- the llama3_json format
def test_llama3_json_auto_grammar_makes_an_answer_that_opens_with_a_brace_calls() -> None:
    """An answer that opens with { is calls of the tools with arguments of their schemas, joined by
    '; ' (one without parallel_tool_calls); any other answer is free, the empty one too."""
    from worker.guided import GuideCompiler, allowed_mask
    from worker.tool_calls import llama3_auto_grammar

    compiler = GuideCompiler(ByteTokenizer(), ByteTokenizer().vocab_size)
    one = '{"name":"add","parameters":{"a":1,"b":2}}'
    two = one + '; {"name":"get_weather","parameters":{"city":"Oslo","unit":"c"}}'
    for parallel in (True, False):
        guide = compiler.compile(*llama3_auto_grammar(ToolRequest(TOOLS, "auto", parallel=parallel), False))

        def complete(text: str, guide=guide) -> bool:
            m = guide.matcher()
            if not m.consume_tokens(list(text.encode())) or m.is_error():
                return False
            return bool(allowed_mask([m], ByteTokenizer().vocab_size)[0][ByteTokenizer.EOS])

        assert complete("It is sunny in Oslo.") and complete("") and complete(one)
        assert complete(two) == parallel
        # free text may open with whitespace, but not with whitespace and then "{": the reader would take
        # that for calls the grammar never checked (an unknown tool's, arguments off the schema)
        assert complete(" It is sunny.") and complete("\n\nSunny.") and complete("  ")
        assert not complete(" " + one) and not complete('\n{"name":"nope","parameters":{}}')
        assert not complete('{"answer": 42}') and not complete('{"name":"get_time","parameters":{}}')
        assert not complete('{"name":"add","parameters":{"a":"one","b":2}}')


@pytest.fixture(scope="module")
def llama3_worker():
    with serve(tool_call_parser="llama3_json") as live:
        yield httpx.Client(base_url=live.url, timeout=120)


def test_llama3_json_auto_calls_parse_whole_and_streamed(llama3_worker) -> None:
    """The model pushed to open its answer with { (logit_bias) writes a call of a tool with valid
    arguments under the grammar, read as that call whole and streamed."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": {str(ord("{")): 100}}  # fmt: skip
    choice = llama3_worker.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    [(name, args)] = calls_of(choice["message"])
    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    assert set(args) == set(params["required"])
    assert streamed_answer(llama3_worker, body) == ("", [(name, args)], "tool_calls")


def test_a_structured_output_beside_auto_tools_is_the_answer_not_a_call(llama3_worker) -> None:
    """response_format takes the place of auto's calls grammar, and so of its reader: a JSON object with
    a "name" (here forced to one no tool has) is the client's data, whole, streamed, and as a Responses
    answer, not a call."""
    person = {"type": "object", "properties": {"name": {"const": "Alice"}, "age": {"const": 30}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
            "response_format": response_format}  # fmt: skip
    choice = llama3_worker.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"], choice
    assert json.loads(choice["message"]["content"]) == {"name": "Alice", "age": 30}
    assert streamed_answer(llama3_worker, body) == (choice["message"]["content"], [], "stop")
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    answer = llama3_worker.post("/v1/responses", json={
        "input": "Who?", "tools": tools, "max_output_tokens": 60, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": person}}}).json()  # fmt: skip
    assert [item["type"] for item in answer["output"]] == ["message"], answer
    assert json.loads(answer["output"][0]["content"][0]["text"]) == {"name": "Alice", "age": 30}


# ---------------------------------------------------------------------- the granite format
def test_granite_calls_follow_their_tag() -> None:
    """(Streams agree with these: test_streamed_calls_agree_with_the_whole_answer.)"""
    for text, expected in zip(GRANITE_TEXTS, [("Sure.", 2), (None, 1), (GRANITE_TEXTS[2], 0),
                                              (GRANITE_TEXTS[3], 0)], strict=True):  # fmt: skip
        whole = ToolOutput(ToolRequest(TOOLS, "auto"), "granite").message(text)
        assert (whole["content"], len(whole.get("tool_calls", []))) == expected
        assert all(c["id"].startswith("call_") for c in whole.get("tool_calls", []))


def test_granite_calls_are_read_after_the_models_own_tag(tmp_path) -> None:
    """A Granite-style tokenizer with <|tool_call|> as a special token and --tool-call-parser granite:
    the model pushed to open with the tag writes a call of a known tool under the grammar, read as
    that call whole and streamed."""
    from .conftest import save_mistral_tools_checkpoint

    directory = save_mistral_tools_checkpoint(tmp_path / "granite", ("<|tool_call|>",))
    tok = HFTokenizer(str(directory))
    bias = {str(tok._tok.token_to_id("<|tool_call|>")): 100, **{str(e): 40 for e in tok.eos_token_ids}}
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 120, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": bias}  # fmt: skip
    with serve(model=str(directory), tool_call_parser="granite") as live:
        client = httpx.Client(base_url=live.url, timeout=120)
        choice = client.post("/v1/chat/completions", json={**body, "logprobs": True}).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [(name, args)] = calls_of(choice["message"])
        assert name == "get_weather" and set(args) == {"city", "unit"}
        assert choice["logprobs"]["content"][0]["token"] == "<|tool_call|>"
        assert streamed_answer(client, body) == ("", [(name, args)], "tool_calls")


# ---------------------------------------------------------------------- tool schemas with references
UNIT = {"type": "function", "function": {"name": "weather", "parameters": {
    "$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"v": {"type": "integer"}, "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "child"], "additionalProperties": False}}}  # fmt: skip


ANCHOR = {"type": "function", "function": {"name": "anchor", "parameters": {
    "type": "object", "properties": {"u": {"$ref": "#unit"}}, "required": ["u"], "additionalProperties": False,
    "$defs": {"U": {"$anchor": "unit", "enum": ["c", "f"]}}}}}  # fmt: skip
NESTED_ID = {"type": "function", "function": {"name": "nested", "parameters": {
    "type": "object", "properties": {"u": {"$id": "https://example.com/u.json", "$ref": "#/$defs/U",
                                           "$defs": {"U": {"enum": ["c", "f"]}}}},
    "required": ["u"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json", "required"])
def test_tool_schemas_with_references_keep_their_meaning_in_every_calls_grammar(fmt) -> None:
    """pydantic writes `$defs` and `$ref` (and `#` for a recursive model): nested in a grammar of
    calls, each reference must still name the tool's own schema, not the grammar's root."""
    from worker.guided import GuideCompiler, allowed_mask
    from worker.tool_calls import auto_grammar, forced_grammar, llama3_auto_grammar, tagged_auto_grammar

    tok = ByteTokenizer()
    req = ToolRequest([UNIT, TREE, ANCHOR, NESTED_ID], "required" if fmt == "required" else "auto")
    kind, grammar = {
        "hermes": lambda: auto_grammar(req, trigger_is_special=False),
        "mistral": lambda: tagged_auto_grammar(req, "[TOOL_CALLS]", None),
        "llama3_json": lambda: llama3_auto_grammar(req, False),
        "required": lambda: forced_grammar(req),
    }[fmt]()
    guide = GuideCompiler(tok, tok.vocab_size).compile(kind, grammar)
    key = "arguments" if fmt in ("hermes", "mistral") else "parameters"

    def accepts(*calls: tuple[str, dict]) -> bool:
        body = [{"name": name, key: args} for name, args in calls]
        dump = functools.partial(json.dumps, separators=(",", ":"))  # NOTE: the grammars' compact JSON
        text = {
            "hermes": "".join(f"<tool_call>{dump(c)}</tool_call>" for c in body),
            "mistral": "[TOOL_CALLS]" + dump(body),
            "llama3_json": "; ".join(dump(c) for c in body),
            "required": dump(body),
        }[fmt]
        m = guide.matcher()
        if not m.consume_tokens(list(text.encode())) or m.is_error():
            return False
        return bool(allowed_mask([m], tok.vocab_size)[0][ByteTokenizer.EOS])

    assert accepts(("weather", {"city": "Oslo", "unit": "c"}))
    assert not accepts(("weather", {"city": "Oslo", "unit": "k"}))
    assert accepts(("tree", {"v": 1, "child": {"v": 2, "child": None}}))
    assert not accepts(("tree", {"v": 1, "child": [{"name": "tree", key: {"v": 2, "child": None}}]}))
    assert not accepts(("tree", {"v": 1, "child": {"v": 2, "child": {"city": "Oslo", "unit": "c"}}}))
    for name in ("anchor", "nested"):  # an anchor is found by name; a subschema's $id is its own base
        assert accepts((name, {"u": "f"})) and not accepts((name, {"u": "k"}))


def test_two_tools_with_one_anchor_name_and_keyword_named_properties_keep_their_own_schemas() -> None:
    from worker.guided import GuideCompiler, allowed_mask
    from worker.tool_calls import forced_grammar

    def anchored(name: str, units: list[str]) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"u": {"$ref": "#unit"}, "enum": {"$ref": "#/$defs/E"}},
            "required": ["u", "enum"], "additionalProperties": False,
            "$defs": {"U": {"$anchor": "unit", "enum": units}, "E": {"const": {"$ref": "#"}}}}}}  # fmt: skip

    tok = ByteTokenizer()
    req = ToolRequest([anchored("a", ["c", "f"]), anchored("b", ["x", "y"])], "required")
    guide = GuideCompiler(tok, tok.vocab_size).compile(*forced_grammar(req))

    def accepts(name: str, unit: str) -> bool:
        call = {"name": name, "parameters": {"u": unit, "enum": {"$ref": "#"}}}  # a const: spelled as is
        m = guide.matcher()
        text = json.dumps([call], separators=(",", ":"))
        return m.consume_tokens(list(text.encode())) and bool(allowed_mask([m], tok.vocab_size)[0][tok.EOS])

    assert accepts("a", "f") and accepts("b", "y")
    assert not accepts("a", "y") and not accepts("b", "f")


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_schema_the_grammar_would_loosen_is_refused_as_a_response_formats_is(choice) -> None:
    from worker.tool_calls import auto_grammar, forced_grammar

    big = {"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 2**53 + 1}}}}}  # fmt: skip
    req = ToolRequest([WEATHER, big], choice)
    with pytest.raises(ValueError, match="beyond 2"):
        auto_grammar(req, trigger_is_special=False) if choice == "auto" else forced_grammar(req)
