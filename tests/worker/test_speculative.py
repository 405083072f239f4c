"""Speculative decoding by prompt lookup: drafts come from the most recent earlier occurrence of a
request's last tokens; a verify step keeps exactly the drafts one-at-a-time decoding would have
produced (greedy and seeded: the same tokens; sampled: the same distribution); the scheduler's
pages and KV stay right when drafts are rejected or a request ends inside a step; a real worker
answers the same with and without it (text, logprobs, seeded samples, stop strings, streams) and
counts drafts in /metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch

from worker.assembly import build_engine
from worker.config import WorkerConfig
from worker.request import Request
from worker.sampling import SamplingParams, accept_draft, accept_greedy, sample
from worker.scheduler import _pages_for
from worker.speculative import NgramProposer

from .test_overlap import run_overlapped
from .test_scheduler import PS, assert_no_leak, make, reference
from .test_server import LiveServer


def decoding(tokens: list[int], prompt_len: int | None = None, max_tokens: int = 100) -> Request:
    n = len(tokens) if prompt_len is None else prompt_len
    req = Request("r", tokens[:n], max_tokens=max_tokens, speculative=True)
    req.token_ids.extend(tokens[n:])
    return req


# ------------------------------------------------------------------ proposer
def test_drafts_follow_the_most_recent_occurrence_of_the_longest_suffix():
    p = NgramProposer(num_tokens=3, max_ngram=3, min_ngram=1)
    #              0  1  2  3  4  5  6  7  8  9 10 11
    req = decoding([5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 0, 6, 7])
    # suffix [0, 6, 7] never occurred; [6, 7] at 1 and 6: the later one continues 3, 4, 0
    assert p.propose(req) == [3, 4, 0]
    req = decoding([1, 2, 3, 8, 2, 3, 9, 1, 2, 3])
    assert p.propose(req) == [8, 2, 3]  # [1, 2, 3] matched at 0 beats the later [2, 3] at 4


def test_no_draft_without_a_match_or_room_or_permission():
    p = NgramProposer(num_tokens=4, max_ngram=3, min_ngram=2)
    assert p.propose(decoding([1, 2, 3, 4, 5])) == []  # no repeated pair
    two_out = [1, 2, 3, 1, 2, 3, 1, 2]
    assert p.propose(decoding(two_out, prompt_len=6, max_tokens=4)) == [3]  # 2 left: 1 draft + its own
    assert p.propose(decoding(two_out, prompt_len=6, max_tokens=3)) == []  # 1 left: its own token only
    req = decoding([1, 2, 3, 1, 2])
    req.speculative = False  # penalties or a grammar: never speculates
    assert p.propose(req) == []
    short = decoding([1, 2, 5, 1, 2])
    assert p.propose(short) == [5, 1, 2]  # the continuation runs into the suffix itself


def test_the_lookup_sees_tokens_appended_after_the_last_proposal():
    p = NgramProposer(num_tokens=2, max_ngram=2, min_ngram=2)
    req = decoding([1, 2, 3, 4], prompt_len=2)
    assert p.propose(req) == []
    req.token_ids.extend([9, 3, 4])  # now [3, 4] occurred at 2, followed by 9, 3
    assert p.propose(req) == [9, 3]
    req.token_ids.extend([8, 7])
    assert p.propose(req) == []  # [8, 7] is new


def naive_drafts(tokens: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """The proposer's rule, spelt out: for n from longest down, the latest earlier start of the
    last n tokens, and the k tokens after it."""
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        tail = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tail]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


def test_the_lookup_agrees_with_the_rule_spelt_out():
    rng = np.random.default_rng(7)
    for _ in range(2000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(2, 50))).tolist()
        longest = int(rng.integers(1, 6))
        shortest, k = int(rng.integers(1, longest + 1)), int(rng.integers(1, 6))
        got = NgramProposer(k, longest, shortest).propose(decoding(tokens, max_tokens=1000))
        assert got == naive_drafts(tokens, k, longest, shortest), (tokens, k, longest, shortest)


@pytest.mark.parametrize("bad", [{"num_tokens": 0}, {"num_tokens": 2, "min_ngram": 0},
                                 {"num_tokens": 2, "min_ngram": 3, "max_ngram": 2},
                                 {"num_tokens": 2, "max_batch": 0}])  # fmt: skip
def test_bad_proposer_settings_are_errors(bad):
    with pytest.raises(ValueError):
        NgramProposer(**bad)


# ------------------------------------------------------------------ acceptance
def test_greedy_acceptance_keeps_the_agreed_run_then_the_models_token():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept + bonus
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # second rejected: the model's own
    assert accept_greedy([1, 5, 6, 7], [4, 5, 6]) == [1]
    logits = torch.full((3, 10), -5.0)
    logits[0, 3], logits[1, 8], logits[2, 2] = 1.0, 1.0, 1.0
    assert accept_draft(logits, [3, 4], SamplingParams(temperature=0), None) == [3, 8]


@pytest.mark.parametrize(
    ("stop", "max_tokens", "kept", "accepted"),
    [
        (frozenset(), 10, [7, 8, 9, 10], 3),
        (frozenset({7}), 10, [7], 1),
        (frozenset({9}), 10, [7, 8, 9], 3),
        (frozenset(), 2, [7, 8], 2),
    ],
)
def test_a_verify_step_counts_as_accepted_only_the_drafts_a_request_kept(stop, max_tokens, kept, accepted):
    """The model agreed with all three drafts (then gave 10): a request that ends on one (a stop id,
    its max_tokens) keeps the tokens up to it, and only those drafts count as accepted."""
    from types import SimpleNamespace

    from worker.request import SchedulerStats
    from worker.speculative import commit_verify

    req = Request("r", [1, 2, 3], max_tokens=max_tokens, stop_token_ids=stop)
    stats = SchedulerStats()
    commit_verify(stats, SimpleNamespace(requests=[req], drafts=[[7, 8, 9]]), [[7, 8, 9, 10]])
    assert req.token_ids[3:] == kept
    assert (stats.draft_tokens, stats.accepted_tokens, stats.decode_tokens) == (3, accepted, len(kept))


def _tv(counts: np.ndarray, p: torch.Tensor) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p.numpy()).sum())


@pytest.mark.parametrize("top_k", [-1, 3])
def test_sampled_acceptance_gives_each_position_the_models_distribution(top_k):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, top_k=top_k)
    scores = logits / 0.8
    if top_k > 0:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    p = scores.softmax(dim=-1)
    draft = [int(p[0].argmax()), int(p[1].argmin() if top_k < 0 else p[1].argmax())]
    first = np.zeros(6)
    second = np.zeros(6)  # the next position's token, when the first draft was kept
    lengths = set()
    for _ in range(20_000):
        out = accept_draft(logits, draft, params, gen)
        lengths.add(len(out))
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert _tv(first, p[0]) < 0.02
    assert _tv(second, p[1]) < 0.03
    assert lengths == {1, 2, 3}  # rejected at once, at the second draft, and all kept + bonus
    if top_k > 0:
        assert not (first[p[0] == 0]).any() and not (second[p[1] == 0]).any()


@pytest.mark.parametrize("wrong_at", [0, 2, None])
def test_a_seeded_check_gives_the_tokens_and_leaves_the_generator_as_decoding_one_at_a_time(wrong_at):
    """Row j draws as the (j + 1)-th decode step's sample would, and the rows after the returned
    tokens give their draws back: the next token is the one plain decoding would draw next."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 2.0
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    one_at_a_time = torch.Generator().manual_seed(7)
    plain = [int(sample(logits[j : j + 1], [params], [one_at_a_time])[0]) for j in range(5)]
    draft = plain[:4]
    if wrong_at is not None:
        draft[wrong_at] = (draft[wrong_at] + 1) % 40
    gen = torch.Generator().manual_seed(7)
    tokens = accept_draft(logits, draft, params, gen)
    kept = 4 if wrong_at is None else wrong_at
    assert tokens == plain[: kept + 1]
    replay = torch.Generator().manual_seed(7)
    for j in range(kept + 1):
        sample(logits[j : j + 1], [params], [replay])
    assert torch.equal(gen.get_state(), replay.get_state())


def test_acceptance_checks_its_input_shape():
    with pytest.raises(ValueError):
        accept_draft(torch.zeros(2, 5), [1, 2], SamplingParams(), None)


# ------------------------------------------------------------------ scheduler
@pytest.mark.parametrize("seed", range(6))
def test_verify_steps_under_pressure_keep_outputs_pages_and_kv_right(seed):
    """A 3-token vocabulary, so drafts are often right and often not. The toy model reads every
    context token back through its KV slots: a rejected draft's K/V taken for valid, a wrong slot
    or a page lost shows up as a wrong token or an unwritten slot."""
    rng = np.random.default_rng(seed)
    sched, model = make(
        num_pages=24, vocab=3, speculative_tokens=int(rng.integers(1, 6)), speculative_min_ngram=1,
        speculative_max_batch=int(rng.integers(1, 5)), max_running=int(rng.integers(1, 6)),
        decode_reserve_tokens=int(rng.integers(0, 8)), chunked_prefill_tokens=int(rng.choice([4, 64])),
    )  # fmt: skip
    pending = []
    for i in range(10):
        tokens = rng.integers(0, 3, int(rng.integers(2, 30))).tolist()
        max_tokens, speculative = int(rng.integers(1, 40)), bool(rng.random() < 0.8)
        pending.append(Request(str(i), tokens, max_tokens=max_tokens, speculative=speculative))
    everyone = list(pending)
    cut: dict[str, int] = {}  # requests ended inside a verify step (as a stop string does)
    verify_steps = 0
    while pending or sched.has_work():
        if pending and rng.random() < 0.3:
            sched.add(pending.pop())
        batch = sched.schedule()
        if batch is None:
            continue
        verify_steps += batch.mode == "verify"
        sizes = {r.rid: len(r.token_ids) for r in batch.requests}
        for req in sched.commit(batch, model.forward(batch)):
            size = sizes[req.rid]
            if req.finish_reason is None and len(req.token_ids) - size >= 2 and rng.random() < 0.2:
                cut[req.rid] = size + 1 - req.prompt_len
                sched.finish(req, "stop", keep_tokens=size + 1)
            elif req.finish_reason is not None:
                sched.finish(req, req.finish_reason)
        free, tree, owned = sched.pages_accounted()
        assert free + tree + owned == 24
    assert_no_leak(sched)
    assert verify_steps > 0 and sched.stats.accepted_tokens > 0
    assert sched.stats.accepted_tokens < sched.stats.draft_tokens  # some drafts were rejected
    # every output token is counted once, those a cut dropped not at all; but a prefill's: a request's
    # first, and the one after each retraction (its prefill again)
    assert sched.stats.decode_tokens == sum(req.num_output - 1 for req in everyone) - sched.stats.retractions
    for req in everyone:
        assert req.output_ids == reference(req.prompt_ids, req.num_output, vocab=3)
        assert req.num_output == cut.get(req.rid, req.max_tokens)


def _run_tight_pool(seed: int, overlapped: bool) -> int:
    """Six speculating requests arriving at random into a 12-page pool, two of them verified at once;
    every answer checked against the reference and every page back. Returns the steps after which a
    running request held pages past its next position (those of rejected drafts)."""
    rng = np.random.default_rng(seed)
    sched, model = make(
        num_pages=12, vocab=3, speculative_tokens=6, speculative_min_ngram=1, speculative_max_batch=2,
        max_running=4, decode_reserve_tokens=0,
    )  # fmt: skip
    pending = [
        Request(str(i), rng.integers(0, 3, int(rng.integers(2, 12))).tolist(),
                max_tokens=int(rng.integers(8, 24)), speculative=True)
        for i in range(6)
    ]  # fmt: skip
    everyone = list(pending)
    kept = 0

    def on_step() -> None:
        nonlocal kept
        kept += any(r.pages.size > _pages_for(r.kv_len + 1, PS) for r in sched.running)
        if pending and rng.random() < 0.3:
            sched.add(pending.pop())

    while pending or sched.has_work():
        if overlapped:
            run_overlapped(sched, model, on_step)
        elif (batch := sched.schedule()) is not None:
            for req in sched.commit(batch, model.forward(batch)):
                if req.finish_reason is not None:
                    sched.finish(req, req.finish_reason)
        on_step()
    assert_no_leak(sched)
    for req in everyone:
        assert req.output_ids == reference(req.prompt_ids, req.num_output, vocab=3)
        assert req.num_output == req.max_tokens
    return kept


@pytest.mark.parametrize("overlapped", [False, True])
def test_pages_kept_from_rejected_drafts_hide_no_other_requests_need(overlapped):
    """A verify step leaves its rejected drafts' pages with their request (its next drafts reuse
    them). Counted as a negative need, they hid another request's need for a new page: a decode or
    verify step (or, overlapped, a step scheduled ahead) then grew it from an empty pool and the
    engine thread died. Stepped one at a time and overlapped, over 50 seeds."""
    kept = sum(_run_tight_pool(seed, overlapped) for seed in range(50))
    assert kept > 0  # NOTE: the case this test is for arose


def test_no_verify_step_above_the_batch_bound_or_without_drafts():
    sched, model = make(speculative_tokens=3, speculative_max_batch=1, speculative_min_ngram=1, vocab=3)
    sched.add(Request("a", [1, 2, 0, 1, 2, 0, 1, 2], max_tokens=4, speculative=True))
    sched.add(Request("b", [1, 2, 0, 1, 2, 0, 1, 2], max_tokens=30, speculative=True))
    modes = []
    while sched.has_work():
        batch = sched.schedule()
        modes.append((batch.mode, len(batch.requests)))
        for req in sched.commit(batch, model.forward(batch)):
            if req.finish_reason is not None:
                sched.finish(req, req.finish_reason)
    assert ("verify", 2) not in modes and ("decode", 2) in modes  # two running: plain decode
    assert ("verify", 1) in modes  # one left: it speculates


# ------------------------------------------------------------------ real worker
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3


@pytest.fixture(scope="module")
def workers():
    def serve(**extra) -> LiveServer:
        cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=8192, warmup_tokens=0, **extra)
        return LiveServer(build_engine(cfg))

    with serve() as plain, serve(speculative_tokens=4) as spec:
        yield plain, spec


def complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def spec_counts(url: str, prefix: str = "radixgate_worker_spec_") -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(prefix)}


def generated(url: str) -> float:
    return spec_counts(url, "radixgate_worker_generation_tokens_total")[
        "radixgate_worker_generation_tokens_total"
    ]


def test_greedy_answers_and_logprobs_are_the_same_with_drafts(workers):
    plain, spec = workers
    before = spec_counts(spec.url)
    for body in ({"max_tokens": 80, "logprobs": 2}, {"max_tokens": 33, "n": 2}, {"max_tokens": 7}):
        a, b = complete(plain.url, **body), complete(spec.url, **body)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        assert a["usage"] == b["usage"]
        if "logprobs" in body:
            la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
            assert la["tokens"] == lb["tokens"]
            assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
    after = spec_counts(spec.url)
    assert (
        after["radixgate_worker_spec_verify_steps_total"] > before["radixgate_worker_spec_verify_steps_total"]
    )
    assert (
        after["radixgate_worker_spec_accepted_tokens_total"]
        > before["radixgate_worker_spec_accepted_tokens_total"]
    )
    assert spec_counts(plain.url)["radixgate_worker_spec_draft_tokens_total"] == 0


def test_stop_strings_and_ids_end_at_the_same_token_with_drafts(workers):
    """Stops at many places, so some end a request inside a verify step (its later tokens dropped):
    a stop string completes on a kept draft only when it is longer than the matched n-gram and
    starts before the copied run, hence the longer ones. The tokens dropped after a stop are not
    counted as generated."""
    plain, spec = workers
    text = complete(plain.url, max_tokens=80)["choices"][0]["text"]
    before = generated(plain.url), generated(spec.url)
    # NOTE: on the tiny model, 7 of the 7-character stops end inside a verify step (2026-11-27)
    bodies = [{"max_tokens": 80, "stop": [text[i : i + 7]]} for i in range(10, 70, 3)]
    bodies += [{"max_tokens": 80, "stop": [text[i : i + 2]]} for i in range(10, 70, 9)]
    bodies += [{"max_tokens": 80, "stop_token_ids": [ord(text[i])]} for i in range(10, 70, 12)]
    for body in bodies:
        a, b = complete(plain.url, **body), complete(spec.url, **body)
        assert a["choices"][0]["text"] == b["choices"][0]["text"], body
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"] == "stop"
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] < 80
    assert generated(plain.url) - before[0] == generated(spec.url) - before[1]


def test_a_stream_with_drafts_equals_the_whole_answer(workers):
    _, spec = workers
    whole = complete(spec.url, max_tokens=60)["choices"][0]["text"]
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 60, "stream": True}
    parts = []
    with httpx.stream("POST", spec.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(parts) == whole and len(parts) > 1


def test_seeded_sampling_with_drafts_gives_the_answer_without_them(workers):
    """A seeded request's tokens do not depend on which steps speculate (that changes with the
    batch: --speculative-max-batch) nor on how many drafts each keeps."""
    plain, spec = workers
    before = spec_counts(spec.url)["radixgate_worker_spec_accepted_tokens_total"]
    for body in (
        {"max_tokens": 60, "temperature": 0.7, "seed": 11},
        {"max_tokens": 60, "temperature": 0.5, "top_p": 0.9, "min_p": 0.05, "seed": 12, "n": 2},
        {"max_tokens": 60, "temperature": 0.6, "top_k": 5, "seed": 13, "frequency_penalty": 0.2},
    ):
        a, b = complete(plain.url, **body), complete(spec.url, **body)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]], body
    assert spec_counts(spec.url)["radixgate_worker_spec_accepted_tokens_total"] > before  # drafts were kept


@pytest.mark.parametrize(
    "extra",
    [
        {"frequency_penalty": 0.4, "presence_penalty": 0.3},
        {"repetition_penalty": 1.15, "logit_bias": {"89": 3.0}},
        {"min_tokens": 30, "stop_token_ids": [84]},
        {"frequency_penalty": 0.3, "response_format": {"type": "json_object"}},
    ],
)
def test_penalties_bias_and_min_tokens_speculate_with_the_same_answer(workers, extra):
    """Each verify row is adjusted over the history up to it (the drafts before it included)."""
    plain, spec = workers
    before = spec_counts(spec.url)["radixgate_worker_spec_accepted_tokens_total"]
    body = {"max_tokens": 90, "logprobs": 1, **extra}
    a, b = complete(plain.url, **body), complete(spec.url, **body)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
    assert spec_counts(spec.url)["radixgate_worker_spec_accepted_tokens_total"] > before  # drafts were kept


def test_requests_beside_a_verify_step_sample_as_in_a_decode_step(workers):
    """A verify step holds every running request: one with penalties and bias is sampled with
    them, as plain decoding does, while another request's drafts are checked."""
    plain, spec = workers
    penalized = {"prompt": "Paged attention and radix trees. " * 3, "max_tokens": 40, "temperature": 0,
                 "frequency_penalty": 1.5, "presence_penalty": 1.0, "logit_bias": {"32": -100}, "logprobs": 1}  # fmt: skip
    alone = httpx.post(plain.url + "/v1/completions", json=penalized, timeout=60).json()["choices"][0]
    before = spec_counts(spec.url)["radixgate_worker_spec_verify_steps_total"]

    async def together() -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            drafting = client.post(
                spec.url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 120}
            )
            beside = client.post(spec.url + "/v1/completions", json=penalized)
            return (await asyncio.gather(drafting, beside))[1].json()["choices"][0]

    got = asyncio.run(together())
    assert got["text"] == alone["text"] and " " not in got["text"]  # the bias holds in verify steps too
    assert got["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-4)
    assert spec_counts(spec.url)["radixgate_worker_spec_verify_steps_total"] > before


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["add", "sub"]}},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def test_structured_outputs_take_forced_and_allowed_drafts_with_the_same_answer(workers):
    """Under a grammar, drafts are the tokens it forces (JSON keys, punctuation) or the lookup's
    drafts it allows; every row is masked as one-at-a-time decoding masks it."""
    plain, spec = workers
    bodies = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, "max_tokens": 120},
        {"structured_outputs": {"regex": "(add|sub)(, (add|sub)){3,8}"}, "max_tokens": 80},
        {"structured_outputs": {"choice": ["return a + b", "return a - b"]}, "max_tokens": 20, "temperature": 0.8,
         "seed": 3},
    ]  # fmt: skip
    before = spec_counts(spec.url)
    for body in bodies:
        answers = [complete(url, **body)["choices"][0] for url in (plain.url, spec.url)]
        assert answers[0]["text"] == answers[1]["text"]
        assert answers[1]["finish_reason"] == "stop"
    doc = json.loads(complete(spec.url, **bodies[0])["choices"][0]["text"])
    assert set(doc) == {"name", "tags"} and all(t in ("add", "sub") for t in doc["tags"])
    after = spec_counts(spec.url)
    kept = (
        after["radixgate_worker_spec_accepted_tokens_total"]
        - before["radixgate_worker_spec_accepted_tokens_total"]
    )
    assert kept >= len('{"name":"') + len('","tags":[')  # at least the forced keys came as drafts


def test_an_hf_checkpoint_answers_the_same_with_drafts_free_and_under_a_schema(llama_checkpoint):
    """BPE tokens: the grammar's forced tokens are a tokenization the model may not pick; they are
    checked like any draft."""

    def serve(**extra) -> LiveServer:
        cfg = WorkerConfig(
            model=str(llama_checkpoint), device="cpu", kv_cache_tokens=4096, warmup_tokens=0, **extra
        )
        return LiveServer(build_engine(cfg))

    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    with serve() as plain, serve(speculative_tokens=3, speculative_ngram_min=1) as spec:
        for body in ({"max_tokens": 60}, {**schema, "max_tokens": 60}):
            a, b = complete(plain.url, **body), complete(spec.url, **body)
            assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]
        assert spec_counts(spec.url)["radixgate_worker_spec_verify_steps_total"] > 0


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_over_an_fp8_pool_a_verify_step_scores_as_decode_steps_do(tmp_path, sliding_window):
    """Decode steps read a token's K/V back from an fp8 pool, rounded; a verify step of one request
    (on the CPU) or of a windowed model attended its new tokens as computed, so its logits moved and
    greedy answers with drafts differed from those without (the first token off at ~50)."""
    from .conftest import save_checkpoint

    model = save_checkpoint(tmp_path / "m", "llama" if sliding_window is None else "mistral",
                            **({} if sliding_window is None else {"sliding_window": sliding_window}))  # fmt: skip

    def serve(**extra) -> LiveServer:
        cfg = WorkerConfig(model=str(model), device="cpu", kv_cache_tokens=4096, warmup_tokens=0,
                           kv_cache_dtype="fp8_e5m2", **extra)  # fmt: skip
        return LiveServer(build_engine(cfg))

    with serve() as plain, serve(speculative_tokens=4, speculative_ngram_min=1) as spec:
        for bias in ({}, {"logit_bias": {"5": 8, "6": 8, "7": 8}}):  # drafts agreed with often
            body = {"max_tokens": 80, "logprobs": 1, **bias}
            a, b = complete(plain.url, **body), complete(spec.url, **body)
            la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
            assert la["tokens"] == lb["tokens"]
            # NOTE: a step of 5 tokens and one of 1 round differently in float32 (~1e-6), and now and
            # then that moves a value across an fp8 rounding step (e5m2: 2 bits)
            assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-2)
        assert spec_counts(spec.url)["radixgate_worker_spec_accepted_tokens_total"] > 0


def test_speculation_needs_the_model_engine_and_sane_flags():
    for bad in ({"engine": "sim", "speculative_tokens": 2}, {"speculative_tokens": -1},
                {"speculative_ngram_min": 3, "speculative_ngram_max": 2}, {"speculative_max_batch": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            WorkerConfig(**bad).validate()
