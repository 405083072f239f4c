"""kernels.bench_fp8_linear on the CPU: the command end to end (kernel interpreted, CUDA's parts stood in
for), with 16-bit and fp8 activations and cuBLAS's fp8 GEMM, its output checks catching a wrong result, the
rule that picks a regime's candidate, and its refusal to measure without a GPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kernels import bench_fp8_linear, timing
from kernels.bench_fp8_linear import Projection
from tests.support import SLOW

# q 1 head, kv 1 head of 64, an MLP of 32: qkv [192, 64], o [64, 64], gate_up [64, 64], down [64, 32]
TINY = ["--q-heads", "1", "--kv-heads", "1", "--head-dim", "64", "--intermediate", "32"]
VARIANTS = ("bf16", "fp8", "fp8_per_row", "w8a8", "w8a8_per_row", "cublas_fp8", "w8a8_fused", "w8a8_separate",
            "w8a8_static", "w8a8_static_fused")  # fmt: skip
FIELDS = {
    "shape", "n", "k", "rows", "default", "flops", "rel_err", "candidates_us", "candidate_errors", "wrong",
    "best_candidate", "best_speedup", "fp8_speedup", "w8a8_default", "w8a8_candidates_us",
    "w8a8_best_candidate", "w8a8_best_speedup", "w8a8_speedup", "w8a8_vs_fp8", "static_vs_dynamic",
    *(f"{variant}_{what}" for variant in VARIANTS for what in ("weight_bytes", "us", "gbs", "tflops")),
}  # fmt: skip


def interpreted_only(backend) -> None:
    if backend.is_cuda:
        pytest.skip("the GPU runs the command itself (scripts/gpu-bench fp8)")


def weight(n: int, k: int) -> bench_fp8_linear.Fp8Weight:
    return bench_fp8_linear.fp8_weight(Projection("p", n, k), torch.bfloat16, torch.device("cpu"), seed=0)


def test_the_command_writes_every_row_and_prints_the_table_last(
    backend, monkeypatch, tmp_path, capsys, gpu_command_on_cpu
):
    """main() on tiny projections, every timer saying 1 ms: a row per projection and row count with every
    field, each output checked against the reference, the summary, the report; the table printed last."""
    interpreted_only(backend)
    monkeypatch.setattr(bench_fp8_linear, "PREFILL_ROWS", 20)  # so that both regimes have rows
    # NOTE: two of the candidate tiles (the loop over them is the same for all seven; interpreted, each is ~8 s here)
    fp8 = bench_fp8_linear.fp8_linear
    monkeypatch.setattr(
        fp8, "CANDIDATES", {k: fp8.CANDIDATES[k] for k in ("m16 n32 k128 s4", "m32 n64 k128")}
    )
    out = tmp_path / "fp8.json"
    assert bench_fp8_linear.main([*TINY, "--rows", "1,20", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == {"name": "CPU stand-in", "sm_count": 2, "copy_gbs": 100.0}
    assert doc["software"]["torch"] == torch.__version__ and doc["software"]["triton"]
    projections = [("qkv", 192, 64), ("o", 64, 64), ("gate_up", 64, 64), ("down", 64, 32)]
    shapes = [(r["shape"], r["n"], r["k"], r["rows"]) for r in doc["rows"]]
    assert shapes == [(name, n, k, rows) for name, n, k in projections for rows in (1, 20)]
    labels = list(bench_fp8_linear.fp8_linear.CANDIDATES)
    for r in doc["rows"]:
        assert set(r) == FIELDS, set(r) ^ FIELDS
        n, k, rows = r["n"], r["k"], r["rows"]
        assert r["fp8_weight_bytes"] == n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)
        assert r["fp8_per_row_weight_bytes"] == n * k + 4 * n and r["bf16_weight_bytes"] == 2 * n * k
        assert r["w8a8_weight_bytes"] == r["fp8_weight_bytes"]
        assert r["cublas_fp8_weight_bytes"] == r["w8a8_per_row_weight_bytes"] == r["fp8_per_row_weight_bytes"]
        assert (
            r["w8a8_static_weight_bytes"]
            == r["w8a8_static_fused_weight_bytes"]
            == r["fp8_per_row_weight_bytes"]
        )
        assert r["flops"] == 2 * rows * n * k and r["fp8_us"] == r["w8a8_us"] == r["cublas_fp8_us"] == 1000.0
        assert r["fp8_gbs"] == pytest.approx(r["fp8_weight_bytes"] / 1e-3 / 1e9)
        assert r["fp8_tflops"] == pytest.approx(r["flops"] / 1e-3 / 1e12)
        assert list(r["candidates_us"]) == labels and r["candidate_errors"] == {}
        # W8A8's candidates on prefill rows only (20 rows here)
        w8a8_labels = labels if rows >= 20 else []
        assert list(r["w8a8_candidates_us"]) == w8a8_labels
        assert set(r["rel_err"]) == {*VARIANTS, *labels, *(f"w8a8_{label}" for label in w8a8_labels)}
        # NOTE: torch's CPU _scaled_mm is the reference's own arithmetic: exact here
        errors = {name: e for name, e in r["rel_err"].items() if name != "cublas_fp8"}
        assert r["wrong"] == [] and all(0 < e < 2e-2 for e in errors.values()), r["rel_err"]
        assert r["rel_err"]["cublas_fp8"] < 2e-2
        assert r["fp8_speedup"] == r["w8a8_speedup"] == r["w8a8_vs_fp8"] == r["static_vs_dynamic"] == 1.0
        assert r["best_speedup"] == 1.0 and r["best_candidate"] in labels
        assert (r["w8a8_best_candidate"] in labels) == (rows >= 20)
    assert doc["summary"] == {
        "fp8_speedup_min_decode": 1.0,
        "fp8_speedup_geomean_prefill": 1.0,
        "w8a8_speedup_min_decode": 1.0,
        "w8a8_speedup_geomean_prefill": 1.0,
        "w8a8_vs_fp8_min_decode": 1.0,
        "w8a8_vs_fp8_geomean_prefill": 1.0,
        "static_vs_dynamic_min_decode": 1.0,
        "static_vs_dynamic_geomean_prefill": 1.0,
        "static_inside_vs_first_min_prefill": 1.0,
        "cublas_fp8_vs_w8a8_per_row_geomean_prefill": 1.0,
        # none 5% faster than the default
        "best_candidate_per_regime": {"decode": None, "prefill": None, "prefill_w8a8": None},
        "inaccurate": [],
    }
    table, w8a8 = bench_fp8_linear.format_table(doc), bench_fp8_linear.w8a8_table(doc)
    assert table.count("\n") == 1 + len(doc["rows"]) and "| qkv | 192 x 64 | 1 | 1000.0 |" in table
    assert (
        w8a8.count("\n") == 1 + len(doc["rows"]) and "| qkv | 1 | 1000.0 | 1000.0 | 1000.0 | 1000.0 |" in w8a8
    )
    assert capsys.readouterr().out.endswith(table + "\n\n" + w8a8 + "\n")
    report = out.with_suffix(".md").read_text()
    assert table in report and w8a8 in report and f"| proj | rows | {' | '.join(labels)} |" in report
    assert "Candidate tiles (kernels.fp8_linear.CANDIDATES), fp8 activations, prefill rows" in report
    assert "decode none, prefill none" in report and "on every prefill row: none" in report
    assert "cuBLAS's fp8 GEMM against the per-row W8A8 at prefill: 1.00x" in report
    assert "quantizing x inside the product against first at prefill: least 1.00x" in report


def test_the_default_tiles_are_timed_once_when_they_are_a_candidate(backend, monkeypatch, gpu_command_on_cpu):
    interpreted_only(backend)
    fp8 = bench_fp8_linear.fp8_linear
    monkeypatch.setattr(
        fp8, "default_config", lambda rows, fp8_activations=False: fp8.CANDIDATES["m16 n32 k128 s4"]
    )
    timed = []
    monkeypatch.setattr(timing, "time_ms", lambda fn: timed.append(fn()) or 1.0)
    row = bench_fp8_linear.bench_row(
        Projection("o", 64, 64), 3, weight(64, 64), torch.Generator().manual_seed(0)
    )
    # bf16, the default, per row, both W8A8, cuBLAS fp8, W8A8 with x quantized inside and first, the static
    # W8A8 by default and inside, the other candidates (W8A8's: prefill rows only)
    assert len(timed) == 10 + len(fp8.CANDIDATES) - 1
    assert row["default"] == "m16 n32 k128 s4" and row["candidates_us"]["m16 n32 k128 s4"] == row["fp8_us"]
    doc = {"device": {"name": "CPU", "copy_gbs": 100.0}, "rows": [row], "model": {"dtype": "bf16"},
           "summary": bench_fp8_linear.summarize([row]), "command": "c", "timing": "t"}  # fmt: skip
    report = bench_fp8_linear.format_markdown(doc)
    assert "| o | 3 | **1000.0*** |" in report  # the default in bold, the fastest marked *


# NOTE: the default tier: one variant of 16-bit activations, a tile candidate, one of fp8 activations
@pytest.mark.parametrize(
    "wrong",
    [
        v if v in ("fp8_per_row", "m32 n64 k128", "w8a8_separate") else pytest.param(v, marks=SLOW)
        for v in ("bf16", "fp8", "fp8_per_row", "m32 n64 k128", "w8a8", "w8a8_per_row", "cublas_fp8",
                  "w8a8_fused", "w8a8_separate", "w8a8_static", "w8a8_static_fused")
    ],
)  # fmt: skip
def test_a_wrong_output_is_caught_and_marked(backend, monkeypatch, gpu_command_on_cpu, wrong):
    """One variant's output 10% off, and its replay the fastest: the row says it failed its check, the
    table and summary say so, and a wrong candidate is never the best however fast."""
    interpreted_only(backend)
    fp8, F = bench_fp8_linear.fp8_linear, bench_fp8_linear.F
    kernel, linear, last = fp8.fp8_linear, F.linear, []

    def off(name: str, out: torch.Tensor) -> torch.Tensor:
        last.append(name)
        return out * 1.1 if name == wrong else out

    def fp8_call(
        x, w, scale, block=None, bias=None, config=None, fp8_activations=False, fuse_quantization=None,
        input_scale=None,
    ):  # fmt: skip
        name = next((label for label, cfg in fp8.CANDIDATES.items() if cfg == config), None)
        name = name or ("fp8" if block else "w8a8_static" if input_scale is not None else "fp8_per_row")
        name = name.replace("fp8", "w8a8") if fp8_activations and input_scale is None else name
        name += {None: "", True: "_fused", False: "_separate"}[fuse_quantization]
        out = kernel(x, w, scale, block, bias, config, fp8_activations, fuse_quantization, input_scale)
        return off(name, out)

    cublas = bench_fp8_linear.cublas_fp8
    monkeypatch.setattr(fp8, "fp8_linear", fp8_call)
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: off("bf16", linear(x, w, b)))
    monkeypatch.setattr(bench_fp8_linear, "cublas_fp8", lambda x, w: off("cublas_fp8", cublas(x, w)))
    monkeypatch.setattr(timing, "time_ms", lambda fn: fn() or (0.5 if last[-1] == wrong else 1.0))
    row = bench_fp8_linear.bench_row(
        Projection("o", 64, 64), 3, weight(64, 64), torch.Generator().manual_seed(0)
    )
    assert row["wrong"] == [wrong] and row["rel_err"][wrong] > 0.05
    assert all(e < 2e-2 for name, e in row["rel_err"].items() if name != wrong)
    times = {name: row[f"{name}_us"] for name in VARIANTS} | row["candidates_us"]
    assert times[wrong] == 500.0 and all(us == 1000.0 for name, us in times.items() if name != wrong)
    assert row["best_candidate"] not in (None, wrong)
    summary = bench_fp8_linear.summarize([row])
    assert summary["inaccurate"] == [f"o x 3 rows: {wrong}"]
    assert f"| WRONG: {wrong} |" in bench_fp8_linear.format_table(
        {"device": {"copy_gbs": 100.0}, "rows": [row]}
    )


def test_a_candidate_that_fails_is_recorded_and_the_row_goes_on(backend, monkeypatch, gpu_command_on_cpu):
    interpreted_only(backend)
    fp8 = bench_fp8_linear.fp8_linear
    kernel, broken = fp8.fp8_linear, fp8.CANDIDATES["m64 n128 k64"]

    def fp8_call(
        x, w, scale, block=None, bias=None, config=None, fp8_activations=False, fuse_quantization=None,
        input_scale=None,
    ):  # fmt: skip
        if config == broken:
            raise RuntimeError("out of shared memory")
        return kernel(x, w, scale, block, bias, config, fp8_activations, fuse_quantization, input_scale)

    monkeypatch.setattr(fp8, "fp8_linear", fp8_call)
    row = bench_fp8_linear.bench_row(
        Projection("o", 64, 64), 3, weight(64, 64), torch.Generator().manual_seed(0)
    )
    assert row["candidate_errors"] == {"m64 n128 k64": "RuntimeError: out of shared memory"}
    assert row["candidates_us"]["m64 n128 k64"] is None and "m64 n128 k64" not in row["rel_err"]
    assert row["wrong"] == [] and row["best_candidate"] not in (None, "m64 n128 k64")
    assert bench_fp8_linear.regime_candidate([row]) is None  # every time 1 ms: none faster


def test_cublas_refusing_a_shape_is_recorded_and_the_row_goes_on(backend, monkeypatch, gpu_command_on_cpu):
    """torch._scaled_mm refuses some shapes on some GPUs: the row records why, its time is None, the table
    says '-', and the summary's cuBLAS comparison leaves the row out."""
    interpreted_only(backend)

    def refuse(x, w):
        raise RuntimeError("mat1 rows must be a multiple of 16")

    monkeypatch.setattr(bench_fp8_linear, "cublas_fp8", refuse)
    row = bench_fp8_linear.bench_row(
        Projection("o", 64, 64), 3, weight(64, 64), torch.Generator().manual_seed(0)
    )
    assert row["candidate_errors"] == {"cublas_fp8": "RuntimeError: mat1 rows must be a multiple of 16"}
    assert row["cublas_fp8_us"] is None and "cublas_fp8" not in row["rel_err"] and row["wrong"] == []
    table = bench_fp8_linear.w8a8_table({"rows": [row]})
    assert "| o | 3 | 1000.0 | 1000.0 | 1000.0 | 1000.0 | 1000.0 | 1000.0 | 1000.0 | 1000.0 | - |" in table
    assert bench_fp8_linear.summarize([row])["cublas_fp8_vs_w8a8_per_row_geomean_prefill"] is None


def timed_row(
    rows: int,
    default_us: float,
    wrong: tuple[str, ...] = (),
    speedup: float = 1.0,
    **candidates_us: float | None,
) -> dict:
    """A made-up row: the default's time, each candidate's (None: it failed), the default's speed-up over
    bf16 cuBLAS, the outputs that failed their check; its W8A8 form the same, twice as fast (cuBLAS's fp8
    GEMM as fast as the per-row W8A8)."""
    return {"rows": rows, "fp8_us": default_us, "candidates_us": candidates_us, "wrong": list(wrong),
            "fp8_speedup": speedup, "w8a8_us": default_us / 2, "w8a8_speedup": 2 * speedup,
            "w8a8_vs_fp8": 2.0, "w8a8_per_row_us": default_us / 2, "cublas_fp8_us": default_us / 2,
            "static_vs_dynamic": 1.25, "w8a8_static_us": default_us / 2.5, "w8a8_static_fused_us": default_us / 2,
            "w8a8_candidates_us": {label: us and us / 2 for label, us in candidates_us.items()}}  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "picked"),
    [
        ([timed_row(1, 106, a=100, b=104), timed_row(16, 212, a=200, b=150)], "a"),  # b: 1.02x on the first
        ([timed_row(1, 110, a=100), timed_row(16, 104, a=100)], None),  # 1.10x, then only 1.04x
        ([timed_row(1, 105, a=100), timed_row(16, 105, a=100)], "a"),  # 1.05x on both: enough
        ([timed_row(1, 110, a=100, b=104), timed_row(16, 120, a=100, b=100)], "a"),  # a: least 1.10, b 1.06
        ([timed_row(1, 150, ("a",), a=100, b=140), timed_row(16, 150, a=100, b=140)], "b"),  # a wrong once
        ([timed_row(1, 150, a=None, b=140), timed_row(16, 150, a=100, b=140)], "b"),  # a failed once
        ([timed_row(1, 100, a=100), timed_row(16, 100, a=120)], None),  # the default's own tiles, and slower
        ([], None),
    ],
)
def test_a_regime_takes_a_candidate_only_if_5_percent_faster_on_every_row(rows, picked):
    assert bench_fp8_linear.regime_candidate(rows) == picked
    # the W8A8 candidates by the same rule, against the W8A8 default; their failed checks "w8a8_<label>"
    for r in rows:
        r["wrong"] = [f"w8a8_{label}" for label in r["wrong"]]
    assert bench_fp8_linear.regime_candidate(rows, variant="w8a8") == picked


def test_the_summary_splits_the_rows_by_regime():
    """Decode is 16 rows or fewer, prefill 256 or more; 64 rows is neither."""
    rows = [timed_row(1, 100, speedup=2.0, a=90), timed_row(16, 200, speedup=4.0, a=180),
            timed_row(64, 100, speedup=0.1, a=200, b=200),  # NOTE: in either regime, it would change all
            timed_row(256, 50, speedup=1.0, b=40), timed_row(2048, 400, speedup=16.0, b=300)]  # fmt: skip
    summary = bench_fp8_linear.summarize(rows)
    assert summary["fp8_speedup_min_decode"] == 2.0  # the least of 2.0 and 4.0
    assert summary["fp8_speedup_geomean_prefill"] == pytest.approx(4.0)  # of 1.0 and 16.0
    assert summary["best_candidate_per_regime"] == {"decode": "a", "prefill": "b", "prefill_w8a8": "b"}
    assert summary["w8a8_speedup_min_decode"] == 4.0 and summary["w8a8_vs_fp8_geomean_prefill"] == 2.0
    assert summary["w8a8_speedup_geomean_prefill"] == pytest.approx(8.0)
    assert summary["cublas_fp8_vs_w8a8_per_row_geomean_prefill"] == 1.0
    assert summary["static_vs_dynamic_min_decode"] == summary["static_vs_dynamic_geomean_prefill"] == 1.25
    assert summary["static_inside_vs_first_min_prefill"] == pytest.approx(0.8)  # NOTE: first is faster here


def test_the_rows_and_quick_flags():
    assert bench_fp8_linear.parse_args([]).rows == [1, 16, 64, 256, 2048]
    assert bench_fp8_linear.parse_args(["--quick"]).rows == list(bench_fp8_linear.QUICK_ROWS)
    assert bench_fp8_linear.parse_args(["--rows", "3,40", "--quick"]).rows == [3, 40]
    for bad in ("1,x", "0,4"):
        with pytest.raises(SystemExit):
            bench_fp8_linear.parse_args(["--rows", bad])


def test_it_measures_nothing_without_a_gpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench_fp8_linear.main(["--quick", "--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
