"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3, Granite, Gemma 2 and 3, SmolLM3, and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, Granite 3 MoE and gpt-oss) over a paged KV pool, driven
by a ForwardBatch.

Stores every new token's K/V into the pool at ``batch.out_slots`` in every layer; never allocates
or frees slots. Weights use HF names; q/k/v and gate/up are stacked into one matmul each, and a sparse
layer's experts into one [E, 2I, H] and one [E, H, I] tensor (kernels.moe runs them).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from worker import attention
from worker.forward_batch import ForwardBatch
from worker.model.checkpoint import LAYER_WEIGHT, canonical_weights, quantized_at_load
from worker.model.config import ModelConfig
from worker.model.lora import LoraStack
from worker.model.rope import local_rope_config, rope_cos_sin_cache
from worker.model.shard import WHOLE, Shard, rows_per_entry


def _weight(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def _norm_weight(size: int, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """An RMSNorm weight: in float32 where the checkpoint stores it as an offset from 1 (Gemma), so that
    1 + w is exact as transformers computes it (the norm kernels read any weight dtype)."""
    return _weight(size, device=device, dtype=torch.float32 if config.norm_offset else dtype)


def _fp8_scale(
    config: ModelConfig, n: int, k: int, device: torch.device, experts: int | None = None
) -> nn.Parameter | None:  # fmt: skip
    """The float32 scales of an [n, k] projection kept in fp8 (kernels.fp8_linear; of each of ``experts``
    experts: kernels.moe): one a block of config.fp8_weight_block, else one a row; None when the
    projections are not kept in fp8."""
    if not config.fp8_projections:
        return None
    rows, cols = config.fp8_weight_block or (1, k)
    shape = (-(-n // rows), -(-k // cols))
    return _weight(*((experts,) if experts else ()), *shape, device=device, dtype=torch.float32)


def _input_scales(config: ModelConfig, *shape: int, device: torch.device) -> nn.Parameter | None:
    """Static input scales (--fp8-activations static): float32, one a part of a stacked projection (q, k, v;
    gate, up), or of each expert's; None when the inputs are not quantized by them (after loading, see
    LlamaForCausalLM.settle_scales)."""
    if not config.fp8_input_scales:
        return None
    return _weight(*shape, device=device, dtype=torch.float32)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, device: torch.device, dtype: torch.dtype, index: int = 0, shard: Shard = WHOLE
    ) -> None:  # fmt: skip
        super().__init__()
        c = config
        self.index = index  # layer number (LoRA weights are per layer)
        self.shard = shard
        self.heads, self.kv_heads = shard.local(c, "heads"), shard.local(c, "kv_heads")  # this rank's
        self.sparse = c.is_sparse(index)  # a mixture of experts in place of the MLP
        self.window = c.layer_window(index)  # sliding-window attention (tokens; 0: full)
        self.rope = index not in c.nope_layers
        self.inter = shard.local(c, "moe_intermediate" if self.sparse else "intermediate")  # per expert
        self.q_size, self.kv_size = self.heads * c.head_dim, self.kv_heads * c.head_dim
        qkv_rows = self.q_size + 2 * self.kv_size
        w = {"device": device, "dtype": dtype}
        # NOTE: an fp8 checkpoint's projections kept in fp8 (--fp8-weights) with float32 scales (*_scale)
        proj = {"device": device, "dtype": torch.float8_e4m3fn} if c.fp8_projections else w
        self.input_layernorm = _norm_weight(c.hidden_size, c, device, dtype)
        self.qkv_proj = _weight(qkv_rows, c.hidden_size, **proj)
        self.qkv_bias = _weight(qkv_rows, **w) if c.qkv_bias else None
        self.o_proj = _weight(c.hidden_size, self.q_size, **proj)
        self.o_bias = _weight(c.hidden_size, **w) if c.o_bias else None
        self.q_norm = _norm_weight(c.head_dim, c, device, dtype) if c.qk_norm else None
        self.k_norm = _norm_weight(c.head_dim, c, device, dtype) if c.qk_norm else None
        self.post_attention_layernorm = _norm_weight(c.hidden_size, c, device, dtype)  # the MLP's input norm
        # Gemma 3: a norm on the attention's and the MLP's outputs before their residual adds
        self.attn_out_norm = _norm_weight(c.hidden_size, c, device, dtype) if c.sandwich_norms else None
        self.mlp_out_norm = _norm_weight(c.hidden_size, c, device, dtype) if c.sandwich_norms else None
        self.uses_local_rope = self.window > 0 and c.local_rope_theta is not None
        dense = not self.sparse
        self.gate_up_proj = _weight(2 * self.inter, c.hidden_size, **proj) if dense else None
        self.gate_up_bias = _weight(2 * self.inter, **w) if c.mlp_bias and dense else None
        self.down_proj = _weight(c.hidden_size, self.inter, **proj) if dense else None
        self.down_bias = _weight(c.hidden_size, **w) if c.mlp_bias and dense else None
        # a sparse layer: the router (HF's mlp.gate), the experts stacked, the shared expert and its gate
        self.router = _weight(c.num_experts, c.hidden_size, **w) if self.sparse else None
        self.experts_gate_up_scales = self.experts_down_scales = None
        e, h, n = c.num_experts, c.hidden_size, self.inter
        if not self.sparse:
            self.experts_gate_up = self.experts_down = None
        elif c.mxfp4_experts:  # NOTE: codes two a byte, a scale a block of 32 (kernels.moe)
            packed = {"device": device, "dtype": torch.uint8}
            self.experts_gate_up, self.experts_down = (
                _weight(e, 2 * n, h // 2, **packed),
                _weight(e, h, n // 2, **packed),
            )
            self.experts_gate_up_scales = _weight(e, 2 * n, h // 32, **packed)
            self.experts_down_scales = _weight(e, h, n // 32, **packed)
        elif c.fp8_projections:  # NOTE: an fp8 checkpoint's experts kept in fp8 (kernels.moe)
            self.experts_gate_up, self.experts_down = _weight(e, 2 * n, h, **proj), _weight(e, h, n, **proj)
            self.experts_gate_up_scales = _fp8_scale(c, 2 * n, h, device, e)
            self.experts_down_scales = _fp8_scale(c, h, n, device, e)
        else:
            self.experts_gate_up, self.experts_down = _weight(e, 2 * n, h, **w), _weight(e, h, n, **w)
        sparse_fp8 = self.sparse and not c.mxfp4_experts
        self.experts_gate_up_input_scale = _input_scales(c, e, 2, device=device) if sparse_fp8 else None
        self.experts_down_input_scale = _input_scales(c, e, 1, device=device) if sparse_fp8 else None
        biased = self.sparse and c.moe_bias  # gpt-oss: the router's and every expert's biases
        self.router_bias = _weight(c.num_experts, **w) if biased else None
        self.experts_gate_up_bias = _weight(c.num_experts, 2 * self.inter, **w) if biased else None
        self.experts_down_bias = _weight(c.num_experts, c.hidden_size, **w) if biased else None
        # an fp8 pool's K and V scales (the checkpoint's k_scale, v_scale; --kv-cache-dtype fp8): K's, then
        # V's, one for each of this rank's KV heads (a checkpoint's scale a tensor repeated), as the stores
        # and attention kernels take them
        self.kv_pool_scale = (
            _weight(2, self.kv_heads, device=device, dtype=torch.float32) if c.kv_scales else None
        )
        # gpt-oss: this rank's heads' attention sinks (float32, as the kernels read them)
        self.sinks = _weight(self.heads, device=device, dtype=torch.float32) if c.attention_sinks else None
        self.shared_inter = shard.local(c, "shared_intermediate") if self.sparse else 0
        shared = self.shared_inter > 0
        self.shared_gate_up = _weight(2 * self.shared_inter, c.hidden_size, **w) if shared else None
        self.shared_down = _weight(c.hidden_size, self.shared_inter, **w) if shared else None
        self.shared_gate = _weight(1, c.hidden_size, **w) if shared and c.shared_expert_gated else None
        self.qkv_scale = _fp8_scale(c, qkv_rows, c.hidden_size, device)
        self.o_scale = _fp8_scale(c, c.hidden_size, self.q_size, device)
        self.gate_up_scale = _fp8_scale(c, 2 * self.inter, c.hidden_size, device) if dense else None
        self.down_scale = _fp8_scale(c, c.hidden_size, self.inter, device) if dense else None
        self.qkv_input_scale = _input_scales(c, 3, device=device)
        self.o_input_scale = _input_scales(c, 1, device=device)
        self.gate_up_input_scale = _input_scales(c, 2, device=device) if dense else None
        self.down_input_scale = _input_scales(c, 1, device=device) if dense else None
        # NOTE: o_proj / down_proj outputs are summed over ranks: their biases are added by rank 0 only
        self.bias_here = shard.rank == 0
        self.config = c
        self.sm_scale = c.head_dim**-0.5 if c.attention_multiplier is None else c.attention_multiplier

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, delta) -> (x', delta'): the residual stream is x + delta (the previous layer's MLP
        output, None before the first layer), added where the next norm reads it (one fused kernel:
        add_rms_norm); the caller adds the last layer's delta."""
        c, ops = self.config, attention.kernel_ops(x.device)
        t = x.shape[0]
        lora, i = batch.lora, self.index
        if delta is None:
            h = ops.rms_norm(x, self.input_layernorm, c.rms_norm_eps)
        else:
            x, h = ops.add_rms_norm(x, delta, self.input_layernorm, c.rms_norm_eps)
        qkv = self._project(h, "qkv", self.qkv_bias, ops)
        if lora is not None:
            qkv = lora.apply(i, "qkv", h, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.heads, c.head_dim)
        k = k.reshape(t, self.kv_heads, c.head_dim)
        v = v.reshape(t, self.kv_heads, c.head_dim)
        if self.q_norm is not None:  # NOTE: per head, before RoPE
            q = ops.rms_norm(q, self.q_norm, c.rms_norm_eps)
            k = ops.rms_norm(k, self.k_norm, c.rms_norm_eps)
        # NOTE: decode attention reads the new token's K/V from the pool, so store first (with RoPE: one kernel)
        kv_scales = self.kv_pool_scale
        if self.rope:
            q, k = ops.rope_store_kv(
                q, k, v, batch.positions, cos_sin_cache, k_cache, v_cache, batch.out_slots, kv_scales
            )
        else:  # NOTE: a NoPE layer (SmolLM3): positions reach it through the causal mask alone
            ops.store_kv(k_cache, v_cache, batch.out_slots, k, v, kv_scales)
        if batch.mode == "extend":
            out = attention.extend(q, k, v, k_cache, v_cache, batch, self.sm_scale, self.window,
                                   c.attn_logit_softcapping, self.sinks, kv_scales)  # fmt: skip
        else:
            out = attention.decode(q, k_cache, v_cache, batch, self.sm_scale, self.window,
                                   c.attn_logit_softcapping, self.sinks, kv_scales)  # fmt: skip
        out = out.reshape(t, self.q_size)
        o = self._project(out, "o", self.o_bias if self.bias_here else None, ops)
        o = self.shard.all_reduce(o if lora is None else lora.apply(i, "o", out, o))
        if self.attn_out_norm is not None:
            o = ops.rms_norm(o, self.attn_out_norm, c.rms_norm_eps)
        x, h = ops.add_rms_norm(x, o, self.post_attention_layernorm, c.rms_norm_eps)
        if self.sparse:
            return x, self._mlp_out(self.shard.all_reduce(self._experts(h, ops)), ops)
        gate_up = self._project(h, "gate_up", self.gate_up_bias, ops)
        if lora is not None:
            gate_up = lora.apply(i, "gate_up", h, gate_up)
        act = ops.gated_activation(gate_up, c.mlp_activation)
        down = self._project(act, "down", self.down_bias if self.bias_here else None, ops)
        return x, self._mlp_out(
            self.shard.all_reduce(down if lora is None else lora.apply(i, "down", act, down)), ops
        )

    def _project(
        self, x: torch.Tensor, name: str, bias: torch.Tensor | None, ops: ModuleType
    ) -> torch.Tensor:
        """x times projection ``name``'s weight (qkv, o, gate_up, down), plus ``bias``: in fp8 with its
        scales where the checkpoint's stays fp8 (kernels.fp8_linear; x quantized to fp8 first under
        --fp8-activations dynamic or static), else a plain matmul."""
        weight, scale = getattr(self, f"{name}_proj"), getattr(self, f"{name}_scale")
        if scale is None:
            return F.linear(x, weight, bias)
        c, static = self.config, self.input_scale(f"{name}_input_scale")
        return ops.fp8_linear(x, weight, scale, c.fp8_weight_block, bias, c.fp8_activations, static)

    def input_scale(self, name: str) -> torch.Tensor | None:
        """Static input scale ``name``'s one value ([1]: the largest of the parts it was loaded from), or
        None."""
        scales = getattr(self, name)
        return None if scales is None else scales.view(-1)[:1]

    def _mlp_out(self, down: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """The MLP's output as the next norm adds it: normed first where the model says so (Gemma 3)."""
        if self.mlp_out_norm is None:
            return down
        return ops.rms_norm(down, self.mlp_out_norm, self.config.rms_norm_eps)

    def _experts(self, h: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """A sparse layer's MLP output for h [T, H]: the router's top experts of each token, weighted, plus
        the shared expert, scaled by sigmoid(its gate) where it has one (this rank's part of each, summed by
        the caller)."""
        c = self.config
        logits = F.linear(h, self.router, self.router_bias)
        weights, ids = ops.moe_route(logits, c.experts_per_token, c.norm_topk_prob)
        out = ops.fused_moe(
            h, self.experts_gate_up, self.experts_down, weights, ids, b13=self.experts_gate_up_bias,
            b2=self.experts_down_bias if self.bias_here else None, activation=c.expert_activation,
            alpha=c.swiglu_alpha, limit=c.swiglu_limit, w13_scales=self.experts_gate_up_scales,
            w2_scales=self.experts_down_scales, fp8_block=c.fp8_weight_block if c.fp8_projections else None,
            fp8_activations=c.fp8_activations, w13_input_scale=self.input_scale("experts_gate_up_input_scale"),
            w2_input_scale=self.input_scale("experts_down_input_scale"),
        )  # fmt: skip
        if self.shared_gate_up is None:
            return out
        shared = F.linear(ops.silu_and_mul(F.linear(h, self.shared_gate_up)), self.shared_down)
        if self.shared_gate is None:
            return out + shared
        return out + shared * torch.sigmoid(F.linear(h, self.shared_gate))


# Gemma's four norms a layer, as this model names their places (post_attention_layernorm: the MLP's input)
_GEMMA_NORMS = {"post_attention_layernorm": "attn_out_norm", "pre_feedforward_layernorm": "post_attention_layernorm",
                "post_feedforward_layernorm": "mlp_out_norm"}  # fmt: skip
# what a stacked projection's (q/k/v, gate/up) weight, bias or kept fp8 scales fill: the layer's <group>_<this>
_STACKED_KINDS = {"weight": "proj", "bias": "bias", "weight_scale": "scale"}
# the place of each part's static input scale in its stacked projection's (DecoderLayer's *_input_scale)
_INPUT_SCALE_PLACE = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2, "mlp.gate_proj": 0,
                      "mlp.up_proj": 1}  # fmt: skip


_EXPERT_PART = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)")  # canonical names


class LlamaForCausalLM(nn.Module):
    """``forward(batch, kv_pool)`` -> float32 logits [B, vocab] (last new token per request), or
    [T, vocab] when ``batch.return_all_logits``, or one row per ``batch.logit_rows`` entry.
    ``kv_pool`` has per-layer ``k_cache``/``v_cache``. With a ``shard`` of size > 1 it is one rank
    of a tensor-parallel model (worker.model.shard): every rank runs the same batch in step, and
    each returns the whole logits."""

    def __init__(
        self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype, shard: Shard = WHOLE
    ) -> None:  # fmt: skip
        super().__init__()
        shard.check(config)
        device = torch.device(device)
        self.config, self.device, self.dtype, self.shard = config, device, dtype, shard
        w = {"device": device, "dtype": dtype}
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, **w)
        self.layers = nn.ModuleList(
            DecoderLayer(config, device, dtype, i, shard) for i in range(config.num_layers)
        )
        self.lora: list = []  # LoRA adapters served (worker.model.lora): request adapter id i is lora[i - 1]
        layer = self.layers[0]
        # NOTE: adapters of a mixture of experts are on attention only (worker.model.lora refuses the others)
        projs = ("qkv", "o") if config.num_experts else ("qkv", "o", "gate_up", "down")
        dims = {name: tuple(getattr(layer, f"{name}_proj").shape) for name in projs}
        self.lora_stack = LoraStack(dims, config.num_layers, device, dtype)  # their weights
        self.norm = _norm_weight(config.hidden_size, config, device, dtype)
        # NOTE: Gemma scales its embeddings by sqrt(hidden_size) rounded to the weights' dtype (34.0 in bf16 for
        # Gemma 3 1B's 33.94), as transformers and the original implementation do; Granite by its multiplier
        self.embedding_scale = config.embedding_multiplier
        if config.sandwich_norms:
            self.embedding_scale = float(torch.tensor(config.embedding_multiplier, dtype=dtype))
        self.vocab_lo, self.vocab_hi = shard.vocab_range(config.vocab_size)  # this rank's lm_head rows
        # NOTE: tied embeddings share one tensor; loading either name fills both.
        if config.tie_word_embeddings:
            self.lm_head = (
                self.embed_tokens[self.vocab_lo : self.vocab_hi] if shard.size > 1 else self.embed_tokens
            )
        else:
            self.lm_head = _weight(self.vocab_hi - self.vocab_lo, config.hidden_size, **w)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config, device), persistent=False)
        local = any(layer.uses_local_rope for layer in self.layers)
        local_cache = rope_cos_sin_cache(local_rope_config(config), device) if local else self.cos_sin_cache
        self.register_buffer("local_cos_sin_cache", local_cache, persistent=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: object) -> torch.Tensor:
        x = F.embedding(batch.input_ids, self.embed_tokens)
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        k_caches, v_caches = kv_pool.k_cache, kv_pool.v_cache  # type: ignore[attr-defined]
        delta = None
        for i, layer in enumerate(self.layers):
            cos_sin = self.local_cos_sin_cache if layer.uses_local_rope else self.cos_sin_cache
            x, delta = layer(x, delta, batch, k_caches[i], v_caches[i], cos_sin)
        rows = None
        if batch.logit_rows is not None:
            rows = batch.logit_rows
        elif not batch.return_all_logits and batch.mode == "extend":
            rows = batch.qo_indptr[1:].long() - 1
        if rows is not None:
            x = x[rows]
            delta = None if delta is None else delta[rows]
        ops = attention.kernel_ops(x.device)
        eps = self.config.rms_norm_eps
        x = (
            ops.rms_norm(x, self.norm, eps)
            if delta is None
            else ops.add_rms_norm(x, delta, self.norm, eps)[1]
        )
        logits = F.linear(x, self.lm_head).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return self.shard.gather_vocab(logits, self.config.vocab_size)

    def add_lora(self, adapter: object) -> int:
        """Serve a loaded LoRA adapter (worker.model.lora; its weights move into ``lora_stack``);
        returns its adapter id."""
        self.lora.append(adapter)
        self.lora_stack.add(len(self.lora), adapter)  # type: ignore[arg-type]
        return len(self.lora)

    def remove_lora(self, adapter_id: int) -> None:
        """Drop adapter ``adapter_id``'s weights (ids are never reused)."""
        self.lora[adapter_id - 1] = None
        self.lora_stack.remove(adapter_id)

    # ---- weights -------------------------------------------------------------------------------

    def weight_slot(self, name: str) -> torch.Tensor | None:
        """The parameter (or the rows of a stacked one) that HF weight ``name`` fills; None for
        names that carry nothing to load (rotary caches, a tied lm_head)."""
        c = self.config
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "model.embed_tokens.weight":
            return self.embed_tokens
        if name == "lm_head.weight":
            return None if c.tie_word_embeddings else self.lm_head
        if name == "model.norm.weight":
            return self.norm
        m = LAYER_WEIGHT.match(name)
        if m is None or int(m.group(1)) >= c.num_layers:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        layer: DecoderLayer = self.layers[int(m.group(1))]  # type: ignore[assignment]
        part, kind = m.group(2), m.group(3)
        q, kv, inter = layer.q_size, layer.kv_size, layer.inter  # this rank's sizes
        if layer.sparse and part.startswith("mlp."):
            target = self._expert_slot(layer, part, kind)
            if target is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            return target
        stacked = {
            "self_attn.q_proj": ("qkv", 0, q),
            "self_attn.k_proj": ("qkv", q, q + kv),
            "self_attn.v_proj": ("qkv", q + kv, q + 2 * kv),
            "mlp.gate_proj": ("gate_up", 0, inter),
            "mlp.up_proj": ("gate_up", inter, 2 * inter),
        }
        if c.sandwich_norms:  # NOTE: Gemma's post_attention_layernorm is on the attention's output
            part = _GEMMA_NORMS.get(part, part)
        single = {
            ("input_layernorm", "weight"): layer.input_layernorm,
            ("post_attention_layernorm", "weight"): layer.post_attention_layernorm,
            ("attn_out_norm", "weight"): layer.attn_out_norm,
            ("mlp_out_norm", "weight"): layer.mlp_out_norm,
            ("self_attn.o_proj", "weight"): layer.o_proj,
            ("self_attn.o_proj", "bias"): layer.o_bias,
            ("self_attn.q_norm", "weight"): layer.q_norm,
            ("self_attn.k_norm", "weight"): layer.k_norm,
            ("mlp.down_proj", "weight"): layer.down_proj,
            ("mlp.down_proj", "bias"): layer.down_bias,
            ("self_attn.o_proj", "weight_scale"): layer.o_scale,
            ("mlp.down_proj", "weight_scale"): layer.down_scale,
            ("self_attn.o_proj", "input_scale"): layer.o_input_scale,
            ("mlp.down_proj", "input_scale"): layer.down_input_scale,
            ("self_attn", "sinks"): layer.sinks,
            **({("self_attn", "k_scale"): layer.kv_pool_scale[0],
                ("self_attn", "v_scale"): layer.kv_pool_scale[1]} if layer.kv_pool_scale is not None else {}),
        }  # fmt: skip
        if part in stacked and kind == "input_scale":
            target = getattr(layer, f"{stacked[part][0]}_input_scale")
            if target is not None:
                return target[_INPUT_SCALE_PLACE[part]].view(1)
        elif part in stacked and kind in _STACKED_KINDS:
            group, start, end = stacked[part]
            target = getattr(layer, f"{group}_{_STACKED_KINDS[kind]}")
            # NOTE: a kept fp8 projection's scales, one a block of rows (served_fp8: parts in whole blocks)
            per = rows_per_entry(c, kind)
            if target is not None:
                return target[start // per : end // per]
        elif single.get((part, kind)) is not None:
            return single[(part, kind)]
        raise ValueError(f"unexpected weight {name!r} in checkpoint")

    def _expert_slot(self, layer: DecoderLayer, part: str, kind: str) -> torch.Tensor | None:
        """What a sparse layer's ``mlp.*`` weight or bias ``part`` fills (canonical names, as
        checkpoint.canonical_weights gives them)."""
        inter, shared = layer.inter, layer.shared_inter
        m = _EXPERT_PART.fullmatch(part)
        if m is not None:
            e = int(m.group(1))
            if e >= self.config.num_experts:
                return None
            # NOTE: MXFP4 experts' scales come as "scales", fp8 ones' (kept, --fp8-weights) as "weight_scale"
            scales, c = (layer.experts_gate_up_scales, layer.experts_down_scales), self.config
            gate_up, down = {
                "weight": (layer.experts_gate_up, layer.experts_down),
                "bias": (layer.experts_gate_up_bias, layer.experts_down_bias),
                "scales": scales if c.mxfp4_experts else (None, None),
                "weight_scale": scales if c.fp8_projections else (None, None),
                "input_scale": (layer.experts_gate_up_input_scale, layer.experts_down_input_scale),
            }[kind]
            if gate_up is None:
                return None
            if m.group(2) == "down_proj":
                return down[e]
            if kind == "input_scale":  # NOTE: the gate's, then the up's
                return gate_up[e, int(m.group(2) == "up_proj")].view(1)
            # NOTE: fp8 block scales: one a block of rows (served_fp8: the gate and up parts are whole blocks)
            per = rows_per_entry(c, kind)
            start = 0 if m.group(2) == "gate_proj" else inter
            return gate_up[e, start // per : (start + inter) // per]
        if kind != "weight":
            return layer.router_bias if (part, kind) == ("mlp.gate", "bias") else None
        slots = {"mlp.gate": layer.router}
        if layer.shared_gate_up is not None:
            slots.update({
                "mlp.shared_expert.gate_proj": layer.shared_gate_up[:shared],
                "mlp.shared_expert.up_proj": layer.shared_gate_up[shared:],
                "mlp.shared_expert.down_proj": layer.shared_down,
                **({"mlp.shared_expert_gate": layer.shared_gate} if layer.shared_gate is not None else {}),
            })  # fmt: skip
        return slots.get(part)

    def settle_scales(self) -> None:
        """What the forward reads of the loaded scales, settled once: each static input scale holds the
        largest of its parts' in every place (DecoderLayer.input_scale reads the first); each layer's KV
        scales are checked here, once (the kernels never read them on the host): ValueError naming a layer
        whose scales are not all positive and finite."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("input_scale"):  # NOTE: present under --fp8-activations static only
                    p.fill_(p.amax())
        for i, layer in enumerate(self.layers):
            scales = layer.kv_pool_scale
            if scales is not None and not bool(torch.isfinite(scales).all() and (scales > 0).all()):
                raise ValueError(
                    f"layer {i}'s KV scales (k_scale, v_scale) must be positive and finite, got {scales.tolist()}"
                )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to this model's dtype and device). Raises ValueError on
        an unknown or repeated name, a shape mismatch, or when any parameter was left unfilled (naming
        the weights missing)."""
        filled, seen = 0, set()
        stream = canonical_weights(weights, self.config, self.dtype)
        if self.config.fp8_projections and not self.config.fp8_weights:  # NOTE: --quantization fp8
            stream = quantized_at_load(stream)
        for name, tensor in stream:
            target = self.weight_slot(name)
            if target is None:
                continue
            if name in seen:  # NOTE: a second copy would hide a missing weight from the count
                raise ValueError(f"weight {name!r} appears twice in the checkpoint")
            seen.add(name)
            tensor = self.shard.weight(self.config, name, tensor)
            # NOTE: a slot kept in fp8 takes fp8 only: a cast would round
            if target.dtype == torch.float8_e4m3fn and tensor.dtype != target.dtype:
                raise ValueError(
                    f"weight {name!r} is {tensor.dtype} in the checkpoint, not fp8 (e4m3) as --fp8-weights fp8 "
                    "keeps it; serve the checkpoint with --fp8-weights dequantized"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
            filled += target.numel()
        expected = sum(p.numel() for p in self.parameters())
        if filled != expected:
            missing = [n for n in self._weight_names() if n not in seen]
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weights: {shown or 'unknown'}")
        self.settle_scales()
        if self.config.norm_offset:  # NOTE: Gemma stores each RMSNorm weight as w for a scale of 1 + w
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if name.endswith("norm"):  # every norm: input_layernorm ... q_norm, the final one
                        p.add_(1.0)
        r = self.config.residual_multiplier
        if r != 1.0:  # NOTE: Granite scales each layer's output before its residual add: folded in here
            with torch.no_grad():
                # NOTE: a projection kept in fp8 is scaled through its scales (a cast of fp8 would round)
                kept = self.config.fp8_projections
                for layer in self.layers:
                    o, down = (layer.o_scale, layer.down_scale) if kept else (layer.o_proj, layer.down_proj)
                    experts_down = layer.experts_down_scales if kept else layer.experts_down
                    for p in (o, layer.o_bias, down, layer.down_bias, experts_down, layer.shared_down):
                        if p is not None:
                            p.mul_(r)

    def _weight_names(self) -> list[str]:
        """The HF names of every weight this model loads."""
        parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                 "self_attn.k_norm", "mlp.gate", "mlp.shared_expert_gate", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm",
                 *(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
                 *(f"mlp.experts.{e}.{p}" for e in range(self.config.num_experts)
                   for p in ("gate_proj", "up_proj", "down_proj")))  # fmt: skip
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        names += [f"model.layers.{i}.self_attn.{kind}" for i in range(self.config.num_layers)
                  for kind in ("sinks", "k_scale", "v_scale")]  # fmt: skip
        names += [f"model.layers.{i}.{p}.{k}" for i in range(self.config.num_layers) for p in parts
                  for k in ("weight", "bias", "scales", "weight_scale", "input_scale")]  # fmt: skip
        out = []
        for name in names:
            with contextlib.suppress(ValueError):
                if self.weight_slot(name) is not None:
                    out.append(name)
        return out
