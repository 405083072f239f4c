"""Sliding-window attention (the query at position p sees positions p - window + 1 .. p) and soft-capped
scores (Gemma 2): the reference against the plain definition, and the extend and decode kernels (split,
packed, fused merge, prefetch, slots ahead) against the reference, with windows shorter than a tile, spanning several,
and longer than every request."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from tests.kernels import test_decode_attention as decode_cases
from tests.kernels import test_extend_attention as extend_cases
from tests.support import each_value_once

# (prefix, new) tokens per request: no prefix, a window inside the new tokens, a prefix mostly outside it,
# one new token past a long prefix, no new tokens, several query blocks across the window's edge
REQUESTS = [(0, 40), (5, 3), (100, 9), (161, 1), (7, 0), (47, 40), (30, 70)]
WINDOWS = [1, 7, 33, 400]  # one key (itself), under a tile, over two tiles, longer than every request


def by_definition(q, k, v, n_prefix, window):
    """Query j (position n_prefix + j) against every key one at a time, float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // k.shape[1]
    for j in range(q.shape[0]):
        pos = n_prefix + j
        keys = range(max(0, pos - window + 1), pos + 1)
        for h in range(q.shape[1]):
            kh = k[list(keys), h // group].float()
            weights = (kh @ q[j, h].float() * q.shape[-1] ** -0.5).softmax(0)
            out[j, h] = weights @ v[list(keys), h // group].float()
    return out


def test_the_reference_windows_extend_and_decode_by_definition():
    args = extend_cases.make_batch([(6, 5), (0, 9)], 4, 2, 16, torch.float32, "cpu", seed=3)
    q, k_new, v_new, k_cache, v_cache, _, _, slots = args
    got = reference.extend_attention(*args, window=4)
    s0 = slots[:6].long()
    want = by_definition(
        q[:5], torch.cat([k_cache[s0], k_new[:5]]), torch.cat([v_cache[s0], v_new[:5]]), 6, 4
    )
    torch.testing.assert_close(got[:5], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        got[5:], by_definition(q[5:], k_new[5:], v_new[5:], 0, 4), rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(got, reference.extend_attention(*args))  # the window changed something
    dq, dk, dv, dkvp, dslots = decode_cases.make_batch([9, 2], 4, 2, 16, torch.float32, "cpu", seed=4)
    got = reference.decode_attention(dq, dk, dv, dkvp, dslots, window=3)
    last = dslots[:9].long()
    want = by_definition(dq[:1], dk[last], dv[last], 8, 3)
    torch.testing.assert_close(got[:1], want, rtol=1e-5, atol=1e-5)
    whole = reference.decode_attention(dq, dk, dv, dkvp, dslots)
    torch.testing.assert_close(reference.decode_attention(dq, dk, dv, dkvp, dslots, window=400), whole)


@pytest.mark.parametrize(("window", "num_splits", "packed"), each_value_once(WINDOWS, [1, 4], [False, True]))
def test_extend_windows_match_the_reference(backend, assert_close_rel, window, num_splits, packed):
    ext = backend.module("extend_attention")
    dtype = torch.float16 if backend.is_cuda else torch.float32
    args = extend_cases.make_batch(REQUESTS, 8, 2, 64, dtype, backend.device, seed=window)
    cfg = dataclasses.replace(ext.default_config(64, dtype), packed_blocks=packed)
    out = torch.full_like(args[0], float("nan"))  # poisoned: any row the kernel skips fails
    ext.extend_attention(*args, out=out, config=cfg, num_splits=num_splits, window=window)
    assert_close_rel(out.cpu(), reference.extend_attention(*(a.cpu() for a in args), window=window))


@pytest.mark.parametrize(
    ("window", "num_splits", "variant"), each_value_once(WINDOWS, [1, 4], decode_cases.VARIANTS)
)
def test_decode_windows_match_the_reference(backend, assert_close_rel, window, num_splits, variant):
    dec = backend.module("decode_attention")
    dtype = torch.float16 if backend.is_cuda else torch.float32
    args = decode_cases.make_batch([1, 2, 17, 50, 130, 33], 8, 2, 64, dtype, backend.device, seed=window)
    cfg = decode_cases.config_of(dec, args, variant)
    out = torch.full_like(args[0], float("nan"))
    dec.decode_attention(*args, out=out, config=cfg, num_splits=num_splits, window=window)
    assert_close_rel(out.cpu(), reference.decode_attention(*(a.cpu() for a in args), window=window))


def test_the_reference_soft_caps_scores_by_definition():
    """softcap * tanh(s / softcap) on every score before the softmax (Gemma 2): a cap far above the scores
    changes nothing, a low one changes the output."""
    args = extend_cases.make_batch([(6, 5)], 4, 2, 16, torch.float32, "cpu", seed=5)
    q, k_new, v_new, k_cache, v_cache, _, _, slots = args
    k = torch.cat([k_cache[slots.long()], k_new]).float().repeat_interleave(2, dim=1)
    v = torch.cat([v_cache[slots.long()], v_new]).float().repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * 16**-0.5
    capped = torch.tanh(scores / 0.5) * 0.5
    mask = torch.arange(11)[None, :] <= 6 + torch.arange(5)[:, None]
    want = torch.einsum("hqk,khd->qhd", capped.masked_fill(~mask, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(reference.extend_attention(*args, softcap=0.5), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        reference.extend_attention(*args, softcap=1e4), reference.extend_attention(*args)
    )
    assert not torch.allclose(want, reference.extend_attention(*args), atol=1e-3)


@pytest.mark.parametrize(("window", "num_splits"), each_value_once([0, 33], [1, 4]))
def test_extend_soft_caps_match_the_reference(backend, assert_close_rel, window, num_splits):
    ext = backend.module("extend_attention")
    dtype = torch.float16 if backend.is_cuda else torch.float32
    args = extend_cases.make_batch(REQUESTS, 8, 2, 64, dtype, backend.device, seed=11 + window)
    args = (args[0] * 4, *args[1:])  # NOTE: scores of order 10, so a cap of 5 bites
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, out=out, num_splits=num_splits, window=window, softcap=5.0)
    want = reference.extend_attention(*(a.cpu() for a in args), window=window, softcap=5.0)
    assert_close_rel(out.cpu(), want)
    assert not torch.allclose(
        want, reference.extend_attention(*(a.cpu() for a in args), window=window), atol=1e-2
    )


@pytest.mark.parametrize("variant", decode_cases.VARIANTS)
def test_decode_soft_caps_match_the_reference(backend, assert_close_rel, variant):
    dec = backend.module("decode_attention")
    dtype = torch.float16 if backend.is_cuda else torch.float32
    args = decode_cases.make_batch([1, 2, 17, 50, 130, 33], 8, 2, 64, dtype, backend.device, seed=12)
    args = (args[0] * 4, *args[1:])
    out = torch.full_like(args[0], float("nan"))
    dec.decode_attention(
        *args, out=out, config=decode_cases.config_of(dec, args, variant), num_splits=4, softcap=5.0
    )
    assert_close_rel(out.cpu(), reference.decode_attention(*(a.cpu() for a in args), softcap=5.0))
