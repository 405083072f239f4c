"""Triton extend attention vs kernels.reference.extend_attention on ragged, paged, GQA batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from tests.kernels.conftest import SERVED_SHAPES, strided
from tests.support import SLOW

# (dtype, head_dim, Hq, Hkv): GQA ratios 1 / 4 / 8 spread over both head dims and all three dtypes, then the
# served models' other shapes (conftest.SERVED_SHAPES).
CASES = [
    (torch.float32, 64, 2, 2),
    (torch.float32, 128, 8, 2),
    (torch.float16, 64, 8, 1),
    (torch.float16, 128, 4, 4),
    (torch.bfloat16, 128, 8, 1),
    (torch.bfloat16, 64, 4, 1),
    *SERVED_SHAPES,
]
# (prefix, new) tokens per request: empty prefix, one new token, no new tokens, tile-crossing lengths.
REQUESTS = [(0, 19), (1, 1), (7, 0), (33, 17), (16, 32)]


def make_batch(requests, hq, hkv, d, dtype, device, seed=0, index_dtype=torch.int32):
    """Random inputs; pool slots not referenced by any request hold NaN, so a stray read fails."""
    g = torch.Generator().manual_seed(seed)
    total_prefix = sum(p for p, _ in requests)
    pool = total_prefix + 23
    k_cache = torch.full((pool, hkv, d), float("nan"))
    v_cache = torch.full((pool, hkv, d), float("nan"))
    slots = torch.randperm(pool, generator=g)[:total_prefix]
    k_cache[slots] = torch.randn(total_prefix, hkv, d, generator=g)
    v_cache[slots] = torch.randn(total_prefix, hkv, d, generator=g)
    t = sum(n for _, n in requests)
    q, k_new, v_new = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    qo = torch.tensor([0] + [n for _, n in requests]).cumsum(0)
    kvp = torch.tensor([0] + [p for p, _ in requests]).cumsum(0)
    to = dict(device=device, dtype=dtype)
    ix = dict(device=device, dtype=index_dtype)
    return (q.to(**to), k_new.to(**to), v_new.to(**to), k_cache.to(**to), v_cache.to(**to),
            qo.to(**ix), kvp.to(**ix), slots.to(**ix))  # fmt: skip


def reference_on_cpu(args, sm_scale=None):
    return reference.extend_attention(*(a.cpu() for a in args), sm_scale=sm_scale)


@pytest.mark.parametrize(("dtype", "head_dim", "hq", "hkv"), CASES)
def test_extend_matches_reference_on_ragged_paged_batch(backend, assert_close_rel, dtype, head_dim, hq, hkv):
    ext = backend.module("extend_attention")
    requests = REQUESTS if not backend.is_cuda else [(p * 9, n * 9) for p, n in REQUESTS]
    args = make_batch(requests, hq, hkv, head_dim, dtype, backend.device)
    out = torch.full_like(args[0], float("nan"))  # poisoned: any row the kernel skips fails
    ext.extend_attention(*args, out=out)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


@pytest.mark.parametrize(("block_m", "block_n"), [(32, 16), (16, 32), (64, 32), (32, 64), (128, 64)])
def test_extend_is_exact_for_any_tile_shape(backend, assert_close_rel, block_m, block_n):
    """Unmasked whole tiles (prefix and left of the diagonal) and masked edge tiles meet correctly
    whether query blocks are larger or smaller than key tiles (the shapes kernels.tune tries). On CUDA in
    fp16, as tuned: in fp32 the 128x64 tiles spill 9 KB a thread on sm_90 and take ~30 s to compile."""
    ext = backend.module("extend_attention")
    cfg = ext.ExtendConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)
    # prefixes: none, under one tile, exactly tiles, tiles + a tail; new: 1 up to three query blocks
    requests = [(0, 1), (5, 70), (64, 33), (96, 64), (100, 129)]
    dtype = torch.float16 if backend.is_cuda else torch.float32
    args = make_batch(requests, 4, 2, 64, dtype, backend.device, seed=block_m + block_n)
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, out=out, config=cfg)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


# (prefix, new) tokens per request for the prefix splits: no prefix (one split), a prefix under one part,
# prefixes of many parts with a partial last tile, no new tokens, one new token, several query blocks
SPLIT_REQUESTS = [(0, 19), (5, 3), (100, 9), (7, 0), (47, 40), (161, 1), (64, 33)]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "hq", "hkv", "num_splits"),
    [
        (torch.float32, 64, 4, 2, 2),
        (torch.bfloat16, 128, 8, 1, 3),
        (torch.float16, 64, 4, 4, 16),
        *(pytest.param(*shape, 4, marks=() if shape[1] in (96, 256) else SLOW) for shape in SERVED_SHAPES),
    ],
)
def test_prefix_splits_match_the_reference(backend, assert_close_rel, dtype, head_dim, hq, hkv, num_splits):
    """Each request's prefix split over up to ``num_splits`` programs (each part's partial output and
    log2-sum-exp, the last part with the new tokens), merged: the same answer as one program per block."""
    ext = backend.module("extend_attention")
    requests = SPLIT_REQUESTS if not backend.is_cuda else [(p * 9, n * 9) for p, n in SPLIT_REQUESTS]
    args = make_batch(requests, hq, hkv, head_dim, dtype, backend.device, seed=num_splits)
    out = torch.full_like(args[0], float("nan"))  # poisoned: a row the merge skips fails
    ext.extend_attention(*args, out=out, num_splits=num_splits)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


def test_prefix_parts_past_the_end_of_a_prefix_weigh_nothing(backend, assert_close_rel):
    """Tile-aligned parts can end before the last split: 100 prefix tokens in 7 splits (16-token parts
    at least) of 32-token tiles are parts of 32, 32, 32, 4 and then two empty ones before the last,
    which attends the new tokens alone; the empty ones write lse -inf and a zero partial."""
    ext = backend.module("extend_attention")
    cfg = ext.ExtendConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, min_split_len=16)
    args = make_batch([(100, 21), (30, 5), (0, 3)], 4, 2, 64, torch.float32, backend.device, seed=11)
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, out=out, config=cfg, num_splits=7)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "split"])
def test_packed_blocks_cover_every_query_block_of_a_ragged_batch(backend, assert_close_rel, num_splits):
    """ExtendConfig.packed_blocks: one program per query block that exists, found on the device (a
    prefix sum over qo_indptr), instead of requests x the longest request's blocks. Empty requests at
    the start, middle and end, requests of one block plus one row (the packed grid's bound is then
    exact), and padding rows past the last request (as an extend graph has), which stay unwritten."""
    ext = backend.module("extend_attention")
    scale = 1 if not backend.is_cuda else 4
    requests = [(9, 0), (0, 17), (33, 17), (7, 0), (20, 17), (5, 1), (0, 0)]
    requests = [(p * scale, n * scale) for p, n in requests]
    args = list(make_batch(requests, 4, 2, 64, torch.float32, backend.device, seed=21))
    t = args[0].shape[0]
    for i in range(3):  # 5 padding rows owned by no request
        args[i] = torch.cat([args[i], torch.randn(5, *args[i].shape[1:], device=backend.device)])
    cfg = dataclasses.replace(ext.default_config(64, torch.float32), packed_blocks=True)
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, out=out, config=cfg, num_splits=num_splits, max_extend_len=17 * scale)
    ref = reference.extend_attention(*(a.cpu() for a in [x[:t] for x in args[:3]] + args[3:]))
    assert_close_rel(out[:t].cpu(), ref)
    assert out[t:].isnan().all()  # the padding rows are nobody's


def test_a_packed_grid_has_a_slot_for_every_block_and_no_more_rows_than_requests():
    from kernels.split_merge import packed_blocks

    assert packed_blocks(51, 3, 17, 16) == 6  # three requests of 17 rows: 2 blocks each, exactly
    assert packed_blocks(256, 32, 256, 64) == 35  # a 256-token graph of 32 request rows: 4 + 31
    assert packed_blocks(256, 1, 256, 64) == 4
    assert packed_blocks(40, 4, 10, 16) == 4  # never more than a row of blocks per request
    assert packed_blocks(0, 4, 0, 16) == 1


def test_the_prefix_split_cap_fills_the_sms_with_parts_the_prefix_fills():
    from kernels import extend_attention as ext

    cpu = torch.device("cpu")  # 4 "SMs" off CUDA: SPLIT_WAVES x 4 = 8 programs wanted
    split = ext.ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, split_prefix=True)
    assert ext.prefix_split_cap(None, 64, 1, cpu, split) == 8  # one program: 8 splits
    assert ext.prefix_split_cap(None, 65, 2, cpu, split) == 2  # 2 heads x 2 query blocks
    assert ext.prefix_split_cap(None, 64, 8, cpu, split) == 1  # enough programs already
    assert ext.prefix_split_cap(None, 64, 1, cpu, split, max_prefix_len=700) == 3  # 256-token parts
    assert ext.prefix_split_cap(None, 64, 1, cpu, split, max_prefix_len=0) == 1
    unsplit = ext.ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    assert ext.prefix_split_cap(None, 64, 1, cpu, unsplit) == 1  # off unless the config splits
    assert ext.prefix_split_cap(5, 64, 64, cpu, unsplit) == 5  # a given cap is taken as it is
    assert ext.prefix_split_cap(1000, 64, 1, cpu, split) == ext.MAX_PREFIX_SPLITS
    assert ext.prefix_split_cap(0, 64, 1, cpu, split) == 1
    assert not ext.default_config(128, torch.bfloat16, 90).split_prefix  # off until a GPU run says it pays


def test_extend_graphs_take_the_configurations_that_differ_and_replay_them_by_prefix(monkeypatch):
    """graph_configs: the long-prefix tiles where they differ from an unknown prefix's, the prefix split
    where it adds programs; graph_variant: the split from max(SPLIT_GRAPH_MIN_PREFIX, per token x the
    graph's tokens) (fewer per token against the default tiles), else the long-prefix tiles from
    GRAPH_LONG_TILES_MIN_PREFIX, else the default."""
    from kernels import extend_attention as ext

    monkeypatch.setattr(ext, "INTERPRETED", False)  # the compiled choice (the interpreter takes tiny tiles)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16  # 4 "SMs" off CUDA: SPLIT_WAVES x 4 = 8 programs
    configs = ext.graph_configs(32, 1, 128, bf16, cpu)
    assert configs == {"long_prefix": ext.LONG_PREFIX_TILES,
                       "split": dataclasses.replace(ext.SM90_TILES, split_prefix=True)}  # fmt: skip
    assert set(ext.graph_configs(32, 64, 128, bf16, cpu)) == {"long_prefix"}  # enough programs already
    assert set(ext.graph_configs(32, 1, 128, torch.float32, cpu)) == {"split"}  # one fp32 tile choice
    both, split_only = ("long_prefix", "split"), ("split",)
    least, long_tiles = ext.SPLIT_GRAPH_MIN_PREFIX, ext.GRAPH_LONG_TILES_MIN_PREFIX
    assert [ext.graph_variant(p, 32, both) for p in (0, long_tiles - 1, long_tiles, least - 1, least)] == [
        "default", "default", "long_prefix", "long_prefix", "split"]  # fmt: skip
    per_token = ext.SPLIT_GRAPH_PREFIX_PER_TOKEN * 256  # larger graphs: a longer prefix
    assert per_token > least and ext.graph_variant(per_token, 256, both) == "split"
    assert ext.graph_variant(per_token - 1, 256, both) == "long_prefix"
    fewer = ext.SPLIT_GRAPH_PREFIX_PER_TOKEN_DEFAULT_TILES * 256
    assert least < fewer < per_token and ext.graph_variant(fewer, 256, split_only) == "split"
    assert ext.graph_variant(fewer - 1, 256, split_only) == ext.graph_variant(10**6, 256, ()) == "default"


def test_the_long_prefix_rule_needs_a_long_prefix_and_few_new_tokens(monkeypatch):
    """Long-prefix tiles on sm_90 (head dims 65-128, fp16/bf16) for a long prefix and few new tokens in
    all (twice as many over a deep prefix), measured on an H100: tests/kernels/test_sweep.py."""
    from kernels import extend_attention as ext

    monkeypatch.setattr(ext, "INTERPRETED", False)  # the compiled choice (the interpreter takes tiny tiles)
    bf16, long, few, deep = torch.bfloat16, ext.LONG_PREFIX, ext.FEW_NEW_TOKENS, ext.DEEP_PREFIX
    tiles = {"small": ext.ExtendConfig(64, 32, 4, 2), "long_prefix": ext.ExtendConfig(128, 64, 8, 3)}

    def tiles_of(*args):  # NOTE: over a deep prefix an eager call also splits (the next test)
        return dataclasses.replace(ext.default_config(*args), split_prefix=False)

    assert ext.default_config(128, bf16, 90) == tiles["small"]
    assert ext.default_config(128, bf16, 90, long, few) == tiles["long_prefix"]
    assert tiles_of(128, torch.float16, 90, deep, 2 * few) == tiles["long_prefix"]
    for prefix, new in [(long - 1, 1), (long, few + 1), (deep - 1, 2 * few), (deep, 2 * few + 1), (long, None),
                        (None, 1)]:  # fmt: skip
        assert tiles_of(128, bf16, 90, prefix, new) == tiles["small"], (prefix, new)
    for head_dim, dtype, arch in [(128, bf16, 80), (128, bf16, 89), (64, bf16, 90), (128, torch.float32, 90)]:
        assert ext.default_config(head_dim, dtype, arch, long, 1) == ext.default_config(head_dim, dtype, arch)


def test_sm90_defaults_split_eager_calls_over_a_deep_prefix_and_widen_fp8_pools_in_128x128_tiles(monkeypatch):
    """sm_90, head dim 128, a 16-bit q: an eager call (its longest prefix known) over EAGER_SPLIT_MIN_PREFIX
    cached tokens or more takes the prefix split, whatever its tiles, over a 16-bit pool; an fp8 pool takes
    FP8_PREFIX_TILES wherever the batch may have a prefix (unknown included) and no split; other head
    dims, dtypes and architectures keep what they took."""
    from kernels import extend_attention as ext

    monkeypatch.setattr(ext, "INTERPRETED", False)  # the compiled choice (the interpreter takes tiny tiles)
    bf16, e4m3, deep = torch.bfloat16, torch.float8_e4m3fn, ext.EAGER_SPLIT_MIN_PREFIX
    assert deep == ext.DEEP_PREFIX
    for new, tiles in ((256, ext.LONG_PREFIX_TILES), (4096, ext.SM90_TILES)):
        assert ext.default_config(128, bf16, 90, deep - 1, new) == tiles
        assert ext.default_config(128, bf16, 90, deep, new) == dataclasses.replace(tiles, split_prefix=True)
    assert not ext.default_config(128, bf16, 90, None, 256).split_prefix  # a graph's unknown prefix
    for head_dim, dtype, arch in [(128, bf16, 89), (64, bf16, 90), (256, bf16, 90), (128, torch.float32, 90)]:
        assert not ext.default_config(head_dim, dtype, arch, deep, 256).split_prefix, (head_dim, dtype, arch)
    for prefix in (None, 1, 1024, deep):
        assert ext.default_config(128, bf16, 90, prefix, 256, e4m3) == ext.FP8_PREFIX_TILES, prefix
        assert (
            ext.default_config(128, torch.float16, 90, prefix, 256, torch.float8_e5m2) == ext.FP8_PREFIX_TILES
        )
    assert ext.default_config(128, bf16, 90, 0, 256, e4m3) == ext.default_config(128, bf16, 90, 0, 256)
    assert ext.default_config(96, bf16, 90, 1024, 256, e4m3) == ext.LONG_PREFIX_TILES  # 128x128 spills there
    assert ext.default_config(128, bf16, 89, 1024, 256, e4m3) == ext.FP8_PRE_HOPPER_TILES
    assert ext.default_config(128, torch.float32, 90, 1024, 256, e4m3) != ext.FP8_PREFIX_TILES


def test_extend_passes_its_prefix_hint_to_the_tile_choice(backend, assert_close_rel, monkeypatch):
    """The hint, the new tokens in all (q's rows) and the pool's dtype reach default_config, and the kernel
    with the tiles it picks (the long-prefix ones when compiled for sm_90; the interpreter's small ones
    here) still matches the reference."""
    ext = backend.module("extend_attention")
    seen, choose = [], ext.default_config
    monkeypatch.setattr(ext, "default_config", lambda *a: seen.append(a[3:]) or choose(*a))
    args = make_batch([(40, 9), (3, 30)], 8, 2, 128, torch.bfloat16, backend.device)
    ref = reference_on_cpu(args)
    for hint in (ext.LONG_PREFIX, None):
        out = torch.full_like(args[0], float("nan"))
        ext.extend_attention(*args, max_prefix_len=hint, out=out)
        assert_close_rel(out.cpu(), ref)
    assert seen == [(ext.LONG_PREFIX, 39, torch.bfloat16), (None, 39, torch.bfloat16)]  # 9 + 30 new tokens


def test_extend_honours_sm_scale_int64_indices_and_computes_its_own_grid(backend, assert_close_rel):
    ext = backend.module("extend_attention")
    args = make_batch([(5, 3), (20, 18)], 4, 2, 64, torch.float16, backend.device, index_dtype=torch.int64)
    out = ext.extend_attention(*args, sm_scale=0.3)  # max_extend_len read from qo_indptr
    assert_close_rel(out.cpu(), reference_on_cpu(args, sm_scale=0.3))


def test_extend_prefix_changes_the_output(backend):
    """Guards against a kernel that ignores the cached prefix (the reference would catch it too,
    but this states the behaviour: a request's answer depends on its cached context)."""
    ext = backend.module("extend_attention")
    with_prefix = make_batch([(24, 8)], 2, 2, 64, torch.float32, backend.device)
    no_prefix = list(with_prefix)
    no_prefix[6] = torch.zeros_like(with_prefix[6])  # kv_indptr all zero: empty prefix
    a = ext.extend_attention(*with_prefix)
    b = ext.extend_attention(*no_prefix)
    assert not torch.allclose(a, b, atol=1e-3)
    assert torch.allclose(b.cpu(), reference_on_cpu(no_prefix), atol=1e-5)


def test_extend_with_no_new_tokens_returns_empty(backend):
    ext = backend.module("extend_attention")
    args = make_batch([(4, 0), (9, 0)], 2, 1, 64, torch.float32, backend.device)
    assert ext.extend_attention(*args).shape == (0, 2, 64)


@pytest.mark.parametrize("index", [5, 6, 7], ids=["qo_indptr", "kv_indptr", "kv_indices"])
def test_extend_reads_strided_index_tensors_by_value(backend, assert_close_rel, index):
    ext = backend.module("extend_attention")
    args = make_batch([(20, 5), (33, 17)], 4, 2, 64, torch.float32, backend.device, seed=5)
    args = list(args)
    args[index] = strided(args[index])
    assert not args[index].is_contiguous()
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, out=out, max_extend_len=17)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


def _mismatched(name):
    """make_batch's arguments with one made inconsistent, and the error message it must raise."""
    q, k_new, v_new, k_cache, v_cache, qo, kvp, idx = make_batch(
        [(20, 5), (3, 7)], 4, 2, 64, torch.float16, "cpu"
    )
    kw = {}
    if name == "pool_hkv":  # k_new has 2 KV heads, the pool 1
        k_cache, v_cache, match = k_cache[:, :1], v_cache[:, :1], "k_new has shape"
    elif name == "v_pool_hkv":
        v_cache, match = v_cache[:, :1], "v_cache has shape"
    elif name == "head_dim":  # q and k_new 64, the pool 32
        k_cache, v_cache, match = k_cache[..., :32], v_cache[..., :32], "k_cache has shape"
    elif name == "short_k_new":  # 10 rows of k_new for 12 queries: the kernel would read past its end
        k_new, match = k_new[:-2], "k_new has shape"
    elif name == "short_v_new":
        v_new, match = v_new[:-2], "v_new has shape"
    elif name == "small_out":  # the kernel would write past its end
        kw["out"], match = torch.empty(3, 4, 64, dtype=torch.float16), "out has shape"
    elif name == "out_dtype":
        kw["out"], match = torch.empty(12, 4, 64), "out is torch.float32"
    elif name == "fp16_q_bf16_pool":
        k_cache, v_cache, match = k_cache.bfloat16(), v_cache.bfloat16(), "share one dtype"
    elif name == "bf16_q_fp32_pool":  # runs interpreted, a CompilationError on sm_90
        q, k_new, v_new = q.bfloat16(), k_new.bfloat16(), v_new.bfloat16()
        k_cache, v_cache, match = k_cache.float(), v_cache.float(), "share one dtype"
    elif name == "fp32_v_new":
        v_new, match = v_new.float(), "share one dtype"
    elif name == "q_2d":
        q, match = q.reshape(12, 256), "q must be 3-D"
    elif name == "kv_indptr_length":
        kvp, match = kvp[:-1], "kv_indptr must have 3 entries"
    elif name == "float_indices":
        idx, match = idx.float(), "kv_indices must be int32 or int64"
    return (q, k_new, v_new, k_cache, v_cache, qo, kvp, idx), kw, match


@pytest.mark.parametrize(
    "name",
    ["pool_hkv", "v_pool_hkv", "head_dim", "short_k_new", "short_v_new", "small_out", "out_dtype",
     "fp16_q_bf16_pool", "bf16_q_fp32_pool", "fp32_v_new", "q_2d", "kv_indptr_length", "float_indices"],
)  # fmt: skip
def test_extend_rejects_inconsistent_arguments_before_launch(backend, name):
    ext = backend.module("extend_attention")
    args, kw, match = _mismatched(name)
    args = [a.to(backend.device) for a in args]
    kw = {k: v.to(backend.device) for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        ext.extend_attention(*args, max_extend_len=7, **kw)


def test_extend_rejects_a_max_extend_len_below_the_longest_request_on_cpu(backend, assert_close_rel):
    """A short hint would leave the last rows of the longest request unwritten. The check needs
    qo_indptr's values, so it runs only where reading them is free (CPU tensors; on CUDA it is the
    caller's contract, see the module docstring)."""
    if backend.is_cuda:
        pytest.skip("on CUDA the hint is a documented caller contract (checking it would sync)")
    ext = backend.module("extend_attention")
    args = make_batch([(20, 5), (33, 17)], 4, 2, 64, torch.float32, backend.device, seed=6)
    with pytest.raises(ValueError, match="max_extend_len=16 < 17"):
        ext.extend_attention(*args, max_extend_len=16)
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, max_extend_len=17, out=out)  # exactly the longest is enough
    assert_close_rel(out.cpu(), reference_on_cpu(args))
