"""Attention sinks (gpt-oss): each head's softmax counts one more score, its sink, that attends nothing.
The reference against the plain definition, and every extend and decode path (unsplit, prefix-split,
packed, short extend, decode's merge kernel, fused merge, prefetch and slots ahead) against the reference, with sinks
far below, near and far above the scores."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from tests.kernels import test_decode_attention as decode_cases
from tests.kernels import test_extend_attention as extend_cases
from tests.kernels.test_sliding_window import REQUESTS
from tests.support import each_value_once

# per query head: no weight to the sink, about as much as a key, most of it, all but nothing
SINKS = [-30.0, 0.0, 2.5, 40.0, -1.0, 1.0, 5.0, -5.0]


def sinks_on(device: torch.device | str) -> torch.Tensor:
    return torch.tensor(SINKS, dtype=torch.float32, device=device)


def test_the_reference_adds_each_heads_sink_to_its_softmax_by_definition():
    args = extend_cases.make_batch([(6, 5)], 8, 2, 16, torch.float32, "cpu", seed=21)
    q, k_new, v_new, k_cache, v_cache, _, _, slots = args
    k = torch.cat([k_cache[slots.long()], k_new]).float().repeat_interleave(4, dim=1)
    v = torch.cat([v_cache[slots.long()], v_new]).float().repeat_interleave(4, dim=1)
    want = torch.empty(5, 8, 16)
    for j in range(5):  # query j sees keys 0 .. 6 + j
        for h in range(8):
            scores = k[: 7 + j, h] @ q[j, h].float() * 16**-0.5
            weights = torch.cat([scores, torch.tensor([SINKS[h]])]).softmax(0)[:-1]
            want[j, h] = weights @ v[: 7 + j, h]
    got = reference.extend_attention(*args, sinks=sinks_on("cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain = reference.extend_attention(*args)
    assert got[:, 0].allclose(plain[:, 0], atol=1e-6)  # a sink of -30 takes no weight
    assert got[:, 3].abs().max() < 1e-6  # a sink of 40 takes all of it
    assert not got[:, 2].allclose(plain[:, 2], atol=1e-2)
    dq, dk, dv, dkvp, dslots = decode_cases.make_batch([9, 2], 8, 2, 16, torch.float32, "cpu", seed=22)
    decoded = reference.decode_attention(dq, dk, dv, dkvp, dslots, sinks=sinks_on("cpu"))
    qo = torch.tensor([0, 1, 2], dtype=torch.int32)
    kv = torch.tensor([0, 8, 9], dtype=torch.int32)  # each request's slots but its last, then the last as new
    last = torch.cat([dslots[8:9], dslots[10:11]]).long()
    prefix = torch.cat([dslots[:8], dslots[9:10]])
    as_extend = reference.extend_attention(
        dq, dk[last], dv[last], dk, dv, qo, kv, prefix, sinks=sinks_on("cpu")
    )
    torch.testing.assert_close(decoded, as_extend, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("window", "num_splits", "packed"), each_value_once([0, 33], [1, 4], [False, True]))
def test_extend_sinks_match_the_reference(backend, assert_close_rel, window, num_splits, packed):
    ext = backend.module("extend_attention")
    dtype = torch.float16 if backend.is_cuda else torch.float32
    args = extend_cases.make_batch(REQUESTS, 8, 2, 64, dtype, backend.device, seed=31 + window)
    cfg = dataclasses.replace(ext.default_config(64, dtype), packed_blocks=packed)
    out = torch.full_like(args[0], float("nan"))  # poisoned: any row the kernel skips fails
    sinks = sinks_on(backend.device)
    ext.extend_attention(*args, out=out, config=cfg, num_splits=num_splits, window=window, sinks=sinks)
    cpu = [a.cpu() for a in args]
    assert_close_rel(out.cpu(), reference.extend_attention(*cpu, window=window, sinks=sinks.cpu()))


def test_short_extend_sinks_match_the_reference(backend, assert_close_rel):
    short = backend.module("extend_short")
    dtype = torch.float16 if backend.is_cuda else torch.float32
    requests = [(0, 3), (40, 1), (17, 5), (130, 2)]
    q, k_new, v_new, k_cache, v_cache, qo, kv, prefix = extend_cases.make_batch(
        requests, 8, 2, 64, dtype, backend.device, seed=41
    )
    # NOTE: the short extend reads the new tokens' K/V from the pool: store them in unused slots
    free = sorted(set(range(k_cache.shape[0])) - set(prefix.tolist()))[: q.shape[0]]
    out_slots = torch.tensor(free, dtype=torch.int32, device=backend.device)
    k_cache[out_slots.long()], v_cache[out_slots.long()] = k_new, v_new
    out = torch.full_like(q, float("nan"))
    sinks = sinks_on(backend.device)
    short.extend_short_attention(q, k_cache, v_cache, qo, kv, prefix, out_slots, max_extend_len=5, out=out,
                                 num_splits=4, sinks=sinks)  # fmt: skip
    want = reference.extend_attention(
        *(a.cpu() for a in (q, k_new, v_new, k_cache, v_cache, qo, kv, prefix)), sinks=sinks.cpu()
    )
    assert_close_rel(out.cpu(), want)


@pytest.mark.parametrize(("window", "variant"), each_value_once([0, 33], decode_cases.VARIANTS))
def test_decode_sinks_match_the_reference(backend, assert_close_rel, window, variant):
    dec = backend.module("decode_attention")
    dtype = torch.float16 if backend.is_cuda else torch.float32
    args = decode_cases.make_batch([1, 2, 17, 50, 130, 33], 8, 2, 64, dtype, backend.device, seed=51)
    cfg = decode_cases.config_of(dec, args, variant)
    out = torch.full_like(args[0], float("nan"))
    sinks = sinks_on(backend.device)
    dec.decode_attention(*args, out=out, config=cfg, num_splits=4, window=window, sinks=sinks)
    want = reference.decode_attention(*(a.cpu() for a in args), window=window, sinks=sinks.cpu())
    assert_close_rel(out.cpu(), want)


@pytest.mark.parametrize(
    "sinks",
    [torch.zeros(4), torch.zeros(8, dtype=torch.float16), torch.zeros(8, 1)],
    ids=["heads", "dtype", "shape"],
)
def test_sinks_of_the_wrong_shape_or_dtype_are_refused(backend, sinks):
    args = decode_cases.make_batch([3], 8, 2, 64, torch.float32, backend.device, seed=1)
    with pytest.raises(ValueError, match="sinks must be float32"):
        backend.module("decode_attention").decode_attention(*args, sinks=sinks.to(backend.device))
