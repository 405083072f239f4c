"""ModelConfig: the Llama-family hyperparameters the worker needs, read from an HF config.json.

Pure data; never imports torch. Unsupported architectures or RoPE types fail here, at load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "gemma2",
    "gemma3_text",
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "ministral",
    "phi3",
    "granite",
    "granitemoe",
    "granitemoeshared",
    "smollm3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "granitemoeshared", "gpt_oss")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# NOTE: the model types whose transformers config class ties the lm_head to the embeddings where config.json
# leaves tie_word_embeddings out (transformers 4 saves no key equal to its default)
TIED_BY_DEFAULT = ("smollm3", *GEMMA_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the parameters each scaled RoPE type reads (worker.model.rope.rope_inv_freq)
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3"|"yarn", "factor": ...}
    max_position_embeddings: int = 4096  # tokens
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key, before RoPE
    # Granite's scalars: on the embeddings, on each layer's attention and MLP output before its residual
    # add, on the attention scores (instead of 1/sqrt(head_dim)), and dividing the logits
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): 0 experts is a dense model. A sparse layer's MLP is
    # experts_per_token of num_experts SwiGLU experts of moe_intermediate_size, their outputs weighted by
    # the router's softmax (over the chosen ones when norm_topk_prob), plus a shared expert (Qwen2-MoE) of
    # shared_expert_intermediate_size scaled by sigmoid(its gate); dense_layers keep an intermediate_size MLP
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert (Granite's has none)
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: biases on the router and on every expert's projections, experts under a clamped SwiGLU
    # ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit))
    moe_bias: bool = False
    expert_activation: str = "silu"  # or "clamped_swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False  # gpt-oss: one learned score per head in each softmax, attending nothing
    # the experts' weights are MXFP4 codes and scales (gpt-oss as released), kept so on the device (kernels.moe
    # decodes them); the loader clears it to dequantize them instead (--mxfp4-experts dequantized)
    mxfp4_experts: bool = False
    # fp8 checkpoints (HF's fine-grained "fp8", compressed-tensors' float8): their fp8 weights with their
    # scales (a tensor's, a row's, or a block's of fp8_weight_block rows x columns), dequantized at load;
    # with fp8_projections (the loader's choice, --fp8-weights) every layer's q/k/v/o, dense gate/up/down and
    # experts' projections stay fp8 on the device with their scales (kernels.fp8_linear, kernels.moe), the
    # others dequantized; on a 16-bit checkpoint (fp8_weights False: --quantization fp8) those projections
    # are quantized at load, one scale a row
    fp8_weights: bool = False
    fp8_weight_block: tuple[int, int] | None = None
    fp8_projections: bool = False
    # with fp8_projections: their inputs (the experts' too) quantized to e4m3 per token group at each call and
    # multiplied fp8 by fp8 (--fp8-activations dynamic; kernels.fp8_linear's and kernels.moe's fp8_activations)
    fp8_activations: bool = False
    # how the fp8 checkpoint says its projections' inputs are quantized: "dynamic" (per token, at each call),
    # "static" (one calibrated input_scale a projection, in the checkpoint) or None (it does not say)
    fp8_activation_scheme: str | None = None
    # with fp8_activations: by those static input scales instead (--fp8-activations static), one a stacked
    # projection (the largest of its parts': q/k/v, gate/up) and one a sparse layer's gate/up and down GEMMs
    # (the largest of its experts')
    fp8_input_scales: bool = False
    # the checkpoint carries calibrated fp8 scales for each layer's K and V, one a tensor or one a KV head
    # (compressed-tensors' kv_cache_scheme: 8-bit floats by tensor or attn_head; an fp8 config's
    # "kv_cache_scheme": "static"; self_attn.k_scale / v_scale, or k_proj / v_proj.output_scale);
    # with kv_scales (the loader's choice: an fp8 --kv-cache-dtype) the pool stores K / k_scale and
    # V / v_scale, each head's over its own, and attention reads them back times the scales
    checkpoint_kv_scales: bool = False
    kv_scales: bool = False
    # sliding-window attention: the layers in sliding_layers attend the last sliding_window positions only
    sliding_window: int = 0  # tokens, the query's own included
    sliding_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()  # layers whose attention takes no rotary embedding (SmolLM3's NoPE)
    # Gemma 3: RMSNorm weights stored as an offset from 1 (folded in at load), a norm on each sublayer's
    # output before its residual add, a GELU (tanh) gated MLP, sliding layers' own RoPE base, and tanh
    # soft-capping of the logits (0: none)
    norm_offset: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"  # or "gelu_tanh"
    local_rope_theta: float | None = None  # the RoPE base of sliding layers (default RoPE), when theirs
    final_logit_softcapping: float = 0.0
    attn_logit_softcapping: float = 0.0  # Gemma 2: each attention score s becomes c * tanh(s / c) (0: none)
    # the checkpoint holds more than this language model (Gemma 3 4B+: a vision tower and its projector),
    # its weights named language_model.*: those are loaded, the others skipped
    multimodal: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def layer_window(self, layer: int) -> int:
        """The sliding window of ``layer``'s attention (tokens), 0 for full attention."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def input_quantization(self) -> str:
        """How the fp8 projections' inputs are served, as --fp8-activations names it: "none", "dynamic" (per
        token) or "static" (the checkpoint's input scales)."""
        if not self.fp8_activations:
            return "none"
        return "static" if self.fp8_input_scales else "dynamic"

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output tokens) the model serves."""
        return self.max_position_embeddings

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        """From a parsed HF config.json (transformers 4.x ``rope_scaling``/``rope_theta`` or 5.x
        ``rope_parameters``). Raises ValueError on what this model cannot run."""
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3":  # NOTE: Gemma 3 4B+ (image and text): its language model is served
            # NOTE: the whole model's tokens, quantization (llm-compressor writes it beside text_config) and
            # tying are the top level's, as transformers 5 reads them (Gemma3Config ties unless told not to)
            whole = ("eos_token_id", "bos_token_id", "quantization_config")
            text = dict(cfg.get("text_config") or {})
            cfg = {**text, "model_type": "gemma3_text", "language_model_of": "gemma3",
                   "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
                   **{k: cfg[k] for k in whole if cfg.get(k) is not None}}  # fmt: skip
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if model_type in GEMMA_MODEL_TYPES:
            cfg = _gemma_defaults(cfg, model_type)
        fp8 = _quantization(cfg, model_type)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        act = "silu" if act == "swish" else act  # NOTE: transformers' name for the same function
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"unsupported hidden_act {act!r}; silu (SwiGLU) and gelu_pytorch_tanh (GeGLU) are"
            )
        if act != "silu" and model_type in MOE_MODEL_TYPES and model_type != "gpt_oss":
            # NOTE: experts (kernels.moe) and shared experts run SwiGLU only; gpt-oss's run their clamped
            # SwiGLU whatever hidden_act says, as transformers' do
            raise ValueError(
                f"hidden_act {act!r} is not supported on {model_type}'s experts; silu (SwiGLU) is"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads")

        rope = _rope_parameters(cfg)
        local_rope_theta = None
        if "full_attention" in rope:  # NOTE: transformers 5's RoPE per layer type (Gemma 3)
            local = dict(rope.get("sliding_attention") or {})
            if local.get("rope_type", "default") != "default":
                raise ValueError(
                    f"unsupported rope type {local['rope_type']!r} on sliding layers (default only)"
                )
            local_rope_theta = float(local.get("rope_theta", 10000.0))
            rope = dict(rope["full_attention"] or {})
        elif cfg.get("rope_local_base_freq") is not None:  # transformers 4's Gemma 3
            local_rope_theta = float(cfg["rope_local_base_freq"])
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rotary = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
        if rotary != 1.0:  # Phi-4-mini and others rotate only part of each head
            raise ValueError(
                f"partial_rotary_factor {rotary} is not supported: RoPE here rotates whole heads"
            )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        if rope_type in ("llama3", "yarn"):
            # NOTE: as transformers 5 reads it: a top-level original_max_position_embeddings (Phi-3's place)
            # wins, else the parameters' own, else max_position_embeddings (the pretraining context)
            if cfg.get("original_max_position_embeddings") is not None:
                rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
            rope.setdefault("original_max_position_embeddings", max_positions)
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        missing = [k for k in _ROPE_KEYS.get(rope_type, ()) if not isinstance(rope.get(k), (int, float))]
        if missing:
            raise ValueError(f"rope type {rope_type!r} needs numeric {', '.join(missing)} in its parameters")

        attention_bias = bool(cfg.get("attention_bias", False))
        if rope_type == "yarn":
            # NOTE: YaRN serves factor x the pretraining context; Qwen2.5 / Qwen3 configs turn it on by
            # adding rope_scaling and leave max_position_embeddings at the pretraining context
            max_positions = max(max_positions, int(rope["original_max_position_embeddings"] * rope["factor"]))
        eos = cfg.get("eos_token_id")
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT)),
            # NOTE: Qwen2 always has q/k/v biases and no o_proj bias (Qwen2-MoE too, unless its config says not).
            qkv_bias=attention_bias
            or model_type == "qwen2"
            or bool(model_type == "qwen2_moe" and cfg.get("qkv_bias", True)),
            o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            **(_granite_scalars(cfg) if model_type.startswith("granite") else {}),
            **(_experts(cfg, model_type) if model_type in MOE_MODEL_TYPES else {}),
            **_sliding_window(cfg, model_type),
            **(_nope_layers(cfg) if model_type == "smollm3" else {}),
            **(_gpt_oss(cfg) if model_type == "gpt_oss" else {}),
            mxfp4_experts=(cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4",
            **fp8,
            **(_gemma(cfg, hidden, local_rope_theta, model_type) if model_type in GEMMA_MODEL_TYPES else {}),
            mlp_activation="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters as transformers reads them: a non-empty ``rope_scaling`` wins over
    ``rope_parameters`` (transformers 5 writes a default one into every config.json it saves, and Qwen's
    model cards turn YaRN on by adding rope_scaling); Gemma 3's go into its full attention's parameters."""
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if not scaling:
        return rope
    if "full_attention" in rope:
        return {**rope, "full_attention": {**(rope["full_attention"] or {}), **scaling}}
    # NOTE: rope_scaling seldom names the model's base, so it stays the config's (transformers 5 would fall
    # back to 10^4 where only rope_parameters names it: another model than the one trained)
    theta = cfg.get("rope_theta") or rope.get("rope_theta")
    return {**({"rope_theta": theta} if theta else {}), **scaling}


def _quantization(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Quantized checkpoints: gpt-oss's MXFP4 experts are served (kept packed, or dequantized at load), and
    fp8 weights (HF's fine-grained ``fp8``: e4m3 with a scale a block or a tensor; compressed-tensors'
    8-bit float weights: a scale a tensor, a row or a block) are dequantized at load (the ModelConfig
    fields they set); any other quantization is refused here rather than failing on weight names the
    loader does not know."""
    quant = cfg.get("quantization_config")
    if not quant:
        return {}
    method = (quant.get("quant_method") if isinstance(quant, dict) else None) or "unknown method"
    if method == "mxfp4" and model_type == "gpt_oss":
        return {}
    if method == "fp8" and quant.get("fmt", "e4m3") == "e4m3":
        block = quant.get("weight_block_size")
        scheme = quant.get("activation_scheme")
        # NOTE: "kv_cache_scheme": "static": the release carries calibrated KV scales (the FP8-KV releases'
        # k_proj / v_proj.output_scale, or self_attn.k_scale / v_scale), one a tensor
        return {"fp8_weights": True, "fp8_weight_block": tuple(int(b) for b in block) if block else None,
                "fp8_activation_scheme": scheme if scheme in ("dynamic", "static") else None,
                "checkpoint_kv_scales": quant.get("kv_cache_scheme") == "static"}  # fmt: skip
    if method == "compressed-tensors":
        return _compressed_fp8(quant)
    if method == "fp8":  # NOTE: e5m2 weights ("fmt": "e5m2"): the kernels and the dequantizer read e4m3 codes
        raise ValueError(
            f"fp8 checkpoints of format {quant.get('fmt')!r} are not supported (e4m3 weights are)"
        )
    raise ValueError(
        f"quantized checkpoints ({method}) are not supported, except fp8 weights (dequantized at load) and "
        "gpt-oss's MXFP4 experts; serve the unquantized weights"
    )


def _compressed_fp8(quant: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors config whose every group's weights are 8-bit floats with one strategy (a
    scale a tensor, a row or a block): the fp8 fields; anything else (integer or 4-bit weights, groups)
    is a ValueError naming it."""
    schemes = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    kinds = {(w.get("type"), w.get("num_bits"), w.get("strategy"), tuple(w.get("block_structure") or ()))
             for w in schemes}  # fmt: skip
    fp8 = [k for k in kinds if k[:2] == ("float", 8) and k[2] in ("tensor", "channel", "block")]
    if not schemes or len(kinds) != 1 or not fp8 or (fp8[0][2] == "block" and len(fp8[0][3]) != 2):
        shown = ", ".join(f"{t} {b}-bit by {s}" for t, b, s, _ in sorted(kinds, key=str)) or "no weights"
        raise ValueError(
            f"quantized checkpoints (compressed-tensors: {shown}) are not supported; of compressed-tensors, "
            "8-bit float weights by tensor, channel or block are (dequantized at load)"
        )
    _, _, strategy, block = fp8[0]
    return {
        "fp8_weights": True,
        "fp8_weight_block": tuple(int(b) for b in block) if strategy == "block" else None,
        "fp8_activation_scheme": _compressed_activations(quant),
        "checkpoint_kv_scales": _compressed_kv_scales(quant),
    }


def _compressed_kv_scales(quant: dict[str, Any]) -> bool:
    """Whether a compressed-tensors config's kv_cache_scheme stores K and V as 8-bit floats by symmetric
    scales, one a layer's tensor ("tensor") or one a KV head ("attn_head"); other schemes' scales are not
    read (an asymmetric one's would need its zero points too)."""
    kv = quant.get("kv_cache_scheme") or {}
    symmetric = kv.get("symmetric", True) is not False
    return (
        (kv.get("type"), kv.get("num_bits")) == ("float", 8)
        and kv.get("strategy") in ("tensor", "attn_head")
        and symmetric
    )


def _compressed_activations(quant: dict[str, Any]) -> str | None:
    """How a compressed-tensors config's groups quantize the layers' inputs: "static" where every group's
    input_activations are 8-bit floats by one static scale a tensor, "dynamic" where every group's are
    computed at each call, else None (weight-only, or groups that differ)."""
    schemes = [g.get("input_activations") for g in (quant.get("config_groups") or {}).values()]
    kinds = {
        (a.get("type"), a.get("num_bits"), a.get("strategy"), bool(a.get("dynamic"))) if a else None
        for a in schemes
    }
    if kinds == {("float", 8, "tensor", False)}:
        return "static"
    if len(kinds) == 1 and None not in kinds and all(k[:2] == ("float", 8) and k[3] for k in kinds):
        return "dynamic"
    return None


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: biased router and experts under a clamped SwiGLU, attention sinks; its router's softmax
    over the top experts' logits is the renormalized top-k of the softmax over all (norm_topk_prob)."""
    return {
        "moe_bias": True,
        "expert_activation": "clamped_swiglu",
        "swiglu_alpha": float(cfg.get("swiglu_alpha") or 1.702),
        "swiglu_limit": float(cfg.get("swiglu_limit") or 7.0),
        "attention_sinks": True,
    }


def _granite_scalars(cfg: dict[str, Any]) -> dict[str, float]:
    """Granite's multipliers, transformers' defaults (1) where a config leaves one out."""
    names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {name: float(cfg.get(name, 1.0)) for name in names}


def _experts(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or Granite 3 MoE config.json."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(
            f"{model_type} needs num_experts (or num_local_experts) > 0 and 0 < num_experts_per_tok <= it, "
            f"got {experts} and {top_k}"
        )
    if model_type in ("mixtral", "granitemoe", "granitemoeshared", "gpt_oss"):
        # NOTE: every layer sparse, experts of intermediate_size, the top experts' weights renormalized;
        # Granite's shared expert (granitemoeshared) is added ungated
        return {
            "num_experts": experts,
            "experts_per_token": top_k,
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "shared_expert_intermediate_size": int(cfg.get("shared_intermediate_size") or 0),
            "shared_expert_gated": False,
        }
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),  # NOTE: transformers' default
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe"
        else 0,
        "dense_layers": tuple(sorted(dense)),
    }


def _sliding_window(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The sliding window and the layers it applies to, as transformers reads them: the layers
    ``layer_types`` marks "sliding_attention"; without it, every layer of Mistral, Ministral, Mixtral and
    Phi-3, gpt-oss's even layers, Gemma's pattern, SmolLM3's NoPE layers, or with ``use_sliding_window`` every layer of Qwen3-MoE,
    the even layers below ``max_window_layers`` of Qwen2-MoE, the layers from it on of the others (Qwen2's
    rule; 28 where a config leaves it out, as transformers' Qwen configs). SmolLM3 windows nothing without
    ``use_sliding_window``."""
    window, layers = cfg.get("sliding_window"), int(cfg["num_hidden_layers"])
    other = sorted(set(cfg.get("layer_types") or ()) - {"full_attention", "sliding_attention"})
    if other:  # NOTE: e.g. linear attention: computed as full attention it would be silently wrong
        raise ValueError(f"layer_types {other} are not supported (full_attention and sliding_attention are)")
    if not window:
        return {}
    if model_type == "smollm3" and not cfg.get("use_sliding_window"):  # NOTE: its attention checks both
        return {}
    if cfg.get("layer_types"):  # NOTE: transformers 5 writes them; Ministral's interleave windows
        sliding = [i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention"]
    elif model_type == "smollm3":  # NOTE: its NoPE layers slide
        sliding = list(_nope_layers(cfg)["nope_layers"])
    elif model_type in ("mistral", "ministral", "mixtral", "phi3"):
        sliding = range(layers)
    elif model_type == "gpt_oss":  # NOTE: its config's default layer_types: the even layers slide
        sliding = range(0, layers, 2)
    elif model_type in GEMMA_MODEL_TYPES:
        # NOTE: transformers 4's configs: Gemma 2 alternates (even layers sliding), Gemma 3 has every 6th full
        pattern = int(cfg.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6))
        sliding = [i for i in range(layers) if (i + 1) % pattern]
    elif not cfg.get("use_sliding_window"):
        return {}
    elif model_type == "qwen3_moe":  # NOTE: its attention windows every layer; max_window_layers is unread
        sliding = range(layers)
    else:
        bound = 28 if cfg.get("max_window_layers") is None else int(cfg["max_window_layers"])
        # NOTE: Qwen2-MoE windows the even layers below the bound, the others the layers from it on
        sliding = range(0, min(bound, layers), 2) if model_type == "qwen2_moe" else range(bound, layers)
    return {"sliding_window": int(window), "sliding_layers": tuple(sliding)} if sliding else {}


def _gemma_defaults(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A Gemma 2 or Gemma 3 text config with transformers' defaults where it leaves them out (the text_config
    of a Gemma 3 4B+ checkpoint lists only what differs from them)."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model) is not supported")
    defaults = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                "bos_token_id": 2, "eos_token_id": 1, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "rope_theta": 1_000_000.0}  # fmt: skip
    if model_type == "gemma2":
        defaults.update({"vocab_size": 256_000, "max_position_embeddings": 8192, "rope_theta": 10_000.0,
                         "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0})  # fmt: skip
    return {**defaults, **cfg}  # NOTE: a key present wins, null included (Gemma 2's softcaps: none)


def _gemma(
    cfg: dict[str, Any], hidden: int, local_rope_theta: float | None, model_type: str
) -> dict[str, Any]:
    """Gemma's scalars: embeddings times sqrt(hidden_size), scores times query_pre_attn_scalar^-1/2 (and
    soft-capped, Gemma 2), norms as offsets from 1 on every sublayer's input and output, soft-capped logits;
    Gemma 3's sliding layers have their own RoPE base."""
    return {
        "embedding_multiplier": hidden**0.5,
        "attention_multiplier": float(cfg["query_pre_attn_scalar"]) ** -0.5,
        "norm_offset": True,
        "sandwich_norms": True,
        "local_rope_theta": (10000.0 if local_rope_theta is None else local_rope_theta)
        if model_type == "gemma3_text"
        else None,
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
        # NOTE: Gemma 3's config keeps the key (null in every release), but its attention caps nothing
        # (transformers reads it, and passes it to no attention): Gemma 2's only
        "attn_logit_softcapping": float(cfg.get("attn_logit_softcapping") or 0.0)
        if model_type == "gemma2"
        else 0.0,
        "multimodal": cfg.get("language_model_of") == "gemma3",
    }


def _nope_layers(cfg: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's layers without RoPE: where ``no_rope_layers`` holds 0, else every
    ``no_rope_layer_interval``-th layer (4 by default), as transformers reads them."""
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    return {"nope_layers": tuple(i for i, flag in enumerate(flags) if not flag)}
