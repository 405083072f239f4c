"""The launches kernels.compile_check compiles: each kernel's host wrapper called on small CPU tensors of a
model's attention shape, with the default configuration or a kernels.tune candidate.

Sizes (tokens, slots) are tiny because nothing runs; what is compiled depends only on dtype, head counts,
head_dim, the configuration and 16-byte divisibility, which match a real launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kernels.bench import DTYPES

DECODE_SPLITS = 8  # a runtime argument of the split kernel; only the merge kernel's BLOCK_S follows it
Case = tuple[str, dict, Callable[[], Any]]


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int

    @property
    def label(self) -> str:
        return f"{self.dtype} hd{self.head_dim} gqa{self.q_heads // self.kv_heads}"


def fp8_pool(arch: int) -> torch.dtype:
    """The fp8 pool dtype the fp8 cases compile with: e4m3fn from sm_89 (Ada, Hopper) on, e5m2 before."""
    return torch.float8_e4m3fn if arch >= 89 else torch.float8_e5m2


def _tensors(
    shape: Shape, tokens: int = 32, slots: int = 64, pool: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    dt = DTYPES[shape.dtype]
    hq, hkv, d = shape.q_heads, shape.kv_heads, shape.head_dim
    pool = pool or dt
    return {
        "q": torch.zeros(tokens, hq, d, dtype=dt),
        "k": torch.zeros(tokens, hkv, d, dtype=dt),
        "v": torch.zeros(tokens, hkv, d, dtype=dt),
        "k_cache": torch.zeros(slots, hkv, d, dtype=pool),
        "v_cache": torch.zeros(slots, hkv, d, dtype=pool),
        "indptr": torch.zeros(tokens + 1, dtype=torch.int32),
        "indices": torch.zeros(slots, dtype=torch.int32),
        "positions": torch.zeros(tokens, dtype=torch.int64),
        "cos_sin": torch.zeros(slots, d, dtype=torch.float32),
        "x": torch.zeros(tokens, shape.hidden, dtype=dt),
        "w": torch.zeros(shape.hidden, dtype=dt),
        "sinks": torch.zeros(hq, dtype=torch.float32),
    }


# a checkpoint's KV scales over an fp8 pool (their values do not change what compiles)
KV_SCALES = (0.5, 2.0)


def decode_case(
    shape: Shape, config: Any, label: str, window: int = 0, softcap: float = 0.0, sinks: bool = False,
    pool: torch.dtype | None = None, scaled: bool = False,
) -> Case:  # fmt: skip
    from kernels.decode_attention import decode_attention

    t = _tensors(shape, pool=pool)

    def call() -> Any:
        return decode_attention(t["q"], t["k_cache"], t["v_cache"], t["indptr"], t["indices"],
                                num_splits=DECODE_SPLITS, config=config, window=window, softcap=softcap,
                                sinks=t["sinks"] if sinks else None,
                                kv_scales=KV_SCALES if scaled else None)  # fmt: skip

    return label, dataclasses.asdict(config), call


def extend_case(
    shape: Shape, config: Any, label: str, num_splits: int | None = None, window: int = 0, softcap: float = 0.0,
    sinks: bool = False, pool: torch.dtype | None = None, scaled: bool = False,
) -> Case:  # fmt: skip
    from kernels.extend_attention import extend_attention

    t = _tensors(shape, pool=pool)

    def call() -> Any:
        return extend_attention(t["q"], t["k"], t["v"], t["k_cache"], t["v_cache"], t["indptr"], t["indptr"],
                                t["indices"], max_extend_len=32, num_splits=num_splits, config=config,
                                window=window, softcap=softcap, sinks=t["sinks"] if sinks else None,
                                kv_scales=KV_SCALES if scaled else None)  # fmt: skip

    return label, dataclasses.asdict(config), call


def extend_short_case(
    shape: Shape, config: Any, label: str, pool: torch.dtype | None = None, scaled: bool = False,
    max_extend_len: int = 16, max_rows: int | None = None,
) -> Case:  # fmt: skip
    """A step of ``max_extend_len`` new tokens a request through the short extend (16 by default, the most the
    worker gives it: the most rows a program), ``max_rows`` its rows' cap (the default's when None)."""
    from kernels.extend_short import extend_short_attention

    t = _tensors(shape, pool=pool)

    def call() -> Any:
        return extend_short_attention(t["q"], t["k_cache"], t["v_cache"], t["indptr"], t["indptr"], t["indices"],
                                      t["positions"], max_extend_len=max_extend_len, num_splits=DECODE_SPLITS,
                                      config=config, kv_scales=KV_SCALES if scaled else None,
                                      max_rows=max_rows)  # fmt: skip

    return label, dataclasses.asdict(config), call


def defaults(shape: Shape, arch: int = 90) -> list[Case]:
    """Every kernel the worker launches, with its default configuration for ``shape`` on ``arch``."""
    from kernels import (
        decode_attention,
        extend_attention,
        extend_short,
        fp8_linear,
        fused,
        lora,
        moe,
        pointwise,
        sampling,
    )

    dt = DTYPES[shape.dtype]
    t = _tensors(shape)
    fp8 = _tensors(shape, pool=fp8_pool(arch))
    decode_default = decode_attention.default_config(shape.head_dim, dt, arch)
    # the tiles a decode graph of many requests takes (sm_90, head dim 128)
    decode_many = decode_attention.default_config(shape.head_dim, dt, arch, decode_attention.MANY_REQUESTS)
    extend_default = extend_attention.default_config(shape.head_dim, dt, arch)
    long_prefix = extend_attention.default_config(
        shape.head_dim, dt, arch, extend_attention.LONG_PREFIX, extend_attention.FEW_NEW_TOKENS
    )
    decode_fp8 = decode_attention.default_config(shape.head_dim, dt, arch, pool_dtype=fp8_pool(arch))
    decode_fp8_many = decode_attention.default_config(
        shape.head_dim, dt, arch, decode_attention.MANY_REQUESTS, fp8_pool(arch)
    )
    short_fp8 = extend_short.default_config(shape.head_dim, dt, arch, fp8_pool(arch))
    extend_fp8 = extend_attention.default_config(shape.head_dim, dt, arch, pool_dtype=fp8_pool(arch))
    long_prefix_fp8 = extend_attention.default_config(
        shape.head_dim,
        dt,
        arch,
        extend_attention.LONG_PREFIX,
        extend_attention.FEW_NEW_TOKENS,
        fp8_pool(arch),
    )
    qkv = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
    pdl = dataclasses.replace(decode_default, pdl=True)  # sm_90+
    lora_default = lora.default_config(dt, arch)  # sm_90, 16-bit: 256 columns, programmatic dependents

    def lora_case(rank: int, variant: str = "", **change: Any) -> Case:
        """q/k/v deltas of rank-``rank`` adapters (2 slots) on decode rows; ``change``: a candidate's
        LoraConfig fields, named ``variant``."""
        x, out = t["x"], torch.zeros(32, qkv, dtype=dt)
        a, b = torch.zeros(2, 3 * rank, shape.hidden, dtype=dt), torch.zeros(2, qkv, 3 * rank, dtype=dt)
        cfg = dataclasses.replace(lora_default, **change)
        return (f"lora_add{' ' * bool(variant)}{variant} {shape.dtype} h{shape.hidden} r{3 * rank}",
                dataclasses.asdict(cfg) if change else {},
                lambda: lora.lora_add(x, out, a, b, t["indptr"], t["indptr"][1:], 1, config=cfg))  # fmt: skip

    return [
        decode_case(shape, decode_default, f"decode {shape.label}"),
        *([decode_case(shape, decode_many, f"decode many-requests {shape.label}")] if decode_many != decode_default
          else []),
        decode_case(shape, dataclasses.replace(decode_default, fused_merge=True), f"decode fused-merge {shape.label}"),
        # the prefetch candidate as kernels.bench times it (16-bit only: at 4 warps fp32 needs twice the registers;
        # head dims up to 128, the bench's: two 64-token tiles of BLOCK_D 256 in registers spill KiBs)
        *([decode_case(shape, dataclasses.replace(decode_default, **decode_attention.PREFETCH_TILES),
                       f"decode prefetch {shape.label}")] if dt != torch.float32 and shape.head_dim <= 128
          else []),
        # the slots one tile ahead (DecodeConfig.prefetch_slots), as kernels.bench times it: the default's tiles,
        # and 64-token tiles of 3 stages (PIPELINED_TILES, 16-bit and head dims up to 128 as the bench's: two K/V
        # buffers of 256 dims outgrow sm_89's shared memory)
        decode_case(shape, dataclasses.replace(decode_default, prefetch_slots=True),
                    f"decode prefetch-slots {shape.label}"),
        *([decode_case(shape, dataclasses.replace(decode_default, **decode_attention.PIPELINED_TILES),
                       f"decode pipelined {shape.label}")] if dt != torch.float32 and shape.head_dim <= 128
          else []),
        extend_case(shape, extend_default, f"extend {shape.label}"),
        *([extend_case(shape, long_prefix, f"extend-long-prefix {shape.label}")] if long_prefix != extend_default
          else []),
        # the prefix split (ExtendConfig.split_prefix, off by default): the split kernel and its merge
        *[extend_case(shape, dataclasses.replace(cfg, split_prefix=True), f"{kind} {shape.label}",
                      num_splits=DECODE_SPLITS)
          for kind, cfg in (("extend-prefix-split", extend_default), ("extend-long-prefix-split", long_prefix))
          if kind == "extend-prefix-split" or cfg != extend_default],
        # the packed grid (ExtendConfig.packed_blocks, off by default) with the split, as an extend graph would take them
        extend_case(shape, dataclasses.replace(extend_default, split_prefix=True, packed_blocks=True),
                    f"extend-packed-split {shape.label}", num_splits=DECODE_SPLITS),
        extend_short_case(shape, decode_default, f"extend-short {shape.label}"),
        # its slots a tile ahead, as kernels.bench times it beside the default (16-bit, the bench's: float32's
        # spills 32 B at head dim 128 under Triton 3.6)
        *([extend_short_case(shape, dataclasses.replace(decode_default, prefetch_slots=True),
                             f"extend-short prefetch-slots {shape.label}")] if dt != torch.float32 else []),
        # 64 rows a program on 64-token tiles, as kernels.bench times it beside the short extend's default (sm_90,
        # 16-bit, head dims up to 128, the bench's; on mma.sync 64 rows spill): 16 tokens under GQA 4 in one block
        *([extend_short_case(shape, extend_short.wide_tiles(decode_default), f"extend-short wide {shape.label}",
                             max_rows=extend_short.WIDE_ROWS)]
          if arch >= 90 and dt != torch.float32 and shape.head_dim <= 128 else []),
        # sliding-window attention (Mistral, Phi-3, windowed Qwen2 layers): both kernels with the window's masks
        extend_case(shape, extend_default, f"extend-window {shape.label}", window=4096),
        decode_case(shape, decode_default, f"decode-window {shape.label}", window=4096),
        # Gemma 2's layers: soft-capped scores, the sliding ones windowed too
        extend_case(shape, extend_default, f"extend-softcap {shape.label}", window=4096, softcap=50.0),
        decode_case(shape, decode_default, f"decode-softcap {shape.label}", window=4096, softcap=50.0),
        # gpt-oss's layers: attention sinks in the unsplit extend's and every merge's normalization, windowed
        extend_case(shape, extend_default, f"extend-sinks {shape.label}", window=128, sinks=True),
        extend_case(shape, extend_default, f"extend-sinks split {shape.label}", num_splits=4, sinks=True),
        decode_case(shape, decode_default, f"decode-sinks {shape.label}", window=128, sinks=True),
        # an fp8 KV pool (--kv-cache-dtype): K/V widened as they load, the store's rounding and saturation
        *([decode_case(shape, decode_fp8, f"decode-fp8 {shape.label}", pool=fp8_pool(arch)),
           *([decode_case(shape, decode_fp8_many, f"decode-fp8 many-requests {shape.label}", pool=fp8_pool(arch))]
             if decode_fp8_many != decode_fp8 else []),
           extend_case(shape, extend_fp8, f"extend-fp8 {shape.label}", pool=fp8_pool(arch)),
           *([extend_case(shape, long_prefix_fp8, f"extend-fp8 long-prefix {shape.label}", pool=fp8_pool(arch))]
             if long_prefix_fp8 != extend_fp8 else []),
           extend_case(shape, extend_fp8, f"extend-fp8 split {shape.label}", num_splits=4, pool=fp8_pool(arch)),
           extend_case(shape, extend_fp8, f"extend-fp8-window {shape.label}", window=4096, pool=fp8_pool(arch)),
           extend_short_case(shape, short_fp8, f"extend-short-fp8 {shape.label}", pool=fp8_pool(arch)),
           (f"rope_store_kv-fp8 {shape.label}", {},
            lambda: fused.rope_store_kv(fp8["q"], fp8["k"], fp8["v"], fp8["positions"], fp8["cos_sin"],
                                        fp8["k_cache"], fp8["v_cache"], fp8["positions"])),
           # with a checkpoint's KV scales: the scores and values times them, the stores over them
           decode_case(shape, decode_fp8, f"decode-fp8-scaled {shape.label}", pool=fp8_pool(arch), scaled=True),
           extend_case(shape, extend_fp8, f"extend-fp8-scaled {shape.label}", pool=fp8_pool(arch), scaled=True),
           extend_short_case(shape, short_fp8, f"extend-short-fp8-scaled {shape.label}", pool=fp8_pool(arch),
                             scaled=True),
           (f"rope_store_kv-fp8-scaled {shape.label}", {},
            lambda: fused.rope_store_kv(fp8["q"], fp8["k"], fp8["v"], fp8["positions"], fp8["cos_sin"],
                                        fp8["k_cache"], fp8["v_cache"], fp8["positions"], kv_scales=KV_SCALES))]
          if dt != torch.float32 else []),
        *([decode_case(shape, pdl, f"decode pdl {shape.label}"), extend_short_case(shape, pdl,
           f"extend-short pdl {shape.label}")] if arch >= 90 else []),
        (f"rms_norm {shape.dtype} h{shape.hidden}", {}, lambda: pointwise.rms_norm(t["x"], t["w"], 1e-5)),
        (f"add_rms_norm {shape.dtype} h{shape.hidden}", {},
         lambda: pointwise.add_rms_norm(t["x"], t["x"], t["w"], 1e-5)),
        (f"silu_and_mul {shape.dtype} 2i{shape.hidden}", {}, lambda: pointwise.silu_and_mul(t["x"])),
        (f"rope_store_kv {shape.label}", {},
         lambda: fused.rope_store_kv(t["q"], t["k"], t["v"], t["positions"], t["cos_sin"], t["k_cache"],
                                     t["v_cache"], t["positions"])),
        lora_case(8),
        lora_case(16),
        # the expand's partials SPLIT_STEP splits a load (LoraConfig.batched_partials, off by default)
        lora_case(16, "batched", batched_partials=True),
        # beside sm_90's default, the others' (128 columns, launched plainly); before Hopper, 16-bit, sm_90's
        # 256 columns at both ranks (fp32's FMA dot spills at 128)
        *([lora_case(16, "narrow", block_n=lora.BLOCK_N, pdl=False)] if lora_default.pdl else []),
        *([lora_case(8, "wide", block_n=256), lora_case(16, "wide", block_n=256)]
          if dt != torch.float32 and not lora_default.pdl else []),
        ("top_p_threshold", {}, lambda: sampling.top_p_threshold(torch.zeros(4, 1024), torch.ones(4))),
        *(moe_case(shape, tokens, moe.default_config(2 * tokens, 8), f"fused_moe {shape.dtype} t{tokens}")
          for tokens in (4, 256)),  # a decode step's tiles and a prefill's
        (f"moe_route {shape.dtype} e128 k8", {}, lambda: moe.moe_route(torch.zeros(4, 128, dtype=dt), 8, True)),
        # gpt-oss's experts: biased GEMMs, the clamped SwiGLU, the weights in MXFP4 (decoded tile by tile)
        *(moe_case(shape, tokens, moe.default_config(2 * tokens, 8), f"fused_moe gpt-oss {shape.dtype} t{tokens}",
                   gpt_oss=True) for tokens in (4, 256)),
        # in the default's 32-deep steps, and in 64-deep ones, each value decoded with its scale (kernels.bench_moe's k64)
        *(moe_case(shape, tokens, dataclasses.replace(moe.default_config(2 * tokens, 8, mxfp4=True), **depth),
                   f"fused_moe mxfp4{label} {shape.dtype} t{tokens}", gpt_oss=True, mxfp4=True)
          for label, depth in (("", {}), (" k64", {"block_k": 64})) for tokens in (4, 256) if dt != torch.float32),
        # an fp8 checkpoint's experts kept in fp8 (--fp8-weights: e4m3 from sm_89), 128 x 128 blocks of scales
        *(moe_case(shape, tokens, moe.default_config(2 * tokens, 8), f"fused_moe fp8{act} {shape.dtype} t{tokens}",
                   fp8=True, fp8_activations=bool(act), static=act == " w8a8-static")
          for tokens in (4, 256) for act in ("", " w8a8", " w8a8-static") if dt != torch.float32 and arch >= 89),
        # an fp8 checkpoint's projections kept in fp8 (e4m3 weights: sm_89 on), a decode step's tiles and a prefill's
        *(fp8_linear_case(shape, rows, fp8_linear.default_config(rows, bool(act)),
                          f"fp8_linear{kind}{act} {shape.dtype} m{rows}", per_row=bool(kind),
                          fp8_activations=bool(act))
          for rows in (4, 256) for kind in ("", " per-row") for act in ("", " w8a8")
          if dt != torch.float32 and arch >= 89),
        # a static input scale (a checkpoint's, --fp8-activations static) over per-tensor weight scales
        *(fp8_linear_case(shape, rows, fp8_linear.default_config(rows, True),
                          f"fp8_linear per-row w8a8-static {shape.dtype} m{rows}", per_row=True,
                          fp8_activations=True, static=True)
          for rows in (4, 256) if dt != torch.float32 and arch >= 89),
        *(fp8_quantize_case(shape, rows, group) for rows in (4, 256) for group in (128, shape.hidden, None)
          if dt != torch.float32 and arch >= 89),
    ]  # fmt: skip


def moe_case(
    shape: Shape, tokens: int, config: Any, label: str, gpt_oss: bool = False, mxfp4: bool = False,
    fp8: bool = False, fp8_activations: bool = False, static: bool = False,
) -> Case:  # fmt: skip
    """A mixture-of-experts MLP of 8 experts, 2 a token, over ``tokens`` tokens in ``config``'s tiles (sizes of
    256: what compiles depends on the dtype, the tiles and 16-byte divisibility only); ``gpt_oss``: with the
    experts' biases and the clamped SwiGLU; ``mxfp4``: the weights as MXFP4 codes and scales; ``fp8``: as e4m3
    with one scale a 128 x 128 block (``fp8_activations``: each GEMM's input quantized, fp8 by fp8; by one
    static scale each with ``static``)."""
    from kernels import moe

    dt = DTYPES[shape.dtype]
    w13, w2 = torch.zeros(8, 512, 256, dtype=dt), torch.zeros(8, 256, 256, dtype=dt)
    ids = (torch.arange(2 * tokens, dtype=torch.int32) % 8).reshape(tokens, 2)
    x, weights = torch.zeros(tokens, 256, dtype=dt), torch.zeros(tokens, 2)
    options = {}
    if gpt_oss:
        options = {"b13": torch.zeros(8, 512, dtype=dt), "b2": torch.zeros(8, 256, dtype=dt),
                   "activation": "clamped_swiglu"}  # fmt: skip
    if mxfp4:
        w13, w2 = torch.zeros(8, 512, 128, dtype=torch.uint8), torch.zeros(8, 256, 128, dtype=torch.uint8)
        options |= {"w13_scales": torch.zeros(8, 512, 8, dtype=torch.uint8),
                    "w2_scales": torch.zeros(8, 256, 8, dtype=torch.uint8)}  # fmt: skip
    if fp8:
        w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
        options |= {
            "w13_scales": torch.zeros(8, 4, 2),
            "w2_scales": torch.zeros(8, 2, 2),
            "fp8_block": (128, 128),
            "fp8_activations": fp8_activations,
        }
    if static:
        options |= {"w13_input_scale": torch.ones(1), "w2_input_scale": torch.ones(1)}
    return (
        label,
        dataclasses.asdict(config),
        lambda: moe.fused_moe(x, w13, w2, weights, ids, config=config, **options),
    )


def moe_candidates(shape: Shape) -> list[Case]:
    """kernels.bench_moe's candidate tiles (kernels.moe.CANDIDATES), 32 tokens each."""
    from kernels import moe

    return [moe_case(shape, 32, cfg, f"candidate fused_moe {shape.dtype} {label}")
            for label, cfg in moe.CANDIDATES.items()]  # fmt: skip


def fp8_linear_case(
    shape: Shape, rows: int, config: Any, label: str, per_row: bool = False, fp8_activations: bool = False,
    fuse_quantization: bool | None = None, static: bool = False,
) -> Case:  # fmt: skip
    """An fp8 linear layer over ``rows`` rows of the model's hidden size into 512 columns, e4m3 weights in
    128 x 128 blocks (Qwen3's and DeepSeek's fp8 releases) or with one scale a row (``per_row``:
    llm-compressor's FP8-dynamic), in ``config``'s tiles; with ``fp8_activations`` the product of fp8 by
    fp8, x quantized inside it (a decode step's, with block scales) or first (fp8_quantize_case; the rows
    decide, or ``fuse_quantization``; by one static scale with ``static``: a checkpoint's input scale)."""
    from kernels import fp8_linear

    x = torch.zeros(rows, shape.hidden, dtype=DTYPES[shape.dtype])
    w = torch.zeros(512, shape.hidden, dtype=torch.float8_e4m3fn)
    scale, block = (
        (torch.zeros(512, 1), None) if per_row else (torch.zeros(4, -(-shape.hidden // 128)), (128, 128))
    )
    options = {"fp8_activations": fp8_activations, "fuse_quantization": fuse_quantization,
               "input_scale": torch.ones(1) if static else None}  # fmt: skip
    return (
        label,
        dataclasses.asdict(config),
        lambda: fp8_linear.fp8_linear(x, w, scale, block, config=config, **options),
    )


def fp8_quantize_case(shape: Shape, rows: int, group: int | None) -> Case:
    """The activations' quantization to e4m3 before an fp8 by fp8 product: one scale a run of ``group``
    columns of each of ``rows`` rows of the model's hidden size, or (None) by one static scale."""
    from kernels import fp8_linear

    x = torch.zeros(rows, shape.hidden, dtype=DTYPES[shape.dtype])
    if group is None:
        label = f"fp8 activations {shape.dtype} m{rows} static"
        return label, {}, lambda: fp8_linear.quantize_fp8_static(x, torch.ones(1))
    label = f"fp8 activations {shape.dtype} m{rows} group {group}"
    return label, {"group": group}, lambda: fp8_linear.quantize_fp8_groups(x, group)


def fp8_linear_candidates(shape: Shape) -> list[Case]:
    """kernels.bench_fp8_linear's candidate tiles (kernels.fp8_linear.CANDIDATES), over 16-bit and fp8
    activations."""
    from kernels import fp8_linear

    prefill = fp8_linear.default_config(256, fp8_activations=True)
    return [*(fp8_linear_case(shape, 16, cfg, f"candidate fp8_linear{act} {shape.dtype} {label}",
                              fp8_activations=bool(act))
              for label, cfg in fp8_linear.CANDIDATES.items() for act in ("", " w8a8")),
            # a prefill quantizing x inside the product (kernels.bench_fp8_linear's w8a8_fused)
            fp8_linear_case(shape, 256, prefill, f"candidate fp8_linear w8a8 fused {shape.dtype} m256",
                            fp8_activations=True, fuse_quantization=True)]  # fmt: skip


def tune_candidates(shape: Shape, with_configs: bool = False, pool: torch.dtype | None = None) -> list:
    """Every tile configuration kernels.tune would time, for ``shape`` (over a ``pool`` KV pool: None, the
    model's dtype; an fp8 pool under a bf16 q: each decode tile widening to fp16 and not); with_configs
    appends each case's configuration object to its tuple."""
    from kernels import decode_attention, tune

    pairs = [(extend_case(shape, c, f"candidate extend {shape.label}", pool=pool), c)
             for c in tune.extend_candidates()]  # fmt: skip
    widens = pool is not None and decode_attention.widens_fp8_to_fp16(DTYPES[shape.dtype], pool)
    pairs += [(decode_case(shape, c, f"candidate decode {shape.label}", pool=pool), c)
              for f16 in ((False, True) if widens else (False,))
              for c in tune.decode_candidates(fp8_f16=f16)]  # fmt: skip
    return [(*case, config) if with_configs else case for case, config in pairs]
