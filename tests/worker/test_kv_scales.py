"""An fp8 checkpoint's KV scales (compressed-tensors' kv_cache_scheme: self_attn.k_scale / v_scale, or the
older k_proj / v_proj.output_scale), one a tensor or one a KV head (strategy attn_head), over an fp8 pool
(--kv-cache-dtype fp8_e4m3): the pool holds K / k_scale and V / v_scale, each KV head's over its own, and
attention reads code x scale back. The model is the unscaled model whose pool holds exactly those values;
a 16-bit pool never reads the scales; a missing scale, or one of another count, is named; /v1/cache/info
and the start-up log say so; two ranks (one KV head each) answer as one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import reference
from tests.support import SLOW
from tests.worker.conftest import save_checkpoint
from tests.worker.test_fp8_activations import served
from tests.worker.test_fp8_weights import fp8_pair
from tests.worker.test_model import PROMPT, decode, extend, scattered_slots
from tests.worker.test_tensor_parallel import assert_two_ranks_answer_as_one
from worker.kv_pool import KVPool
from worker.model import ModelConfig, load_model
from worker.model.llama import DecoderLayer

E4M3 = torch.float8_e4m3fn


def kv_checkpoint(
    tmp_path, older_names: bool = False, per_head: bool = False, method: str = "compressed-tensors"
):
    """A two-layer Llama (2 KV heads) in per-tensor fp8 (``method``: compressed-tensors, or HF's ``fp8`` as the
    FP8-KV releases are, its config saying "kv_cache_scheme": "static") with KV scales, each layer's its own
    and no power of two (a power of two would round as the unscaled values do); ``older_names``: as k_proj /
    v_proj.output_scale; ``per_head``: one a KV head, the second head's 1.5 times the first's, stored
    [heads, 1, 1] under kv_cache_scheme strategy attn_head. Returns its path and each layer's scales,
    float32 [2, KV heads] (K's, V's)."""
    fp8, _ = fp8_pair(save_checkpoint(tmp_path / "base", "llama"), tmp_path, method, "tensor")
    weights = load_file(str(fp8 / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    heads = config["num_key_value_heads"]
    scales = []
    for i in range(config["num_hidden_layers"]):
        table = torch.tensor([[0.03 + 0.01 * i], [0.0125 + 0.005 * i]]).expand(2, heads)
        if per_head:
            table = table * torch.tensor([1.0, 1.5])
        scales.append(table)
        for kind, row in zip("kv", table, strict=True):
            weights.pop(f"model.layers.{i}.self_attn.{kind}_scale", None)
            name = f"self_attn.{kind}_proj.output_scale" if older_names else f"self_attn.{kind}_scale"
            weights[f"model.layers.{i}.{name}"] = (
                row.reshape(heads, 1, 1).clone() if per_head else row[:1].clone()
            )
    save_file(weights, str(fp8 / "model.safetensors"))
    if per_head:
        config["quantization_config"]["kv_cache_scheme"]["strategy"] = "attn_head"
    if method == "fp8":
        config["quantization_config"]["kv_cache_scheme"] = "static"
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, scales


def steps(loaded, pool_dtype: torch.dtype, count: int = 4) -> list[torch.Tensor]:
    """The prompt's prefill and ``count`` greedy decode steps over a fresh pool of ``pool_dtype``: each
    step's logits."""
    c = loaded.config
    ids = loaded.tokenizer.encode_prompt(PROMPT)
    pool = KVPool(64, 16, c.num_layers, c.num_kv_heads, c.head_dim, pool_dtype, "cpu")
    [slots] = scattered_slots(pool, [len(ids) + count])
    logits = [extend(loaded.model, pool, [ids], [0], [slots])]
    for step in range(count):
        token = int(logits[-1][-1].argmax())
        logits.append(decode(loaded.model, pool, [token], [len(ids) + step], [slots]))
    return logits


def test_the_config_says_whether_the_checkpoint_carries_kv_scales():
    head = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 300}  # fmt: skip
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}

    def carries(kv_scheme):
        quant = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": weights}}}
        if kv_scheme is not None:
            quant["kv_cache_scheme"] = kv_scheme
        return ModelConfig.from_hf({**head, "quantization_config": quant}).checkpoint_kv_scales

    assert carries({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
    assert carries({"num_bits": 8, "type": "float", "strategy": "attn_head", "symmetric": True})
    assert not carries(None)
    assert not carries({"num_bits": 8, "type": "float", "strategy": "channel"})  # NOTE: not read
    assert not carries({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False})
    fp8 = {"quant_method": "fp8", "activation_scheme": "static"}
    assert ModelConfig.from_hf(
        {**head, "quantization_config": {**fp8, "kv_cache_scheme": "static"}}
    ).checkpoint_kv_scales
    assert not ModelConfig.from_hf({**head, "quantization_config": fp8}).checkpoint_kv_scales
    assert not carries({"num_bits": 8, "type": "int", "strategy": "tensor"})


@pytest.mark.parametrize(
    ("older_names", "per_head", "method"),
    [(False, False, "compressed-tensors"), (True, False, "compressed-tensors"), (False, True, "compressed-tensors"),
     (True, False, "fp8")],
    ids=["k_scale", "output_scale", "per_head", "fp8-kv"],
)  # fmt: skip
def test_an_fp8_pool_holds_k_and_v_over_the_checkpoints_scales(
    tmp_path, monkeypatch, older_names, per_head, method
):
    """The served model (stores and attention over codes x their head's scale) against the unscaled model
    over a float32 pool whose stores keep exactly to_pool(x / scale) x scale, head by head: equal logits at
    every step; and the scales matter (the unscaled fp8 pool's logits differ from the first step that reads
    the pool)."""
    fp8, scales = kv_checkpoint(tmp_path, older_names, per_head, method)
    loaded = load_model(str(fp8), fp8_weights="fp8", kv_cache_dtype="fp8_e4m3")
    assert loaded.config.kv_scales
    for layer, want in zip(loaded.model.layers, scales, strict=True):
        torch.testing.assert_close(layer.kv_pool_scale.detach(), want, rtol=0, atol=0)
    got = steps(loaded, E4M3)
    plain = load_model(str(fp8), fp8_weights="fp8")  # NOTE: a 16-bit pool: the scales never read
    assert not plain.config.kv_scales and all(layer.kv_pool_scale is None for layer in plain.model.layers)
    unscaled = steps(plain, E4M3)

    forward, layer_of = DecoderLayer.forward, [0]

    def forward_of_the_layer(self, *args, **kwargs):
        layer_of[0] = self.index
        return forward(self, *args, **kwargs)

    rope_store_kv = reference.rope_store_kv

    def stores_the_scaled_values(q, k, v, positions, cos_sin, k_cache, v_cache, slots, kv_scales=None):
        assert kv_scales is None  # NOTE: the unscaled model
        s_k, s_v = scales[layer_of[0]][:, :, None]  # NOTE: [heads, 1] each
        q, k = rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        k_cache[slots.long()] = reference.to_pool(k.float() / s_k, E4M3).float() * s_k
        v_cache[slots.long()] = reference.to_pool(v.float() / s_v, E4M3).float() * s_v
        return q, k

    monkeypatch.setattr(DecoderLayer, "forward", forward_of_the_layer)
    monkeypatch.setattr(reference, "rope_store_kv", stores_the_scaled_values)
    want = steps(plain, torch.float32)
    for step, (g, w, u) in enumerate(zip(got, want, unscaled, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        moved = ((g - u).norm() / u.norm()).item()
        assert moved < 1e-5 if step == 0 else moved > 1e-3, (
            f"step {step}: {moved:.2e} from the unscaled pool's"
        )


def test_a_missing_miscounted_or_non_positive_kv_scale_is_named(tmp_path):
    fp8, _ = kv_checkpoint(tmp_path)
    weights = load_file(str(fp8 / "model.safetensors"))
    saved = weights.pop("model.layers.1.self_attn.v_scale")
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.v_scale"):
        load_model(str(fp8), fp8_weights="fp8", kv_cache_dtype="fp8_e4m3")
    weights["model.layers.1.self_attn.v_scale"] = saved.expand(3).contiguous()  # NOTE: 2 KV heads
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"v_scale has 3 values: KV scales are one a tensor or one a KV head \(2\)"
    ):
        load_model(str(fp8), fp8_weights="fp8", kv_cache_dtype="fp8_e4m3")
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([0.5, 0.0])
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"layer 1's KV scales \(k_scale, v_scale\) must be positive and finite"
    ):
        load_model(str(fp8), fp8_weights="fp8", kv_cache_dtype="fp8_e4m3")


def test_cache_info_and_the_log_say_the_pool_holds_scaled_values(tmp_path, caplog):
    from worker.config import WorkerConfig

    fp8, _ = kv_checkpoint(tmp_path)
    cfg = WorkerConfig(model=str(fp8), device="cpu", kv_cache_tokens=1024, warmup_tokens=0, fp8_weights="fp8",
                       kv_cache_dtype="fp8_e4m3")  # fmt: skip
    log, info, _ = served(cfg, caplog)
    assert "KV pool holds K and V over the checkpoint's KV scales" in log
    assert info["kv_scales"] == "checkpoint" and info["kv_dtype"] == "float8_e4m3fn"


@pytest.mark.parametrize("per_head", [pytest.param(False, marks=SLOW), True], ids=["tensor", "per_head"])
def test_two_ranks_over_scaled_fp8_pools_answer_as_one(tmp_path, per_head):
    """Each rank holds its own KV head's scales (a scale a tensor: the same on both; one a head: its own)
    and stores and reads that head over them."""
    fp8, _ = kv_checkpoint(tmp_path, per_head=per_head)
    assert_two_ranks_answer_as_one(
        str(fp8),
        tmp_path,
        ["--kv-cache-tokens", "2048", "--fp8-weights", "fp8", "--kv-cache-dtype", "fp8_e4m3"],
    )
