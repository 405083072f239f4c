"""CUDA graphs for short extend steps: a cache hit's prefill of the few tokens past its cached prefix,
and speculative decoding's verify steps. Eagerly, such a step launches every kernel of every layer
from Python and waits on that far longer than on the GPU; replayed, it costs what its kernels cost.

Never changes what a step computes. A step of n tokens over b requests replays the graph of the next
token count T up: its T - n padding tokens belong to no request (attention skips them; every other
layer works row by row), write their K/V only to the pool's scratch slot, and their rows are dropped;
the graph's request rows past b hold no tokens and no prefix. With LoRA adapters (or room for them)
at capture, each shape is captured with the adapter deltas too (worker.cuda_graph.GraphLora).

A graph is captured over a prefix of unknown length, so its extend kernel takes the tiles of an unknown
prefix and a grid fixed by its tokens: few programs, each walking a whole prefix. So each shape that runs
the extend kernel (more than SHORT_EXTEND tokens a request) is also captured in the configurations that
win over long cached prefixes (kernels.extend_attention.graph_configs: the long-prefix tiles, the prefix
split), and a step replays the one graph_variant picks for its longest cached prefix, which the host
knows at replay.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.attention import SHORT_EXTEND
from worker.cuda_graph import (
    CudaGraphBackend,
    GraphBackend,
    GraphLora,
    StaticInputs,
    put_lora_segments,
    put_new_tokens,
)
from worker.forward_batch import ForwardBatch
from worker.request import ScheduledBatch

log = logging.getLogger("worker.engine")

MIN_GRAPH_TOKENS = 8
GraphKey = tuple[int, str, bool, str]  # a capture: (tokens, logits kind, with LoRA, prefix variant)
# the prefix variants by default from this compute capability (x10) on: measured on an H100 (sm_90);
# before Hopper unmeasured (--cuda-graph-extend-variants on takes them there too)
VARIANTS_MIN_ARCH = 90


def graph_token_sizes(max_tokens: int) -> list[int]:
    """Padded token counts to capture: 8, 16, 32, ... up to ``max_tokens`` (which is always one)."""
    if max_tokens <= 0:
        return []
    sizes = []
    size = MIN_GRAPH_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


class ExtendGraphRunner:
    """Captured extend forwards for ``graph_token_sizes(max_tokens)`` new tokens; the graph of T
    tokens takes up to min(T, max_requests) requests. Two kinds of graph per size: ``last`` (logits
    of each request's last token: prefill) and, with ``all_logits``, ``all`` (every token's: verify).
    ``all_max_new``: the most new tokens of a request in an ``all`` step (a verify step's drafts + 1),
    which its graphs' kernels are launched for; ``can_run`` refuses an ``all`` step past it.

    Static inputs live in ONE int64 device buffer at fixed offsets (T = max_tokens, R = its requests):
    ``[input_ids T | positions T | out_slots T | qo_indptr R+1 | kv_indptr R+1 | lora_slots R+1 |
    lora_indptr R+1 | kv_indices ...]`` (the LoRA segments only with adapters), filled through a pinned
    host mirror with one host-to-device copy per step, as for decode graphs.

    ``prefix_variants``: capture the configurations that win over long prefixes too (see the module
    docstring); None = on CUDA from VARIANTS_MIN_ARCH on.
    """

    def __init__(
        self,
        model: Any,
        kv_pool: Any,
        max_tokens: int,
        max_requests: int,
        max_kv_indices: int,
        all_logits: bool = False,
        backend: GraphBackend | None = None,
        all_max_new: int | None = None,
        prefix_variants: bool | None = None,
    ) -> None:
        self.sizes = graph_token_sizes(max_tokens)
        if not self.sizes or max_requests <= 0 or max_kv_indices <= 0:
            raise ValueError("max_tokens, max_requests and max_kv_indices must be positive")
        big, self.max_requests, self.max_kv_indices = self.sizes[-1], max_requests, max_kv_indices
        self.scratch_slot = int(kv_pool.scratch_slot)
        rows = self._requests(big) + 1
        self.lora = GraphLora(model)
        # NOTE: kv_indices last: a step uploads the written prefix, so one with few slots copies little
        lengths = {"input_ids": big, "positions": big, "out_slots": big, "qo_indptr": rows, "kv_indptr": rows}
        if self.lora.stack:  # the LoRA kernels' segments (kernels.reference.lora_segments)
            lengths |= {"lora_slots": rows, "lora_indptr": rows}
        lengths["kv_indices"] = max_kv_indices
        self._inputs = StaticInputs(lengths, model.device)
        self.kinds = ("last", "all") if all_logits else ("last",)
        # NOTE: verify steps (the "all" kind) have few new tokens per request; the hint lets a graph
        # run the short-extend kernel and size its grid by them rather than by the graph's tokens
        self.all_max_new = all_max_new
        if prefix_variants is None:
            prefix_variants = model.device.type == "cuda" and variants_by_default(model.device)
        self.prefix_variants = bool(prefix_variants)  # False: only the default graphs replay
        # (size, kind) -> the kernel configuration of each variant besides "default"
        self.configs: dict[tuple[int, str], dict[str, Any]] = {}
        self.variant_steps: collections.Counter[str] = collections.Counter()  # steps replayed, by variant
        self._replays: dict[GraphKey, Callable[[], None]] = {}
        self._outputs: dict[GraphKey, torch.Tensor] = {}
        # what the variants depend on of the model and its pool
        shape = (model.config, model.dtype, model.device, kv_pool.dtype)
        backend = backend or CudaGraphBackend()
        started = time.perf_counter()
        empty = np.zeros(0, np.int64)
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
                for kind in self.kinds:
                    max_extend = self._max_extend(size, kind)
                    configs = variant_configs(*shape, size, max_extend) if prefix_variants else {}
                    self.configs[size, kind] = configs
                    for lora in self.lora.variants:
                        for variant, config in [("default", None), *configs.items()]:
                            key = (size, kind, lora, variant)
                            batch = self._static_batch(size, kind, lora, config)
                            self._fill(size, empty, empty, empty, np.zeros(1, np.int64), np.zeros(1, np.int64),
                                       empty, empty if lora else None)  # fmt: skip
                            self._replays[key], self._outputs[key] = backend.capture(
                                lambda b=batch: model.forward(b, kv_pool)
                            )
        variants = sorted({f"{v} at {k[0]}" for k, configs in self.configs.items() for v in configs})
        log.info(
            "extend graphs (%s logits%s) for %s new tokens captured in %.1f s%s",
            "/".join(self.kinds),
            ", with and without LoRA" if self.lora.stack else "",
            self.sizes,
            time.perf_counter() - started,
            f"; for long prefixes also {', '.join(variants)}" if variants else "",
        )

    def _max_extend(self, size: int, kind: str) -> int:
        """The most new tokens of a request the ``kind`` graph of ``size`` tokens launches its kernels for.
        NOTE: the grid covers the whole graph (or an "all" step's longest request); shorter exit early."""
        return min(size, self.all_max_new or size) if kind == "all" else size

    def _requests(self, size: int) -> int:
        """Most requests a graph of ``size`` tokens takes (each scheduled request has a new token)."""
        return min(size, self.max_requests)

    def _static_batch(self, size: int, kind: str, lora: bool, config: Any = None) -> ForwardBatch:
        rows, view = self._requests(size), self._inputs.view
        batch = ForwardBatch(
            mode="extend",
            input_ids=view("input_ids", size),
            positions=view("positions", size),
            out_slots=view("out_slots", size),
            qo_indptr=view("qo_indptr", rows + 1),
            kv_indptr=view("kv_indptr", rows + 1),
            kv_indices=view("kv_indices"),
            return_all_logits=kind == "all",
            verify=kind == "all",  # NOTE: the graphs of every logit are the verify steps
            max_extend_len=self._max_extend(size, kind),
            extend_config=config,
        )
        if lora:  # NOTE: segments of up to ``size`` rows: the kernels' grid is the same as the requests'
            batch.lora = self.lora.batch(view("lora_slots", rows), view("lora_indptr", rows + 1), size)
        return batch

    def _fill(
        self,
        size: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        out_slots: np.ndarray,
        qo_indptr: np.ndarray,
        kv_indptr: np.ndarray,
        kv_indices: np.ndarray,
        lora_slots: np.ndarray | None = None,
    ) -> None:
        """Write a step of ``len(input_ids)`` tokens over ``len(qo_indptr) - 1`` requests, padded to
        ``size`` tokens (owned by no request) and the graph's request rows (empty ones), into the host
        buffer, and copy its used part to the device (``lora_slots``: each request's adapter slot,
        for a LoRA graph)."""
        put, rows = self._inputs.put, self._requests(size)
        put_new_tokens(self._inputs, size, input_ids, positions, out_slots, self.scratch_slot)
        # NOTE: empty rows past the step's requests: no new tokens, no prefix
        put("qo_indptr", qo_indptr, rows + 1, int(qo_indptr[-1]))
        put("kv_indptr", kv_indptr, rows + 1, int(kv_indptr[-1]))
        put("kv_indices", kv_indices)
        if lora_slots is not None:
            put_lora_segments(self._inputs, lora_slots, qo_indptr, rows, size)
        self._inputs.upload()

    def can_run(self, batch: ScheduledBatch, kind: str = "last") -> bool:
        """Whether a graph holds ``batch`` (an extend or verify step) with ``kind`` logits."""
        n = batch.num_new_tokens
        return (
            batch.mode in ("extend", "verify")
            and kind in self.kinds
            and 0 < n <= self.sizes[-1]
            and len(batch.requests) <= self._requests(self.padded_size(n))
            and self.lora.holds(batch)
            and not any(r.full_prefill for r in batch.requests)  # prompt logprobs: their own logit rows
            and batch.kv_indices.size <= self.max_kv_indices
            and (kind != "all" or not self.all_max_new or batch.max_new_tokens <= self.all_max_new)
        )

    def padded_size(self, n: int) -> int:
        """The captured token count a step of ``n`` new tokens (<= the largest) replays."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, batch: ScheduledBatch, kind: str = "last") -> torch.Tensor:
        """Logits (float32) of a step ``can_run`` accepted: [B, vocab] for ``last``, [T, vocab] for
        ``all``. NOTE: a view of the graph's output buffer, valid until the next replay."""
        size = self.padded_size(batch.num_new_tokens)
        slots = self.lora.slots(batch)
        configs = self.configs[size, kind]
        variant = (
            replayed_variant(configs, batch.max_prefix_tokens, size) if self.prefix_variants else "default"
        )
        key = (size, kind, slots is not None, variant)
        self._fill(size, batch.input_ids, batch.positions, batch.out_slots, batch.qo_indptr, batch.kv_indptr,
                   batch.kv_indices, slots)  # fmt: skip
        self._replays[key]()
        self.variant_steps[variant] += 1
        rows = len(batch.requests) if kind == "last" else batch.num_new_tokens
        return self._outputs[key][:rows]


# NOTE: the kernels' module imports Triton: the functions below import it only where variants may run


def variants_by_default(device: torch.device) -> bool:
    """Whether extend graphs on ``device`` take the prefix variants unless told (VARIANTS_MIN_ARCH)."""
    from kernels.extend_attention import device_arch

    return device_arch(device) >= VARIANTS_MIN_ARCH


def variant_configs(
    config: Any, dtype: torch.dtype, device: torch.device, pool_dtype: torch.dtype, size: int, max_extend: int
) -> dict[str, Any]:
    """The configurations besides the default an extend graph of ``size`` tokens of a model of ``config``
    (a ModelConfig) in ``dtype`` on ``device`` over a pool of ``pool_dtype``, its kernels launched for
    requests of up to ``max_extend`` new tokens, is captured in: kernels.extend_attention.graph_configs'
    where it runs the extend kernel (not the short one)."""
    if max_extend <= SHORT_EXTEND:
        return {}
    from kernels.extend_attention import graph_configs

    return graph_configs(size, config.num_heads, config.head_dim, dtype, device, pool_dtype)


def replayed_variant(configs: dict[str, Any], max_prefix_len: int, size: int) -> str:
    """The capture a step over a longest cached prefix of ``max_prefix_len`` tokens replays from a graph
    of ``size`` tokens captured in ``configs`` besides the default: kernels.extend_attention.graph_variant's
    pick, "default" without variants."""
    if not configs:
        return "default"
    from kernels.extend_attention import graph_variant

    return graph_variant(max_prefix_len, size, configs)
