"""ForwardBatch: everything one model forward needs to know about its requests and KV slots.

A plain container built by the scheduler; it never allocates KV slots or touches the pool itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass
class ForwardBatch:
    """One forward over B requests and T new tokens (request-major).

    NOTE: extend -> ``kv_indices`` holds each request's PREFIX slots only (already in the pool; the
    new tokens' K/V come from this forward); decode -> one new token per request and ``kv_indices``
    holds all of its slots including the new token's own (written before attention runs).
    """

    mode: Literal["extend", "decode"]
    input_ids: torch.Tensor  # int64 [T] new tokens of all requests, request-major
    positions: torch.Tensor  # int64 [T] absolute positions (tokens)
    out_slots: torch.Tensor  # int64 [T] pool slots where each new token's K/V is written
    qo_indptr: torch.Tensor  # int32 [B+1] rows of request i in input_ids
    kv_indptr: torch.Tensor  # int32 [B+1] request i's entries of kv_indices
    kv_indices: torch.Tensor  # int32/int64 [nnz] pool slots (see the NOTE above)
    return_all_logits: bool = False  # logits of every new token instead of the last per request
    # a speculative verify step: its new tokens are attended as the pool stores them (decode's view)
    verify: bool = False
    logit_rows: torch.Tensor | None = None  # int64: the new tokens to give logits for (overrides both)
    # NOTE: host-side, so the extend kernel's grid needs no device-to-host sync (one per layer otherwise)
    max_extend_len: int | None = None  # most new tokens of any request; None = read from qo_indptr
    # extend: the longest cached prefix of any request (picks the kernel's tiles); None = unknown
    max_prefix_len: int | None = None
    # extend: the Triton kernel's configuration (an extend graph's variant, kernels.extend_attention.
    # graph_configs); None = its default for the hints above
    extend_config: Any = None
    lora: Any = None  # a worker.model.lora.LoraBatch when requests of LoRA adapters are in the batch
    # the scheduled step it was built from (its numpy arrays: what tensor parallelism sends the
    # other ranks), and whether ``input_ids`` came from the step before's sampled tokens on the
    # device instead (a step scheduled ahead: --overlap-schedule)
    host: Any = None
    inputs_on_device: bool = False

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with every tensor on ``device``."""
        return ForwardBatch(
            mode=self.mode,
            input_ids=self.input_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            out_slots=self.out_slots.to(device, non_blocking=True),
            qo_indptr=self.qo_indptr.to(device, non_blocking=True),
            kv_indptr=self.kv_indptr.to(device, non_blocking=True),
            kv_indices=self.kv_indices.to(device, non_blocking=True),
            return_all_logits=self.return_all_logits,
            verify=self.verify,
            logit_rows=None if self.logit_rows is None else self.logit_rows.to(device, non_blocking=True),
            max_extend_len=self.max_extend_len,
            max_prefix_len=self.max_prefix_len,
            extend_config=self.extend_config,
            lora=self.lora,
        )

    @staticmethod
    def from_step(step: Any, device: torch.device | str) -> ForwardBatch:
        """From a scheduled step's numpy arrays (worker.request.ScheduledBatch), on ``device``. A
        verify step is an extend to the model."""
        batch = ForwardBatch(
            mode="decode" if step.mode == "decode" else "extend",
            input_ids=torch.from_numpy(step.input_ids),
            positions=torch.from_numpy(step.positions),
            out_slots=torch.from_numpy(step.out_slots),
            qo_indptr=torch.from_numpy(step.qo_indptr),
            kv_indptr=torch.from_numpy(step.kv_indptr),
            kv_indices=torch.from_numpy(step.kv_indices),
            max_extend_len=step.max_new_tokens,
            max_prefix_len=None if step.mode == "decode" else step.max_prefix_tokens,
        ).to(device)
        batch.host = step
        return batch

    @staticmethod
    def build(
        mode: Literal["extend", "decode"],
        new_tokens: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        new_slots: Sequence[Sequence[int]],
        kv_slots: Sequence[Sequence[int]],
        device: torch.device | str = "cpu",
        return_all_logits: bool = False,
        verify: bool = False,
    ) -> ForwardBatch:
        """From per-request lists: request i's new tokens begin at position ``start_positions[i]``,
        their K/V go to ``new_slots[i]``, and ``kv_slots[i]`` is its prefix (extend) or all of its
        slots including the new token's (decode)."""
        if not len(new_tokens) == len(start_positions) == len(new_slots) == len(kv_slots):
            raise ValueError("per-request lists must all have one entry per request")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        kv: list[int] = []
        qo_indptr, kv_indptr = [0], [0]
        for toks, start, out, prefix in zip(new_tokens, start_positions, new_slots, kv_slots, strict=True):
            if len(toks) != len(out):
                raise ValueError("each new token needs exactly one output slot")
            if mode == "decode" and len(toks) != 1:
                raise ValueError("decode takes exactly one new token per request")
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            slots.extend(out)
            kv.extend(prefix)
            qo_indptr.append(len(ids))
            kv_indptr.append(len(kv))

        def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return ForwardBatch(
            mode=mode,
            input_ids=t(ids, torch.int64),
            positions=t(positions, torch.int64),
            out_slots=t(slots, torch.int64),
            qo_indptr=t(qo_indptr, torch.int32),
            kv_indptr=t(kv_indptr, torch.int32),
            kv_indices=t(kv, torch.int64),
            return_all_logits=return_all_logits,
            verify=verify,
            max_extend_len=max((len(toks) for toks in new_tokens), default=0),
            max_prefix_len=max((len(prefix) for prefix in kv_slots), default=0) if mode == "extend" else None,
        )
