"""An fp8 checkpoint's KV scales (compressed-tensors' kv_cache_scheme: self_attn.k_scale / v_scale, or the
older k_proj / v_proj.output_scale) over an fp8 pool (--kv-cache-dtype fp8_e4m3): the pool holds K / k_scale
and V / v_scale, and attention reads code x scale back. The model is the unscaled model whose pool holds
exactly those values; a 16-bit pool never reads the scales; a missing or per-channel scale is named;
/v1/cache/info and the start-up log say so; two ranks answer as one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import reference
from tests.worker.conftest import save_checkpoint
from tests.worker.test_fp8_activations import served
from tests.worker.test_fp8_weights import fp8_pair
from tests.worker.test_model import PROMPT, decode, extend, scattered_slots
from tests.worker.test_tensor_parallel import assert_two_ranks_answer_as_one
from worker.kv_pool import KVPool
from worker.model import ModelConfig, load_model
from worker.model.llama import DecoderLayer

E4M3 = torch.float8_e4m3fn


def kv_checkpoint(tmp_path, older_names: bool = False):
    """A two-layer Llama in compressed-tensors' per-tensor fp8 with KV scales, each layer's its own and no
    power of two (a power of two would round as the unscaled values do); ``older_names``: as k_proj /
    v_proj.output_scale. Returns its path and each layer's (k_scale, v_scale)."""
    fp8, _ = fp8_pair(save_checkpoint(tmp_path / "base", "llama"), tmp_path, "compressed-tensors", "tensor")
    weights = load_file(str(fp8 / "model.safetensors"))
    scales = []
    layers = json.loads((fp8 / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        scales.append((0.03 + 0.01 * i, 0.0125 + 0.005 * i))
        for kind, value in zip("kv", scales[-1], strict=True):
            del weights[f"model.layers.{i}.self_attn.{kind}_scale"]
            name = f"self_attn.{kind}_proj.output_scale" if older_names else f"self_attn.{kind}_scale"
            weights[f"model.layers.{i}.{name}"] = torch.tensor([value])
    save_file(weights, str(fp8 / "model.safetensors"))
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
    assert not carries(None)
    assert not carries({"num_bits": 8, "type": "float", "strategy": "channel"})  # NOTE: not read
    assert not carries({"num_bits": 8, "type": "int", "strategy": "tensor"})


@pytest.mark.parametrize("older_names", [False, True], ids=["k_scale", "output_scale"])
def test_an_fp8_pool_holds_k_and_v_over_the_checkpoints_scales(tmp_path, monkeypatch, older_names):
    """The served model (stores and attention over codes x scale) against the unscaled model over a
    float32 pool whose stores keep exactly to_pool(x / scale) x scale: equal logits at every step; and
    the scales matter (the unscaled fp8 pool's logits differ from the first step that reads the pool)."""
    fp8, scales = kv_checkpoint(tmp_path, older_names)
    loaded = load_model(str(fp8), fp8_weights="fp8", kv_cache_dtype="fp8_e4m3")
    assert loaded.config.kv_scales
    values = torch.tensor([layer.kv_scale_values for layer in loaded.model.layers])
    torch.testing.assert_close(values, torch.tensor(scales))  # NOTE: as float32 holds them
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
        s_k, s_v = scales[layer_of[0]]
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


def test_a_missing_or_per_channel_kv_scale_is_named(tmp_path):
    fp8, _ = kv_checkpoint(tmp_path)
    weights = load_file(str(fp8 / "model.safetensors"))
    saved = weights.pop("model.layers.1.self_attn.v_scale")
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.v_scale"):
        load_model(str(fp8), fp8_weights="fp8", kv_cache_dtype="fp8_e4m3")
    weights["model.layers.1.self_attn.v_scale"] = saved.expand(2).contiguous()
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"v_scale has 2 values: KV scales are one a tensor"):
        load_model(str(fp8), fp8_weights="fp8", kv_cache_dtype="fp8_e4m3")


def test_cache_info_and_the_log_say_the_pool_holds_scaled_values(tmp_path, caplog):
    from worker.config import WorkerConfig

    fp8, _ = kv_checkpoint(tmp_path)
    cfg = WorkerConfig(model=str(fp8), device="cpu", kv_cache_tokens=1024, warmup_tokens=0, fp8_weights="fp8",
                       kv_cache_dtype="fp8_e4m3")  # fmt: skip
    log, info, _ = served(cfg, caplog)
    assert "KV pool holds K and V over the checkpoint's KV scales" in log
    assert info["kv_scales"] == "checkpoint" and info["kv_dtype"] == "float8_e4m3fn"


def test_two_ranks_over_scaled_fp8_pools_answer_as_one(tmp_path):
    """Each rank reads every layer's two scales whole and stores its own KV heads over them."""
    fp8, _ = kv_checkpoint(tmp_path)
    assert_two_ranks_answer_as_one(
        str(fp8),
        tmp_path,
        ["--kv-cache-tokens", "2048", "--fp8-weights", "fp8", "--kv-cache-dtype", "fp8_e4m3"],
    )
