"""Tensor parallelism inside the model: which part of each weight a rank holds, and the two
collectives a sharded forward needs.

Megatron-style split over ``size`` ranks: q/k/v and gate/up are split by output rows (attention
heads, intermediate units), o_proj and down_proj by input columns, so each layer needs one sum
over ranks after o_proj and one after down_proj; a mixture of experts splits every expert (and the
shared one) so, its router whole on every rank (MXFP4 experts in whole 32-unit blocks: as equal shares as
blocks allow, the first ranks a block more where they do not divide, e.g. 23, 23, 22, 22 of gpt-oss's 90
over 4 ranks; the sum over ranks does not need equal parts). Projections kept in fp8 take their scales'
rows or blocks with their weights' rows and columns. Attention sinks
go with their heads. The lm_head is split by vocabulary rows and the logits gathered. Embedding and
norms are whole on every rank. Each rank's KV pool holds its own KV heads only. ``Shard()`` (size 1) is the unsharded model: every method is then the identity.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig


def rows_per_entry(config: ModelConfig, kind: str) -> int:
    """Weight rows one row of a ``kind`` tensor covers: a projection kept in fp8 with block scales
    (``weight_scale``, --fp8-weights) one a block of rows; any other tensor one a row."""
    return config.fp8_weight_block[0] if kind == "weight_scale" and config.fp8_weight_block else 1


_LAYER_WEIGHT = re.compile(r"model\.layers\.\d+\.(.+)\.(weight|bias|sinks|scales|weight_scale|[kv]_scale)$")
# HF projection -> how its weight is split: by output rows of which size, or by input columns
_ROWS = {
    "self_attn.q_proj": "heads",
    "self_attn.k_proj": "kv_heads",
    "self_attn.v_proj": "kv_heads",
    "mlp.gate_proj": "intermediate",
    "mlp.up_proj": "intermediate",
    "mlp.experts.gate_proj": "moe_intermediate",  # every expert (its number taken out of the name)
    "mlp.experts.up_proj": "moe_intermediate",
    "mlp.shared_expert.gate_proj": "shared_intermediate",
    "mlp.shared_expert.up_proj": "shared_intermediate",
}
_COLUMNS = {"self_attn.o_proj": "heads", "mlp.down_proj": "intermediate", "mlp.experts.down_proj": "moe_intermediate",
            "mlp.shared_expert.down_proj": "shared_intermediate"}  # fmt: skip
_EXPERT = re.compile(r"\.experts\.\d+\.")
_SIZES = {"heads": "num_heads", "kv_heads": "num_kv_heads", "intermediate": "intermediate_size",
          "moe_intermediate": "moe_intermediate_size", "shared_intermediate": "shared_expert_intermediate_size"}  # fmt: skip


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group of the ranks (None when size is 1)

    def check(self, config: ModelConfig) -> None:
        """ValueError unless ``config`` splits evenly over ``size`` ranks (MXFP4 experts: at least a
        32-unit block each)."""
        blocks = config.moe_intermediate_size // 32
        # NOTE: a dense MLP's width only where some layer has one (an all-sparse MoE's is unused)
        dense = any(not config.is_sparse(i) for i in range(config.num_layers))
        for what, n in (
            ("num_attention_heads", config.num_heads),
            ("num_key_value_heads", config.num_kv_heads),
            ("intermediate_size", config.intermediate_size if dense else 0),
            ("moe_intermediate_size", 0 if config.mxfp4_experts else config.moe_intermediate_size),
            ("shared_expert_intermediate_size", config.shared_expert_intermediate_size),
        ):
            if n % self.size:
                raise ValueError(
                    f"--tensor-parallel-size {self.size} does not divide the model's {what} ({n})"
                )
        if config.mxfp4_experts and blocks < self.size:
            raise ValueError(
                f"MXFP4 experts split over {self.size} ranks need a 32-unit block each; moe_intermediate_size "
                f"{config.moe_intermediate_size} has {blocks}: serve them with --mxfp4-experts dequantized"
            )

    def span(self, config: ModelConfig, what: str) -> tuple[int, int]:
        """This rank's units [lo, hi) of ``heads``, ``kv_heads``, ``intermediate``, ``moe_intermediate``
        (one expert's) or ``shared_intermediate``: equal parts, but MXFP4 experts' in whole 32-unit blocks
        (the first ranks a block more where the blocks do not divide)."""
        total = getattr(config, _SIZES[what])
        if what == "moe_intermediate" and config.mxfp4_experts:
            per, extra = divmod(total // 32, self.size)
            lo = 32 * (self.rank * per + min(self.rank, extra))
            return lo, lo + 32 * (per + (self.rank < extra))
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n

    def local(self, config: ModelConfig, what: str) -> int:
        """This rank's count of ``what``'s units (``span``'s)."""
        lo, hi = self.span(config, what)
        return hi - lo

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's lm_head rows [lo, hi): equal parts of ceil(vocab / size), the last shorter."""
        per = -(-vocab_size // self.size)
        lo = min(vocab_size, self.rank * per)
        return lo, min(vocab_size, lo + per)

    def weight(self, config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of HF weight ``name`` (the whole tensor) this rank holds."""
        if self.size == 1:
            return tensor
        if name == "lm_head.weight":
            lo, hi = self.vocab_range(config.vocab_size)
            return tensor[lo:hi]
        m = _LAYER_WEIGHT.match(name)
        if m is None:
            return tensor
        part, kind = _EXPERT.sub(".experts.", m.group(1)), m.group(2)
        if kind == "sinks":  # NOTE: one per query head (gpt-oss)
            lo, hi = self.span(config, "heads")
            return tensor[lo:hi]
        if kind in ("k_scale", "v_scale"):  # NOTE: an fp8 pool's, one per KV head (the loader's [kv_heads])
            lo, hi = self.span(config, "kv_heads")
            return tensor[lo:hi]
        unit = config.head_dim if _ROWS.get(part, _COLUMNS.get(part)) in ("heads", "kv_heads") else 1
        # NOTE: a projection kept in fp8 (--fp8-weights): its scales one a block of rows x columns (the
        # loader keeps it only where every rank's span is whole blocks), else one a row
        cols = config.fp8_weight_block[1] if config.fp8_weight_block else 0
        if part in _ROWS:
            lo, hi = self.span(config, _ROWS[part])
            per = rows_per_entry(config, kind)
            return tensor[lo * unit // per : hi * unit // per]
        if part in _COLUMNS and kind == "weight_scale":
            lo, hi = self.span(config, _COLUMNS[part])
            return tensor[:, lo * unit // cols : hi * unit // cols] if cols else tensor
        if part in _COLUMNS and kind in ("weight", "scales"):
            lo, hi = self.span(config, _COLUMNS[part])
            # NOTE: MXFP4: one scale a block of 32 columns, two codes a byte (spans are whole blocks)
            per = 32 if kind == "scales" else 2 if tensor.dtype == torch.uint8 else 1
            return tensor[:, lo * unit // per : hi * unit // per]
        return tensor  # norms, and o_proj / down_proj biases (added once, after the sum)

    def lora(
        self, config: ModelConfig, proj: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA pair for stacked projection ``proj`` (A [R, in], B [out, R],
        whole): B's rows of the outputs this rank computes (qkv, gate_up), or A's columns of the
        inputs it holds (o, down: each rank's delta is then a part of the sum, like its output)."""
        if self.size == 1:
            return a, b
        d = config.head_dim
        if proj == "qkv":
            q, kv = config.num_heads * d, config.num_kv_heads * d
            spans = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
        elif proj == "gate_up":
            n = config.intermediate_size
            spans = [(0, n), (n, 2 * n)]
        else:
            n = a.shape[1] // self.size
            return a[:, self.rank * n : (self.rank + 1) * n], b
        rows = []
        for lo, hi in spans:
            n = (hi - lo) // self.size
            rows.append(b[lo + self.rank * n : lo + (self.rank + 1) * n])
        return a, torch.cat(rows)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over ranks (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's logit columns side by side: [N, vocab_size]."""
        if self.size == 1:
            return logits
        import torch.distributed as dist

        per = -(-vocab_size // self.size)
        logits = F.pad(logits, (0, per - logits.shape[1])).contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=1)[:, :vocab_size]


WHOLE = Shard()  # the unsharded model
