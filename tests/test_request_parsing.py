"""Request bodies as the router reads them: ``stream: null`` is no stream (as OpenAI and the worker
read it), a malformed ``stream_options``, or one on a request that does not stream, is the router's
own 400, never silently replaced, and a ``cache_salt`` starts its own hash chain."""

from __future__ import annotations

import httpx
import orjson
import pytest

from router.errors import RouterError
from router.request_parsing import parse_request, parse_responses_request
from router.tokenization import ByteTokenizer

from .test_router_integration import chat


def test_stream_null_is_no_stream_and_bad_stream_options_are_400(launch):
    backend = launch.echo_backend()
    router = launch.router([backend.url])
    completion = {"model": "echo", "prompt": "Hello there", "max_tokens": 4}
    for path, body in (("/v1/chat/completions", chat("Hi", stream=None)), ("/v1/completions", completion)):
        answer = httpx.post(router.url + path, json={**body, "stream": None}, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("application/json") and answer.json()["choices"]
    for options in ({"include_usage": "yes"}, "yes", [True]):
        for path, body in (("/v1/chat/completions", chat("Hi")), ("/v1/completions", completion)):
            answer = httpx.post(
                router.url + path, json={**body, "stream": True, "stream_options": options}, timeout=10
            )
            assert answer.status_code == 400, (path, options, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and "stream_options" in error["message"]
    for stream in (False, None):  # OpenAI and vLLM refuse stream_options on a request that does not stream
        for path, body in (("/v1/chat/completions", chat("Hi")), ("/v1/completions", completion)):
            answer = httpx.post(
                router.url + path,
                json={**body, "stream": stream, "stream_options": {"include_usage": True}},
                timeout=10,
            )
            assert answer.status_code == 400, (path, stream, answer.text)
            assert "only allowed when 'stream' is true" in answer.json()["error"]["message"]
    fine = httpx.post(router.url + "/v1/chat/completions", timeout=10,
                      json=chat("Hi", stream=True, stream_options={"include_usage": None}))  # fmt: skip
    assert fine.status_code == 200 and fine.headers["content-type"].startswith("text/event-stream")


def test_responses_read_stream_null_as_no_stream():
    body = {"model": "m", "input": "Hello", "stream": None}
    assert parse_responses_request(orjson.dumps(body), ByteTokenizer()).stream is False
    with pytest.raises(RouterError) as err:
        parse_responses_request(orjson.dumps({**body, "stream": "yes"}), ByteTokenizer())
    assert err.value.status == 400


def test_a_cache_salt_starts_its_own_hash_chain_and_a_bad_one_is_400():
    from router.block_hash import PromptHashes, root_hash, salted

    tok = ByteTokenizer()
    body = {"model": "m", "prompt": "x" * 64}
    plain = parse_request(orjson.dumps(body), False, tok)
    salty = parse_request(orjson.dumps({**body, "cache_salt": "t1"}), False, tok)
    responses = parse_responses_request(orjson.dumps({"model": "m", "input": "hi", "cache_salt": "t1"}), tok)
    assert plain.cache_salt is None and salty.cache_salt == responses.cache_salt == "t1"
    assert salted("m", None) == "m" and root_hash(salted("m", "t1")) not in (
        root_hash("m"),
        root_hash(salted("m", "t2")),
    )
    assert (
        PromptHashes(salty.token_ids, 16, salted("m", "t1"))[0] != PromptHashes(plain.token_ids, 16, "m")[0]
    )
    for bad in ("", 3, ["t"], "s" * 1025):  # the last: each salt in use is held (a bound on what clients pin)
        with pytest.raises(RouterError) as err:
            parse_request(orjson.dumps({**body, "cache_salt": bad}), False, tok)
        assert err.value.status == 400 and "cache_salt" in err.value.message
    assert (
        parse_request(orjson.dumps({**body, "cache_salt": "s" * 1024}), False, tok).cache_salt == "s" * 1024
    )


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
OTHER_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,R0lGODlhAQAB"}}


def test_an_image_part_is_routed_by_a_stand_in_and_sent_as_it_came():
    """A chat or Responses content part that is not text (an image for a vision backend) is routed by
    a stand-in naming its digest: the same image gives the same prompt prefix, another image another;
    the body upstream is the client's own."""
    tok = ByteTokenizer()

    def parsed(image: dict, question: str = "What is this?"):
        content = [{"type": "text", "text": "Look:"}, image, {"type": "text", "text": question}]
        raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
        return raw, parse_request(raw, True, tok)

    raw, first = parsed(IMAGE)
    assert first.raw == raw and first.body["messages"][0]["content"][1] == IMAGE
    text = bytes(first.token_ids).decode()
    assert "Look:" in text and "<image_url " in text and "What is this?" in text
    same, other = parsed(IMAGE, "And this?")[1], parsed(OTHER_IMAGE)[1]
    cut = text.index("What is this?")
    assert bytes(same.token_ids).decode()[:cut] == text[:cut]
    assert bytes(other.token_ids).decode()[:cut] != text[:cut]
    responses = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    body = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}, responses]}],
    }
    assert "<input_image " in bytes(parse_responses_request(orjson.dumps(body), tok).token_ids).decode()
    result = {"type": "function_call_output", "call_id": "c1", "output": [responses]}  # a tool's screenshot
    call = {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"}
    body = {"model": "m", "input": [{"role": "user", "content": "Look"}, call, result]}
    assert "<input_image " in bytes(parse_responses_request(orjson.dumps(body), tok).token_ids).decode()
    with pytest.raises(RouterError):  # a part that is no part at all is still the router's 400
        parse_request(orjson.dumps({"messages": [{"role": "user", "content": [5]}]}), True, tok)


def test_a_reasoning_item_is_routed_by_its_text_as_the_worker_renders_it(tmp_path):
    """A Responses reasoning item sent back (a stateless tool loop) is text, not a part to stand in
    for: the router's prompt is the one the worker renders (router.responses_input), its thought
    included (gpt-oss's template renders it before a tool call), so predictions and counts follow
    the worker's."""
    from router.responses_input import prompt_messages

    from .test_tokenization import byte_level_dir, with_template

    template = "{% for m in messages %}[{{ m.role }}:{{ m.reasoning_content }}:{{ m.content }}]{% endfor %}"
    tok = with_template(byte_level_dir(tmp_path / "base"), tmp_path / "thinking", template)
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "need weather"}]}  # fmt: skip
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    items = [{"role": "user", "content": "Weather?"}, thought, call, result]
    routed = parse_responses_request(orjson.dumps({"model": "m", "input": items}), tok).token_ids
    assert "need weather" in tok.decode(routed)
    assert list(routed) == list(tok.encode_chat(prompt_messages(None, [], items)))


def _nested(depth: int) -> str:
    """A JSON schema whose arrays nest ``depth`` levels, as text (json.dumps and orjson.dumps stop
    short of a thousand levels)."""
    return '{"type": "array", "items": ' * (depth - 1) + '{"type": "integer"}' + "}" * (depth - 1)


def test_a_body_nested_past_the_bound_is_a_400_on_both_and_opens_no_breaker(launch):
    """A body nesting arrays and objects deeper than MAX_JSON_DEPTH is refused whole, by the router and
    the worker: it parsed (orjson reads 1,024 levels), then failed deep inside as a 500 (a schema
    check's recursion, orjson.dumps' own bound of ~254 when the router re-wrote a stream's body),
    and three such requests opened every worker's circuit breaker: the fleet answered 503."""
    from router.request_parsing import JSON_DEPTH_ERROR, MAX_JSON_DEPTH

    worker = launch.module("worker")
    router = launch.router([worker.url])
    plain = '{"prompt": "hi", "max_tokens": 1, '
    headers = {"content-type": "application/json"}
    for url in (worker.url, router.url):
        for body in (
            plain + f'"guided_json": {_nested(1000)}}}',
            plain + f'"stream": true, "extra": {_nested(300)}}}',
        ):
            for _ in range(4):  # past the breaker's threshold (3)
                answer = httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=30)
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["message"] == JSON_DEPTH_ERROR
        fits = plain + f'"stream": true, "extra": {_nested(MAX_JSON_DEPTH - 1)}}}'
        assert (
            httpx.post(url + "/v1/completions", content=fits, headers=headers, timeout=30).status_code == 200
        )
        chat = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": '
                f'{{"type": "json_schema", "json_schema": {{"name": "n", "schema": {_nested(500)}}}}}}}')  # fmt: skip
        answer = httpx.post(url + "/v1/chat/completions", content=chat, headers=headers, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["message"] == JSON_DEPTH_ERROR
    workers = httpx.get(router.url + "/workers", timeout=10).json()
    assert all(w["breaker"] == "closed" for w in workers["workers"]), workers


def test_a_chat_template_refusal_is_a_400_only_for_the_models_that_render_with_that_template(tmp_path):
    """The router has one chat template; a model whose workers render with another judges its
    conversations itself: one the router's template refuses is routed by its bytes rendering."""
    from router.tokenization import HFTokenizer

    from .test_tokenization import byte_level_dir

    tok = HFTokenizer(str(byte_level_dir(tmp_path / "tok")))  # its template: the first turn is a user's
    messages = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "hi"}]

    def parsed(model: str, endpoint: str):
        if endpoint == "chat":
            return parse_request(
                orjson.dumps({"model": model, "messages": messages}), True, tok, lambda m: m == "mine"
            )
        body = {"model": model, "input": messages}
        return parse_responses_request(orjson.dumps(body), tok, lambda m: m == "mine")

    for endpoint in ("chat", "responses"):
        with pytest.raises(RouterError, match="must start with a user") as refused:
            parsed("mine", endpoint)
        assert refused.value.status == 400
        assert list(parsed("theirs", endpoint).token_ids) == ByteTokenizer().encode_chat(messages)
    with pytest.raises(RouterError):  # a request no template reads is the router's 400 whatever its model
        parse_request(
            orjson.dumps({"model": "theirs", "messages": [{"role": "user"}]}), True, tok, lambda m: False
        )
