"""Triton LoRA deltas (kernels.lora) vs kernels.reference.lora_add: segments of any length (empty ones
too), base segments, several adapters and one adapter in several segments, split-K, ranks that are not
powers of two; rows no adapter covers must come back bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def lora_case(
    lengths: list[int], slots: list[int], k: int, n: int, rank: int, dtype: torch.dtype, extra_rows: int = 0
) -> tuple[torch.Tensor, ...]:
    """x [T, k], out [T, n], a [4, rank, k], b [4, n, rank] (4 slots, scaled as real adapters are:
    the delta is a few percent of out), seg_indptr, seg_slots; ``extra_rows`` rows after the last segment."""
    g = torch.Generator().manual_seed(sum(lengths) + k + rank)
    t = sum(lengths) + extra_rows
    x = torch.randn(t, k, generator=g).to(dtype)
    out = torch.randn(t, n, generator=g).to(dtype)
    a = (torch.randn(4, rank, k, generator=g) / k**0.5).to(dtype)
    b = (torch.randn(4, n, rank, generator=g) / rank**0.5).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, out, a, b, indptr, torch.tensor(slots, dtype=torch.int32)


def per_segment(x, out, a, b, indptr, slots, max_rows=None):
    """The definition, one segment at a time."""
    out = out.clone()
    for i, s in enumerate(slots.tolist()):
        lo, hi = int(indptr[i]), int(indptr[i + 1])
        hi = hi if max_rows is None else min(hi, lo + max_rows)
        if s >= 0 and hi > lo:
            y = (x[lo:hi].float() @ a[s].float().t()).to(x.dtype).float()
            out[lo:hi] = (out[lo:hi].float() + y @ b[s].float().t()).to(out.dtype)
    return out


def test_the_reference_adds_each_segments_adapter_delta_to_its_rows():
    x, out, a, b, indptr, slots = lora_case([3, 0, 5, 2, 4], [1, 2, -1, 1, 3], 24, 20, 6, torch.float32, 3)
    want = per_segment(x, out, a, b, indptr, slots)
    got = reference.lora_add(x, out.clone(), a, b, indptr, slots)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3:8], out[3:8]) and torch.equal(got[14:], out[14:])  # base rows, uncovered rows
    assert not torch.allclose(got[:3], out[:3])
    capped = reference.lora_add(x, out.clone(), a, b, indptr, slots, max_rows=2)
    torch.testing.assert_close(capped, per_segment(x, out, a, b, indptr, slots, max_rows=2))


CASES = {
    # lengths, slots, K, N, rank: extend-like segments (one adapter twice, an empty and a base segment),
    # split K (1100 = 3 splits), N past one column block, rank 12 padded to 16
    "extend": ([20, 0, 7, 33, 5], [2, 1, -1, 2, 0], 1100, 200, 12),
    # decode: one row per request, a rank of 40 (padded to 64), K under one split
    "decode": ([1] * 9, [0, -1, 3, 3, 1, -1, -1, 2, 0], 96, 130, 40),
}


# the expand's variants: the default; its partials SPLIT_STEP splits a load (LoraConfig.batched_partials);
# the same over many splits (the extend case only: 64 columns a split, its K of 1100 in 18, three steps of 8)
VARIANTS = {"default": {}, "batched": {"batched_partials": True},
            "batched-many-splits": {"batched_partials": True, "k_per_split": 64}}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("case", "variant"), [(c, v) for c in CASES for v in VARIANTS
                                               if v != "batched-many-splits" or c == "extend"])  # fmt: skip
def test_lora_add_matches_reference(backend, assert_close_rel, monkeypatch, dtype, case, variant):
    lora = backend.module("lora")
    config = dataclasses.replace(lora.default_config(dtype), **VARIANTS[variant])
    # NOTE: the split-K partials start as NaN, so a partial the shrink does not write poisons its rows
    monkeypatch.setattr(
        lora, "_partials", lambda *shape, device: torch.full(shape, float("nan"), device=device)
    )
    lengths, slots, k, n, rank = CASES[case]
    x, out, a, b, indptr, seg_slots = lora_case(lengths, slots, k, n, rank, dtype, extra_rows=2)
    want = reference.lora_add(x, out.clone(), a, b, indptr, seg_slots)
    dev = [t.to(backend.device) for t in (x, out.clone(), a, b, indptr, seg_slots)]
    got = lora.lora_add(*dev, max(lengths), config=config).cpu()
    if variant == "batched-many-splits":
        assert lora.split_k(k, len(lengths) * 3, 64)[0] > 2 * lora.SPLIT_STEP  # NOTE: steps past the first
    rows = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths))
    adapted = torch.nonzero(rows >= 0).squeeze(1)
    untouched = torch.ones(len(out), dtype=torch.bool)
    untouched[adapted] = False
    assert torch.equal(got[untouched], out[untouched])  # the base's rows and the rows past the segments
    # NOTE: the deltas alone, so an error in them is not hidden by out's larger values
    delta, want_delta = ((t[adapted].float() - out[adapted].float()).to(dtype) for t in (got, want))
    assert_close_rel(delta, want_delta)


def test_lora_add_with_no_adapter_rows_leaves_out_alone(backend):
    lora = backend.module("lora")
    x, out, a, b, indptr, slots = lora_case([4, 3], [-1, -1], 64, 32, 8, torch.float32)
    got = lora.lora_add(*(t.to(backend.device) for t in (x, out.clone(), a, b, indptr, slots)), 4)
    assert torch.equal(got.cpu(), out)


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda x, out, a, b: (x, out, a[:, :, :-1], b), "do not agree"),
     (lambda x, out, a, b: (x, out[:, :-1], a, b), "do not agree"),
     (lambda x, out, a, b: (x, out, a, b.to(torch.float16)), "must share"),
     (lambda x, out, a, b: (x[0], out, a, b), "expected")],
)  # fmt: skip
def test_lora_add_rejects_inputs_that_do_not_fit(backend, change, match):
    lora = backend.module("lora")
    x, out, a, b, indptr, slots = lora_case([2, 2], [0, 1], 32, 16, 4, torch.float32)
    x, out, a, b = change(*(t.to(backend.device) for t in (x, out, a, b)))
    with pytest.raises(ValueError, match=match):
        lora.lora_add(x, out, a, b, indptr.to(backend.device), slots.to(backend.device), 2)


def test_k_is_split_for_few_rows_only():
    from kernels.lora import BLOCK_K, split_k

    assert split_k(4096, 1) == (8, 512)  # batch 1 decode: 8 programs of 512 columns
    assert split_k(14336, 64) == (8, 1792)  # 64 decode rows: 512 programs
    assert split_k(4096, 128) == (4, 1024)  # a 2,048-token prefill: 128 row blocks
    assert split_k(14336, 4096) == (1, 14336)  # a long prefill: no split
    assert split_k(100, 1) == (1, 128) and split_k(1100, 15) == (3, 384)
    assert split_k(4096, 1, k_per_split=128) == (32, 128)  # a LoraConfig's shorter splits (kernels.tune)
    for k, programs in ((4096, 1), (14336, 64), (1100, 15), (96, 9)):
        splits, per = split_k(k, programs)
        assert per % BLOCK_K == 0 and (splits - 1) * per < k <= splits * per  # every column, no empty split


def test_lora_segments_join_neighbouring_requests_of_one_adapter_cut_every_cap_rows():
    import numpy as np

    def segments(slots, lengths, cap):
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        got = reference.lora_segments(slots, indptr, cap)
        return got[0].tolist(), got[1].tolist()

    # one row per request (a decode step): 40 on one adapter are three segments, padded to 40
    indptr, slots = segments([3] * 40, [1] * 40, 16)
    assert indptr == [0, 16, 32] + [40] * 38 and slots == [3, 3, 3] + [-1] * 37
    # runs of an adapter, of the base, an empty request inside a run and one alone
    assert segments([0, 0, 1, 1, -1, 0, 2], [3, 2, 0, 4, 3, 1, 0], 16) == (
        [0, 5, 9, 12, 13, 13, 13, 13], [0, 1, -1, 0, 2, -1, -1],
    )  # fmt: skip
    assert segments([0, 1, 0, 1], [1, 1, 1, 1], 16) == ([0, 1, 2, 3, 4], [0, 1, 0, 1])  # no neighbours
    assert segments([2, 2, 2], [10, 10, 10], 10) == ([0, 10, 20, 30], [2, 2, 2])  # full requests stay
    assert segments([2, 2, 2], [3, 10, 4], 10) == ([0, 10, 17, 17], [2, 2, -1])  # cut inside a request
    assert segments([], [], 16) == ([0], [])
    with pytest.raises(ValueError, match="below a request's rows"):
        segments([0, 1], [3, 20], 16)
    with pytest.raises(ValueError, match="entries"):
        reference.lora_segments([0, 1], [0, 1], 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_on_joined_segments_gives_each_requests_deltas(backend, assert_close_rel, dtype):
    """A decode step of 45 rows (a run of 37 on one adapter, the base, another adapter) and a prefill
    of short requests, as the worker passes them: the same deltas as one segment per request."""
    lora = backend.module("lora")
    for lengths, slots in (
        ([1] * 45, [2] * 37 + [-1, -1, 0, 0, 0, 1, 1, 2]),
        ([5, 9, 2, 7, 1], [1, 1, 1, -1, 1]),
    ):
        x, out, a, b, indptr, seg_slots = lora_case(lengths, slots, 200, 70, 8, dtype)
        want = reference.lora_add(x, out.clone(), a, b, indptr, seg_slots)
        cap = max(max(lengths), reference.LORA_BLOCK_ROWS)
        joined = [
            torch.from_numpy(t).to(torch.int32) for t in reference.lora_segments(slots, indptr.numpy(), cap)
        ]
        assert int((joined[1] >= 0).sum()) < sum(s >= 0 for s in slots)  # fewer segments than requests
        same_rows = {s: r.tolist() for s, r in reference.lora_rows(indptr, seg_slots)}
        assert {s: r.tolist() for s, r in reference.lora_rows(*joined, cap)} == same_rows
        dev = [t.to(backend.device) for t in (x, out.clone(), a, b, *joined)]
        got = lora.lora_add(*dev, cap).cpu()
        assert_close_rel((got.float() - out.float()).to(dtype), (want.float() - out.float()).to(dtype))


def test_pdl_launches_replay_after_the_base_projection_in_one_graph(backend, assert_close_rel):
    """LoraConfig.pdl on CUDA: the base projection (a cuBLAS matmul into out), then the deltas with both
    kernels launched as programmatic dependents, captured in one CUDA graph and replayed over new x
    written in place. The shrink must wait for the matmul's x and the expand for the shrink's partials
    and the matmul's out; the expand reads its b before it waits."""
    if not backend.is_cuda:
        pytest.skip("the interpreter has no grid dependencies (pdl_active is False there)")
    import dataclasses

    lora = backend.module("lora")
    lengths, slots, k, n, rank = CASES["decode"]
    x, _, a, b, indptr, seg_slots = (t.to(backend.device) for t in lora_case(lengths, slots, k, n, rank,
                                                                             torch.float32))  # fmt: skip
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) / k**0.5).to(x)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    cfg = dataclasses.replace(lora.default_config(x.dtype), pdl=True)

    def step() -> None:
        torch.mm(x, w.t(), out=out)
        lora.lora_add(x, out, a, b, indptr, seg_slots, max(lengths), config=cfg)

    def check() -> None:  # NOTE: the deltas alone (out less the same matmul), so out's size hides nothing
        want = reference.lora_add(
            x.cpu(), torch.zeros(out.shape), a.cpu(), b.cpu(), indptr.cpu(), seg_slots.cpu()
        )
        assert_close_rel((out - torch.mm(x, w.t())).cpu(), want)

    step()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x))
    out.fill_(float("nan"))
    graph.replay()
    check()
