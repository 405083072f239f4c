"""A checkpoint's tensors under the names and layout LlamaForCausalLM loads: fused and stacked projections
split (Phi-3, Granite 3 MoE, gpt-oss), Mixtral's expert names as Qwen-MoE's, fp8 weights paired with their
scales (dequantized, or kept as they are), MXFP4 halves paired. A stream: a tensor is held only until its
pair is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kernels import reference
from worker.model.config import ModelConfig

# sinks: gpt-oss's, self_attn's; scales: MXFP4 experts' (of mlp.experts.N.gate_proj / up_proj / down_proj);
# weight_scale: the scales of a projection kept in fp8 (--fp8-weights); input_scale: its input's static scale
LAYER_WEIGHT = re.compile(
    r"model\.layers\.(\d+)\.(.+)\.(weight|bias|sinks|scales|weight_scale|input_scale|k_scale|v_scale)$"
)
# Mixtral's names for a sparse layer: block_sparse_moe.gate and block_sparse_moe.experts.N.w1 / w3 / w2
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(?:gate|(experts\.\d+\.)(w[123]))\.")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# Granite 3 MoE's stacked weights: every expert's gate and up rows in one input_linear [E, 2I, H], their down
# projections in one output_linear [E, H, I], the router's as router.layer; the shared expert's likewise
_GRANITE_MOE = re.compile(
    r"(model\.layers\.\d+\.)(block_sparse_moe\.input_linear|block_sparse_moe\.output_linear|"
    r"block_sparse_moe\.router\.layer|shared_mlp\.input_linear|shared_mlp\.output_linear)\.weight$"
)


def _granite_moe_parts(m: re.Match, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """A _GRANITE_MOE weight as the Qwen-MoE named weights it stacks (gate rows before up rows)."""
    layer, part = m.group(1), m.group(2)
    if part == "block_sparse_moe.router.layer":
        yield f"{layer}mlp.gate.weight", tensor
        return
    if part.startswith("shared_mlp"):
        owned = [(f"{layer}mlp.shared_expert.", tensor)]
    else:  # NOTE: every expert's, stacked along the first dimension
        owned = [(f"{layer}mlp.experts.{e}.", w) for e, w in enumerate(tensor)]
    for owner, w in owned:
        if part.endswith("output_linear"):
            yield f"{owner}down_proj.weight", w
        else:
            gate, up = w.chunk(2)
            yield f"{owner}gate_proj.weight", gate
            yield f"{owner}up_proj.weight", up


# an fp8 checkpoint's scales: weight_scale_inv (HF's fine-grained fp8) or weight_scale (compressed-tensors), a
# weight's multiplier despite the first name; a projection's input_scale (its input's calibrated scale) is
# read under --fp8-activations static, the KV scales (self_attn.k_scale / v_scale, or k_proj / v_proj's
# output_scale in older releases) over an fp8 pool; other output scales are not used
_FP8_SCALE = re.compile(r"(.+)\.weight_scale(?:_inv)?$")
_FP8_UNUSED = re.compile(r"(.+)\.(input_scale|output_scale|k_scale|v_scale)$")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# a KV scale's names: self_attn.k_scale / v_scale, or self_attn.k_proj / v_proj.output_scale
_KV_SCALE = re.compile(r"(.+\.self_attn)\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
# the projections an fp8 checkpoint keeps in fp8 under --fp8-weights fp8 (the owner of a weight and its scale):
# every layer's attention q/k/v/o, a dense layer's MLP gate/up/down and every expert's (Mixtral's w1 / w3 / w2
# names too); shared experts, routers and the LM head are dequantized
FP8_PROJECTION = re.compile(
    r"(?:^|\.)model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:experts\.\d+\.)?(?:gate|up|down)_proj|"
    r"block_sparse_moe\.experts\.\d+\.w[123])$"
)


def _fp8_dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] | None, dtype: torch.dtype,
    keep: bool = False, inputs: bool = False, kv_heads: int = 0,
) -> Iterable[tuple[str, torch.Tensor]]:  # fmt: skip
    """``weights`` with each fp8 weight and its scale, whichever is read first, as one weight dequantized to
    ``dtype`` (kernels.reference.dequantize_fp8_weight: a scale a ``block``, else a tensor's or a row's), or
    with ``keep`` an FP8_PROJECTION's as they are, the weight and its scales (``<owner>.weight_scale``:
    float32, one a block, else one a row, [N, 1]); with ``inputs`` (and ``keep``) each FP8_PROJECTION's
    static ``input_scale`` too (float32 [1]); with ``kv_heads`` (the model's KV heads) each layer's KV scales
    as ``self_attn.k_scale`` / ``v_scale`` (float32 [kv_heads], _kv_scale); other weights (norms, embeddings,
    layers the checkpoint left unquantized) as they are. A weight without its scale, or a scale without its
    weight, is a ValueError naming it; so is an input scale of more than one value, or a KV scale of neither
    one nor one a KV head."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        unused, kv_scale = _FP8_UNUSED.match(name), _KV_SCALE.match(name)
        if unused is not None:
            if inputs and keep and unused[2] == "input_scale" and FP8_PROJECTION.search(unused[1]):
                yield name, _one_scale(name, tensor, "static input")
            elif kv_heads and kv_scale is not None:
                yield f"{kv_scale[1]}.{kv_scale[2] or kv_scale[3]}_scale", _kv_scale(name, tensor, kv_heads)
            continue
        scale = _FP8_SCALE.match(name)
        if scale is None and not (name.endswith(".weight") and tensor.dtype in _FP8):
            yield name, tensor
            continue
        owner = scale.group(1) if scale else name.removesuffix(".weight")
        if scale is not None and not torch.isfinite(tensor.float()).all():  # NOTE: every answer would be NaN
            raise ValueError(f"{name} holds inf or NaN: a weight's scales must be finite")
        pair = waiting.setdefault(owner, {})
        pair["scale" if scale else "weight"] = tensor
        if len(pair) == 2 and keep and FP8_PROJECTION.search(owner):
            del waiting[owner]
            yield f"{owner}.weight", pair["weight"]
            yield f"{owner}.weight_scale", _row_or_block_scales(pair["scale"], pair["weight"].shape[0], block)
        elif len(pair) == 2:
            del waiting[owner]
            yield (
                f"{owner}.weight",
                reference.dequantize_fp8_weight(pair["weight"], pair["scale"], block, dtype),
            )
    for owner, pair in waiting.items():
        has, lacks = ("weight", "its scale") if "weight" in pair else ("scale", "its fp8 weight")
        raise ValueError(f"checkpoint has the fp8 {has} of {owner} without {lacks}")


def _one_scale(name: str, tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """A per-tensor scale as float32 [1]; ValueError naming it where it holds more than one value, or one
    that is not positive and finite (the input is divided by it: every answer would be inf or NaN)."""
    if tensor.numel() != 1:
        raise ValueError(f"{name} has {tensor.numel()} values: {kind} scales are one a tensor")
    value = tensor.float().reshape(1)
    if not (torch.isfinite(value).all() and value.item() > 0):
        raise ValueError(f"{name} is {value.item()}: {kind} scales must be positive and finite")
    return value


def _kv_scale(name: str, tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A KV scale as float32 [kv_heads]: one a tensor repeated for every KV head, or one a head as it is
    (compressed-tensors' attn_head, stored [heads] or [heads, 1, 1]); ValueError naming it otherwise."""
    if tensor.numel() not in (1, kv_heads):
        raise ValueError(
            f"{name} has {tensor.numel()} values: KV scales are one a tensor or one a KV head ({kv_heads})"
        )
    return tensor.float().reshape(-1).expand(kv_heads).contiguous()


def quantized_at_load(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` (canonical names) with each FP8_PROJECTION's 16- or 32-bit weight as e4m3 codes and
    their scales (``<owner>.weight_scale``), one a row (kernels.reference.quantize_fp8_rows): a 16-bit
    checkpoint served with --quantization fp8. Other weights as they are."""
    for name, tensor in weights:
        owner = name.removesuffix(".weight")
        if name.endswith(".weight") and FP8_PROJECTION.search(owner) and tensor.dtype not in _FP8:
            codes, scales = reference.quantize_fp8_rows(tensor)
            yield name, codes
            yield f"{owner}.weight_scale", scales
        else:
            yield name, tensor


def _row_or_block_scales(scale: torch.Tensor, rows: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A kept fp8 weight's scales as the model holds them (float32): one a block as they are, else one a
    row [rows, 1] (a tensor's one scale repeated, so that stacked q/k/v keep each their own)."""
    if block is not None:
        return scale.float()
    if scale.numel() not in (1, rows):
        raise ValueError(f"an fp8 weight of {rows} rows has scales {list(scale.shape)}: not one a row")
    return scale.float().reshape(-1, 1).expand(rows, 1)


# gpt-oss's sparse layer: the router as mlp.router; the experts stacked, [E, in, out] with gate and up
# interleaved (out columns 2i and 2i + 1), their biases [E, out], or in MXFP4 as _blocks and _scales in the
# [E, out, ...] layout of a Linear weight (kernels.reference.dequantize_mxfp4; blocks [E, out, in/32, 16])
_GPT_OSS_MLP = re.compile(
    r"(model\.layers\.\d+\.mlp\.)(?:router\.(weight|bias)|experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?)$"
)


def _gpt_oss_parts(
    m: re.Match, tensor: torch.Tensor, waiting: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype | None
) -> Iterable[tuple[str, torch.Tensor]]:
    """A _GPT_OSS_MLP weight as the Qwen-MoE named weights it holds, per expert (gate rows before up rows).
    MXFP4 codes and scales go as they are (``dtype`` None: the model keeps them), as each expert's weight
    ([out, in/2] uint8) and scales ([out, in/32]); else the halves wait until both have been
    read (``waiting``), then are dequantized to ``dtype`` one expert at a time."""
    mlp, router_kind, proj, suffix = m.groups()
    if router_kind is not None:
        yield f"{mlp}gate.{router_kind}", tensor
        return
    if suffix in ("_blocks", "_scales") and dtype is None:
        kind = "weight" if suffix == "_blocks" else "scales"
        for e, part in enumerate(tensor):
            yield from _gpt_oss_expert(mlp, e, proj, kind, part.flatten(-2) if kind == "weight" else part)
        return
    if suffix in ("_blocks", "_scales"):
        halves = waiting.setdefault(f"{mlp}experts.{proj}", {})
        halves[suffix] = tensor
        if len(halves) < 2:
            return
        del waiting[f"{mlp}experts.{proj}"]
        for e in range(tensor.shape[0]):
            weight = reference.dequantize_mxfp4(halves["_blocks"][e].flatten(-2), halves["_scales"][e], dtype)
            yield from _gpt_oss_expert(mlp, e, proj, "weight", weight)
        return
    kind = "bias" if suffix == "_bias" else "weight"
    for e, part in enumerate(tensor):
        yield from _gpt_oss_expert(mlp, e, proj, kind, part if kind == "bias" else part.T)


def _gpt_oss_expert(
    mlp: str, e: int, proj: str, kind: str, t: torch.Tensor
) -> Iterable[tuple[str, torch.Tensor]]:
    """Expert ``e``'s weight [out, in] or bias [out] of ``proj``, gate and up de-interleaved."""
    if proj == "down_proj":
        yield f"{mlp}experts.{e}.down_proj.{kind}", t
    else:
        yield f"{mlp}experts.{e}.gate_proj.{kind}", t[0::2]
        yield f"{mlp}experts.{e}.up_proj.{kind}", t[1::2]


def _mixtral_to_qwen(m: re.Match) -> str:
    """The Qwen-MoE name of a _MIXTRAL_EXPERT match: .mlp.gate. or .mlp.experts.N.gate_proj. (up, down)."""
    return ".mlp.gate." if m.group(1) is None else f".mlp.{m.group(1)}{_MIXTRAL_PROJ[m.group(2)]}."


def canonical_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, dtype: torch.dtype
) -> Iterable[tuple[str, torch.Tensor]]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as the q/k/v and gate/up weights they stack
        (rows in that order), and Mixtral's ``block_sparse_moe`` names (gate, experts.N.w1 / w3 / w2) as
        Qwen-MoE's (mlp.gate, mlp.experts.N.gate_proj / up_proj / down_proj), so that loading,
        tensor-parallel splits and checks see one layout; Granite 3 MoE's stacked experts likewise, per expert.
        gpt-oss's too (_gpt_oss_parts). Of a multimodal checkpoint, the language model's weights
        (language_model.* or, as transformers 4.52+ saves them, model.language_model.* and lm_head.*) as
    a text model's. An fp8 checkpoint's weights dequantized with their scales
        first (to ``dtype``, the model's; or kept, as _fp8_dequantized says)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # gpt-oss's MXFP4 halves read without their pair
    if c.fp8_weights:
        weights = _fp8_dequantized(
            weights,
            c.fp8_weight_block,
            dtype,
            keep=c.fp8_projections,
            inputs=c.fp8_input_scales,
            kv_heads=c.num_kv_heads if c.kv_scales else 0,
        )
    for name, tensor in weights:
        if c.multimodal:  # NOTE: the language model's weights only (Gemma 3 4B+), in either naming:
            if name.startswith("language_model."):  # language_model.model.X, language_model.lm_head
                name = name.removeprefix("language_model.")
            elif name.startswith("model.language_model."):  # transformers 4.52+: model.language_model.X
                name = "model." + name.removeprefix("model.language_model.")
            elif not name.startswith("lm_head."):  # ... and lm_head; the vision tower and projector skipped
                continue
        granite = _GRANITE_MOE.match(name)
        if granite is not None:
            yield from _granite_moe_parts(granite, tensor)
            continue
        gpt_oss = _GPT_OSS_MLP.match(name) if c.model_type == "gpt_oss" else None
        if gpt_oss is not None:
            yield from _gpt_oss_parts(gpt_oss, tensor, waiting, None if c.mxfp4_experts else dtype)
            continue
        name = _MIXTRAL_EXPERT.sub(_mixtral_to_qwen, name)
        m = LAYER_WEIGHT.match(name)
        part = m.group(2) if m else None
        if part == "self_attn.qkv_proj" and tensor.shape[0] == q + 2 * kv:
            head = name[: m.start(2)]  # type: ignore[union-attr]
            for proj, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                yield f"{head}self_attn.{proj}.{m.group(3)}", rows  # type: ignore[union-attr]
        elif part == "mlp.gate_up_proj" and tensor.shape[0] == 2 * c.intermediate_size:
            head = name[: m.start(2)]  # type: ignore[union-attr]
            for proj, rows in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                yield f"{head}mlp.{proj}.{m.group(3)}", rows  # type: ignore[union-attr]
        else:
            yield name, tensor
    for name, halves in waiting.items():
        missing = "_scales" if "_blocks" in halves else "_blocks"
        raise ValueError(
            f"checkpoint has MXFP4 weight {name}{next(iter(halves))} without its {name}{missing}"
        )
