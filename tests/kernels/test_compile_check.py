"""kernels.compile_check: the kernels compile for sm_90 on a machine without a GPU, the report reads the
real cubin (registers, spills, shared memory, instructions), and a configuration that spills fails it.

Compilation runs in child processes: this test process has the kernels imported interpreted. Every child
compiles with Triton's default FMA contraction off (its default from Triton 3.10), so the kernels' own
enable_fp_fusion is what is checked; and as the setting is part of Triton's cache key, one setting for all
lets a later test find the kernels an earlier one compiled. The file's tests share one pytest-xdist process,
in file order: the sm_90 defaults first, whose compiles most of the rest reuse. A compile takes minutes
on a busy 2-core machine (the sm_90 defaults 150-240 s there): the children may run 10 minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kernels import compile_cases, compile_check
from tests.support import SLOW

pytestmark = [pytest.mark.xdist_group("compile_check"), pytest.mark.timeout(900)]


def _python(code: str, *args: str, timeout: float = 600, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "0"}
    env |= env_vars
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_parse_resource_usage_reads_registers_and_spills():
    text = textwrap.dedent("""\
        Resource usage:
         Common:
          GLOBAL:11 CONSTANT[4]:8
         Function _extend_kernel:
          REG:255 STACK:16 SHARED:1024 LOCAL:296 CONSTANT[0]:672 TEXTURE:0 SURFACE:0 SAMPLER:0
         Function _other:
          REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
        """)
    usage = compile_check.parse_resource_usage(text)
    assert usage == {"_extend_kernel": {"regs": 255, "stack": 16, "local": 296},
                     "_other": {"regs": 40, "stack": 0, "local": 0}}  # fmt: skip


def test_count_sass_ops_tells_load_widths_and_mma_kinds_apart():
    sass = textwrap.dedent("""\
        /*0100*/ LDGSTS.E.BYPASS.128 [R5], desc[UR6][R2.64] ;
        /*0110*/ @!P0 LDG.E.128 R8, desc[UR6][R2.64] ;
        /*0120*/ LDG.E R9, desc[UR6][R4.64] ;
        /*0130*/ HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0140*/ HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0148*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*014c*/ QMMA.16832.F32.E4M3.E4M3 R4, R8, R12, R4 ;
        /*014e*/ QMMA.16832.F32.E4M3.E4M3 R4, R8, R12, R4 ;
        /*0150*/ STL.64 [R1], R10 ;
        /*0160*/ LDL R3, [R1+0x8] ;
        /*0170*/ ACQBULK ;
        /*0180*/ PREEXIT ;
        /*0190*/ ACQBULK ;
        """)
    assert compile_check.count_sass_ops(sass) == {
        "HGMMA": 1, "QGMMA": 1, "HMMA": 1, "QMMA": 2, "LDGSTS": 1, "UTMALDG": 0, "LDG.E.128": 1, "LDL": 1,
        "STL": 1, "ACQBULK": 2,
        "PREEXIT": 1}  # fmt: skip


def test_blocks_per_sm_is_bounded_by_registers_shared_memory_and_threads():
    h100 = compile_check.ARCHS[90]
    assert compile_check.blocks_per_sm(h100, regs=233, shared=96 * 1024, num_warps=8) == 1  # registers
    assert compile_check.blocks_per_sm(h100, regs=32, shared=100 * 1024, num_warps=4) == 2  # shared memory
    assert compile_check.blocks_per_sm(h100, regs=32, shared=0, num_warps=16) == 4  # threads
    assert compile_check.blocks_per_sm(h100, regs=16, shared=0, num_warps=1) == 32  # block slots
    assert compile_check.blocks_per_sm(h100, regs=32, shared=230 * 1024, num_warps=4) == 0  # too much smem
    a100 = compile_check.ARCHS[80]
    assert compile_check.blocks_per_sm(a100, regs=32, shared=200 * 1024, num_warps=4) == 0


# NOTE: full tier (as the sm_80 and above-128 sweeps below): ~340 s of CPU on a 2-core machine, a fifth of the
# default tier's kernel tests, and what it checks depends on kernels/ and the pinned Triton alone (a change to
# either runs the full tier); the default tier compiles for sm_90 in the tests after it and test_compile_replay
@SLOW
def test_default_configurations_compile_for_h100_without_spills(tmp_path):
    """Every kernel compiles with FMA contraction even where Triton's default is off (as from 3.10).
    Three processes compile the cases: each row is its own case's (the case and kernel pairs below), at head
    dims 128 and 64."""
    head_dims = (128, 64)
    out = tmp_path / "sm90.json"
    proc = _python("", "-m", "kernels.compile_check", "--arch", "90", "--dtypes", "bf16", "--head-dims",
                   *map(str, head_dims), "--jobs", "3", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["arch"] == 90 and report["defaults_ok"] is True
    rows = {(r["case"], r["kernel"]): r for r in report["rows"]}
    kernels = {kernel for _, kernel in rows}
    assert kernels == {"_decode_split_kernel", "_decode_merge_kernel", "_extend_kernel", "_rms_norm_kernel",
                       "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_store_kv_kernel", "_shrink_kernel",
                       "_expand_kernel", "_short_split_kernel", "_merge_rows_kernel",
                       "_top_p_threshold_kernel", "_grouped_gemm_kernel", "_align_kernel", "_route_kernel",
                       "_clamped_swiglu_and_mul_kernel", "_fp8_linear_kernel",
                       "_quantize_tiles_kernel", "_quantize_groups_kernel"}  # fmt: skip
    for r in report["rows"]:
        assert r["ok"] and r["spill_bytes"] == 0 and r["blocks_per_sm"] >= 1, r
        assert 0 < r["regs"] <= 255 and r["shared_bytes"] <= report["limits"]["smem_per_block"]
        assert r["fp_fusion"] is True, r
    assert ("extend-long-prefix bf16 hd128 gqa4", "_extend_kernel") in rows  # LONG_PREFIX's tiles
    # the experts' GEMMs: a prefill's 64-row blocks on warpgroup MMA, a decode step's 16-row ones on mma.sync
    assert rows[("fused_moe bf16 t256", "_grouped_gemm_kernel")]["sass"]["HGMMA"] > 0
    assert rows[("fused_moe bf16 t4", "_grouped_gemm_kernel")]["sass"]["HMMA"] > 0
    # the fp8 linear layer likewise, over block scales and one scale a row; with fp8 activations a prefill's
    # product on the fp8 warpgroup MMA (a decode step's widened to 16 bits on sm_90's mma.sync)
    for kind in ("", " per-row"):
        assert rows[(f"fp8_linear{kind} bf16 m256", "_fp8_linear_kernel")]["sass"]["HGMMA"] > 0
        assert rows[(f"fp8_linear{kind} bf16 m4", "_fp8_linear_kernel")]["sass"]["HMMA"] > 0
        w8a8 = rows[(f"fp8_linear{kind} w8a8 bf16 m256", "_fp8_linear_kernel")]["sass"]
        assert w8a8["QGMMA"] > 0 and w8a8["HGMMA"] == 0
        assert rows[(f"fp8_linear{kind} w8a8 bf16 m4", "_fp8_linear_kernel")]["sass"]["HMMA"] > 0
    # a prefill's 128-column runs a tile of rows a program; a row's scale over 4,096 columns read in chunks
    assert ("fp8 activations bf16 m256 group 128", "_quantize_tiles_kernel") in rows
    assert ("fp8 activations bf16 m256 group 4096", "_quantize_groups_kernel") in rows
    moe_w8a8 = [r["sass"] for r in report["rows"]
                if r["case"] == "fused_moe fp8 w8a8 bf16 t256" and r["kernel"] == "_grouped_gemm_kernel"]  # fmt: skip
    assert len(moe_w8a8) == 2 and all(s["QGMMA"] > 0 and s["HGMMA"] == 0 for s in moe_w8a8)
    assert ("decode many-requests bf16 hd128 gqa4", "_decode_split_kernel") in rows  # MANY_REQUESTS' tiles
    assert ("extend-long-prefix bf16 hd64 gqa4", "_extend_kernel") not in rows  # the same tiles as extend's
    assert ("decode many-requests bf16 hd64 gqa4", "_decode_split_kernel") not in rows  # as decode's
    # the prefix split of both tile choices (off by default): the split kernel and its merge
    for case in ("extend-prefix-split bf16 hd128 gqa4", "extend-long-prefix-split bf16 hd128 gqa4",
                 "extend-packed-split bf16 hd128 gqa4"):  # fmt: skip
        assert {(case, "_extend_kernel"), (case, "_merge_rows_kernel")} <= set(rows)
    for hd in head_dims:
        extend = rows[(f"extend bf16 hd{hd} gqa4", "_extend_kernel")]
        decode = rows[(f"decode bf16 hd{hd} gqa4", "_decode_split_kernel")]
        assert extend["sass"]["HGMMA"] > 0, "extend should use Hopper warpgroup MMA on sm_90"
        assert extend["sass"]["LDGSTS"] > 0 and decode["sass"]["LDGSTS"] > 0, "KV gathers should be cp.async"
        assert decode["sass"]["HMMA"] > 0
        # NOTE: the prefetch candidate loads K/V into registers (128-bit loads), not through cp.async
        prefetch = rows[(f"decode prefetch bf16 hd{hd} gqa4", "_decode_split_kernel")]
        assert prefetch["sass"]["LDGSTS"] == 0 and prefetch["sass"]["LDG.E.128"] > 0, prefetch
        # NOTE: the slots one tile ahead keep the default's cp.async gathers, unspilled; at the batch-1 tiles
        # (head dim 128) as many blocks an SM as the default
        slots = rows[(f"decode prefetch-slots bf16 hd{hd} gqa4", "_decode_split_kernel")]
        assert slots["ok"] and slots["sass"]["LDGSTS"] > 0, slots
        if hd == 128:
            assert slots["blocks_per_sm"] == decode["blocks_per_sm"], (slots, decode)
        # NOTE: on 3 stages the slots ahead let Triton buffer the 64-token K/V copies twice: two K and two V tiles
        pipelined = rows[(f"decode pipelined bf16 hd{hd} gqa4", "_decode_split_kernel")]
        assert pipelined["ok"] and pipelined["sass"]["LDGSTS"] > 0, pipelined
        assert pipelined["shared_bytes"] >= 2 * 2 * 64 * hd * 2, pipelined
        # NOTE: the short extend's 32 rows a program, and the bench's 64 on 64-token tiles: unspilled, at least
        # two blocks an SM
        for case in (f"extend-short bf16 hd{hd} gqa4", f"extend-short wide bf16 hd{hd} gqa4"):
            short = rows[(case, "_short_split_kernel")]
            assert short["ok"] and short["blocks_per_sm"] >= 2 and short["sass"]["LDGSTS"] > 0, short
        # NOTE: and its slots a tile ahead as many blocks an SM as the default (head dim 128), as decode's
        short_slots = rows[(f"extend-short prefetch-slots bf16 hd{hd} gqa4", "_short_split_kernel")]
        assert short_slots["ok"] and short_slots["sass"]["LDGSTS"] > 0, short_slots
        if hd == 128:
            short = rows[(f"extend-short bf16 hd{hd} gqa4", "_short_split_kernel")]
            assert short_slots["blocks_per_sm"] == short["blocks_per_sm"], (short_slots, short)
        # NOTE: the PDL cases wait for the kernel before (ACQBULK) in both kernels of a pair, and the split
        # kernels let the merge launch early (PREEXIT); every other kernel does neither
        for case in (f"decode pdl bf16 hd{hd} gqa4", f"extend-short pdl bf16 hd{hd} gqa4"):
            pair = [r for (c, _), r in rows.items() if c == case]
            assert len(pair) == 2 and all(r["sass"]["ACQBULK"] >= 1 for r in pair), pair
            assert [r["sass"]["PREEXIT"] >= 1 for r in pair] == [True, False], pair
    # sm_90's LoRA default (and its batched candidate) launch as programmatic dependents; the "narrow"
    # case is the other archs' default, launched plainly
    lora_pdl = {c for c, _ in rows if c.startswith("lora_add") and "narrow" not in c}
    assert len(lora_pdl) == 3 and ("lora_add narrow bf16 h4096 r48", "_expand_kernel") in rows
    assert {(k, r["sass"]["ACQBULK"] >= 1, r["sass"]["PREEXIT"] >= 1) for (c, k), r in rows.items()
            if c in lora_pdl} == {("_shrink_kernel", True, True), ("_expand_kernel", True, False)}  # fmt: skip
    assert all(
        r["sass"]["ACQBULK"] == r["sass"]["PREEXIT"] == 0
        for (c, _), r in rows.items()
        if "pdl" not in c and c not in lora_pdl
    )
    md = out.with_suffix(".md").read_text()
    assert "sm_90" in md and "every default fits and spills nothing" in md


def test_a_spilling_configuration_is_reported_as_failing():
    code = textwrap.dedent("""\
        import json
        from kernels import compile_cases, compile_check
        from kernels.extend_attention import ExtendConfig
        shape = compile_cases.Shape("bf16", 32, 8, 128, 4096)
        big = ExtendConfig(block_m=128, block_n=128, num_warps=4, num_stages=2)
        with compile_check.compile_only(90) as compiled:
            compile_cases.extend_case(shape, big, "big")[2]()
        print(json.dumps([compile_check.inspect_kernel(n, k, compile_check.ARCHS[90]) for n, k in compiled]))
        """)
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["kernel"] == "_extend_kernel"
    assert row["spill_bytes"] > 0 and row["ok"] is False


def test_compile_only_refuses_to_run_under_the_interpreter():
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unset TRITON_INTERPRET" in proc.stderr


def test_pdl_configurations_compile_kernels_launched_as_programmatic_dependents():
    """DecodeConfig.pdl reaches Triton's launch option (the driver's programmatic-serialization
    attribute), for both kernels of decode and of the short extend; the default launches without it."""
    code = textwrap.dedent("""\
        import dataclasses, json
        import torch
        from kernels import compile_cases, compile_check
        from kernels.decode_attention import default_config
        shape = compile_cases.Shape("bf16", 32, 8, 128, 4096)
        launched = {}
        for pdl in (False, True):
            cfg = dataclasses.replace(default_config(128, torch.bfloat16), pdl=pdl)
            with compile_check.compile_only(90) as compiled:
                compile_cases.decode_case(shape, cfg, "decode")[2]()
                compile_cases.extend_short_case(shape, cfg, "short")[2]()
            launched[str(pdl)] = [[name, kernel.metadata.launch_pdl] for name, kernel in compiled]
        print(json.dumps(launched))
        """)
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    launched = json.loads(proc.stdout.strip().splitlines()[-1])
    names = ["_decode_split_kernel", "_decode_merge_kernel", "_short_split_kernel", "_merge_rows_kernel"]
    assert launched == {"False": [[n, False] for n in names], "True": [[n, True] for n in names]}


def test_fp8_products_compile_for_sm90_at_every_step_depth_and_quantization_place():
    """What the interpreter cannot tell: the fp8 products at the kernel tests' own shapes compile for sm_90
    (x quantized inside a product of one step over the whole row, its scale read after the loop; fp8 by fp8
    at 16-deep steps, below the fp8 MMA's 32, taken in fp16; a static scale at 16-deep steps; experts over
    blocks of 48 columns): each call compiles its product's kernels."""
    code = textwrap.dedent("""\
        import json
        import torch
        from kernels import compile_check, fp8_linear, moe
        def fp8(*shape):
            return torch.zeros(*shape).to(torch.float8_e4m3fn)
        x, static = torch.zeros(3, 96, dtype=torch.bfloat16), torch.ones(1)
        short = fp8_linear.Fp8LinearConfig(block_m=16, block_n=32, block_k=16)
        one_step = fp8_linear.Fp8LinearConfig(block_m=16, block_n=32, block_k=128)
        tokens = torch.zeros(3, 72, dtype=torch.bfloat16)
        ids, weights = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32), torch.ones(3, 2)
        experts = dict(w13_scales=torch.ones(4, 3, 2), w2_scales=torch.ones(4, 3, 1), fp8_block=(32, 48),
                       fp8_activations=True)
        calls = {
            "row one step": lambda: fp8_linear.fp8_linear(x, fp8(64, 96), torch.ones(64, 1), None, config=one_step,
                                                          fp8_activations=True, fuse_quantization=True),
            "blocks of 48": lambda: fp8_linear.fp8_linear(x, fp8(64, 96), torch.ones(4, 2), (16, 48),
                                                          fp8_activations=True),
            "static short": lambda: fp8_linear.fp8_linear(x, fp8(64, 96), torch.ones(1), None, config=short,
                                                          fp8_activations=True, input_scale=static),
            "experts of 48": lambda: moe.fused_moe(tokens, fp8(4, 80, 72), fp8(4, 72, 40), weights, ids,
                                                   **experts),
        }
        print(json.dumps({label: compile_check.compile_rows(call, 90) for label, call in calls.items()}))
        """)
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for label, rows in report.items():
        assert rows and all(r["kernel"] is not None for r in rows), (label, rows)
    products = {label: [r["kernel"] for r in rows if r["kernel"] in ("_fp8_linear_kernel", "_grouped_gemm_kernel")]
                for label, rows in report.items()}  # fmt: skip
    assert products == {
        "row one step": ["_fp8_linear_kernel"],
        "blocks of 48": ["_fp8_linear_kernel"],
        "static short": ["_fp8_linear_kernel"],
        "experts of 48": ["_grouped_gemm_kernel"] * 2,
    }


# NOTE: full tier (as the defaults sweep above): it compiles every default kernel for sm_90, ~120 s of CPU on a
# 2-core machine, the longest test of the default tier, and what it lists depends on kernels/ and the pinned
# Triton alone (a change to either runs the full tier)
@SLOW
def test_loaded_kernels_lists_every_compiled_kernel_with_its_constexprs():
    code = textwrap.dedent("""\
        import json
        import torch
        from kernels import compile_cases, compile_check
        from kernels.decode_attention import default_config
        shape = compile_cases.Shape("bf16", 32, 8, 128, 4096)
        with compile_check.compile_only(90):
            for case in compile_cases.defaults(shape):
                case[2]()
            # a second split count: the same split kernel, another merge kernel (BLOCK_S 16)
            compile_cases.DECODE_SPLITS = 16  # divisible by 16: specialised unless told not to
            compile_cases.decode_case(shape, default_config(128, torch.bfloat16), "16")[2]()
            # the unpacked extend kernels again for 3 requests: the same kernels as for 32
            from kernels.extend_attention import default_config as extend_config, extend_attention
            t = compile_cases._tensors(shape)
            for splits in (1, 8):
                extend_attention(t["q"], t["k"], t["v"], t["k_cache"], t["v_cache"], t["indptr"][:4],
                                 t["indptr"][:4], t["indices"], max_extend_len=32, num_splits=splits,
                                 config=extend_config(128, torch.bfloat16))
        print(json.dumps(compile_check.loaded_kernels()))
        """)
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    # the kernels over an fp8 pool (--kv-cache-dtype) are their own compiles: the default tiles of each (decode's
    # two regimes; extend unsplit, split and windowed)
    fp8 = [r for r in loaded if r.get("pool") == "*fp8e4nv"]
    # (their merges read no pool: the 16-bit pools' merge kernels serve them), and with a checkpoint's KV
    # scales one more of each kernel that reads or writes the pool
    scaled = [r for r in fp8 if r["constants"].get("KV_SCALED")]
    assert sorted(r["kernel"] for r in fp8 if r not in scaled) == [
        "_decode_split_kernel", "_decode_split_kernel", "_extend_kernel", "_extend_kernel", "_extend_kernel",
        "_rope_store_kv_kernel", "_short_split_kernel"]  # fmt: skip
    assert sorted(r["kernel"] for r in scaled) == ["_decode_split_kernel", "_extend_kernel",
                                                   "_rope_store_kv_kernel", "_short_split_kernel"]  # fmt: skip
    loaded = [r for r in loaded if r not in fp8]
    splits = [(r["constants"]["BLOCK_N"], r["constants"]["FUSED_MERGE"], r["constants"]["PDL"],
               r["constants"]["PREFETCH"], r["constants"]["PREFETCH_SLOTS"], r["constants"]["WINDOWED"],
               r["constants"]["SOFTCAP"])
              for r in loaded if r["kernel"] == "_decode_split_kernel"]  # fmt: skip
    # one split kernel a tile choice (the default's and, from MANY_REQUESTS requests, 64-token tiles; and
    # one fused, one launched as a programmatic dependent, one prefetching, two loading their slots a tile
    # ahead, one windowed and one windowed with soft-capped scores) serves every split count, window and cap
    assert sorted(splits) == [
        (64, False, False, False, False, False, False),
        (64, False, False, False, True, False, False),
        (64, False, False, True, False, False, False),
        (128, False, False, False, False, False, False),
        (128, False, False, False, False, True, False),
        (128, False, False, False, False, True, True),
        (128, False, False, False, True, False, False),
        (128, False, True, False, False, False, False),
        (128, True, False, False, False, False, False),
    ]
    merge_blocks = sorted((r["constants"]["BLOCK_S"], r["constants"]["PDL"], r["constants"]["WINDOWED"],
                           r["constants"]["SINKS"]) for r in loaded if r["kernel"] == "_decode_merge_kernel")  # fmt: skip
    # the merge adds attention sinks (gpt-oss's windowed layers); the split kernel is the windowed one
    assert merge_blocks == [(8, False, False, False), (8, False, True, False), (8, False, True, True),
                            (8, True, False, False), (16, False, False, False)]  # fmt: skip
    assert all(
        "window" not in r["constants"] and "softcap" not in r["constants"] for r in loaded
    )  # plain arguments
    rows = {r["kernel"]: r for r in loaded}
    assert set(rows) == {"_decode_split_kernel", "_decode_merge_kernel", "_extend_kernel", "_rms_norm_kernel",
                         "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_store_kv_kernel", "_shrink_kernel",
                       "_expand_kernel", "_short_split_kernel", "_merge_rows_kernel",
                       "_top_p_threshold_kernel", "_grouped_gemm_kernel", "_align_kernel", "_route_kernel",
                       "_clamped_swiglu_and_mul_kernel", "_fp8_linear_kernel",
                       "_quantize_tiles_kernel", "_quantize_groups_kernel"}  # fmt: skip
    # sm_90's two extend defaults: without a long prefix, and the long-prefix tiles; each also with the
    # prefix split (one compiled kernel for any split count)
    extends = sorted(
        (r for r in loaded if r["kernel"] == "_extend_kernel" and not r["constants"]["WINDOWED"]),
        key=lambda r: (r["constants"]["PACKED"], r["constants"]["SPLIT"], r["constants"]["BLOCK_M"]),
    )
    assert [(r["constants"]["PACKED"], r["constants"]["SPLIT"], r["constants"]["BLOCK_M"], r["constants"]["BLOCK_N"],
             r["num_warps"]) for r in extends] == [
        (False, False, 64, 32, 4), (False, False, 128, 64, 8), (False, True, 64, 32, 4), (False, True, 128, 64, 8),
        (True, True, 64, 32, 4),  # the packed grid with the split, 32 requests: BLOCK_R 32
    ]  # fmt: skip
    windowed = [r for r in loaded if r["kernel"] == "_extend_kernel" and r["constants"]["WINDOWED"]]
    # windowed alone, with soft-capped scores (Gemma 2), with attention sinks (gpt-oss)
    assert sorted(
        (r["constants"]["SOFTCAP"], r["constants"]["SINKS"], r["constants"]["BLOCK_M"]) for r in windowed
    ) == [
        (False, False, 64),
        (False, True, 64),
        (True, False, 64),
    ]
    assert extends[-1]["constants"]["BLOCK_R"] == 32
    assert {r["constants"]["BLOCK_R"] for r in extends[:-1]} == {2}  # unpacked: one kernel for any batch
    for extend in extends:
        assert extend["constants"]["GROUP"] == 4 and extend["shared_bytes"] > 0
        assert extend["regs"] is None and extend["spills"] is None  # compiled, never loaded on a GPU
    assert "num_splits" not in rows["_decode_split_kernel"]["constants"]


def test_record_loaded_kernels_records_a_failure_instead_of_raising(monkeypatch):
    def broken():
        raise AttributeError("'JITFunction' object has no attribute 'device_caches'")

    monkeypatch.setattr(compile_check, "loaded_kernels", broken)
    doc: dict = {"extend": [1.0]}
    compile_check.record_loaded_kernels(doc)
    assert doc == {"extend": [1.0], "compiled_error": "AttributeError: 'JITFunction' object has no "
                   "attribute 'device_caches'"}  # fmt: skip


@SLOW
def test_defaults_before_hopper_fit_without_spills_on_mma_sync(tmp_path):
    """sm_80 (A100) has no wgmma: the head_dim-128 extend default is 128x32 there, which does not spill
    (128x64, the H100 choice, spills on sm_80 and sm_89)."""
    out = tmp_path / "sm80.json"
    proc = _python("", "-m", "kernels.compile_check", "--arch", "80", "--dtypes", "bf16",
                   "--head-dims", "128", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    extend = next(r for r in report["rows"] if r["kernel"] == "_extend_kernel")
    unsplit = {"split_prefix": False, "min_split_len": 256, "packed_blocks": False}
    assert extend["config"] == {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 2} | unsplit
    assert extend["ok"] and extend["spill_bytes"] == 0
    assert extend["sass"]["HGMMA"] == 0 and extend["sass"]["HMMA"] > 0
    # over an fp8 pool (e5m2 there) the 16-bit pools' tiles spill (widening the tiles takes registers); 32x16
    fp8 = [r for r in report["rows"] if r["case"].split()[0].endswith("-fp8")]
    assert {r["case"].split()[0] for r in fp8} == {
        "decode-fp8",
        "extend-fp8",
        "extend-short-fp8",
        "rope_store_kv-fp8",
    }
    assert all(r["ok"] and r["spill_bytes"] == 0 for r in fp8), fp8
    extend_fp8 = next(r for r in fp8 if r["kernel"] == "_extend_kernel")
    assert extend_fp8["config"] == {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 2} | unsplit


def test_head_dims_beyond_64_and_128_are_accepted_and_checked():
    args = compile_check.parse_args(["--head-dims", "80", "96", "256"])
    assert args.head_dims == [80, 96, 256]
    for bad in ("63", "0", "1024"):
        proc = _python("", "-m", "kernels.compile_check", "--head-dims", bad, timeout=60)
        assert proc.returncode == 2 and "even number from 16 to 512" in proc.stderr, proc.stderr


def test_only_refuses_names_of_no_case_and_lists_the_cases(capsys):
    assert compile_check.main(["--arch", "80", "--only", "nope", "rms"]) == 2
    err = capsys.readouterr().err
    assert (
        "--only nope rms: no such kernel case (cases here: add_rms_norm, decode, decode-fp8, decode-fp8-scaled, "
        "decode-sinks, decode-softcap, decode-window," in err
    )


@SLOW
@pytest.mark.parametrize(("arch", "block_m"), [(90, 64), (80, 32)])
def test_defaults_above_head_dim_128_compile_without_spills(tmp_path, arch, block_m):
    """The former head_dim-256 extend default (64x32, 4 warps) spilled 120-128 B per thread at 255
    registers on sm_80 and sm_90; the defaults for head_dim > 128 use 16-key tiles and 8 warps."""
    out = tmp_path / f"sm{arch}.json"
    proc = _python("", "-m", "kernels.compile_check", "--arch", str(arch), "--dtypes", "bf16",
                   "--head-dims", "256", "96", "80", "--only", "extend", "extend-long-prefix",
                   "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["defaults_ok"] is True
    kinds = {r["case"].split()[0] for r in report["rows"]}  # --only: the extend cases alone
    assert "extend" in kinds and kinds <= {"extend", "extend-long-prefix"}
    assert {r["case"].split()[2] for r in report["rows"] if r["kernel"] == "_extend_kernel"} == {
        "hd256", "hd96", "hd80"}  # fmt: skip
    extend = next(r for r in report["rows"] if r["case"] == "extend bf16 hd256 gqa4")
    unsplit = {"split_prefix": False, "min_split_len": 256, "packed_blocks": False}
    assert extend["config"] == {"block_m": block_m, "block_n": 16, "num_warps": 8, "num_stages": 2} | unsplit
    assert extend["spill_bytes"] == 0 and extend["regs"] <= 255 and extend["ok"]


def test_the_prefetch_variant_is_checked_at_the_head_dims_the_bench_times_it():
    """DecodeConfig.prefetch holds two tiles in registers: kernels.bench and kernels.sweep time it at head dims
    64 and 128; at 256 it would spill KiBs (3.5 KiB a thread on sm_90), a variant nothing launches there."""
    for head_dim, dtype, expected in [(128, "bf16", True), (64, "fp16", True), (96, "bf16", True),
                                      (256, "bf16", False), (192, "fp16", False), (128, "fp32", False)]:  # fmt: skip
        shape = compile_cases.Shape(dtype, 8, 2, head_dim, 256)
        labels = {case[0] for case in compile_cases.defaults(shape)}
        assert (f"decode prefetch {shape.label}" in labels) is expected, (head_dim, dtype)
        assert f"decode {shape.label}" in labels
