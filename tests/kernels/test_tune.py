"""kernels.tune: every candidate runs and is checked against SDPA; the fastest accurate one wins; a
failing or inaccurate candidate is recorded and never chosen. On CPU the kernels run interpreted and
only the CUDA-event timer is replaced (by a made-up time per configuration)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import bench, timing, tune
from tests.support import SLOW

MODEL = bench.Model(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="fp32")


def fake_time(times: list[tuple[dict, float]]) -> object:
    """A timer under which each listed configuration takes its time (ms) and every other 2 ms."""

    def time_ms(call) -> float:
        cfg = dataclasses.asdict(call.__defaults__[0])  # the candidate the tuner bound to ``call``
        return next((ms for c, ms in times if c == cfg), 2.0)

    return time_ms


def test_best_row_skips_failed_and_inaccurate_rows():
    rows = [
        {"config": {"a": 1}, "error": "OutOfResources: shared memory"},
        {"config": {"a": 2}, "rel_err": 0.5, "error": "inaccurate"},
        {"config": {"a": 3}, "rel_err": 1e-3, "ms": 3.0},
        {"config": {"a": 4}, "rel_err": 1e-3, "ms": 2.0},
    ]
    assert tune.best_row(rows)["config"] == {"a": 4}
    assert tune.best_row(rows[:2]) is None


def test_a_candidate_that_raises_or_computes_wrong_is_recorded_not_chosen():
    ref = torch.ones(4, 2)
    wrong = tune.try_config(lambda: torch.zeros(4, 2), ref, bench.DecodeShape(1, 1))
    assert "inaccurate" in wrong["error"] and "ms" not in wrong

    def boom() -> torch.Tensor:
        raise RuntimeError("out of resource: shared memory, Required: 262144")

    failed = tune.try_config(boom, ref, bench.DecodeShape(1, 1))
    assert failed["error"].startswith("RuntimeError: out of resource") and "ms" not in failed


def test_run_candidates_records_statically_rejected_configs_without_launching(monkeypatch):
    from kernels.decode_attention import DecodeConfig

    monkeypatch.setattr(timing, "time_ms", fake_time([]))
    spills, fine = DecodeConfig(128, 256, 2, 2), DecodeConfig(64, 256, 4, 2)
    launched = []

    def launch(cfg):
        launched.append(cfg)
        return torch.ones(2)

    rejected = {tune.config_key(spills): "static check: spills 56 B/thread"}
    rows = tune.run_candidates([spills, fine], launch, torch.empty(2), torch.ones(2), rejected)
    assert launched == [fine]
    assert rows[0] == {"config": dataclasses.asdict(spills), "error": "static check: spills 56 B/thread"}
    assert "error" not in rows[1] and rows[1]["rel_err"] == 0.0 and rows[1]["ms"] == 2.0
    assert tune.best_row(rows)["config"] == dataclasses.asdict(fine)


# NOTE: full tier: the spill verdict it reads is kernels.compile_check.compile_rows', whose spilling case runs in
# test_compile_check.py (the command's test here skips the static check)
@SLOW
def test_static_check_rejects_a_spilling_candidate_and_keeps_the_default():
    """Compiles for sm_90 in a child process (this one has the kernels imported interpreted)."""
    code = textwrap.dedent("""\
        from kernels import bench, compile_cases, tune
        from kernels.extend_attention import ExtendConfig, default_config
        import torch
        model = bench.Model(32, 8, 128, "bf16")
        shape = compile_cases.Shape("bf16", 32, 8, 128, 4096)
        default, big = default_config(128, torch.bfloat16), ExtendConfig(128, 128, 4, 2)
        cases = [(*compile_cases.extend_case(shape, c, "x"), c) for c in (default, big)]
        rejected = tune.static_check(model, 90, cases)
        print(sorted(rejected) == [tune.config_key(big)], rejected[tune.config_key(big)])
        """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    verdict, _, reason = proc.stdout.strip().splitlines()[-1].partition(" ")
    assert verdict == "True", proc.stdout
    assert "spills" in reason and "sm_90" in reason


@pytest.mark.slow
def test_extend_and_decode_candidates_all_run_and_the_fastest_wins(backend, monkeypatch):
    if not backend.interpret:
        pytest.skip("the real timing runs in python -m kernels.tune")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)

    want = dataclasses.asdict(tune.extend_candidates()[5])
    monkeypatch.setattr(timing, "time_ms", fake_time([(want, 1.0)]))
    result = tune.tune_extend(bench.ExtendShape(batch=2, prefix=5, new=9), MODEL, backend.device, gen)
    assert len(result["rows"]) == len(tune.extend_candidates()) + 1  # + the interpreter's own default
    assert all("error" not in r and r["rel_err"] < 1e-4 for r in result["rows"]), result["rows"]
    assert result["best"]["config"] == want
    assert result["default"]["ms"] == 2.0 and result["speedup_vs_default"] == 2.0

    decode_tiles = tune.decode_candidates(16)  # the interpreter's default split length
    tile = dataclasses.asdict(decode_tiles[3])
    length = {**tile, "min_split_len": 64}
    want = {**length, "split_waves": 8}
    # decode is timed as graph replays (the eager timer would fail the test if used)
    monkeypatch.setattr(timing, "time_ms", None)
    monkeypatch.setattr(timing, "time_replay_ms", fake_time([(tile, 1.5), (length, 1.2), (want, 1.0)]))
    result = tune.tune_decode(bench.DecodeShape(batch=3, context=40), MODEL, backend.device, gen)
    # the default and every tile first; then every split length on the fastest tile, then every
    # number of waves on the fastest tile and length, then the fastest with its merge fused, then the
    # fastest launched as programmatic dependents, then the fastest with its slots a tile ahead
    waves = len(tune.SPLIT_WAVES) - 1
    assert len(result["rows"]) == 1 + len(decode_tiles) + len(tune.SPLIT_LENGTHS) + waves + 3
    assert all("error" not in r and r["rel_err"] < 1e-4 for r in result["rows"]), result["rows"]
    lengths, wave_rows = result["rows"][-8 - waves : -3 - waves], result["rows"][-3 - waves : -3]
    assert result["rows"][-3]["config"] == {**want, "fused_merge": True}
    assert result["rows"][-2]["config"] == {**want, "pdl": True}
    assert result["rows"][-1]["config"] == {**want, "prefetch_slots": True}
    # the slots-ahead tiles (3 stages) ran among the tiles
    assert sum(r["config"]["prefetch_slots"] for r in result["rows"][: 1 + len(decode_tiles)]) == 9
    assert [r["config"]["min_split_len"] for r in lengths] == list(tune.SPLIT_LENGTHS)
    assert all(r["config"]["block_n"] == tile["block_n"] for r in lengths)
    assert [r["config"]["split_waves"] for r in wave_rows] == [w for w in tune.SPLIT_WAVES if w != 2]
    assert all(r["config"]["min_split_len"] == 64 for r in wave_rows)
    assert result["best"]["config"] == want and result["speedup_vs_default"] == 2.0
    table = tune.format_table([result])
    assert table.splitlines()[1].startswith("decode batch=3 context=40")


# NOTE: full tier: the command's test tunes every kind, LoRA among them
@SLOW
def test_lora_candidates_all_run_on_the_workers_segments_and_the_fastest_wins(backend, monkeypatch):
    if not backend.interpret:
        pytest.skip("the real timing runs in python -m kernels.tune")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name, value in (("LORA_IN", 200), ("LORA_OUT", 160), ("LORA_RANK", 8)):
        monkeypatch.setattr(bench, name, value)
    want = dataclasses.asdict(tune.lora_candidates()[4])
    monkeypatch.setattr(timing, "time_ms", None)  # LoRA is timed as graph replays, the kernels alone
    monkeypatch.setattr(timing, "time_replay_ms", fake_time([(want, 1.0)]))
    result = tune.tune_lora(20, MODEL, backend.device, torch.Generator().manual_seed(0))
    assert result["kind"] == "lora" and result["shape"] == {"rows": 20, "adapters": 1}
    # every candidate, fp32's own default (32 columns), then the fastest launched as programmatic dependents,
    # then the fastest with the expand's partials several splits a load
    assert len(result["rows"]) == len(tune.lora_candidates()) + 3
    assert all("error" not in r and r["rel_err"] < 1e-5 for r in result["rows"]), result["rows"]
    assert [r["config"] for r in result["rows"][-2:]] == [
        {**want, "pdl": True},
        {**want, "batched_partials": True},
    ]
    assert result["best"]["config"] == want and result["speedup_vs_default"] == 2.0
    assert result["default"]["config"] == {
        "k_per_split": 512,
        "block_n": 32,
        "pdl": False,
        "batched_partials": False,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_tune_without_cuda_exits_nonzero(tmp_path, capsys):
    assert tune.main(["--out", str(tmp_path / "t.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_the_command_tunes_every_kind_and_writes_its_record(
    backend, monkeypatch, tmp_path, gpu_command_on_cpu
):
    """main() end to end on the interpreter, CUDA's parts stood in for (the device, its properties,
    the timers) and each kind cut to one shape and one candidate besides its default: a result per
    shape, the record's head, so a GPU call cannot fail on the command itself."""
    if not backend.interpret:
        pytest.skip("the real timing runs in python -m kernels.tune")
    monkeypatch.setattr(tune, "EXTEND_SHAPES", (bench.ExtendShape(batch=2, prefix=5, new=9),))
    monkeypatch.setattr(tune, "DECODE_SHAPES", (bench.DecodeShape(batch=2, context=40),))
    monkeypatch.setattr(tune, "LORA_ROWS", (3,))
    for name, count in (("extend_candidates", 1), ("decode_candidates", 1), ("lora_candidates", 1)):
        every = getattr(tune, name)
        monkeypatch.setattr(tune, name, lambda *args, every=every, count=count: every(*args)[:count])
    monkeypatch.setattr(tune, "SPLIT_LENGTHS", (64,))
    monkeypatch.setattr(tune, "SPLIT_WAVES", (1,))
    for name, value in (("LORA_IN", 64), ("LORA_OUT", 48), ("LORA_RANK", 8)):
        monkeypatch.setattr(bench, name, value)
    out = tmp_path / "tune.json"
    argv = ["--no-static-check", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp16"]
    assert tune.main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"]["name"] == "CPU stand-in" and doc["software"]["python"] and doc["max_rel_err"] > 0
    assert [r["kind"] for r in doc["results"]] == ["extend", "decode", "lora"]
    assert all(r["best"] is not None for r in doc["results"]), doc["results"]


def test_decode_over_an_fp8_pool_under_a_bf16_query_also_tries_the_fp16_widening(backend, monkeypatch):
    """Over an fp8 pool under a bf16 q the tuner's last candidate is the best with its tiles widened to fp16
    (DecodeConfig.fp8_f16), checked against SDPA like the rest; over a 16-bit pool it is not tried."""
    if not backend.interpret:
        pytest.skip("the real timing runs in python -m kernels.tune")
    monkeypatch.setattr(
        tune, "decode_candidates", lambda *args, every=tune.decode_candidates: every(*args)[:1]
    )
    monkeypatch.setattr(tune, "SPLIT_LENGTHS", (64,))
    monkeypatch.setattr(tune, "SPLIT_WAVES", (1,))
    monkeypatch.setattr(timing, "time_replay_ms", fake_time([]))
    model, shape = dataclasses.replace(MODEL, dtype="bf16"), bench.DecodeShape(batch=2, context=40)
    gen = torch.Generator().manual_seed(2)
    result = tune.tune_decode(shape, model, backend.device, gen, pool=torch.float8_e4m3fn)
    assert result["rows"][-1]["config"]["fp8_f16"] is True
    assert not any(r["config"]["fp8_f16"] for r in result["rows"][:-1])
    assert all("error" not in r and r["rel_err"] < 2e-2 for r in result["rows"]), result["rows"]
    plain = tune.tune_decode(shape, model, backend.device, gen)
    assert not any(r["config"]["fp8_f16"] for r in plain["rows"])


def test_candidates_over_an_fp8_pool_are_checked_against_the_widened_values(backend, monkeypatch, tmp_path,
                                                                            gpu_command_on_cpu):  # fmt: skip
    """--kv-dtype fp8: the extend prefix and the decode K/V in an fp8 pool, each candidate's output against
    SDPA over the values it stores (a candidate reading them wrong would miss by far more than the bound),
    the pool's own defaults timed, and the record named apart from the 16-bit pool's."""
    if not backend.interpret:
        pytest.skip("the real timing runs in python -m kernels.tune")
    monkeypatch.setattr(tune, "EXTEND_SHAPES", (bench.ExtendShape(batch=2, prefix=21, new=9),))
    monkeypatch.setattr(tune, "DECODE_SHAPES", (bench.DecodeShape(batch=2, context=40),))
    for name in ("extend_candidates", "decode_candidates"):
        every = getattr(tune, name)
        monkeypatch.setattr(tune, name, lambda *args, every=every: every(*args)[:1])
    monkeypatch.setattr(tune, "SPLIT_LENGTHS", (64,))
    monkeypatch.setattr(tune, "SPLIT_WAVES", (1,))
    out = tmp_path / "kernels-tune-fp8.json"
    argv = ["--no-static-check", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp16"]
    assert tune.main([*argv, "--kind", "extend", "--out", str(out)]) == 0
    assert tune.main([*argv, "--kind", "decode", "--kv-dtype", "fp8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kv_dtype"] == "float8_e4m3fn"  # the stand-in reports sm_90
    [decode] = doc["results"]
    assert decode["kind"] == "decode" and len(decode["rows"]) >= 2
    assert all("error" not in r and r["rel_err"] < 3e-3 for r in decode["rows"]), decode["rows"]
    gen = torch.Generator().manual_seed(1)
    extend = tune.tune_extend(bench.ExtendShape(batch=2, prefix=21, new=9), MODEL, backend.device, gen,
                              pool=torch.float8_e5m2)  # fmt: skip
    assert all("error" not in r and r["rel_err"] < 1e-4 for r in extend["rows"]), extend["rows"]


BENCHMARKS = Path(__file__).resolve().parents[2] / "docs/benchmarks"


def test_the_sm90_fp8_pool_defaults_follow_the_h200_tune(monkeypatch):
    """The committed H200 tunes over an fp8 pool (2026-11-29): in decode, widening to fp16 made each
    shape's fastest tile at least 1.4x the previous default (FP8_SHORT_TILES, the tune's default then), and
    widening paid on each of those tiles; FP8_TILES and FP8_MANY_TILES widen. In extend, FP8_PREFIX_TILES
    ran at least 1.18x the default on every shape with a prefix, and default_config takes them there."""
    from kernels import decode_attention as dec
    from kernels import extend_attention as ext

    decode = json.loads((BENCHMARKS / "kernels-tune-fp8-decode-nvidia-h200-2026-11-29-2.json").read_text())
    assert decode["kv_dtype"] == "float8_e4m3fn" and len(decode["results"]) == 3
    for r in decode["results"]:
        assert dec.DecodeConfig(**r["default"]["config"]) == dec.FP8_SHORT_TILES
        best = dec.DecodeConfig(**r["best"]["config"])
        assert best.fp8_f16 and r["speedup_vs_default"] >= 1.4, r["shape"]
        unwidened = dataclasses.replace(best, fp8_f16=False)
        times = {dec.DecodeConfig(**row["config"]): row["ms"] for row in r["rows"] if "ms" in row}
        assert times[unwidened] > 1.1 * times[best], r["shape"]
    assert dec.FP8_TILES.fp8_f16 and dec.FP8_MANY_TILES.fp8_f16
    extend = json.loads((BENCHMARKS / "kernels-tune-fp8-extend-nvidia-h200-2026-11-29-2.json").read_text())
    monkeypatch.setattr(ext, "INTERPRETED", False)
    with_prefix = [r for r in extend["results"] if r["shape"]["prefix"] > 0]
    assert len(with_prefix) == 4
    for r in with_prefix:
        times = {ext.ExtendConfig(**row["config"]): row["ms"] for row in r["rows"] if "ms" in row}
        assert r["default"]["ms"] / times[ext.FP8_PREFIX_TILES] >= 1.18, r["shape"]
        shape = r["shape"]
        chosen = ext.default_config(128, torch.bfloat16, 90, shape["prefix"], shape["batch"] * shape["new"],
                                    torch.float8_e4m3fn)  # fmt: skip
        assert chosen == ext.FP8_PREFIX_TILES
