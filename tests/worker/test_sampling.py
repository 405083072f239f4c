"""Sampling: greedy, seeds, top-k / top-p, temperature, and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from worker.sampling import SamplingParams, accept_draft, make_generator, sample


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def draw(probs: list[float], params: SamplingParams, n: int) -> list[int]:
    logits = logits_from_probs(probs)
    gen = make_generator(params, "cpu")
    return [int(sample(logits, [params], [gen])[0]) for _ in range(n)]


def test_temperature_zero_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_same_seed_same_tokens_and_different_seed_different_tokens():
    probs = [1 / 20] * 20
    a = draw(probs, SamplingParams(seed=7), 30)
    b = draw(probs, SamplingParams(seed=7), 30)
    c = draw(probs, SamplingParams(seed=8), 30)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # a stream, not one token repeated


def test_a_seeded_request_does_not_depend_on_its_batch_neighbours():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 100, generator=gen)
    seeded = SamplingParams(seed=42)
    alone = sample(logits[1:2], [seeded])
    batched = sample(logits, [SamplingParams(temperature=0.0), seeded, SamplingParams(seed=1)])
    assert int(batched[1]) == int(alone[0])
    assert int(batched[0]) == int(logits[0].argmax())


def test_unseeded_rows_draw_independently_and_leave_a_seeded_neighbour_alone():
    """Unseeded rows share one draw from the default generator: each still follows its own
    distribution, two equal rows do not move together, and a seeded row gives what it gives alone."""
    torch.manual_seed(0)
    a, b = [0.6, 0.3, 0.09, 0.01], [0.1, 0.2, 0.3, 0.4]
    uniform = [0.25] * 4
    logits = torch.cat([logits_from_probs(p) for p in (a, uniform, b, uniform, uniform)])
    params = [SamplingParams(), SamplingParams(seed=5), SamplingParams(), SamplingParams(), SamplingParams()]
    alone_gen, batch_gen = make_generator(params[1], "cpu"), make_generator(params[1], "cpu")
    draws = [sample(logits, params, [None, batch_gen, None, None, None]).tolist() for _ in range(3000)]
    for row, probs in ((0, a), (2, b), (3, uniform), (4, uniform)):
        tokens = [d[row] for d in draws]
        for token, p in enumerate(probs):
            assert abs(tokens.count(token) / len(tokens) - p) < 0.04, (row, token)
    alone = [int(sample(logits[1:2], params[1:2], [alone_gen])[0]) for _ in range(3000)]
    assert [d[1] for d in draws] == alone
    same = sum(d[3] == d[4] for d in draws) / len(
        draws
    )  # NOTE: two equal unseeded rows: 1/4 when independent
    assert 0.2 < same < 0.3


def test_sampling_follows_the_distribution():
    probs = [0.5, 0.3, 0.2]
    tokens = draw(probs, SamplingParams(seed=0), 3000)
    for token, p in enumerate(probs):
        assert abs(tokens.count(token) / len(tokens) - p) < 0.04


def test_low_temperature_sharpens():
    probs = [0.4, 0.35, 0.25]
    cold = draw(probs, SamplingParams(temperature=0.05, seed=0), 300)
    assert cold.count(0) / len(cold) > 0.9


def test_top_k_keeps_only_the_k_most_likely():
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    tokens = draw(probs, SamplingParams(temperature=2.0, top_k=3, seed=0), 400)
    assert set(tokens) == {1, 3, 4}
    assert set(draw(probs, SamplingParams(temperature=5.0, top_k=1, seed=0), 50)) == {1}


def test_top_p_keeps_the_nucleus():
    probs = [0.1, 0.4, 0.3, 0.2]
    # 0.4 + 0.3 reaches 0.6: tokens 1 and 2 stay, the rest go
    assert set(draw(probs, SamplingParams(top_p=0.6, seed=0), 400)) == {1, 2}
    assert set(draw(probs, SamplingParams(top_p=0.01, seed=0), 50)) == {1}


def test_min_p_drops_tokens_under_its_share_of_the_likeliest():
    probs = [0.05, 0.4, 0.3, 0.15, 0.1]
    # min_p 0.3: p >= 0.12 stays (tokens 1, 2, 3), in proportion
    tokens = draw(probs, SamplingParams(min_p=0.3, seed=0), 4000)
    assert set(tokens) == {1, 2, 3}
    assert tokens.count(1) / len(tokens) == pytest.approx(0.4 / 0.85, abs=0.03)
    assert set(draw(probs, SamplingParams(min_p=1.0, temperature=5.0, seed=0), 50)) == {1}
    assert set(draw(probs, SamplingParams(min_p=0.0, seed=0), 4000)) == {0, 1, 2, 3, 4}
    # after the temperature: at 2 the ratios are square roots (token 0: 0.35 of the likeliest)
    assert set(draw(probs, SamplingParams(min_p=0.3, temperature=2.0, seed=0), 4000)) == {0, 1, 2, 3, 4}
    # each row its own min_p, and the draft check masks as sampling does
    logits = logits_from_probs(probs).repeat(2, 1)
    params = [SamplingParams(min_p=1.0, seed=0), SamplingParams(seed=0)]
    gens = [make_generator(p, "cpu") for p in params]
    firsts = [sample(logits, params, gens).tolist() for _ in range(300)]
    assert {f[0] for f in firsts} == {1} and len({f[1] for f in firsts}) == 5
    assert accept_draft(logits, [2], params[0], make_generator(params[0], "cpu")) == [1]


def test_top_k_rows_take_their_candidates_from_topk_and_mask_as_a_full_sort_does():
    """When every row has a top_k, the candidates come from topk (not a sort of the vocabulary):
    the same tokens survive, with the same scores, as ranking the whole vocabulary would keep."""
    from worker.sampling import _mask_top_k_top_p

    scores = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 2  # continuous: no ties
    top_k, top_p = [1, 7, 40, 40, 3], [1.0, 0.5, 0.9, 1.0, 0.01]
    got = _mask_top_k_top_p(scores, top_k, top_p)
    for row, (k, p) in enumerate(zip(top_k, top_p, strict=True)):
        order = scores[row].argsort(descending=True)[:k]  # the row's top-k by a full sort
        probs = scores[row, order].softmax(0)
        mass_before = probs.cumsum(0) - probs
        kept = order[(mass_before < p) | (torch.arange(k) == 0)]
        want = torch.full_like(scores[row], float("-inf"))
        want[kept] = scores[row, kept]
        assert torch.equal(got[row], want), row


def test_a_row_keeps_the_same_tokens_whatever_its_batch_when_scores_tie_at_a_cut():
    """bf16 logits tie often. A row ranked by topk (every row has a top_k) and by a sort (a row
    without one beside it) orders tied scores differently, so a cut by rank kept other tokens and a
    seeded answer changed with its batch: every token tied at a cut stays, on either path."""
    from worker.sampling import _mask_top_k_top_p

    torch.manual_seed(0)
    tied = 0
    for _ in range(20):
        row = (torch.randn(256) * 2).to(torch.bfloat16).float()  # rounded: many equal scores
        for k, p in ((5, 1.0), (10, 1.0), (20, 1.0), (40, 0.9), (-1, 0.5), (-1, 0.9), (8, 0.7)):
            alone = _mask_top_k_top_p(row.unsqueeze(0), [k], [p])[0]
            for other_k, other_p in ((-1, 1.0), (100, 1.0), (3, 0.2), (-1, 0.3)):
                beside = _mask_top_k_top_p(torch.stack([row, row]), [k, other_k], [p, other_p])[0]
                assert torch.equal(alone.isfinite(), beside.isfinite()), (k, p, other_k, other_p)
                assert torch.equal(alone[alone.isfinite()], row[alone.isfinite()])
            kept = row[alone.isfinite()]
            cut = kept.min()
            assert torch.equal(alone.isfinite(), row >= cut)  # everything tied with the lowest kept stays
            if k != -1:
                assert int(alone.isfinite().sum()) >= min(k, 1)
                tied += int((row == cut).sum()) > 1 and int((row >= cut).sum()) > k
    assert tied  # some rows had ties across the k-th score


def test_top_p_one_keeps_every_token_beside_a_top_k_row():
    """A request without top-p (1.0) next to one with a top_k goes through the ranked path: it keeps
    its whole vocabulary, although float32 cumulative sums reach 1 before its last tokens."""
    from worker.sampling import _mask_top_k_top_p

    scores = torch.randn(2, 400, generator=torch.Generator().manual_seed(7)) * 3
    got = _mask_top_k_top_p(scores, [-1, 3], [1.0, 1.0])
    assert int(got[0].isfinite().sum()) == 400 and int(got[1].isfinite().sum()) == 3


def test_mixed_batch_applies_each_requests_own_filters():
    probs = [0.1, 0.4, 0.3, 0.2]
    logits = logits_from_probs(probs).repeat(2, 1)
    params = [SamplingParams(top_k=1, seed=0), SamplingParams(top_p=1.0, seed=0)]
    gens = [make_generator(p, "cpu") for p in params]
    seen = [set(), set()]
    for _ in range(200):
        out = sample(logits, params, gens)
        seen[0].add(int(out[0]))
        seen[1].add(int(out[1]))
    assert seen[0] == {1}
    assert seen[1] == {0, 1, 2, 3}


def test_logits_and_params_must_line_up():
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(2, 5), [SamplingParams()])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("temperature", "hot", "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("min_p", -0.1, "min_p"),
        ("min_p", 1.5, "min_p"),
        ("min_p", float("nan"), "min_p"),
        ("min_p", True, "min_p"),
        ("top_k", 0, "top_k"),
        ("top_k", -2, "top_k"),
        ("top_k", 2.5, "top_k"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", True, "max_tokens"),
        ("seed", 2**70, "seed"),
        ("seed", "abc", "seed"),
        ("stop", [""], "stop"),
        ("stop", "END", "stop"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        ("ignore_eos", "yes", "ignore_eos"),
        ("temperature", True, "temperature"),
        pytest.param("temperature", 10**400, "temperature", id="temperature-int-beyond-float"),
        ("temperature", float("inf"), "temperature"),
        ("top_p", True, "top_p"),
        ("top_p", float("nan"), "top_p"),
        pytest.param(
            "repetition_penalty", 10**400, "repetition_penalty", id="repetition_penalty-int-beyond-float"
        ),
        ("repetition_penalty", float("inf"), "repetition_penalty"),
        ("frequency_penalty", True, "frequency_penalty"),
        ("presence_penalty", float("nan"), "presence_penalty"),
        ("logit_bias", {3: True}, "logit_bias"),
        pytest.param("logit_bias", {3: 10**400}, "logit_bias", id="logit_bias-int-beyond-float"),
        ("logit_bias", {True: 1.0}, "logit_bias"),
    ],
)
def test_validate_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate()


def test_stop_strings_stop_ids_and_bad_words_are_bounded():
    """Every output token of every choice is checked against each stop string and bad word on the
    engine thread: millions of them slowed every request of the worker a thousandfold."""
    from worker.sampling import MAX_BAD_WORDS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

    assert SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP).validate()
    for params, field in ((SamplingParams(stop=["s"] * (MAX_STOP + 1)), "stop takes at most"),
                          (SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop takes at most"),
                          (SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
                          (SamplingParams(bad_words=[[1]] * (2 * MAX_BAD_WORDS + 1)), "bad_words")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            params.validate()


def test_validate_accepts_sensible_values():
    params = SamplingParams(temperature=0.0, top_p=0.9, top_k=40, seed=-5, max_tokens=1, stop=["\n"],
                            stop_token_ids=[2], ignore_eos=True)  # fmt: skip
    assert params.validate() is params


def test_validate_makes_real_valued_fields_floats():
    params = SamplingParams(temperature=2**63, top_p=1, repetition_penalty=2, frequency_penalty=1,
                            presence_penalty=-2, logit_bias={3: 5}).validate()  # fmt: skip
    assert params.temperature == 2.0**63 and type(params.temperature) is float
    assert (params.top_p, params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (
        1.0, 2.0, 1.0, -2.0,
    )  # fmt: skip
    fields = (params.top_p, params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    assert all(type(v) is float for v in fields)
    assert params.logit_bias == {3: 5.0} and type(params.logit_bias[3]) is float


def test_an_integer_temperature_too_large_for_int64_does_not_fail_its_batch():
    """Integer temperatures (as JSON gives them) next to greedy rows: the batch samples."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=2**63, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1),
    ]
    out = sample(logits, params)
    assert out.shape == (3,) and int(out[1]) == int(logits[1].argmax())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e300, seed=0),  # float32 inf: -inf / inf is NaN
        SamplingParams(temperature=1e-300, seed=0),  # float32 0: x / 0 is inf or NaN
        SamplingParams(top_p=1e-300, seed=0),  # float32 0: every token outside the nucleus
    ],
)
def test_extreme_valid_values_never_sample_an_excluded_token(params):
    """A row with excluded tokens (-inf: a grammar, min_tokens) samples only allowed ones, the
    most likely of them where the temperature or top_p is tiny."""
    logits = torch.tensor([[float("-inf"), 0.5, 2.0, 1.0, float("-inf")]])
    tokens = draw_from(logits, params, 200)
    assert set(tokens) <= {1, 2, 3}
    if params.temperature < 1 or params.top_p < 1:
        assert set(tokens) == {2}
    draft = accept_draft(logits.repeat(2, 1), [0], params, make_generator(params, "cpu"))
    assert draft[-1] in {1, 2, 3} and draft[:-1] == []


def draw_from(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    gen = make_generator(params, "cpu")
    return [int(sample(logits, [params], [gen])[0]) for _ in range(n)]


def test_on_device_copies_the_callers_values():
    """A step's index lists are built from arrays the caller keeps reusing (the penalties' memo): the
    tensor must not see a later change."""
    import numpy as np

    from worker.sampling import on_device

    values = np.array([1, 2, 3])
    got = on_device(values, torch.device("cpu"), torch.int64)
    values[0] = 9
    assert got.tolist() == [1, 2, 3]


def test_seeds_apart_by_a_multiple_of_two_to_the_32_draw_differently_on_the_cpu():
    """The CPU generator keeps 32 bits of a seed: 7, 7 + 2**32 and 7 + 2**40 drew the same tokens.
    A seed below 2**32 seeds as it did (answers seeded so stay what they were)."""
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in (7, 7 + 2**32, 7 + 2**40, -(2**63))]
    draws = [tuple(torch.rand(8, generator=make_generator(p, "cpu")).tolist()) for p in params]
    assert len(set(draws)) == len(draws)
    assert draws[0] == tuple(torch.rand(8, generator=torch.Generator().manual_seed(7)).tolist())
