"""Loads a model for the worker: ``tiny`` (built in) or a local HF directory (config.json + safetensors).

Reads only local files (never downloads); the tokenizer comes from the same directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kernels.host_checks import e4m3_supported
from router.tokenization import ByteTokenizer, HFTokenizer, PromptTokenizer
from worker.config import FP8_ACTIVATION_CHOICES, FP8_WEIGHT_CHOICES, MXFP4_CHOICES, QUANTIZATION_CHOICES
from worker.model.checkpoint import FP8_PROJECTION
from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.shard import WHOLE, Shard
from worker.model.tiny import build_tiny, tiny_config


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: PromptTokenizer
    name: str  # served model name (also the block-hash namespace)


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU (the reference kernels compute in it anyway), bfloat16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of a --dtype value: "auto" is ``default_dtype(device)``."""
    return default_dtype(device) if name == "auto" else getattr(torch, name)


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's shard files: from model.safetensors.index.json, else every *.safetensors."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {directory}")
    return [os.path.join(directory, n) for n in files]


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, one at a time (peak memory: one tensor, not the model)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def read_config(spec: str) -> ModelConfig:
    """The ModelConfig of ``"tiny"`` or a local HF model directory, without loading weights."""
    if spec == "tiny":
        return tiny_config()
    if not os.path.isdir(spec):
        raise ValueError(f"model {spec!r} is neither 'tiny' nor a local directory")
    path = os.path.join(spec, "config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as exc:  # NOTE: a start-up error naming the key, not a traceback
        raise ValueError(f"{path} lacks {exc.args[0]!r}, which this model type needs") from None


def served_experts(config: ModelConfig, mxfp4_experts: str, device: torch.device) -> ModelConfig:
    """``config`` as ``--mxfp4-experts`` serves it on ``device``: its MXFP4 experts kept packed
    (``packed``; ``auto`` on CUDA) or not (``dequantized``; ``auto`` elsewhere)."""
    if mxfp4_experts not in MXFP4_CHOICES:
        raise ValueError(f"mxfp4_experts must be one of {', '.join(MXFP4_CHOICES)}, got {mxfp4_experts!r}")
    if mxfp4_experts == "dequantized" or (mxfp4_experts == "auto" and device.type != "cuda"):
        return dataclasses.replace(config, mxfp4_experts=False)
    return config


_E4M3_REFUSAL = "fp8 (e4m3) weights need compute capability 8.9 or newer on CUDA"


def served_fp8(
    config: ModelConfig, fp8_weights: str, device: torch.device, shard: Shard = WHOLE, files: list[str] = ()
) -> ModelConfig:  # fmt: skip
    """``config`` as ``--fp8-weights`` serves an fp8 checkpoint (``files``, its shards) on ``device``: its
    projections kept in fp8 (``fp8``; ``auto`` on CUDA from sm_89, where kernels.fp8_linear reads e4m3,
    when nothing below refuses it) or dequantized at load (``dequantized``; ``auto`` otherwise). A reason
    fp8_projection_refusal gives is a ValueError under ``fp8``. Other checkpoints as they are."""
    if fp8_weights not in FP8_WEIGHT_CHOICES:
        raise ValueError(f"fp8_weights must be one of {', '.join(FP8_WEIGHT_CHOICES)}, got {fp8_weights!r}")
    if not config.fp8_weights or fp8_weights == "dequantized":
        return config
    if not e4m3_supported(device):
        refusal = _E4M3_REFUSAL
    elif fp8_weights == "auto" and device.type != "cuda":
        return config  # NOTE: on the CPU the kept weights would be dequantized at every step
    else:
        refusal = fp8_projection_refusal(config, shard, files)
    if refusal is None:
        return dataclasses.replace(config, fp8_projections=True)
    if fp8_weights == "fp8":
        raise ValueError(f"--fp8-weights fp8: {refusal}; serve them with --fp8-weights dequantized")
    logging.getLogger("worker.engine").info("fp8 projections dequantized at load: %s", refusal)
    return config


def quantized_at_load(config: ModelConfig, quantization: str, device: torch.device) -> ModelConfig:
    """``config`` as ``--quantization`` serves a 16-bit checkpoint: ``fp8``: its projections (those an fp8
    checkpoint keeps in fp8, checkpoint.FP8_PROJECTION) quantized to e4m3 at load, one scale a row, and
    multiplied as kept fp8 ones are; ``none``: as it is. ValueError for a checkpoint already quantized (fp8,
    or MXFP4 experts kept packed) and below compute capability 8.9 on CUDA."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )
    if quantization == "none":
        return config
    if config.fp8_weights:
        raise ValueError("--quantization fp8: the checkpoint is fp8 already (--fp8-weights serves it)")
    if config.mxfp4_experts:
        raise ValueError("--quantization fp8: the checkpoint's experts are MXFP4; serve them with "
                         "--mxfp4-experts dequantized to quantize them to fp8")  # fmt: skip
    if not e4m3_supported(device):
        raise ValueError(f"--quantization fp8: {_E4M3_REFUSAL}")
    return dataclasses.replace(config, fp8_projections=True, fp8_weight_block=None)


def served_activations(config: ModelConfig, fp8_activations: str) -> ModelConfig:
    """``config`` as ``--fp8-activations`` serves its fp8 projections' inputs: ``dynamic``: quantized to
    e4m3 per token group at each call (kernels.fp8_linear's fp8_activations); ``static``: by the
    checkpoint's calibrated input scales (its input_scale tensors, loaded beside the weights); ``none``: as
    computed. ValueError where no projection is served in fp8 (after served_fp8 and quantized_at_load), and
    for ``static`` unless the checkpoint declares static input scales."""
    if fp8_activations not in FP8_ACTIVATION_CHOICES:
        raise ValueError(
            f"fp8_activations must be one of {', '.join(FP8_ACTIVATION_CHOICES)}, got {fp8_activations!r}"
        )
    if fp8_activations == "none":
        return config
    if not config.fp8_projections:
        raise ValueError(
            f"--fp8-activations {fp8_activations}: no projection is served in fp8; it needs an fp8 checkpoint "
            "served with --fp8-weights fp8 (auto dequantizes on the CPU and below sm_89)"
            + (" or --quantization fp8" if fp8_activations == "dynamic" else "")
        )
    if fp8_activations == "static" and (not config.fp8_weights or config.fp8_activation_scheme != "static"):
        scheme = config.fp8_activation_scheme
        declared = f"{scheme} activations" if scheme else "no activation scheme"
        source = (
            f"the checkpoint declares {declared}" if config.fp8_weights else "--quantization fp8 has none"
        )
        raise ValueError(
            f"--fp8-activations static needs a checkpoint's calibrated input scales (activation_scheme static, "
            f"or compressed-tensors' static input_activations by tensor); {source}: use --fp8-activations "
            "dynamic"
        )
    return dataclasses.replace(config, fp8_activations=True, fp8_input_scales=fp8_activations == "static")


def served_kv_scales(config: ModelConfig, kv_cache_dtype: str) -> ModelConfig:
    """``config`` with its checkpoint's KV scales served (kv_scales) where the pool is fp8 (--kv-cache-dtype
    fp8, fp8_e4m3 or fp8_e5m2): the pool then holds K / k_scale and V / v_scale. A 16-bit pool holds K and
    V as computed and the scales are not read."""
    if config.checkpoint_kv_scales and kv_cache_dtype.startswith("fp8"):
        return dataclasses.replace(config, kv_scales=True)
    return config


def served_precision(
    config: ModelConfig, device: torch.device, shard: Shard, files: list[str], fp8_weights: str,
    quantization: str, fp8_activations: str, kv_cache_dtype: str = "auto",
) -> ModelConfig:  # fmt: skip
    """``config`` as the worker's precision flags serve it, in their order: --fp8-weights (served_fp8, over
    the checkpoint's ``files``), --quantization (quantized_at_load), --fp8-activations (served_activations),
    --kv-cache-dtype (served_kv_scales)."""
    config = served_fp8(config, fp8_weights, device, shard, files)
    config = served_activations(quantized_at_load(config, quantization, device), fp8_activations)
    return served_kv_scales(config, kv_cache_dtype)


# weights that stack projections kept apart in fp8: Phi-3's q/k/v and gate/up, Granite MoE's experts
_FUSED = (
    "self_attn.qkv_proj",
    "mlp.gate_up_proj",
    "block_sparse_moe.input_linear",
    "block_sparse_moe.output_linear",
)


def fp8_projection_refusal(config: ModelConfig, shard: Shard, files: list[str]) -> str | None:
    """Why an fp8 checkpoint's projections cannot stay in fp8 on ``shard``'s ranks (None: they can). Each
    must be an e4m3 weight of its own (not Phi-3's fused q/k/v or gate/up, nor Granite MoE's stacked
    experts) in the checkpoint's headers (no tensor is read), and with block scales every stacked or split
    part must be whole blocks: this rank's q, k and v rows and dense and expert gate and up rows in blocks
    of rows, and over several ranks the columns each holds of o_proj and the down projections in blocks
    of columns."""
    from safetensors import safe_open

    if config.fp8_weight_block is not None:
        rows, cols = config.fp8_weight_block
        d = config.head_dim
        q, kv = shard.local(config, "heads") * d, shard.local(config, "kv_heads") * d
        # NOTE: a dense MLP's width where some layer has one, an expert's where some layer has experts
        dense = any(not config.is_sparse(i) for i in range(config.num_layers))
        inter = shard.local(config, "intermediate") if dense else 0
        expert = shard.local(config, "moe_intermediate") if config.num_experts else 0
        parts = {"q_proj rows": (q, rows), "k_proj and v_proj rows": (kv, rows)}
        parts |= {
            "gate_proj and up_proj rows": (inter, rows),
            "experts' gate_proj and up_proj rows": (expert, rows),
        }
        if shard.size > 1:
            parts |= {"o_proj columns": (q, cols), "down_proj columns": (inter, cols)}
            parts["experts' down_proj columns"] = (expert, cols)
        for what, (n, block) in parts.items():
            if n % block:
                ranks = f" on each of {shard.size} ranks" if shard.size > 1 else ""
                return f"{n} {what}{ranks} are not whole {rows}x{cols} scale blocks"
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                owner = name.removesuffix(".weight")
                if name.endswith(".weight") and owner.endswith(_FUSED):
                    return f"{name} holds fused projections"
                if name.endswith(".weight") and FP8_PROJECTION.search(owner):
                    dtype = f.get_slice(name).get_dtype()
                    if dtype != "F8_E4M3":
                        return f"{name} is {dtype}, not fp8 (e4m3)"
    return None


def cap_context(config: ModelConfig, max_model_len: int | None) -> ModelConfig:
    """``config`` serving at most ``max_model_len`` tokens (None: as it is). Only shrinks: a longer
    context than the model's is a ValueError (its positions past the trained ones would be wrong)."""
    if max_model_len is None or max_model_len == config.max_context:
        return config
    if max_model_len > config.max_context:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's context ({config.max_context} tokens)"
        )
    return dataclasses.replace(config, max_position_embeddings=max_model_len)


def load_model(
    spec: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, shard: Shard = WHOLE,
    max_model_len: int | None = None, mxfp4_experts: str = "auto", fp8_weights: str = "auto",
    quantization: str = "none", fp8_activations: str = "none", kv_cache_dtype: str = "auto",
) -> LoadedModel:  # fmt: skip
    """``"tiny"`` or the path of a local HF model directory (``shard``: the part one rank of a
    tensor-parallel model holds; ``max_model_len``: a context below the model's own to serve;
    ``mxfp4_experts``: MXFP4 experts kept ``packed`` or ``dequantized`` to ``dtype`` at load, ``auto``:
    packed on CUDA, where kernels.moe decodes them, dequantized elsewhere; ``fp8_weights``: an fp8
    checkpoint's projections likewise, see served_fp8; ``quantization``: a 16-bit checkpoint's quantized to
    fp8 at load or not, see quantized_at_load; ``fp8_activations``: see served_activations;
    ``kv_cache_dtype``: the pool's, whether the checkpoint's KV scales are served, see served_kv_scales).
    Raises ValueError when the directory is not a supported checkpoint or does not split over the shard's
    ranks."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    precision = {"fp8_weights": fp8_weights, "quantization": quantization, "fp8_activations": fp8_activations,
                 "kv_cache_dtype": kv_cache_dtype}  # fmt: skip
    if spec == "tiny":
        config = served_precision(cap_context(tiny_config(), max_model_len), device, shard, [], **precision)
        return LoadedModel(build_tiny(device, dtype, shard, config), config, ByteTokenizer(), "tiny")
    config = served_experts(cap_context(read_config(spec), max_model_len), mxfp4_experts, device)
    files = safetensors_files(spec)
    config = served_precision(config, device, shard, files, **precision)
    # NOTE: a tokenizer may name tokens past the embedding (Gemma 3's image tokens, Code Llama's infill
    # tokens): the engine refuses a prompt that holds one, and the model never samples one
    tokenizer = HFTokenizer(spec)
    model = LlamaForCausalLM(config, device, dtype, shard)
    model.load_weights(iter_safetensors(files))
    name = os.path.basename(os.path.normpath(spec))
    return LoadedModel(model, config, tokenizer, name)
