"""LoRA adapters served beside their base model: each request names the base or one adapter, and a
batch mixes them.

An adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors) for the base's
q/k/v/o and gate/up/down projections. A targeted projection's output for a request of adapter a
gains ``scale_a * (x @ A_a^T) @ B_a^T`` (A: [r, in], B: [out, r], scale = lora_alpha / r, or
lora_alpha / sqrt(r) with rslora), computed for that adapter's rows of the batch only; the base
weights are never changed, so base requests in the same batch are untouched.

``LoraBatch`` is what one forward needs: for each adapter present, the rows (new tokens) of its
requests; each adapter's weights are read once per step, in a few small products per projection
(python -m worker.bench_lora measures what that costs as adapters per step grow). The KV a request
computes depends on its adapter, so the radix cache keeps each adapter's prefixes apart
(worker.radix_node.adapter_keys) and routers see them as separate models. Adapters can be added
and removed between steps (``add_adapter`` / ``remove_adapter``, on the engine thread).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

# PEFT's target name -> (our stacked projection, which part of its output rows)
TARGETS = {
    "q_proj": ("qkv", "q"),
    "k_proj": ("qkv", "k"),
    "v_proj": ("qkv", "v"),
    "o_proj": ("o", None),
    "gate_proj": ("gate_up", "gate"),
    "up_proj": ("gate_up", "up"),
    "down_proj": ("down", None),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
MAX_ADAPTERS = 2047  # adapter ids 1..2047 (worker.radix_node.ADAPTER_SHIFT keeps them apart in the cache)


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scale: float
    path: str = ""  # the PEFT directory it was read from
    # (layer, projection) -> (A [R, in], B [out, R]) with B scaled: the projection's whole output
    # gains (x @ A^T) @ B^T. A stacked projection (qkv, gate_up) concatenates its parts' A along R
    # and places their B block-diagonally, so each part sees only its own A.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class LoraBatch:
    """One forward's adapters: for each adapter present, the rows (new tokens) of its requests
    (int64 on the model's device)."""

    groups: list[tuple[LoraAdapter, torch.Tensor]]
    host: list[list[int]] | None = None  # the same rows on the host, group by group (for the other TP ranks)

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (= the base projection of ``x``) plus each adapter's delta on its rows."""
        for adapter, rows in self.groups:
            ab = adapter.weights.get((layer, proj))
            if ab is not None:
                out = out.index_add(0, rows, (x.index_select(0, rows) @ ab[0].t()) @ ab[1].t())
        return out


def lora_batch(
    adapters: list[LoraAdapter], per_request: list[int], qo_indptr: list[int], device: torch.device
) -> LoraBatch | None:
    """Rows of each adapter's requests (``per_request[i]``: request i's adapter id, 0 = the base,
    i = ``adapters[i - 1]``); None when every request is the base's."""
    rows: dict[int, list[int]] = {}
    for i, a in enumerate(per_request):
        if a:
            rows.setdefault(a, []).extend(range(qo_indptr[i], qo_indptr[i + 1]))
    if not rows:
        return None
    from worker.sampling import on_device

    # NOTE: through pinned memory: a step scheduled ahead builds this while the step before runs
    groups = [(adapters[a - 1], on_device(r, torch.device(device), torch.long)) for a, r in rows.items()]
    return LoraBatch(groups, host=list(rows.values()))


def load_adapter(name: str, path: str, model: torch.nn.Module) -> LoraAdapter:
    """A PEFT LoRA directory for ``model`` (its device and dtype). ValueError names what does not fit."""
    from safetensors.torch import load_file

    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ValueError(
            f"adapter {name!r}: cannot read {path}/adapter_config.json ({exc.strerror})"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"adapter {name!r}: adapter_config.json is not JSON ({exc})") from None
    r = config.get("r") if isinstance(config, dict) else None
    if type(r) is not int or r <= 0 or not isinstance(config.get("lora_alpha", r), (int, float)):
        raise ValueError(
            f"adapter {name!r}: adapter_config.json needs a positive integer 'r' and a numeric 'lora_alpha'"
        )
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: only LoRA adapters are supported, not {config.get('peft_type')}")
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out") or config.get("use_dora"):
        raise ValueError(f"adapter {name!r}: LoRA biases, fan_in_fan_out and DoRA are not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(weights_path):
        raise ValueError(f"adapter {name!r}: no adapter_model.safetensors in {path}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        tensors = load_file(weights_path)
    except Exception as exc:  # NOTE: safetensors raises its own error type for a damaged file
        raise ValueError(f"adapter {name!r}: cannot read {weights_path}: {exc}") from None
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(
                f"adapter {name!r}: unsupported weight {key!r} (LoRA on q/k/v/o/gate/up/down only)"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    c = model.config  # type: ignore[attr-defined]
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    rows = {
        "q": (0, q),
        "k": (q, q + kv),
        "v": (q + kv, q + 2 * kv),
        "gate": (0, inter),
        "up": (inter, 2 * inter),
    }
    inputs = {"qkv": c.hidden_size, "o": q, "gate_up": c.hidden_size, "down": inter}
    outputs = {"o": c.hidden_size, "down": c.hidden_size}
    adapter = LoraAdapter(name, rank, scale, path)
    dev, dtype = model.device, model.dtype  # type: ignore[attr-defined]
    parts: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"} or layer >= c.num_layers:
            raise ValueError(
                f"adapter {name!r}: layer {layer} {target} needs lora_A and lora_B of a base layer"
            )
        proj, part = TARGETS[target]
        start, end = rows[part] if part else (0, outputs[proj])
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, inputs[proj]) or b.shape != (end - start, rank):
            raise ValueError(
                f"adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"the base needs A ({rank}, {inputs[proj]}), B ({end - start}, {rank})"
            )
        parts.setdefault((layer, proj), []).append((start, end, a, b))
    for key, found in parts.items():
        width = outputs.get(key[1]) or {"qkv": q + 2 * kv, "gate_up": 2 * inter}[key[1]]
        stacked_b = torch.zeros(width, rank * len(found))
        for n, (start, end, _, b) in enumerate(found):
            stacked_b[start:end, n * rank : (n + 1) * rank] = b.float() * scale
        stacked_a = torch.cat([a.float() for _, _, a, _ in found])
        # NOTE: one rank of a tensor-parallel model keeps the part its projection computes
        stacked_a, stacked_b = model.shard.lora(c, key[1], stacked_a, stacked_b)  # type: ignore[attr-defined]
        adapter.weights[key] = (stacked_a.to(dev, dtype), stacked_b.to(dev, dtype))
    if not adapter.weights:
        raise ValueError(f"adapter {name!r}: no LoRA weights in {weights_path}")
    return adapter


class AdapterBusyError(RuntimeError):
    """An adapter with requests queued or running cannot be unloaded."""


def check_room(model: Any, adapters: int) -> None:
    """ValueError unless ``adapters`` adapters over a worker's life fit the cache's key ranges."""
    from worker.radix_node import ADAPTER_SHIFT

    if adapters > MAX_ADAPTERS:
        raise ValueError(f"at most {MAX_ADAPTERS} LoRA adapters can be loaded over a worker's life")
    if model.config.vocab_size > 1 << ADAPTER_SHIFT:
        raise ValueError(f"LoRA adapters need a vocabulary below {1 << ADAPTER_SHIFT} tokens")


def add_adapter(engine: Any, adapter: LoraAdapter) -> int:
    """Serve a loaded adapter from the next step (engine thread): its id, cache namespace, name."""
    model = engine.executor.model
    check_room(model, len(engine.adapter_names) + 1)
    model.add_lora(adapter)
    engine.cache.add_namespace(adapter.name)
    engine.adapter_names.append(adapter.name)
    return len(engine.adapter_names)


def remove_adapter(engine: Any, name: str) -> int:
    """Stop serving adapter ``name`` (engine thread): its weights and its cached pages go (their
    removal events tell routers); returns the pages freed. Its id is never reused."""
    adapter_id = engine.adapter_names.index(name) + 1
    sched = engine.scheduler
    busy = sum(r.adapter == adapter_id for r in (*sched.waiting, *sched.prefilling, *sched.running))
    if busy:
        raise AdapterBusyError(
            f"LoRA adapter {name!r} has {busy} requests queued or running; retry when they finish"
        )
    engine.adapter_names[adapter_id - 1] = None
    engine.executor.model.remove_lora(adapter_id)
    return engine.cache.drop_namespace(adapter_id)
