"""Routing policies: pick one worker for a request from its block hashes and the workers' loads.

Pure and synchronous: no I/O, no clocks, no awaiting; the caller owns loads and health. Every
policy reports predicted cached tokens for every candidate and a human-readable reason.

Policies and parameters (``make_policy(name, index, params)``; ``describe()`` returns them):

- ``round_robin``: candidates in turn. No parameters.
- ``random``: uniform choice. ``seed`` (int | None, default None).
- ``least_load``: power of two choices — two distinct random candidates, the lower load wins.
  ``seed`` (int | None, default None).
- ``prefix_hash``: consistent hashing (mmh3 ring, virtual nodes) of the first ``prefix_blocks``
  blocks (default 8) with bounded loads: a worker whose load after taking the request would
  exceed ceil(``load_factor`` (default 1.25) x the mean) passes the request on clockwise; if every
  worker is over, the least loaded takes it. ``vnodes`` (default 100) points per worker.
  Prompts shorter than one block go to the least loaded worker.
- ``cache_aware`` (default): the longest predicted cached prefix wins among admissible workers;
  ties go to the lower load, then to the highest rendezvous hash of (worker, first block) so that
  router replicas agree where a new prefix goes. Worker ``w`` is admissible when
  ``load_w - min_load <= max(balance_abs, min(balance_rel x mean_load, saved_w / tokens_per_load))``
  where ``saved_w`` = its predicted cached tokens minus the most that any least-loaded worker holds
  (the prefill it saves over going to the least loaded). So a holder may be ``balance_abs`` (default
  2.0) requests busier than the least loaded worker whatever it saves or, if more, one request per
  ``tokens_per_load`` (default 32) tokens it saves, that part capped at ``balance_rel`` (default
  2.0) x the mean load. Loads are in load units: outstanding requests, plus the router's pending
  prefill (router/workers.py). ``tokens_per_load=0`` gives
  any saving the whole ``balance_rel`` window: the saving-blind rule (the former default, with
  ``balance_rel=0.1``).
  Misses therefore go to the least loaded worker, never to the worker with the smallest cache. A
  hot prefix spreads to a second worker once its holder is busier than its window, and that worker
  becomes a holder too (insert on route). A fresh worker (nothing of it in the prefix index: just
  added, restarted, or at start-up) earns the others no window: while one is among the least
  loaded, holders are admissible only within ``balance_abs``. Without that, once enough of the
  fleet holds the common prefixes, their windows exceed their loads and an added worker would get
  no request at all.

Every policy inserts the routed prompt into the prefix index in ``on_routed`` (optimistic), so
predicted cached tokens stay meaningful whichever policy runs; worker events correct it.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import mmh3

from router.prefix_index import PrefixIndex

_MASK64 = (1 << 64) - 1
_RING_EPOCH = 10_000  # prefix_hash picks: a worker not a candidate for one or two of these leaves the ring


@dataclass(slots=True)  # NOTE: not frozen: one is made per worker per request, and frozen costs 2.5x
class Candidate:
    url: str
    load: float  # blended load (router in-flight + worker-reported queue), lower is better


@dataclass(frozen=True, slots=True)
class RouteRequest:
    block_hashes: Sequence[int]  # chained hashes of the prompt's full blocks (may be lazy: PromptHashes)
    prompt_tokens: int
    block_size: int  # tokens per block

    def cacheable(self, matched: int) -> int:
        """Of ``matched`` tokens a worker holds, those it serves from its cache: it computes the
        prompt's last token at least, so a prompt of whole blocks computes its last block."""
        return max(0, min(matched, (self.prompt_tokens - 1) // self.block_size * self.block_size))


@dataclass(slots=True)
class Decision:
    url: str
    matched_tokens: dict[str, int]  # predicted cached tokens per candidate (every candidate, 0 if none)
    reason: str  # why the winner won, human-readable, for /debug/route and logs


def kv_fetch_source(decision: Decision, min_tokens: int, load: Callable[[str], float | None]) -> str | None:
    """The worker ``decision``'s pick may fetch the prompt's cached KV from (router
    --kv-fetch-min-tokens): the candidate predicted to hold the most of the prompt, when that is at
    least ``min_tokens`` more than the pick holds (ties: the least loaded; ``load`` is None for a
    worker no longer known); None when ``min_tokens`` is 0 (off) or no candidate does."""
    if not min_tokens:  # NOTE: off, the default: every request passes here
        return None
    matched = decision.matched_tokens
    most = max(matched.values(), default=0)
    if most - matched.get(decision.url, 0) < min_tokens:
        return None
    holders = [(lo, url) for url, n in matched.items() if n == most and (lo := load(url)) is not None]
    return min(holders)[1] if holders else None


def _h64(data: bytes) -> int:
    return mmh3.hash128(data, 0, True, False) & _MASK64


def _rendezvous(url: str, key: int) -> int:
    """Highest-random-weight score of ``url`` for ``key`` (a block hash); same on every replica."""
    return _h64(key.to_bytes(8, "little") + url.encode("utf-8"))


def _least_loaded(candidates: Sequence[Candidate], key: int) -> Candidate:
    """Lowest load; exact ties broken by rendezvous hash of ``key``."""
    low = min(c.load for c in candidates)
    tied = [c for c in candidates if c.load == low]
    if len(tied) == 1:
        return tied[0]
    return max(tied, key=lambda c: _rendezvous(c.url, key))


class Policy:
    """Base: parameter handling, predicted cached tokens, optimistic insert on route."""

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, index: PrefixIndex, params: dict[str, Any] | None = None) -> None:
        params = dict(params or {})
        unknown = set(params) - set(self.defaults)
        if unknown:
            accepted = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(
                f"policy {self.name!r}: unknown parameter(s) {sorted(unknown)}; accepts {accepted}"
            )
        self.index = index
        self.params: dict[str, Any] = {**self.defaults, **params}

    def _number(self, name: str, kind: type[int] | type[float] = float) -> Any:
        """Parameter ``name`` as ``kind``; ValueError naming it when it is not one (a bool, text,
        a fraction where a count is wanted)."""
        value = self.params[name]
        try:
            if isinstance(value, bool) or (
                kind is int and isinstance(value, float) and not value.is_integer()
            ):
                raise TypeError
            return kind(value)
        except (TypeError, ValueError):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"policy {self.name!r}: {name} must be {what}, not {value!r}") from None

    def _seeded_rng(self) -> random.Random:
        seed = self.params["seed"]
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"policy {self.name!r}: seed must be an integer or null, not {seed!r}")
        return random.Random(seed)

    def select(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of ``candidates`` (non-empty) for ``req``."""
        raise NotImplementedError

    def preview(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """``select`` without moving the policy on (its random draws; round robin's turn): what
        /debug/route shows is what the next request would get, and asking does not change that."""
        rng = getattr(self, "_rng", None)
        state = None if rng is None else rng.getstate()
        try:
            return self.select(req, candidates)
        finally:
            if rng is not None:
                rng.setstate(state)

    def on_routed(self, req: RouteRequest, url: str, max_blocks: int | None = None) -> int:
        """The request was sent to ``url``: optimistically record its prefix there (at most
        ``max_blocks``: what the worker's context can hold, so no prompt it must refuse floods the
        index's budget). Returns the insert's tick (``on_refused``)."""
        hashes = req.block_hashes
        return self.index.insert(
            url, hashes if max_blocks is None or max_blocks >= len(hashes) else hashes[:max_blocks]
        )

    def on_refused(
        self,
        req: RouteRequest,
        url: str,
        held_blocks: int,
        tick: int,
        max_blocks: int | None = None,
        followed: bool = False,
    ) -> None:
        """``url`` answered that it will not serve the request (4xx): take back what ``on_routed``
        recorded at ``tick`` beyond the ``held_blocks`` it was predicted to hold before, unless
        something touched it since (PrefixIndex.take_back). ``followed``: the index follows the
        worker's KV events, so what the worker holds is known apart from what was only predicted
        there: the predicted prefix is taken back too, except the blocks its stored events named
        (a prefix predicted only because other attempts, since ended, were sent there would stay
        for good otherwise). Only the blocks ``on_routed`` could have recorded (at most
        ``max_blocks``) are looked at: the rest of a long prompt is never hashed for it."""
        start = 0 if followed else held_blocks
        if len(req.block_hashes) > start:
            self.index.take_back(url, req.block_hashes[start:max_blocks], tick)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}

    def _matched_blocks(self, req: RouteRequest, candidates: Sequence[Candidate]) -> dict[str, int]:
        held = self.index.match(req.block_hashes) if req.block_hashes else {}
        return {c.url: held.get(c.url, 0) for c in candidates}

    @staticmethod
    def _tokens(blocks: dict[str, int], req: RouteRequest) -> dict[str, int]:
        return {url: n * req.block_size for url, n in blocks.items()}


class OptimisticInsert:
    """One attempt's optimistic insert and its take-back. Called once the request is written
    (``sent``); ``record`` inserts earlier, before a new connection is opened for it, so that the
    requests decided while it opens see the prefix there (a burst on a cold connection pool is
    otherwise routed blind). Taken back when the worker answers that it will not serve the request
    (4xx, 429) or when it was never written (no connection): such a prompt is not recorded as cached
    there. An attempt that reached the worker and ended without its answer (the client left, a
    timeout, a 5xx) is taken back only where the worker's KV events put back what it did compute
    (Router._forget_unconfirmed); elsewhere it stays, since the worker may well have computed it."""

    __slots__ = ("_max_blocks", "_policy", "_req", "_tick", "_url", "held_blocks", "sent")

    def __init__(
        self, policy: Policy, req: RouteRequest, url: str, held_blocks: int, max_blocks: int | None
    ) -> None:
        self._policy, self._req, self._url = policy, req, url
        self.held_blocks = held_blocks  # what the worker was predicted to hold before
        self._max_blocks = max_blocks
        self._tick: int | None = None  # set while inserted
        self.sent = False

    def __call__(self) -> None:
        self.sent = True
        self.record()

    def record(self) -> None:
        """Insert the prompt's blocks for the worker, once."""
        if self._tick is None:
            self._tick = self._policy.on_routed(self._req, self._url, self._max_blocks)

    def take_back(self, followed: bool = False) -> None:
        """``followed``: the index follows the worker's KV events (Policy.on_refused)."""
        if self._tick is not None:
            self._policy.on_refused(
                self._req, self._url, self.held_blocks, self._tick, self._max_blocks, followed
            )
            self._tick = None


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, index: PrefixIndex, params: dict[str, Any] | None = None) -> None:
        super().__init__(index, params)
        self._turn = 0

    def select(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        decision = self.preview(req, candidates)
        self._turn += 1
        return decision

    def preview(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        pick = candidates[self._turn % len(candidates)]
        blocks = self._matched_blocks(req, candidates)
        return Decision(pick.url, self._tokens(blocks, req), "round robin turn")


class RandomChoice(Policy):
    name = "random"
    defaults = {"seed": None}

    def __init__(self, index: PrefixIndex, params: dict[str, Any] | None = None) -> None:
        super().__init__(index, params)
        self._rng = self._seeded_rng()

    def select(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        pick = self._rng.choice(candidates)
        blocks = self._matched_blocks(req, candidates)
        return Decision(pick.url, self._tokens(blocks, req), "uniform random choice")


class LeastLoad(Policy):
    name = "least_load"
    defaults = {"seed": None}

    def __init__(self, index: PrefixIndex, params: dict[str, Any] | None = None) -> None:
        super().__init__(index, params)
        self._rng = self._seeded_rng()

    def select(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        blocks = self._matched_blocks(req, candidates)
        if len(candidates) == 1:
            return Decision(candidates[0].url, self._tokens(blocks, req), "only candidate")
        a, b = self._rng.sample(range(len(candidates)), 2)
        first, second = candidates[a], candidates[b]
        pick, other = (first, second) if first.load <= second.load else (second, first)
        reason = f"power of two choices: load {pick.load:g} vs {other.load:g} on {other.url}"
        return Decision(pick.url, self._tokens(blocks, req), reason)


MAX_VNODES = 10_000  # ring points a worker at most (the default is 100)


class PrefixHash(Policy):
    name = "prefix_hash"
    defaults = {"prefix_blocks": 8, "load_factor": 1.25, "vnodes": 100}

    def __init__(self, index: PrefixIndex, params: dict[str, Any] | None = None) -> None:
        super().__init__(index, params)
        self._prefix_blocks = self._number("prefix_blocks", int)
        self._vnodes = self._number("vnodes", int)
        self._load_factor = self._number("load_factor")
        if self._prefix_blocks < 1 or self._vnodes < 1:
            raise ValueError("prefix_hash: prefix_blocks and vnodes must be >= 1")
        if self._vnodes > MAX_VNODES:  # NOTE: the ring is built at a request: 1e6 a worker took 8 s, 318 MiB
            raise ValueError(f"prefix_hash: vnodes must be at most {MAX_VNODES:,}, not {self._vnodes:,}")
        if not self._load_factor >= 1.0:  # NaN fails too
            raise ValueError("prefix_hash: load_factor must be >= 1.0")
        # NOTE: one ring over the workers seen as candidates lately, walked past those not among a
        # request's: the pick is the ring of the candidates alone's (their points are the same), and
        # requests of two affinity groups, or a retry that leaves a worker out, share it
        self._ring_urls: set[str] = set()
        self._points: list[int] = []  # sorted ring positions (64-bit)
        self._owners: list[str] = []  # url owning each point
        self._url_points: dict[str, list[int]] = {}  # each ring worker's vnode positions (hashed once)
        self._seen: set[str] = set()  # candidates in this epoch of _RING_EPOCH picks
        self._seen_before: set[str] = set()  # ... and in the one before
        self._picks = 0

    def _ring(self, urls: Collection[str]) -> None:
        """Put ``urls`` on the ring. A worker not on it yet builds it again, of the workers seen as
        candidates in the last one or two epochs: workers gone leave it then."""
        self._picks += 1
        if self._picks % _RING_EPOCH == 0:
            self._seen_before, self._seen = self._seen, set()
        self._seen.update(urls)
        if self._ring_urls.issuperset(urls):
            return
        fresh = self._seen | self._seen_before
        vnodes = self._vnodes
        self._url_points = {
            url: self._url_points.get(url) or [_h64(f"{url}#{i}".encode()) for i in range(vnodes)]
            for url in fresh
        }
        points = sorted((p, url) for url, ps in self._url_points.items() for p in ps)
        self._points = [p for p, _ in points]
        self._owners = [u for _, u in points]
        self._ring_urls = fresh

    def select(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        blocks = self._matched_blocks(req, candidates)
        if not req.block_hashes:
            pick = _least_loaded(candidates, 0)
            return Decision(
                pick.url, self._tokens(blocks, req), "prompt shorter than one block: least loaded"
            )
        # NOTE: hashes chain, so the hash of block k-1 identifies the whole k-block leading prefix.
        key = req.block_hashes[min(self._prefix_blocks, len(req.block_hashes)) - 1]
        by_url = {c.url: c for c in candidates}
        self._ring(by_url)
        points, owners = self._points, self._owners
        total = sum(c.load for c in candidates)
        # NOTE: the ceiling keeps at least one worker under the bound when loads are integers.
        cap = math.ceil(self._load_factor * (total + 1) / len(candidates))
        start = bisect_right(points, key)
        seen: set[str] = set()
        n_points = len(points)
        for i in range(n_points):
            url = owners[(start + i) % n_points]
            if url in seen or url not in by_url:
                continue
            seen.add(url)
            load = by_url[url].load
            if load + 1 <= cap:
                skipped = len(seen) - 1
                why = (
                    "ring owner" if not skipped else f"ring successor #{skipped} (earlier ones at the bound)"
                )
                reason = f"consistent hash of leading prefix: {why}, load {load:g} + 1 <= bound {cap:g}"
                return Decision(url, self._tokens(blocks, req), reason)
            if len(seen) == len(by_url):
                break
        pick = _least_loaded(candidates, key)
        reason = f"every worker over the load bound {cap:g}: least loaded"
        return Decision(pick.url, self._tokens(blocks, req), reason)


class CacheAware(Policy):
    name = "cache_aware"
    defaults = {"balance_abs": 2.0, "balance_rel": 2.0, "tokens_per_load": 32.0}

    def __init__(self, index: PrefixIndex, params: dict[str, Any] | None = None) -> None:
        super().__init__(index, params)
        self._abs = self._number("balance_abs")
        self._rel = self._number("balance_rel")
        self._tokens_per_load = self._number("tokens_per_load")
        if not (self._abs >= 0 and self._rel >= 0 and self._tokens_per_load >= 0):  # NaN fails too
            raise ValueError("cache_aware: balance_abs, balance_rel and tokens_per_load must be >= 0")

    def _window(self, saved_tokens: int, cap_load: float) -> float:
        """Load above the least loaded worker that a worker saving ``saved_tokens`` may carry, its
        saving-earned part capped at ``balance_rel`` x ``cap_load`` (the mean load, or 0)."""
        cap = self._rel * cap_load
        if saved_tokens > 0:
            earned = cap if self._tokens_per_load == 0 else min(cap, saved_tokens / self._tokens_per_load)
        else:
            earned = 0.0
        return max(self._abs, earned)

    def select(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        blocks = self._matched_blocks(req, candidates)
        tokens = self._tokens(blocks, req)
        min_load = min(c.load for c in candidates)
        mean_load = sum(c.load for c in candidates) / len(candidates)
        # NOTE: a fresh least-loaded worker closes the saving-earned windows (see the module docstring)
        fresh = next(
            (c.url for c in candidates if c.load == min_load and not self.index.worker_entries(c.url)), None
        )
        cap_load = 0.0 if fresh else mean_load
        # NOTE: the baseline is what the request gets at no extra load: the best least-loaded worker.
        base = max(tokens[c.url] for c in candidates if c.load == min_load)
        near = min_load + self._abs
        # NOTE: only a worker past balance_abs that saves something needs its own window (O(holders)).
        admissible = [
            c
            for c in candidates
            if c.load <= near
            or (tokens[c.url] > base and c.load - min_load <= self._window(tokens[c.url] - base, cap_load))
        ]
        best = max(admissible, key=lambda c: (blocks[c.url], -c.load))
        top = (blocks[best.url], best.load)
        tied = [c for c in admissible if (blocks[c.url], c.load) == top]
        key = req.block_hashes[0] if req.block_hashes else 0
        if len(tied) > 1:
            best = max(tied, key=lambda c: _rendezvous(c.url, key))
        matched = tokens[best.url]
        if matched:
            reason = f"longest cached prefix among admissible: {matched} tokens (load {best.load:g}"
            if best.load > min_load:
                reason += (
                    f", {best.load - min_load:g} over the least loaded, window "
                    f"{self._window(matched - base, cap_load):g} for {matched - base} tokens saved"
                )
            reason += ")"
        else:
            reason = f"no cached prefix among admissible: least loaded (load {best.load:g})"
        if len(tied) > 1:
            reason += f", rendezvous tie-break among {len(tied)}"
        most = max(blocks.values())
        if most > blocks[best.url]:
            holder = min((c for c in candidates if blocks[c.url] == most), key=lambda c: c.load)
            window = self._window(tokens[holder.url] - base, cap_load)
            reason += (
                f"; {holder.url} holds {tokens[holder.url]} tokens but its load {holder.load:g} is "
                f"{holder.load - min_load:g} over the least loaded, past its window {window:g}"
            )
            if fresh:
                reason += f" ({fresh} is fresh: windows are balance_abs)"
        return Decision(best.url, tokens, reason)


_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobin, RandomChoice, LeastLoad, PrefixHash, CacheAware)
}
POLICY_NAMES = ("round_robin", "random", "least_load", "prefix_hash", "cache_aware")


def make_policy(name: str, index: PrefixIndex, params: dict[str, Any] | None = None) -> Policy:
    """Build the policy ``name`` over ``index``; unknown names or parameters raise ValueError."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return cls(index, params)
