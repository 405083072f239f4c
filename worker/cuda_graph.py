"""CUDA graphs for decode steps: one captured model forward per padded batch size, replayed after the
step's inputs are copied into static buffers. At small batches this removes the per-kernel launch
cost that otherwise dominates a decode step.

Never changes what a step computes: a padded row writes its K/V only to the pool's scratch slot,
attends to no slot, and its logits are dropped. Runs decode only (extend shapes vary too much).
With LoRA adapters loaded at start-up (or room made for them: --max-loras), each size is captured a
second time with the adapter deltas (kernels/lora.py), for steps with adapter requests: each
request's adapter slot is one more static input (-1 for the base and for padded rows; GraphLora).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from kernels.reference import LORA_BLOCK_ROWS, lora_segments
from worker.forward_batch import ForwardBatch
from worker.request import ScheduledBatch

log = logging.getLogger("worker.engine")

Capture = tuple[Callable[[], None], torch.Tensor]  # (replay, the output tensor every replay rewrites)


class GraphBackend(Protocol):
    """Turns a function of static buffers into a replayable step."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Capture: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture; every graph shares one memory pool (captured largest first,
    so the pool is sized by the first capture and the smaller ones reuse it)."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Capture:
        # NOTE: two warm-up calls on a side stream first: Triton compiles its kernels and torch
        # picks its GEMM algorithms outside the capture, where a host sync is allowed.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return Replay(graph, fn), out


class Replay:
    """A captured graph, replayed by calling it. It holds the function it was captured from: the
    graph reads the memory of every tensor that function holds (a static batch's qo_indptr, say),
    and a tensor freed after the capture would be handed to other allocations while the graph still
    reads it."""

    __slots__ = ("fn", "graph")

    def __init__(self, graph: torch.cuda.CUDAGraph, fn: Callable[[], torch.Tensor]) -> None:
        self.graph, self.fn = graph, fn

    def __call__(self) -> None:
        self.graph.replay()


class StaticInputs:
    """A graph's integer inputs in ONE int64 device buffer, regions at fixed offsets (``lengths``, in
    order: name -> most entries), and two pinned host mirrors used in turn: a step writes each
    region's values and padding into the current mirror (``put``), then moves the written prefix
    with one host-to-device copy (``upload``). Views of the device regions are what a captured
    graph reads."""

    def __init__(self, lengths: dict[str, int], device: torch.device) -> None:
        self.offsets: dict[str, int] = {}
        total = 0
        for name, length in lengths.items():
            self.offsets[name], total = total, total + length
        self.device_buf = torch.zeros(total, dtype=torch.int64, device=device)
        # NOTE: two host mirrors, used in turn: a step may be filled while the one before is still
        # queued on the device (a step scheduled ahead), its copy from the other mirror not yet done
        self._mirrors = [
            torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)
        ]
        self._host_buf = self._mirrors[0]
        self._host = self._host_buf.numpy()  # NOTE: shares memory with the pinned tensor
        self._end = 0  # the written prefix since the last upload

    def view(self, name: str, length: int | None = None) -> torch.Tensor:
        """The device region ``name`` (its first ``length`` entries; to the buffer's end when None)."""
        start = self.offsets[name]
        return self.device_buf[start:] if length is None else self.device_buf[start : start + length]

    def put(self, name: str, values: np.ndarray, size: int | None = None, pad: int = 0) -> None:
        """Region ``name`` := ``values``, then ``pad`` up to ``size`` entries (host side)."""
        start, n = self.offsets[name], len(values)
        end = start + max(n, size or 0)
        self._host[start : start + n] = values
        self._host[start + n : end] = pad
        self._end = max(self._end, end)

    def upload(self) -> None:
        """Copy what ``put`` wrote to the device, then switch to the other mirror.
        NOTE: non_blocking from pinned memory: the mirror is written again two steps later, and the
        engine waits for a step's tokens before it fills the step after next, so its copy is done.
        A step's graph reads only what its own ``put`` calls wrote, so the switch loses nothing."""
        self.device_buf[: self._end].copy_(self._host_buf[: self._end], non_blocking=True)
        self._end = 0
        self._host_buf = self._mirrors[1] if self._host_buf is self._mirrors[0] else self._mirrors[0]
        self._host = self._host_buf.numpy()


def put_new_tokens(
    inputs: StaticInputs, size: int, input_ids: np.ndarray, positions: np.ndarray, out_slots: np.ndarray,
    scratch_slot: int,
) -> None:  # fmt: skip
    """A step's new tokens into ``inputs``, padded to ``size``: a padding token is token 0 at
    position 0 whose K/V go to the pool's scratch slot (no page owns it, nothing reads it)."""
    inputs.put("input_ids", input_ids, size)
    inputs.put("positions", positions, size)
    inputs.put("out_slots", out_slots, size, scratch_slot)


def put_lora_segments(
    inputs: StaticInputs, slots: np.ndarray, qo_indptr: np.ndarray, rows: int, cap: int
) -> None:
    """The LoRA kernels' segments (kernels.reference.lora_segments, cut every ``cap`` rows) of a step
    whose request i, of adapter slot ``slots[i]``, owns rows qo_indptr[i]:qo_indptr[i + 1], padded to
    the graph's ``rows`` requests (empty, no adapter), into the regions lora_slots and lora_indptr."""
    n = len(slots)
    padded = np.full(rows, -1, dtype=np.int64)
    padded[:n] = slots
    bounds = np.full(rows + 1, qo_indptr[n], dtype=np.int64)
    bounds[: n + 1] = qo_indptr[: n + 1]
    seg_indptr, seg_slots = lora_segments(padded, bounds, cap)
    inputs.put("lora_slots", seg_slots)
    inputs.put("lora_indptr", seg_indptr)


class GraphLora:
    """What a graph runner keeps of the model's LoRA stack (worker.model.lora.LoraStack) when it has
    adapters or room for them at capture (--max-loras): each batch shape is then captured a second
    time with the adapter deltas, each request's slot one more static input. A later adapter that
    makes the stack grow moves its tensors, and steps with adapters run eagerly from then on."""

    def __init__(self, model: Any) -> None:
        stack = getattr(model, "lora_stack", None)
        self.stack = stack if stack is not None and stack.slots else None
        self.version = None if self.stack is None else self.stack.version

    @property
    def variants(self) -> tuple[bool, ...]:
        """Captures per shape: without adapters, and with them when there is a stack."""
        return (False, True) if self.stack is not None else (False,)

    def current(self) -> bool:
        """Whether adapter steps can replay: a stack was captured and its tensors have not moved."""
        return self.stack is not None and self.stack.version == self.version

    def holds(self, batch: ScheduledBatch) -> bool:
        """Whether the captured graphs can run ``batch``'s adapters (none, or all in the stack as captured)."""
        if not any(r.adapter for r in batch.requests):
            return True
        return self.current() and all(
            not r.adapter or r.adapter in self.stack.slot_of for r in batch.requests
        )  # type: ignore[union-attr]

    def slots(self, batch: ScheduledBatch) -> np.ndarray | None:
        """Each request's slot (-1: the base) when ``batch`` has adapter requests, else None."""
        if not any(r.adapter for r in batch.requests):
            return None
        return np.array(self.stack.slots_of([r.adapter for r in batch.requests]))  # type: ignore[union-attr]

    def batch(self, slots: torch.Tensor, indptr: torch.Tensor, max_rows: int) -> Any:
        """The LoRA part of a static batch: its slots are rewritten before each replay."""
        from worker.model.lora import LoraBatch

        return LoraBatch(self.stack, slots, indptr, max_rows, [], fixed=False)  # type: ignore[arg-type]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to ``max_batch``
    (a step pads to the next size up: at most 7 wasted rows, ~1.3x the graphs of powers of two)."""
    if max_batch <= 0:
        return []
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphRunner:
    """Captured decode forwards for ``graph_batch_sizes(max_batch)`` requests.

    Static inputs live in ONE int64 device buffer at fixed offsets:
    ``[input_ids B | positions B | out_slots B | kv_indptr B+1 | lora_slots B | lora_indptr B+1 |
    kv_indices max_kv_indices]`` (B = the largest size; the LoRA segments' slots and bounds only
    when the model has adapters). A step fills the same layout in pinned host memory (StaticInputs)
    and moves it with a single host-to-device copy of the used prefix, then replays the graph of the
    next size up.
    """

    def __init__(
        self,
        model: Any,
        kv_pool: Any,
        max_batch: int,
        max_kv_indices: int,
        backend: GraphBackend | None = None,
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        if not self.sizes:
            raise ValueError("max_batch must be positive")
        if max_kv_indices <= 0:
            raise ValueError("max_kv_indices must be positive")
        big = self.sizes[-1]
        self.max_batch, self.max_kv_indices = big, max_kv_indices
        self.scratch_slot = int(kv_pool.scratch_slot)
        self.lora = GraphLora(model)
        # NOTE: kv_indices last: a step uploads the written prefix, so one with few slots copies little
        lengths = {"input_ids": big, "positions": big, "out_slots": big, "kv_indptr": big + 1}
        if self.lora.stack:  # the LoRA kernels' segments (kernels.reference.lora_segments)
            lengths |= {"lora_slots": big, "lora_indptr": big + 1}
        lengths["kv_indices"] = max_kv_indices
        self._inputs = StaticInputs(lengths, model.device)
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self._replays: dict[tuple[int, bool], Callable[[], None]] = {}
        backend = backend or CudaGraphBackend()
        started = time.perf_counter()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                for lora in self.lora.variants:
                    batch = self._static_batch(size, lora)
                    # padded rows only during capture: each attends to nothing, writes the scratch slot
                    self._fill(size, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                               np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64) if lora else None)  # fmt: skip
                    replay, out = backend.capture(lambda b=batch: model.forward(b, kv_pool))
                    self._replays[size, lora], self._outputs[size, lora] = replay, out
        log.info("decode graphs for batch sizes %s%s captured in %.1f s", self.sizes,
                 " (with and without LoRA)" if self.lora.stack else "", time.perf_counter() - started)  # fmt: skip

    def _static_batch(self, size: int, lora: bool) -> ForwardBatch:
        view = self._inputs.view
        batch = ForwardBatch(
            mode="decode",
            input_ids=view("input_ids", size),
            positions=view("positions", size),
            out_slots=view("out_slots", size),
            qo_indptr=torch.arange(size + 1, dtype=torch.int32, device=self._inputs.device_buf.device),
            kv_indptr=view("kv_indptr", size + 1),
            kv_indices=view("kv_indices"),
        )
        if lora:
            batch.lora = self.lora.batch(
                view("lora_slots", size), view("lora_indptr", size + 1), LORA_BLOCK_ROWS
            )
        return batch

    def _fill(
        self,
        size: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        out_slots: np.ndarray,
        kv_indptr: np.ndarray,
        kv_indices: np.ndarray,
        lora_slots: np.ndarray | None = None,
    ) -> None:
        """Write a step of ``len(input_ids)`` requests, padded to ``size``, and copy it to the device
        (``lora_slots``: each request's adapter slot, for a LoRA graph)."""
        put_new_tokens(self._inputs, size, input_ids, positions, out_slots, self.scratch_slot)
        self._inputs.put("kv_indptr", kv_indptr, size + 1, int(kv_indptr[-1]))  # padded rows: zero slots
        self._inputs.put("kv_indices", kv_indices)
        if lora_slots is not None:  # NOTE: one row per request; padded rows: no adapter
            put_lora_segments(self._inputs, lora_slots, np.arange(len(lora_slots) + 1), size, LORA_BLOCK_ROWS)
        self._inputs.upload()

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (
            batch.mode == "decode"
            and len(batch.requests) <= self.max_batch
            and self.lora.holds(batch)
            and batch.kv_indices.size <= self.max_kv_indices
        )

    def padded_size(self, n: int) -> int | None:
        """The captured size a step of ``n`` requests replays (the next one up); None past the largest."""
        return self.sizes[bisect.bisect_left(self.sizes, n)] if n <= self.max_batch else None

    def replay_of(self, size: int) -> Callable[[], None]:
        """The captured forward of ``size`` (one of self.sizes), over whatever the static buffers hold
        (the last step's inputs): for timing the GPU side of a step alone (worker.bench)."""
        return self._replays[size, False]

    def run(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, vocab] (float32) of a decode step; ``input_ids``: its new tokens on the device
        (from the step before), instead of ``batch.input_ids``. NOTE: a view of the graph's output
        buffer, valid until the next replay; the executor enqueues its sampling before that."""
        n = len(batch.requests)
        size = self.padded_size(n)
        slots = self.lora.slots(batch)
        self._fill(
            size, batch.input_ids, batch.positions, batch.out_slots, batch.kv_indptr, batch.kv_indices, slots
        )
        if input_ids is not None:
            self._inputs.view("input_ids", n).copy_(input_ids)
        self._replays[size, slots is not None]()
        return self._outputs[size, slots is not None][:n]
