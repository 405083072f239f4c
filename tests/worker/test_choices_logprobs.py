"""n > 1 choices and logprobs on a real worker server: logprobs against transformers' own
log-softmax for the same checkpoint, both OpenAI shapes, streams, and n choices sharing the prompt's
pages (cached prefix) with one usage."""

from __future__ import annotations

import math
import time

import httpx
import pytest
import torch
import transformers

from router.tokenization import ByteTokenizer, HFTokenizer
from tests.worker.test_server import LiveServer, sse_events
from worker.assembly import build_engine
from worker.config import WorkerConfig

PROMPT = "Cache-aware routing sends shared prefixes to the worker that already holds them."


def serve(model: str) -> LiveServer:
    cfg = WorkerConfig(model=model, device="cpu", kv_cache_tokens=4096, warmup_tokens=0)
    return LiveServer(build_engine(cfg))


@pytest.fixture(scope="module")
def hf_server(llama_checkpoint):
    with serve(str(llama_checkpoint)) as live:
        yield live


@pytest.fixture(scope="module")
def tiny_server():
    with serve("tiny") as live:
        yield live


def hf_greedy(path, ids: list[int], steps: int) -> list[torch.Tensor]:
    """transformers' log-softmax at each of ``steps`` greedy positions after ``ids``."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            out.append(logp)
            ids.append(int(logp.argmax()))
    return out


def test_completion_logprobs_match_transformers(hf_server, llama_checkpoint):
    tok = HFTokenizer(str(llama_checkpoint))
    ids = tok.encode_prompt(PROMPT)
    body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    resp = httpx.post(hf_server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    expected = hf_greedy(llama_checkpoint, ids, 5)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    for i, logp in enumerate(expected):
        best = int(logp.argmax())
        assert lp["tokens"][i] == tok.decode([best], skip_special_tokens=False)
        assert math.isclose(lp["token_logprobs"][i], float(logp[best]), abs_tol=1e-3)
        top = logp.topk(3)
        want = sorted(float(v) for v in top.values)
        got = sorted(lp["top_logprobs"][i].values())
        names = {tok.decode([int(t)], skip_special_tokens=False) for t in top.indices}
        if len(names) == 3:  # NOTE: two ids may decode to the same text (partial UTF-8): one key
            assert got == pytest.approx(want, abs=1e-3)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert "".join(lp["tokens"]) == choice["text"]


def test_chat_logprobs_name_tokens_by_text_and_bytes(hf_server, llama_checkpoint):
    tok = HFTokenizer(str(llama_checkpoint))
    messages = [{"role": "user", "content": "Héllo wörld — naïve café, 東京"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True}  # fmt: skip
    resp = httpx.post(hf_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    content = choice["logprobs"]["content"]
    expected = hf_greedy(llama_checkpoint, tok.encode_chat(messages), 6)
    assert len(content) == 6
    raw = b""
    for entry, logp in zip(content, expected, strict=True):
        assert math.isclose(entry["logprob"], float(logp.max()), abs_tol=1e-3)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            logp.topk(2).values.tolist(), abs=1e-3
        )
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-6)
        raw += bytes(entry["bytes"])
    # the tokens' bytes put together are the answer's text
    assert raw.decode("utf-8", errors="replace") == choice["message"]["content"]


def test_logprobs_are_none_unless_asked_and_zero_gives_only_the_sampled_token(tiny_server):
    url = tiny_server.url
    plain = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=60).json()
    assert plain["choices"][0]["logprobs"] is None
    body = {"prompt": "abc", "max_tokens": 3, "logprobs": 0, "temperature": 0.8, "seed": 5}
    lp = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top == {token: value} and value <= 0.0
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}
    entry = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["logprobs"]
    assert len(entry["content"]) == 2 and all(e["top_logprobs"] == [] for e in entry["content"])
    assert all(len(e["bytes"]) == 1 for e in entry["content"])  # byte tokenizer: one byte per token


def test_streamed_logprobs_cover_every_token_once(tiny_server):
    body = {"prompt": "Stream me ", "max_tokens": 12, "logprobs": 2, "stream": True, "seed": 3, "stream_options": {"include_usage": True},
            "stop": ["zz"], "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as resp:
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [
        o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    usage = events[-2]["usage"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    if "zz" not in "".join(tokens):  # a stop string would cut the text inside the tokens
        assert "".join(tokens) == text
    assert len(tokens) == usage["completion_tokens"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_n_choices_share_the_prompt_and_report_one_usage(tiny_server):
    url = tiny_server.url
    prompt = "A fresh shared prompt about n choices. " * 6  # ~234 tokens, 14 full pages
    body = {"prompt": prompt, "max_tokens": 8, "n": 4, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in data["choices"]]
    assert len(set(texts)) > 1  # seed + i per choice: the choices differ
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    prompt_tokens = len(ByteTokenizer().encode_prompt(prompt))
    assert data["usage"]["prompt_tokens"] == prompt_tokens
    assert data["usage"]["completion_tokens"] == 32
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was cached before
    # the prompt's full pages were computed once: the other choices found them in the cache
    info = httpx.get(url + "/metrics", timeout=10).text
    cached = next(float(line.split()[-1]) for line in info.splitlines()
                  if line.startswith("radixgate_worker_cached_tokens_total"))  # fmt: skip
    assert cached >= 3 * (prompt_tokens // 16) * 16

    # the same request again is reproducible choice by choice, now from the cache
    again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in again["choices"]] == texts
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens // 16) * 16


def test_n_choices_stream_with_their_index(tiny_server):
    body = {"messages": [{"role": "user", "content": "two please"}], "max_tokens": 5, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    per_index: dict[int, list[dict]] = {0: [], 1: []}
    for e in events[:-2]:
        [choice] = e["choices"]
        per_index[choice["index"]].append(choice)
    for chunks in per_index.values():
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in chunks[:-1])


def test_n_choices_all_aborted_when_the_client_leaves(tiny_server):
    engine = tiny_server.engine
    before = engine.snapshot().finished.get("abort", 0)
    body = {"prompt": "forever", "max_tokens": 3000, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as resp:
        events = sse_events(resp.iter_lines())
        assert next(events)["choices"]
    end = time.monotonic() + 15.0
    while engine.snapshot().finished.get("abort", 0) < before + 3:
        assert time.monotonic() < end, engine.snapshot().finished
        time.sleep(0.05)
    assert engine.snapshot().running == 0


def test_a_stop_token_ends_the_answer_without_a_logprobs_entry(tiny_server):
    url = tiny_server.url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "stop soon"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "ignore_eos": True}  # fmt: skip
    first = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    ids = [e["bytes"][0] for e in first]
    cut = next(i for i in range(1, 6) if ids[i] not in ids[:i])  # first id not seen before it
    answer = httpx.post(url, json={**body, "stop_token_ids": [ids[cut]]}, timeout=60).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == cut + 1  # the stop token is generated...
    assert [e["bytes"][0] for e in choice["logprobs"]["content"]] == ids[
        :cut
    ]  # ...but not part of the answer


def test_batched_prompts_answer_n_choices_each_in_order(tiny_server):
    url = tiny_server.url + "/v1/completions"
    prompts = ["First prompt: alpha. " * 3, [ord(c) for c in "Second prompt as ids."], "Third: gamma."]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0.7, "seed": 9, "ignore_eos": True}
    data = httpx.post(url, json=body, timeout=60).json()
    assert [c["index"] for c in data["choices"]] == list(range(6))
    tok = ByteTokenizer()
    lengths = [len(tok.encode_prompt(prompts[0])), len(prompts[1]), len(tok.encode_prompt(prompts[2]))]
    assert data["usage"]["prompt_tokens"] == sum(lengths)
    assert data["usage"]["completion_tokens"] == 6 * 4
    # choice p * n + i is prompt p's i-th: the same as asking for prompt p alone
    for p, prompt in enumerate(prompts):
        alone = httpx.post(url, json={**body, "prompt": prompt}, timeout=60).json()
        assert [c["text"] for c in alone["choices"]] == [
            c["text"] for c in data["choices"][2 * p : 2 * p + 2]
        ]


def test_a_token_is_named_by_the_text_it_adds_so_offsets_follow_the_answer(tmp_path):
    """A SentencePiece ``▁word`` piece decoded alone loses its space; named by its bytes it is
    " word", so the names put together are the answer's text (and ``text_offset`` counts it), while
    part of a byte-fallback character stays U+FFFD."""
    from tests.test_tokenization import sentencepiece_dir
    from worker.openai_format import TokenNames

    tok = HFTokenizer(str(sentencepiece_dir(tmp_path / "sp")))
    names = TokenNames(tok)
    prompt = tok.encode_prompt("in the")
    ids = tok.encode_prompt("the hat in the cat")[1:]  # generated tokens carry no BOS
    assert "".join(names(t)[0] for t in ids) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert [bytes(names(t)[1]).decode() for t in ids] == [names(t)[0] for t in ids]
    (split,) = [t for t in tok.encode_text("é") if names(t)[1] == [0xC3]]
    assert names(split)[0] == "\ufffd"


def test_tokens_spelt_alike_share_one_top_logprobs_key_holding_the_likeliest():
    """The legacy shape keys top_logprobs by token text: the pieces of a UTF-8 character each read U+FFFD, and
    the last of them (the least likely) overwrote the others' key, the sampled one's too."""
    from worker.openai_format import Choice, Responses, TokenNames

    names = TokenNames(ByteTokenizer())
    assert names(169)[0] == names(195)[0] == names(0xE4)[0] == "\ufffd"
    out = Responses(
        "x", "tiny", chat=False, names=names, logprobs=True, simulated=False
    )._completion_logprobs(Choice(0, prompt=0), [(169, (-5.0, [111, 195, 0xE4], [-1.0, -2.0, -4.0]))])
    assert out["tokens"] == ["\ufffd"] and out["token_logprobs"] == [-5.0]
    assert out["top_logprobs"] == [{"o": -1.0, "\ufffd": -2.0}]
