"""LoRA adapters served beside their base model: each request names the base or one adapter, and a
batch mixes them.

An adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors) for the base's
q/k/v/o and gate/up/down projections. A targeted projection's output for a request of adapter a
gains ``scale_a * (x @ A_a^T) @ B_a^T`` (A: [r, in], B: [out, r], scale = lora_alpha / r, or
lora_alpha / sqrt(r) with rslora), computed for that adapter's rows of the batch only; the base
weights are never changed, so base requests in the same batch are untouched.

The adapters' weights live in a ``LoraStack`` (one tensor pair per projection, a slot per adapter), and
``LoraBatch`` is what one forward needs: each request's slot and rows. On a GPU the deltas of a whole
batch are two Triton launches per projection however many adapters it mixes (kernels/lora.py); on the
CPU they are a pair of matmuls per adapter in the batch (python -m worker.bench_lora measures both).
The KV a request computes depends on its adapter, so the radix cache keeps each adapter's prefixes apart
(worker.radix_node.adapter_keys) and routers see them as separate models. Adapters can be added
and removed between steps (``add_adapter`` / ``remove_adapter``, on the engine thread).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kernels import reference
from worker.attention import kernel_ops
from worker.cache_salt import FIRST_SALT_SPACE

# PEFT's target name -> (our stacked projection, which part of its output rows)
TARGETS = {
    "q_proj": ("qkv", "q"),
    "k_proj": ("qkv", "k"),
    "v_proj": ("qkv", "v"),
    "o_proj": ("o", None),
    "gate_proj": ("gate_up", "gate"),
    "up_proj": ("gate_up", "up"),
    "down_proj": ("down", None),
    "qkv_proj": ("qkv", "qkv"),  # Phi-3's fused projections: all of their rows
    "gate_up_proj": ("gate_up", "gate_up"),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}  # PEFT targets stacked in each projection
MAX_ADAPTERS = (
    FIRST_SALT_SPACE - 1
)  # adapter ids 1..1791 (radix_node.ADAPTER_SHIFT; cache salts use the rest)
log = logging.getLogger("worker.engine")


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
    # what was read from ``path`` (adapter_config.json, the safetensors), until the adapter is stacked:
    # the other ranks of a tensor-parallel worker take their parts of these, not of the files again
    files: tuple[dict, dict[str, torch.Tensor]] | None = None


class LoraStack:
    """Every served adapter's weights in one pair of tensors per stacked projection, what
    kernels.ops.lora_add reads: A [layers, slots, R, in] and B [layers, slots, out, R] (this rank's
    parts). R is the largest rank an adapter has on that projection (q/k/v and gate/up stack their
    parts' ranks); an adapter with a smaller rank, or without that projection in a layer, is zero
    there. A removed adapter's slot is reused. Adding an adapter that needs more slots or rank than
    the tensors have reallocates them (``version`` counts that: a CUDA graph keeps their addresses)."""

    def __init__(
        self, dims: dict[str, tuple[int, int]], layers: int, device: torch.device, dtype: torch.dtype
    ):
        self.dims = dims  # projection -> (out, in) of this rank's base weight
        self.layers, self.device, self.dtype = layers, device, dtype
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.slots = 0
        self.version = 0

    def add(self, adapter_id: int, adapter: LoraAdapter) -> None:
        """Stack ``adapter``'s weights in a free slot; the stack takes them (``adapter.weights`` is emptied)."""
        used = set(self.slot_of.values())
        slot = next(i for i in range(self.slots + 1) if i not in used)
        ranks: dict[str, int] = {}
        for (_, proj), (a, _) in adapter.weights.items():
            ranks[proj] = max(ranks.get(proj, 0), a.shape[0])
        self._grow(max(self.slots, slot + 1), ranks)
        for proj in self.a:  # NOTE: both: a zero A row times a B left non-finite would still be NaN
            self.a[proj][:, slot].zero_()
            self.b[proj][:, slot].zero_()
        for (layer, proj), (a, b) in adapter.weights.items():
            self.a[proj][layer, slot, : a.shape[0]] = a
            self.b[proj][layer, slot, :, : b.shape[1]] = b
        adapter.weights.clear()
        adapter.files = None
        self.slot_of[adapter_id] = slot

    def slots_of(self, adapter_ids: Sequence[int]) -> list[int]:
        """Each adapter id's slot, -1 for 0 (the base model)."""
        return [self.slot_of[a] if a else -1 for a in adapter_ids]

    def reserve(self, slots: int, rank: int) -> None:
        """Room for ``slots`` adapters of rank up to ``rank`` on every projection (q/k/v and gate/up
        stack their parts' ranks), so adding them later moves no tensor (``version`` unchanged)."""
        self._grow(max(self.slots, slots), {proj: rank * PARTS[proj] for proj in self.dims})

    def nbytes(self) -> int:
        """Bytes the stacked weights take on the device."""
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def remove(self, adapter_id: int) -> None:
        """Free ``adapter_id``'s slot (cleared when the next adapter takes it)."""
        self.slot_of.pop(adapter_id, None)

    def _grow(self, slots: int, ranks: dict[str, int]) -> None:
        """Make room for ``slots`` slots everywhere and for ``ranks`` on their projections."""
        for proj in sorted(set(self.a) | set(ranks)):
            old_a, old_b = self.a.get(proj), self.b.get(proj)
            have = 0 if old_a is None else old_a.shape[2]
            rank = max(have, ranks.get(proj, 0))
            if old_a is not None and old_a.shape[1] == slots and have == rank:
                continue
            out, inp = self.dims[proj]
            w = {"device": self.device, "dtype": self.dtype}
            self.a[proj] = torch.zeros(self.layers, slots, rank, inp, **w)
            self.b[proj] = torch.zeros(self.layers, slots, out, rank, **w)
            if old_a is not None and old_b is not None:
                self.a[proj][:, : old_a.shape[1], :have] = old_a
                self.b[proj][:, : old_b.shape[1], :, :have] = old_b
            self.version += 1
        self.slots = slots

    def apply(
        self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch
    ) -> torch.Tensor:
        """``out`` (the base projection of ``x``, updated in place) plus each request's adapter delta."""
        a = self.a.get(proj)
        if a is None:
            return out
        ops = kernel_ops(x.device)
        if ops is reference:  # NOTE: the batch's rows of each adapter, worked out once per forward
            groups = batch.groups
            if groups is None:
                groups = reference.lora_rows(batch.indptr, batch.slots, batch.max_rows)
                batch.groups = groups if batch.fixed else None
            return reference.lora_add_rows(x, out, a[layer], self.b[proj][layer], groups)
        return ops.lora_add(x, out, a[layer], self.b[proj][layer], batch.indptr, batch.slots, batch.max_rows)


@dataclass
class LoraBatch:
    """One forward's adapters: the segments of its rows (requests, neighbours of one adapter joined)
    and each one's slot in ``stack`` (-1: the base model)."""

    stack: LoraStack
    slots: torch.Tensor  # int32 [B] on the model's device: each segment's slot (-1: the base model)
    indptr: torch.Tensor  # int32 [B + 1]: segment i's rows (kernels.reference.lora_segments)
    max_rows: int  # most rows of any segment
    adapters: list[int]  # each request's adapter id (0: the base), on the host (for the other TP ranks)
    fixed: bool = True  # False: ``slots`` is rewritten between forwards (a CUDA graph's static input)
    groups: list | None = None  # the torch reference path's (slot, rows) pairs, once it has worked them out

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (= the base projection of ``x``) plus each adapter's delta on its rows."""
        return self.stack.apply(layer, proj, x, out, self)


def lora_batch(
    stack: LoraStack,
    per_request: list[int],
    qo_indptr: np.ndarray | torch.Tensor,
    max_rows: int | None = None,
) -> LoraBatch | None:
    """The LoRA part of a forward whose request i is of adapter ``per_request[i]`` (0 = the base) and
    owns rows ``qo_indptr[i]:qo_indptr[i + 1]`` (the scheduler's host array; a tensor is read back),
    ``max_rows``: the most rows of any request (read from ``qo_indptr`` when not given); None when
    every request is the base's. Neighbouring requests of one adapter share segments
    (kernels.reference.lora_segments)."""
    if not any(per_request):
        return None
    from worker.sampling import on_device

    host = qo_indptr.cpu().numpy() if isinstance(qo_indptr, torch.Tensor) else np.asarray(qo_indptr)
    if max_rows is None:
        max_rows = int(np.diff(host).max(initial=0))
    cap = max(max_rows, reference.LORA_BLOCK_ROWS)  # NOTE: row blocks per segment stay cdiv(max_rows, 16)
    seg_indptr, seg_slots = reference.lora_segments(stack.slots_of(per_request), host, cap)
    # NOTE: through pinned memory: a step scheduled ahead builds this while the step before runs
    slots = on_device(seg_slots, stack.device, torch.int32)
    return LoraBatch(stack, slots, on_device(seg_indptr, stack.device, torch.int32), cap, list(per_request))


def load_adapter(
    name: str, path: str, model: torch.nn.Module, files: tuple[dict, dict[str, torch.Tensor]] | None = None
) -> LoraAdapter:
    """A PEFT LoRA directory for ``model`` (its device and dtype); ``files``: what another rank read
    from it (``LoraAdapter.files``). ValueError names what does not fit."""
    config, tensors = read_adapter(name, path) if files is None else files
    adapter = _adapter(name, path, model, config, tensors)
    adapter.files = (config, tensors)
    return adapter


PEFT_DEFAULT_ALPHA = 8  # PEFT's LoraConfig.lora_alpha where a config leaves it out
# PEFT's settings that change what an adapter computes at inference, beyond LoRA's own product: served as a plain
# LoRA they would answer wrong, so an adapter that sets one is refused, naming it
UNSERVED_SETTINGS = {
    "alora_invocation_tokens": "activated LoRA (aLoRA: the adapter applies from its invocation tokens on)",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
    "layer_replication": "layer replication",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "whole modules saved beside the adapter",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on parameters (as MoE experts' stacked weights)",
    "arrow_config": "Arrow routing among adapters",
    "kasa_config": "KaSA's singular-value adaptation",
    "monteclora_config": "MonteCLoRA",
}


def read_adapter(name: str, path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the LoRA tensors of a PEFT directory, as read (ValueError: what is wrong)."""
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
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA) if isinstance(config, dict) else None
    if type(r) is not int or r <= 0 or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(  # NOTE: Python's json reads NaN and Infinity: they would poison every answer
            f"adapter {name!r}: adapter_config.json needs a positive integer 'r' and a finite 'lora_alpha'"
        )
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(weights_path):
        raise ValueError(f"adapter {name!r}: no adapter_model.safetensors in {path}")
    try:
        tensors = load_file(weights_path)
    except Exception as exc:  # NOTE: safetensors raises its own error type for a damaged file
        raise ValueError(f"adapter {name!r}: cannot read {weights_path}: {exc}") from None
    # NOTE: through float32: isfinite has no CPU kernel for the float8 types an adapter may be stored in
    bad = next(
        (key for key, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t.float()).all()),
        None,
    )
    if bad is not None:
        raise ValueError(f"adapter {name!r}: {bad} holds inf or NaN")
    return config, tensors


def _adapter(name: str, path: str, model: torch.nn.Module, config: Any, tensors: dict) -> LoraAdapter:
    """The adapter ``config`` and ``tensors`` make for ``model`` (this rank's part)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: only LoRA adapters are supported, not {config.get('peft_type')}")
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out") or config.get("use_dora"):
        raise ValueError(f"adapter {name!r}: LoRA biases, fan_in_fan_out and DoRA are not supported")
    for key, what in UNSERVED_SETTINGS.items():
        if config.get(key) not in (None, False, {}, []):
            raise ValueError(f"adapter {name!r}: {key} ({what}) is not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    for key, default in (("rank_pattern", rank), ("alpha_pattern", alpha)):
        # NOTE: PEFT gives the modules these name their own r or lora_alpha; one scale serves every module here
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or any(value != default for value in pattern.values()):
            raise ValueError(
                f"adapter {name!r}: its {key} {pattern!r} is not supported (one r and one lora_alpha for "
                "every module are)"
            )
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(
                f"adapter {name!r}: unsupported weight {key!r} (LoRA on q/k/v/o/gate/up/down, or Phi-3's "
                "qkv/gate_up, only)"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    c = model.config  # type: ignore[attr-defined]
    mlp = sorted({target for _, target in pairs if TARGETS[target][0] in ("gate_up", "down")})
    if c.num_experts and mlp:
        raise ValueError(
            f"adapter {name!r}: LoRA on {'/'.join(mlp)} of a mixture-of-experts model is not supported "
            "(adapters on its attention projections are)"
        )
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    rows = {
        "q": (0, q),
        "k": (q, q + kv),
        "v": (q + kv, q + 2 * kv),
        "gate": (0, inter),
        "up": (inter, 2 * inter),
        "qkv": (0, q + 2 * kv),
        "gate_up": (0, 2 * inter),
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
                f"r {rank} on this base needs A ({rank}, {inputs[proj]}), B ({end - start}, {rank})"
            )
        parts.setdefault((layer, proj), []).append((start, end, a, b))
    for key, found in parts.items():
        width = outputs.get(key[1]) or rows[key[1]][1]  # NOTE: qkv, gate_up: all of their rows
        stacked_b = torch.zeros(width, rank * len(found))
        # NOTE: the base's o / down weights hold Granite's residual multiplier (folded in at load)
        out_scale = scale * (c.residual_multiplier if key[1] in ("o", "down") else 1.0)
        for n, (start, end, _, b) in enumerate(found):
            stacked_b[start:end, n * rank : (n + 1) * rank] = b.float() * out_scale
        stacked_a = torch.cat([a.float() for _, _, a, _ in found])
        # NOTE: one rank of a tensor-parallel model keeps the part its projection computes
        stacked_a, stacked_b = model.shard.lora(c, key[1], stacked_a, stacked_b)  # type: ignore[attr-defined]
        adapter.weights[key] = (stacked_a.to(dev, dtype), stacked_b.to(dev, dtype))
    if not adapter.weights:
        raise ValueError(f"adapter {name!r}: no LoRA weights in {path}/adapter_model.safetensors")
    return adapter


class AdapterBusyError(RuntimeError):
    """An adapter with requests queued or running cannot be unloaded."""


class AdapterMissingError(LookupError):
    """No adapter of that name is loaded."""


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
    if adapter.name in engine.served_models():  # NOTE: again here: two loads of one name may overlap
        raise ValueError(f"model {adapter.name!r} is already served")
    check_room(model, len(engine.adapter_names) + 1)
    model.add_lora(adapter)
    graphs = getattr(engine.executor, "decode_graphs", None)
    if graphs is not None and not graphs.lora.current():
        log.warning("LoRA adapter %s: the CUDA graphs hold no room for it (--max-loras, --max-lora-rank "
                    "at start-up), so steps with adapters run without them", adapter.name)  # fmt: skip
    engine.cache.add_namespace(adapter.name)
    engine.adapter_names.append(adapter.name)
    return len(engine.adapter_names)


def remove_adapter(engine: Any, name: str) -> int:
    """Stop serving adapter ``name`` (engine thread): its weights and its cached pages go (their
    removal events tell routers); returns the pages freed. Its id is never reused. AdapterMissingError
    when it is not loaded (by now: another unload of it went first)."""
    if name not in engine.adapter_names:
        raise AdapterMissingError(f"no LoRA adapter {name!r} is loaded")
    adapter_id = engine.adapter_names.index(name) + 1
    busy = sum(r.adapter == adapter_id for r in engine.queued())
    if busy:
        raise AdapterBusyError(
            f"LoRA adapter {name!r} has {busy} requests queued or running; retry when they finish"
        )
    engine.adapter_names[adapter_id - 1] = None
    engine.executor.model.remove_lora(adapter_id)
    return engine.cache.drop_namespace(adapter_id) + engine.salts.drop_adapter(adapter_id)
