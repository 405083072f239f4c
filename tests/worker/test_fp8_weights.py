"""fp8 checkpoints (HF's fine-grained ``fp8``: a scale a 128x128 block or a tensor; compressed-tensors'
8-bit float weights: a scale a tensor, a row or a block), dequantized at load: the same model as a
checkpoint holding the dequantized weights, dense and mixture of experts; the block layout as transformers
reads it; the scales of activations and of the KV cache left unused; other quantizations refused."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import reference
from tests.worker.conftest import QWEN3_MOE, save_checkpoint
from tests.worker.test_model import PROMPT, extend, new_pool, scattered_slots
from worker.model import ModelConfig, load_model

FP8_MAX = 448.0
# the linear layers an fp8 quantizer quantizes (Phi-3's fused q/k/v and gate/up, Mixtral's experts among them;
# Gemma 3 4B+'s under language_model.)
LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(qkv|[qkvo])_proj|mlp\.(experts\.\d+\.)?(gate_up|gate|up|down)_proj|"
    r"block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)


def quantize(
    w: torch.Tensor, strategy: str, block: tuple[int, int] = (16, 32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> fp8 e4m3 codes and their float32 scales, each scale the largest magnitude of its tensor,
    row or block over 448 (as the quantizers choose them); a block's scales [ceil(N / rows), ceil(K / cols)]."""
    w = w.float()
    if strategy == "tensor":
        scale = w.abs().amax() / FP8_MAX
        expanded = scale
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        expanded = scale
    else:
        rows, cols = block
        n, k = w.shape
        scale = torch.empty(-(-n // rows), -(-k // cols))
        expanded = torch.empty_like(w)
        for i in range(scale.shape[0]):  # NOTE: block by block, not the loader's repeat_interleave
            for j in range(scale.shape[1]):
                part = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
                scale[i, j] = w[part].abs().amax() / FP8_MAX
                expanded[part] = scale[i, j]
    return (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_pair(base, tmp_path, method: str, strategy: str, block=(16, 32)):
    """``base``'s checkpoint with its linear layers in fp8 (``method``: "fp8" or "compressed-tensors"), and
    the same model with those weights dequantized (codes times scales, in float32), unquantized."""
    fp8, plain = tmp_path / f"{method}-{strategy}", tmp_path / f"{method}-{strategy}-dequantized"
    for directory in (fp8, plain):
        shutil.copytree(base, directory)
    weights = load_file(str(base / "model.safetensors"))
    quantized, dequantized = {}, {}
    suffix = "weight_scale_inv" if method == "fp8" else "weight_scale"
    for name, w in weights.items():
        if not LINEAR.search(name):
            quantized[name] = dequantized[name] = w
            continue
        codes, scale = quantize(w, strategy, block)
        quantized[name], quantized[name.replace("weight", suffix)] = codes, scale
        if strategy == "block":
            rows, cols = block
            expanded = torch.kron(scale, torch.ones(rows, cols))[: w.shape[0], : w.shape[1]]
        else:
            expanded = scale
        dequantized[name] = codes.float() * expanded
        # NOTE: a static input scale and the KV cache's scales, unread here (--fp8-activations static and an
        # fp8 pool read them: test_fp8_activations.py, test_kv_scales.py)
        if method == "compressed-tensors":
            quantized[name.replace("weight", "input_scale")] = torch.tensor(0.5)
            owner = name.rsplit(".", 3)[0]
            if name.endswith("self_attn.k_proj.weight"):
                quantized[f"{owner}.self_attn.k_scale"] = torch.tensor(0.25)
            if name.endswith("self_attn.v_proj.weight"):
                quantized[f"{owner}.self_attn.v_scale"] = torch.tensor(0.125)
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    if method == "fp8":
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(block) if strategy == "block" else None}  # fmt: skip
    else:
        weights_scheme = {
            "num_bits": 8,
            "type": "float",
            "strategy": strategy,
            "symmetric": True,
            "dynamic": False,
        }
        if strategy == "block":
            weights_scheme["block_structure"] = list(block)
        quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_scheme,
                                               "input_activations": {"num_bits": 8, "type": "float",
                                                                     "strategy": "tensor", "dynamic": False}}},
                 "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return fp8, plain


def logits_of(path, dtype=torch.float32, **options) -> torch.Tensor:
    """The prompt's logits from the checkpoint at ``path`` (``options``: load_model's)."""
    loaded = load_model(str(path), "cpu", dtype, **options)
    ids = loaded.tokenizer.encode_prompt(PROMPT)
    pool = new_pool(loaded.config)
    return extend(loaded.model, pool, [ids], [0], scattered_slots(pool, [len(ids)]))


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    return save_checkpoint(
        tmp_path_factory.mktemp("fp8_llama"), "llama", intermediate_size=136
    )  # partial blocks


@pytest.mark.parametrize(
    ("method", "strategy"),
    [("fp8", "block"), ("fp8", "tensor"), ("compressed-tensors", "channel"), ("compressed-tensors", "tensor"),
     ("compressed-tensors", "block")],
)  # fmt: skip
def test_an_fp8_checkpoint_is_the_model_of_its_dequantized_weights(llama_base, tmp_path, method, strategy):
    fp8, plain = fp8_pair(llama_base, tmp_path, method, strategy)
    config = load_model(str(fp8)).config
    assert config.fp8_weights and config.fp8_weight_block == ((16, 32) if strategy == "block" else None)
    ours, want = load_model(str(fp8)).model, load_model(str(plain)).model
    for (name, got), (_, expected) in zip(ours.named_parameters(), want.named_parameters(), strict=True):
        assert torch.equal(got, expected), name
    name = "model.layers.0.mlp.up_proj.weight"
    original, dequantized = (load_file(str(d / "model.safetensors"))[name] for d in (llama_base, plain))
    assert not torch.equal(dequantized, original)  # the quantization does change the weights
    torch.testing.assert_close(logits_of(fp8), logits_of(plain), rtol=0, atol=0)
    # served in bf16: the dequantized weights rounded once, as the plain checkpoint's are
    torch.testing.assert_close(
        logits_of(fp8, torch.bfloat16), logits_of(plain, torch.bfloat16), rtol=0, atol=0
    )


def test_a_mixture_of_experts_fp8_checkpoint_dequantizes_every_expert(tmp_path):
    base = save_checkpoint(tmp_path / "moe", "qwen3_moe", **QWEN3_MOE)
    fp8, plain = fp8_pair(base, tmp_path, "fp8", "block")
    assert any(
        ".experts.7.down_proj.weight_scale_inv" in n for n in load_file(str(fp8 / "model.safetensors"))
    )
    torch.testing.assert_close(logits_of(fp8), logits_of(plain), rtol=0, atol=0)


def test_a_gemma3_image_and_text_checkpoint_is_quantized_as_its_top_level_config_says(
    gemma3_multimodal_checkpoint, tmp_path
):
    """llm-compressor writes a Gemma 3 4B+ checkpoint's quantization_config beside text_config, not in it: its
    language model's fp8 weights load as the dequantized ones (their scales were unexpected weights), and
    another quantization there is refused by name."""
    fp8, plain = fp8_pair(gemma3_multimodal_checkpoint, tmp_path, "compressed-tensors", "channel")
    config = json.loads((fp8 / "config.json").read_text())
    assert "quantization_config" in config and "quantization_config" not in config["text_config"]
    assert load_model(str(fp8)).config.fp8_weights
    torch.testing.assert_close(logits_of(fp8), logits_of(plain), rtol=0, atol=0)
    with pytest.raises(ValueError, match=re.escape("quantized checkpoints (awq) are not supported")):
        ModelConfig.from_hf({**config, "quantization_config": {"quant_method": "awq"}})


def test_block_scales_are_laid_out_as_transformers_reads_them():
    """Partial blocks at the end of rows and columns included (40 x 72 in 16 x 32 blocks)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(3)
    codes = (torch.randn(40, 72, generator=g) * 50).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 3, generator=g) + 0.1
    ours = reference.dequantize_fp8_weight(codes, scales, (16, 32), torch.float32)
    torch.testing.assert_close(
        ours, _dequantize_fp8_weight(codes, scales, [16, 32], torch.float32), rtol=0, atol=0
    )
    rows = torch.rand(40, 1, generator=g)
    assert torch.equal(
        reference.dequantize_fp8_weight(codes, rows, None, torch.float32), codes.float() * rows
    )
    assert torch.equal(
        reference.dequantize_fp8_weight(codes, rows[:, 0], None, torch.float32), codes.float() * rows
    )
    with pytest.raises(ValueError, match=r"in 16x32 blocks has scales \[2, 3\]"):
        reference.dequantize_fp8_weight(codes, scales[:2], (16, 32), torch.float32)
    with pytest.raises(ValueError, match="not one a row"):
        reference.dequantize_fp8_weight(codes, rows[:39], None, torch.float32)


def test_an_fp8_weight_without_its_scale_is_named(llama_base, tmp_path):
    fp8, _ = fp8_pair(llama_base, tmp_path, "fp8", "block")
    weights = load_file(str(fp8 / "model.safetensors"))
    del weights["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(weights, str(fp8 / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"fp8 weight of model\.layers\.1\.self_attn\.o_proj without its scale"
    ):
        load_model(str(fp8))


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}},
            },
            "compressed-tensors: int 4-bit by group",
        ),
        (
            {"quant_method": "fp8", "fmt": "e5m2"},
            "fp8 checkpoints of format 'e5m2' are not supported (e4m3 weights are)",
        ),
        ({"quant_method": "awq"}, "quantized checkpoints (awq) are not supported"),
    ],
    ids=["w4a16", "fp8-e5m2", "awq"],
)
def test_other_quantizations_are_refused_naming_what_they_are(quant, named):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 300, "quantization_config": quant}  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig.from_hf(config)
