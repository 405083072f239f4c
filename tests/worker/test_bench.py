"""python -m worker.bench: a quick tiny-model run on CPU writes every measurement; a cached prefix
means fewer computed tokens (engine counters); the 8B-shaped model is refused on CPU; the
random-weight model path serves requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.bench import IdTokenizer, build_bench_engine, run_request
from worker.config import WorkerConfig
from worker.model.config import ModelConfig

QUICK = ["--quick", "--device", "cpu", "--cpu-threads", "1", "--prompt-tokens", "160", "--batches", "1,3",
         "--decode-steps", "6", "--decode-prompt-tokens", "16", "--reps", "1", "--radix-iters", "3"]  # fmt: skip


def run_bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.bench", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "worker.json"
    proc = run_bench(*QUICK, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_json_records_machine_params_and_every_measurement(quick_run):
    doc, _ = quick_run
    machine = doc["machine"]
    assert machine["device"] == "cpu" and machine["device_name"]
    assert machine["torch"] and machine["torch_threads"] == 1
    assert len(machine["loadavg_start"]) == 3
    params = doc["params"]
    assert params["prompt_tokens"] == 160 and params["batches"] == [1, 3] and params["quick"] is True
    assert doc["command"].startswith("python -m worker.bench --quick")

    assert doc["prefill"]["tokens_per_s"] > 0
    assert doc["prefill"]["computed_tokens"] == params["prefill_prompts"] * 160  # nothing cached
    assert [d["batch"] for d in doc["decode"]] == [1, 3]
    for d in doc["decode"]:
        assert d["tokens_per_s"] > 0 and d["step_ms"] > 0 and d["window_steps"] >= 1
        assert d["decode_tokens_counted"] >= d["window_tokens"]
    adjusted = doc["decode_adjusted"]
    assert adjusted["batch"] == 3 and adjusted["step_ms"] > 0 and adjusted["sampling"]["logprobs"] == 5
    sampled = doc["decode_sampled"]
    assert sampled["batch"] == 3 and sampled["step_ms"] > 0 and sampled["sampling"]["temperature"] == 0.7
    assert [(t["cached_fraction"], t["from"], t["prompt_tokens"]) for t in doc["ttft"]] == [
        (0.0, "device", 160), (0.5, "device", 160), (0.9, "device", 160), (0.9, "host", 160),
        (0.8047, "device", 512),  # the follow-up turn: 412 of 512 tokens sent before, 400 of them cached
    ]  # fmt: skip
    assert all(t["ttft_ms_median"] > 0 for t in doc["ttft"])
    ops = {(r["op"], r["tokens"]) for r in doc["radix"]}
    assert {("match_hit", 1024), ("insert_new", 1024), ("match_hit", 32768), ("insert_new", 32768)} <= ops
    assert all(r["median_us"] > 0 for r in doc["radix"])


def test_cached_prefix_means_fewer_computed_tokens(quick_run):
    doc, _ = quick_run
    cold, half, warm, host, follow_up = doc["ttft"]
    assert cold["cached_tokens"] == 0 and cold["computed_tokens"] == 160
    assert half["cached_tokens"] == 80 and half["computed_tokens"] == 80
    # 90% of 160 = 144 tokens = 9 full pages of 16: all of them hit
    assert warm["cached_tokens"] == 144 and warm["computed_tokens"] == 16
    assert warm["host_loaded_tokens"] == 0
    # the same hit after the prefix moved to host memory: copied back, not computed
    assert (
        host["cached_tokens"] == 144 and host["computed_tokens"] == 16 and host["host_loaded_tokens"] == 144
    )
    assert warm["computed_tokens"] < half["computed_tokens"] < cold["computed_tokens"]
    # a long conversation's next turn: all but its last 100 tokens were sent before (25 full pages hit)
    assert follow_up["follow_up"] and follow_up["prompt_tokens"] == doc["params"]["follow_up_context"] == 512
    assert follow_up["cached_tokens"] == 400 and follow_up["computed_tokens"] == 112
    # what each hit reached, beside the whole pages of the prefix warmed before it
    reached = [(t["cached_fraction_reached"], t["warmed_pages_tokens"]) for t in doc["ttft"]]
    assert reached == [(0.0, 0), (0.5, 80), (0.9, 144), (0.9, 144), (0.7812, 400)]
    # the copies alone, for the hit's 144 tokens (9 pages), timed on the host tier after the run
    copies, c = doc["host_copies"], doc["model"]["config"]
    assert copies["tokens"] == 144
    assert copies["bytes"] == 144 * 2 * c["num_layers"] * c["num_kv_heads"] * c["head_dim"] * 4  # float32
    assert copies["save_gbs"] > 0 and copies["load_gbs"] > 0
    # NOTE: ms are rounded to 3 decimals, so a tiny copy agrees only loosely
    assert copies["load_gbs"] == pytest.approx(copies["bytes"] / copies["load_ms"] / 1e6, rel=0.1)


def test_decode_floor_compares_the_batch_1_step_with_weight_bytes_over_bandwidth(quick_run):
    doc, stdout = quick_run
    floor = doc["decode_floor"]
    tiny = doc["model"]
    # tiny's LM head is its own matrix: every parameter but the embedding table counts (fp32)
    vocab, hidden = tiny["config"]["vocab_size"], tiny["config"]["hidden_size"]
    assert not tiny["config"]["tie_word_embeddings"]
    assert floor["weight_bytes"] == 4 * (tiny["parameters"] - vocab * hidden)
    assert floor["copy_gbs"] > 0
    assert floor["floor_ms"] == pytest.approx(floor["weight_bytes"] / floor["copy_gbs"] / 1e6, rel=1e-3)
    assert floor["step_ms"] == doc["decode"][0]["step_ms"]
    assert floor["ratio"] == pytest.approx(floor["step_ms"] / floor["floor_ms"], rel=1e-2)
    assert floor["met"] == (floor["ratio"] <= 1.3)
    assert doc["decode_graph_steps"] == 0  # CPU: every step eager
    assert doc["extend_graph_steps"] == 0 and all(t["extend_graph_steps"] == 0 for t in doc["ttft"])
    assert "replay_ms" not in floor and "decode_graph_replay_ms" not in doc  # no graphs to replay
    assert any(line.startswith("| decode batch 1 step / weight-read floor |") for line in stdout.splitlines())
    assert any(line.startswith("| host tier copies, 144 tokens") for line in stdout.splitlines())
    assert any(line.startswith("| decode, batch 3, every request sampled (temperature 0.7, top-p 0.9, unseeded) |")
               for line in stdout.splitlines())  # fmt: skip


def test_decode_floor_splits_off_the_gpu_share_when_the_replay_was_timed():
    import torch

    from worker.bench import random_llama
    from worker.bench_report import decode_floor, decode_weight_bytes

    shape = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
    model = random_llama(ModelConfig(**shape), "cpu", torch.bfloat16)
    copy_gbs = 0.1  # GB/s, so that the floor is a few ms
    floor = decode_floor(model, [{"batch": 1, "step_ms": 6.0}], copy_gbs, replay_ms=4.5)
    floor_ms = decode_weight_bytes(model) / (copy_gbs * 1e9) * 1e3
    assert floor["floor_ms"] == pytest.approx(floor_ms, rel=1e-3)
    assert floor["ratio"] == pytest.approx(6.0 / floor_ms, rel=1e-3)
    assert floor["replay_ms"] == 4.5 and floor["replay_ratio"] == pytest.approx(4.5 / floor_ms, rel=1e-3)
    assert decode_floor(model, [{"batch": 1, "step_ms": 6.0}], copy_gbs).keys() == floor.keys() - {
        "replay_ms",
        "replay_ratio",
    }


def test_decode_weight_bytes_skips_an_untied_embedding_table():
    import torch

    from worker.bench import random_llama
    from worker.bench_report import decode_weight_bytes

    shape = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
    untied = random_llama(ModelConfig(**shape), "cpu", torch.bfloat16)
    tied = random_llama(ModelConfig(**shape, tie_word_embeddings=True), "cpu", torch.bfloat16)
    params = sum(p.numel() for p in untied.parameters())
    assert decode_weight_bytes(untied) == 2 * (params - 1000 * 64)
    assert decode_weight_bytes(tied) == 2 * sum(p.numel() for p in tied.parameters())
    # a mixture of experts: a batch-1 step reads 2 of each sparse layer's 8 experts (layer 1 is dense)
    moe = random_llama(ModelConfig(**shape, num_experts=8, experts_per_token=2, moe_intermediate_size=32,
                                   dense_layers=(1,)), "cpu", torch.bfloat16)  # fmt: skip
    experts = 8 * 3 * 64 * 32  # layer 0's gate, up and down of every expert
    params = sum(p.numel() for p in moe.parameters())
    assert decode_weight_bytes(moe) == 2 * (params - 1000 * 64 - experts * 6 // 8)


def test_markdown_table_is_printed_last(quick_run):
    _, stdout = quick_run
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("| radix")
    assert "| measurement | value | unit |" in lines
    assert any(line.startswith("| TTFT, 90% of 160 tokens cached (16 computed)") for line in lines)


@pytest.mark.parametrize("activations", ["16-bit", "fp8"])
def test_fp8_weights_run_through_the_engine_and_the_title_says_so(quick_run, tmp_path, activations):
    """--fp8-weights: the projections kept in fp8 (128x128 block scales) through every measurement, with
    --fp8-activations their inputs quantized per token; the JSON's config and the table's title say which
    weights and KV pool the numbers are for."""
    out = tmp_path / "fp8.json"
    extra = ["--fp8-activations"] if activations == "fp8" else []
    proc = run_bench(*QUICK, "--fp8-weights", *extra, "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    config = doc["model"]["config"]
    assert config["fp8_projections"] and config["fp8_weight_block"] == [128, 128]
    assert config["fp8_activations"] == (activations == "fp8")
    assert [d["batch"] for d in doc["decode"]] == [d["batch"] for d in quick_run[0]["decode"]]
    assert all(d["tokens_per_s"] > 0 for d in doc["decode"])
    # the weight floor counts the projections at one byte a weight
    assert doc["decode_floor"]["weight_bytes"] < quick_run[0]["decode_floor"]["weight_bytes"] / 2
    inputs = ", inputs fp8 per token" if extra else ""
    assert (
        f"**tiny (fp8 projections (128x128 blocks{inputs}), float32 elsewhere, KV float32) on " in proc.stdout
    )
    assert "**tiny (float32, KV float32) on " in quick_run[1]


def test_ttft_rows_say_whether_the_prefill_was_replayed_or_launched_eagerly(quick_run):
    from worker.bench_report import markdown_table

    doc, _ = quick_run
    warm = next(t for t in doc["ttft"] if t["cached_fraction"] == 0.9 and t["from"] == "device")
    graphed = {**doc, "extend_graph_steps": 3, "params": {**doc["params"], "cuda_graph_extend_tokens": 256}}
    follow_up = next(t for t in doc["ttft"] if t.get("follow_up"))
    graphed["ttft"] = [{**warm, "extend_graph_steps": 1}, {**warm, "eager": True},
                       {**follow_up, "extend_graph_steps": 1, "graph_variants": {"split": 1}},
                       {**follow_up, "extend_graph_steps": 1, "graph_variants": {"default": 1},
                        "prefix_variants": False}]  # fmt: skip
    lines = markdown_table(graphed).splitlines()
    assert "extend graphs up to 256 new tokens (3 steps replayed)" in lines[0]
    ttft = [line for line in lines if line.startswith("| TTFT")]
    assert ttft[0].startswith(
        "| TTFT, 90% of 160 tokens cached, prefill replayed as a CUDA graph (16 computed)"
    )
    assert ttft[1].startswith("| TTFT, 90% of 160 tokens cached, prefill launched eagerly (16 computed)")
    assert ttft[2].startswith(
        "| TTFT, follow-up turn, 400 of 512 tokens cached, prefill replayed as a CUDA graph (prefix split) (112 "
        "computed)"
    )
    assert ttft[3].startswith("| TTFT, follow-up turn, 400 of 512 tokens cached, prefill replayed as a CUDA "
                              "graph, default graphs only (112 computed)")  # fmt: skip
    assert "extend graphs" not in markdown_table(doc).splitlines()[0]


def test_ttft_rows_say_the_share_cached_and_flag_a_hit_short_of_the_warmed_pages(quick_run):
    """90% of a 256-token prompt warms 230 tokens, 14 whole pages: 224 tokens (88%) can hit. A row
    whose hit fell short of the warmed pages says so; the share asked for stays in the JSON."""
    from worker.bench_report import markdown_table

    doc, _ = quick_run
    warm = next(t for t in doc["ttft"] if t["cached_fraction"] == 0.9 and t["from"] == "device")
    reached = {**warm, "prompt_tokens": 256, "cached_tokens": 224, "computed_tokens": 32,
               "warmed_pages_tokens": 224}  # fmt: skip
    missed = {**reached, "cached_tokens": 0, "computed_tokens": 256}
    ttft = [
        line for line in markdown_table({**doc, "ttft": [reached, missed]}).splitlines() if "TTFT" in line
    ]
    assert ttft[0].startswith("| TTFT, 88% of 256 tokens cached (32 computed) |")
    assert ttft[1].startswith(
        "| TTFT, 0% of 256 tokens cached, **hit short of the 224 tokens warmed** (256 computed) |"
    )


def test_with_overlap_the_smallest_batch_is_also_timed_one_step_at_a_time(tmp_path):
    out = tmp_path / "worker.json"
    proc = run_bench(*QUICK, "--overlap-schedule", "on", "--decode-steps", "12", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [(d["batch"], d["overlap"]) for d in doc["decode"]] == [(1, True), (3, True), (1, False)]
    assert (
        all(d["overlapped_steps"] > 0 for d in doc["decode"][:2])
        and doc["decode"][2]["overlapped_steps"] == 0
    )
    assert doc["decode_floor"]["step_ms"] == doc["decode"][0]["step_ms"]  # NOTE: the engine as configured
    assert "(16-token prompts, one step at a time)" in proc.stdout


@pytest.mark.parametrize("model", ["llama3-8b-shape", "qwen3-30b-a3b-shape", "gpt-oss-20b-shape"])
def test_model_shapes_are_refused_on_cpu(model):
    proc = run_bench("--model", model, "--device", "cpu")
    assert proc.returncode == 2
    assert f"--model {model} needs a CUDA GPU" in proc.stderr


def test_bad_batches_are_a_usage_error():
    proc = run_bench("--batches", "1,x", "--device", "cpu")
    assert proc.returncode == 2 and "--batches" in proc.stderr


def test_fp8_activations_without_fp8_weights_are_a_usage_error():
    proc = run_bench("--fp8-activations", "--device", "cpu")
    assert proc.returncode == 2 and "add --fp8-weights" in proc.stderr


def test_kv_scales_run_an_fp8_pool_over_per_head_scales_and_the_title_says_so(tmp_path):
    """--kv-scales: the fp8 pool over random KV scales, each layer's KV heads their own, through every
    measurement; the JSON's config and the table's title say so. Without an fp8 pool: a usage error."""
    out = tmp_path / "kv.json"
    proc = run_bench(*QUICK, "--kv-cache-dtype", "fp8_e4m3", "--kv-scales", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["model"]["config"]["kv_scales"] and doc["model"]["kv_dtype"] == "float8_e4m3fn"
    assert all(d["tokens_per_s"] > 0 for d in doc["decode"])
    assert "KV float8_e4m3fn over KV scales) on " in proc.stdout
    refused = run_bench("--kv-scales", "--device", "cpu")
    assert refused.returncode == 2 and "add --kv-cache-dtype fp8_e4m3" in refused.stderr


# gpt-oss-20b-shape's features, on the small model
GPT_OSS_KIND = {"moe_bias": True, "expert_activation": "clamped_swiglu", "attention_sinks": True, "qkv_bias": True,
                "o_bias": True, "sliding_window": 8, "sliding_layers": (0,), "mxfp4_experts": True}  # fmt: skip


@pytest.mark.parametrize("kind", ["dense", "moe", "gpt-oss"])
async def test_random_weight_model_serves_through_the_engine(kind):
    """The llama3-8b-shape, qwen3-30b-a3b-shape and gpt-oss-20b-shape wiring (random weights built on the
    device, id-only tokenizer), small."""
    experts = 0 if kind == "dense" else 4
    shape = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=512, num_experts=experts,
                        experts_per_token=2, moe_intermediate_size=32, qk_norm=kind == "moe",
                        **(GPT_OSS_KIND if kind == "gpt-oss" else {}))  # fmt: skip
    cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=1024, served_model_name="shape")
    engine = build_bench_engine(cfg, shape)
    assert isinstance(engine.tokenizer, IdTokenizer)
    engine.start()
    try:
        prompt = list(range(900, 940))
        trace = await run_request(engine, prompt, 5)
        again = await run_request(engine, prompt, 5)
    finally:
        engine.stop()
    assert trace.last.finish_reason == "length" and trace.last.completion_tokens == 5
    assert len(trace.token_times) == 5
    assert again.last.cached_tokens == 32  # two full pages of the 40-token prompt


def test_guided_bench_times_masks_in_both_states_and_writes_json(tmp_path, capsys):
    from worker import bench_guided

    out = tmp_path / "guided.json"
    bench_guided.main(["--vocab", "600", "--batch", "1,3", "--reps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["vocab"] == 600 and [r["batch"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["allowed_in_string"] > 300  # inside a string almost any token may come next
        assert all(row[k] > 0 for k in ("mask_ms_object_start", "mask_ms_in_string", "apply_ms_vocab_128256"))
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| 3 |")


def test_penalties_bench_times_each_batch_and_output_length_and_writes_json(tmp_path, capsys):
    from worker import bench_penalties

    out = tmp_path / "penalties.json"
    bench_penalties.main(["--vocab", "500", "--batches", "1,3", "--outputs", "10,40", "--reps", "2",
                          "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert [(r["batch"], r["output_tokens"]) for r in result["rows"]] == [(1, 10), (1, 40), (3, 10), (3, 40)]
    assert all(r["call_ms"] > 0 and r["vocab"] == 500 for r in result["rows"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| 3 | 40 |")


def test_sampling_bench_times_every_setting_and_the_sort_and_writes_json(tmp_path, capsys):
    from worker import bench_sampling

    out = tmp_path / "sampling.json"
    bench_sampling.main(["--vocab", "500", "--batches", "1,3", "--reps", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    names = [*bench_sampling.SETTINGS, "sort alone"]
    assert [(r["batch"], r["setting"]) for r in result["rows"]] == [(b, n) for b in (1, 3) for n in names]
    assert all(r["call_ms"] > 0 and r["vocab"] == 500 for r in result["rows"])
    assert result["sorted_mask_wins_up_to"] is None  # the mask both ways is timed on CUDA only
    assert (
        capsys.readouterr().out.strip().splitlines()[-1]
        == f"| 3 | sort alone | {result['rows'][-1]['call_ms']} |"
    )


def test_sampling_bench_says_up_to_which_batch_the_sorted_top_p_mask_wins():
    """From the CUDA rows' host + device times: the largest batch with the sort faster at it and every
    smaller one; 0 when the kernel wins at once; None without both (the CPU run)."""
    from worker import bench_sampling

    def rows(times: dict[int, tuple[float, float]]) -> list[dict]:
        return [
            {"batch": b, "setting": f"top-p 0.9 mask, {name}", "call_ms": 0.01, "call_and_device_ms": ms}
            for b, pair in times.items()
            for name, ms in zip(("sorted", "threshold kernel"), pair, strict=True)
        ]

    measured = {1: (0.30, 0.53), 2: (0.33, 0.52), 16: (0.59, 0.51), 4: (0.40, 0.52), 64: (1.45, 0.60)}
    assert bench_sampling.sorted_mask_wins_up_to(rows(measured)) == 4
    assert bench_sampling.sorted_mask_wins_up_to(rows(measured | {8: (0.55, 0.50), 16: (0.4, 0.5)})) == 4
    assert bench_sampling.sorted_mask_wins_up_to(rows({1: (0.6, 0.5), 2: (0.3, 0.5)})) == 0
    assert bench_sampling.sorted_mask_wins_up_to(rows({1: (0.3, 0.5), 64: (0.4, 0.6)})) == 64
    assert bench_sampling.sorted_mask_wins_up_to([{"batch": 1, "setting": "greedy", "call_ms": 0.1}]) is None
    # the worker's threshold is the committed H100 run's, recomputed from its rows
    from worker import sampling

    committed = Path(__file__).resolve().parents[2] / "docs/benchmarks/sampling-nvidia-h100-80gb-hbm3.json"
    run = json.loads(committed.read_text())
    assert bench_sampling.sorted_mask_wins_up_to(run["rows"]) == run["sorted_mask_wins_up_to"]
    assert run["sorted_mask_wins_up_to"] == sampling.SORT_MAX_ROWS


def test_speculative_bench_times_steps_and_compares_outputs(tmp_path, capsys):
    from worker import bench_speculative

    out, md = tmp_path / "spec.json", tmp_path / "spec.md"
    bench_speculative.main(["--quick", "--out", str(out), "--markdown", str(md)])
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["step_cost"]] == [1, 2]
    for row in result["step_cost"]:
        assert row["k0_ms"] > 0 and row["k2_ms"] > 0 and row["k2_vs_decode"] > 0
        assert row["replayed"] is False  # CPU: eager steps (CUDA replays them, as the engine does)
    assert "median of 2, eager steps)" in md.read_text().splitlines()[0]
    off, on, schema_off, schema_on = result["end_to_end"]
    assert off["drafts_per_step"] == 0 and off["verify_steps"] == 0 and off["draft_tokens"] == 0
    assert on["drafts_per_step"] == 4 and on["same_output_as_off"] is True
    assert off["output_tokens"] == on["output_tokens"] == 2 * 24
    assert schema_off["output"] == schema_on["output"] == "json_schema" and schema_on["same_output_as_off"]
    assert schema_on["accepted_tokens"] >= len('{"customer_name":"')  # the forced key at least
    assert md.read_text() in capsys.readouterr().out


def test_lora_bench_times_steps_with_growing_adapter_counts(tmp_path, capsys):
    from worker import bench_lora

    out = tmp_path / "lora.json"
    bench_lora.main(["--quick", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["adapters"] for r in rows] == [0, 1, 2]
    assert all(r["decode_ms"] > 0 and r["prefill_ms"] > 0 for r in rows) and rows[0]["decode_vs_base"] == 1.0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| 2 |")


def test_kv_transfer_bench_fetches_every_prompt_it_times(tmp_path, capsys):
    from worker import bench_kv_transfer

    out = tmp_path / "kv.json"
    bench_kv_transfer.main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in doc["rows"]] == [256, 1024]
    for row in doc["rows"]:
        assert row["fetched_tokens"] == row["prompt_tokens"]  # the whole prefix came from the source
        assert row["kv_mib"] == row["prompt_tokens"] * doc["kv_bytes_per_token"] / 2**20
        assert row["fetch_ms"] > 0 and min(row["ttft_computed_ms"], row["ttft_fetched_ms"]) > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| 1024 |")


def test_kv_transfer_bench_runs_the_source_in_its_own_process_when_asked(tmp_path):
    from worker import bench_kv_transfer

    out, md = tmp_path / "kv.json", tmp_path / "kv.md"
    bench_kv_transfer.main(["--source-process", "--prompt-tokens", "256", "--reps", "1", "--out", str(out),
                            "--markdown", str(md)])  # fmt: skip
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    assert row["fetched_tokens"] == 256 and row["fetch_ms"] > 0  # fetched from the child over loopback
    assert row["peak_held_mib"][0] is None and row["peak_held_mib"][1] > 0  # the child's is not visible
    assert "the source in its own process" in md.read_text()


def test_host_bench_times_decode_steps_of_a_zero_cost_forward(tmp_path, capsys):
    from worker import bench_host

    out, md = tmp_path / "host.json", tmp_path / "host.md"
    assert bench_host.main(["--batches", "1,3", "--contexts", "32", "--steps", "32", "--out", str(out),
                            "--markdown", str(md)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in doc["rows"]] == [(1, 32), (3, 32)]
    for r in doc["rows"]:
        # the window: decode steps after the warm tokens, fewer when this loop saw them late (a busy
        # machine: 5 of 8 seen in CI), never the warm ones; twice the steps again after a run with none left
        assert r["steps_run"] in (32, 64, 128) and 1 <= r["steps"] <= r["steps_run"] and r["ms_per_step"] > 0
        assert r["us_per_request_step"] == pytest.approx(r["ms_per_step"] * 1e3 / r["batch"], rel=1e-2)
    assert md.read_text() in capsys.readouterr().out
    assert "| 3 |" in md.read_text()


def test_a_timed_window_that_closed_before_it_opened_runs_again_then_gives_up():
    """On a busy host this loop may see the warm tokens only after every step has run (CI saw it with 20
    steps): timed_window then runs the requests again with twice the steps, on the same engine, and gives
    up after WINDOW_TRIES runs. With no step past the warm tokens no window can open, so every run misses:
    the engine decoded the warm tokens of each run (the first token comes from the prefill)."""
    from worker import bench_host

    with bench_host.sim_engine(0.0, "off", kv_cache_tokens=8192, sim_context_tokens=512) as engine:
        with pytest.raises(bench_host.NoWindow, match="raise --steps"):
            bench_host.timed_window(engine, batch=1, context=16, steps=0, seed=0)
        runs = engine.scheduler.stats.decode_tokens / (bench_host.WARM_TOKENS - 1)
    assert runs == bench_host.WINDOW_TRIES == 3


def test_host_bench_saturates_an_engine_one_step_at_a_time_and_overlapped(tmp_path, capsys):
    from worker import bench_host

    out = tmp_path / "saturated.json"
    assert bench_host.main(["--saturate", "6", "--contexts", "32", "--steps", "8", "--max-running", "2",
                            "--forward-ms", "0.5", "--overlap", "both", "--out", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "host_step_saturated"
    assert [(r["overlap"], r["max_running"]) for r in doc["rows"]] == [("off", 2), ("on", 2)]
    off, on = doc["rows"]
    # the same work both ways (the first token of each comes from its prefill), chained only when on
    assert off["decode_tokens"] == on["decode_tokens"] == 6 * 7
    assert off["ahead_steps"] == 0 < on["ahead_steps"]
    assert off["device_s"] > 0 and off["wall_s"] > 0 and on["wall_s"] > 0
    assert "| 2 |" in capsys.readouterr().out


def test_profile_groups_kernels_by_what_they_do():
    from worker.bench_profile import group_of, group_times

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "matmul",
        "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT": "matmul",
        "_decode_split_kernel": "attention",
        "_decode_merge_kernel": "attention",
        "_extend_kernel": "attention",
        "_short_split_kernel": "attention",  # verify steps and short cache-hit prefills
        "_merge_rows_kernel": "attention",  # their merge, and extend's prefix splits'
        "_rms_norm_kernel": "rms_norm",
        "_add_rms_norm_kernel": "rms_norm",
        "_rope_kernel": "rope_kv_store",
        "_store_kv_kernel": "rope_kv_store",
        "_rope_store_kv_kernel": "rope_kv_store",
        "_silu_and_mul_kernel": "silu_mul",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>": "silu_mul",
        "aten::addmm": "matmul",
        "aten::mul": "other",
    }
    assert {n: group_of(n) for n in names} == names
    events = [("_decode_split_kernel", 30.0, 4), ("nvjet_x", 90.0, 8), ("aten::mul", 0.0, 2)]
    rows = group_times(events, steps=2)
    assert rows[0] == {"group": "matmul", "us_per_step": 45.0, "calls_per_step": 4.0, "share": 0.75}
    assert rows[1] == {"group": "attention", "us_per_step": 15.0, "calls_per_step": 2.0, "share": 0.25}
    assert {r["group"] for r in rows} == {
        "attention",
        "matmul",
        "rms_norm",
        "rope_kv_store",
        "silu_mul",
        "other",
    }
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)


def test_profile_bench_splits_a_cpu_decode_step_into_groups(tmp_path, capsys):
    from worker import bench_profile

    out, md = tmp_path / "profile.json", tmp_path / "profile.md"
    assert bench_profile.main(["--quick", "--device", "cpu", "--out", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    r = doc["result"]
    assert r["eager_step_ms"] > 0 and r["replayed_step_ms"] is None  # no graphs on the CPU
    groups = {g["group"]: g for g in r["groups"]}
    assert groups["matmul"]["us_per_step"] > 0 and groups["matmul"]["calls_per_step"] >= 1
    assert r["profiled_us_per_step"] == pytest.approx(sum(g["us_per_step"] for g in groups.values()), abs=0.1)
    assert r["matmul_gbs"] == pytest.approx(  # NOTE: reported to 0.1 GB/s, a CPU's ~2 GB/s included
        r["weight_bytes"] / groups["matmul"]["us_per_step"] / 1e3, rel=1e-2, abs=0.05
    )
    assert md.read_text() in capsys.readouterr().out


def test_profile_bench_profiles_a_cache_hit_prefill(tmp_path, capsys):
    from worker import bench_profile
    from worker.bench import bench_model

    out, md = tmp_path / "prefill.json", tmp_path / "prefill.md"
    argv = [
        "--quick",
        "--device",
        "cpu",
        "--batch",
        "2",
        "--new-tokens",
        "5",
        "--out",
        str(out),
        "--markdown",
        str(md),
    ]
    assert bench_profile.main(argv) == 0
    doc = json.loads(out.read_text())
    r, c = doc["result"], bench_model("tiny", "cpu").config
    assert doc["params"]["new_tokens"] == 5 and r["step"] == "prefill"
    # every layer's projections for the 10 new tokens, the LM head for each request's last one
    per_token = (
        c.num_layers
        * c.hidden_size
        * (
            (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            + c.num_heads * c.head_dim
            + 3 * c.intermediate_size
        )
    )
    assert r["matmul_flops"] == 2 * (per_token * 10 + c.vocab_size * c.hidden_size * 2)
    groups = {g["group"]: g for g in r["groups"]}
    assert groups["matmul"]["us_per_step"] > 0 and groups["attention"]["calls_per_step"] >= c.num_layers
    assert r["matmul_tflops"] == pytest.approx(
        r["matmul_flops"] / groups["matmul"]["us_per_step"] / 1e6, rel=1e-2, abs=1e-3
    )
    assert (
        "extend_tiles_eager" not in r or r["extend_tiles_eager"] is None
    )  # the CPU takes the reference path
    text = md.read_text()
    assert (
        text.startswith("Prefill of 2 request(s), 5 new tokens each over 32 cached")
        and text in capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        bench_profile.main(["--device", "cpu", "--new-tokens", "-1"])


def test_profile_bench_replays_a_prefill_in_the_extend_graph_variant_the_engine_would(monkeypatch):
    """worker.bench_profile's replayed prefill takes the configuration the worker's extend graphs replay
    for it (the graph it pads to, its prefix): here a bf16 model of head dim 128 with the compiled tile
    choices (on CPU: 4 "SMs", so its 2 heads' graphs split)."""
    import types

    import torch

    from kernels import extend_attention as ext
    from worker.bench_profile import graph_config

    monkeypatch.setattr(ext, "INTERPRETED", False)
    config = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=128)  # fmt: skip
    model, cpu = types.SimpleNamespace(config=config, dtype=torch.bfloat16), torch.device("cpu")
    split = ext.graph_configs(100, 2, 128, torch.bfloat16, cpu)["split"]
    assert split.split_prefix and graph_config(model, cpu, 7900, 100) == split  # a follow-up turn
    # 90% of 2,048 cached: the 256-token graph's split pays from 4,096 cached tokens; the larger tiles do
    assert graph_config(model, cpu, 1840, 208) == ext.LONG_PREFIX_TILES
    assert graph_config(model, cpu, 0, 208) is None  # the default
    assert graph_config(model, cpu, 7900, 300) is None  # past the largest graph: the engine runs it eagerly


def test_profile_bench_turns_the_prefix_split_on_for_its_run_only(tmp_path, monkeypatch):
    """--split-prefix: the extend kernel's default configurations split during the run (seen by the
    model's attention), and the default is back afterwards (tests call main() in one process)."""
    from kernels import extend_attention as ext
    from worker import attention, bench_profile

    seen, extend = [], attention.extend
    monkeypatch.setattr(
        attention, "extend", lambda *a: seen.append(ext.default_config(64, ext.torch.bfloat16)) or extend(*a)
    )
    out = tmp_path / "split.json"
    argv = ["--quick", "--device", "cpu", "--new-tokens", "4", "--split-prefix", "--out", str(out)]
    assert bench_profile.main(argv) == 0
    assert seen and all(cfg.split_prefix for cfg in seen)
    assert json.loads(out.read_text())["params"]["split_prefix"] is True
    assert ext.SPLIT_PREFIX is False and not ext.default_config(64, ext.torch.bfloat16).split_prefix


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_profile_bench_finds_the_kernels_of_a_cuda_decode_step(tmp_path):
    from worker import bench_profile

    out = tmp_path / "profile.json"
    assert bench_profile.main(["--quick", "--device", "cuda", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["result"]
    assert r["eager_step_ms"] > 0 and r["replayed_step_ms"] > 0
    groups = {g["group"]: g for g in r["groups"]}
    # the Triton kernels by their names, the projections by cuBLAS's
    for group in ("matmul", "attention", "rms_norm", "rope_kv_store", "silu_mul"):
        assert groups[group]["us_per_step"] > 0 and groups[group]["calls_per_step"] >= 1, groups
    # fused: one RoPE + KV-store kernel and one SiLU-and-multiply per layer; a norm per sublayer and the last
    layers = groups["silu_mul"]["calls_per_step"]
    assert groups["rope_kv_store"]["calls_per_step"] == layers
    assert groups["rms_norm"]["calls_per_step"] == 2 * layers + 1
    # a cache hit's prefill: one extend attention kernel a layer, the tiles named both ways (24 new tokens:
    # up to worker.attention.SHORT_EXTEND take the short extend, a split kernel and a merge a layer)
    out = tmp_path / "prefill.json"
    assert bench_profile.main(["--quick", "--device", "cuda", "--new-tokens", "24", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["result"]
    assert r["step"] == "prefill" and r["replayed_step_ms"] > 0
    assert {g["group"]: g for g in r["groups"]}["attention"]["calls_per_step"] == layers
    assert r["extend_tiles_eager"] and r["extend_tiles_replayed"]
