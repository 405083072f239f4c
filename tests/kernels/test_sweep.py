"""kernels.sweep: the committed H100 sweep against the worker's extend tile rule, the report, and the
sweep's rows run end to end on the interpreter."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from kernels import bench, sweep, timing
from tests.support import SLOW

SWEEP = Path(__file__).resolve().parents[2] / "docs/benchmarks/kernels-sweep-nvidia-h100-80gb-hbm3.json"
# the run that measured the prefix split (extend graphs included)
SPLIT_SWEEP = SWEEP.with_name("kernels-sweep-split-nvidia-h100-80gb-hbm3.json")
# the run that measured the extend graphs' three captures and decode's tile choices over batch x context
TILES_SWEEP = SWEEP.with_name("kernels-sweep-tiles-nvidia-h100-80gb-hbm3.json")
# decode_tiles again, with the tile rule that run set applied
APPLIED_SWEEP = SWEEP.with_name("kernels-sweep-tiles-applied-nvidia-h100-80gb-hbm3.json")
LAUNCH_BOUND_MS = 0.05  # calls this short differ by launch noise between the tiles (a few us)


@pytest.fixture
def compiled_choice(monkeypatch):
    """default_config as compiled for sm_90 (the interpreter takes tiny tiles)."""
    from kernels import extend_attention as ext

    monkeypatch.setattr(ext, "INTERPRETED", False)


def test_the_default_extend_tiles_follow_the_h100_sweep(compiled_choice):
    """On every row of the committed sweep the tiles default_config takes are within 8% of the faster
    of the two, and it takes the long-prefix tiles only where they won by at least 4%."""
    rows = json.loads(SWEEP.read_text())["extend"]
    assert len(rows) == len(sweep.EXTEND_SHAPES)
    took_long = 0
    for r in rows:
        shape = f"prefix {r['prefix']}, {r['batch']} x {r['new']}"
        long = sweep.picks_long_prefix(r)
        took_long += long
        chosen = r["long_prefix_ms"] if long else r["small_ms"]
        if long:
            assert r["long_prefix_speedup"] >= 1.04, shape
        if min(r["small_ms"], r["long_prefix_ms"]) >= LAUNCH_BOUND_MS:
            assert chosen <= 1.08 * min(r["small_ms"], r["long_prefix_ms"]), shape
        assert r["rel_diff"] < 2e-3, shape  # both tiles compute the same attention
    assert took_long >= 10


def test_eager_calls_split_only_where_the_h100_sweep_split_their_tiles_faster(compiled_choice):
    """default_config takes the prefix split for eager calls over a prefix of EAGER_SPLIT_MIN_PREFIX tokens
    or more: on every eager row of the split sweep where it does and the grid was small enough to split
    (8 rows, 8,192-32,768 cached tokens), the split of the tiles it takes ran faster than those tiles
    unsplit; below the threshold the split lost on 11 of its 13 rows (0.34-0.99x; 1.01x and 1.10x at 4,096)."""
    from kernels import extend_attention as ext

    rows = json.loads(SPLIT_SWEEP.read_text())["extend"]
    faster, slower_below = 0, 0
    for r in rows:
        shape = f"prefix {r['prefix']}, {r['batch']} x {r['new']}"
        cfg = ext.default_config(128, torch.bfloat16, 90, r["prefix"], r["batch"] * r["new"])
        tiles = "long_prefix" if sweep.picks_long_prefix(r) else "small"
        split_ms = r.get(f"{tiles}_split_ms")
        assert cfg.split_prefix == (r["prefix"] >= ext.EAGER_SPLIT_MIN_PREFIX), shape
        if split_ms is None:
            continue
        if cfg.split_prefix:
            assert split_ms < r[f"{tiles}_ms"], shape
            faster += 1
        else:
            slower_below += split_ms > r[f"{tiles}_ms"]
    assert (faster, slower_below) == (8, 11)


def test_extend_graphs_replay_the_configuration_the_h100_sweep_ran_fastest():
    """The worker replays an extend graph's capture by graph_variant: on every extend-graph row of the H100
    sweep that measured them all (64x32, the default for an unknown prefix; 128x64; 64x32 split) it takes
    the fastest; without the 128x64 capture (before Hopper), the faster of the other two."""
    from kernels import extend_attention as ext

    rows = json.loads(SPLIT_SWEEP.read_text())["extend_graph"]
    assert len(rows) == 24
    taken = {"default": "small_us", "long_prefix": "long_prefix_us", "split": "small_split_us"}
    for r in rows:
        shape = (r["prefix"], r["new"], r["size"])
        fastest = min(taken, key=lambda v: r[taken[v]])
        assert ext.graph_variant(r["prefix"], r["size"], ("long_prefix", "split")) == fastest, shape
        of_two = min(("default", "split"), key=lambda v: r[taken[v]])
        assert ext.graph_variant(r["prefix"], r["size"], ("split",)) == of_two, shape
    variants = [ext.graph_variant(r["prefix"], r["size"], ("long_prefix", "split")) for r in rows]
    assert (variants.count("default"), variants.count("long_prefix"), variants.count("split")) == (4, 7, 13)
    assert all(sweep.replayed_over_fastest(r)[1] == 1.0 for r in rows)


def test_the_replayed_extend_graph_capture_is_within_the_slack_of_the_fastest_on_the_tiles_sweep():
    """The later H100 sweep also timed four cache hits in one graph: on all 32 rows the capture graph_variant
    replays is within VARIANT_SLACK of the fastest (the rule that would move its thresholds)."""
    rows = json.loads(TILES_SWEEP.read_text())["extend_graph"]
    assert len(rows) == 32 and sum(r.get("requests", 1) == 4 for r in rows) == 8
    assert all(sweep.replayed_over_fastest(r)[1] <= 1.0 + sweep.VARIANT_SLACK for r in rows)


def test_the_default_decode_tiles_follow_the_h100_tile_sweep(monkeypatch):
    """What decode_tile_rule printed for the committed sweep (64/2/3 from 16 requests) is what default_config
    takes for sm_90, bf16, head dim 128: that tile from that batch on, within 2% of the fastest there, the
    former default below; and the rows as the next sweep will record them (each row's default the tiles
    default_config takes for its batch) ask for no further change."""
    from kernels import decode_attention as dec

    monkeypatch.setattr(dec, "INTERPRETED", False)
    doc = json.loads(TILES_SWEEP.read_text())
    rows, sms, hkv = doc["decode_tiles"], doc["device"]["sm_count"], doc["model"]["num_kv_heads"]
    resident = sweep.decode_residency(doc)
    rule = sweep.decode_tile_rule(rows, sms, resident, hkv)
    assert (rule["change"], rule["tile"], rule["from_batch"]) == ("tile", "64/2/3", dec.MANY_REQUESTS)
    applied = []
    for r in rows:
        chosen = sweep.config_label(dec.default_config(128, torch.bfloat16, 90, r["batch"]))
        assert chosen == (rule["tile"] if r["batch"] >= rule["from_batch"] else r["default"]), r["batch"]
        if r["batch"] >= rule["from_batch"]:
            assert r["us"][chosen] <= 1.02 * min(r["us"].values()), (r["batch"], r["context"])
        applied.append(r | {"default": chosen, "splits": {chosen: r["splits"][chosen]}, "split_us": {}})
    assert sweep.decode_tile_rule(applied, sms, resident, hkv)["change"] is None
    # the same, measured: the sweep run again on the H100 with the change
    after = json.loads(APPLIED_SWEEP.read_text())
    assert [r["default"] for r in after["decode_tiles"]] == [r["default"] for r in applied]
    rule = sweep.decode_tile_rule(after["decode_tiles"], sms, sweep.decode_residency(after), hkv)
    assert rule["change"] is None and "wins on 1 rows" in rule["why"]  # 8 x 64k: 64/2/3 1.03x
    # before Hopper, and in fp32, the batch changes nothing
    assert dec.default_config(128, torch.bfloat16, 80, 64) == dec.default_config(128, torch.bfloat16, 80)
    assert dec.default_config(128, torch.float32, 90, 64) == dec.default_config(128, torch.float32, 90)


def test_the_report_has_every_row_and_says_what_the_default_takes(compiled_choice):
    doc = json.loads(SWEEP.read_text())
    text = sweep.markdown(doc)
    table = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == len(doc["extend"]) + len(doc["decode"]) // 2
    assert "| 16384 | 1 x 1024 | 1024 | 1.529 | 1.054 | 1.45 | 128x64 |" in text
    assert "| 16384 | 8 x 1024 | 8192 | 7.878 | 8.325 | 0.95 | 64x32 |" in text
    # the default split count, marked; the committed run predates the prefetch variant
    assert "| 16384 | 33* | 33.3 | 2,017 | 32.2 | 2,085 | - | - | - | - |" in text


def test_the_decode_table_has_a_prefetch_column_when_the_run_measured_it():
    doc = json.loads(SWEEP.read_text())
    row = next(r for r in doc["decode"] if r["context"] == 16384 and r["default"] and not r["pdl"])
    doc["decode"].append({**row, "prefetch": True, "us": 30.0, "gbs": 2236.0})
    doc["decode"].append({**row, "prefetch": True, "pdl": True, "us": 29.0, "gbs": 2313.0})
    text = sweep.markdown(doc)
    assert "| 16384 | 33* | 33.3 | 2,017 | 32.2 | 2,085 | 30.0 | 2,236 | 29.0 | 2,313 |" in text
    assert sum(line.startswith("| 16384 | 33* |") for line in text.splitlines()) == 1  # one row a count
    other = next(line for line in text.splitlines() if line.startswith("| 16384 | 32 | "))
    assert other.endswith("| - | - | - | - |")  # a split count with no prefetch rows


def test_the_report_has_a_graph_table_when_the_graph_sweep_ran():
    doc = json.loads(SWEEP.read_text())
    assert "Extend graphs" not in sweep.markdown(doc)  # the committed run predates that sweep
    doc["extend_graph"] = [{"prefix": 2048, "new": 208, "size": 256, "rows": 32, "small_us": 120.0,
                            "long_prefix_us": 90.0, "long_prefix_speedup": 4 / 3, "rel_diff": 1e-3,
                            "small_split_us": 60.0, "small_split_cap": 3, "small_one_row_us": 100.0,
                            "small_split_one_row_us": 45.5, "small_packed_us": 101.0,
                            "small_split_packed_us": 47.0}]  # fmt: skip
    # graph_variant replays long_prefix here (2,048 < 16 x 256 tokens), 1.5x the split's time
    line = (
        "| 2048 | 208 | 256 | 120.0 | 90.0 | 1.33 | 60.0 (3) | - | 100.0 | 45.5 | 101.0 | 47.0 | 1.0e-03 "
        "| long_prefix 1.50 |"
    )
    assert line in sweep.markdown(doc)
    assert "within 5% of the fastest of the three on all rows but 1: 2048 + 208 (long_prefix 1.50x)." in (
        sweep.markdown(doc)
    )
    doc["extend_graph"][0] |= {
        "small_split_us": None,
        "small_split_one_row_us": None,
        "small_split_packed_us": None,
    }
    line = "| 2048 | 208 | 256 | 120.0 | 90.0 | 1.33 | - | - | 100.0 | - | 101.0 | - | 1.0e-03 | long_prefix 1.00 |"
    assert line in sweep.markdown(doc)  # a graph that did not split
    assert "of the fastest of the three on every row." in sweep.markdown(doc)


def test_the_extend_table_shows_the_prefix_split_where_a_row_has_it(compiled_choice):
    doc = json.loads(SWEEP.read_text())  # the committed run predates the split: dashes
    row = next(r for r in doc["extend"] if (r["prefix"], r["batch"], r["new"]) == (2048, 1, 256))
    line = next(x for x in sweep.markdown(doc).splitlines() if x.startswith("| 2048 | 1 x 256 |"))
    assert line.endswith(f"| 128x64 | - | - | {row['rel_diff']:.1e} |")
    row |= {
        "small_split_ms": 0.05,
        "small_split_cap": 5,
        "long_prefix_split_ms": 0.0412,
        "long_prefix_split_cap": 3,
    }
    line = next(x for x in sweep.markdown(doc).splitlines() if x.startswith("| 2048 | 1 x 256 |"))
    assert line.endswith(f"| 128x64 | 0.050 (5) | 0.041 (3) | {row['rel_diff']:.1e} |")


def test_the_command_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    assert sweep.main(["--only", "extend"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# NOTE: full tier: every sweep's rows run in the command's test below; this one each split count and variant
@SLOW
def test_the_sweep_rows_run_on_the_interpreter(backend, monkeypatch):
    """sweep_extend, sweep_extend_graph and sweep_decode with the host clock in place of CUDA timing:
    both tiles' outputs agree, each split count and decode variant (PDL, prefetch) makes its row."""
    if not backend.interpret:
        pytest.skip("on CUDA, python -m kernels.sweep runs these rows for real")

    def once(fn, **_):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(timing, "time_ms", once)
    monkeypatch.setattr(timing, "time_replay_ms", once)
    monkeypatch.setattr(sweep, "DECODE_SPLITS", (2,))
    tiles = sweep.extend_tiles()  # NOTE: 16-token parts, so this short prefix splits
    monkeypatch.setattr(
        sweep, "extend_tiles", lambda: {k: dataclasses.replace(t, min_split_len=16) for k, t in tiles.items()}
    )
    cpu, gen = torch.device("cpu"), torch.Generator().manual_seed(0)
    model = bench.Model(num_q_heads=4, num_kv_heads=2, head_dim=128, dtype="fp16")
    row = sweep.sweep_extend(40, 2, 20, model, cpu, gen)
    assert row["small_ms"] > 0 and row["long_prefix_ms"] > 0 and row["rel_diff"] < 3e-3
    # 4 heads x 1 query block for 4 "SMs" x 2 waves: 2 parts for each tile choice (a wrong split: rel_diff)
    assert row["small_split_ms"] > 0 and row["long_prefix_split_ms"] > 0
    assert row["small_split_cap"] == row["long_prefix_split_cap"] == 2
    assert sweep.sweep_extend(0, 2, 20, model, cpu, gen)["small_split_ms"] is None  # no prefix: no split
    graph = sweep.sweep_extend_graph(40, 5, 8, 1, model, cpu, gen, rows=3)
    assert (graph["prefix"], graph["new"], graph["size"], graph["rows"]) == (40, 5, 8, 3)
    assert graph["small_us"] > 0 and graph["long_prefix_us"] > 0 and graph["rel_diff"] < 3e-3
    assert graph["small_split_us"] > 0 and graph["long_prefix_split_us"] > 0 and graph["small_split_cap"] == 2
    with pytest.raises(ValueError):
        sweep.sweep_extend_graph(40, 5, 8, 2, model, cpu, gen, rows=3)  # 10 new tokens > 8
    assert graph["small_one_row_us"] > 0 and graph["small_split_one_row_us"] > 0  # the one request row alone
    assert graph["small_packed_us"] > 0 and graph["small_split_packed_us"] > 0  # the packed grid
    rows = sweep.sweep_decode(64, model, cpu, gen)
    default = rows[0]["splits"]
    assert [(r["pdl"], r["prefetch"], r["default"], r["splits"]) for r in rows] == [
        (False, False, True, default), (False, False, False, 2), (True, False, True, default),
        (True, False, False, 2), (False, True, True, default), (False, True, False, 2),
        (True, True, True, default), (True, True, False, 2),
    ]  # fmt: skip
    assert all(r["us"] > 0 and r["gbs"] > 0 for r in rows)
    monkeypatch.setattr(sweep, "DECODE_TILES", ((32, 4, 2), (16, 1, 1), (16, 2, 3)))
    tiles = sweep.sweep_decode_tiles(3, 70, model, cpu, gen)
    # the default's first (the interpreter's 16/1/1), each other once; every one agrees with it
    assert list(tiles["us"]) == list(tiles["gbs"]) == ["16/1/1", "32/4/2", "16/2/3"]
    assert tiles["default"] == "16/1/1" and 0 < tiles["rel_diff"] < 3e-3
    assert all(tiles["us"][x] > 0 for x in tiles["us"])
    assert tiles["splits"]["16/1/1"] == 2  # 3 requests x 2 KV heads for 4 "SMs" x 2 waves
    assert list(tiles["split_us"]) == [1, 4] and all(us > 0 for us in tiles["split_us"].values())


def test_the_command_runs_every_sweep_and_writes_its_report(
    backend, monkeypatch, tmp_path, gpu_command_on_cpu
):
    """main() end to end on the interpreter, CUDA's parts stood in for (the device, its properties,
    the timers, the copy rate) and each sweep cut to one shape: the JSON holds a row per shape and
    sweep, the report each table, so a GPU call cannot fail on the command itself."""
    if not backend.interpret:
        pytest.skip("on CUDA, python -m kernels.sweep runs for real")

    monkeypatch.setattr(sweep, "EXTEND_SHAPES", ((40, 1, 20),))
    monkeypatch.setattr(sweep, "GRAPH_SHAPES", ((40, 3, 8, 2),))  # two requests of 3 new tokens
    monkeypatch.setattr(sweep, "DECODE_CONTEXTS", (64,))
    monkeypatch.setattr(sweep, "DECODE_SPLITS", (2,))
    monkeypatch.setattr(sweep, "DECODE_TILE_SHAPES", ((2, 40),))
    monkeypatch.setattr(sweep, "DECODE_TILES", ((32, 4, 2),))
    out = tmp_path / "sweep.json"
    assert sweep.main(["--q-heads", "4", "--kv-heads", "2", "--dtype", "fp16", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == {"name": "CPU stand-in", "sm_count": 2, "arch": 90} and doc["copy_gbs"] == 100.0
    # decode: 2 split caps x 4 variants; decode_tiles: one shape
    assert [len(doc[kind]) for kind in sweep.KINDS] == [1, 1, 8, 1]
    report = out.with_suffix(".md").read_text()
    titles = ("## Extend:", "## Extend graphs:", "## Decode: batch 1", "## Decode: tile choices")
    assert all(title in report for title in titles)
    assert list(doc["decode_tiles"][0]["us"]) == ["16/1/1", "32/4/2"]
    # the graph row: a step of two cache hits (the rows past them empty), every variant right on both
    (two,) = doc["extend_graph"]
    assert two["requests"] == 2 and two["small_split_us"] > 0 and two["rel_diff"] < 3e-3
    assert "| 40 | 2 x 3 | 8 |" in report
    assert "Rule (kernels.sweep.decode_tile_rule): " in report


def test_the_decode_tiles_table_names_the_fastest_and_its_speedup_over_the_default():
    doc = json.loads(SWEEP.read_text())
    assert "## Decode: tile choices" not in sweep.markdown(doc)  # the committed run predates that sweep
    doc["decode_tiles"] = [
        {"batch": 32, "context": 4096, "default": "128/4/2", "us": {"128/4/2": 200.0, "64/2/2": 160.0},
         "gbs": {"128/4/2": 2400.0, "64/2/2": 3000.0}, "splits": {"128/4/2": 2, "64/2/2": 2},
         "split_us": {"1": 170.0, "4": 230.5}, "rel_diff": 1e-3},
        {"batch": 1, "context": 16384, "default": "128/4/2", "us": {"128/4/2": 33.0},
         "gbs": {"128/4/2": 2030.0}, "splits": {"128/4/2": 33}, "rel_diff": 0.0},
    ]  # fmt: skip
    text = sweep.markdown(doc)
    header = "| batch | context | 128/4/2 GB/s | 64/2/2 GB/s | best | speedup | of copy bw | default tiles at other"
    assert header in text
    copy = doc["copy_gbs"]
    assert (
        f"| 32 | 4096 | 2,400* | 3,000 | 64/2/2 | 1.25 | {3000 / copy:.0%} | 1: 170.0, 2: 200.0, 4: 230.5 |"
        in text
    )
    assert (
        f"| 1 | 16384 | 2,030* | - | 128/4/2 | 1.00 | {2030 / copy:.0%} | 33: 33.0 |" in text
    )  # a tile it lacks


def test_the_default_decode_tiles_are_also_timed_at_other_split_caps():
    """No split, half and twice the default cap, each only as far as the context lets a request split."""
    assert sweep.other_split_caps(33, 16384, 256) == [1, 16, 64]
    assert sweep.other_split_caps(2, 4096, 256) == [1, 4]
    assert sweep.other_split_caps(1, 1024, 256) == [2]
    assert sweep.other_split_caps(2, 512, 256) == [1]  # 512 tokens make 2 parts at most
    assert sweep.other_split_caps(3, 1024, 256) == [1, 4]  # half of 3 is 1; twice it past the 4 parts


def _split_kernel(block_n: int, warps: int, stages: int, regs: int | None, shared: int, **flags) -> dict:
    constants = {"BLOCK_N": block_n, "PDL": False, "PREFETCH": False, "FUSED_MERGE": False} | flags
    return {"kernel": "_decode_split_kernel", "constants": constants, "num_warps": warps, "num_stages": stages,
            "shared_bytes": shared, "regs": regs, "spills": 0}  # fmt: skip


def test_the_decode_tiles_residency_comes_from_the_split_kernels_as_loaded():
    """Blocks an SM from the registers and shared memory each plain split kernel was loaded with (as the
    H100 bench recorded sm_90's default: 168 registers, 72 KiB -> 3); PDL, prefetch and fused-merge
    variants, other kernels and kernels never loaded on a GPU are left out; no arch, nothing."""
    compiled = [
        _split_kernel(128, 4, 2, 168, 73728),
        _split_kernel(128, 4, 2, 168, 73728, PDL=True),
        _split_kernel(64, 4, 1, 212, 20480, PREFETCH=True),
        _split_kernel(64, 2, 3, 198, 39168),
        _split_kernel(64, 2, 2, None, 38912),
        {"kernel": "_decode_merge_kernel", "constants": {"BLOCK_S": 4}, "num_warps": 4, "num_stages": 3,
         "shared_bytes": 2048, "regs": 22, "spills": 0},
    ]  # fmt: skip
    doc = {"device": {"name": "H100", "sm_count": 132, "arch": 90}, "compiled": compiled}
    assert sweep.decode_residency(doc) == {"128/4/2": 3, "64/2/3": 5}
    assert sweep.decode_residency({"device": {"name": "H100", "sm_count": 132}, "compiled": compiled}) == {}


def _tile_row(batch: int, context: int, us: dict, cap: int, split_us: dict | None = None) -> dict:
    return {"batch": batch, "context": context, "default": "128/4/2", "us": us,
            "gbs": {t: 1e3 / x for t, x in us.items()}, "splits": {t: cap for t in us},
            "split_us": split_us or {}, "rel_diff": 0.0}  # fmt: skip


def test_the_decode_tile_rule_caps_splits_by_residency_where_that_serves_the_lost_rows():
    """On the H100 (132 SMs, 3 blocks of the default an SM, 8 KV heads) 32 requests at cap 2 make 512
    programs, past the 396 resident: where the default tiles at cap 1 are within 2% of the tile that won,
    the rule caps splits by residency; where not, it looks for a tile from some batch on."""
    rows = [
        _tile_row(1, 16384, {"128/4/2": 33.0, "64/2/2": 36.0}, 33, {"1": 300.0, "16": 37.0, "64": 34.0}),
        _tile_row(32, 4096, {"128/4/2": 200.0, "64/2/2": 160.0}, 2, {"1": 162.0, "4": 230.0}),
        _tile_row(64, 4096, {"128/4/2": 320.0, "64/2/2": 318.0}, 1, {"2": 400.0}),
    ]
    rule = sweep.decode_tile_rule(rows, 132, {"128/4/2": 3}, 8)
    assert rule == {"change": "split_cap", "rows": [(32, 4096, 2, 1)]}
    # without the residency (not recorded) the same rows go to the tile rule: 64/2/2 from 32 requests on
    rule = sweep.decode_tile_rule(rows, 132, {}, 8)
    assert rule["change"] == "tile" and (rule["tile"], rule["from_batch"]) == ("64/2/2", 32)
    assert rule["gain"] == pytest.approx((200 / 160 * 320 / 318) ** 0.5)
    # the 64-request row lost too (by 6.7%) at a cap of one already: residency cannot explain it
    rows[2]["us"]["64/2/2"] = 300.0
    rule = sweep.decode_tile_rule(rows, 132, {"128/4/2": 3}, 8)
    assert rule["change"] == "tile" and rule["gain"] == pytest.approx((200 / 160 * 320 / 300) ** 0.5)
    # cap 1 more than 2% slower than the tile that won: no residency cap either
    rows[2]["us"]["64/2/2"] = 318.0
    rows[1]["split_us"]["1"] = 165.0
    assert sweep.decode_tile_rule(rows, 132, {"128/4/2": 3}, 8)["change"] == "tile"
    # nor where the cap would slow a row the default tiles won (25 x 8 x 2 = 400 programs, cap 1 10% slower)
    rows[1]["split_us"]["1"] = 162.0
    rows.append(_tile_row(25, 4096, {"128/4/2": 150.0, "64/2/2": 151.0}, 2, {"1": 165.0}))
    assert sweep.decode_tile_rule(rows, 132, {"128/4/2": 3}, 8)["change"] == "tile"


def test_the_decode_tile_rule_changes_nothing_without_a_clear_win():
    """Within 2% everywhere: no change; a tile that wins one row but is 3% short of the fastest on the
    next batch up, with no residency explanation: no change either."""
    rows = [
        _tile_row(1, 16384, {"128/4/2": 33.0, "64/2/2": 33.5}, 33),
        _tile_row(32, 4096, {"128/4/2": 200.0, "64/2/2": 198.0}, 2, {"1": 240.0}),
    ]
    rule = sweep.decode_tile_rule(rows, 132, {"128/4/2": 3}, 8)
    assert rule["change"] is None and "within 2%" in rule["why"]
    rows[1]["us"]["64/2/2"] = 160.0  # lost at 32 requests: cap 1 is 240, no residency fix
    rows.append(_tile_row(64, 4096, {"128/4/2": 300.0, "64/2/2": 310.0, "64/2/3": 301.0}, 1))
    rule = sweep.decode_tile_rule(rows, 132, {"128/4/2": 3}, 8)
    assert rule["change"] is None and "wins on 1 rows" in rule["why"]


def test_the_decode_tiles_report_shows_waves_residency_and_the_rule():
    doc = json.loads(SWEEP.read_text())
    doc["device"]["arch"] = 90
    doc["compiled"] = [_split_kernel(128, 4, 2, 168, 73728), _split_kernel(64, 2, 2, 210, 38912)]
    doc["decode_tiles"] = [
        _tile_row(1, 16384, {"128/4/2": 33.0, "64/2/2": 36.0}, 33),
        _tile_row(32, 4096, {"128/4/2": 200.0, "64/2/2": 160.0}, 2, {"1": 162.0, "4": 230.0}),
    ]
    text = sweep.markdown(doc)
    assert text.count(" waves |") == 1
    assert "| 1: 162.0, 2: 200.0, 4: 230.0 | 1.29 |" in text  # 32 x 8 x 2 = 512 programs over 132 x 3
    assert "| 33: 33.0 | 0.67 |" in text  # 264 over 396
    assert "Resident blocks an SM (the split kernel as loaded here): 128/4/2 3, 64/2/2 4." in text
    assert "Rule (kernels.sweep.decode_tile_rule): cap the split count at one wave of resident programs:" \
           " 32 x 4096: 2 -> 1." in text  # fmt: skip
