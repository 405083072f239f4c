"""The attention kernels at the head dims and GQA ratios of served models beyond the
64 / 128 and 1 / 2 / 4 / 8 of the other kernel tests: head dim 96 (Phi-3: BLOCK_D 128, masked),
256 (Gemma 2 and 3), and query groups of 5 and 7 (Qwen2.5: 40 / 8 and 28 / 4 heads), whose padded
rows (BLOCK_H 16) hold 3 and 2 tokens' groups in the short extend. Against kernels.reference, on
poisoned outputs (RoPE and the store at these shapes: tests/kernels/test_fused.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels import test_decode_attention as decode_cases
from tests.kernels import test_extend_attention as extend_cases
from tests.kernels import test_extend_short as short_cases

SHAPES = [  # dtype, head dim, query heads, KV heads (scaled down from the models named)
    pytest.param(torch.bfloat16, 96, 4, 4, id="phi3-hd96-gqa1"),
    pytest.param(torch.float16, 256, 4, 2, id="gemma-hd256-gqa2"),
    pytest.param(torch.bfloat16, 128, 14, 2, id="qwen2.5-hd128-gqa7"),
    pytest.param(torch.float16, 64, 10, 2, id="hd64-gqa5"),
]


@pytest.mark.parametrize(("dtype", "head_dim", "hq", "hkv"), SHAPES)
@pytest.mark.parametrize("variant", ["merge_kernel", "fused_merge"])
def test_decode(backend, assert_close_rel, dtype, head_dim, hq, hkv, variant):
    dec = backend.module("decode_attention")
    lens = decode_cases.KV_LENS if not backend.is_cuda else [n * 97 for n in decode_cases.KV_LENS]
    args = decode_cases.make_batch(lens, hq, hkv, head_dim, dtype, backend.device, seed=head_dim)
    out = torch.full_like(args[0], float("nan"))
    cfg = decode_cases.config_of(dec, args, variant)
    dec.decode_attention(*args, num_splits=4, out=out, config=cfg)
    assert_close_rel(out.cpu(), decode_cases.reference_on_cpu(args))


@pytest.mark.parametrize(("dtype", "head_dim", "hq", "hkv"), SHAPES)
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_extend(backend, assert_close_rel, dtype, head_dim, hq, hkv, split):
    ext = backend.module("extend_attention")
    requests = (
        extend_cases.REQUESTS if not backend.is_cuda else [(p * 41, n * 13) for p, n in extend_cases.REQUESTS]
    )
    args = extend_cases.make_batch(requests, hq, hkv, head_dim, dtype, backend.device, seed=head_dim)
    cfg = ext.default_config(head_dim, dtype, ext.device_arch(backend.device))
    if split:  # parts of at most 16 prefix tokens in the interpreter: the 33-token prefix takes three
        cfg = dataclasses.replace(cfg, split_prefix=True, min_split_len=16 if not backend.is_cuda else 256)
    out = torch.full_like(args[0], float("nan"))
    max_prefix = max(p for p, _ in requests)
    ext.extend_attention(*args, config=cfg, max_prefix_len=max_prefix, num_splits=4 if split else 1, out=out)
    assert_close_rel(out.cpu(), extend_cases.reference_on_cpu(args))


@pytest.mark.parametrize(("dtype", "head_dim", "hq", "hkv"), SHAPES)
def test_extend_short(backend, assert_close_rel, dtype, head_dim, hq, hkv):
    short = backend.module("extend_short")
    prefix = short_cases.scaled(backend, short_cases.PREFIX)
    args = short_cases.make_batch(
        prefix, short_cases.NEW, hq, hkv, head_dim, dtype, backend.device, seed=head_dim
    )
    out = torch.full_like(args[0], float("nan"))
    short.extend_short_attention(*args, max_extend_len=max(short_cases.NEW), num_splits=3, out=out)
    assert_close_rel(out.cpu(), short_cases.want(args))
