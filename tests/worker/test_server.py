"""Worker HTTP API on a real uvicorn server (loopback, tiny model on CPU): OpenAI responses and usage,
cached tokens in usage and /metrics, honest 4xx/5xx, disconnects release pages, KV snapshot and SSE
event stream agree."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest
import uvicorn

from router.tokenization import HFTokenizer
from tests.worker.conftest import write_tokenizer
from worker.api_params import TRUNCATE_CONTEXTS, APIError, prompt_ids
from worker.assembly import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.server import create_app

ADMIN = "s3cret"
SYSTEM = "You are a helpful assistant. Always answer briefly and precisely. " * 4  # ~270 tokens


class LiveServer:
    """A worker app served by uvicorn in a thread, on a loopback port picked by the OS."""

    def __init__(
        self, engine: Engine, admin_token: str | None = None, max_stored_responses: int = 1024, **app: object
    ) -> None:
        self.engine = engine
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = create_app(engine, admin_token, max_stored_responses, **app)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def serve(**overrides) -> LiveServer:
    cfg = WorkerConfig(**{"model": "tiny", "device": "cpu", "kv_cache_tokens": 8192, **overrides})
    return LiveServer(
        build_engine(cfg), cfg.admin_token, cfg.max_stored_responses,
        kv_transfer_max_mib=cfg.kv_transfer_max_mib, kv_fetch_timeout_s=cfg.kv_fetch_timeout_s,
        kv_transfer_max_wait_ms=cfg.kv_transfer_max_wait_ms, reasoning_parser=cfg.reasoning_parser,
        tool_call_parser=cfg.tool_call_parser, kv_hints=cfg.kv_hints,
        max_stored_responses_mib=cfg.max_stored_responses_mib,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with serve(admin_token=ADMIN) as live:
        yield live


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else orjson.loads(data)


def poll(fn, what: str, deadline_s: float = 15.0):
    end = time.monotonic() + deadline_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def idle(client: httpx.Client) -> dict:
    """Wait until no request holds KV pages; returns /health."""

    def check():
        h = client.get("/health").json()
        return h if h["running"] == 0 and h["waiting"] == 0 and h["kv_pages_active"] == 0 else None

    health = poll(check, "all pages released")
    assert (
        health["kv_usage"] == 0.0
        and health["kv_pages_free"] + health["kv_pages_cached"] == health["kv_pages_total"]
    )
    return health


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


def test_stream_and_non_stream_agree_and_report_usage(client):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["object"] == "text_completion" and plain["choices"][0]["finish_reason"] == "length"
    usage = plain["usage"]
    assert usage["prompt_tokens"] == 19 and usage["completion_tokens"] == 12 and usage["total_tokens"] == 31
    assert "cached_tokens" in usage["prompt_tokens_details"]
    with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == plain["choices"][0]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    # without stream_options.include_usage (OpenAI's default) no usage chunk: every chunk has a choice
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        bare = list(sse_events(resp.iter_lines()))
    assert bare[-1] == "[DONE]" and len({e["id"] for e in bare[:-1]}) == 1
    assert all(e["choices"] and "usage" not in e for e in bare[:-1])
    assert "".join(e["choices"][0]["text"] for e in bare[:-1]) == text


def test_chat_completion_stream_and_non_stream(client):
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body).json()
    message = plain["choices"][0]["message"]
    assert plain["object"] == "chat.completion" and message["role"] == "assistant"
    assert plain["usage"]["completion_tokens"] == 6
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as resp:
        events = list(sse_events(resp.iter_lines()))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == message["content"]
    assert (
        events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == plain["usage"]["total_tokens"]
    )


def test_shared_prefix_reports_cached_tokens_in_usage_and_metrics(client):
    before = metric(client, "radixgate_worker_cached_tokens_total")
    first = {"prompt": SYSTEM + "Question one?", "max_tokens": 2, "temperature": 0}
    client.post("/v1/completions", json=first).raise_for_status()
    second = client.post("/v1/completions", json={**first, "prompt": SYSTEM + "Question two?"}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 256 and cached % 16 == 0
    assert metric(client, "radixgate_worker_cached_tokens_total") - before >= cached
    assert 0 < metric(client, "radixgate_worker_cache_hit_rate") <= 1
    assert metric(client, "radixgate_worker_time_to_first_token_seconds_count") >= 2


@pytest.mark.parametrize(
    ("path", "raw", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"prompt": ""}', 400),
        ("/v1/completions", b'{"prompt": 42}', 400),
        ("/v1/completions", b'{"prompt": ["a", ""]}', 400),
        ("/v1/completions", b'{"prompt": ["a", 5]}', 400),
        ("/v1/completions", b'{"prompt": ["a", "b"], "n": 40}', 400),
        ("/v1/completions", b'{"prompt": [1, 99999]}', 400),
        ("/v1/completions", b'{"prompt": "hi", "n": 65}', 400),
        ("/v1/completions", b'{"prompt": "hi", "n": true}', 400),
        ("/v1/completions", b'{"prompt": "hi", "n": 2, "best_of": 3}', 400),
        ("/v1/completions", b'{"prompt": "hi", "best_of": true}', 400),
        ("/v1/completions", b'{"prompt": "hi", "n": 2, "best_of": 2.0}', 400),
        ("/v1/completions", b'{"prompt": "hi", "suffix": "}"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "logprobs": 21}', 400),
        ("/v1/completions", b'{"prompt": "hi", "logprobs": true}', 400),
        ("/v1/completions", b'{"prompt": "hi", "echo": "yes"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}',
            400,
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "xml"}}',
            400,
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "functions": [{"name": "f"}]}',
            400,
        ),
        (  # text only: an image the router routed by its stand-in is refused here
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
            400,
        ),
        ("/v1/completions", b'{"prompt": "hi", "guided_regex": "[a-"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}', 400),
        ("/v1/completions", b'{"prompt": "hi", "guided_choice": ["a"], "ignore_eos": true}', 400),
        (
            "/v1/completions",
            b'{"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}',
            400,
        ),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "logprobs": 3}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}', 400),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": -1}',
            400,
        ),
        ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "temperature": true}', 400),
        ("/v1/completions", b'{"prompt": "hi", "top_p": true}', 400),
        ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": false}', 400),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": true}}', 400),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\u00b2": 1}}', 400),  # a digit, not ASCII
        # more digits than int() takes (4,300): a ValueError inside the check was a 500
        pytest.param(
            "/v1/completions",
            b'{"prompt": "hi", "logit_bias": {"' + b"9" * 4301 + b'": 1}}',
            400,
            id="bias-4301-digits",
        ),
        pytest.param(
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "logit_bias": {"' + b"0" * 5000 + b'1": 1}}',
            400,
            id="chat-bias-5001-digits",
        ),
        ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400),
        ("/v1/completions", b'{"prompt": "hi", "min_p": 2}', 400),
        ("/v1/completions", b'{"prompt": "hi", "include_stop_str_in_output": "yes"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400),
        # not the integer 0, though Python's == says so: no prompt scoring
        ("/v1/completions", b'{"prompt": "hi", "echo": true, "max_tokens": false}', 400),
        ("/v1/completions", b'{"prompt": "hi", "echo": true, "max_tokens": 0.0}', 400),
        ("/v1/completions", b'{"prompt": "hi", "priority": "high"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "priority": 1e40}', 400),
        ("/v1/completions", b'{"prompt": "hi", "stop": 5}', 400),
        ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "model": "other"}', 404),
        ("/v1/completions", b'{"prompt": "hi", "model": 5}', 400),  # bad input, not an unknown model
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "model": ["tiny"]}', 400),
        ("/v1/completions", b'{"prompt": "' + b"z" * 9000 + b'"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "use_beam_search": true}', 400),
        ("/v1/completions", b'{"prompt": "hi", "return_token_ids": "yes"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "return_tokens_as_token_ids": 1}', 400),
        ("/v1/completions", b'{"prompt": "hi", "prompt_logprobs": 1}', 400),
        ("/v1/completions", b'{"prompt": "hi", "truncate_prompt_tokens": 0}', 400),
        ("/v1/completions", b'{"prompt": "hi", "truncate_prompt_tokens": "5"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "skip_special_tokens": "no"}', 400),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "modalities": ["audio"]}',
            400,
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "audio": {"voice": "x"}}',
            400,
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": 1}',
            400,
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tools": []}}',
            400,
        ),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(client, path, raw, status):
    resp = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["message"] and error["type"]
    ok = client.post("/v1/completions", json={"prompt": "still alive?", "max_tokens": 1})
    assert ok.status_code == 200


def test_min_p_one_leaves_only_the_likeliest_token(client):
    """min_p 1 keeps the tokens as likely as the likeliest: sampled at any temperature and seed,
    the answer is the greedy one (vLLM's and SGLang's min_p, after the temperature)."""
    body = {"prompt": "The cache", "max_tokens": 12}
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for seed in range(3):
        r = client.post("/v1/completions", json={**body, "temperature": 1.5, "seed": seed, "min_p": 1.0})
        assert r.json()["choices"][0]["text"] == greedy
    free = {client.post("/v1/completions", json={**body, "temperature": 1.5, "seed": seed}).json()["choices"][0]["text"]
            for seed in range(3)}  # fmt: skip
    assert free != {greedy}  # without it the same requests sample other answers


def test_return_token_ids_gives_the_prompts_and_every_generated_token(client):
    """vLLM's return_token_ids: each completions choice carries its prompt's ids and the ids it
    generated, the final stop token included (it is not text); chat carries the prompt's ids once;
    streams carry each chunk's new ids, the prompt's on the first chunk; absent, none of it."""
    body = {"prompt": ["Token ids", "Two"], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
    plain = client.post("/v1/completions", json=body).json()
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
    whole = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == list(["Token ids", "Two"][c["index"] // 2].encode())
        assert len(c["token_ids"]) == 6 and bytes(c["token_ids"]).decode() == c["text"]
    stop_id = whole["choices"][0]["token_ids"][2]
    one = {"prompt": "Token ids", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    stopped = client.post("/v1/completions", json={**one, "stop_token_ids": [stop_id]}).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == whole["choices"][0]["token_ids"][:3]
    assert choice["text"] == whole["choices"][0]["text"][:2] and stopped["usage"]["completion_tokens"] == 3
    with client.stream("POST", "/v1/completions", json={**one, "stream": True}) as r:
        chunks = [e["choices"][0] for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == list(b"Token ids") and "prompt_token_ids" not in chunks[1]
    assert [t for c in chunks for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    chat = {"messages": [{"role": "user", "content": "ids?"}], "max_tokens": 5, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    answer = client.post("/v1/chat/completions", json=chat).json()
    assert answer["prompt_token_ids"] == client.post("/tokenize", json=chat).json()["tokens"]
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert events[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == answer["choices"][0]["token_ids"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
    """vLLM's return_tokens_as_token_ids: logprobs name each token ``token_id:N`` (chat keeps bytes)."""
    body = {"prompt": "Name them", "max_tokens": 4, "temperature": 0, "logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = {"messages": [{"role": "user", "content": "ids?"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    for entry in content:
        assert entry["token"] == f"token_id:{entry['bytes'][0]}" and entry["top_logprobs"][0][
            "token"
        ].startswith("token_id:")


def test_a_stop_string_is_kept_with_either_spelling(client):
    """vLLM's include_stop_str_in_output and SGLang's no_stop_trim keep the stop string that ended
    the text; without them it is cut."""
    body = {"prompt": "Stop here", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[4:6]
    end = text.find(stop)
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[:end] and cut["finish_reason"] == "stop"
    for flag in ("include_stop_str_in_output", "no_stop_trim"):
        kept = client.post("/v1/completions", json={**body, "stop": [stop], flag: True}).json()["choices"][0]
        assert kept["text"] == text[: end + len(stop)], flag


def test_stop_reason_names_the_stop_string_or_stop_id_that_ended_a_choice(client):
    """vLLM's stop_reason: the stop string, or the stop_token_ids id, that ended the choice; null
    for EOS (also where stop_token_ids names it) and for a length; streams carry it on the finish chunk."""
    eos = {"logit_bias": {"256": 100}, "ignore_eos": False}  # the tiny model's EOS
    for path, req in (
        ("/v1/completions", {"prompt": "Stop here"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Stop here"}]}),
    ):
        req = {**req, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        choice = client.post(path, json=req).json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert choice["stop_reason"] is None and len(text) == 16
        stop, stop_id = text[4:6], ord(text[2])
        for extra, reason in (
            ({"stop": ["zzz", stop]}, stop),
            ({"stop_token_ids": [stop_id]}, stop_id),
            (eos, None),
            ({**eos, "stop_token_ids": [256]}, None),
        ):
            choice = client.post(path, json={**req, **extra}).json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", reason), (path, extra)
            with client.stream("POST", path, json={**req, **extra, "stream": True}) as r:
                chunks = [
                    e["choices"][0] for e in sse_events(r.iter_lines()) if e != "[DONE]" and e["choices"]
                ]
            assert [(c["finish_reason"], c["stop_reason"]) for c in chunks if c["finish_reason"]] == [
                ("stop", reason)
            ], (path, extra)
            assert all("stop_reason" not in c for c in chunks if c["finish_reason"] is None)


def test_add_special_tokens_false_gives_a_completions_prompt_no_bos_on_router_and_worker(llama_checkpoint):
    """vLLM's add_special_tokens: false tokenizes a completions prompt without the tokenizer's BOS
    (a prompt that carries its own: one, not two), on the worker and in the router's count of it;
    it was ignored. Not a boolean: 400. Chat: its template writes the special tokens: only false."""
    from router.request_parsing import parse_request
    from router.tokenization import HFTokenizer

    router_tok = HFTokenizer(str(llama_checkpoint))
    with serve(model=str(llama_checkpoint)) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        bos = c.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
        bare = c.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()["tokens"]
        assert bos[0] == 1 and bare == bos[1:]
        body = {"prompt": "<s>Hello", "max_tokens": 1, "return_token_ids": True}
        doubled = c.post("/v1/completions", json=body).json()["choices"][0]["prompt_token_ids"]
        assert doubled[:2] == [1, 1]  # as vLLM's default: the text's own BOS after the tokenizer's
        for sent in (body, {**body, "add_special_tokens": False}):
            answer = c.post("/v1/completions", json=sent).json()
            ids = answer["choices"][0]["prompt_token_ids"]
            routed = parse_request(orjson.dumps(sent), False, router_tok).token_ids
            assert list(routed) == ids and answer["usage"]["prompt_tokens"] == len(ids)
        assert ids[:2] == [1, bare[0]]
        refused = c.post("/v1/completions", json={**body, "add_special_tokens": "no"})
        assert refused.status_code == 400 and "add_special_tokens" in refused.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        assert c.post("/v1/chat/completions", json={**chat, "add_special_tokens": False}).status_code == 200
        assert c.post("/v1/chat/completions", json={**chat, "add_special_tokens": True}).status_code == 400


def test_the_stop_string_that_completes_first_ends_the_text_however_the_tokens_cut_it(qwen3_checkpoint):
    """Two stop strings one token completes (" laz" is one token of this tokenizer): the one that ends
    first ("la") ends the text, as it does when the text comes a character at a time (the tiny model's
    bytes); the one that starts first won."""
    text = "The quick brown fox jumps over the lazy dog\\."
    body = {"prompt": "Q", "max_tokens": 40, "temperature": 0, "guided_regex": text, "stop": [" laz", "la"]}
    with serve() as tiny, serve(model=str(qwen3_checkpoint), kv_cache_tokens=2048) as bpe:
        for live in (tiny, bpe):
            with httpx.Client(base_url=live.url, timeout=60) as c:
                cut = c.post("/v1/completions", json=body).json()["choices"][0]
                kept = c.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
            assert cut["text"] == "The quick brown fox jumps over the " and cut["finish_reason"] == "stop"
            assert kept["choices"][0]["text"] == "The quick brown fox jumps over the la"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the
    usage so far, the last one the whole request's; without it only the usage chunk does."""
    for path, body in (
        ("/v1/completions", {"prompt": "Count", "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count"}]}),
    ):
        req = {**body, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
        with client.stream("POST", path, json=req) as r:
            events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        done = [e["usage"]["completion_tokens"] for e in events]
        assert done == sorted(done) and done[-1] == 5 * body.get("n", 1) and len(set(done)) > 2, done
        assert len({e["usage"]["prompt_tokens"] for e in events}) == 1 and events[-1]["choices"] == []
        plain = {**req, "stream_options": {"include_usage": True}}
        with client.stream("POST", path, json=plain) as r:
            events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]
    bad = {
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": 1},
    }
    assert client.post("/v1/completions", json=bad).status_code == 400
    for stream in (False, None):  # stream_options without a stream: refused, as OpenAI and vLLM do
        answer = client.post(
            "/v1/completions", json={**req, "stream": stream, "stream_options": {"include_usage": True}}
        )
        assert (
            answer.status_code == 400
            and "only allowed when 'stream' is true" in answer.json()["error"]["message"]
        )


def test_special_tokens_are_text_only_when_asked(client):
    """skip_special_tokens false (vLLM's): the special tokens sampled show as their names, in the
    answer and in its stream; by default they are not text. The answers are the same tokens."""
    body = {"prompt": "Specials:", "max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True,
            "allowed_token_ids": [ord("A"), 256]}  # fmt: skip
    hidden = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    shown = client.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()
    text = shown["choices"][0]["text"]
    assert "<|eos|>" in text and "A" in text and text.replace("<|eos|>", "") == hidden
    with client.stream(
        "POST", "/v1/completions", json={**body, "skip_special_tokens": False, "stream": True}
    ) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client):
    """vLLM's truncate_prompt_tokens: k keeps the last k prompt tokens (echo shows them); -1 keeps
    what the context serves, so a prompt longer than it is answered instead of refused."""
    body = {"prompt": "0123456789", "max_tokens": 1, "temperature": 0}
    short = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 4, "echo": True}).json()
    assert short["usage"]["prompt_tokens"] == 4 and short["choices"][0]["text"].startswith("6789")
    same = client.post("/v1/completions", json={**body, "prompt": "6789"}).json()
    assert same["choices"][0]["text"] == short["choices"][0]["text"][4:]
    kept = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 50}).json()
    assert kept["usage"]["prompt_tokens"] == 10
    chat = {"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 1}
    assert (
        client.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 7}).json()["usage"][
            "prompt_tokens"
        ]
        == 7
    )
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    long = {**body, "prompt": "y" * (context + 10)}
    assert client.post("/v1/completions", json=long).status_code == 400
    served = client.post("/v1/completions", json={**long, "truncate_prompt_tokens": -1}).json()
    assert served["usage"]["prompt_tokens"] == context - 1 and served["usage"]["completion_tokens"] == 1


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(server, client, monkeypatch):
    """A prompt of megabytes (a string, one of a batch, one kept whole by truncation, chat messages, a
    Responses input) is a 400 context_length_exceeded without its text being tokenized (its list of ids
    would take 10-40x its size in memory), and the worker serves the requests after it."""
    tok, encoded = server.engine.tokenizer, []

    def spy(real):
        def encode(*args, **kwargs):
            ids = real(*args, **kwargs)
            encoded.append(len(ids))
            return ids

        return encode

    for name in ("encode_prompt", "encode_chat", "encode_chat_text"):
        if hasattr(tok, name):
            monkeypatch.setattr(tok, name, spy(getattr(tok, name)))
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    huge = "lorem ipsum " * 400_000  # 4.8 MB
    asks = [
        ("/v1/completions", {"prompt": huge}),
        ("/v1/completions", {"prompt": ["hi", huge]}),
        ("/v1/completions", {"prompt": huge, "truncate_prompt_tokens": 10 * context}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": huge}]},
        ),
        ("/v1/responses", {"input": huge}),
    ]
    for path, body in asks:
        r = client.post(path, json={**body, "max_tokens": 1})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded", (path, r.text[:300])
        assert (
            error["message"].startswith("the prompt has at least")
            and f"at most {context - 1}" in error["message"]
        )
    assert max(encoded, default=0) < context  # NOTE: "hi" only
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_truncating_a_prompt_of_megabytes_keeps_exactly_its_last_tokens(client):
    """The bytes tokenizer's ids are the text's UTF-8 bytes: a prompt far past the context cut by
    truncate_prompt_tokens keeps its last bytes' ids (a character cut in two too), chat's rendered prompt too."""
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    huge = "naïve café 東京 " * 200_000 + "the end"
    body = {
        "prompt": huge,
        "max_tokens": 1,
        "truncate_prompt_tokens": -1,
        "return_token_ids": True,
        "echo": True,
    }
    r = client.post("/v1/completions", json=body).json()
    assert r["choices"][0]["prompt_token_ids"] == list(huge.encode()[-(context - 1) :])
    assert r["usage"]["prompt_tokens"] == context - 1 and r["choices"][0]["text"].startswith(
        huge.encode()[-(context - 1) :].decode(errors="replace")
    )
    chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 1, "truncate_prompt_tokens": 100}
    r = client.post("/v1/chat/completions", json={**chat, "return_token_ids": True}).json()
    assert r["prompt_token_ids"] == list(f"<|user|>\n{huge}\n<|assistant|>\n".encode()[-100:])


async def test_an_hf_prompt_is_tokenized_whole_unless_it_surely_cannot_fit(tmp_path):
    """With a byte-level BPE: a prompt that may fit, or that truncation may cut, gets exactly the ids of the
    whole text (its last k); one surely past the context (or past what truncation cuts) is a 400 first."""
    write_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    context, vocab = 64, tok.vocab_size
    fits = "The quick brown fox. " * 3
    assert await prompt_ids(fits, tok, vocab, context) == ([tok.encode_prompt(fits)], [False])
    near = "The quick brown fox jumps over the lazy dog. " * 30  # past the context, though not surely
    assert await prompt_ids(near, tok, vocab, context, keep=40) == ([tok.encode_prompt(near)[-40:]], [True])
    with pytest.raises(APIError) as refused:
        await prompt_ids(near * 3, tok, vocab, context)
    assert refused.value.code == "context_length_exceeded" and "at least" in refused.value.message
    far = "x" * (TRUNCATE_CONTEXTS * context * tok.max_token_bytes + 1)
    with pytest.raises(APIError) as refused:
        await prompt_ids(far, tok, vocab, context, keep=40)
    assert (
        refused.value.code == "context_length_exceeded"
        and "too long even to truncate" in refused.value.message
    )


async def test_a_huge_integer_temperature_is_served_beside_other_requests(server):
    """temperature 2**63 (a JSON integer beyond int64) is a (very high) temperature: it is answered,
    and so are the greedy requests sent with it. NOTE: ignore_eos, as that temperature samples every token
    alike, the end of text too (CI once drew it within 4 steps)."""
    bodies = [{"prompt": "hot", "max_tokens": 4, "temperature": 2**63, "ignore_eos": True}]
    bodies += [{"prompt": f"cold {i}", "max_tokens": 4, "temperature": 0} for i in range(3)]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        answers = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/v1/embeddings", 404, "unknown_endpoint"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("PUT", "/v1/responses/resp_x", 405, "method_not_allowed"),
    ],
)
def test_unknown_endpoints_and_methods_get_openai_errors(client, method, path, status, code):
    resp = client.request(method, path)
    assert resp.status_code == status and resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["code"] == code and f"{method} {path}" in error["message"]
    assert (resp.headers.get("allow") is not None) == (status == 405)


def test_client_disconnect_mid_stream_releases_pages(client, server):
    idle(client)
    aborted_before = server.engine.snapshot().finished.get("abort", 0)
    body = {"prompt": SYSTEM + "Write forever.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        got = [e for _, e in zip(range(3), sse_events(lines), strict=False)]
        assert len(got) == 3
        assert client.get("/health").json()["kv_pages_active"] > 0
    health = idle(client)  # the closed connection aborted the request and freed its pages
    assert health["status"] == "ok"
    assert server.engine.snapshot().finished.get("abort", 0) == aborted_before + 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": SYSTEM + "Write forever."}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SYSTEM + "Write forever."}]}),
        ("/v1/responses", {"input": SYSTEM + "Write forever."}),
    ],
)
def test_client_disconnect_mid_answer_aborts_a_non_streamed_request(client, server, path, body):
    """A client that closes its connection while its (non-streamed) answer is being generated:
    the request is aborted and its pages released in far less time than it would take to finish
    (3,000+ tokens, about 10 s on this model)."""
    idle(client)
    aborted_before = server.engine.snapshot().finished.get("abort", 0)
    raw = orjson.dumps({**body, "max_tokens": 4000, "ignore_eos": True})
    head = f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(raw)}\r\n\r\n"
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + raw)
        poll(lambda: client.get("/health").json()["kv_pages_active"] > 0, "the request running")
    poll(lambda: client.get("/health").json()["running"] == 0, "the request aborted", deadline_s=5.0)
    health = idle(client)
    assert health["status"] == "ok"
    assert server.engine.snapshot().finished.get("abort", 0) == aborted_before + 1


def test_models_and_cache_info(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    info = client.get("/v1/cache/info").json()
    assert info["block_size"] == 16 and info["capacity_tokens"] == 8192
    assert info["namespace"] == "tiny" and info["tokenizer"] == "bytes"
    assert info["epoch"] == client.get("/health").json()["epoch"]


def test_a_chat_top_logprobs_out_of_bounds_is_a_400_that_names_it(client) -> None:
    """Chat's top_logprobs becomes the sampler's logprobs: its 400 named that field, which the
    request had set to true."""
    for top in (21, -1, 2.5, True):
        body = {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": top}
        resp = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert resp.status_code == 400 and "'top_logprobs'" in resp.json()["error"]["message"], (
            top,
            resp.text,
        )


def test_flush_needs_the_admin_token(client):
    client.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 1}).raise_for_status()
    assert client.post("/v1/cache/flush").status_code == 401
    for bad in ("Bearer wrong", f"Basic {ADMIN}", f"Bearer{ADMIN}", "Bearer"):
        assert client.post("/v1/cache/flush", headers={"authorization": bad}).status_code == 401, bad
    assert client.post("/v1/cache/flush", headers={"x-admin-token": "wrong"}).status_code == 401
    for good in (f"Bearer {ADMIN}", f"bearer {ADMIN}"):  # NOTE: the scheme in any case (RFC 9110)
        assert client.post("/v1/cache/flush", headers={"authorization": good}).status_code == 200, good
    assert client.post("/v1/cache/flush", headers={"x-admin-token": ADMIN}).status_code == 200
    client.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 1}).raise_for_status()
    resp = client.post("/v1/cache/flush", headers={"authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 200 and resp.json()["flushed_pages"] > 0
    assert client.get("/health").json()["kv_pages_cached"] == 0


def test_behind_an_api_key_the_refused_flush_names_the_header_the_admin_token_goes_in() -> None:
    """The API key takes the Authorization header; following a 401 that named only that header for
    the admin token led to another 401 (invalid_api_key)."""
    engine = build_engine(WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=8192))
    with LiveServer(engine, ADMIN, api_key="fleet-key") as live, httpx.Client(base_url=live.url) as client:
        denied = client.post("/v1/cache/flush", headers={"authorization": "Bearer fleet-key"})
        assert denied.status_code == 401 and "X-Admin-Token: <token>" in denied.json()["error"]["message"]
        both = {"authorization": "Bearer fleet-key", "x-admin-token": ADMIN}
        assert client.post("/v1/cache/flush", headers=both).status_code == 200


def apply_batch(blocks: set[int], batch: dict) -> None:
    if batch["cleared"]:
        blocks.clear()
    for run in batch["stored"]:
        blocks.update(run["block_hashes"])
    blocks.difference_update(batch["removed"])


async def test_sse_event_stream_matches_the_snapshot(server):
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=60) as c,
        c.stream("GET", "/v1/cache/events") as resp,
    ):
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        start = orjson.loads((await c.get("/v1/cache/snapshot")).content)
        blocks: set[int] = set()
        apply_batch(blocks, start)
        jobs = [
            c.post("/v1/completions", json={"prompt": SYSTEM + f"Q{i}", "max_tokens": 3}) for i in range(3)
        ]
        await asyncio.gather(*jobs)
        await c.post("/v1/cache/flush", headers={"authorization": f"Bearer {ADMIN}"})
        await c.post("/v1/completions", json={"prompt": SYSTEM + "after flush", "max_tokens": 2})
        end = orjson.loads((await c.get("/v1/cache/snapshot")).content)
        seq = start["seq"]
        async for line in lines:
            if not line.startswith("data: "):
                continue
            batch = orjson.loads(line[6:])
            if batch["seq"] <= start["seq"]:
                continue  # already in the starting snapshot
            assert batch["seq"] == seq + 1 and batch["epoch"] == start["epoch"]
            seq = batch["seq"]
            apply_batch(blocks, batch)
            if seq == end["seq"]:
                break
    assert end["cleared"] is True
    expect: set[int] = set()
    apply_batch(expect, end)
    assert blocks == expect and len(expect) >= 17


def test_queue_full_429_prompt_too_long_400_and_dead_engine_503():
    with (
        serve(kv_cache_tokens=512, max_running=1, max_waiting=1) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        long_body = {"prompt": "busy " * 10, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        too_long = c.post("/v1/completions", json={"prompt": "y" * 600, "max_tokens": 1})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        with c.stream("POST", "/v1/completions", json=long_body) as running:
            events = sse_events(running.iter_lines())  # NOTE: keep a reference: dropping it disconnects
            next(events)
            waiting_result: dict = {}

            def send_waiting() -> None:
                with httpx.Client(base_url=live.url, timeout=60) as c2:
                    waiting_result["resp"] = c2.post(
                        "/v1/completions", json={"prompt": "queued", "max_tokens": 1}
                    )

            t = threading.Thread(target=send_waiting)
            t.start()
            poll(lambda: c.get("/health").json()["waiting"] == 1, "a queued request")
            queued = len(live.engine.tokenizer.encode_prompt("queued"))  # the running one is decoding
            # NOTE: waiting counts it from its submit; the backlog once the engine thread took it
            poll(
                lambda: c.get("/health").json()["prefill_backlog_tokens"] == queued,
                "its prompt in the backlog",
            )
            assert f"radixgate_worker_prefill_backlog_tokens {float(queued)}" in c.get("/metrics").text
            full = c.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 1})
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
            assert full.json()["error"]["code"] == "queue_full" and full.headers["retry-after"] == "1"
            assert "radixgate_worker_queue_full_requests_total 1.0" in c.get("/metrics").text
        t.join(30)
        assert waiting_result["resp"].status_code == 200  # the queued one ran once the first left
        live.engine.stop()
        assert c.get("/health").status_code == 503
        dead = c.post("/v1/completions", json={"prompt": "anyone?", "max_tokens": 1})
        assert dead.status_code == 503 and dead.json()["error"]["message"]


def test_a_burst_that_fits_the_free_running_slots_is_not_refused():
    """--max-waiting counts the requests queued beyond the free --max-running slots: a burst an idle
    worker can run at once is served whole (requests that went straight to a slot were counted as
    waiting, so an idle worker answered 429 to the second of two)."""
    with serve(max_running=6, max_waiting=1) as live:

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                body = {"prompt": "burst", "max_tokens": 2}
                return [r.status_code for r in await asyncio.gather(
                    *(c.post("/v1/completions", json=body) for _ in range(6)))]  # fmt: skip

        for _ in range(3):
            assert asyncio.run(burst()) == [200] * 6


def test_requests_the_engine_thread_has_not_counted_yet_count_as_waiting(client, server):
    """A router reads running + waiting from /health as the worker's load: requests that arrive
    during a long step wait in the engine's inbox, and those it took count until its next snapshot
    (the step after it took them may be long too: their prefill)."""
    gates = [threading.Event(), threading.Event()]
    held = [threading.Event(), threading.Event()]
    server.engine.post(lambda: (held[0].set(), gates[0].wait(30)))  # the engine thread is on a long step
    assert held[0].wait(20)
    results: list = []

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c2:
            results.append(c2.post("/v1/completions", json={"prompt": "in the inbox", "max_tokens": 2}))

    threads = [threading.Thread(target=send) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        poll(lambda: client.get("/health").json()["waiting"] == 3, "three requests waiting in the inbox")
        assert metric(client, "radixgate_worker_waiting_requests") == 3
        # the engine takes the three, then runs a long step before its next snapshot
        server.engine.post(lambda: (held[1].set(), gates[1].wait(30)))
        gates[0].set()
        assert held[1].wait(20)
        health = client.get("/health").json()
        assert health["waiting"] + health["running"] == 3, health
    finally:
        for gate in gates:
            gate.set()
        for t in threads:
            t.join(30)
    assert [r.status_code for r in results] == [200] * 3
    assert idle(client)["waiting"] == 0


def test_a_request_short_of_pages_a_kv_export_holds_waits_for_them_and_the_worker_lives():
    """An export held open (a slow reader, a peer on a slow link) locks its cached pages. A lone
    request that then runs out of pages is put back to wait until they are given back; it was a
    'KV pool cannot hold a single request' that killed the engine."""
    import random

    from worker.kv_pages import export_begin

    rng = random.Random(0)
    held, short = [rng.randrange(97, 123) for _ in range(700)], [rng.randrange(97, 123) for _ in range(300)]
    with (
        serve(kv_cache_tokens=1024, decode_reserve_tokens=8) as live,
        httpx.Client(base_url=live.url, timeout=120) as c,
    ):
        engine = live.engine
        assert c.post("/v1/completions", json={"prompt": held, "max_tokens": 1}).status_code == 200
        pin = engine.post(lambda: export_begin(engine, np.array([*held, 0]), 0, 10_000)).result(30)
        assert pin is not None  # 43 of the 64 pages locked; 21 left for the request's 700 tokens
        result: dict = {}

        def send() -> None:
            body = {"prompt": short, "max_tokens": 400, "ignore_eos": True}
            with httpx.Client(base_url=live.url, timeout=120) as c2:
                result["resp"] = c2.post("/v1/completions", json=body)

        t = threading.Thread(target=send)
        t.start()
        try:
            poll(lambda: engine.snapshot().retractions >= 1, "the request put back for want of pages")
            health = c.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert health.json()["waiting"] + health.json()["running"] == 1 and "resp" not in result
        finally:
            engine.post(lambda: engine.cache.unlock(pin.node)).result(30)  # the export ends
            t.join(120)
        resp = result["resp"]
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 400
        assert idle(c)["status"] == "ok"


def test_more_choices_than_the_worker_takes_at_once_is_a_400_not_a_429():
    """prompts x n above --max-running plus --max-waiting can never be taken at once: a 400 saying so
    (a 429 would have the client retry forever), on an idle worker; as many choices as that run."""
    with serve(max_waiting=2, max_running=2) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        for body in ({"prompt": "hi", "n": 5}, {"prompt": ["a", "b", "c", "d", "e"]}):
            resp = c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and "--max-waiting" in error["message"]
        ok = c.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=chat).status_code == 400
        idle(c)


def test_sim_engine_serves_the_same_api_and_says_it_is_simulated():
    from worker.sim_engine import build_sim_engine

    cfg = WorkerConfig(engine="sim", model="sim-8b", kv_cache_tokens=4096)
    with LiveServer(build_sim_engine(cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.get("/health").json()["simulated"] is True
        body = {"model": "sim-8b", "prompt": SYSTEM + "first", "max_tokens": 5}
        first = c.post("/v1/completions", json=body).json()
        again = c.post("/v1/completions", json=body).json()
        assert first["simulated"] is True and first["usage"]["completion_tokens"] == 5
        assert again["choices"][0]["text"] == first["choices"][0]["text"]  # deterministic
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            events = list(sse_events(resp.iter_lines()))
        assert all(e["simulated"] is True for e in events[:-1])


def test_assistant_prefill_continues_the_last_message(client):
    messages = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": '{"a": '}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    tokens = client.post("/tokenize", json={"messages": messages, **options}).json()["tokens"]
    assert bytes(tokens).decode().endswith('<|assistant|>\n{"a": ')
    body = {"messages": messages, **options, "max_tokens": 3, "temperature": 0}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == len(tokens)
    for bad in ({**body, "messages": messages[:1]}, {**body, "add_generation_prompt": True}):
        assert client.post("/v1/chat/completions", json=bad).status_code == 400


def test_tokenize_and_detokenize_round_trip_as_generation_tokenizes(client):
    text = "Héllo, radix caches!"
    tokens = client.post("/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == list(text.encode()) and tokens["count"] == len(text.encode())
    assert tokens["max_model_len"] == client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    eos = client.post("/detokenize", json={"tokens": [*tokens["tokens"], 256]}).json()
    assert eos == {"prompt": text + "<|eos|>"}  # special tokens kept: the text the model reads
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert len(chat_ids) == answer["usage"]["prompt_tokens"]  # the same rendering as chat
    for path, body in [("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [1, 999]}),
                       ("/detokenize", {"tokens": "abc"}), ("/tokenize", {"messages": "x"})]:  # fmt: skip
        resp = client.post(path, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["message"], (path, body)


def test_a_stalled_engine_step_makes_health_503_until_it_ends() -> None:
    """A step (here a call) that does not end, as one stuck in a hung tensor-parallel rank's
    collective: /health answers 503 'stalled' so routers send work elsewhere, then ok again."""
    release = threading.Event()
    with serve(stall_timeout_s=0.3) as live:
        poll(lambda: httpx.get(live.url + "/health").json()["status"] == "ok", "the warm-up to end")
        held = live.engine.post(lambda: release.wait(30))
        health = poll(lambda: (h := httpx.get(live.url + "/health")).status_code == 503 and h, "a stall")
        assert health.json()["status"] == "stalled"
        release.set()
        held.result(timeout=10)
        poll(lambda: httpx.get(live.url + "/health").status_code == 200, "the stall to end")
        body = {"prompt": "after the stall", "max_tokens": 2}
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=30).status_code == 200


def test_a_chunked_body_past_the_bound_is_413_like_a_declared_one(server) -> None:
    """The body bound counts bytes as they arrive: a chunked body declares no length."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(33):
            yield b"x" * (1 << 20)
        yield b'", "max_tokens": 1}'

    r = httpx.post(
        server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert (
        httpx.post(server.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 1}).status_code
        == 200
    )


def test_a_body_that_does_not_arrive_in_time_is_408_and_the_worker_serves_on() -> None:
    """A client trickling its body (one byte a second: it never goes silent) gets 408 body_timeout
    once body_timeout_s is over, on every endpoint that reads a body."""
    from worker.sim_engine import build_sim_engine

    cfg = WorkerConfig(engine="sim", model="sim-8b", kv_cache_tokens=4096)
    with LiveServer(build_sim_engine(cfg), ADMIN, body_timeout_s=0.5) as live:
        port = int(live.url.rsplit(":", 1)[1])
        for path in (b"/v1/completions", b"/v1/load_lora_adapter"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: w\r\nauthorization: Bearer " + ADMIN.encode()
                             + b"\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{")  # fmt: skip
                sock.settimeout(1.0)
                answer, deadline = b"", time.monotonic() + 20
                while not answer and time.monotonic() < deadline:
                    try:
                        answer = sock.recv(65536)
                    except TimeoutError:
                        sock.sendall(b" ")
            assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer, (path, answer)
        body = {"model": "sim-8b", "prompt": "fine", "max_tokens": 1}
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_bodies_past_the_inline_size_are_checked_as_small_ones_are(server) -> None:
    """A body over PARSE_INLINE_BYTES is parsed and checked in a thread (off the event loop every
    stream shares): the same answers as inline."""
    from router.request_parsing import JSON_DEPTH_ERROR, MAX_JSON_DEPTH, PARSE_INLINE_BYTES

    pad = "x" * PARSE_INLINE_BYTES
    url = server.url + "/v1/completions"
    ok = httpx.post(url, json={"prompt": "fine", "max_tokens": 1, "user": pad}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None, ok.text
    deep: object = 1
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = [deep]
    cases = [
        ({"prompt": "p", "max_tokens": 1, "user": pad, "extra": deep}, 400, JSON_DEPTH_ERROR),
        ({"prompt": "p", "max_tokens": 1, "user": pad, "model": "nope"}, 404, "nope"),
        ([pad], 400, "must be a JSON object"),
    ]
    for body, status, message in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    bad = httpx.post(url, content=b'{"prompt": "' + pad.encode() + b'"', timeout=30)
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"], bad.text


def test_a_large_body_is_checked_off_the_event_loop(server) -> None:
    """Parsing and checking a body of a million JSON values takes a second or more: done on the event
    loop, it held every stream and /health until it was over."""
    body = orjson.dumps({"prompt": "p", "max_tokens": 1, "user": "u", "extra": [{"a": 1}] * 1_500_000})
    done = threading.Event()

    def big() -> None:
        try:
            headers = {"content-type": "application/json"}
            httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=120)
        finally:
            done.set()

    answered = 0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        thread = threading.Thread(target=big)
        thread.start()
        done.wait(0.3)  # NOTE: the body is sent by then; its check takes a second or more
        while not done.is_set():
            assert client.get("/health").status_code == 200
            answered += not done.is_set()  # NOTE: answered while the body was still being checked
        thread.join(120)
    assert answered >= 10, answered  # a few at most while the loop was held


def test_a_request_for_an_adapter_unloaded_after_its_check_is_404(server) -> None:
    """An adapter unloaded between the body's check and the request's submission: 404, not 500."""
    from worker.api_params import APIError
    from worker.sampling import SamplingParams
    from worker.server import WorkerAPI

    api = WorkerAPI(server.engine)
    with pytest.raises(APIError) as caught:
        api.for_model(SamplingParams(), {"model": "gone-adapter"})
    assert (caught.value.status, caught.value.code) == (404, "model_not_found")


def test_every_answer_carries_a_request_id_and_models_are_listed_one_by_one(client) -> None:
    mine = client.post(
        "/v1/completions", json={"prompt": "id?", "max_tokens": 1}, headers={"x-request-id": "r-42"}
    )
    assert mine.headers["x-request-id"] == "r-42"
    made = client.post(
        "/v1/completions", json={"prompt": "id?", "max_tokens": 1, "echo": None}
    )  # null: default
    assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
    assert client.get("/v1/nope").headers["x-request-id"]  # errors too
    listed = client.get("/v1/models").json()["data"]
    assert [client.get(f"/v1/models/{m['id']}").json() for m in listed] == listed
    missing = client.get("/v1/models/not-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_an_event_stays_one_line_for_line_readers_whatever_the_text() -> None:
    """JSON allows U+2028, U+2029 and U+0085 raw; readers built on str.splitlines cut there."""
    from worker.openai_format import sse_json

    text = "a\u2028b\u2029c\x85d é"
    data = sse_json({"content": text})
    assert len(data.decode().splitlines()) == 1 and orjson.loads(data) == {"content": text}


def test_max_model_len_caps_the_context_served_and_its_rope_tables():
    with serve(max_model_len=100) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 100
        assert live.engine.executor.model.cos_sin_cache.shape[0] == 100  # type: ignore[attr-defined]
        refused = c.post("/v1/completions", json={"prompt": "y" * 100, "max_tokens": 1})
        assert refused.status_code == 400 and "at most 99" in refused.json()["error"]["message"]
        served = c.post("/v1/completions", json={"prompt": "y" * 90, "max_tokens": 50}).json()
        assert served["usage"]["completion_tokens"] == 10  # the rest of the context
    with pytest.raises(ValueError, match="exceeds the model's context"):
        serve(max_model_len=10**6)
    with pytest.raises(ValueError, match="--max-model-len"):
        WorkerConfig(model="tiny", max_model_len=1).validate()


def test_a_refusal_that_quotes_the_request_is_logged_on_one_line(client, caplog):
    """A 400's message may quote the request (a schema's type here): logged escaped, a newline in it
    cannot write a line of its own into the worker's log."""
    forged = "nope\n2026-11-30 22:00:00,000 INFO worker.server: POST /v1/cache/flush -> 200 (admin)"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": forged}}}}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="worker.server"):
        assert client.post("/v1/chat/completions", json=body).status_code == 400
    (line,) = [r.getMessage() for r in caplog.records if "-> 400" in r.getMessage()]
    assert "\n" not in line and "nope\\n2026" in line


def test_stop_strings_and_bad_words_past_their_bounds_are_a_400(client):
    """Millions of them cost every request on the worker a step's time each token (and seconds of
    the event loop to read): a clear 400 past the documented bounds, and the worker serves on."""
    body = {"prompt": "bounded", "max_tokens": 2}
    for extra, message in (({"stop": [f"s{i}" for i in range(65)]}, "stop takes at most 64"),
                           ({"bad_words": [f"w{i}" for i in range(257)]}, "bad_words takes at most 256"),
                           ({"bad_words": ["x" * 257]}, "bad_words takes at most 256"),
                           ({"stop_token_ids": list(range(1025))}, "stop_token_ids")):  # fmt: skip
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert (
        client.post(
            "/v1/completions", json={**body, "stop": ["s"] * 64, "bad_words": ["w"] * 256}
        ).status_code
        == 200
    )


def test_documents_refusal_parts_and_a_request_chat_template_on_the_worker(client):
    """``documents`` reach the chat template (more prompt tokens, here the built-in template's
    block), an assistant's ``refusal`` part is its text, and a per-request ``chat_template`` is a 400
    (it was ignored without a word, as were the documents)."""
    chat = {"messages": [{"role": "user", "content": "Sum up the documents."}], "max_tokens": 1}
    plain = client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"]
    docs = [{"title": "radix", "text": "a tree of prefixes"}]
    with_docs = client.post("/v1/chat/completions", json={**chat, "documents": docs}).json()["usage"]
    rendered = '<|documents|>\n[{"title":"radix","text":"a tree of prefixes"}]\n'
    assert with_docs["prompt_tokens"] == plain + len(rendered.encode())
    refused = client.post("/v1/chat/completions", json={**chat, "chat_template": "{{ messages }}"})
    assert refused.status_code == 400 and "chat_template" in refused.json()["error"]["message"]
    turns = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
             {"role": "user", "content": "Why?"}]  # fmt: skip
    assert client.post("/v1/chat/completions", json={**chat, "messages": turns}).status_code == 200


def test_a_bad_output_bound_is_refused_by_the_name_it_was_sent_as(client):
    """Chat's max_completion_tokens and the Responses API's max_output_tokens are refused as such,
    not as max_tokens, a field the client did not send."""
    chat = {"messages": [{"role": "user", "content": "a"}]}
    for path, body, name in (("/v1/chat/completions", {**chat, "max_completion_tokens": 0}, "max_completion_tokens"),
                             ("/v1/chat/completions", {**chat, "max_tokens": 0}, "max_tokens"),
                             ("/v1/responses", {"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
                             ("/v1/completions", {"prompt": "a", "max_tokens": "2"}, "max_tokens")):  # fmt: skip
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{name} must be"), r.text
