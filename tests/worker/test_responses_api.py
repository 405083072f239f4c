"""The worker's /v1/responses on a real server (tiny model, CPU): the response object and its
stream events, stored conversations continued with previous_response_id (and their prefix served
from the cache), retrieve and delete, and honest 4xx for what is not supported."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from router.responses_input import tag_of, worker_tag
from router.tokenization import ByteTokenizer
from tests.worker.test_server import LiveServer, serve
from worker.engine_api import RequestOutput
from worker.reasoning import splitter
from worker.responses_api import ResponsesAPI, _Turn
from worker.server import WorkerAPI

INSTRUCTIONS = "You are a terse assistant for the radixgate test-suite. Answer in one line. " * 4


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with serve(max_stored_responses=4) as server:
        yield server


@pytest.fixture
def client(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def create(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/responses", json={"max_output_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def output_text(resp: dict) -> str:
    return "".join(part["text"] for item in resp["output"] for part in item["content"])


def events(client: httpx.Client, **body) -> list[tuple[str, dict]]:
    out = []
    req = {"max_output_tokens": 8, "temperature": 0, "stream": True, **body}
    with client.stream("POST", "/v1/responses", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                data = orjson.loads(line[len("data: ") :])
                assert data["type"] == kind
                out.append((kind, data))
    return out


def test_a_response_object_names_this_worker_and_counts_tokens(client, live) -> None:
    resp = create(client, instructions=INSTRUCTIONS, input="Say hi.", metadata={"team": "search"})
    assert resp["object"] == "response" and resp["status"] in ("completed", "incomplete")
    assert resp["metadata"] == {"team": "search"}
    assert tag_of(resp["id"]) == worker_tag(live.engine.publisher.worker)
    (item,) = resp["output"]
    assert (
        item["type"] == "message"
        and item["role"] == "assistant"
        and item["content"][0]["type"] == "output_text"
    )
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Say hi."}]
    expected = client.post("/tokenize", json={"messages": messages}).json()["count"]
    usage = resp["usage"]
    assert usage["input_tokens"] == expected and 1 <= usage["output_tokens"] <= 8
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert resp["instructions"] == INSTRUCTIONS and resp["previous_response_id"] is None


def test_max_output_tokens_makes_an_incomplete_response(client) -> None:
    resp = create(client, input="Count to one hundred.", max_output_tokens=2, ignore_eos=True)
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["output_tokens"] == 2 and resp["output"][0]["status"] == "incomplete"


def test_previous_response_id_continues_the_stored_conversation_from_the_cache(client) -> None:
    first = create(client, instructions=INSTRUCTIONS, input="First question, please answer it.")
    second = create(
        client, instructions=INSTRUCTIONS, input="And a second one.", previous_response_id=first["id"]
    )
    assert second["previous_response_id"] == first["id"]
    # the second prompt holds the first turn (its input and output) before the new input
    history = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "First question, please answer it."},
        {"role": "assistant", "content": output_text(first)},
        {"role": "user", "content": "And a second one."},
    ]
    expected = client.post("/tokenize", json={"messages": history}).json()["count"]
    assert second["usage"]["input_tokens"] == expected
    # ... and most of it comes from the radix cache: the first turn's prompt pages at least
    assert (
        second["usage"]["input_tokens_details"]["cached_tokens"]
        >= first["usage"]["input_tokens"] // 16 * 16 - 16
    )
    got = client.get(f"/v1/responses/{second['id']}")
    assert got.status_code == 200 and got.json() == second
    deleted = client.delete(f"/v1/responses/{first['id']}").json()
    assert deleted == {"id": first["id"], "object": "response", "deleted": True}
    again = client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert again.status_code == 404 and again.json()["error"]["code"] == "response_not_found"


@pytest.mark.parametrize("whole_pages", [False, True])
def test_cache_write_tokens_are_what_the_request_added_to_the_cache(client, whole_pages) -> None:
    """usage.input_tokens_details.cache_write_tokens (required by OpenAI's types): the prompt's tokens
    whose pages the request added to the radix cache. The same prompt again finds them cached and
    writes none, a prompt of whole pages too: its last page is computed again (a match leaves a token
    to compute) but was cached already (it was counted as written each time)."""
    question = f"A question no other test asks, to start cold ({whole_pages})"

    def pages_whole(text: str) -> bool:
        count = client.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()[
            "count"
        ]
        return count % 16 == 0

    while pages_whole(question) != whole_pages:
        question += "?"
    first = create(client, input=question, max_output_tokens=1, store=False)["usage"]
    again = create(client, input=question, max_output_tokens=1, store=False)["usage"]
    written, cached = (first["input_tokens_details"][k] for k in ("cache_write_tokens", "cached_tokens"))
    assert written > 0 and written % 16 == 0 and cached + written == first["input_tokens"] // 16 * 16
    assert again["input_tokens_details"]["cache_write_tokens"] == 0
    # a prompt of whole pages computes its last page again: a match leaves a token to compute
    assert again["input_tokens_details"]["cached_tokens"] == cached + written - (16 if whole_pages else 0)


def test_store_false_and_the_bound_on_stored_responses(client) -> None:
    unstored = create(client, input="Do not keep this.", store=False)
    assert unstored["store"] is False and client.get(f"/v1/responses/{unstored['id']}").status_code == 404
    ids = [create(client, input=f"Question {i}")["id"] for i in range(5)]  # the store keeps 4
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert all(client.get(f"/v1/responses/{i}").status_code == 200 for i in ids[1:])


def test_the_stream_sends_the_event_sequence_and_the_same_text(client) -> None:
    body = {
        "instructions": INSTRUCTIONS,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
    }
    whole = create(client, **body)
    evs = events(client, **body)
    kinds = [k for k, _ in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole["status"] == "completed" else "response.incomplete"]  # fmt: skip
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    deltas = "".join(d["delta"] for k, d in evs if k == "response.output_text.delta")
    final = evs[-1][1]["response"]
    assert deltas == output_text(final) == output_text(whole)
    assert final["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert evs[0][1]["response"]["status"] == "in_progress" and evs[0][1]["response"]["id"] == final["id"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"input": ""}, 400),
        ({"input": 5}, 400),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400),
        ({"input": [{"role": "tool", "content": "x"}]}, 400),
        ({"input": "hi", "instructions": 3}, 400),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400),
        (
            {
                "input": "hi",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            400,
        ),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400),
        (
            {
                "input": "hi",
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nope"}}},
            },
            400,
        ),
        ({"input": "hi", "text": "plain"}, 400),
        ({"input": "hi", "store": "yes"}, 400),
        ({"input": "hi", "conversation": "conv_1"}, 400),  # features not served: refused, not dropped
        ({"input": "hi", "prompt": {"id": "pmpt_1"}}, 400),
        ({"input": "hi", "background": True}, 400),
        ({"input": "hi", "n": 3}, 400),  # one output a response
        ({"input": "hi", "best_of": 2}, 400),
        ({"input": "hi", "best_of": True}, 400),
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404),
        ({"input": "hi", "previous_response_id": 5}, 400),  # bad input, not an unknown response
        ({"input": "hi", "model": 5}, 400),
        ({"input": "hi", "model": "other"}, 404),
        ({"input": "hi", "max_output_tokens": -1}, 400),
        ({"input": "hi", "truncation": "middle"}, 400),
        ({"input": "hi", "metadata": "tag"}, 400),  # echoed back: clients parse it as a string map
        ({"input": "hi", "metadata": {"k": 5}}, 400),
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, 400),
        ({"input": "hi", "metadata": {"k" * 65: "v"}}, 400),
        ({"input": "hi", "reasoning": "low"}, 400),
        # chat's spellings of an output format: refused, pointing at text.format (not ignored)
        ({"input": "hi", "response_format": {"type": "json_object"}}, 400),
        ({"input": "hi", "guided_regex": "abc"}, 400),
        ({"input": "hi", "structured_outputs": {"regex": "abc"}}, 400),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_worker_keeps_serving(client, body, status) -> None:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == status and r.json()["error"]["message"]
    assert create(client, input="still serving")["object"] == "response"


@pytest.mark.parametrize(
    ("body", "words"),
    [({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "at its top level"),
     ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
      "{'type': 'function', 'name': ...}")],
)  # fmt: skip
def test_tool_errors_name_the_responses_shapes_not_chats(client, body, words) -> None:
    r = client.post("/v1/responses", json={"input": "hi", **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_chat_spelling_of_the_format_is_refused_naming_the_responses_one(client) -> None:
    r = client.post("/v1/responses", json={"input": "hi", "guided_regex": "abc"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert "'guided_regex'" in r.json()["error"]["message"] and "'text'" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fmt", "missing"),
    [({"type": "json_schema"}, "'text.format.name'"),
     ({"type": "json_schema", "name": "n"}, "'text.format.schema'"),
     ({"type": "json_schema", "name": "", "schema": {}}, "'text.format.name'"),
     ({"type": "json_schema", "name": "n", "schema": True}, "'text.format.schema'")],
)  # fmt: skip
def test_a_json_schema_format_needs_its_name_and_schema(client, fmt, missing) -> None:
    """Both required, as OpenAI's: without them a json_schema format took any JSON value, and its echo
    failed clients' parsing of the response (their type requires both)."""
    r = client.post("/v1/responses", json={"input": "hi", "text": {"format": fmt}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter", r.text
    assert missing in r.json()["error"]["message"]


def test_the_reasoning_configuration_is_echoed(client) -> None:
    assert create(client, input="hi", reasoning={"effort": "low"})["reasoning"] == {"effort": "low"}
    assert create(client, input="hi")["reasoning"] is None


def test_a_stream_that_fails_closes_its_item_and_ends_with_response_failed(client) -> None:
    """A generation that fails after the stream's head (a token the request bans is all the constraint
    allows): the open message closed incomplete, then response.failed with an error of OpenAI's codes; GET
    answers the failed response, and no follow-up continues it."""
    body = {"input": "x", "allowed_token_ids": [97], "bad_words": ["aa"], "max_output_tokens": 10}
    evs = events(client, **body)
    kinds = [k for k, _ in evs]
    assert kinds[0] == "response.created" and "error" not in kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.failed"]  # fmt: skip
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    item = evs[-2][1]["item"]
    failed = evs[-1][1]["response"]
    assert item["status"] == "incomplete" and failed["output"] == [item]
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_prompt"
    assert failed["error"]["type"] == "constraint_failed" and failed["error"]["message"]
    assert failed["usage"]["output_tokens"] >= 1
    got = client.get(f"/v1/responses/{failed['id']}")
    assert got.status_code == 200 and got.json() == failed
    follow = client.post("/v1/responses", json={"input": "y", "previous_response_id": failed["id"]})
    assert follow.status_code == 400 and follow.json()["error"]["code"] == "response_failed"
    assert create(client, input="still serving")["status"] in ("completed", "incomplete")


def test_the_input_items_of_a_response_are_listed_a_page_at_a_time(client) -> None:
    """GET /v1/responses/{id}/input_items, as OpenAI's clients list them (the fields their types require)."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    sent = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "content": "Hello", "id": "msg_mine"},
            {"role": "user", "content": "Again"}, call,
            {"type": "function_call_output", "call_id": "c1", "output": "42"}]  # fmt: skip
    rid = create(client, input=sent)["id"]
    whole = client.get(f"/v1/responses/{rid}/input_items")
    assert whole.status_code == 200, whole.text
    page = whole.json()
    assert page["object"] == "list" and [i["type"] for i in page["data"]] == [
        "function_call_output", "function_call", "message", "message", "message", "message"]  # fmt: skip
    assert page["has_more"] is False
    assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
    for item in page["data"]:  # NOTE: what openai's ResponseItem types require of each
        assert isinstance(item["id"], str) and item["status"] == "completed"
        if item["type"] == "message":
            assert item["role"] in ("user", "system", "developer", "assistant") and isinstance(
                item["content"], list
            )
        else:
            assert isinstance(item["call_id"], str)
    asc = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [i["role"] for i in asc["data"]] == ["developer", "user"] and asc["has_more"] is True
    assert asc["data"][0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    rest = client.get(
        f"/v1/responses/{rid}/input_items", params={"order": "asc", "after": asc["last_id"]}
    ).json()
    assert rest["has_more"] is False and rest["data"][0]["id"] == "msg_mine"
    assert rest["data"][0]["content"] == [{"type": "output_text", "text": "Hello", "annotations": []}]
    assert len({i["id"] for i in asc["data"] + rest["data"]}) == len(sent)
    one = client.get(f"/v1/responses/{create(client, input='Plain')['id']}/input_items").json()
    assert [(i["type"], i["role"], i["content"]) for i in one["data"]] == [
        ("message", "user", [{"type": "input_text", "text": "Plain"}])
    ]
    for params in ({"limit": 0}, {"limit": 101}, {"limit": "x"}, {"limit": "²"}, {"limit": "9" * 5000},
                   {"order": "up"}, {"after": "msg_nope"},
                   {"include": "message.input_image.image_url"}, {"page": 2}):  # fmt: skip
        r = client.get(f"/v1/responses/{rid}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["message"], (params, r.text)
    r = client.get("/v1/responses/resp_nope/input_items")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_a_bad_text_format_is_named_as_the_client_sent_it(client) -> None:
    r = client.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "yaml"}}})
    assert r.status_code == 400 and "'text.format'" in r.json()["error"]["message"]
    assert "response_format" not in r.json()["error"]["message"]


def test_truncation_auto_drops_the_oldest_turns_to_fit_the_context(client) -> None:
    """A conversation grown past the context: its next turn is a 400 context_length_exceeded with
    truncation disabled (the default); with auto the oldest turn is dropped (its question and its
    answer: what is kept starts at a user message), the instructions kept, and the answer is the one
    the kept turns give when sent as they are."""
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]

    def turn(i: int) -> str:  # ~0.4 of the context each
        return f"Turn {i}: " + "abcdefghij" * (context // 25)

    first = create(client, instructions=INSTRUCTIONS, input=turn(1))
    second = create(client, instructions=INSTRUCTIONS, input=turn(2), previous_response_id=first["id"])
    body = {"instructions": INSTRUCTIONS, "input": turn(3), "previous_response_id": second["id"]}
    refused = client.post("/v1/responses", json={**body, "max_output_tokens": 8})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    fitted = create(client, **body, truncation="auto")
    assert fitted["truncation"] == "auto" and fitted["usage"]["input_tokens"] < context
    kept = [
        {"role": "user", "content": turn(2)},
        {"role": "assistant", "content": output_text(second)},
        {"role": "user", "content": turn(3)},
    ]
    same = create(client, instructions=INSTRUCTIONS, input=kept)
    assert same["usage"]["input_tokens"] == fitted["usage"]["input_tokens"]
    assert output_text(same) == output_text(fitted)


async def test_a_dropped_call_takes_its_tool_result_with_it() -> None:
    from router.tokenization import ByteTokenizer
    from worker.responses_api import _fitted

    tok = ByteTokenizer()
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"x": "' + "y" * 500 + '"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a result"},
        {"role": "user", "content": "and now?"},
    ]
    # the call is the oldest turn: its result goes too, whatever room is left
    for context in (200, 2000):
        assert await _fitted(messages, 1, tok, None, context) == tok.encode_chat([messages[0], messages[3]])
    # a long first question: its turn goes whole (the call and its result answered it), so what is
    # kept starts at a user message, as templates that check the roles alternate require
    asked = [messages[0], {"role": "user", "content": "z" * 1000}, *messages[1:]]
    assert await _fitted(asked, 1, tok, None, 1000) == tok.encode_chat([messages[0], messages[3]])
    # instructions given mid-conversation lead into the kept turn: they stay (they were dropped with
    # the turn before them)
    told = [messages[0], {"role": "user", "content": "z" * 1000}, {"role": "assistant", "content": "ok"},
            {"role": "system", "content": "From now on answer in French."}, messages[3]]  # fmt: skip
    assert await _fitted(told, 1, tok, None, 1000) == tok.encode_chat([messages[0], *told[3:]])
    # no user message after the cut: the call stays with its result (never a result alone)
    tail = [messages[0], {"role": "user", "content": "z" * 1000}, *messages[1:3]]
    assert await _fitted(tail, 1, tok, None, 1000) == tok.encode_chat([messages[0], *messages[1:3]])


async def test_truncation_auto_keeps_the_most_turns_that_fit_rendering_about_the_context_only() -> None:
    """The kept turns are the most that fit (a brute force over every turn start agrees), and the
    search renders prompts about the context's size, not halves of a conversation of thousands of
    messages."""
    import random

    from router.tokenization import ByteTokenizer
    from worker.responses_api import _fitted

    rendered: list[int] = []

    class Counting(ByteTokenizer):
        def render_chat(self, messages, tools=None, **options):  # type: ignore[no-untyped-def]
            text = super().render_chat(messages, tools, **options)
            rendered.append(len(text))
            return text

    tok, rng = Counting(), random.Random(0)
    for trial in range(40):
        turns = rng.randrange(1, 30)
        rest = [m for i in range(turns) for m in (
            {"role": "user", "content": "q" * rng.randrange(1, 200) + str(i)},
            {"role": "assistant", "content": "a" * rng.randrange(1, 200)},
        )][: 2 * turns - rng.randrange(2)]  # fmt: skip
        messages = [{"role": "system", "content": "Be brief."}, *rest]
        context = rng.randrange(40, 3000)
        fits = [u for u in range(0, len(rest), 2) if len(tok.encode_chat(messages[:1] + rest[u:])) < context]
        expected = tok.encode_chat(messages[:1] + rest[fits[0] if fits else len(rest) - 1 :])
        if fits and fits[0] == 0:
            continue  # fits whole: no truncation
        assert await _fitted(messages, 1, tok, None, context) == expected, trial
    long = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "x" * 90}
        for i in range(4001)
    ]
    rendered.clear()
    ids = await _fitted([{"role": "system", "content": "Be brief."}, *long], 1, tok, None, 2000)
    assert 1000 < len(ids) < 2000
    assert len(rendered) <= 2 * 12 + 2 and max(rendered) < 4 * 2000, rendered


ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two small numbers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
CALL_ADD = {"type": "function", "name": "add"}


def test_a_forced_function_call_is_a_function_call_item(client) -> None:
    resp = create(client, input="2+3?", tools=[ADD], tool_choice=CALL_ADD, max_output_tokens=40)
    assert resp["status"] == "completed" and resp["tools"] == [ADD] and resp["tool_choice"] == CALL_ADD
    [item] = resp["output"]
    assert item["type"] == "function_call" and item["name"] == "add" and item["status"] == "completed"
    assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
    assert set(orjson.loads(item["arguments"])) == {"a", "b"}


def test_a_streamed_function_call_sends_its_arguments_and_the_same_item(client) -> None:
    evs = events(client, input="2+3?", tools=[ADD], tool_choice=CALL_ADD, max_output_tokens=40)
    kinds = [k for k, _ in evs]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    streamed = "".join(d["delta"] for k, d in evs if k == "response.function_call_arguments.delta")
    final = evs[-1][1]["response"]["output"][0]
    assert streamed == evs[-3][1]["arguments"] == final["arguments"]
    assert evs[2][1]["item"]["id"] == final["id"] and evs[2][1]["item"]["call_id"] == final["call_id"]


def test_an_empty_answer_with_tools_still_streams_its_message_opened_and_numbered(client) -> None:
    """With tools the message opens at its first text; an answer with none (end of text first)
    still opens the one empty message it closes, and the stream's numbers run on."""
    eos = ByteTokenizer.EOS
    evs = events(client, input="2+3?", tools=[ADD], logit_bias={str(eos): 100})
    kinds = [k for k, _ in evs]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert evs[-1][1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_function_call_output_continues_the_conversation_from_the_cache(client) -> None:
    first = create(client, instructions=INSTRUCTIONS, input="2+3?", tools=[ADD], tool_choice=CALL_ADD,
                   max_output_tokens=40)  # fmt: skip
    call = first["output"][0]
    follow = create(client, previous_response_id=first["id"], tools=[ADD], instructions=INSTRUCTIONS,
                    input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "5"}])  # fmt: skip
    assert follow["status"] in ("completed", "incomplete")
    assert follow["output"][0]["type"] == "message"
    page = client.get("/v1/cache/info").json()["block_size"]
    assert (
        follow["usage"]["input_tokens_details"]["cached_tokens"]
        >= first["usage"]["input_tokens"] // page * page
    )
    # the same conversation sent whole (no stored state) renders to the same prompt
    whole = create(client, tools=[ADD], instructions=INSTRUCTIONS, store=False, input=[
        {"role": "user", "content": "2+3?"},
        {"type": "function_call", "call_id": call["call_id"], "name": "add", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "5"},
    ])  # fmt: skip
    assert whole["usage"]["input_tokens"] == follow["usage"]["input_tokens"]
    # the output as text parts (the SDK's other form), and store: null (the default), the same prompt
    parts = create(client, tools=[ADD], instructions=INSTRUCTIONS, store=None, input=[
        {"role": "user", "content": "2+3?"},
        {"type": "function_call", "call_id": call["call_id"], "name": "add", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": [{"type": "input_text", "text": "5"}]},
    ])  # fmt: skip
    assert parts["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert client.get(f"/v1/responses/{parts['id']}").status_code == 200  # stored


HARMONY = "<|channel|>analysis<|message|>ab<|end|><|start|>assistant<|channel|>final<|message|>cd<|return|>"


@pytest.mark.parametrize(
    ("parser", "answer", "thinking", "text", "numbered"),
    [
        ("qwen3", "<think>ab</think>cd", "ab", "cd", "cd"),
        ("qwen3", "\n<think>é</think>\n\nçd", "é", "\n\nçd", "\n\nçd"),
        ("qwen3", "<think></think>cd", "", "cd", "cd"),
        ("qwen3", "cd", "", "cd", "cd"),
        ("gpt_oss", HARMONY, "ab", "cd", "cd<|return|>"),  # NOTE: the end marker is the answer's last token
    ],
)
@pytest.mark.parametrize("held", [0, 5])
def test_output_text_logprobs_leave_out_the_thinking_tokens(
    live, parser, answer, thinking, text, numbered, held
) -> None:
    """With --reasoning-parser the thinking is a reasoning item: its tokens' logprobs are not the
    output text's, nor are harmony's headers. One byte a token here, sent as the engine sends them:
    a character's text with its last byte; ``held``: the text comes that many characters behind its
    tokens, as a stop string holds it back (each output says its token's own text)."""
    endpoint = ResponsesAPI(WorkerAPI(live.engine, reasoning_parser=parser), 4)
    turn = _Turn(endpoint, {"input": "x"}, "resp_x", 1, [], False, None, True, splitter(parser))
    tokens = [
        (b, ch if k == len(ch.encode()) - 1 else "") for ch in answer for k, b in enumerate(ch.encode())
    ]
    streamed, pending = [], ""
    for made, (token, piece) in enumerate(tokens, 1):
        last = made == len(tokens)
        pending += piece
        keep = 0 if last else min(held, len(pending))
        shown, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
        out = RequestOutput(text=shown, token_ids=[token], token_text=piece, logprobs=(-0.5, [], []),
                            completion_tokens=made, finish_reason="stop" if last else None)  # fmt: skip
        for event in turn.add(out):
            data = orjson.loads(event.split(b"data: ", 1)[1])
            if data["type"] == "response.output_text.delta":
                streamed += data["logprobs"]
    final, _ = turn.finish()
    *thought, message = final["output"]
    assert [t["content"][0]["text"] for t in thought] == ([thinking] if thinking else [])
    part = message["content"][0]
    assert part["text"] == text and b"".join(bytes(e["bytes"]) for e in part["logprobs"]) == numbered.encode()
    assert streamed == part["logprobs"][: len(streamed)] and len(streamed) >= len(text.encode())


def test_output_logprobs_when_included_match_chat_and_stream(client) -> None:
    body = {"input": "Say something.", "max_output_tokens": 6, "temperature": 0, "ignore_eos": True,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    resp = create(client, **body)
    part = resp["output"][0]["content"][0]
    assert len(part["logprobs"]) == resp["usage"]["output_tokens"] == 6
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2}).json()  # fmt: skip
    theirs = chat["choices"][0]["logprobs"]["content"]  # NOTE: equal up to a cached prefix's rounding
    assert [e["token"] for e in part["logprobs"]] == [e["token"] for e in theirs]
    assert [e["logprob"] for e in part["logprobs"]] == pytest.approx([e["logprob"] for e in theirs], abs=1e-4)
    assert all(len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    evs = events(client, **body)
    streamed = [e for k, d in evs if k == "response.output_text.delta" for e in d["logprobs"]]
    done = next(d for k, d in evs if k == "response.output_text.done")
    assert streamed == done["logprobs"]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in part["logprobs"]], abs=1e-4
    )
    # a stop string: its tokens add no text, and their entries come in a delta of no text
    greedy = create(client, **{**body, "max_output_tokens": 20, "ignore_eos": False})
    stop = output_text(greedy)[8:11]
    evs = events(client, **{**body, "max_output_tokens": 20, "ignore_eos": False, "stop": [stop]})
    streamed = [e for k, d in evs if k == "response.output_text.delta" for e in d["logprobs"]]
    done = next(d for k, d in evs if k == "response.output_text.done")
    text = output_text(greedy)
    assert done["text"] == text[: text.index(stop)] and streamed == done["logprobs"]
    assert len(done["logprobs"]) > len(done["text"])  # one byte a token: the stop's tokens are there
    assert "logprobs" not in create(client, input="Say something.")["output"][0]["content"][0]
    for bad in ({"include": ["reasoning.encrypted_content"]}, {"top_logprobs": 21},
                {"include": ["message.output_text.logprobs"], "tools": [ADD]}):  # fmt: skip
        r = client.post("/v1/responses", json={"input": "x", **bad})
        assert r.status_code == 400, r.text


def test_a_response_being_generated_is_in_progress_and_a_delete_then_holds(client, live) -> None:
    """While a stored response streams: GET answers it in_progress, a follow-up of it is a 400 (it has
    no answer yet), DELETE removes it for good (it is not stored when it ends); a stream its client
    leaves is no longer in progress."""
    body = {"input": "Go on.", "max_output_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=60) as other:
        with client.stream("POST", "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            created = next(orjson.loads(line[6:]) for line in lines if line.startswith("data: "))
            rid = created["response"]["id"]
            got = other.get(f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.json()["status"] == "in_progress"
            follow = other.post("/v1/responses", json={"input": "And?", "previous_response_id": rid})
            assert follow.status_code == 400 and follow.json()["error"]["code"] == "response_in_progress"
            assert other.delete(f"/v1/responses/{rid}").json()["deleted"] is True
            assert [
                line for line in lines if '"response.completed"' in line or '"response.incomplete"' in line
            ]
        assert other.get(f"/v1/responses/{rid}").status_code == 404  # deleted: not stored at its end
        with client.stream("POST", "/v1/responses", json=body) as r:  # the client leaves mid-stream
            line = next(line for line in r.iter_lines() if line.startswith("data: "))
            left = orjson.loads(line[6:])["response"]["id"]
        deadline = time.monotonic() + 10
        while other.get(f"/v1/responses/{left}").status_code != 404:
            assert time.monotonic() < deadline, "the abandoned response stays in progress"


def test_parallel_tool_calls_null_is_the_default() -> None:
    from worker.tool_calls import tool_request

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert tool_request({"tools": tools, "parallel_tool_calls": None}).parallel is True
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        tool_request({"tools": tools, "parallel_tool_calls": "yes"})


def test_a_worker_that_keeps_no_responses_says_they_are_not_stored() -> None:
    with serve(max_stored_responses=0) as none, httpx.Client(base_url=none.url, timeout=60) as c:
        resp = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
        assert resp["store"] is False and c.get(f"/v1/responses/{resp['id']}").status_code == 404


def test_the_stored_responses_are_bounded_in_bytes_too() -> None:
    """--max-stored-responses-mib: a count alone let each entry hold a conversation of any size (one
    client kept ~200 MiB a response, over a thousand of them): the least recently used go past the
    bytes too, and one larger than the bound is not kept."""
    with serve(max_stored_responses_mib=1) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        # ~300 KB of JSON a response (its conversation and its input items, ~150 KB each): 100 turns, of
        # which truncation keeps what fits the context
        turns = [{"role": "user", "content": "word " * 300} for _ in range(100)]
        body = {"input": turns, "max_output_tokens": 2, "truncation": "auto"}
        ids = [c.post("/v1/responses", json=body).json()["id"] for _ in range(5)]
        kept = [c.get(f"/v1/responses/{i}").status_code for i in ids]
        assert kept[:2] == [404, 404] and kept[2:] == [200, 200, 200], kept  # 3 of ~0.3 MiB fit in 1 MiB
        huge = c.post("/v1/responses", json={**body, "input": turns * 4}).json()  # ~1.2 MB: never kept
        assert c.get(f"/v1/responses/{huge['id']}").status_code == 404
        assert [c.get(f"/v1/responses/{i}").status_code for i in ids[2:]] == [200, 200, 200]
        follow = c.post("/v1/responses", json={**body, "input": "on", "previous_response_id": ids[4]})
        assert follow.status_code == 200  # its conversation holds ids[4]'s: it counts again, bounded alike
    from worker.responses_api import ResponseStore, StoredResponse

    store = ResponseStore(10, max_bytes=100)

    store.put("a", StoredResponse([], {}, 60))
    store.put("b", StoredResponse([], {}, 30))
    assert store.bytes == 90 and store.delete("b") and store.bytes == 60
    store.put("c", StoredResponse([], {}, 50))
    assert store.get("a") is None and store.bytes == 50


def test_responses_being_generated_push_no_stored_one_out() -> None:
    """The store's bound is for finished responses: one being generated (then abandoned, or deleted
    while it streams) takes no stored one's place, and a delete of it holds however full the store is."""
    from worker.responses_api import ResponseStore, StoredResponse

    store = ResponseStore(1)
    store.put("A", StoredResponse([{"role": "user", "content": "a"}], {"id": "A"}))
    store.begin("B", {"id": "B", "status": "in_progress"})
    assert store.get("A") is not None and store.get("B").messages is None
    store.abandon("B")
    assert store.get("A") is not None and store.get("B") is None
    store.begin("C", {"id": "C"})
    store.begin("D", {"id": "D"})
    store.finish("D", StoredResponse([], {"id": "D"}))  # finished: the bound of 1 holds
    assert store.get("A") is None and store.get("D") is not None and store.get("C").messages is None
    assert store.delete("C") and store.get("C") is None
    store.finish("C", StoredResponse([], {"id": "C"}))
    assert store.get("C") is None and store.get("D") is not None
