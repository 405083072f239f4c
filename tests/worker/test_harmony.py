"""--reasoning-parser gpt_oss: gpt-oss's harmony messages (<|channel|>NAME<|message|>TEXT<|end|>) read
into reasoning (the analysis channel) and content (final, commentary), whole and streamed however the
stream cuts them, on a real worker."""

from __future__ import annotations

import itertools
import json
import re

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.test_server import serve, sse_events
from worker.reasoning import CALL_CLOSE, CALL_OPEN, HarmonySplitter
from worker.tool_calls import ToolOutput, ToolRequest

ANSWER = "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final<|message|>Four."


def split(text: str, **splitter) -> tuple[str, str]:
    return HarmonySplitter(**splitter).take(text, final=True)


@pytest.mark.parametrize(
    "text,expected",
    [
        (ANSWER, ("plan", "Four.")),
        (ANSWER + "<|return|>", ("plan", "Four.")),
        ("<|channel|>final<|message|>only an answer", ("", "only an answer")),
        ("<|channel|>analysis<|message|>cut off while thinking", ("cut off while thinking", "")),
        # a preamble to the user on the commentary channel is content; two analysis messages both reasoning
        ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>b<|end|>"
         "<|start|>assistant<|channel|>analysis<|message|>c<|end|><|start|>assistant<|channel|>final<|message|>d",
         ("ac", "bd")),
        ("plain text, no messages", ("", "plain text, no messages")),  # e.g. under a JSON grammar
        ("<|channel|>final<|message|>ends <|e", ("", "ends <|e")),  # a marker's start that never came
        ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", ("x", "")),  # header cut
        ("", ("", "")),
    ],
)  # fmt: skip
def test_split(text, expected):
    assert split(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "<|channel|>",
        "<|channel|>analysis",
        "<|channel|>commentary to=functions.get_weather",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",
        " to=functions.get_weather<|channel|>commentary json",  # the recipient before the channel
    ],
)
def test_an_answer_cut_off_in_its_first_header_is_in_neither_part(text):
    """A header is markup, though no <|message|> came to end it: it came back as the content."""
    assert split(text) == ("", "")
    whole = HarmonySplitter()
    whole.count([1], text)
    assert whole.is_answer() is False and not whole.lead_was_answer()  # its tokens are no answer's text


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>",
                              "assistant", "a", " ", "<|", "|>", "<|return|>"]), max_size=16),
    st.lists(st.integers(0, 200), max_size=8),
)  # fmt: skip
def test_a_stream_splits_as_the_whole_text_does_however_it_is_cut(words, cuts):
    text = "".join(words)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    splitter = HarmonySplitter()
    pieces = [splitter.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    pieces.append(splitter.flush())
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == split(text)


# the answer a grammar leaves the model: the built-in model's byte tokenizer spells the markers out
HARMONY = {"regex": r"<\|channel\|>analysis<\|message\|>[a-z]{6}<\|end\|><\|start\|>assistant"
                    r"<\|channel\|>final<\|message\|>[a-z]{4}"}  # fmt: skip


@pytest.fixture(scope="module")
def worker():
    with serve(reasoning_parser="gpt_oss") as live:
        yield live


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 120, "temperature": 0,
            **HARMONY, **extra}  # fmt: skip


def test_the_analysis_channel_comes_apart_from_the_final_one_whole_and_streamed(worker):
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=chat()).json()
        body = chat(stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    message = whole["choices"][0]["message"]
    assert len(message["reasoning"]) == 6 and message["reasoning"].isalpha()
    assert message["reasoning_content"] == message["reasoning"]
    assert len(message["content"]) == 4 and message["content"].isalpha()
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    # the byte tokenizer: one token a byte; the analysis message's text and its closing marker count
    thinking = 6 + len("<|end|>")
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking}
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking}


def test_the_parser_decodes_chat_answers_with_their_special_tokens(worker):
    """harmony's markers are special tokens: a chat answer keeps them for the parser (which drops them)."""
    from worker.sampling import SamplingParams

    api = worker.app.state.api
    assert api.reasoning_params(SamplingParams()).skip_special_tokens is False
    assert api.prompt_thinks([1, 2, 3]) is None  # the channels say it; nothing read off the prompt


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
# a call as gpt-oss writes one: the commentary channel, addressed to the function, its arguments as JSON
CALL = (r"<\|channel\|>analysis<\|message\|>[a-z]{4}<\|end\|><\|start\|>assistant<\|channel\|>commentary "
        r'to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city": "Oslo"\}<\|call\|>')  # fmt: skip


@pytest.mark.parametrize(
    "text,expected",
    [
        ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
         CALL_OPEN + '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}' + CALL_CLOSE),
        # the recipient may come before the channel
        ("<|start|>assistant to=functions.get_weather<|channel|>analysis<|message|>{}<|call|>",
         CALL_OPEN + '{"name": "get_weather", "arguments": "{}"}' + CALL_CLOSE),
        # a call cut off by max_tokens: its text is content, not a call
        ('<|channel|>commentary to=functions.get_weather<|message|>{"a": ', '{"a": '),
    ],
)  # fmt: skip
def test_a_message_to_a_tool_is_a_call(text, expected):
    assert split(text, tools=["get_weather"]) == ("", expected)


@pytest.mark.parametrize(
    "text,expected",
    [
        # gpt-oss's built-in tools are not the client's functions: their text is their channel's
        ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", ("print(1)", "")),
        ("<|start|>assistant to=browser.search<|channel|>analysis<|message|>{}<|call|>", ("{}", "")),
        # a function the request did not declare
        ('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": "x"}<|call|>',
         ("", '{"q": "x"}')),
    ],
)  # fmt: skip
def test_a_message_to_no_declared_function_is_no_call(text, expected):
    """Only ``to=functions.NAME`` with NAME among the request's tools is a call: the others came back
    as calls to functions the client never declared (``python``, ``browser.search``, ``search``)."""
    assert split(text, tools=["get_weather"]) == expected


def test_a_call_the_model_writes_in_a_messages_text_is_that_text():
    """hermes markup in a final message's text is the answer's text: the splitter's calls reach the
    reader apart from it. It became a call (the text around it the content), which the model never
    addressed to a tool."""
    said = 'Hermes writes <tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call> so.'
    call = (
        '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>'
    )
    request = ToolRequest(TOOLS, "auto")
    for text, calls in (
        (f"<|channel|>final<|message|>{said}", 0),
        (f"<|channel|>final<|message|>{said}<|end|>{call}", 1),
    ):
        _, content = split(text, tools=["get_weather"])
        message = ToolOutput(request, "harmony").message(content)
        assert message["content"] == said and len(message.get("tool_calls", [])) == calls, message
        stream = ToolOutput(request, "harmony")
        deltas = [d for ch in content for d in stream.feed(ch)] + stream.flush()
        assert "".join(d.get("content") or "" for d in deltas) == said
        assert len([tc for d in deltas for tc in d.get("tool_calls", [])]) == calls


def test_hermes_markup_in_a_final_messages_text_is_content_whole_and_streamed(worker):
    said = 'Hermes writes <tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call> so.'
    body = {**chat(tools=TOOLS, max_tokens=240), "regex": re.escape("<|channel|>final<|message|>" + said)}
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert whole["finish_reason"] == "stop" and not whole["message"].get("tool_calls"), whole
    assert whole["message"]["content"] == said
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == said
    assert not any(d.get("tool_calls") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_call_to_a_function_not_declared_is_content_whole_and_streamed(worker):
    undeclared = '<|channel|>commentary to=functions.search<|message|>{"q": "x"}<|call|>'
    body = {**chat(tools=TOOLS, max_tokens=240), "regex": re.escape(undeclared)}
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert whole["finish_reason"] == "stop" and not whole["message"].get("tool_calls"), whole
    assert whole["message"]["content"] == '{"q": "x"}'
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == '{"q": "x"}'


@pytest.mark.parametrize(
    "opened,expected,alone",
    [
        ("<|start|>assistant<|channel|>final", ("", " 4.Done."), ("", " 4.")),
        ("<|start|>assistant<|channel|>analysis", (" 4.", "Done."), (" 4.", "")),
    ],
)
def test_an_answer_to_a_prefill_starts_as_the_text_of_the_message_it_continues(opened, expected, alone):
    """The prompt ended inside a message (``continue_final_message``): its continuation is that
    message's text. It was read as a header (dropped, or with its <|end|> kept as the content)."""
    assert split(" 4.<|end|><|start|>assistant<|channel|>final<|message|>Done.", opened=opened) == expected
    assert split(" 4.<|end|>", opened=opened) == alone


def test_without_a_tool_reader_a_call_is_the_text_the_model_wrote(worker):
    """No tools, or tool_choice none: no reader takes a call, so its text is content as written, as
    a call cut off is; it came back as hermes markup no one reads, its arguments a JSON string."""
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        body = {**chat(max_tokens=240, **extra), "regex": CALL}
        with httpx.Client(base_url=worker.url, timeout=60) as client:
            whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        assert whole["finish_reason"] == "stop" and not whole["message"].get("tool_calls")
        assert json.loads(whole["message"]["content"]) == {"city": "Oslo"}, whole["message"]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == whole["message"]["content"]


def test_a_tool_call_after_the_analysis_is_read_whole_and_streamed(worker):
    body = {**chat(tools=TOOLS, max_tokens=240), "regex": CALL}
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert len(whole["message"]["reasoning"]) == 4
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == whole["message"]["reasoning"]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed and streamed[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"].get("arguments", "") for tc in streamed) == call["function"]["arguments"]
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_forced_call_and_a_json_answer_stream_as_they_are_generated(worker):
    """Under a JSON constraint (a named or required call, a JSON format) the answer is in no harmony message:
    it was held to its end for a marker that could not come (the call's header and arguments, the JSON,
    all in the last chunk); now it streams as the answer does without the parser, whole and streamed alike."""
    named = {"messages": [{"role": "user", "content": "Oslo?"}], "tools": TOOLS, "max_tokens": 40, "temperature": 0,
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
    }
    formatted = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 40, "temperature": 0,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}}  # fmt: skip
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=named).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**named, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        args = [tc["function"].get("arguments", "") for c in chunks if c["choices"]
                for tc in c["choices"][0]["delta"].get("tool_calls", [])]  # fmt: skip
        assert len([a for a in args if a]) > 1, (
            args
        )  # the arguments as they came, not in one piece at the end
        assert "".join(args) == whole["message"]["tool_calls"][0]["function"]["arguments"]
        answer = client.post("/v1/chat/completions", json=formatted).json()["choices"][0]["message"][
            "content"
        ]
        with client.stream("POST", "/v1/chat/completions", json={**formatted, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        texts = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        assert len([t for t in texts if t]) > 1 and "".join(texts) == answer and "name" in json.loads(answer)


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_a_harmony_call_is_a_call_whatever_the_tool_call_parser(parser):
    """The harmony splitter hands a call on to its own reader, whatever --tool-call-parser says: read by
    another, the answer was call markup as content (which the model never wrote), and no call."""
    body = {**chat(tools=TOOLS, max_tokens=240), "regex": CALL}
    with (
        serve(reasoning_parser="gpt_oss", tool_call_parser=parser) as live,
        httpx.Client(base_url=live.url, timeout=60) as client,
    ):
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and whole["message"]["content"] is None
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_a_call_its_end_token_ended_is_whole_though_that_token_is_not_text():
    """gpt-oss lists <|call|> among its EOS ids (generation_config.json): the engine keeps it out of
    the text, so the splitter is told the answer's last token; a call it ended is a call."""
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    ended = HarmonySplitter(ends={7: "<|call|>"}, tools=["get_weather"])
    ended.count([5], call)
    first = ended.feed(call)
    ended.count([7], "")  # the end token: no text
    rest = ended.flush()
    assert (
        first[1] + rest[1]
        == CALL_OPEN + '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}' + CALL_CLOSE
    )
    cut = HarmonySplitter(ends={7: "<|call|>"}, tools=["get_weather"])
    cut.count([5], call)
    assert cut.take(call, final=True)[1] == '{"city": "Oslo"}'  # cut off by max_tokens: content


HARMONY_TAGS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)


@pytest.fixture(scope="module")
def special_harmony(tmp_path_factory):
    """The llama checkpoint with harmony's markers as special tokens and, as gpt-oss-20b's
    generation_config.json has them, <|return|> and <|call|> among its EOS ids."""
    from tokenizers import Tokenizer

    from tests.worker.conftest import save_tool_tag_checkpoint

    template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}")  # fmt: skip
    path = save_tool_tag_checkpoint(tmp_path_factory.mktemp("harmony"), True, HARMONY_TAGS, template)
    ids = {t: Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(t) for t in HARMONY_TAGS}
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids["<|return|>"], ids["<|call|>"]]})
    )
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|return|>"}))
    with serve(model=str(path), reasoning_parser="gpt_oss", kv_cache_tokens=4096) as live:
        yield live, ids


def test_with_tools_the_model_may_write_its_own_messages(special_harmony):
    """No calls grammar of text over harmony's special tokens: it forbade every marker."""
    live, ids = special_harmony
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 1,
            "temperature": 0, "logit_bias": {str(ids["<|channel|>"]): 100}, "return_token_ids": True}  # fmt: skip
    with httpx.Client(base_url=live.url, timeout=60) as client:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["token_ids"] == [ids["<|channel|>"]], choice


def test_a_call_ended_by_the_call_token_is_a_tool_call_whole_and_streamed(special_harmony):
    live, ids = special_harmony

    def t(marker: str) -> str:
        return f"<[{ids[marker]}]>"

    grammar = (f'start: {t("<|channel|>")} "analysis" {t("<|message|>")} "plan" {t("<|end|>")} {t("<|start|>")} '
               f'"assistant" {t("<|channel|>")} "commentary to=functions.get_weather " {t("<|constrain|>")} '
               f'"json" {t("<|message|>")} "{{\\"city\\": \\"Oslo\\"}}"\n')  # fmt: skip
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 200,
            "temperature": 0, "structured_outputs": {"grammar": grammar},
            "logit_bias": {str(ids["<|call|>"]): 100}}  # fmt: skip
    with httpx.Client(base_url=live.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None, whole
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Oslo"
    }
    assert whole["message"]["reasoning"] == "plan"
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert "".join(tc["function"].get("arguments", "") for tc in streamed) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_an_answer_in_no_message_keeps_its_logprobs_in_the_responses_api(special_harmony):
    """Under a JSON format the answer is in no harmony message: it is content, and so are its
    tokens' logprobs (they were dropped as a header's)."""
    live, _ = special_harmony
    body = {"input": "Answer.", "max_output_tokens": 16, "temperature": 0, "text": {"format": {"type": "json_object"}},
            "include": ["message.output_text.logprobs"]}  # fmt: skip
    with httpx.Client(base_url=live.url, timeout=60) as client:
        out = client.post("/v1/responses", json=body).json()
    (part,) = [c for item in out["output"] if item["type"] == "message" for c in item["content"]]
    assert part["text"] and "".join(lp["token"] for lp in part["logprobs"]) == part["text"], part


def test_a_messages_header_stays_out_of_the_responses_logprobs():
    """Token by token through the Responses API's turn: the header tokens of the first message are
    not known as the answer's until its <|message|>, then dropped."""
    from types import SimpleNamespace

    from worker.engine_api import RequestOutput
    from worker.responses_api import _Turn

    pieces = ["<|channel|>", "analysis", "<|message|>", "plan", "<|end|>", "<|start|>", "assistant", "<|channel|>",
              "final", "<|message|>", "Four", "."]  # fmt: skip
    ids = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    names = {i: p for p, i in ids.items()}
    api = SimpleNamespace(token_names=lambda token: (names[token], []))
    turn = _Turn(SimpleNamespace(api=api), {}, "resp_1", 3, [], False, None, True, HarmonySplitter())
    outs = [RequestOutput(text=p, token_ids=[ids[p]], logprobs=(-1.0, [], [])) for p in pieces]
    outs.append(RequestOutput(token_ids=[99], finish_reason="stop"))  # the end token: no text, no logprobs
    for out in outs:
        turn.add(out)
    turn.items.close("completed")
    (part,) = [c for item in turn.items.items if item["type"] == "message" for c in item["content"]]
    assert part["text"] == "Four." and [lp["token"] for lp in part["logprobs"]] == ["Four", "."]


def test_a_markers_token_stays_out_of_the_responses_logprobs():
    """The <|end|> that closes a commentary message (content) is a marker, not the answer's text: with
    the markers known by id (as the worker knows gpt-oss's), its logprob is not the output text's."""
    from types import SimpleNamespace

    from worker.engine_api import RequestOutput
    from worker.reasoning import BODY_ENDS
    from worker.responses_api import _Turn

    pieces = ["<|channel|>", "commentary", "<|message|>", "Sure", "<|end|>", "<|start|>", "assistant",
              "<|channel|>", "final", "<|message|>", "Four", "."]  # fmt: skip
    ids = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    names = {i: p for p, i in ids.items()}
    api = SimpleNamespace(token_names=lambda token: (names[token], []))
    ends = {ids[m]: m for m in BODY_ENDS if m in ids}
    turn = _Turn(SimpleNamespace(api=api), {}, "resp_1", 3, [], False, None, True, HarmonySplitter(ends=ends))
    for p in pieces:
        turn.add(RequestOutput(text=p, token_ids=[ids[p]], logprobs=(-1.0, [], [])))
    turn.add(RequestOutput(token_ids=[99], finish_reason="stop"))
    turn.items.close("completed")
    (part,) = [c for item in turn.items.items if item["type"] == "message" for c in item["content"]]
    assert part["text"] == "SureFour." and [lp["token"] for lp in part["logprobs"]] == ["Sure", "Four", "."]


def test_an_assistant_prefill_is_continued_as_its_messages_text(special_harmony):
    """``continue_final_message``: the prompt ends inside the assistant's open message, so the answer's
    first text is that message's, up to its <|end|>, and the next message's text follows."""
    live, ids = special_harmony

    def t(marker: str) -> str:
        return f"<[{ids[marker]}]>"

    grammar = (f'start: " 4." {t("<|end|>")} {t("<|start|>")} "assistant" {t("<|channel|>")} "final" '
               f'{t("<|message|>")} "Done."\n')  # fmt: skip
    body = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is"}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"grammar": grammar}}  # fmt: skip
    with httpx.Client(base_url=live.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert whole["message"]["content"] == " 4.Done.", whole
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == " 4.Done."
