"""Speculative decoding by prompt lookup: draft tokens for a decoding request from its own text.

A request whose last n tokens (n from ``max_ngram`` down to ``min_ngram``) occurred earlier in its
prompt or output proposes the tokens that followed the most recent such occurrence: an answer that
quotes its context (code edits, extraction, RAG citations, a tool result repeated) continues the
way the context did. The scheduler turns the drafts into a verify step (each request's last token
plus its drafts as new tokens over its cached KV, one forward), and worker.sampling.accept_draft
keeps the longest run of drafts the model agrees with plus one token of its own. Output is what
decoding one token at a time gives: the same tokens for greedy and seeded requests, the same
distribution for other sampled ones; a step just yields more than one token when drafts are right.

Pure numpy; the scheduler calls ``propose`` once per decoding request per step, so the lookup is a
vectorised scan of the request's ids (kept as an int32 array, appended to as tokens arrive).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class NgramProposer:
    num_tokens: int  # drafts per request per step (k): a verify step computes k + 1 tokens each
    max_ngram: int = 4  # longest suffix looked up
    min_ngram: int = 2  # shortest suffix looked up (shorter ones match too often to be right)
    max_batch: int = 32  # decode steps with more running requests than this do not speculate

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError("speculative tokens must be at least 1")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("speculative n-gram sizes need 1 <= min <= max")
        if self.max_batch < 1:
            raise ValueError("speculative max batch must be at least 1")

    def propose(self, req: Any) -> list[int]:
        """Draft tokens for ``req`` (a worker.request.Request that is decoding): at most
        ``num_tokens``, and never more than its remaining output allows (the verify step adds one
        token of the model's own); empty when it may not speculate or nothing matches. A request
        with a ``draft_check`` (a grammar) gets what that makes of the lookup's drafts."""
        room = min(self.num_tokens, req.max_tokens - req.num_output - 1)
        if room <= 0 or not req.speculative:
            return []
        drafts = self._lookup(req, room)
        if req.draft_check is not None:  # NOTE: structured outputs: what the grammar forces or allows
            drafts = req.draft_check(drafts)[:room]
        return drafts

    def _lookup(self, req: Any, room: int) -> list[int]:
        """The tokens after the most recent earlier occurrence of the longest suffix (of
        ``min_ngram`` to ``max_ngram`` tokens) of the request's ids."""
        ids = _history(req)
        last = ids.size - 1
        # NOTE: one scan over the ids (for their last token), then the matches only are extended
        # backwards one token at a time: cost O(len) once, not once per n-gram size
        ends = np.flatnonzero(ids[:last] == ids[last])  # earlier positions holding the last token
        best, matched = -1, 1
        while ends.size:
            if matched >= self.min_ngram:
                best = int(ends[-1])  # the most recent occurrence of the last `matched` tokens
            if matched == self.max_ngram or matched >= last:
                break
            ends = ends[ends >= matched]
            ends = ends[ids[ends - matched] == ids[last - matched]]
            matched += 1
        return [] if best < 0 else ids[best + 1 : best + 1 + room].tolist()


class _History:
    """A request's token ids as one int32 array sized for its whole life, filled as they arrive."""

    __slots__ = ("ids", "size")

    def __init__(self, capacity: int) -> None:
        self.ids = np.empty(capacity, dtype=np.int32)
        self.size = 0


def _history(req: Any) -> np.ndarray:
    tokens = req.token_ids
    hist: _History | None = req.draft_history
    if hist is None or hist.ids.size < len(tokens) or hist.size > len(tokens):
        hist = req.draft_history = _History(max(len(tokens), req.prompt_len + req.max_tokens))
    if hist.size < len(tokens):
        hist.ids[hist.size : len(tokens)] = tokens[hist.size :]
        hist.size = len(tokens)
    return hist.ids[: hist.size]


def commit_verify(stats: Any, batch: Any, accepted: Sequence[list[int]]) -> list[Any]:
    """Record a verify step (worker.scheduler.Scheduler.commit): append each request's accepted
    tokens up to the first that finishes it; its K/V now cover its last token and the drafts it
    kept (the rest of the step's K/V is left unused). ``stats``: the SchedulerStats to count in."""
    assert batch.drafts is not None
    stats.verify_steps += 1
    stats.verify_requests += len(batch.requests)
    for req, draft, tokens in zip(batch.requests, batch.drafts, accepted, strict=True):
        stats.draft_tokens += len(draft)
        kept = 0
        for token in tokens:
            req.token_ids.append(int(token))
            kept += 1
            if token in req.stop_token_ids:
                req.finish_reason = "stop"
            elif req.num_output >= req.max_tokens:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        # NOTE: the drafts the model agreed with and the request kept: the last token is the model's
        # own unless the request ended before it
        req.verify_counted = (kept, min(kept, len(tokens) - 1))
        stats.decode_tokens += kept
        stats.accepted_tokens += req.verify_counted[1]
        req.kv_len = len(req.token_ids) - 1
    return list(batch.requests)
