"""``echo`` on /v1/completions: the prompt sent back, and with ``logprobs`` every prompt token's
logprob (the first has none), computed over the whole prompt even when it is cached, in chunks
or not, equal to transformers' numbers; ``max_tokens: 0`` scores a prompt and generates nothing
(what evaluation harnesses send)."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
import transformers

from router.tokenization import HFTokenizer
from worker.assembly import build_engine
from worker.config import WorkerConfig

from .test_server import LiveServer

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in pages."


def serve(model: str, **overrides) -> LiveServer:
    cfg = WorkerConfig(model=model, device="cpu", kv_cache_tokens=4096, warmup_tokens=0, **overrides)
    return LiveServer(build_engine(cfg))


@pytest.fixture(scope="module")
def hf_workers(llama_checkpoint):
    """The same checkpoint served twice: whole prefills, and 16-token prefill chunks."""
    with (
        serve(str(llama_checkpoint)) as whole,
        serve(str(llama_checkpoint), chunked_prefill_tokens=16) as chunked,
    ):
        yield whole, chunked


def score(url: str, prompt, top: int = 2, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": top, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def hf_prompt_logprobs(path, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position [len(ids), vocab]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_transformers_cached_or_not_chunked_or_not(hf_workers, llama_checkpoint):
    whole, chunked = hf_workers
    tok = HFTokenizer(str(llama_checkpoint))
    ids = tok.encode_prompt(PROMPT)
    assert len(ids) > 32  # several 16-token chunks
    expected = hf_prompt_logprobs(llama_checkpoint, ids)
    # the prompt is in the cache before the second scoring: it must still be computed whole
    httpx.post(whole.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=60)
    for server in (whole, whole, chunked):
        body = score(server.url, PROMPT)
        choice = body["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 0
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed, not served
        lp = choice["logprobs"]
        assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert math.isclose(lp["token_logprobs"][p], float(expected[p - 1, ids[p]]), abs_tol=1e-3), p
            top = expected[p - 1].topk(2)
            names = [tok.decode([int(t)], skip_special_tokens=False) for t in top.indices]
            if len(set(names)) == 2:  # NOTE: the legacy shape keys alternatives by text; skip collisions
                for name, value in zip(names, top.values, strict=True):
                    assert lp["top_logprobs"][p][name] == pytest.approx(float(value), abs=1e-3)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_with_generation_puts_the_prompt_first(hf_workers, llama_checkpoint):
    whole, _ = hf_workers
    tok = HFTokenizer(str(llama_checkpoint))
    ids = tok.encode_prompt(PROMPT)
    body = {
        "prompt": PROMPT,
        "max_tokens": 3,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
        "ignore_eos": True,
    }
    choice = httpx.post(whole.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    plain = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    generated = httpx.post(whole.url + "/v1/completions", json=plain, timeout=60).json()["choices"][0]["text"]
    assert choice["text"] == PROMPT + generated
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3
    assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(hf_workers):
    whole, _ = hf_workers
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 0, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    chunks = []
    with httpx.stream("POST", whole.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json()["choices"][0])
    assert chunks[0]["text"].startswith(PROMPT)
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    whole_body = score(whole.url, PROMPT, top=0, max_tokens=2, ignore_eos=True)
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(whole_body["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)


def test_echo_on_the_tiny_model_batches_and_bad_requests():
    with serve("tiny") as live:
        url = live.url + "/v1/completions"
        body = score(live.url, ["ab", "xyz"], top=0)
        assert [c["text"] for c in body["choices"]] == ["ab", "xyz"]
        assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [2, 3]
        # echo without logprobs: the text only, and the cache serves the prompt as usual
        first = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout=60).json()
        again = httpx.post(
            url, json={"prompt": PROMPT, "max_tokens": 2, "echo": True, "temperature": 0}, timeout=60
        ).json()
        assert again["choices"][0]["text"] == PROMPT + first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for bad in ({"prompt": "a", "max_tokens": 0}, {"prompt": "a", "echo": "yes"}):
            assert httpx.post(url, json=bad, timeout=10).status_code == 400
        chat = {"messages": [{"role": "user", "content": "a"}], "echo": True}
        assert httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 400


def test_sim_worker_scores_prompts_with_certain_tokens():
    from worker.sim_engine import build_sim_engine

    cfg = WorkerConfig(engine="sim", model="sim", kv_cache_tokens=4096, sim_prefill_ms_per_token=0.0,
                       chunked_prefill_tokens=16)  # fmt: skip
    with LiveServer(build_sim_engine(cfg)) as live:
        body = score(live.url, PROMPT, top=1)
        lp = body["choices"][0]["logprobs"]
        assert body["simulated"] is True and body["choices"][0]["text"] == PROMPT
        assert lp["token_logprobs"] == [None] + [0.0] * (len(PROMPT.encode()) - 1)
        assert lp["top_logprobs"][1:] == [{t: 0.0} for t in lp["tokens"][1:]]
