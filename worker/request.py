"""What the scheduler works on: requests, the batch it schedules each step (and how its arrays are
built), its configuration and counters. Pure Python + numpy, shared by the engine, the executors
and the simulators."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

NO_PAGES = np.zeros(0, dtype=np.int64)


@dataclass
class SchedulerConfig:
    page_size: int = 16  # tokens per KV page (= the advertised block size)
    max_running: int = 256  # requests admitted at once (prefilling + decoding)
    chunked_prefill_tokens: int = 2048  # new prompt tokens per extend step
    policy: Literal["lpm", "fcfs"] = "lpm"
    max_wait_s: float = 5.0  # age bound (s): a request waiting longer goes first, in arrival order
    max_waiting: int = 1024  # waiting-queue bound; the caller turns "full" into HTTP 429
    decode_reserve_tokens: int = 256  # per request, decode tokens kept free when admitting more
    lpm_window: int = 256  # oldest waiting requests considered by LPM ordering per step
    # speculative decoding by prompt lookup (worker.speculative); 0 drafts per step = off
    speculative_tokens: int = 0
    speculative_max_ngram: int = 4
    speculative_min_ngram: int = 2
    speculative_max_batch: int = 32  # decode steps with more running requests do not speculate


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``."""


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it (token ids, progress, KV ownership)."""

    rid: str
    prompt_ids: Sequence[int]
    max_tokens: int  # output tokens at most (already clamped to the context / pool)
    stop_token_ids: frozenset[int] = frozenset()  # a sampled id in here finishes with "stop"
    arrival: float = field(default_factory=time.monotonic)  # s, monotonic
    payload: Any = None  # the engine's per-request state (sampling params, detokenizer, ...)
    prompt_group: Any = None  # requests sharing one prompt (n > 1 choices); None = alone
    priority: int = 0  # lower is admitted first and preempted last
    full_prefill: bool = False  # compute every prompt position, cached or not (prompt logprobs)
    speculative: bool = False  # its decode steps may verify drafts (the engine's requests; not the warm-up)
    draft_check: Any = None  # drafts -> the drafts it may take (a grammar's forced or valid tokens)
    adapter: int = 0  # LoRA adapter id (0 = the base model): its KV and cache entries are its own
    namespace: int | None = None  # the radix cache's key range: the adapter's, or its cache salt's
    # --- progress and KV ownership (scheduler only) ---
    token_ids: list[int] = field(init=False)  # prompt + generated so far
    prompt_len: int = field(init=False)
    kv_len: int = 0  # tokens whose K/V are in the pool (positions [0, kv_len))
    pages: np.ndarray = field(default_factory=lambda: NO_PAGES)  # hold positions [0, len*page)
    slots: np.ndarray = field(default_factory=lambda: NO_PAGES)  # slot of every position of pages
    tree_len: int = 0  # leading tokens whose pages belong to the tree, locked via lock_node
    lock_node: Any = None
    cached_tokens: int = -1  # prompt tokens served from cache at first admission (-1: not yet)
    cache_written: int = 0  # prompt tokens whose pages this request added to the radix cache
    uncached_estimate: int = 0  # while waiting: tokens to prefill, as the cache stood when last looked
    finish_reason: str | None = None
    retractions: int = 0
    draft_history: Any = None  # the draft proposer's copy of token_ids
    key_cache: Any = None  # (namespace, radix keys of token_ids): worker.scheduler._keys
    # the last verify step's (tokens kept, drafts counted as accepted): what a stop string's cut takes back
    verify_counted: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.namespace is None:
            self.namespace = self.adapter
        self.token_ids = [int(t) for t in self.prompt_ids]
        self.prompt_len = len(self.token_ids)
        if self.prompt_len == 0:
            raise ValueError("empty prompt")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


@dataclass
class ScheduledBatch:
    """What one step computes. Request i writes tokens [starts[i], ends[i]) into its pages;
    ``sample[i]`` says whether its last new token's logits yield a sampled token.

    A verify step (speculative decoding) is an extend over decoding requests: request i's new
    tokens are its last token then ``drafts[i]``, every one of them gets logits, and the executor
    returns the tokens it accepts (the agreed drafts plus one of its own) per request."""

    mode: Literal["extend", "decode", "verify"]
    requests: list[Request]
    starts: list[int]
    ends: list[int]
    sample: list[bool]
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    out_slots: np.ndarray  # int64 [T]
    qo_indptr: np.ndarray  # int32 [B+1]
    kv_indptr: np.ndarray  # int32 [B+1]
    kv_indices: np.ndarray  # int64: extend, verify -> prefix slots; decode -> all slots incl. the new one
    drafts: list[list[int]] | None = None  # verify only: each request's draft tokens
    # a step scheduled ahead: row i's input token is the step before's sampled token number
    # inputs_from[i] (of those it sampled; still on the device when this step is built, input_ids
    # holds 0 there), or input_ids[i] where inputs_from[i] is -1 (a token the host has)
    inputs_from: np.ndarray | None = None

    @property
    def num_new_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def max_new_tokens(self) -> int:
        """The most new tokens of any request in the step."""
        return int(np.diff(self.qo_indptr).max(initial=0))

    @property
    def max_prefix_tokens(self) -> int:
        """The longest run of pool slots any request reads as context (extend: its cached prefix)."""
        return int(np.diff(self.kv_indptr).max(initial=0))


@dataclass
class SchedulerStats:
    """Cumulative counters (tokens unless named otherwise)."""

    prompt_tokens: int = 0  # at first admission
    cached_tokens: int = 0  # of those, served from the radix cache
    prefill_tokens: int = 0  # tokens computed by extend steps (includes recompute after retraction)
    decode_tokens: int = 0  # generated by decode and verify steps
    retractions: int = 0
    verify_steps: int = 0  # decode steps that checked drafts
    verify_requests: int = 0  # requests in those steps (a request per step)
    draft_tokens: int = 0  # drafts proposed to those steps
    accepted_tokens: int = 0  # of those, kept
    ahead_steps: int = 0  # decode steps scheduled while the step before ran (Scheduler.schedule_ahead)


def build_batch(
    mode: Literal["extend", "decode", "verify"], items: list[tuple[Request, int, int]], sample: list[bool],
    prefix_only: bool, drafts: list[list[int]] | None = None, inputs_from: np.ndarray | None = None,
) -> ScheduledBatch:  # fmt: skip
    """The step computing tokens [start, end) of each (request, start, end) of ``items``: ids,
    positions and pool slots of the new tokens; each request's context slots (``prefix_only``:
    those before ``start``, else all up to ``end``); verify steps take their new tokens from
    ``drafts``; a decode step with ``inputs_from`` takes them from the step before, on the device
    (see ScheduledBatch.inputs_from). Decode and verify steps with LoRA requests put each adapter's
    requests side by side (a stable order by adapter id), so they share the LoRA kernels' segments
    (kernels.reference.lora_segments)."""
    if mode != "extend" and any(r.adapter for r, _, _ in items):
        order = sorted(range(len(items)), key=lambda i: items[i][0].adapter)
        items, sample = [items[i] for i in order], [sample[i] for i in order]
        drafts = None if drafts is None else [drafts[i] for i in order]
        inputs_from = None if inputs_from is None else np.asarray(inputs_from)[order]
    reqs = [r for r, _, _ in items]
    starts = [st for _, st, _ in items]
    ends = [e for _, _, e in items]
    # NOTE: req.slots[p] is position p's slot; it covers every page the request holds.
    kv = [r.slots[: st if prefix_only else e] for r, st, e in items]
    if mode == "decode":  # one token each: skip per-request array building (hot path)
        if inputs_from is None:
            input_ids = np.fromiter((r.token_ids[st] for r, st, _ in items), np.int64, len(items))
        else:
            host = (
                0 if f >= 0 else r.token_ids[st] for (r, st, _), f in zip(items, inputs_from, strict=True)
            )
            input_ids = np.fromiter(host, np.int64, len(items))
        positions = np.asarray(starts, dtype=np.int64)
        out_slots = np.fromiter((r.slots[st] for r, st, _ in items), np.int64, len(items))
        qo = np.arange(len(items) + 1, dtype=np.int32)
    else:
        if drafts is None:
            input_ids = np.concatenate([np.asarray(r.token_ids[st:e], dtype=np.int64) for r, st, e in items])
        else:  # verify: each request's last token, then its drafts
            ids = [t for (r, st, _), d in zip(items, drafts, strict=True) for t in (r.token_ids[st], *d)]
            input_ids = np.asarray(ids, dtype=np.int64)
        positions = np.concatenate([np.arange(st, e, dtype=np.int64) for _, st, e in items])
        out_slots = np.concatenate([r.slots[st:e] for r, st, e in items])
        qo = np.zeros(len(items) + 1, dtype=np.int32)
        np.cumsum([e - st for _, st, e in items], out=qo[1:])
    kvp = np.zeros(len(items) + 1, dtype=np.int32)
    np.cumsum([k.size for k in kv], out=kvp[1:])
    return ScheduledBatch(
        mode=mode,
        requests=reqs,
        starts=starts,
        ends=ends,
        sample=sample,
        input_ids=input_ids,
        positions=positions,
        out_slots=out_slots,
        qo_indptr=qo,
        kv_indptr=kvp,
        kv_indices=np.concatenate(kv),
        drafts=drafts,
        inputs_from=inputs_from,
    )
