"""Tensor parallelism (--tensor-parallel-size 2, two CPU processes over gloo): real worker processes
answer as the one-rank worker does (text, logprobs, prompt logprobs, sampling, host tier,
speculative decoding, overlapped decode steps) for the tiny model and HF checkpoints with biases,
tied embeddings and a vocabulary that does not split evenly; bad sizes are start-up errors; a rank's death stops the
worker and rank 0's death stops the others."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.support import ROOT, SLOW, start_module, wait_until
from tests.worker.conftest import (
    GEMMA2,
    GEMMA3,
    GPT_OSS,
    GRANITE,
    GRANITE_MOE,
    MIXTRAL,
    QWEN2_MOE,
    save_checkpoint,
)
from worker.model.config import ModelConfig
from worker.model.shard import Shard

COMMON = ["--device", "cpu", "--warmup-tokens", "0", "--cpu-threads", "1", "--kv-hints", "any"]
PROMPTS = [
    "Tensor parallel ranks must agree on every token.",
    "The quick brown fox jumps over the lazy dog, twice: the quick brown fox jumps again.",
]


def serve_pair(model: str, tmp: Path, extra: list[str] = (), extra_tp: list[str] = ()):
    one = start_module("worker", ["--model", model, *COMMON, *extra], str(tmp))
    try:
        two = start_module(
            "worker", ["--model", model, *COMMON, *extra, "--tensor-parallel-size", "2", *extra_tp], str(tmp)
        )
    except BaseException:
        one.stop()
        raise
    return one, two


def complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 16, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same(a: dict, b: dict) -> None:
    """Same text and token counts (cached ones aside); logprobs (generated and prompt) equal to 1e-4."""
    for key in ("prompt_tokens", "completion_tokens"):
        assert a["usage"][key] == b["usage"][key]
    assert len(a["choices"]) == len(b["choices"])
    for ca, cb in zip(a["choices"], b["choices"], strict=True):
        assert ca["text"] == cb["text"]
        if ca.get("logprobs"):
            la, lb = ca["logprobs"], cb["logprobs"]
            assert la["tokens"] == lb["tokens"]
            for x, y in zip(la["token_logprobs"], lb["token_logprobs"], strict=True):
                assert (x is None and y is None) or abs(x - y) < 1e-4, (x, y)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-tiny")
    # NOTE: a pool of 1024 tokens and a host tier: the long prompts below evict to the host and hit
    # there. The two ranks schedule each decode step while the one before runs (on by default on
    # CUDA): its input ids go from rank 0 to rank 1 as a broadcast on the model's group
    one, two = serve_pair("tiny", tmp, ["--kv-cache-tokens", "1024", "--host-cache-tokens", "8192"],
                          ["--overlap-schedule", "on"])  # fmt: skip
    yield one, two
    two.stop()
    one.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert m is not None, name
    return float(m.group(1))


def test_two_ranks_answer_as_one(tiny_pair):
    one, two = tiny_pair
    cases = [
        {"prompt": PROMPTS[0], "temperature": 0, "logprobs": 3},
        {"prompt": PROMPTS, "temperature": 0.8, "top_p": 0.9, "seed": 7, "n": 2, "logprobs": 1},
        {"prompt": PROMPTS[1], "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0},
        {"prompt": PROMPTS[0], "temperature": 0, "frequency_penalty": 0.5, "logit_bias": {"101": 3}},
    ]
    for body in cases:
        assert_same(complete(one.url, **body), complete(two.url, **body))
    assert metric(two.url, "radixgate_worker_overlapped_steps_total") > 0
    assert metric(one.url, "radixgate_worker_overlapped_steps_total") == 0  # NOTE: the CPU default: off


def test_host_tier_copies_reach_every_rank(tiny_pair):
    """Prompts that overflow the 1024-token pool push pages to the host tier; asking again loads
    them back: the answers (which read those pages' KV on both ranks) match the one-rank worker's."""
    one, two = tiny_pair
    long_prompts = [f"document {i}: " + "lorem ipsum dolor sit amet " * 14 for i in range(4)]
    for url in (one.url, two.url):
        for p in long_prompts:
            complete(url, prompt=p, max_tokens=1, temperature=0)
    before = metric(two.url, "radixgate_worker_host_loaded_tokens_total")
    for p in long_prompts[:2]:
        assert_same(
            complete(one.url, prompt=p + " end", temperature=0, logprobs=1),
            complete(two.url, prompt=p + " end", temperature=0, logprobs=1),
        )
    assert metric(two.url, "radixgate_worker_host_loaded_tokens_total") > before


def test_kv_moves_between_one_rank_and_two_ranks_both_ways(tiny_pair):
    """A two-rank worker exports KV gathered from both ranks' heads and imports KV split over them:
    fetched in either direction, the answer is the one computed from scratch."""
    one, two = tiny_pair
    for n, (source, receiver) in enumerate(((one, two), (two, one))):
        shared = f"kv transfer {n}: " + "the archive lists every shipment by port and date. " * 7
        complete(source.url, prompt=shared + "first", max_tokens=1, temperature=0)
        before = metric(receiver.url, "radixgate_worker_kv_fetched_tokens_total")
        body = {"prompt": shared + "second", "temperature": 0, "logprobs": 2}
        hinted = httpx.post(receiver.url + "/v1/completions", json={"max_tokens": 16, **body}, timeout=120,
                            headers={"x-radixgate-kv-source": source.url}).json()  # fmt: skip
        fetched = metric(receiver.url, "radixgate_worker_kv_fetched_tokens_total") - before
        assert fetched == hinted["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shared) - 16
        assert_same(hinted, complete(source.url, **body))


def test_an_fp8_pool_moves_kv_between_one_rank_and_two_ranks_both_ways(tmp_path):
    """--kv-cache-dtype fp8_e4m3: the two-rank worker's export gathers both ranks' fp8 heads and its
    import splits them (the parts travel as bytes: torch cannot unpickle fp8 tensors); either way the
    answer is the source's own from its cached prefix (the same rounded K/V read back)."""
    one, two = serve_pair("tiny", tmp_path, ["--kv-cache-tokens", "2048", "--kv-cache-dtype", "fp8_e4m3"])
    try:
        for n, (source, receiver) in enumerate(((one, two), (two, one))):
            shared = f"fp8 transfer {n}: " + "the ledger lists every cask by cellar and vintage. " * 6
            complete(source.url, prompt=shared + "first", max_tokens=1, temperature=0)
            body = {"prompt": shared + "second", "temperature": 0, "logprobs": 2}
            hinted = httpx.post(receiver.url + "/v1/completions", json={"max_tokens": 16, **body}, timeout=120,
                                headers={"x-radixgate-kv-source": source.url}).json()  # fmt: skip
            assert hinted["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shared) - 16
            assert metric(receiver.url, "radixgate_worker_kv_fetched_tokens_total") > 0
            assert_same(hinted, complete(source.url, **body))
    finally:
        two.stop()
        one.stop()


def test_speculative_decoding_with_two_ranks(tiny_pair, tmp_path):
    one, _ = tiny_pair
    spec = start_module(
        "worker",
        ["--model", "tiny", *COMMON, "--tensor-parallel-size", "2", "--speculative-tokens", "4",
         "--speculative-ngram-min", "1"],
        str(tmp_path),
    )  # fmt: skip
    try:
        body = {"prompt": PROMPTS[1] * 2, "temperature": 0, "logprobs": 1, "max_tokens": 40}
        assert_same(complete(one.url, **body), complete(spec.url, **body))
        assert metric(spec.url, "radixgate_worker_spec_accepted_tokens_total") > 0
    finally:
        spec.stop()


def randomize_biases(ckpt: Path) -> None:
    """transformers initializes biases to zero, which would hide a bias added on the wrong rank."""
    from safetensors.torch import load_file, save_file

    path = next(ckpt.glob("*.safetensors"))
    weights = load_file(str(path))
    gen = torch.Generator().manual_seed(5)
    biases = [n for n in weights if n.endswith(".bias")]
    assert biases
    for name in biases:
        weights[name] = torch.randn(weights[name].shape, generator=gen) * 0.5
    save_file(weights, str(path), metadata={"format": "pt"})


# NOTE: each family splits in its own way; the default tier runs four (three processes a case, ~30 s): a dense
# model with biases, experts with a shared one, Gemma 3's norms and windows, gpt-oss's sinks and biased experts
@pytest.mark.parametrize(
    "model_type,overrides",
    [
        # q/k/v biases and tied embeddings (the lm_head is a slice of the embedding on each rank)
        pytest.param("qwen2", {"tie_word_embeddings": True}, marks=SLOW),
        # q/k RMSNorm per head (whole on each rank) and head_dim x heads != hidden size
        pytest.param("qwen3", {"head_dim": 32}, marks=SLOW),
        # o_proj and MLP biases (added once, after the sum) and an odd vocabulary (unequal lm_head parts)
        ("llama", {"attention_bias": True, "mlp_bias": True, "vocab_size": 401}),
        # q/k/v and gate/up stored fused: each rank takes its heads of each, its rows of each
        pytest.param("phi3", {}, marks=SLOW),
        # Granite's multipliers (the residual one folded into each rank's o_proj / down_proj part)
        pytest.param("granite", GRANITE, marks=SLOW),
        # every expert split by its intermediate units (Mixtral's w1 / w3 / w2 names), the router whole
        pytest.param("mixtral", MIXTRAL, marks=SLOW),
        # the shared expert split as well, its sigmoid gate whole; a dense layer between sparse ones
        ("qwen2_moe", QWEN2_MOE),
        # Gemma 3: norms on each sublayer's summed output, whole on each rank; sliding layers
        ("gemma3_text", GEMMA3),
        # Gemma 2: soft-capped scores in each rank's heads, soft-capped logits
        pytest.param("gemma2", GEMMA2, marks=SLOW),
        # Granite 3 MoE: the stacked experts split per expert, the ungated shared expert too
        pytest.param("granitemoeshared", {**GRANITE_MOE, "shared_intermediate_size": 40}, marks=SLOW),
        # gpt-oss: each rank's heads' sinks, the experts' gate/up biases split with them, their down biases and
        # o_proj's added once, the router's bias whole
        ("gpt_oss", GPT_OSS),
    ],
)
def test_hf_checkpoints_split_over_two_ranks(tmp_path, model_type, overrides):
    ckpt = save_checkpoint(tmp_path / "ckpt", model_type, **overrides)
    if model_type in ("qwen2", "llama", "qwen2_moe"):  # NOTE: the others have no biases
        randomize_biases(ckpt)
    assert_two_ranks_answer_as_one(str(ckpt), tmp_path, ["--kv-cache-tokens", "2048"])


def assert_two_ranks_answer_as_one(model: str, tmp: Path, extra: list[str]) -> None:
    """One rank and two serving ``model`` with ``extra`` flags give the same greedy text and logprobs, and
    the same prompt logprobs."""
    one, two = serve_pair(model, tmp, extra)
    try:
        for body in (
            {"prompt": PROMPTS[1], "temperature": 0, "logprobs": 2},
            {"prompt": PROMPTS[0], "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0},
        ):
            assert_same(complete(one.url, **body), complete(two.url, **body))
    finally:
        two.stop()
        one.stop()


@pytest.mark.parametrize(
    "units", [64, pytest.param(96, marks=SLOW)], ids=["a-block-each", "two-blocks-and-one"]
)
def test_packed_mxfp4_experts_split_over_two_ranks(tmp_path, units):
    """gpt-oss's MXFP4 experts kept packed on each rank: the gate/up codes and scales split by rows, the down
    ones by columns, in whole 32-unit blocks (one each; or 64 and 32 units of 96, unequal parts), against
    one rank serving them the same way."""
    from tests.worker.test_gpt_oss import quantize_checkpoint

    ckpt = quantize_checkpoint(
        save_checkpoint(tmp_path / "ckpt", "gpt_oss", **{**GPT_OSS, "intermediate_size": units})
    )
    one, two = serve_pair(str(ckpt), tmp_path, ["--kv-cache-tokens", "2048", "--mxfp4-experts", "packed"])
    try:
        body = {"prompt": PROMPTS[1], "temperature": 0, "logprobs": 2}
        assert_same(complete(one.url, **body), complete(two.url, **body))
    finally:
        two.stop()
        one.stop()


def test_packed_mxfp4_experts_need_a_block_a_rank_and_dequantized_ones_do_not(tmp_path):
    """Checked at start, before any rank starts, as --mxfp4-experts serves the experts: 64 units (2
    blocks) packed over 4 ranks are refused, naming the way out; dequantized they split evenly."""
    from tests.worker.test_gpt_oss import quantize_checkpoint
    from worker.model.loader import read_config, served_experts

    overrides = {**GPT_OSS, "intermediate_size": 64, "num_key_value_heads": 4}
    ckpt = quantize_checkpoint(save_checkpoint(tmp_path / "ckpt", "gpt_oss", **overrides))
    done = run_worker(["--model", str(ckpt), *COMMON, "--tensor-parallel-size", "4", "--mxfp4-experts", "packed",
                       "--port", "1"])  # fmt: skip
    assert done.returncode == 2
    assert "need a 32-unit block each; moe_intermediate_size 64 has 2" in done.stderr, done.stderr
    Shard(0, 4).check(served_experts(read_config(str(ckpt)), "dequantized", torch.device("cpu")))
    Shard(0, 4).check(served_experts(read_config(str(ckpt)), "auto", torch.device("cpu")))  # the CPU's choice


def run_worker(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": ROOT},
    )  # fmt: skip


def test_sizes_that_do_not_split_the_model_are_errors_at_start():
    done = run_worker(["--model", "tiny", *COMMON, "--tensor-parallel-size", "3", "--port", "1"])
    assert done.returncode == 2
    assert "--tensor-parallel-size 3 does not divide the model's num_attention_heads (8)" in done.stderr
    for bad in (["--tensor-parallel-size", "0"], ["--tensor-parallel-size", "2", "--engine", "sim"]):
        done = run_worker(["--model", "tiny", *bad])
        assert done.returncode == 2 and "--tensor-parallel-size" in done.stderr
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Shard(0, 4).check(ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=1,
                                      num_heads=8, num_kv_heads=2, head_dim=8))  # fmt: skip
    # NOTE: a dense MLP's width counts only where some layer has one: an all-sparse MoE's (Qwen3-MoE's
    # intermediate_size) was refused though no rank splits it
    moe = dict(vocab_size=10, hidden_size=64, intermediate_size=91, num_layers=2, num_heads=8, num_kv_heads=2,
               head_dim=8, num_experts=4, moe_intermediate_size=32)  # fmt: skip
    Shard(0, 2).check(ModelConfig(**moe))
    with pytest.raises(ValueError, match="intermediate_size"):
        Shard(0, 2).check(ModelConfig(**moe, dense_layers=(1,)))


def test_weight_parts_tile_each_weight():
    """Every rank's parts of every weight, put back together, are the whole weight."""
    c = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=2, num_experts=6, experts_per_token=2, moe_intermediate_size=6,
                    shared_expert_intermediate_size=10)  # fmt: skip
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": ((8, 8), 0),
        "model.layers.0.self_attn.k_proj.weight": ((4, 8), 0),
        "model.layers.0.self_attn.k_proj.bias": ((4,), 0),
        "model.layers.0.mlp.up_proj.weight": ((12, 8), 0),
        "model.layers.0.self_attn.o_proj.weight": ((8, 8), 1),
        "model.layers.0.mlp.down_proj.weight": ((8, 12), 1),
        "lm_head.weight": ((11, 8), 0),
        "model.layers.0.mlp.experts.5.up_proj.weight": ((6, 8), 0),
        "model.layers.0.mlp.experts.5.down_proj.weight": ((8, 6), 1),
        "model.layers.0.mlp.shared_expert.gate_proj.weight": ((10, 8), 0),
        "model.layers.0.mlp.shared_expert.down_proj.weight": ((8, 10), 1),
        "model.layers.0.mlp.experts.5.gate_proj.bias": ((6,), 0),
        "model.layers.0.self_attn.sinks": ((4,), 0),
    }
    for name, (shape, dim) in shapes.items():
        whole = torch.randn(shape)
        parts = [Shard(r, 2).weight(c, name, whole) for r in range(2)]
        assert torch.equal(torch.cat(parts, dim=dim), whole), name
    bias = torch.randn(8)
    assert Shard(1, 2).weight(c, "model.layers.0.mlp.down_proj.bias", bias) is bias  # whole, added once
    assert Shard(1, 2).weight(c, "model.layers.0.mlp.experts.5.down_proj.bias", bias) is bias
    router_bias = torch.randn(6)
    assert Shard(1, 2).weight(c, "model.layers.0.mlp.gate.bias", router_bias) is router_bias
    for whole_on_each in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"):
        router = torch.randn(6, 8)
        assert Shard(1, 2).weight(c, whole_on_each, router) is router
    assert [Shard(r, 2).vocab_range(11) for r in range(2)] == [(0, 6), (6, 11)]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
        return [int(p) for p in f.read().split()]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


SHORT_DEFAULT_TIMEOUT = """\
# a new group's default timeout (torch's 30 min) made 4 s: what an idle worker outlives shows in seconds
# (not the first group's: its rendezvous waits for the ranks to start, longer on a loaded machine)
import datetime

import torch.distributed as dist

_short, _new = datetime.timedelta(seconds=4), dist.new_group
dist.new_group = lambda *a, **k: _new(*a, **{"timeout": _short, **k})
"""


def test_an_idle_worker_outlives_the_process_groups_default_timeout(tmp_path):
    """The ranks wait for rank 0's next message however long the worker idles: with torch's default
    timeout (30 min; here made 4 s) on their control group the ranks gave up waiting on an idle worker,
    and it died."""
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "sitecustomize.py").write_text(SHORT_DEFAULT_TIMEOUT)
    env = {"PYTHONPATH": f"{tmp_path / 'short'}{os.pathsep}{ROOT}"}
    worker = start_module("worker", ["--model", "tiny", *COMMON, "--tensor-parallel-size", "2"], str(tmp_path),
                          env=env)  # fmt: skip
    try:
        first = complete(worker.url, prompt=PROMPTS[0], temperature=0)
        time.sleep(8)  # idle, twice the (shortened) default timeout
        assert worker.proc.poll() is None, worker.log()[-2000:]
        assert complete(worker.url, prompt=PROMPTS[0], temperature=0)["choices"] == first["choices"]
    finally:
        worker.stop()


def test_a_rank_dying_stops_the_worker_and_rank_0_dying_stops_the_ranks(tmp_path):
    worker = start_module(
        "worker", ["--model", "tiny", *COMMON, "--tensor-parallel-size", "2"], str(tmp_path)
    )
    try:
        rank1 = int(re.search(r"tensor parallel: 2 ranks \(pids \[(\d+)\]\)", worker.log()).group(1))
        assert rank1 in _children(worker.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        wait_until(lambda: worker.proc.poll() is not None, 30, what="rank 0 exiting")
        assert worker.proc.returncode == 1
        assert "tensor-parallel rank 1 exited" in worker.log()
    finally:
        worker.stop()
    worker = start_module(
        "worker", ["--model", "tiny", *COMMON, "--tensor-parallel-size", "2"], str(tmp_path)
    )
    try:
        rank1 = int(re.search(r"tensor parallel: 2 ranks \(pids \[(\d+)\]\)", worker.log()).group(1))
        os.kill(worker.proc.pid, signal.SIGKILL)
        wait_until(lambda: _gone(rank1), 30, what="rank 1 exiting after rank 0")
    finally:
        worker.stop()


def test_lora_adapters_split_over_two_ranks(llama_checkpoint, tmp_path):
    """Adapters from start-up and loaded at runtime answer on two ranks as on one, alone and in a
    batch with base requests; unloading one leaves the others serving."""
    import asyncio

    from tests.worker.test_lora import write_adapter

    write_adapter(llama_checkpoint, tmp_path / "ad")
    one, two = serve_pair(str(llama_checkpoint), tmp_path, ["--kv-cache-tokens", "2048", "--lora-adapter",
                                                             f"ad={tmp_path / 'ad'}"])  # fmt: skip
    try:
        # NOTE: its config can be read once (a pipe): the other rank must take what rank 0 read, not
        # read the directory again (changed since, or gone: it once killed the worker after the 200)
        late = tmp_path / "late"
        late.mkdir()
        shutil.copy(tmp_path / "ad" / "adapter_model.safetensors", late)
        os.mkfifo(late / "adapter_config.json")
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(httpx.post, two.url + "/v1/load_lora_adapter",
                                  json={"lora_name": "late", "lora_path": str(late)}, timeout=60)  # fmt: skip
            config = (tmp_path / "ad" / "adapter_config.json").read_bytes()
            deadline = time.monotonic() + 60
            while True:  # NOTE: opened without blocking: ENXIO until rank 0 opens it to read
                try:
                    fd = os.open(late / "adapter_config.json", os.O_WRONLY | os.O_NONBLOCK)
                    break
                except OSError:
                    assert time.monotonic() < deadline and not loading.done(), "rank 0 never read it"
                    time.sleep(0.05)
            os.write(fd, config)
            os.close(fd)
            r = loading.result()
        assert r.status_code == 200, r.text
        body = {"prompt": PROMPTS[1], "temperature": 0, "logprobs": 2}
        want = {m: complete(one.url, model=m, **body) for m in (llama_checkpoint.name, "ad")}
        assert want["ad"]["choices"][0]["text"] != want[llama_checkpoint.name]["choices"][0]["text"]

        async def together(models: list[str]) -> list[dict]:
            async with httpx.AsyncClient(timeout=120) as client:
                rs = await asyncio.gather(*(client.post(two.url + "/v1/completions", json={
                    "max_tokens": 16, "model": m, **body}) for m in models))  # fmt: skip
            return [r.json() for r in rs]

        got = asyncio.run(together([llama_checkpoint.name, "ad", "late"]))
        assert_same(got[0], want[llama_checkpoint.name])
        assert_same(got[1], want["ad"])
        assert_same(got[2], want["ad"])  # the same directory, loaded at runtime
        r = httpx.post(two.url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        assert_same(complete(two.url, model="ad", **body), want["ad"])
    finally:
        two.stop()
        one.stop()
