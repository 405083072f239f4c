"""--fp8-weights fp8: an fp8 checkpoint's attention and dense MLP projections kept in fp8 on the device with
their scales (a block's, a row's, a tensor's as a row's), multiplied in kernels.fp8_linear: the same model as
the weights dequantized at load, in half a 16-bit weight's bytes; Granite's residual multiplier through the
scales; the choice ``auto`` makes on each device; what cannot stay in fp8 refused (``fp8``) or dequantized
(``auto``); two ranks splitting the weights with their scales answer as one."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import reference
from tests.support import SLOW
from tests.worker.conftest import GRANITE, MIXTRAL, QWEN3_MOE, save_checkpoint
from tests.worker.test_fp8_weights import fp8_pair, logits_of
from tests.worker.test_tensor_parallel import assert_two_ranks_answer_as_one
from worker.model import load_model
from worker.model.loader import read_config, safetensors_files, served_fp8
from worker.model.shard import Shard

KINDS = [("fp8", "block"), ("fp8", "tensor"), ("compressed-tensors", "channel"),
         ("compressed-tensors", "tensor"), ("compressed-tensors", "block")]  # fmt: skip
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    """Llama with 144 intermediate units: 9 blocks of 16 rows; down_proj's 144 columns end in half a block."""
    return save_checkpoint(tmp_path_factory.mktemp("fp8_kept"), "llama", intermediate_size=144)


def kept_logits(path, dtype=torch.float32) -> torch.Tensor:
    return logits_of(path, dtype, fp8_weights="fp8")


@pytest.mark.parametrize(("method", "strategy"), KINDS)
def test_kept_fp8_projections_are_the_model_of_their_dequantized_weights(
    llama_base, tmp_path, method, strategy
):
    fp8, _ = fp8_pair(llama_base, tmp_path, method, strategy)
    kept, plain = load_model(str(fp8), fp8_weights="fp8"), load_model(str(fp8), fp8_weights="dequantized")
    assert kept.config.fp8_projections and not plain.config.fp8_projections
    for layer, plain_layer in zip(kept.model.layers, plain.model.layers, strict=True):
        for name in PROJECTIONS:
            weight = getattr(layer, name)
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == getattr(plain_layer, name).shape
    rows = {"block": (16, 32)}.get(strategy)
    assert kept.model.layers[0].qkv_scale.shape == ((8, 2) if rows else (128, 1))  # 128 rows, 64 columns
    # a tensor's scale kept as its rows' (q, k and v each their own in the stacked projection)
    if strategy == "tensor":
        scales = load_file(str(fp8 / "model.safetensors"))
        suffix = "weight_scale_inv" if method == "fp8" else "weight_scale"
        k_scale = scales[f"model.layers.1.self_attn.k_proj.{suffix}"].item()
        assert torch.equal(kept.model.layers[1].qkv_scale[64:96], torch.full((32, 1), k_scale))
    # float32: the same products as the dequantized weights' (each weight times its scale, exact in float32)
    torch.testing.assert_close(kept_logits(fp8), logits_of(fp8), rtol=1e-5, atol=1e-5)
    # bf16: the dequantized weights round once to bf16, the kept ones never: close, not equal
    got, want = kept_logits(fp8, torch.bfloat16), logits_of(fp8, torch.bfloat16)
    assert ((got - want).norm() / want.norm()).item() < 3e-2


@pytest.mark.parametrize(("model_type", "overrides"), [("qwen3_moe", QWEN3_MOE), ("mixtral", MIXTRAL)])
def test_kept_fp8_experts_are_the_experts_of_their_dequantized_weights(tmp_path, model_type, overrides):
    """Every expert kept in fp8 beside the attention (Mixtral's w1 / w3 / w2 names too), multiplied in the
    experts' GEMMs (kernels.moe) with their block scales: the model of the dequantized weights."""
    base = save_checkpoint(tmp_path / "moe", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    kept = load_model(str(fp8), fp8_weights="fp8").model
    layer = kept.layers[0]
    assert layer.sparse and layer.experts_gate_up.dtype == layer.experts_down.dtype == torch.float8_e4m3fn
    assert layer.experts_gate_up_scales.dtype == torch.float32
    torch.testing.assert_close(kept_logits(fp8), logits_of(fp8), rtol=1e-5, atol=1e-5)


def test_kept_projections_take_half_the_bytes_of_bf16_ones(llama_base, tmp_path):
    fp8, _ = fp8_pair(llama_base, tmp_path, "fp8", "block")

    def projection_bytes(fp8_weights: str) -> int:
        model = load_model(str(fp8), dtype=torch.bfloat16, fp8_weights=fp8_weights).model
        return sum(getattr(layer, n).nbytes for layer in model.layers for n in PROJECTIONS)

    assert projection_bytes("fp8") * 2 == projection_bytes("dequantized")


def test_granites_residual_multiplier_scales_the_kept_weights_through_their_scales(tmp_path):
    base = save_checkpoint(tmp_path / "granite", "granite", **GRANITE)
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    assert read_config(str(fp8)).residual_multiplier != 1.0
    torch.testing.assert_close(kept_logits(fp8), logits_of(fp8), rtol=1e-5, atol=1e-5)


def test_auto_keeps_fp8_on_cuda_from_sm89_and_dequantizes_elsewhere(llama_base, tmp_path, monkeypatch):
    """The decision alone (no CUDA here: the device's compute capability is what torch would report)."""
    fp8, _ = fp8_pair(llama_base, tmp_path, "fp8", "block")
    config, files = read_config(str(fp8)), safetensors_files(str(fp8))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not served_fp8(config, "auto", cpu, files=files).fp8_projections
    assert served_fp8(config, "fp8", cpu, files=files).fp8_projections  # on the CPU: the reference path
    assert not served_fp8(config, "dequantized", cuda, files=files).fp8_projections
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert served_fp8(config, "auto", cuda, files=files).fp8_projections
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert not served_fp8(config, "auto", cuda, files=files).fp8_projections
    with pytest.raises(ValueError, match=r"compute capability 8\.9.*--fp8-weights dequantized"):
        served_fp8(config, "fp8", cuda, files=files)
    plain = read_config(str(llama_base))  # not an fp8 checkpoint: nothing to keep
    assert served_fp8(plain, "fp8", cpu) == plain
    with pytest.raises(ValueError, match="fp8_weights must be one of"):
        served_fp8(config, "e4m3", cpu)


@pytest.mark.parametrize(
    ("model_type", "overrides", "strategy", "edit", "refusal"),
    [
        # 136 gate/up rows: 8.5 blocks of 16 (stacked gate then up, the up rows would start mid-block)
        (
            "llama",
            {"intermediate_size": 136},
            "block",
            None,
            "136 gate_proj and up_proj rows are not whole 16x32",
        ),
        # Phi-3's fused q/k/v and gate/up weights: one scale grid over three projections
        ("phi3", {}, "tensor", None, r"layers\.0\.mlp\.gate_up_proj\.weight holds fused projections"),
        # a projection the checkpoint left unquantized (a quantizer's ignore list)
        ("llama", {}, "channel", "unquantized", r"layers\.1\.mlp\.down_proj\.weight is F32, not fp8"),
    ],
    ids=["partial-blocks", "phi3-fused", "one-left-unquantized"],
)
def test_what_cannot_stay_in_fp8_is_refused_under_fp8_and_dequantized_under_auto(
    tmp_path, monkeypatch, caplog, model_type, overrides, strategy, edit, refusal
):
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, "compressed-tensors" if strategy == "channel" else "fp8", strategy)
    if edit == "unquantized":
        weights = load_file(str(fp8 / "model.safetensors"))
        name = "model.layers.1.mlp.down_proj.weight"
        weights[name] = weights[name].float() * weights.pop(name.replace("weight", "weight_scale"))
        save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match=f"--fp8-weights fp8: .*{refusal}.*--fp8-weights dequantized"):
        load_model(str(fp8), fp8_weights="fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        config = served_fp8(
            read_config(str(fp8)), "auto", torch.device("cuda"), files=safetensors_files(str(fp8))
        )
    assert config.fp8_weights and not config.fp8_projections
    assert re.search(f"fp8 projections dequantized at load: .*{refusal}", caplog.text)  # the reason, logged
    assert torch.isfinite(logits_of(fp8, fp8_weights="dequantized")).all()  # dequantized, it serves


def test_a_weight_the_headers_did_not_show_unquantized_is_refused_at_load(llama_base, tmp_path):
    """The headers are checked first; loading refuses a cast too (a kept slot is filled with fp8 only)."""
    fp8, _ = fp8_pair(llama_base, tmp_path, "fp8", "block")
    config = dataclasses.replace(read_config(str(fp8)), fp8_projections=True)
    from worker.model.llama import LlamaForCausalLM
    from worker.model.loader import iter_safetensors

    weights = dict(iter_safetensors(safetensors_files(str(fp8))))
    weights["model.layers.0.self_attn.o_proj.weight"] = weights[
        "model.layers.0.self_attn.o_proj.weight"
    ].float()
    with pytest.raises(ValueError, match=r"o_proj\.weight' is torch\.float32 in the checkpoint, not fp8"):
        LlamaForCausalLM(config, "cpu", torch.float32).load_weights(weights.items())


def test_ranks_must_hold_whole_scale_blocks(llama_base, tmp_path):
    """Over 2 ranks each holds 72 of the 144 gate/up rows and down columns: 4.5 blocks of 16 rows."""
    fp8, _ = fp8_pair(llama_base, tmp_path, "fp8", "block")
    config, files = read_config(str(fp8)), safetensors_files(str(fp8))
    assert served_fp8(config, "fp8", torch.device("cpu"), Shard(0, 1), files).fp8_projections
    with pytest.raises(
        ValueError, match="72 gate_proj and up_proj rows on each of 2 ranks are not whole 16x32"
    ):
        served_fp8(config, "fp8", torch.device("cpu"), Shard(0, 2), files)
    per_row = dataclasses.replace(config, fp8_weight_block=None)  # one scale a row: any split
    assert served_fp8(per_row, "fp8", torch.device("cpu"), Shard(0, 2), files).fp8_projections
    # experts of 32 units in 16 x 32 blocks: one block of rows a rank, but half a block of down columns
    moe = dataclasses.replace(config, intermediate_size=128, num_experts=8, moe_intermediate_size=32)
    assert served_fp8(moe, "fp8", torch.device("cpu"), Shard(0, 1)).fp8_projections
    with pytest.raises(ValueError, match="16 experts' down_proj columns on each of 2 ranks are not whole"):
        served_fp8(moe, "fp8", torch.device("cpu"), Shard(0, 2))


@pytest.mark.parametrize(
    ("model_type", "overrides", "strategy"),
    # NOTE: the default tier splits block scales and the experts' per-row ones; the full tier a dense model's rows too
    [
        ("llama", {}, "block"),
        pytest.param("llama", {}, "channel", marks=SLOW),
        ("qwen3_moe", QWEN3_MOE, "channel"),
    ],
    ids=["blocks", "rows", "moe-rows"],
)
def test_two_ranks_split_kept_fp8_projections_with_their_scales(tmp_path, model_type, overrides, strategy):
    """Llama's 128 intermediate units: each rank 64 gate/up rows (4 blocks of 16) and 64 down columns (2 of
    32), 32 q rows and o columns, 16 k and v rows; per row, the scales follow the rows and stay whole by
    column, every expert's too (Qwen3-MoE: 16 of its 32 units a rank). Real worker processes over gloo,
    against one rank serving the same checkpoint kept in fp8."""
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, "fp8" if strategy == "block" else "compressed-tensors", strategy)
    assert_two_ranks_answer_as_one(str(fp8), tmp_path, ["--kv-cache-tokens", "2048", "--fp8-weights", "fp8"])


def test_the_flag_is_validated():
    from worker.config import WorkerConfig

    WorkerConfig(fp8_weights="fp8", quantization="fp8").validate()
    with pytest.raises(ValueError, match="--fp8-weights must be one of auto, fp8, dequantized"):
        WorkerConfig(fp8_weights="kept").validate()
    with pytest.raises(ValueError, match="--quantization must be one of none, fp8"):
        WorkerConfig(quantization="int4").validate()


def test_a_rank_takes_the_scale_blocks_of_its_rows_and_columns(llama_base):
    """Block scales follow their weight's split in whole blocks: a rank's part of a weight dequantized with
    its part of the scales is that rank's rows (gate/up, q/k/v, every expert's) or columns (o, down) of the
    whole weight dequantized; one scale a row follows the rows and is whole by column."""
    config = dataclasses.replace(
        read_config(str(llama_base)), intermediate_size=128, num_experts=4, moe_intermediate_size=64,
        fp8_weights=True, fp8_weight_block=(16, 32), fp8_projections=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    names = {"model.layers.0.mlp.experts.3.up_proj": (64, 64), "model.layers.0.mlp.experts.3.down_proj": (64, 64),
             "model.layers.0.self_attn.k_proj": (32, 64), "model.layers.0.self_attn.o_proj": (64, 64)}  # fmt: skip
    for owner, (n, k) in names.items():
        w = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
        for block, scale in (
            ((16, 32), torch.rand(n // 16, k // 32, generator=g)),
            (None, torch.rand(n, 1, generator=g)),
        ):
            c = dataclasses.replace(config, fp8_weight_block=block)
            whole = reference.dequantize_fp8_weight(w, scale, block, torch.float32)
            by_rows = not owner.endswith(("down_proj", "o_proj"))
            for rank in range(2):
                shard = Shard(rank, 2)
                part = reference.dequantize_fp8_weight(
                    shard.weight(c, f"{owner}.weight", w), shard.weight(c, f"{owner}.weight_scale", scale), block,
                    torch.float32,
                )  # fmt: skip
                half = (n if by_rows else k) // 2
                want = (
                    whole[rank * half : (rank + 1) * half]
                    if by_rows
                    else whole[:, rank * half : (rank + 1) * half]
                )
                assert torch.equal(part, want), (owner, block, rank)


def test_rows_quantize_to_fp8_by_their_largest_magnitude():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3e-3, 448.0, -1e4]])
    codes, scales = reference.quantize_fp8_rows(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (3, 1)
    assert scales[:, 0].tolist() == pytest.approx([2 / 448, 1.0, 1e4 / 448])
    assert codes[0].float().tolist() == [224.0, -448.0, 112.0] and codes[1].float().abs().sum() == 0
    back = reference.dequantize_fp8_weight(codes, scales, None, torch.float32)
    assert back[2, 2] == -1e4 and torch.allclose(back[0], w[0])
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=g)
    codes, scales = reference.quantize_fp8_rows(w)
    err = (reference.dequantize_fp8_weight(codes, scales, None, torch.float32) - w).abs()
    assert (err <= w.abs().amax(dim=1, keepdim=True) * 2**-4).all()  # half an ulp of e4m3 at most
    assert err.max() > 0  # and it is quantized


@pytest.mark.parametrize(("model_type", "overrides"), [("llama", {}), ("qwen3_moe", QWEN3_MOE)])
def test_quantization_fp8_serves_a_16_bit_checkpoint_as_its_rows_quantized(tmp_path, model_type, overrides):
    """--quantization fp8: every projection (the experts' too) quantized at load, one scale a row: the model
    of a checkpoint holding those quantized weights dequantized (not the checkpoint's own: it is rounded)."""
    from safetensors.torch import load_file, save_file

    from worker.model.checkpoint import FP8_PROJECTION

    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    quantized = load_model(str(base), quantization="fp8")
    assert quantized.config.fp8_projections and not quantized.config.fp8_weights
    layer = quantized.model.layers[0]
    kept = (
        layer.qkv_proj,
        layer.o_proj,
        *((layer.experts_gate_up, layer.experts_down) if layer.sparse else ()),
    )
    assert all(w.dtype == torch.float8_e4m3fn for w in kept)
    rounded = tmp_path / "rounded"
    shutil.copytree(base, rounded)
    weights = load_file(str(base / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(".weight") and FP8_PROJECTION.search(name.removesuffix(".weight")):
            weights[name] = reference.dequantize_fp8_weight(
                *reference.quantize_fp8_rows(w), None, torch.float32
            )
    save_file(weights, str(rounded / "model.safetensors"))
    got = logits_of(base, quantization="fp8")
    torch.testing.assert_close(got, logits_of(rounded), rtol=1e-5, atol=1e-5)
    assert ((got - logits_of(base)).norm() / logits_of(base).norm()).item() > 1e-3  # it is quantized


def test_quantization_fp8_is_refused_where_it_cannot_serve(llama_base, tmp_path, monkeypatch):
    from worker.model.loader import quantized_at_load

    fp8, _ = fp8_pair(llama_base, tmp_path, "fp8", "block")
    with pytest.raises(ValueError, match=r"the checkpoint is fp8 already \(--fp8-weights serves it\)"):
        load_model(str(fp8), quantization="fp8")
    config = read_config(str(llama_base))
    with pytest.raises(ValueError, match="experts are MXFP4; serve them with --mxfp4-experts dequantized"):
        quantized_at_load(dataclasses.replace(config, mxfp4_experts=True), "fp8", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 6))
    with pytest.raises(ValueError, match=r"compute capability 8\.9"):
        quantized_at_load(config, "fp8", torch.device("cuda"))
    assert quantized_at_load(config, "none", torch.device("cuda")) == config
    with pytest.raises(ValueError, match="quantization must be one of none, fp8"):
        quantized_at_load(config, "int8", torch.device("cpu"))


def test_cache_info_says_the_tiny_model_is_quantized_at_load():
    from tests.worker.test_server import LiveServer
    from worker.assembly import build_engine
    from worker.config import WorkerConfig

    cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=1024, warmup_tokens=0, quantization="fp8")
    with LiveServer(build_engine(cfg)) as worker:
        info = httpx.get(worker.url + "/v1/cache/info", timeout=10).json()
    assert info["fp8_projections"] == {
        "source": "quantized at load",
        "scales": "row",
        "activations": "float32",
    }


def test_two_ranks_serve_the_tiny_model_quantized_as_one(tmp_path):
    assert_two_ranks_answer_as_one("tiny", tmp_path, ["--kv-cache-tokens", "2048", "--quantization", "fp8"])


def test_a_lora_adapter_on_kept_fp8_projections_answers_as_on_the_dequantized_ones(llama_base, tmp_path):
    """An adapter adds its delta to a projection's output, whatever the weight's format: served over the
    projections kept in fp8, it answers as over the same checkpoint dequantized (and changes the answers)."""
    from tests.worker.test_lora import complete, write_adapter
    from tests.worker.test_server import LiveServer
    from worker.assembly import build_engine
    from worker.config import WorkerConfig

    fp8, _ = fp8_pair(llama_base, tmp_path, "fp8", "block")
    write_adapter(llama_base, tmp_path / "ad")

    def serve(fp8_weights: str) -> LiveServer:
        return LiveServer(build_engine(WorkerConfig(
            model=str(fp8), device="cpu", kv_cache_tokens=2048, warmup_tokens=0, fp8_weights=fp8_weights,
            lora_adapters=[f"ad={tmp_path / 'ad'}"],
        )))  # fmt: skip

    with serve("fp8") as kept, serve("dequantized") as plain:
        # /v1/cache/info says how the weights are served
        info = [httpx.get(w.url + "/v1/cache/info", timeout=10).json() for w in (kept, plain)]
        assert info[0]["fp8_projections"] == {
            "source": "checkpoint",
            "scales": [16, 32],
            "activations": "float32",
        }
        assert (
            info[1]["fp8_projections"] is None
            and info[0]["weight_dtype"] == info[1]["weight_dtype"] == "float32"
        )
        for prompt in ("The quick brown fox", "Paged attention stores keys"):
            got, want = complete(kept.url, "ad", prompt), complete(plain.url, "ad", prompt)
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
                want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
            )
            base = complete(kept.url, fp8.name, prompt)
            assert base["choices"][0]["text"] != got["choices"][0]["text"]


def greedy_runs(path, device: str, steps: int = 4) -> list[list[torch.Tensor]]:
    """The checkpoint at ``path`` served with --fp8-weights fp8 and dequantized (float32) on ``device``: each
    one's logits of a prefill and ``steps`` decode steps, both fed the first one's greedy tokens."""
    from tests.worker.test_model import PROMPT, decode, extend, new_pool, scattered_slots

    runs: list[list[torch.Tensor]] = []
    for fp8_weights in ("fp8", "dequantized"):
        loaded = load_model(str(path), device, torch.float32, fp8_weights=fp8_weights)
        assert loaded.config.fp8_projections == (fp8_weights == "fp8")
        ids = loaded.tokenizer.encode_prompt(PROMPT)
        pool = new_pool(loaded.config, device=device)
        [slots] = scattered_slots(pool, [len(ids) + steps])
        logits = [extend(loaded.model, pool, [ids], [0], [slots])]
        for step in range(steps):
            token = int((runs[0] if runs else logits)[step][-1].argmax())
            logits.append(decode(loaded.model, pool, [token], [len(ids) + step], [slots]))
        runs.append(logits)
    return runs


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])],
)  # fmt: skip
@pytest.mark.parametrize(
    ("model_type", "overrides"), [("llama", {"intermediate_size": 144}), ("qwen3_moe", QWEN3_MOE)]
)
def test_kept_fp8_projections_decode_as_the_dequantized_model(tmp_path, device, model_type, overrides):
    """Prefill and greedy decode steps (on CUDA: the compiled fp8 linear layer and fp8 experts, float32)
    give the logits of the same checkpoint dequantized at load (16 x 32 block scales)."""
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    kept, dequantized = greedy_runs(fp8, device)
    assert len(kept) == len(dequantized) == 5
    for got, want in zip(kept, dequantized, strict=True):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
