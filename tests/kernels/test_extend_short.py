"""Triton short-extend attention (few new tokens per request, their K/V in the pool) against
kernels.reference.extend_attention on paged, ragged GQA batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from tests.kernels.conftest import SERVED_SHAPES
from tests.support import each_value_once

CASES = [  # dtype, head dim, query heads, KV heads: GQA 1, 4 and 8 (at 32 rows 16, 8 and 4 tokens a program)
    (torch.float32, 64, 4, 4),
    (torch.float16, 128, 8, 2),
    (torch.bfloat16, 64, 8, 1),
    (torch.bfloat16, 128, 16, 4),
    *SERVED_SHAPES,
]
PREFIX = [0, 1, 37, 70, 16, 5, 1]  # cached tokens per request
NEW = [3, 1, 5, 9, 0, 2, 16]  # new tokens per request (one without: graph padding)


def make_batch(prefix, new, hq, hkv, d, dtype, device, seed=0):
    """Random q; every request's prefix and new K/V at shuffled pool slots. Slots no request
    references hold NaN, so a stray read fails."""
    g = torch.Generator().manual_seed(seed)
    used, t = sum(prefix) + sum(new), sum(new)
    pool = used + 23
    k_cache = torch.full((pool, hkv, d), float("nan"))
    v_cache = torch.full((pool, hkv, d), float("nan"))
    slots = torch.randperm(pool, generator=g)[:used]
    k_cache[slots] = torch.randn(used, hkv, d, generator=g)
    v_cache[slots] = torch.randn(used, hkv, d, generator=g)
    prefix_slots, out_slots = slots[: sum(prefix)], slots[sum(prefix) :]
    q = torch.randn(t, hq, d, generator=g)
    qo = torch.tensor([0, *new]).cumsum(0)
    kvp = torch.tensor([0, *prefix]).cumsum(0)
    to = dict(device=device, dtype=dtype)
    ix = dict(device=device, dtype=torch.int32)
    return (q.to(**to), k_cache.to(**to), v_cache.to(**to), qo.to(**ix), kvp.to(**ix), prefix_slots.to(**ix),
            out_slots.to(device=device, dtype=torch.int64))  # fmt: skip


def want(args, sm_scale=None):
    """The extend reference, the new tokens' K/V passed as tensors (not read from the pool)."""
    q, k_cache, v_cache, qo, kvp, kv_indices, out_slots = (a.cpu() for a in args)
    k_new, v_new = k_cache[out_slots], v_cache[out_slots]
    return reference.extend_attention(q, k_new, v_new, k_cache, v_cache, qo, kvp, kv_indices, sm_scale)


def scaled(backend, lens):
    return lens if not backend.is_cuda else [n * 53 for n in lens]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "hq", "hkv", "num_splits", "max_rows", "slots_ahead"),
    # NOTE: the default tier pairs the i-th shape with the i-th option: GQA 1 at 16 rows over 5 splits,
    # GQA 4 at 32 rows over 5 splits, GQA 8 at 64 rows in one, ...
    each_value_once(CASES, [(5, 16, False), (5, 32, False), (1, 64, False), (5, 32, True), (1, 16, True)]),
)
def test_extend_short_matches_the_extend_reference(
    backend, assert_close_rel, dtype, head_dim, hq, hkv, num_splits, max_rows, slots_ahead
):
    """The last request's 17 positions make two splits of 9 in the interpreter (16-token minimum):
    with GQA 1 its 16 new tokens are one block, and its first rows see nothing in the second split
    (they must weigh nothing in the merge). With GQA 4 at 16 rows a block takes 4 tokens, at 32 rows 8:
    its first block takes one split and its last two (the merge, 4 tokens a program, must count each
    block's own); at 64 rows one block takes them all. ``slots_ahead``: DecodeConfig.prefetch_slots, each
    tile's slots (the prefix's and the new tokens' alike: tiles cross from one to the other) loaded a tile
    ahead."""
    short = backend.module("extend_short")
    args = make_batch(scaled(backend, PREFIX), NEW, hq, hkv, head_dim, dtype, backend.device)
    config = dataclasses.replace(short.default_config(head_dim, dtype), prefetch_slots=slots_ahead)
    out = torch.full_like(args[0], float("nan"))  # poisoned: any row or head the kernels skip fails
    short.extend_short_attention(*args, max_extend_len=max(NEW), num_splits=num_splits, max_rows=max_rows,
                                 config=config, out=out)  # fmt: skip
    assert_close_rel(out.cpu(), want(args))


def test_a_program_takes_every_token_it_can_up_to_max_rows():
    """block_rows: a request's tokens times the group, as a power of two of at least 16 rows, capped at
    max_rows unless one token's group needs more; at 16 rows, one block per 16 // group tokens."""
    from kernels.extend_short import MAX_ROWS, block_rows, max_rows_for

    assert MAX_ROWS == max_rows_for(torch.bfloat16, 128) == max_rows_for(torch.float16, 64) == 32
    # at 32 rows fp32's tf32 dot spills at head dim 128 (sm_89, sm_90), and any dtype at head dim 256
    assert max_rows_for(torch.float32, 64) == max_rows_for(torch.bfloat16, 256) == 16
    assert block_rows(4, 5) == 32  # a verify step of 4 drafted tokens and one more: one block, not two
    assert block_rows(4, 3) == 16 and block_rows(1, 1) == 16  # tl.dot's least
    assert block_rows(8, 16) == 32 and block_rows(6, 16) == 32  # capped: 4 and 5 tokens a block
    assert block_rows(6, 5) == 32  # 30 rows: 5 tokens of 6 heads
    assert block_rows(8, 16, 64) == 64 and block_rows(4, 16, 64) == 64 and block_rows(4, 5, 64) == 32
    assert block_rows(64, 2) == 64 and block_rows(128, 2, 64) == 128  # one token's group, past the cap
    assert [block_rows(g, 16, 16) for g in (1, 4, 6, 8, 32)] == [16, 16, 16, 16, 32]


def test_a_larger_hint_and_the_default_splits_give_the_same_result(backend, assert_close_rel):
    """A CUDA graph passes its padded size as max_extend_len: the extra blocks of tokens do nothing."""
    short = backend.module("extend_short")
    args = make_batch(
        scaled(backend, [40, 3, 0]), [7, 16, 2], 8, 2, 64, torch.float16, backend.device, seed=3
    )
    got = short.extend_short_attention(*args, sm_scale=0.3, max_extend_len=64)
    assert_close_rel(got.cpu(), want(args, sm_scale=0.3))


def test_the_ops_entry_point_and_the_reference_agree(backend, assert_close_rel):
    from kernels import ops

    args = make_batch(scaled(backend, [9, 30]), [4, 2], 8, 2, 64, torch.float32, backend.device, seed=5)
    got = ops.extend_short_attention(*args, max_extend_len=4)
    assert_close_rel(got.cpu(), reference.extend_short_attention(*(a.cpu() for a in args)))


def test_bad_inputs_raise_value_errors(backend):
    short = backend.module("extend_short")
    q, k_cache, v_cache, qo, kvp, kv_indices, out_slots = make_batch([4, 2], [2, 3], 8, 2, 64, torch.float16,
                                                                     backend.device)  # fmt: skip
    with pytest.raises(ValueError, match="max_extend_len"):
        short.extend_short_attention(q, k_cache, v_cache, qo, kvp, kv_indices, out_slots, max_extend_len=0)
    if qo.device.type == "cpu":  # NOTE: checked where it costs nothing (a sync on CUDA), as extend's
        with pytest.raises(ValueError, match="max_extend_len=2 < 3"):
            short.extend_short_attention(
                q, k_cache, v_cache, qo, kvp, kv_indices, out_slots, max_extend_len=2
            )
    for max_rows in (8, 48):
        with pytest.raises(ValueError, match="max_rows"):
            short.extend_short_attention(q, k_cache, v_cache, qo, kvp, kv_indices, out_slots, max_extend_len=3,
                                         max_rows=max_rows)  # fmt: skip
    with pytest.raises(ValueError, match="out_slots"):
        short.extend_short_attention(
            q, k_cache, v_cache, qo, kvp, kv_indices, out_slots[:-1], max_extend_len=3
        )
    with pytest.raises(ValueError, match="kv_indptr"):
        short.extend_short_attention(
            q, k_cache, v_cache, qo, kvp[:-1], kv_indices, out_slots, max_extend_len=3
        )
