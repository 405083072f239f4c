"""Repetition / frequency / presence penalties, logit_bias, min_tokens, bad_words and
allowed_token_ids: the logit arithmetic, that untouched rows stay untouched, and what a real worker
generates with them."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import torch

from tests.worker.test_choices_logprobs import serve
from worker.penalties import adjust_logits
from worker.sampling import SamplingParams, sample

PROMPT = [5, 6, 7]


def test_each_adjustment_does_its_arithmetic_on_its_own_row():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]] * 5)
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(logit_bias={3: 10.0, 0: -1.0}),
        SamplingParams(min_tokens=4, max_tokens=5),
    ]
    # prompt [0, 1], output [2, 2, 4]; stop ids {4}
    histories = [([0, 1, 2, 2, 4], 2, frozenset({4}), None)] * 5
    out = adjust_logits(logits, params, histories)
    assert torch.equal(out[0], logits[0])
    # repetition over prompt + output (0, 1, 2, 4): positive / 2, negative * 2
    assert out[1].tolist() == [1.0, -4.0, 0.5, 0.5, 1.5]
    # frequency over the output only: token 2 twice, token 4 once; presence once each
    assert out[2].tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5, 3.0 - 0.5 - 0.25]
    assert out[3].tolist() == [1.0, -2.0, 1.0, 10.5, 3.0]
    assert out[4, 4] == float("-inf") and out[4, :4].tolist() == [2.0, -2.0, 1.0, 0.5]
    # min_tokens reached: the stop id is allowed again
    done = adjust_logits(logits[:1], [params[4]], [([0, 1, 2, 2, 4, 3], 2, frozenset({4}), None)])
    assert torch.equal(done[0], logits[0])


def test_rows_without_adjustments_return_the_same_tensor_and_inputs_stay_unchanged():
    logits = torch.randn(3, 10)
    before = logits.clone()
    assert adjust_logits(logits, [SamplingParams()] * 3, [(PROMPT, 3, frozenset(), None)] * 3) is logits
    adjust_logits(
        logits, [SamplingParams(presence_penalty=1.0)] * 3, [([*PROMPT, 1], 3, frozenset(), None)] * 3
    )
    assert torch.equal(logits, before)


def test_greedy_follows_the_adjusted_logits():
    logits = torch.tensor([[0.0, 5.0, 4.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    adjusted = adjust_logits(logits, params, [([0, 1, 1], 1, frozenset(), None)])  # token 1 out twice: 5 - 4
    assert int(sample(adjusted, params)[0]) == 2


def reference(
    logits: torch.Tensor, p: SamplingParams, ids: list[int], prompt_len: int, stops
) -> torch.Tensor:
    """One row the plain way (float64): the semantics in the module docstring, step by step."""
    row = logits.double().clone()
    if p.repetition_penalty != 1.0:
        for t in set(ids):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    output = ids[prompt_len:]
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, b in p.logit_bias.items():
        row[t] += b
    if len(output) < p.min_tokens:
        for t in stops:
            row[t] = float("-inf")
    for *head, last in p.bad_words:
        if len(output) >= len(head) and output[len(output) - len(head) :] == head:
            row[last] = float("-inf")
    if p.allowed_token_ids is not None:
        others = torch.ones_like(row, dtype=torch.bool)
        others[p.allowed_token_ids] = False
        row[others] = float("-inf")
    return row


def test_a_random_batch_matches_the_row_by_row_reference_and_the_memo_is_reused():
    rng = torch.Generator().manual_seed(7)
    vocab, rows = 300, 9
    logits = torch.randn(rows, vocab, generator=rng) * 3
    params, histories = [], []
    for i in range(rows):
        pick = torch.randint(0, 2, (7,), generator=rng).tolist()
        prompt_len = 10 + 7 * i
        ids = torch.randint(0, 40, (prompt_len + 3 * i,), generator=rng).tolist()  # many repeats
        # a one-token word, one the output's last token starts, one it does not end with
        words = [[33], [ids[-1], 1], [ids[-1] + 1, 2]] if i > 0 else [[33], [5, 6]]
        params.append(SamplingParams(
            repetition_penalty=[1.0, 1.7][pick[0]], frequency_penalty=[0.0, 0.6][pick[1]],
            presence_penalty=[0.0, -0.4][pick[2]], logit_bias={7: 3.0, 250: -2.5} if pick[3] else {},
            min_tokens=[0, 40][pick[4]], max_tokens=50, bad_words=words if pick[5] else [],
            allowed_token_ids=[1, 2, 7, 33, 250, ids[-1]] if pick[6] else None,
        ))  # fmt: skip
        histories.append((ids, prompt_len, frozenset({1, 2}), {}))
    got = adjust_logits(logits, params, histories)
    for i, (p, (ids, n, stops, _)) in enumerate(zip(params, histories, strict=True)):
        want = reference(logits[i], p, ids, n, stops).float()
        torch.testing.assert_close(got[i], want, msg=f"row {i}: {p}")
    assert any(p.bad_words for p in params) and any(p.allowed_token_ids for p in params)
    memos = [h[3].get("prompt_ids") for h in histories]
    assert any(m is not None for m in memos)
    again = adjust_logits(logits, params, histories)  # the second step reads the memo
    assert torch.equal(again, got) and [h[3].get("prompt_ids") for h in histories] == memos


def test_the_memo_appends_each_steps_new_tokens_and_gives_what_the_whole_history_gives():
    """Outputs grow from none, one or three tokens a step (a verify step accepts several), past the
    memo's first buffer; every step equals the memo-less result. A shorter history (not one the
    engine makes) starts the memo again rather than read stale ids."""
    rng = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(2, vocab, generator=rng)
    params = [SamplingParams(frequency_penalty=0.8, presence_penalty=0.3, min_tokens=20, max_tokens=99),
              SamplingParams(repetition_penalty=1.4, frequency_penalty=-0.6)]  # fmt: skip
    ids = [[1, 2, 3], [4, 4, 5, 6]]
    memos: list[dict] = [{}, {}]
    for step in range(30):
        for i, row in enumerate(ids):
            row += torch.randint(0, 12, (1 + 2 * (step % 3 == 2) * i,), generator=rng).tolist()
        with_memo = adjust_logits(logits, params, [(ids[0], 3, frozenset({7}), memos[0]),
                                                   (ids[1], 4, frozenset({7}), memos[1])])  # fmt: skip
        whole = adjust_logits(
            logits, params, [(ids[0], 3, frozenset({7}), None), (ids[1], 4, frozenset({7}), None)]
        )
        torch.testing.assert_close(with_memo, whole, msg=f"step {step}")
    assert memos[1]["output_ids"][0].size > 16  # NOTE: the buffer grew
    other = [*ids[0][:3], 9, 9, 8]  # NOTE: a different, shorter output
    shorter = adjust_logits(logits[:1], params[:1], [(other, 3, frozenset({7}), memos[0])])
    torch.testing.assert_close(
        shorter, adjust_logits(logits[:1], params[:1], [(other, 3, frozenset({7}), None)])
    )


def test_a_newest_token_still_on_the_device_counts_as_if_it_were_in_the_history():
    """A step scheduled ahead (--overlap-schedule) knows its rows' newest token only on the device
    (``unseen``): every adjustment, min_tokens' count included, equals the one over the whole
    history. Rows 0 and 3 reach min_tokens with that token; each row's newest token is one already
    out (or in the prompt), so its count grows by one."""
    rng = torch.Generator().manual_seed(11)
    vocab, rows = 64, 8
    logits = torch.randn(rows, vocab, generator=rng) * 3
    params = [
        SamplingParams(min_tokens=4, max_tokens=9),  # 3 out on the host, the 4th on the device
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(repetition_penalty=1.6),
        SamplingParams(frequency_penalty=-0.5, min_tokens=4, max_tokens=9, logit_bias={9: 1.5}),
        SamplingParams(),  # nothing to adjust, its token on the device all the same
        SamplingParams(frequency_penalty=0.9, presence_penalty=0.4, repetition_penalty=1.3),
        SamplingParams(logit_bias={2: -4.0}),
        SamplingParams(presence_penalty=1.1, min_tokens=6, max_tokens=9),  # host: no token on the device
    ]
    outputs = [[3, 17, 20], [4, 4, 21], [30, 5], [6, 22, 23], [8], [40, 41, 40], [1], [9, 9]]
    newest = [17, 4, 5, 22, 8, 41, 1, None]
    late = [i for i, t in enumerate(newest) if t is not None]
    whole, before = [], []
    for out, t in zip(outputs, newest, strict=True):
        prompt = [5, 9, 12, 5]
        whole.append(([*prompt, *out, *([] if t is None else [t])], len(prompt), frozenset({17, 22}), None))
        before.append(([*prompt, *out], len(prompt), frozenset({17, 22}), None))
    tokens = torch.tensor([0 if t is None else t for t in newest])
    want = adjust_logits(logits, params, whole)
    got = adjust_logits(logits, params, before, (tokens, late))
    torch.testing.assert_close(got, want)
    assert want[0, 17] != float("-inf") and want[3, 22] != float("-inf")  # min_tokens reached with it
    assert not torch.equal(adjust_logits(logits, params, before), want)  # NOTE: the token matters
    # only the rows that adjust are read: an unseen row that does not is left as it is
    torch.testing.assert_close(got[4], logits[4])


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest():
    """vLLM's bad_words over the output (not the prompt); allowed_token_ids leaves only its tokens,
    the bans above kept; a verify step's drafts and a newest token still on the device count as
    output. Each case against the row adjusted over the whole output."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    words = SamplingParams(bad_words=[[5], [1, 2], [3, 4, 6]])
    prompt = [3, 4, 1]  # ends with the start of two words: the prompt does not count

    def banned(p: SamplingParams, output: list[int]) -> list[int]:
        row = adjust_logits(logits, [p], [([*prompt, *output], len(prompt), frozenset(), None)])[0]
        return [t for t in range(8) if row[t] == float("-inf")]

    assert banned(words, []) == [5]
    assert banned(words, [0, 1]) == [2, 5]
    assert banned(words, [3, 4]) == [5, 6]
    assert banned(words, [4, 3, 4, 1]) == [2, 5]
    assert banned(words, [3, 5, 4]) == [5]
    both = SamplingParams(bad_words=[[1, 2]], allowed_token_ids=[2, 3, 7], logit_bias={3: 1.5})
    row = adjust_logits(logits, [both], [([*prompt, 0, 1], len(prompt), frozenset(), {})])[0]
    assert row.tolist() == [float("-inf")] * 3 + [5.5, *[float("-inf")] * 3, 8.0]  # 2 banned, 3 biased

    # drafts: row j of a verify step sees draft[:j] after the output
    draft = [3, 4, 1]
    rows = adjust_logits(logits.repeat(4, 1), [words] * 4, [([*prompt, 0], len(prompt), frozenset(), None)] * 4,
                         drafted=[draft[:j] for j in range(4)])  # fmt: skip
    for j in range(4):
        assert [t for t in range(8) if rows[j, t] == float("-inf")] == banned(words, [0, *draft[:j]]), j

    # the newest token on the device (--overlap-schedule): rows whose host output lacks it
    outputs = [[0, 3], [0, 0], [3, 4], [0, 3], [2]]
    newest = [4, 1, 9 % 8, 5, 3]
    before = [([*prompt, *o], len(prompt), frozenset(), None) for o in outputs]
    whole = [([*prompt, *o, t], len(prompt), frozenset(), None) for o, t in zip(outputs, newest, strict=True)]
    stack, ps = logits.repeat(5, 1), [words] * 5
    got = adjust_logits(stack, ps, before, (torch.tensor(newest), list(range(5))))
    torch.testing.assert_close(got, adjust_logits(stack, ps, whole))
    assert got[0, 6] == float("-inf") and got[1, 2] == float("-inf") and got[3, 6] != float("-inf")


@pytest.mark.parametrize(
    "field",
    [
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": (1, 2)},
        {"bad_words": [[]]},
        {"bad_words": [["a"]]},
        {"skip_special_tokens": "no"},
        {"frequency_penalty": 2.5},
        {"presence_penalty": "x"},
        {"repetition_penalty": 0},
        {"logit_bias": {1: 200.0}},
        {"logit_bias": {-1: 1.0}},
        {"min_tokens": 20, "max_tokens": 10},
        {"min_tokens": -1},
    ],
)
def test_bad_values_are_rejected(field):
    with pytest.raises(ValueError):
        SamplingParams(**field).validate()


@pytest.fixture(scope="module")
def tiny_url():
    with serve("tiny") as live:
        yield live.url


def test_logit_bias_and_min_tokens_steer_a_real_worker(tiny_url):
    url = tiny_url + "/v1/completions"
    body = {"prompt": "Bias me: ", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    forced = httpx.post(url, json={**body, "logit_bias": {str(ord("Q")): 100}}, timeout=60).json()
    assert forced["choices"][0]["text"] == "QQQQQ"
    # greedy's first token as a stop id: without min_tokens the answer ends at once, with it later
    first = httpx.post(url, json={**body, "max_tokens": 1, "logprobs": 0}, timeout=60).json()
    stop_id = ord(first["choices"][0]["logprobs"]["tokens"][0])
    assert stop_id < 128  # one ASCII byte: its text is the token
    ended = httpx.post(url, json={**body, "stop_token_ids": [stop_id]}, timeout=60).json()
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
    held = httpx.post(url, json={**body, "stop_token_ids": [stop_id], "min_tokens": 3}, timeout=60).json()
    choice = held["choices"][0]
    assert chr(stop_id) not in choice["text"][:3]
    if choice["finish_reason"] == "stop":  # the stop id came at the 4th token or later
        assert held["usage"]["completion_tokens"] >= 4
    else:
        assert held["usage"]["completion_tokens"] == 5 and choice["finish_reason"] == "length"


def test_bad_words_and_allowed_token_ids_steer_a_real_worker(tiny_url):
    """A piece of the greedy answer as a bad word: the answer no longer holds it (nor the same word
    after a space), and is the same up to it; allowed_token_ids: sampled answers use only those
    tokens."""
    url = tiny_url + "/v1/completions"
    body = {"prompt": "hello world", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    word = plain[2:5]
    assert len(word.encode()) == 3 and plain.count(word) >= 2  # greedy repeats itself here
    for words in ([word], [" " + word, "zzz"]):
        text = httpx.post(url, json={**body, "bad_words": words}, timeout=60).json()["choices"][0]["text"]
        assert word not in text and text[:2] == plain[:2], (words, text)
    allowed = [ord(c) for c in "ACGT"]
    for seed in range(3):
        sampled = {**body, "temperature": 1.0, "seed": seed, "allowed_token_ids": allowed}
        text = httpx.post(url, json=sampled, timeout=60).json()["choices"][0]["text"]
        assert len(text) == 40 and set(text) <= set("ACGT"), text


def test_penalties_change_a_repetitive_greedy_answer(tiny_url):
    url = tiny_url + "/v1/completions"
    body = {"prompt": "aaaaaaaaaaaaaaaa", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    penalised = httpx.post(url, json={**body, "frequency_penalty": 2.0}, timeout=60).json()["choices"][0][
        "text"
    ]
    most = Counter(plain).most_common(1)[0][1]
    assert most >= 4  # greedy repeats itself here...
    assert Counter(penalised).most_common(1)[0][1] < most  # ...and less with the penalty
    repeated = httpx.post(url, json={**body, "repetition_penalty": 3.0}, timeout=60).json()["choices"][0][
        "text"
    ]
    assert Counter(repeated).most_common(1)[0][1] < most


@pytest.mark.parametrize(
    "extra",
    [
        {"logit_bias": {"abc": 1}},
        {"logit_bias": {"99999": 1}},
        {"logit_bias": [1]},
        {"frequency_penalty": 3},
        {"allowed_token_ids": []},
        {"allowed_token_ids": [99999]},
        {"allowed_token_ids": [65], "guided_choice": ["A"]},
        {"bad_words": [" "]},
        {"bad_words": "abc"},
        {"top_k": False},  # read as 0 (no limit) while true and 1.0 were a 400
        {"top_k": 0.0},
    ],
)
def test_bad_adjustments_get_400_and_the_worker_keeps_serving(tiny_url, extra):
    url = tiny_url + "/v1/completions"
    resp = httpx.post(url, json={"prompt": "x", "max_tokens": 1, **extra}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["message"]
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 1}, timeout=60).status_code == 200


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adjustments_and_logprobs_agree_on_cuda_and_cpu():
    from worker.sampling import token_logprobs

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 1000, generator=gen)
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                       logit_bias={7: 5.0, 999: -3.0}, min_tokens=8, max_tokens=16, logprobs=5),
        SamplingParams(logprobs=0),
    ] * 3  # fmt: skip
    histories = [([*range(i, 40 + i), 3, 3, 9], 40, frozenset({3, 999}), None) for i in range(6)]
    cpu = adjust_logits(logits, params, histories)
    cuda = adjust_logits(logits.cuda(), params, histories).cpu()
    torch.testing.assert_close(cuda, cpu)
    tokens = cpu.argmax(-1)
    want = token_logprobs(logits, tokens, [p.logprobs for p in params])
    got = token_logprobs(logits.cuda(), tokens.cuda(), [p.logprobs for p in params])
    for (c1, i1, v1), (c2, i2, v2) in zip(want, got, strict=True):
        assert c1 == pytest.approx(c2, abs=1e-5) and i1 == i2 and v1 == pytest.approx(v2, abs=1e-5)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"allowed_token_ids": [97], "bad_words": ["a"]}, "bad_words bans every token"),
        ({"allowed_token_ids": [256], "min_tokens": 2}, "min_tokens bans every token"),  # 256: EOS
        ({"allowed_token_ids": [97], "stop_token_ids": [97], "min_tokens": 1}, "min_tokens bans every token"),
    ],
)
def test_constraints_that_leave_no_token_to_sample_are_a_400(tiny_url, extra, words):
    """Nothing left to sample would give token 0, which the request ruled out: refused instead."""
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0, **extra}
    refused = httpx.post(tiny_url + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and words in refused.json()["error"]["message"]
    ok = httpx.post(tiny_url + "/v1/completions", json={**body, "allowed_token_ids": [97, 98]}, timeout=60)
    assert ok.status_code == 200 and set(ok.json()["choices"][0]["text"]) <= {"a", "b"}


@pytest.mark.parametrize(
    "extra",
    [
        {"allowed_token_ids": [97], "bad_words": ["aa"]},  # after "a", "a" completes a bad word
        {"allowed_token_ids": [97, 98], "bad_words": ["aa", "ab", "ba", "bb"]},
        {"allowed_token_ids": [97, 256], "bad_words": ["aa"], "min_tokens": 2},  # 256: EOS, banned until 2
    ],
)
def test_bans_that_empty_a_row_midway_end_the_request_without_token_0(tiny_url, extra):
    """Rows emptied part way through (what the up-front check cannot see) sampled id 0, a NUL byte
    the request ruled out, answered 200: the request ends with an error, that token not output, also
    where the emptied row's token was the last max_tokens allowed."""
    body = {"prompt": "hi", "max_tokens": 6, "temperature": 0, "return_token_ids": True, **extra}
    for max_tokens in (6, 2):
        whole = httpx.post(tiny_url + "/v1/completions", json={**body, "max_tokens": max_tokens}, timeout=60)
        assert whole.status_code == 400 and "no token was left" in whole.json()["error"]["message"], (
            whole.text
        )
    with httpx.stream("POST", tiny_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "constraint_failed"
    sent = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert sent and 0 not in sent and set(sent) <= set(extra["allowed_token_ids"])


def test_an_extreme_repetition_penalty_samples_only_allowed_tokens(tiny_url):
    """A penalty of 1e-39 (or 1e39) made logits inf and rows NaN, which sampled id 0 past every ban."""
    for penalty, prompt, allowed in ((1e-39, "hihihi", [104, 105, 120]), (1e39, [1, 2, 1, 2], [1, 2])):
        for temperature in (0, 1e-7, 1.0):
            body = {"prompt": prompt, "max_tokens": 5, "temperature": temperature, "repetition_penalty": penalty,
                    "allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
            answer = httpx.post(tiny_url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert set(answer.json()["choices"][0]["token_ids"]) <= set(allowed), (penalty, temperature)


def test_a_draft_of_a_banned_token_is_not_kept_where_the_bans_emptied_a_row():
    """Speculative decoding: an emptied row's argmax is id 0, so a draft of 0 (the prompt repeats
    "B A \\x00") was kept and output before the request ended."""
    from tests.worker.test_server import serve as serve_tiny

    with serve_tiny(speculative_tokens=4, speculative_ngram_min=1, warmup_tokens=0) as live:
        prompt = [66, 65, 0, 66, 67, 68] * 4 + [66]
        body = {"prompt": prompt, "allowed_token_ids": [65], "bad_words": ["AA"], "temperature": 0,
                "return_token_ids": True, "max_tokens": 8}  # fmt: skip
        with httpx.stream(
            "POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "constraint_failed"
        assert [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []] == [65]
        for max_tokens in (3, 8):
            whole = httpx.post(
                live.url + "/v1/completions", json={**body, "max_tokens": max_tokens}, timeout=60
            )
            assert whole.status_code == 400 and "no token was left" in whole.json()["error"]["message"]
