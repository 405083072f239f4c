"""Triton top-p threshold (a bisection over float bit patterns, no sort) against its definition and
against kernels.reference.top_p_threshold (a sort)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference


def distributions(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from peaked to flat (scaled random logits), a row with underflowed zeros, and one with a
    single token holding almost all the mass."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 12.0, rows).unsqueeze(1)
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[-1, min(3, vocab - 1)] = 60.0
    return logits.softmax(dim=-1)


@pytest.mark.parametrize("vocab", [1, 300, 1000])
def test_threshold_keeps_the_nucleus_as_defined(backend, vocab):
    """The tokens >= t hold at least top_p (up to fp32 rounding of the sums), and without the least
    likely of them less than top_p: the smallest set of most likely tokens that reaches top_p. (At
    top_p 1.0 the sums stay under 1 in fp32 and t is 0: every token.)"""
    kernels = backend.module("sampling")
    probs = distributions(9, vocab, seed=vocab)
    top_p = torch.tensor([0.9, 0.5, 0.01, 0.999, 1.0, 0.3, 0.75, 0.95, 0.6])
    t = kernels.top_p_threshold(probs.to(backend.device), top_p.to(backend.device)).cpu()
    for row in range(probs.shape[0]):
        kept = probs[row][probs[row] >= t[row]]
        assert kept.numel() >= 1 and kept.sum() >= top_p[row] - 1e-5, row
        assert kept.sum() - kept.min() < top_p[row] + 1e-5, row


def no_rounding_case(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> bool:
    """Whether no row's top-k distribution reaches its top_p below 1 within fp32 rounding at some token
    (where a sort's cumulative sum and the kernel's sums may keep different tokens)."""
    for row, (k, p) in enumerate(zip(top_k, top_p, strict=True)):
        if p >= 1.0:
            continue
        ranked = scores[row].sort(descending=True).values[: None if k == -1 else k]
        if (ranked.softmax(0).double().cumsum(0) - p).abs().min() <= 1e-5:
            return False
    return True


def test_threshold_agrees_with_the_sorted_reference(backend):
    """The same threshold as the sort, but where the row's mass reaches top_p within fp32 rounding
    of a token (the two sum in different orders; none of these rows is such a case)."""
    kernels = backend.module("sampling")
    probs = distributions(6, 500, seed=1)
    top_p = torch.tensor([0.9, 0.5, 0.2, 0.8, 0.95, 0.4])
    got = kernels.top_p_threshold(probs.to(backend.device), top_p.to(backend.device)).cpu()
    want = reference.top_p_threshold(probs, top_p)
    assert no_rounding_case(probs.log(), [-1] * 6, top_p.tolist())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_inputs_raise_value_errors(backend):
    kernels = backend.module("sampling")
    probs = torch.rand(2, 10, device=backend.device)
    with pytest.raises(ValueError, match="probs"):
        kernels.top_p_threshold(probs.half(), torch.ones(2, device=backend.device))
    with pytest.raises(ValueError, match="top_p"):
        kernels.top_p_threshold(probs, torch.ones(3, device=backend.device))


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [([-1] * 4, [0.9, 0.5, 0.2, 0.7]), ([-1, 5, 40, -1], [0.9, 1.0, 0.8, 0.5]), ([-1, 3, -1, 60], [1.0] * 4)],
    ids=["top-p", "top-k beside top-p", "top-k beside neither"],
)
def test_the_worker_masks_without_a_sort_as_a_sort_would(backend, monkeypatch, top_k, top_p):
    """worker.sampling on the kernels, for a batch (of more than SORT_MAX_ROWS rows) with a row without
    top_k, cuts the top-k rows below their k-th score and takes the threshold kernel for top-p: the
    tokens it keeps, and their scores, are the sorted path's."""
    from kernels import ops
    from worker import sampling

    if backend.interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # NOTE: so the worker picks the kernels on the CPU
    scores = (torch.randn(4, 400, generator=torch.Generator().manual_seed(7)) * 3).to(backend.device)
    assert no_rounding_case(scores.cpu(), top_k, top_p)
    calls = []
    kernel = ops.top_p_threshold
    monkeypatch.setattr(ops, "top_p_threshold", lambda *args: (calls.append(1), kernel(*args))[1])
    monkeypatch.setattr(sampling, "SORT_MAX_ROWS", 3)  # these 4 rows are "many"
    got = sampling._mask_top_k_top_p(scores, top_k, top_p).cpu()
    assert calls == ([1] if any(x < 1.0 for x in top_p) else [])
    monkeypatch.setattr(sampling, "kernel_ops", lambda device: reference)  # the sorted path
    want = sampling._mask_top_k_top_p(scores, top_k, top_p).cpu()
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.equal(got[got.isfinite()], want[want.isfinite()])
    assert 1 < int(got.isfinite().sum()) < got.numel()  # some tokens kept, some dropped


def test_tied_scores_at_a_cut_keep_the_same_tokens_with_and_without_a_sort(backend, monkeypatch):
    """Scores tied at a top-k or top-p cut (bf16 logits): the threshold kernel's path keeps them all,
    and so does the sorted path, so a row keeps the same tokens in a batch of any size."""
    from worker import sampling

    if backend.interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    scores = torch.full((4, 64), -10.0)
    scores[:, 0] = 3.0
    scores[:, 1:4] = 2.0  # three tokens tied below the top one
    top_k, top_p = [2, -1, 3, -1], [1.0, 0.6, 1.0, 1.0]
    monkeypatch.setattr(sampling, "SORT_MAX_ROWS", 3)  # these 4 rows are "many": the kernel's path
    many = sampling._mask_top_k_top_p(scores.to(backend.device), top_k, top_p).cpu()
    alone = [
        sampling._mask_top_k_top_p(scores[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])[0] for i in range(3)
    ]
    for i in range(3):
        assert torch.equal(many[i].isfinite(), alone[i].isfinite()), i
        assert many[i].isfinite().nonzero()[:, 0].tolist() == [0, 1, 2, 3]  # the ties at the cut stay
    assert many[3].isfinite().all()


def test_a_top_p_of_one_keeps_every_token_beside_a_top_p_row_without_a_sort(backend, monkeypatch):
    """On the threshold kernel's path too, a row without top-p (1.0) keeps its whole vocabulary when
    another row has one, although a float32 sum of its mass reaches 1 before its last tokens."""
    from worker import sampling

    if backend.interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # NOTE: so the worker picks the kernels on the CPU
    scores = torch.randn(4, 400, generator=torch.Generator().manual_seed(7)) * 3
    scores[:, 0] = 30.0  # one token holds nearly all the mass: the tail is below float32's resolution
    monkeypatch.setattr(sampling, "SORT_MAX_ROWS", 3)  # these 4 rows are "many"
    got = sampling._mask_top_k_top_p(scores.to(backend.device), [-1] * 4, [1.0, 0.5, 1.0, 0.9]).cpu()
    assert got[[0, 2]].isfinite().all()
    assert int(got[1].isfinite().sum()) == int(got[3].isfinite().sum()) == 1


def test_the_worker_sorts_up_to_sort_max_rows_rows(backend, monkeypatch):
    """Up to SORT_MAX_ROWS rows the worker sorts the vocabulary even on the kernels (the sort is faster
    there); one row more takes the threshold kernel; both keep the same tokens."""
    from kernels import ops
    from worker import sampling

    if backend.interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = sampling.SORT_MAX_ROWS
    scores = (torch.randn(rows + 1, 300, generator=torch.Generator().manual_seed(3)) * 3).to(backend.device)
    calls = []
    kernel = ops.top_p_threshold
    monkeypatch.setattr(ops, "top_p_threshold", lambda *args: (calls.append(len(args[0])), kernel(*args))[1])
    few = sampling._mask_top_k_top_p(scores[:rows], [-1] * rows, [0.8] * rows).cpu()
    assert calls == []
    many = sampling._mask_top_k_top_p(scores, [-1] * (rows + 1), [0.8] * (rows + 1)).cpu()
    assert calls == [rows + 1]
    assert torch.equal(few.isfinite(), many[:rows].isfinite())
    assert 1 < int(few.isfinite().sum()) < few.numel()
