"""kernels.bench_rules: each waiting candidate's rule read off a kernels.bench result, and the next step."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import bench_report, bench_rules, extend_attention
from tests.kernels.test_bench import synthetic_result

LONG = bench_report.LONG_CONTEXT
H200_RUN = Path(__file__).parents[2] / "docs/benchmarks/kernels-nvidia-h200-2026-11-29-2.json"


def decode_row(batch: int, context: int, ms: float, **candidates: float) -> dict:
    """A decode row whose default took ``ms`` and each candidate its own time (single replays)."""
    row = {"batch": batch, "context": context, "triton_gbs": 100.0, "triton_graph_ms": ms}
    return row | {f"triton_{name}_graph_ms": t for name, t in candidates.items()}


def with_decode(rows: list[dict]) -> dict:
    result = synthetic_result()
    result["decode"] = rows
    return result


def command(step: tuple[int, str]) -> str:
    return f"GPU_BENCH_DEADLINE={step[0]} bash scripts/gpu-bench {step[1]}"


def taken(decisions: list[bench_rules.Decision], rule: str) -> list[bool | None]:
    return [d.taken for d in decisions if d.rule == rule]


def test_the_slots_ahead_are_taken_below_many_requests_only_where_no_other_row_loses():
    rows = [decode_row(1, LONG, 0.0338, slots=0.0320, pipelined=0.0330),  # slots 1.056x, pipelined 1.024x
            decode_row(8, 1024, 0.0100, slots=0.0101, pipelined=0.0090),  # slots 0.990x: within 0.98
            decode_row(32, LONG, 0.2000, slots=0.1900, pipelined=0.2100)]  # fmt: skip
    decisions = bench_rules.decide(with_decode(rows))
    first = next(d for d in decisions if d.rule == "1(a)")
    assert first.taken is True and "`slots`" in first.what
    assert taken(decisions, "1(b)") == [True]  # from 16 requests: 1.053x, the least and the most
    assert bench_rules.next_step(decisions) == command(bench_rules.FP8_ENGINE)
    rows[1]["triton_slots_graph_ms"] = 0.0103  # 0.971x at 8 x 1k: slots would cost there
    assert taken(bench_rules.decide(with_decode(rows)), "1(a)") == [False]


def test_the_pipelined_tiles_taken_send_the_decode_tune_next():
    rows = [decode_row(1, LONG, 0.0338, slots=0.0330, pipelined=0.0310),
            decode_row(8, 1024, 0.0100, slots=0.0100, pipelined=0.0099)]  # fmt: skip
    decisions = bench_rules.decide(with_decode(rows))
    first = next(d for d in decisions if d.rule == "1(a)")
    assert first.taken is True and "`pipelined`" in first.what
    assert taken(decisions, "1(b)") == [None]  # no row from 16 requests timed it
    assert bench_rules.next_step(decisions) == command(bench_rules.TUNE_DECODE)
    rows[1]["triton_pipelined_graph_ms"] = 0.0110  # the faster at 1 x 16k loses 9% at 8 x 1k: neither taken
    decisions = bench_rules.decide(with_decode(rows))
    assert taken(decisions, "1(a)") == [False] and bench_rules.next_step(decisions) == command(
        bench_rules.FP8_ENGINE
    )


def test_pdl_joins_only_a_candidate_taken_and_only_where_it_passes_the_same_test():
    rows = [decode_row(1, LONG, 0.0338, slots=0.0320, slots_pdl=0.0310),
            decode_row(8, 1024, 0.0100, slots=0.0100, slots_pdl=0.0105)]  # fmt: skip
    assert taken(bench_rules.decide(with_decode(rows)), "1(c)") == [False, None]  # 0.952x at 8 x 1k
    rows[1]["triton_slots_pdl_graph_ms"] = 0.0099
    assert taken(bench_rules.decide(with_decode(rows)), "1(c)") == [True, None]
    rows[0]["triton_slots_graph_ms"] = 0.0340  # slots itself not taken: PDL does not join alone
    assert taken(bench_rules.decide(with_decode(rows)), "1(c)") == [False, None]


def test_fp8_rules_are_read_per_regime_of_the_fp8_tiles():
    def fp8(short_tiles: float, flip_f16: float, pdl: float, slots: float | None = None) -> dict:
        over = {"short_tiles": short_tiles, "flip_f16": flip_f16, "pdl": pdl, "slots": slots}
        return {f"fp8_default_over_{name}": x for name, x in over.items() if x is not None}

    rows = [decode_row(1, LONG, 0.030) | fp8(0.93, 1.10, 0.94, 0.97),
            decode_row(8, 4096, 0.010) | fp8(1.20, 0.99, 0.90, 0.99),
            decode_row(32, 4096, 0.050) | fp8(1.05, 0.98, 1.00)]  # fmt: skip
    decisions = bench_rules.decide(with_decode(rows))
    # (a): one row of a regime under 0.95 sends that regime back; (b), (c), (e): every row of it must agree
    assert taken(decisions, "11(a)") == [True, False]
    assert taken(decisions, "11(b)") == [False, True]
    assert taken(decisions, "11(c)") == [True, False]
    assert taken(decisions, "11(e)") == [False, None]
    assert bench_rules.next_step(decisions) == command(bench_rules.TUNE_FP8_DECODE)


def test_the_eager_split_is_judged_from_the_deep_prefix_on():
    assert bench_rules.DEEP_PREFIX == extend_attention.DEEP_PREFIX
    result = synthetic_result()
    result["extend"] = [
        {"batch": 4, "prefix": 4096, "new": 256, "triton_tflops": 100.0, "triton_split_tflops": 50.0},
        {"batch": 1, "prefix": 16384, "new": 1024, "triton_tflops": 100.0, "triton_unsplit_tflops": 100.0,
         "triton_split_tflops": 103.0},
    ]  # fmt: skip
    assert taken(bench_rules.decide(result), "2") == [False]  # the 0.5x row is below the deep prefix
    result["extend"][1]["triton_split_tflops"] = 97.0
    assert taken(bench_rules.decide(result), "2") == [True]


def test_the_short_extends_slots_bound_widens_when_decode_takes_the_slots():
    result = with_decode(
        [decode_row(1, LONG, 0.0338, slots=0.0320), decode_row(8, 1024, 0.0100, slots=0.0100)]
    )
    times = {"short_graph_ms": 0.010, "short_slots_graph_ms": 0.0101, "short_narrow_graph_ms": 0.0098,
             "short_wide_graph_ms": 0.0096}  # fmt: skip
    result["verify"] = [{"batch": 1, "prefix": 4096, "new": 5, **times}]
    decisions = bench_rules.decide(result)
    assert taken(decisions, "20(a)") == [True] and taken(decisions, "20(b)") == [False]
    assert taken(decisions, "20(c)") == [True]  # 1.01: within 1.02 as decode takes the slots
    result["decode"][0]["triton_slots_graph_ms"] = 0.0340
    assert taken(bench_rules.decide(result), "20(c)") == [False]  # alone it must win by 2%


def test_the_command_reads_a_committed_run_and_ends_with_the_next_step(tmp_path, capsys):
    assert bench_rules.main([str(H200_RUN)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("# ") for line in lines[:-1]) and len(lines) == 2 + 17
    # that run predates the candidates: they read untimed; its fp8 extend is the bound itself (not above it)
    assert any(line.startswith("# 1(a)   untimed") for line in lines)
    assert any(line.startswith("# 11(d)  TAKE") for line in lines)
    assert lines[-1] == command(bench_rules.TUNE_FP8_EXTEND)
    # what the device call has left bounds the step's deadline, the packing's margin kept
    assert bench_rules.main([str(H200_RUN), "--seconds", "150"]) == 0
    deadline = 150 - bench_rules.MARGIN_S
    assert capsys.readouterr().out.splitlines()[-1] == command((deadline, bench_rules.TUNE_FP8_EXTEND[1]))
    bad = tmp_path / "cut.json"
    bad.write_text(H200_RUN.read_text()[:5000])
    assert bench_rules.main([str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        bench_rules.main([])
    assert stop.value.code == 2 and "usage" in capsys.readouterr().err
