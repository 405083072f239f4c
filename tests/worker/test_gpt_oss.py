"""gpt-oss checkpoints: the config as released, MXFP4 experts dequantized at load (against transformers'
own dequantization), and what the loader refuses. The forward against transformers is in test_model.py
(CHECKPOINTS), two ranks as one in test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kernels import reference
from tests.worker.conftest import GPT_OSS, save_checkpoint
from tests.worker.test_model import match_transformers
from worker.model import ModelConfig, load_model

# openai/gpt-oss-20b's config.json, as released (the fields the worker reads)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088, "eos_token_id": 200002,
    "pad_token_id": 199999, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}  # fmt: skip


def test_config_reads_gpt_oss_20b_as_released():
    c = ModelConfig.from_hf(GPT_OSS_20B)
    assert (c.num_experts, c.experts_per_token, c.moe_intermediate_size) == (32, 4, 2880)
    assert c.norm_topk_prob and c.moe_bias and c.attention_sinks and c.qkv_bias and c.o_bias
    assert (c.expert_activation, c.swiglu_alpha, c.swiglu_limit) == ("clamped_swiglu", 1.702, 7.0)
    assert c.sliding_window == 128 and c.sliding_layers == tuple(range(0, 24, 2))
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False
    assert c.max_context == 131072 and c.eos_token_ids == [200002] and c.head_dim == 64


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_other_quantized_checkpoints_are_refused_with_the_method_named(method):
    quantized = {**GPT_OSS_20B, "model_type": "llama", "quantization_config": {"quant_method": method}}
    with pytest.raises(ValueError, match=f"quantized checkpoints \\({method}\\) are not supported"):
        ModelConfig.from_hf(quantized)


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=g)
    ours = reference.dequantize_mxfp4(blocks.flatten(-2), scales, torch.float32)
    assert ours.shape == (3, 10, 128)
    # NOTE: transformers returns the [E, in, out] layout its experts multiply by
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))
    # one byte: low nibble first; 0x2F is codes 15 (-6.0) then 2 (1.0); scale 128 doubles them
    one = reference.dequantize_mxfp4(torch.full((16,), 0x2F, dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8),
                                     torch.float32)  # fmt: skip
    assert one[:2].tolist() == [-12.0, 2.0]
    with pytest.raises(ValueError, match="MXFP4 codes"):
        reference.dequantize_mxfp4(blocks[..., :8].flatten(-2), scales, torch.float32)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] (K a multiple of 32) -> MXFP4 blocks [..., K/32, 16] and scales [..., K/32]: each
    block's scale the power of two that fits its largest value under 6, each value the nearest code."""
    table = torch.tensor(reference.E2M1_VALUES)
    w = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(w.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    codes = ((w / torch.exp2(exponent)[..., None])[..., None] - table).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def quantize_checkpoint(directory):
    """``directory``'s gpt-oss checkpoint with its experts in MXFP4 (as released), in place; returns it."""
    weights = load_file(str(directory / "model.safetensors"))
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize(weights.pop(name).transpose(1, 2))  # NOTE: stored [E, out, in/32, 16]
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_20B["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """A gpt-oss checkpoint with MXFP4 experts (sizes multiples of 32), and the same model with the
    dequantized experts in transformers' layout, unquantized, as the reference."""
    base = save_checkpoint(
        tmp_path_factory.mktemp("gpt_oss_bf"), "gpt_oss", **{**GPT_OSS, "intermediate_size": 64}
    )
    packed = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    plain = tmp_path_factory.mktemp("gpt_oss_dequantized")
    for directory in (packed, plain):
        shutil.copytree(base, directory, dirs_exist_ok=True)
    weights = load_file(str(base / "model.safetensors"))
    quantized = load_file(str(quantize_checkpoint(packed) / "model.safetensors"))
    dequantized = dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        codes, scales = quantized[f"{name}_blocks"].flatten(-2), quantized[f"{name}_scales"]
        dequantized[name] = (
            reference.dequantize_mxfp4(codes, scales, torch.float32).transpose(1, 2).contiguous()
        )
    save_file(dequantized, str(plain / "model.safetensors"))
    return packed, plain, weights, dequantized


def test_an_mxfp4_checkpoint_serves_its_dequantized_experts(mxfp4_pair):
    packed, plain, weights, dequantized = mxfp4_pair
    name = "model.layers.1.mlp.experts.down_proj"
    assert not torch.equal(weights[name], dequantized[name])  # the quantization does change the weights
    assert (weights[name] - dequantized[name]).abs().max() < 0.25 * weights[name].abs().max()
    loaded = load_model(str(packed))
    torch.testing.assert_close(loaded.model.layers[1].experts_down[3], dequantized[name][3].T)
    gate_up = dequantized["model.layers.0.mlp.experts.gate_up_proj"][2].T  # [2I, H], gate and up interleaved
    torch.testing.assert_close(
        loaded.model.layers[0].experts_gate_up[2], torch.cat([gate_up[0::2], gate_up[1::2]])
    )
    # NOTE: the reference directory holds the same experts unquantized: transformers runs it as it is
    match_transformers_with(packed, plain)


def match_transformers_with(ours, theirs):
    """test_model.match_transformers, our model loaded from ``ours``, transformers' from ``theirs``."""
    import tests.worker.test_model as test_model

    original = test_model.hf_model
    test_model.hf_model = lambda _: original(theirs)
    try:
        match_transformers(ours, "cpu", test_model.ATOL)
    finally:
        test_model.hf_model = original


def test_an_mxfp4_half_without_the_other_is_named(mxfp4_pair, tmp_path):
    packed = mxfp4_pair[0]
    weights = load_file(str(packed / "model.safetensors"))
    del weights["model.layers.0.mlp.experts.down_proj_scales"]
    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=re.escape("down_proj_blocks without its model.layers.0.mlp.experts.down_proj_scales"),
    ):
        load_model(str(broken))


def test_transformers_is_the_gpt_oss_it_claims(gpt_oss_checkpoint):
    """The checkpoint test_model.py compares against is what it says: sinks, biases and the window bite."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_checkpoint, dtype=torch.float32)
    layer = hf.model.layers[0]
    assert layer.self_attn.sliding_window == 12 and hf.model.layers[1].self_attn.sliding_window is None
    assert layer.self_attn.sinks.abs().min() > 0 and layer.mlp.experts.down_proj_bias.abs().min() > 0
    assert hf.config.swiglu_limit == 1.5


def test_packed_mxfp4_experts_give_the_dequantized_models_logits(mxfp4_pair):
    """--mxfp4-experts packed: the codes and scales kept as uint8 (a quarter of bf16's bytes, with the
    scales) and decoded in the experts' GEMMs, to the logits of the experts dequantized at load."""
    from tests.worker.test_model import PROMPT, extend, new_pool, scattered_slots

    packed = mxfp4_pair[0]
    kept, unpacked = load_model(str(packed), mxfp4_experts="packed"), load_model(str(packed))
    layer = kept.model.layers[0]
    assert kept.config.mxfp4_experts and not unpacked.config.mxfp4_experts  # auto on the CPU: dequantized
    assert layer.experts_gate_up.dtype == torch.uint8 and layer.experts_gate_up.shape == (4, 128, 32)
    assert (
        layer.experts_down_scales.shape == (4, 64, 2) and unpacked.model.layers[0].experts_down_scales is None
    )
    torch.testing.assert_close(
        reference.dequantize_mxfp4(layer.experts_down, layer.experts_down_scales, torch.float32),
        unpacked.model.layers[0].experts_down,
        rtol=0,
        atol=0,
    )
    ids = kept.tokenizer.encode_prompt(PROMPT)
    logits = []
    for loaded in (kept, unpacked):
        pool = new_pool(loaded.config)
        logits.append(extend(loaded.model, pool, [ids], [0], scattered_slots(pool, [len(ids)])))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mxfp4_experts must be one of"):
        load_model(str(packed), mxfp4_experts="fp4")


def test_mxfp4_experts_split_over_ranks_in_whole_blocks_as_equal_as_blocks_allow(mxfp4_pair):
    """Each rank takes whole 32-unit blocks of every expert (gpt-oss's 2,880 units: 90 blocks, 23, 23, 22
    and 22 of them over 4 ranks; 12 and 11 over 8), its codes and scales the same units' (dequantized,
    each part is the whole's rows or columns); ranks that would get no block are refused."""
    from worker.model.shard import Shard

    config = load_model(str(mxfp4_pair[0]), mxfp4_experts="packed").config
    Shard(0, 2).check(config)  # 64 units: a block a rank
    with pytest.raises(ValueError, match=r"need a 32-unit block each.*--mxfp4-experts dequantized"):
        Shard(0, 4).check(dataclasses.replace(config, num_kv_heads=4))  # 2 blocks for 4 ranks
    Shard(0, 4).check(dataclasses.replace(config, num_kv_heads=4, mxfp4_experts=False))  # 16 units each
    oss = dataclasses.replace(config, num_heads=64, num_kv_heads=8, moe_intermediate_size=2880)
    assert [Shard(r, 4).span(oss, "moe_intermediate") for r in range(4)] == [
        (0, 736), (736, 1472), (1472, 2176), (2176, 2880)
    ]  # fmt: skip
    assert [Shard(r, 8).local(oss, "moe_intermediate") // 32 for r in range(8)] == [12, 12] + [11] * 6
    assert Shard(1, 4).span(dataclasses.replace(oss, mxfp4_experts=False), "moe_intermediate") == (720, 1440)
    small = dataclasses.replace(config, moe_intermediate_size=96, hidden_size=64)  # 3 blocks over 2 ranks
    g = torch.Generator().manual_seed(5)
    up = torch.randint(0, 256, (96, 32), dtype=torch.uint8, generator=g)  # [units, hidden / 2]
    up_scales = torch.randint(120, 130, (96, 2), dtype=torch.uint8, generator=g)  # [units, hidden / 32]
    down = torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=g)  # [hidden, units / 2]
    down_scales = torch.randint(120, 130, (64, 3), dtype=torch.uint8, generator=g)  # [hidden, units / 32]
    name = "model.layers.0.mlp.experts.3.{}_proj.{}"
    whole_up = reference.dequantize_mxfp4(up, up_scales, torch.float32)
    whole_down = reference.dequantize_mxfp4(down, down_scales, torch.float32)
    for rank, (lo, hi) in enumerate([(0, 64), (64, 96)]):
        shard = Shard(rank, 2)
        assert shard.span(small, "moe_intermediate") == (lo, hi)
        part_up = [
            shard.weight(small, name.format("up", k), t) for k, t in (("weight", up), ("scales", up_scales))
        ]
        part_down = [shard.weight(small, name.format("down", k), t)
                     for k, t in (("weight", down), ("scales", down_scales))]  # fmt: skip
        assert torch.equal(reference.dequantize_mxfp4(*part_up, torch.float32), whole_up[lo:hi])
        assert torch.equal(reference.dequantize_mxfp4(*part_down, torch.float32), whole_down[:, lo:hi])
