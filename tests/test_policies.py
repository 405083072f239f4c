"""Routing policies: spread, load awareness, consistent hashing, cache affinity under load."""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest

from router.block_hash import block_hashes
from router.config import RouterConfig
from router.gateway import Router
from router.policies import POLICY_NAMES, Candidate, Decision, RouteRequest, make_policy
from router.prefix_index import PrefixIndex

BLOCK = 4  # tokens per block, small to keep the simulations fast


def request(tokens: list[int]) -> RouteRequest:
    return RouteRequest(block_hashes(tokens, BLOCK), len(tokens), BLOCK)


def idle(urls: list[str]) -> list[Candidate]:
    return [Candidate(u, 0.0) for u in urls]


URLS = [f"http://w{i}" for i in range(4)]


def test_every_policy_reports_predicted_tokens_for_every_candidate() -> None:
    for name in POLICY_NAMES:
        index = PrefixIndex()
        policy = make_policy(name, index, {"seed": 1} if name in ("random", "least_load") else None)
        req = request(list(range(40)))
        index.insert(URLS[2], req.block_hashes[:3])
        decision = policy.select(req, idle(URLS))
        assert decision.url in URLS
        assert decision.matched_tokens == {URLS[0]: 0, URLS[1]: 0, URLS[2]: 12, URLS[3]: 0}
        assert decision.reason
        policy.on_routed(req, decision.url)
        assert index.match(req.block_hashes)[decision.url] == 10  # optimistic insert on route
        assert policy.describe()["name"] == name


def test_a_preview_is_what_the_next_select_picks_and_moves_no_policy_on() -> None:
    # /debug/route previews: asking must not spend round robin's turn or a random draw
    for name in POLICY_NAMES:
        policy = make_policy(name, PrefixIndex(), {"seed": 3} if name in ("random", "least_load") else None)
        req = request(list(range(40)))
        picks = []
        for _ in range(12):
            previews = {policy.preview(req, idle(URLS)).url for _ in range(3)}
            picked = policy.select(req, idle(URLS)).url
            assert previews == {picked}, name
            picks.append(picked)
        if name in ("round_robin", "random"):
            assert len(set(picks)) > 1, name  # NOTE: the policy still moves on when it selects


def test_unknown_policy_or_parameter_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("smallest_tree", PrefixIndex())
    with pytest.raises(ValueError, match="balance_abs"):
        make_policy("cache_aware", PrefixIndex(), {"balance": 3})
    assert make_policy("cache_aware", PrefixIndex()).describe()["params"] == {
        "balance_abs": 2.0,
        "balance_rel": 2.0,
        "tokens_per_load": 32.0,
    }
    for bad in ({"tokens_per_load": -1}, {"balance_rel": -0.5}, {"balance_abs": float("nan")}):
        with pytest.raises(ValueError, match="must be >= 0"):
            make_policy("cache_aware", PrefixIndex(), bad)


def test_round_robin_spreads_evenly() -> None:
    policy = make_policy("round_robin", PrefixIndex())
    req = request(list(range(16)))
    counts = Counter(policy.select(req, idle(URLS)).url for _ in range(400))
    assert counts == {u: 100 for u in URLS}


def test_least_load_prefers_the_lighter_worker() -> None:
    policy = make_policy("least_load", PrefixIndex(), {"seed": 3})
    req = request(list(range(16)))
    two = [Candidate("http://busy", 10.0), Candidate("http://free", 0.0)]
    assert {policy.select(req, two).url for _ in range(50)} == {"http://free"}
    three = [*two, Candidate("http://mid", 5.0)]
    picks = Counter(policy.select(req, three).url for _ in range(300))
    assert picks["http://busy"] == 0  # the heaviest never wins a pair
    assert picks["http://free"] > picks["http://mid"]


def test_prefix_hash_moves_only_about_one_nth_of_keys_when_a_worker_joins() -> None:
    policy = make_policy("prefix_hash", PrefixIndex(), {"prefix_blocks": 2})
    reqs = [request([k, k + 1, k + 2, k + 3, 7, 7, 7, 7, 9]) for k in range(0, 4000, 4)]
    before = [policy.select(r, idle(URLS)).url for r in reqs]
    assert min(Counter(before).values()) > 150  # 1000 keys over 4 workers, none starved
    grown = [*URLS, "http://w4"]
    after = [policy.select(r, idle(grown)).url for r in reqs]
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert 0.1 < len(moved) / len(reqs) < 0.3  # ~1/5 expected
    assert all(b == "http://w4" for _, b in moved)  # keys only move to the newcomer


def test_prefix_hash_picks_for_a_subset_of_workers_as_a_ring_of_that_subset_would() -> None:
    """Requests whose candidates alternate (two affinity groups, a retry without one worker, a worker
    gone) pick as a policy that only ever saw those candidates: their keys' owners, clockwise."""
    fleet = [f"http://w{i}" for i in range(12)]
    subsets = [fleet, fleet[:5], fleet[5:], fleet[1:], fleet[::3]]
    shared = make_policy("prefix_hash", PrefixIndex(), {"prefix_blocks": 2})
    alone = {i: make_policy("prefix_hash", PrefixIndex(), {"prefix_blocks": 2}) for i in range(len(subsets))}
    for k in range(0, 2000, 4):
        i = (k // 4) % len(subsets)
        req = request([k, k + 1, k + 2, k + 3, 7, 7, 7, 7, 9])
        assert shared.select(req, idle(subsets[i])).url == alone[i].select(req, idle(subsets[i])).url


def test_prefix_hash_builds_its_ring_once_for_alternating_candidates_and_forgets_workers_gone(monkeypatch):
    """Ten candidate sets in turn build no ring after the first; a fleet whose workers are replaced
    one by one (pods restarted at new addresses) keeps on its ring only those seen lately."""
    from router import policies

    policy = make_policy("prefix_hash", PrefixIndex(), {"prefix_blocks": 2})
    fleet = [f"http://w{i}" for i in range(12)]
    subsets = [fleet, *(fleet[i::9] for i in range(9))]
    req = request([1, 2, 3, 4, 7, 7, 7, 7, 9])
    policy.select(req, idle(fleet))
    ring = policy._points
    for _ in range(3):
        for subset in subsets:
            policy.select(req, idle(subset))
    assert policy._points is ring  # not built again
    monkeypatch.setattr(policies, "_RING_EPOCH", 5)
    live = list(fleet)
    for n in range(100):
        live = [*live[1:], f"http://new{n}"]  # one worker replaced by a newcomer
        for _ in range(3):
            policy.select(req, idle(live))
    assert set(live) <= policy._ring_urls and len(policy._ring_urls) <= 2 * len(live)


def test_prefix_hash_bounds_the_load_of_a_hot_prefix() -> None:
    policy = make_policy("prefix_hash", PrefixIndex(), {"load_factor": 1.25})
    req = request(list(range(64)))
    loads = dict.fromkeys(URLS, 0.0)
    for _ in range(200):  # one hot prefix, nothing completes: load only grows
        url = policy.select(req, [Candidate(u, load) for u, load in loads.items()]).url
        loads[url] += 1
        mean = sum(loads.values()) / len(loads)
        assert max(loads.values()) <= 1.25 * mean + 1
    assert policy.select(request(list(range(64))), idle(URLS)).url == policy.select(req, idle(URLS)).url


def test_prefix_hash_passes_on_where_the_request_would_take_the_owner_past_the_bound() -> None:
    """The bound counts the request being placed (docs/router.md): idle, the owner takes it (0 + 1 <= 1);
    one request on it, the next goes clockwise (1 + 1 > ceil(1.25 x 2 / n)), and the reason says so."""
    policy = make_policy("prefix_hash", PrefixIndex(), {"load_factor": 1.25})
    req = request(list(range(64)))
    first = policy.select(req, idle(URLS))
    assert "ring owner, load 0 + 1 <= bound 1" in first.reason
    busy = [Candidate(u, 1.0 if u == first.url else 0.0) for u in URLS]
    second = policy.select(req, busy)
    assert second.url != first.url and "ring successor #1 (earlier ones at the bound)" in second.reason


# ---- cache_aware: the load window grows with the predicted saving ----------------------------------


def holder_setup(
    held_tokens: int, holder_load: float, other_load: float, others_fresh: bool = False
) -> tuple[RouteRequest, PrefixIndex, list[Candidate]]:
    """URLS[0] holds the first ``held_tokens`` of a 1,024-token prompt; the others hold nothing of
    it (an unrelated prompt each, or, with ``others_fresh``, nothing at all)."""
    index = PrefixIndex()
    req = request(list(range(1024)))
    index.insert(URLS[0], req.block_hashes[: held_tokens // BLOCK])
    if not others_fresh:
        for i, url in enumerate(URLS[1:]):
            index.insert(url, request([5000 + i] * 64).block_hashes)
    loads = [holder_load] + [other_load] * (len(URLS) - 1)
    return req, index, [Candidate(u, load) for u, load in zip(URLS, loads, strict=True)]


def test_cache_aware_keeps_a_long_prefix_on_a_busier_holder_but_not_a_short_one() -> None:
    # Loads 10 vs 6: the holder is 4 requests busier than the least loaded, mean load 7.
    req, index, candidates = holder_setup(256, 10.0, 6.0)
    decision = make_policy("cache_aware", index).select(req, candidates)
    assert decision.url == URLS[0]  # 256 tokens saved buy 256 / 32 = 8 requests (cap: 2.0 x 7)
    assert "256 tokens saved" in decision.reason and "window 8" in decision.reason
    # The saving-blind window (2 requests, or 0.1 x mean) sends the same request away.
    blind = {"balance_rel": 0.1, "tokens_per_load": 0}
    assert make_policy("cache_aware", index, blind).select(req, candidates).url != URLS[0]

    req, index, candidates = holder_setup(32, 10.0, 6.0)  # 32 tokens saved buy one request only
    decision = make_policy("cache_aware", index).select(req, candidates)
    assert decision.url != URLS[0] and decision.matched_tokens[decision.url] == 0
    assert f"{URLS[0]} holds 32 tokens" in decision.reason and "past its window 2" in decision.reason


def test_a_fresh_least_loaded_worker_closes_the_holders_windows() -> None:
    # As in the test above, 256 tokens saved would buy the holder 8 requests over the least loaded;
    # but the others hold nothing at all (just added or restarted): windows shrink to balance_abs.
    req, index, candidates = holder_setup(256, 10.0, 6.0, others_fresh=True)
    decision = make_policy("cache_aware", index).select(req, candidates)
    assert decision.url != URLS[0]
    assert "past its window 2" in decision.reason and "is fresh" in decision.reason
    req, index, candidates = holder_setup(256, 8.0, 6.0, others_fresh=True)  # within balance_abs
    assert make_policy("cache_aware", index).select(req, candidates).url == URLS[0]
    # Once every least-loaded worker holds anything, the saving earns its window again.
    req, index, candidates = holder_setup(256, 10.0, 6.0, others_fresh=True)
    policy = make_policy("cache_aware", index)
    for i, url in enumerate(URLS[1:]):
        policy.on_routed(request([9000 + i] * 64), url)
        chosen = policy.select(req, candidates).url
        if url != URLS[-1]:
            assert chosen != URLS[0]  # another fresh worker is still among the least loaded
        else:
            assert chosen == URLS[0]


def test_cache_aware_still_spreads_a_hot_prefix_whose_holder_is_far_busier() -> None:
    # The whole 1,024-token prompt is cached on the holder, but it is 34 requests busier than the
    # rest: the saving's window is capped at balance_rel x mean load (2 x 14.5), so the prefix spreads.
    req, index, candidates = holder_setup(1024, 40.0, 6.0)
    decision = make_policy("cache_aware", index).select(req, candidates)
    assert decision.url != URLS[0]
    assert decision.matched_tokens == {URLS[0]: 1024, URLS[1]: 0, URLS[2]: 0, URLS[3]: 0}
    assert "past its window 29" in decision.reason
    # ... while 14 requests busier (mean 9.5) is inside the cap: the holder keeps it.
    req, index, candidates = holder_setup(1024, 20.0, 6.0)
    assert make_policy("cache_aware", index).select(req, candidates).url == URLS[0]
    # An idle fleet gives no relative window at all: at 3 vs 0 the holder is past balance_abs.
    req, index, candidates = holder_setup(1024, 3.0, 0.0)
    assert make_policy("cache_aware", index).select(req, candidates).url != URLS[0]


def test_cache_aware_counts_the_saving_over_the_least_loaded_workers_prefix() -> None:
    index = PrefixIndex()
    req = request(list(range(1024)))
    index.insert(URLS[0], req.block_hashes[:64])  # 256 tokens on a busy worker
    index.insert(URLS[1], req.block_hashes[:60])  # 240 of them on an idle one: 16 tokens saved
    candidates = [Candidate(URLS[0], 10.0)] + [Candidate(u, 6.0) for u in URLS[1:]]
    decision = make_policy("cache_aware", index).select(req, candidates)
    assert decision.url == URLS[1] and decision.matched_tokens[URLS[1]] == 240


# ---- closed-loop simulation: load = outstanding requests ----------------------------------------


def simulate(policy_name: str, workload: str, seed: int = 0, params: dict | None = None) -> dict[str, float]:
    """Clients send a request, wait for it, then send the next. Service time grows with uncached
    blocks (what the worker really holds, tracked separately) and with the worker's load."""
    rng = random.Random(seed)
    index = PrefixIndex()
    if policy_name in ("random", "least_load"):
        params = {"seed": seed}
    policy = make_policy(policy_name, index, params)
    cached: dict[str, set[int]] = {u: set() for u in URLS}  # what each worker really holds
    outstanding = dict.fromkeys(URLS, 0)
    load_sum = dict.fromkeys(URLS, 0.0)
    system = [rng.randrange(1000) for _ in range(32 * BLOCK)]
    clients = 48
    history: list[list[int]] = [[rng.randrange(1000) for _ in range(8 * BLOCK)] for _ in range(clients)]
    last_worker: list[str | None] = [None] * clients
    stay = moves = hot_hits = hot = miss_blocks = 0
    hot_workers: Counter[str] = Counter()
    events: list[tuple[float, int, str]] = []
    now = 0.0

    def send(client: int) -> None:
        nonlocal stay, moves, hot_hits, hot, miss_blocks
        if workload == "chat":  # the conversation's history grows every turn
            history[client] += [rng.randrange(1000) for _ in range(rng.randrange(2, 6) * BLOCK)]
            tokens = history[client]
        else:  # 80% of requests share one system prompt, the rest are unique
            is_hot = rng.random() < 0.8
            tail = [rng.randrange(1000) for _ in range(rng.randrange(2, 6) * BLOCK)]
            tokens = system + tail if is_hot else tail + [rng.randrange(1000) for _ in range(24 * BLOCK)]
        req = RouteRequest(block_hashes(tokens, BLOCK), len(tokens), BLOCK)
        decision = policy.select(req, [Candidate(u, float(outstanding[u])) for u in URLS])
        url = decision.url
        policy.on_routed(req, url)
        for u in URLS:
            load_sum[u] += outstanding[u]
        if workload == "chat" and last_worker[client] is not None:
            stay += last_worker[client] == url
            moves += last_worker[client] != url
        if workload == "hot" and is_hot:
            hot += 1
            hot_workers[url] += 1
            hot_hits += decision.matched_tokens[url] >= len(system)
        last_worker[client] = url
        held = cached[url]
        misses = sum(1 for h in req.block_hashes if h not in held)
        held.update(req.block_hashes)
        miss_blocks += misses
        outstanding[url] += 1
        service = (1.0 + 0.2 * misses) * (1.0 + 0.1 * outstanding[url])
        heapq.heappush(events, (now + service, client, url))

    for c in range(clients):
        send(c)
    for _ in range(1500):
        now, client, url = heapq.heappop(events)
        outstanding[url] -= 1
        send(client)
    mean_load = sum(load_sum.values()) / len(URLS)
    return {
        "imbalance": max(load_sum.values()) / mean_load,  # max/mean of time-averaged load
        "affinity": stay / max(1, stay + moves),
        "miss_blocks": miss_blocks,  # prefill work the fleet really did
        "hot_workers": sum(1 for n in hot_workers.values() if n > 0.05 * hot),
        "hot_busiest_share": max(hot_workers.values(), default=0) / max(1, hot),
        "hot_hit_rate": hot_hits / max(1, hot),
    }


def test_cache_aware_keeps_conversations_on_their_worker_with_even_load() -> None:
    aware = simulate("cache_aware", "chat")
    assert aware["affinity"] >= 0.9
    assert aware["imbalance"] <= 1.10
    spread = simulate("least_load", "chat")
    assert spread["affinity"] < 0.6  # what a load-only policy gives up
    assert aware["miss_blocks"] < 0.5 * spread["miss_blocks"]


def test_cache_aware_spreads_a_hot_system_prompt_instead_of_piling_it_on_one_worker() -> None:
    aware = simulate("cache_aware", "hot")
    assert aware["hot_workers"] >= 2
    assert aware["hot_busiest_share"] <= 0.5
    assert aware["imbalance"] <= 1.25
    assert aware["hot_hit_rate"] >= 0.9  # spreading keeps the prefix cached where it goes
    # Without the load window, affinity alone piles the hot prefix onto its first holder.
    piled = simulate("cache_aware", "hot", params={"balance_abs": 1e9})
    assert piled["hot_busiest_share"] > 0.9


def test_the_kv_source_is_the_best_holder_when_it_holds_enough_more_than_the_pick():
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    router = Router(RouterConfig(workers=urls, kv_fetch_min_tokens=64))
    router.workers.get("http://b:1").in_flight = 3
    pick = Decision("http://a:1", {"http://a:1": 32, "http://b:1": 96, "http://c:1": 96}, "")
    assert router.kv_source(pick) == "http://c:1"  # b and c hold as much: the less loaded one
    assert router.kv_source(Decision("http://a:1", {**pick.matched_tokens, "http://a:1": 33}, "")) is None
    assert router.kv_source(Decision("http://c:1", pick.matched_tokens, "")) is None  # the pick holds most
    assert router.kv_source(Decision("http://a:1", {"http://a:1": 0}, "")) is None
    assert router.kv_source(pick, cache_salt="tenant") is None  # workers export unsalted prefixes only
    router.config.kv_fetch_min_tokens = 0  # off
    assert router.kv_source(pick) is None


@pytest.mark.parametrize(
    ("name", "params", "words"),
    [
        ("cache_aware", {"balance_abs": "abc"}, "balance_abs must be a number, not 'abc'"),
        ("cache_aware", {"tokens_per_load": True}, "tokens_per_load must be a number"),
        ("cache_aware", {"bogus": 1}, "unknown parameter(s) ['bogus']"),
        ("prefix_hash", {"vnodes": "many"}, "vnodes must be an integer, not 'many'"),
        # the ring is built at a request: 1e6 points a worker took 8 s and 318 MiB
        ("prefix_hash", {"vnodes": 1_000_000_000}, "vnodes must be at most 10,000, not 1,000,000,000"),
        ("prefix_hash", {"prefix_blocks": 2.5}, "prefix_blocks must be an integer"),
        ("prefix_hash", {"load_factor": float("nan")}, "load_factor must be >= 1.0"),
        ("random", {"seed": [1]}, "seed must be an integer or null"),
        ("least_load", {"seed": 1.5}, "seed must be an integer or null"),
    ],
)
def test_a_bad_parameter_is_refused_by_name(name, params, words) -> None:
    with pytest.raises(ValueError) as err:
        make_policy(name, PrefixIndex(), params)
    assert words in str(err.value)


def test_whole_numbers_and_numeric_text_are_parameters_still() -> None:
    policy = make_policy("prefix_hash", PrefixIndex(), {"vnodes": 4.0, "load_factor": "1.5"})
    assert policy.describe()["params"] == {"prefix_blocks": 8, "load_factor": "1.5", "vnodes": 4.0}


def test_a_request_naming_no_model_hashes_under_the_base_model_beside_its_adapters():
    """The worker serves a request without ``model`` as its base model and hashes its KV events under
    that name; its LoRA adapters, also listed in /v1/models, do not make the base unknown."""
    router = Router(RouterConfig(workers=["http://a:1", "http://b:1"]))
    a, b = router.workers.get("http://a:1"), router.workers.get("http://b:1")
    a.models, a.parents = frozenset({"base", "lora-1"}), {"lora-1": "base"}
    b.models = frozenset({"base"})
    router.workers.served_changed()  # as the health checks tell it
    assert (router.namespace(None), router.namespace("lora-1")) == ("base", "lora-1")
    b.models = frozenset({"base", "other"})  # two base models: which one serves it is not known
    router.workers.served_changed()
    assert router.namespace(None) == ""
