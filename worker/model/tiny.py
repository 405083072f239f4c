"""The built-in ``tiny`` model: a small Llama with seeded random weights and the byte tokenizer.

Same weights on every start and every device (generated on CPU from a fixed seed); it is for
demos, tests and benchmarks of the serving stack, never for output quality.
"""

from __future__ import annotations

import torch

from router.tokenization import ByteTokenizer
from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.shard import WHOLE, Shard

TINY_SEED = 20240601
# NOTE: residual dimension 0 carries a constant through every layer and the lm_head reads it as
# a per-token bias: printable ASCII is preferred, other bytes are pushed down, EOS is rare.
_BIAS_DIM = 0
_SUCCESSOR_WEIGHT = 1.0


def tiny_config() -> ModelConfig:
    tok = ByteTokenizer()
    return ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,  # tokens
        tie_word_embeddings=False,
        model_type="llama",
        eos_token_ids=list(tok.eos_token_ids),
    )


def tiny_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named float32 weights, the same for the same config on every call."""
    gen = torch.Generator().manual_seed(TINY_SEED)
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def normal(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    embed = torch.randn(config.vocab_size, h, generator=gen)
    embed[:, _BIAS_DIM] = h**0.5
    weights = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        o_proj, down_proj = normal(h, q), normal(h, inter)
        o_proj[_BIAS_DIM] = 0.0  # layers never write the bias dimension
        down_proj[_BIAS_DIM] = 0.0
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": o_proj,
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": down_proj,
        }
    printable = torch.zeros(config.vocab_size, dtype=torch.bool)
    printable[32:127] = True
    printable[ord("\n")] = True
    # A successor per token, one long cycle through the printable bytes (the residual stream
    # still holds the current token's embedding): greedy decoding does not lock onto a short loop.
    order = printable.nonzero().flatten()[torch.randperm(int(printable.sum()), generator=gen)]
    successor = order[torch.randint(len(order), (config.vocab_size,), generator=gen)]
    successor[order] = order.roll(-1)
    lm_head = normal(config.vocab_size, h)
    lm_head.index_add_(0, successor, _SUCCESSOR_WEIGHT * embed / h**0.5)
    lm_head[:, _BIAS_DIM] = torch.where(printable, 0.0, -1.0)
    lm_head[ByteTokenizer.EOS, _BIAS_DIM] = -0.3
    weights["lm_head.weight"] = lm_head
    return weights


def build_tiny(
    device: torch.device | str, dtype: torch.dtype, shard: Shard = WHOLE, config: ModelConfig | None = None
) -> LlamaForCausalLM:
    """The tiny model (``config``: tiny_config, its context capped or not: the weights are the same)."""
    config = config or tiny_config()
    model = LlamaForCausalLM(config, device, dtype, shard)
    model.load_weights(tiny_weights(config).items())
    return model
