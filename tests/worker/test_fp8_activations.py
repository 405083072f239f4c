"""--fp8-activations dynamic: the input of every projection served in fp8 quantized to e4m3 per token group
(the weight's blocks' columns, or the whole row) at each call, then multiplied fp8 by fp8 (W8A8), the
experts' GEMMs' inputs too: the model is the dequantized model with exactly those inputs quantized; refused
where no projection is in fp8; over two ranks splitting block-scaled projections it answers as one rank;
/v1/cache/info and the start-up log say so. --fp8-activations static: those inputs quantized by the
checkpoint's calibrated input scales instead (the largest of a stacked projection's parts', of a layer's
experts'), refused where the checkpoint declares none."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import reference
from tests.worker.conftest import MIXTRAL, QWEN3_MOE, save_checkpoint
from tests.worker.test_fp8_weights import LINEAR, fp8_pair, logits_of
from tests.worker.test_tensor_parallel import assert_two_ranks_answer_as_one
from worker.model import load_model
from worker.model.llama import DecoderLayer
from worker.model.loader import served_activations


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    ("model_type", "overrides", "method", "strategy", "group"),
    [("llama", {}, "fp8", "block", 32), ("llama", {}, "compressed-tensors", "channel", None),
     ("qwen3_moe", QWEN3_MOE, "fp8", "block", 32)],
    ids=["blocks", "rows", "moe-blocks"],
)  # fmt: skip
def test_dynamic_activations_are_the_dequantized_model_with_its_projection_inputs_quantized(
    tmp_path, monkeypatch, model_type, overrides, method, strategy, group
):
    """16 x 32 blocks: each projection's input in runs of 32 columns (a row's for per-row scales); Qwen3-MoE's
    experts' GEMMs' inputs likewise (kernels.reference.fused_moe's fp8_activations on the dequantized
    experts, its groups from the blocks)."""
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, method, strategy)
    loaded = load_model(str(fp8), fp8_weights="fp8", fp8_activations="dynamic")
    assert loaded.config.fp8_projections and loaded.config.fp8_activations
    got = logits_of(fp8, fp8_weights="fp8", fp8_activations="dynamic")
    weight_only = logits_of(fp8, fp8_weights="fp8")

    project = DecoderLayer._project

    def quantized_inputs(self, x, name, bias, ops):
        k = x.shape[-1]
        codes, scales = reference.quantize_fp8_groups(x, group or k)
        return project(
            self, reference.dequantize_fp8_groups(codes, scales, group or k).to(x.dtype), name, bias, ops
        )

    monkeypatch.setattr(DecoderLayer, "_project", quantized_inputs)
    fused_moe = reference.fused_moe  # NOTE: the CPU's ops (worker.attention.kernel_ops)
    monkeypatch.setattr(reference, "fused_moe", lambda *a, **kw: fused_moe(
        *a, **{**kw, "fp8_activations": True, "fp8_block": (16, 32) if group else None}))  # fmt: skip
    want = logits_of(fp8, fp8_weights="dequantized")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rel(got, weight_only) > 1e-3  # NOTE: the inputs were quantized (not the weight-only model)


def test_dynamic_is_refused_where_no_projection_is_served_in_fp8(tmp_path):
    base = save_checkpoint(tmp_path / "base", "llama")
    with pytest.raises(ValueError, match="--fp8-activations dynamic: no projection is served in fp8"):
        load_model(str(base), fp8_activations="dynamic")
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    with pytest.raises(ValueError, match=r"auto dequantizes on the CPU"):
        load_model(str(fp8), fp8_activations="dynamic")  # --fp8-weights auto on the CPU: dequantized
    config = load_model("tiny", quantization="fp8", fp8_activations="dynamic").config
    assert config.fp8_projections and config.fp8_activations
    assert served_activations(config, "none") == config
    with pytest.raises(ValueError, match="fp8_activations must be one of none, dynamic, static"):
        served_activations(config, "w8a8")
    from worker.config import WorkerConfig

    WorkerConfig(fp8_activations="dynamic").validate()
    WorkerConfig(fp8_activations="static").validate()
    with pytest.raises(ValueError, match="--fp8-activations must be one of none, dynamic, static"):
        WorkerConfig(fp8_activations="w8a8").validate()


def served(cfg, caplog) -> tuple[str, dict, httpx.Response]:
    """Build the engine of WorkerConfig ``cfg`` and serve it: its start-up log, its /v1/cache/info and a
    4-token completion of its model."""
    from tests.worker.test_server import LiveServer
    from worker.assembly import build_engine

    with caplog.at_level(logging.INFO, logger="worker"):
        engine = build_engine(cfg)
    with LiveServer(engine) as worker:
        info = httpx.get(worker.url + "/v1/cache/info", timeout=10).json()
        [model] = httpx.get(worker.url + "/v1/models", timeout=10).json()["data"]
        reply = httpx.post(worker.url + "/v1/completions", json={"model": model["id"], "prompt": "Hello",
                                                                 "max_tokens": 4}, timeout=30)  # fmt: skip
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    return caplog.text, info, reply


def test_cache_info_and_the_log_say_the_inputs_are_quantized(caplog):
    from worker.config import WorkerConfig

    cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=1024, warmup_tokens=0, quantization="fp8",
                       fp8_activations="dynamic")  # fmt: skip
    log, info, _ = served(cfg, caplog)
    assert "their inputs quantized to fp8 per token (--fp8-activations dynamic)" in log
    assert info["fp8_projections"] == {
        "source": "quantized at load",
        "scales": "row",
        "activations": "fp8 per token",
    }


def test_two_ranks_with_block_scales_answer_as_one(tmp_path):
    """Each rank's o/down input is whole 32-column runs of the full one: the same scales as one rank's."""
    base = save_checkpoint(tmp_path / "base", "llama")
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    assert_two_ranks_answer_as_one(
        str(fp8),
        tmp_path,
        ["--kv-cache-tokens", "2048", "--fp8-weights", "fp8", "--fp8-activations", "dynamic"],
    )


def steps_on(
    path, device: str, fp8_activations: str, tokens: list[int] | None = None, steps: int = 4
) -> tuple[list[torch.Tensor], list[int]]:  # fmt: skip
    """The logits of a prefill and ``steps`` decode steps of the checkpoint at ``path`` kept in fp8
    (float32) on ``device``, each step fed ``tokens`` (default: its own greedy choices), and the tokens."""
    from tests.worker.test_model import PROMPT, decode, extend, new_pool, scattered_slots

    loaded = load_model(str(path), device, torch.float32, fp8_weights="fp8", fp8_activations=fp8_activations)
    ids = loaded.tokenizer.encode_prompt(PROMPT)
    pool = new_pool(loaded.config, device=device)
    [slots] = scattered_slots(pool, [len(ids) + steps])
    logits, fed = [extend(loaded.model, pool, [ids], [0], [slots]).cpu()], []
    for step in range(steps):
        fed.append(tokens[step] if tokens else int(logits[step][-1].argmax()))
        logits.append(decode(loaded.model, pool, [fed[-1]], [len(ids) + step], [slots]).cpu())
    return logits, fed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
@pytest.mark.parametrize(("model_type", "overrides"), [("llama", {}), ("qwen3_moe", QWEN3_MOE)])
def test_fp8_activations_on_cuda_follow_the_cpu_reference(tmp_path, model_type, overrides, scheme):
    """The compiled kernels (a decode step quantizing inside the product, a prefill first) over a prefill
    and greedy decode steps, float32: near the CPU reference path's logits, and far nearer them than the
    16-bit-input model's (as the interpreter's model test bounds it). Per token over block scales; static
    over per-tensor ones (the checkpoint's input scales)."""
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    if scheme == "dynamic":
        fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    else:
        fp8, _ = fp8_pair(base, tmp_path, "compressed-tensors", "tensor")
        with_input_scales(fp8, "compressed-tensors")
    want, tokens = steps_on(fp8, "cpu", scheme)
    got, _ = steps_on(fp8, "cuda", scheme, tokens)
    unquantized, _ = steps_on(fp8, "cpu", "none", tokens)
    for step, (g, w, u) in enumerate(zip(got, want, unquantized, strict=True)):
        err, apart = rel(g, w), rel(g, u)
        assert torch.isfinite(g).all() and err < 5e-2 and err < apart / 2, (
            f"step {step}: {err:.2e}, {apart:.2e}"
        )


# a projection's input -> the static scale it is quantized by: q/k/v's, gate/up's and a layer's experts'
# stacked (the largest of theirs)
_QUANTIZED_INPUT = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
                    "self_attn.o_proj": "o", "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up",
                    "mlp.down_proj": "down", "gate_proj": "experts_gate_up", "up_proj": "experts_gate_up",
                    "down_proj": "experts_down", "w1": "experts_gate_up", "w3": "experts_gate_up",
                    "w2": "experts_down"}  # fmt: skip


def with_input_scales(fp8, method: str) -> dict[tuple[int, str], float]:
    """The fp8 checkpoint at ``fp8`` with a calibrated-like input_scale beside each quantized weight (1/64,
    1/128 or 1/256 in turn, so that q, k and v differ, and experts: the largest matters; x / it tops 448
    for some inputs, which saturate) and its config declaring static activations. Returns the scale each
    quantized input takes: (layer, "qkv" | "o" | "gate_up" | "down" | "experts_gate_up" | "experts_down")."""
    weights = load_file(str(fp8 / "model.safetensors"))
    served: dict[tuple[int, str], float] = {}
    for i, name in enumerate(sorted(n for n in weights if LINEAR.match(n))):
        scale = 2.0 ** -(6 + i % 3)
        # NOTE: one value, as a 0-d tensor (AutoFP8) or [1] (compressed-tensors)
        weights[name.replace(".weight", ".input_scale")] = torch.tensor(scale if method == "fp8" else [scale])
        layer, part = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name).groups()
        key = (int(layer), _QUANTIZED_INPUT[re.sub(r"^(mlp|block_sparse_moe)\.experts\.\d+\.", "", part)])
        served[key] = max(served.get(key, 0.0), scale)
    save_file(weights, str(fp8 / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    if method == "fp8":
        config["quantization_config"]["activation_scheme"] = "static"
    (fp8 / "config.json").write_text(json.dumps(config))
    return served


@pytest.mark.parametrize(
    ("model_type", "overrides", "method"),
    [("llama", {}, "fp8"), ("llama", {}, "compressed-tensors"), ("qwen3_moe", QWEN3_MOE, "compressed-tensors"),
     ("mixtral", MIXTRAL, "compressed-tensors")],
    ids=["autofp8", "compressed-tensors", "moe", "mixtral"],
)  # fmt: skip
def test_static_activations_are_the_dequantized_model_with_its_inputs_quantized_by_the_checkpoints_scales(
    tmp_path, monkeypatch, model_type, overrides, method
):
    """Per-tensor fp8 weights (AutoFP8's and llm-compressor's FP8 releases): each projection's input by its
    layer's scale, q/k/v's and gate/up's the largest of theirs, a sparse layer's by the largest of its
    experts' (kernels.reference.fused_moe's static input scales on the dequantized experts; Mixtral's
    w1 / w3 / w2 names too)."""
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, method, "tensor")
    served = with_input_scales(fp8, method)
    loaded = load_model(str(fp8), fp8_weights="fp8", fp8_activations="static")
    assert loaded.config.fp8_input_scales and loaded.config.fp8_activation_scheme == "static"
    got = logits_of(fp8, fp8_weights="fp8", fp8_activations="static")
    dynamic = logits_of(fp8, fp8_weights="fp8", fp8_activations="dynamic")
    weight_only = logits_of(fp8, fp8_weights="fp8")

    project, experts, layer = DecoderLayer._project, DecoderLayer._experts, [0]

    def quantized_inputs(self, x, name, bias, ops):
        s = torch.tensor(served[(self.index, name)])
        return project(self, (reference.quantize_fp8_static(x, s).float() * s).to(x.dtype), name, bias, ops)

    def experts_of_the_layer(self, h, ops):
        layer[0] = self.index
        return experts(self, h, ops)

    monkeypatch.setattr(DecoderLayer, "_project", quantized_inputs)
    monkeypatch.setattr(DecoderLayer, "_experts", experts_of_the_layer)
    fused_moe = reference.fused_moe  # NOTE: the CPU's ops (worker.attention.kernel_ops)
    monkeypatch.setattr(reference, "fused_moe", lambda *a, **kw: fused_moe(
        *a, **{**kw, "fp8_activations": True, "w13_input_scale": torch.tensor(served[(layer[0], "experts_gate_up")]),
               "w2_input_scale": torch.tensor(served[(layer[0], "experts_down")])}))  # fmt: skip
    want = logits_of(fp8, fp8_weights="dequantized")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rel(got, dynamic) > 1e-3 and rel(got, weight_only) > 1e-3


def test_static_needs_the_checkpoints_declared_input_scales(tmp_path):
    """Refused where the checkpoint declares dynamic activations or none (--quantization fp8 has none), or
    lacks a projection's input scale; one of several values is refused by name."""
    base = save_checkpoint(tmp_path / "base", "llama")
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    with pytest.raises(ValueError, match="the checkpoint declares dynamic activations: use --fp8-activations "
                                         "dynamic"):  # fmt: skip
        load_model(str(fp8), fp8_weights="fp8", fp8_activations="static")
    with pytest.raises(ValueError, match="--quantization fp8 has none"):
        load_model("tiny", quantization="fp8", fp8_activations="static")
    with pytest.raises(ValueError, match="--fp8-activations static: no projection is served in fp8"):
        load_model(str(base), fp8_activations="static")
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "tensor")
    with_input_scales(fp8, "fp8")
    weights = load_file(str(fp8 / "model.safetensors"))
    saved = weights.pop("model.layers.1.self_attn.v_proj.input_scale")
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.v_proj\.input_scale"
    ):
        load_model(str(fp8), fp8_weights="fp8", fp8_activations="static")
    weights["model.layers.1.self_attn.v_proj.input_scale"] = saved.expand(4).contiguous()
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"v_proj\.input_scale has 4 values: static input scales are one a "):
        load_model(str(fp8), fp8_weights="fp8", fp8_activations="static")
    # weight-only (the input scales unread), or per token (dynamic) on the same checkpoint
    assert not load_model(str(fp8), fp8_weights="fp8").config.fp8_activations
    # an input scale of zero, inf or NaN loaded, and every answer was inf or NaN (or far off): refused by name
    for bad in (0.0, float("inf"), float("nan"), -1.0):
        weights["model.layers.1.self_attn.v_proj.input_scale"] = torch.tensor([bad])
        save_file(weights, str(fp8 / "model.safetensors"))
        with pytest.raises(
            ValueError, match=r"v_proj\.input_scale is .+: static input scales must be positive and finite"
        ):
            load_model(str(fp8), fp8_weights="fp8", fp8_activations="static")
    # a weight's scale of NaN: every answer NaN, whether kept in fp8 or dequantized
    weights["model.layers.1.self_attn.v_proj.input_scale"] = saved
    key = next(k for k in weights if k.startswith("model.layers.0.mlp.down_proj.weight_scale"))
    weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, str(fp8 / "model.safetensors"))
    for kept in ("fp8", "dequantized"):
        with pytest.raises(ValueError, match=r"down_proj\.weight_scale(_inv)? holds inf or NaN"):
            load_model(str(fp8), fp8_weights=kept)


def test_the_activation_scheme_is_read_from_either_config():
    from worker.model import ModelConfig

    head = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 300}  # fmt: skip
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}

    def scheme(quant):
        return ModelConfig.from_hf({**head, "quantization_config": quant}).fp8_activation_scheme

    def compressed(*inputs):
        groups = {f"g{i}": {"weights": weights, "input_activations": a} for i, a in enumerate(inputs)}
        return {"quant_method": "compressed-tensors", "config_groups": groups}

    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    per_token = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    assert scheme({"quant_method": "fp8", "activation_scheme": "static"}) == "static"
    assert scheme({"quant_method": "fp8", "activation_scheme": "dynamic"}) == "dynamic"
    assert scheme({"quant_method": "fp8"}) is None
    assert scheme(compressed(static)) == "static" and scheme(compressed(static, static)) == "static"
    assert scheme(compressed(per_token)) == "dynamic"
    assert scheme(compressed(None)) is None and scheme(compressed(static, per_token)) is None
    assert scheme(compressed({**static, "strategy": "channel"})) is None  # NOTE: one a channel: not served


def test_cache_info_and_the_log_say_the_inputs_take_the_checkpoints_scales(tmp_path, caplog):
    from worker.config import WorkerConfig

    fp8, _ = fp8_pair(save_checkpoint(tmp_path / "base", "llama"), tmp_path, "compressed-tensors", "tensor")
    with_input_scales(fp8, "compressed-tensors")
    cfg = WorkerConfig(model=str(fp8), device="cpu", kv_cache_tokens=1024, warmup_tokens=0, fp8_weights="fp8",
                       fp8_activations="static")  # fmt: skip
    log, info, _ = served(cfg, caplog)
    assert "their inputs quantized to fp8 by the checkpoint's input scales (--fp8-activations static)" in log
    assert info["fp8_projections"] == {"source": "checkpoint", "scales": "row", "activations": "fp8 static"}


def test_two_ranks_with_static_input_scales_answer_as_one(tmp_path):
    """Each rank reads every input scale whole (one value a projection) and takes the same largest."""
    fp8, _ = fp8_pair(save_checkpoint(tmp_path / "base", "llama"), tmp_path, "compressed-tensors", "tensor")
    with_input_scales(fp8, "compressed-tensors")
    assert_two_ranks_answer_as_one(
        str(fp8),
        tmp_path,
        ["--kv-cache-tokens", "2048", "--fp8-weights", "fp8", "--fp8-activations", "static"],
    )
