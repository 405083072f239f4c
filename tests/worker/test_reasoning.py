"""--reasoning-parser: a chat answer's <think> text returned apart from its content, whole and streamed
(the split the same however the stream cuts the text), on a real worker."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tokenization import ByteTokenizer
from tests.worker.test_server import serve, sse_events
from worker.reasoning import ReasoningSplitter, prompt_opens_thinking, split


@pytest.mark.parametrize(
    "text,thinking,expected",
    [
        ("<think>plan</think>answer", False, ("plan", "answer")),
        ("\n <think>\nplan\n</think>\n\nanswer", False, ("\nplan\n", "\n\nanswer")),
        ("no thinking here", False, ("", "no thinking here")),
        ("an answer that mentions <think> later", False, ("", "an answer that mentions <think> later")),
        ("<think>cut off while thinking", False, ("cut off while thinking", "")),
        ("<thi", False, ("", "<thi")),  # the start of a tag that never came is content
        ("plan</think>answer", True, ("plan", "answer")),  # the prompt opened the thinking
        # ... and the model opened it again: the tag is in neither part (it stayed in the reasoning)
        ("<think>\nplan\n</think>\n\nanswer", True, ("\nplan\n", "\n\nanswer")),
        ("\n<think>plan</think>answer", True, ("plan", "answer")),
        (" <thinking aloud</think>answer", True, (" <thinking aloud", "answer")),  # no tag: the text
        ("<thi", True, ("<thi", "")),  # the start of a tag that never came: thinking cut off
        ("still thinking </thi", True, ("still thinking </thi", "")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),  # only the first close ends it
        ("", False, ("", "")),
    ],
)
def test_split(text, thinking, expected):
    assert split(text, thinking) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(["<", "/", "t", "h", "i", "n", "k", ">", " ", "a", "\n"]), max_size=40),
    st.lists(st.integers(0, 40), max_size=8),
    st.booleans(),
)
def test_a_stream_splits_as_the_whole_text_does_however_it_is_cut(text, cuts, thinking):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    splitter = ReasoningSplitter(thinking)
    pieces = [splitter.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    pieces.append(splitter.flush())
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == split(text, thinking)


def test_a_prompt_that_opens_the_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


THOUGHT = {"regex": "<think>[a-z]{6}</think>[a-z]{4}"}  # the answer the grammar leaves the model


@pytest.fixture(scope="module")
def worker():
    with serve(reasoning_parser="qwen3") as live:
        yield live


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 40, "temperature": 0,
            **extra}  # fmt: skip


def test_reasoning_comes_apart_from_the_content_whole_and_streamed(worker):
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=chat(**THOUGHT)).json()
        message = whole["choices"][0]["message"]
        assert len(message["reasoning"]) == 6 and message["reasoning_content"] == message["reasoning"]
        assert len(message["content"]) == 4 and message["content"].isalpha()
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, **THOUGHT)) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert not any(d.get("reasoning") for d in deltas[first_content:])  # thinking, then the answer
        # no empty content while tags are held back: clients take any content as the answer's start
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert not any("content" in d for d in deltas[1:first_content])
        # cut off while thinking: all reasoning, no content
        cut = client.post(
            "/v1/chat/completions", json=chat(max_tokens=10, **THOUGHT)
        ).json()  # a byte a token
        assert cut["choices"][0]["message"]["content"] is None
        assert cut["choices"][0]["message"]["reasoning"] == message["reasoning"][:3]


def test_a_stream_with_logprobs_sends_no_empty_content_while_tags_are_held(worker):
    """Chunks that carry only logprobs while the thinking's tags are held back say nothing of the
    answer: no empty ``content`` (clients take any content as the answer's start)."""
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=chat(logprobs=True, **THOUGHT)).json()["choices"][0]
        with client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, logprobs=True, **THOUGHT)
        ) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any("content" in d for d in deltas[1:first_content]), deltas[:first_content]
    streamed = [t for c in chunks for t in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert [t["token"] for t in streamed] == [t["token"] for t in whole["logprobs"]["content"]]


@pytest.mark.parametrize(
    "body",
    [{"regex": "[0-9]{3}"}, {"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
     {"guided_grammar": 'start: "yes" | "no"'}],
    ids=["regex", "json_schema", "lark"],
)  # fmt: skip
async def test_a_structured_output_follows_the_thinking(body):
    """With the parser, the constraint is on the answer after the thinking: the model may think
    first (or must close a thinking its prompt opened); a constraint that names </think> itself
    is the whole answer's."""
    from tests.worker.test_guided import allowed_ids
    from worker.api_params import output_guide
    from worker.guided import GuideCompiler

    compiler = GuideCompiler(ByteTokenizer(), 257)
    answer = {"regex": "123", "response_format": '{"a":7}', "guided_grammar": "no"}[next(iter(body))]

    def walk(guide, text: str) -> bool:
        m = guide.matcher()
        return all(m.consume_token(b) for b in text.encode()) and ByteTokenizer.EOS in allowed_ids(m, 257)

    plain = await output_guide(body, compiler)
    free = await output_guide(body, compiler, thinking=False)
    opened = await output_guide(body, compiler, thinking=True)
    assert walk(plain, answer) and walk(free, answer)  # thinking is optional
    assert walk(free, "<think>any {text}\n</think>\n\n" + answer)
    assert not walk(plain, "<think>x</think>" + answer)
    assert not walk(free, "<think>x</think>not the answer")
    assert walk(opened, "any text</think>\n" + answer) and not walk(opened, answer)
    spelled = await output_guide({"regex": "<think>[a-z]</think>[0-9]"}, compiler, thinking=False)
    assert walk(spelled, "<think>q</think>5") and not walk(spelled, "<think>qq</think>5")


def test_a_prompt_that_opens_the_thinking_starts_the_answer_in_it(worker):
    """An assistant message left open after <think> (a template that starts the thinking does
    the same): the answer is reasoning until </think>."""
    body = chat(regex="[a-z]{5}</think>[a-z]{3}", continue_final_message=True, add_generation_prompt=False)
    body["messages"].append({"role": "assistant", "content": "<think>\n"})
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert len(message["reasoning"]) == 5 and len(message["content"]) == 3


def test_without_the_parser_the_thinking_stays_in_the_content():
    with serve() as live, httpx.Client(base_url=live.url, timeout=60) as client:
        message = client.post("/v1/chat/completions", json=chat(**THOUGHT)).json()["choices"][0]["message"]
    assert message["content"].startswith("<think>") and "</think>" in message["content"]
    assert "reasoning" not in message


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def test_a_tool_call_after_the_thinking_is_read_from_the_content(worker):
    body = chat(tools=TOOLS, regex="<think>[a-z]{4}</think>" + CALL.replace("{", "\\{").replace("}", "\\}"),
                max_tokens=120)  # fmt: skip
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Oslo"
    }
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert len(whole["message"]["reasoning"]) == 4
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == whole["message"]["reasoning"]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed and streamed[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"].get("arguments", "") for tc in streamed) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


THINKING_TOKENS = len("<think>") + 6 + len("</think>")  # the byte tokenizer: one token a byte


def test_usage_counts_the_thinking_tokens(worker):
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=chat(**THOUGHT)).json()
        body = chat(stream=True, stream_options={"include_usage": True}, **THOUGHT)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            streamed = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"][-1]["usage"]
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": THINKING_TOKENS}
    assert streamed["completion_tokens_details"] == {"reasoning_tokens": THINKING_TOKENS}
    assert whole["usage"]["completion_tokens"] > THINKING_TOKENS


def test_a_stop_string_does_not_move_tokens_into_the_thinking(worker):
    """The engine holds back the text a stop string might take, so the text comes after its tokens;
    each token is still counted by its own text: the answer's first tokens are not thinking."""
    stop = {"stop": ["qqqqqqq"]}  # never met (the answer's letters run 6 and 4 at most): 6 characters held
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=chat(**stop, **THOUGHT)).json()
        body = chat(stream=True, stream_options={"include_usage": True}, **stop, **THOUGHT)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            streamed = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"][-1]["usage"]
    message = whole["choices"][0]["message"]
    assert len(message["reasoning"]) == 6 and len(message["content"]) == 4
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": THINKING_TOKENS}
    assert streamed["completion_tokens_details"] == {"reasoning_tokens": THINKING_TOKENS}


def test_the_responses_api_returns_the_thinking_as_a_reasoning_item(worker):
    """A response's outputs, fed as the engine delivers them (a token at a time, tags cut anywhere):
    the thinking is a reasoning item before the message, announced by reasoning_text events."""
    import orjson

    from worker.engine_api import RequestOutput
    from worker.responses_api import ResponsesAPI, _Turn

    endpoint = ResponsesAPI(worker.app.state.api, 8)
    text = "<think>weigh it</think>Yes."
    turn = _Turn(endpoint, {"input": "x"}, "resp_1", 5, [{"role": "user", "content": "x"}], True,
                 thinking=ReasoningSplitter())  # fmt: skip
    events = []
    for i, ch in enumerate(text):
        last = i == len(text) - 1
        out = RequestOutput(ch, [i], "stop" if last else None, completion_tokens=i + 1)
        events += turn.add(out)
    final, closing = turn.finish()
    events = [orjson.loads(e.split(b"data: ", 1)[1]) for e in events + closing]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "weigh it"}]
    assert message["type"] == "message" and message["content"][0]["text"] == "Yes."
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == len("<think>weigh it</think>")
    kinds = [e["type"] for e in events]
    assert kinds[:3] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert thought == done["text"] == "weigh it"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # the stored conversation gives the thinking back to the chat template, under the name it reads
    stored = endpoint.store.get("resp_1").messages[-1]
    assert stored == {"role": "assistant", "content": "Yes.", "reasoning_content": "weigh it"}


def test_include_reasoning_false_drops_the_thinking(worker):
    """vLLM's include_reasoning: false: the thinking is still split off the content, and not sent."""
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        message = client.post("/v1/chat/completions", json=chat(include_reasoning=False, **THOUGHT)).json()
        body = chat(include_reasoning=False, stream=True, **THOUGHT)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            deltas = [e["choices"][0]["delta"] for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        bad = client.post("/v1/chat/completions", json=chat(include_reasoning="no"))
    message = message["choices"][0]["message"]
    assert "reasoning" not in message and "reasoning_content" not in message
    assert len(message["content"]) == 4 and message["content"].isalpha()
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert bad.status_code == 400 and "include_reasoning" in bad.json()["error"]["message"]


def test_reasoning_effort_reaches_the_chat_template_in_chat_and_the_responses_api(tmp_path):
    """OpenAI's reasoning_effort (chat) and reasoning.effort (Responses) are the template's
    ``reasoning_effort``, as gpt-oss's template reads it; chat_template_kwargs' own wins."""
    from tests.worker.conftest import save_tool_tag_checkpoint

    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "Reasoning: {{ reasoning_effort | default('medium') }}\n"
                "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip
    path = save_tool_tag_checkpoint(tmp_path / "effort", False, ("<x>",), template)
    messages = [{"role": "user", "content": "Think."}]
    with (
        serve(model=str(path), kv_cache_tokens=4096) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):

        def prompt(**extra) -> str:
            ids = c.post("/tokenize", json={"messages": messages, **extra}).json()["tokens"]
            return c.post("/detokenize", json={"tokens": ids}).json()["prompt"]

        assert "Reasoning: medium" in prompt() and "Reasoning: high" in prompt(reasoning_effort="high")
        assert "Reasoning: low" in prompt(
            reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}
        )
        bad = c.post("/v1/chat/completions", json={"messages": messages, "reasoning_effort": "max"})
        assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]
        lengths = {}
        for effort in ("minimal", "low"):
            chat = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                        "reasoning_effort": effort}).json()  # fmt: skip
            resp = c.post("/v1/responses", json={"input": "Think.", "max_output_tokens": 1,
                                                 "reasoning": {"effort": effort}}).json()  # fmt: skip
            lengths[effort] = len(
                c.post("/tokenize", json={"messages": messages, "reasoning_effort": effort}).json()["tokens"]
            )
            assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] == lengths[effort]
        default = len(c.post("/tokenize", json={"messages": messages}).json()["tokens"])
        assert len({default, *lengths.values()}) == 3  # each effort renders a prompt of its own length


def test_a_named_call_cut_off_while_thinking_is_no_call_whole_or_streamed(worker):
    """``tool_choice`` naming a function: the call starts with its arguments, after the thinking; an
    answer cut off while thinking holds no call (it had no header either while it streamed)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    # "<" (byte 60) favoured: the thinking opens, then fills with it until max_tokens
    body = chat(tools=TOOLS, tool_choice=named, logit_bias={"60": 100}, max_tokens=12)
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        done = client.post("/v1/chat/completions", json={**body, "logit_bias": {}, "max_tokens": 30}).json()
    assert whole["message"]["reasoning"] == "<" * 5 and not whole["message"].get("tool_calls")
    assert whole["finish_reason"] == "length" and not whole["message"]["content"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "<" * 5
    assert (
        not any(d.get("tool_calls") for d in deltas) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    )
    (call,) = done["choices"][0]["message"]["tool_calls"]  # its arguments begun: the named call, as before
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith("{")
