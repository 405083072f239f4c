"""Continuous-batching scheduler: picks each step's requests, their KV pages and token ranges.

Pure Python + numpy (no torch) so the simulators reuse it. It decides; it never runs a model, and it
never leaks a page: every page is free, in the radix tree, or held by exactly one live request.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from worker.kv_pool import PageAllocator
from worker.radix_cache import RadixCache
from worker.radix_node import adapter_keys
from worker.request import (
    NO_PAGES,
    QueueFullError,
    Request,
    ScheduledBatch,
    SchedulerConfig,
    SchedulerStats,
    build_batch,
)
from worker.speculative import NgramProposer, commit_verify

MAX_CHAIN_BLOCKED = 8  # decode steps chained ahead while a blocked request waits, before admission is retried


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _keys(req: Request, n: int) -> np.ndarray:
    """The radix-tree keys of the request's first ``n`` tokens (its LoRA adapter's own range). Kept
    on the request while its tokens and namespace stay as they are: a waiting request's prompt is
    matched again at every admission attempt (a 30k-token list to numpy: ~1 ms each time)."""
    space: int = req.namespace  # type: ignore[assignment]  # NOTE: set in __post_init__
    kept = req.key_cache
    if kept is None or kept[0] != space or len(kept[1]) != len(req.token_ids):
        kept = req.key_cache = (space, adapter_keys(np.asarray(req.token_ids, dtype=np.int32), space))
    return kept[1][:n]


class Scheduler:
    """Owns the waiting queue and running set; allocates pages from ``allocator`` and shares full
    pages through ``cache``. Call ``schedule`` then ``commit`` (or ``fail``) once per step."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, cache: RadixCache) -> None:
        self.cfg = config
        self.allocator = allocator
        self.cache = cache
        self.ps = config.page_size
        self.waiting: deque[Request] = deque()  # arrival order (retracted requests at the front)
        self.prefilling: list[Request] = []  # admitted, prompt not fully computed yet
        self.running: list[Request] = []  # decoding, in admission order (oldest first)
        self.stats = SchedulerStats()
        self._last_mode: str | None = None
        # NOTE: when the waiting queue's head could not be admitted (no pages): what admission saw then
        # (see _admission_state); schedule_ahead chains decode steps while nothing there has changed
        self._blocked: tuple | None = None
        self._chained = 0  # decode steps scheduled ahead since the last schedule()
        self.proposer: NgramProposer | None = None  # speculative decoding's draft source
        if config.speculative_tokens > 0:
            c = config
            self.proposer = NgramProposer(
                c.speculative_tokens,
                c.speculative_max_ngram,
                c.speculative_min_ngram,
                c.speculative_max_batch,
            )

    # ------------------------------------------------------------------ queue
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def requests(self) -> itertools.chain[Request]:
        """Every request queued or admitted (waiting, prefilling, decoding)."""
        return itertools.chain(self.waiting, self.prefilling, self.running)

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens still to prefill: the rest of every admitted request's prompt, plus each
        waiting request's uncached part as of its arrival (LPM refreshes it every step it orders
        the queue). Routers read it in /health to see prefill other routers sent here. Requests of
        one ``prompt_group`` (the choices of an n > 1 request) compute their prompt once: the group
        counts its largest part."""
        total, groups = 0, {}
        parts = itertools.chain(
            ((len(r.token_ids) - r.kv_len, r.prompt_group) for r in self.prefilling),
            ((r.uncached_estimate, r.prompt_group) for r in self.waiting),
        )
        for rest, group in parts:
            if group is None:
                total += rest
            else:
                groups[group] = max(groups.get(group, 0), rest)
        return total + sum(groups.values())

    def add(self, req: Request) -> None:
        """Queue a request; raises QueueFullError at ``max_waiting`` beyond the free ``max_running``
        slots (a request that goes straight to a free slot does not wait; nor does it fill the queue)."""
        free = max(0, self.cfg.max_running - self.num_running)
        if len(self.waiting) >= self.cfg.max_waiting + free:
            raise QueueFullError(f"the waiting queue is full ({self.cfg.max_waiting} requests)")
        self._estimate(req)
        self.waiting.append(req)

    def _estimate(self, req: Request) -> None:
        req.uncached_estimate = len(req.token_ids) - self.cache.cached_prefix_len(self._matchable(req))

    @staticmethod
    def _matchable(req: Request) -> np.ndarray:
        """The tokens the cache may serve: none for a request that must compute its whole prompt."""
        return _keys(req, 0 if req.full_prefill else len(req.token_ids))

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Drop a request wherever it is and release its pages (its computed full pages stay cached)."""
        if req.finish_reason is None:
            req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
            return
        self._remove_active(req)
        self._release(req)

    def finish(self, req: Request, reason: str, keep_tokens: int | None = None) -> None:
        """End a running request (e.g. a stop string the engine found): cache and release its pages.
        ``keep_tokens``: its tokens past that many are dropped first (a verify step's tokens after
        the one that finished it)."""
        if keep_tokens is not None and keep_tokens < len(req.token_ids):
            dropped = len(req.token_ids) - keep_tokens
            del req.token_ids[keep_tokens:]
            req.kv_len = min(req.kv_len, keep_tokens)
            # NOTE: the verify step counted them: they were not generated after all, nor drafts kept
            kept, accepted = req.verify_counted
            self.stats.decode_tokens -= dropped
            self.stats.accepted_tokens -= accepted - min(kept - dropped, accepted)
        self.abort(req, reason)

    def _remove_active(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)

    # ------------------------------------------------------------------ step
    def schedule(self, now: float | None = None) -> ScheduledBatch | None:
        """The next step, or None when there is nothing to do. Prefill first, except that a decode
        step follows every extend step while requests are decoding (bounds inter-token latency)."""
        now = time.monotonic() if now is None else now
        batch = self._pick(now)
        # NOTE: admission reserves pages by estimate; if prefilling requests alone are stuck with no
        # decode to free pages, retract (lowest priority, newest first) until one can move.
        while batch is None and not self.running and len(self.prefilling) > 1:
            self._retract(self._victim())  # type: ignore[arg-type]
            batch = self._pick(now)
        return batch

    def _victim(self) -> Request | None:
        """Whom to preempt for pages: the lowest priority (largest value), a prefilling request
        before a decoding one, the newest first; None when a single request is active (it always
        fits: its prompt plus max_tokens were clamped to the pool)."""
        if len(self.running) + len(self.prefilling) <= 1:
            return None
        ranked = [((r.priority, 0, i), r) for i, r in enumerate(self.running)]
        ranked += [((r.priority, 1, i), r) for i, r in enumerate(self.prefilling)]
        return max(ranked, key=lambda kr: kr[0])[1]

    def _pick(self, now: float) -> ScheduledBatch | None:
        self._blocked, self._chained = None, 0
        if not (self.running and self._last_mode == "extend"):
            batch = self._schedule_extend(now)
            if batch is not None:
                self._last_mode = "extend"
                return batch
            if self.waiting and not self.prefilling:
                self._blocked = self._admission_state(len(self.running))
        if self.running:
            self._last_mode = "decode"
            batch = self._schedule_decode()
            if batch is not None:
                return batch
        batch = self._schedule_extend(now)
        self._last_mode = None if batch is None else "extend"
        return batch

    def commit(self, batch: ScheduledBatch, next_tokens: Sequence[Any]) -> list[Request]:
        """Record a finished step: K/V now cover ``ends``; sampled tokens are appended. Returns the
        requests that got a token; ``finish_reason`` is set on those that hit EOS or max_tokens
        (the caller passes them to ``finish`` after its own checks, e.g. stop strings). A verify
        step's ``next_tokens`` holds each request's accepted tokens, a list. A request that ended
        while the step ran (a step scheduled ahead: see ``schedule_ahead``) is skipped: its token
        is dropped."""
        if batch.mode == "verify":
            return commit_verify(self.stats, batch, next_tokens)
        out: list[Request] = []
        for i, req in enumerate(batch.requests):
            if req.finish_reason is not None:  # NOTE: ended at the step before (EOS, stop string, abort)
                continue
            req.kv_len = batch.ends[i]
            if batch.mode == "extend":
                self.stats.prefill_tokens += batch.ends[i] - batch.starts[i]
                self._cache_computed_pages(req)
            else:
                self.stats.decode_tokens += 1
            if not batch.sample[i]:
                continue
            token = int(next_tokens[i])
            req.token_ids.append(token)
            if batch.mode == "extend":
                self.prefilling.remove(req)
                self.running.append(req)
            if token in req.stop_token_ids:
                req.finish_reason = "stop"
            elif req.num_output >= req.max_tokens:
                req.finish_reason = "length"
            out.append(req)
        return out

    def fail(self, batch: ScheduledBatch, reason: str = "error") -> list[Request]:
        """The step's forward failed: end its requests and release their pages (nothing from this
        step is committed). Returns the failed requests; those that had already ended are not."""
        failed = [r for r in batch.requests if r.finish_reason is None]
        for req in failed:
            req.finish_reason = reason
            self._remove_active(req)
            self._release(req)
        return failed

    # ------------------------------------------------------------------ pages
    def _ensure_free(self, n: int) -> bool:
        """At least ``n`` free pages, evicting unlocked cache leaves if needed."""
        self.cache.make_room(n)
        return self.allocator.num_free >= n

    def _pages_short(self, req: Request, end: int) -> int:
        """Pages ``req`` lacks to cover positions [0, end): none when it holds more (a verify step
        leaves the pages of its rejected drafts with the request, for its next drafts to reuse)."""
        return max(0, _pages_for(end, self.ps) - req.pages.size)

    def _grow(self, req: Request, end: int) -> None:
        """Give ``req`` pages covering positions [0, end); caller ensured they are free."""
        need = self._pages_short(req, end)
        if need > 0:
            new = self.allocator.alloc(need)
            assert new is not None, "caller must ensure free pages first"
            req.pages = np.concatenate([req.pages, new])
            req.slots = np.concatenate([req.slots, self._page_slots(new)])

    def _page_slots(self, pages: np.ndarray) -> np.ndarray:
        """Slots of every token position held by ``pages`` (slot = page * page_size + offset)."""
        return (pages[:, None] * self.ps + np.arange(self.ps, dtype=np.int64)).reshape(-1)

    def _set_pages(self, req: Request, pages: np.ndarray) -> None:
        req.pages = pages
        req.slots = self._page_slots(pages)

    def _future_pages(self, req: Request) -> int:
        """Pages ``req`` may still need beyond what it holds: the rest of its prompt plus up to
        ``decode_reserve_tokens`` of output (an estimate; a shortfall is met by retraction)."""
        decode = min(req.max_tokens - req.num_output, self.cfg.decode_reserve_tokens)
        return self._pages_short(req, len(req.token_ids) + decode)

    def _cache_computed_pages(self, req: Request) -> None:
        """Insert the full pages computed so far into the tree and lock them, so a waiting request
        sharing this prefix reuses them next step (in-batch prefix sharing)."""
        full = req.kv_len // self.ps * self.ps
        if full <= req.tree_len:
            return
        tokens = _keys(req, full)
        self._insert(req, tokens, full)
        # NOTE: the probe token past ``full`` is never matched (match leaves >= 1 token uncached).
        match = self.cache.match_prefix(np.append(tokens, np.int32(0)))
        assert match.num_tokens == full and not match.host_nodes, "pages just inserted must match"
        self.cache.lock(match.last_node)
        if req.lock_node is not None:
            self.cache.unlock(req.lock_node)
        req.lock_node = match.last_node
        self._set_pages(req, np.concatenate([match.pages, req.pages[full // self.ps :]]))
        req.tree_len = full

    def _insert(self, req: Request, tokens: np.ndarray, full: int) -> None:
        """Insert tokens[:full] with req's pages; frees req's duplicates of pages the tree already had."""
        n = full // self.ps
        already = self.cache.insert(tokens[:full], req.pages[:n])
        # NOTE: pages [0, tree_len) came from the tree; ours in [tree_len, already) are duplicates;
        # pages [already, full) now belong to the tree: of the prompt's, what it wrote to the cache
        prompt = req.prompt_len // self.ps * self.ps
        written = min(full, prompt) - min(max(already, req.tree_len), prompt)
        req.cache_written = min(prompt, req.cache_written + max(0, written))
        dup = req.pages[req.tree_len // self.ps : already // self.ps]
        if dup.size:
            self.allocator.free(dup)

    def _release(self, req: Request) -> None:
        """Cache the request's computed full pages, free the rest, drop its lock."""
        full = req.kv_len // self.ps * self.ps
        n_tree = req.tree_len // self.ps
        if full > req.tree_len:
            self._insert(req, _keys(req, full), full)
            n_tree = full // self.ps
        tail = req.pages[n_tree:]
        if tail.size:
            self.allocator.free(tail)
        if req.lock_node is not None:
            self.cache.unlock(req.lock_node)
        self._set_pages(req, NO_PAGES)
        req.kv_len, req.tree_len, req.lock_node = 0, 0, None

    def _retract(self, req: Request) -> None:
        """Preempt a request to free pages: cache what it computed, requeue it at the front."""
        self._remove_active(req)
        self._release(req)
        req.retractions += 1
        self.stats.retractions += 1
        self._estimate(req)
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ extend
    def _order_waiting(self, now: float) -> list[tuple[Request, Any]]:
        """Waiting requests in admission order, with their prefix matches (LPM) or None (FCFS).
        Lower ``priority`` goes first, except that requests older than ``max_wait_s`` come first in
        arrival order (either policy), so nothing starves."""
        wait = self.cfg.max_wait_s

        def turn(r: Request) -> tuple:  # admission order: the overdue by arrival, then by priority
            return (0, r.arrival, 0) if now - r.arrival > wait else (1, r.priority, r.arrival)

        # NOTE: the window is the first requests in admission order, not in the queue's: an urgent
        # request behind more than a window of others waited for them all to drain
        waiting = self.waiting
        window = list(waiting) if len(waiting) <= self.cfg.lpm_window else heapq.nsmallest(
            self.cfg.lpm_window, waiting, key=turn)  # fmt: skip
        old = [r for r in window if now - r.arrival > wait]
        old_ids = {id(r) for r in old}
        young = [r for r in window if id(r) not in old_ids]
        old.sort(key=lambda r: r.arrival)
        if self.cfg.policy == "fcfs":
            return [(r, None) for r in old + sorted(young, key=lambda r: r.priority)]  # stable: arrival order
        matched = [(r, self.cache.match_prefix(self._matchable(r))) for r in young]
        for r, m in matched:
            r.uncached_estimate = len(r.token_ids) - m.num_tokens
        matched.sort(key=lambda rm: (rm[0].priority, -rm[1].num_tokens, rm[0].arrival))
        return [(r, None) for r in old] + matched

    def _chunk_end(self, start: int, total: int, budget: int) -> int:
        """End of a chunk from ``start``; page-aligned when it does not reach ``total``."""
        end = min(total, start + budget)
        if end < total and end // self.ps * self.ps > start:
            end = end // self.ps * self.ps
        return end

    def _new_page_key(self, req: Request, cached: int) -> tuple[int, bytes] | None:
        """Identifies the first uncomputed full page after ``cached`` tokens (sharing detection)."""
        if cached + self.ps > len(req.token_ids):
            return None
        return cached, _keys(req, cached + self.ps)[cached:].tobytes()

    def _schedule_extend(self, now: float) -> ScheduledBatch | None:
        if not (self.prefilling or self.waiting):
            return None
        budget = self.cfg.chunked_prefill_tokens
        items: list[tuple[Request, int, int]] = []
        reserved = sum(self._future_pages(r) for r in self.running)
        in_flight_keys: set[tuple[int, bytes]] = set()
        for req in self.prefilling:
            key = self._new_page_key(req, req.tree_len)
            if key is not None:
                in_flight_keys.add(key)
            if budget <= 0:
                reserved += self._future_pages(req)
                continue
            end = self._chunk_end(req.kv_len, len(req.token_ids), budget)
            if not self._ensure_free(self._pages_short(req, end)):
                reserved += self._future_pages(req)
                budget = 0
                continue
            self._grow(req, end)
            items.append((req, req.kv_len, end))
            budget -= end - req.kv_len
            reserved += self._future_pages(req)

        room = self.allocator.num_free + self.cache.evictable_pages - reserved
        if self.waiting and budget > 0 and room > 0 and self.num_running < self.cfg.max_running:
            self._admit(now, budget, reserved, in_flight_keys, items)
        if not items:
            return None
        return build_batch(
            "extend", items, [end == len(r.token_ids) for r, _, end in items], prefix_only=True
        )

    def _admit(
        self,
        now: float,
        budget: int,
        reserved: int,
        in_flight_keys: set[tuple[int, bytes]],
        items: list[tuple[Request, int, int]],
    ) -> None:
        """Move waiting requests into ``prefilling`` while token budget, slots and pages allow."""
        for req, _ in self._order_waiting(now):
            if budget <= 0 or self.num_running >= self.cfg.max_running:
                break
            match = self.cache.match_prefix(self._matchable(req))
            # NOTE: a full prefill computes its own pages whoever else computes the same ones
            key = None if req.full_prefill else self._new_page_key(req, match.num_tokens)
            if key is not None and key in in_flight_keys:
                continue  # NOTE: another request computes this page now; take it from the tree next step
            self.cache.lock(match.last_node)
            # NOTE: the match's host part needs device pages like uncached tokens, but no compute
            self._set_pages(req, match.pages.copy())
            req.kv_len, req.tree_len, req.lock_node = match.num_tokens, match.num_tokens, match.last_node
            end = self._chunk_end(req.kv_len, len(req.token_ids), budget)
            need_now = self._pages_short(req, end)
            need_total = self._future_pages(req)
            available = self.allocator.num_free + self.cache.evictable_pages - reserved
            if need_total > available or not self._ensure_free(need_now):
                self.cache.unlock(match.last_node)
                self._set_pages(req, NO_PAGES)
                req.kv_len, req.tree_len, req.lock_node = 0, 0, None
                break  # NOTE: no skipping ahead of a request that does not fit: it would starve
            if match.host_nodes:
                self._set_pages(req, self.cache.load_back(match))
            self._grow(req, end)
            reserved += need_total - need_now
            self.waiting.remove(req)
            self.prefilling.append(req)
            if req.cached_tokens < 0:
                req.cached_tokens = match.num_tokens
                self.stats.prompt_tokens += req.prompt_len
                self.stats.cached_tokens += match.num_tokens
            if key is not None:
                in_flight_keys.add(key)
            items.append((req, req.kv_len, end))
            budget -= end - req.kv_len

    # ------------------------------------------------------------------ decode
    def _schedule_decode(self) -> ScheduledBatch | None:
        def needs_page(r: Request) -> bool:
            return r.kv_len >= r.pages.size * self.ps

        # NOTE: one request alone fits the pool, so retracting others until it does ends in progress;
        # None when it does not fit now only because a KV transfer holds pages (an export's locked
        # prefix, an import's pages): it waits with the others until they are given back
        while not self._ensure_free(sum(needs_page(r) for r in self.running)):
            victim = self._victim()
            if victim is None:
                (alone,) = self.running
                if _pages_for(alone.kv_len + 1, self.ps) > self.allocator.num_pages:
                    raise RuntimeError("KV pool cannot hold a single request; check its capacity")
                victim = alone
            self._retract(victim)
        if not self.running:
            return None
        items = []
        for req in self.running:
            self._grow(req, req.kv_len + 1)
            items.append((req, req.kv_len, req.kv_len + 1))
        drafts = self._drafts()
        if drafts is not None:
            for i, (req, start, _) in enumerate(items):
                self._grow(req, start + 1 + len(drafts[i]))
                items[i] = (req, start, start + 1 + len(drafts[i]))
            return build_batch("verify", items, [True] * len(items), prefix_only=True, drafts=drafts)
        return build_batch("decode", items, [True] * len(items), prefix_only=False)

    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after ``batch`` (a decode or extend step still running, not committed),
        or None when it cannot be known before ``batch``'s tokens are. After a decode step: None
        while a request is prefilling or could be admitted (the next step may be an extend; a
        waiting request with every slot of ``max_running`` taken, or one that found too few pages
        and nothing freed since, cannot). After an extend step the next step is a decode step
        anyway (see schedule), over the running requests and those ``batch`` finishes prefilling.
        Also None when drafts may be proposed or its pages would need a retraction.

        Each request decodes one position further than ``batch`` leaves it: a request of ``batch``
        takes ``batch``'s sampled token for it as input (``inputs_from``: taken on the device), a
        request decoding beside an extend step its last token. A request that ``batch`` finishes
        by length is left out; one that it ends otherwise (EOS, a stop string, an abort) is
        skipped at commit."""
        if batch.mode not in ("decode", "extend"):
            return None
        sampled = np.cumsum(batch.sample) - 1  # NOTE: a row's place among the tokens ``batch`` samples
        rows = [i for i, (r, s) in enumerate(zip(batch.requests, batch.sample, strict=True))
                if s and r.finish_reason is None and r.num_output + 1 < r.max_tokens]  # fmt: skip
        if batch.mode == "decode":
            if self.prefilling:
                return None
            if len(self.running) != sum(r.finish_reason is None for r in batch.requests):
                return None  # NOTE: every running request is in ``batch`` unless one joined since
            if self.waiting and len(rows) < self.cfg.max_running and not self._still_blocked(len(rows)):
                return None  # NOTE: a slot is (or will be, after ``batch``) free for a waiting request
            beside: list[Request] = []
        else:
            beside = list(self.running)  # NOTE: an extend step's requests are all prefilling
        if not rows and not beside:
            return None
        if self.proposer is not None and len(beside) + len(rows) <= self.proposer.max_batch:
            return None  # NOTE: that step may check drafts (a verify step)
        ahead = [(r, r.kv_len) for r in beside] + [(batch.requests[i], batch.ends[i]) for i in rows]
        need = sum(self._pages_short(r, end + 1) for r, end in ahead)
        if not self._ensure_free(need):
            return None
        for r, end in ahead:
            self._grow(r, end + 1)
        inputs_from = np.asarray([-1] * len(beside) + [sampled[i] for i in rows], dtype=np.int64)
        step = build_batch("decode", [(r, end, end + 1) for r, end in ahead], [True] * len(ahead),
                           prefix_only=False, inputs_from=inputs_from)  # fmt: skip
        self.stats.ahead_steps += 1
        self._chained += 1
        self._last_mode = "decode"
        return step

    def _admission_state(self, running: int) -> tuple:
        """What decides whether the waiting queue's head is admitted: which request heads the queue,
        how many wait, how many decode, and the pages admission may count on."""
        reserved = sum(self._future_pages(r) for r in self.running)
        available = self.allocator.num_free + self.cache.evictable_pages - reserved
        return self.waiting[0], len(self.waiting), running, available

    def _still_blocked(self, running: int) -> bool:
        """Would admission still fail as it did at the last schedule()? The same head and queue, the same
        requests decoding and no more pages to count on; rechecked at least every MAX_CHAIN_BLOCKED steps
        (the queue's order also ages)."""
        if self._blocked is None or self._chained >= MAX_CHAIN_BLOCKED:
            return False
        head, waiting, decoding, available = self._admission_state(running)
        was_head, was_waiting, was_decoding, was_available = self._blocked
        return (head is was_head and (waiting, decoding) == (was_waiting, was_decoding)
                and available <= was_available)  # fmt: skip

    def _drafts(self) -> list[list[int]] | None:
        """Each running request's draft tokens for a verify step, or None for a plain decode step:
        no proposer, too many requests, nothing proposed, or not enough free pages for the drafts
        (a draft never evicts cached pages or preempts a request)."""
        if self.proposer is None or len(self.running) > self.proposer.max_batch:
            return None
        drafts = [self.proposer.propose(r) for r in self.running]
        if not any(drafts):
            return None
        grow = zip(self.running, drafts, strict=True)
        need = sum(self._pages_short(r, r.kv_len + 1 + len(d)) for r, d in grow)
        return drafts if need <= self.allocator.num_free else None

    # ------------------------------------------------------------------ checks
    def pages_accounted(self) -> tuple[int, int, int]:
        """(free, tree, request-owned) pages; they sum to the pool size when nothing leaked."""
        owned = sum(r.pages.size - r.tree_len // self.ps for r in (*self.prefilling, *self.running))
        return self.allocator.num_free, self.cache.total_pages, owned
