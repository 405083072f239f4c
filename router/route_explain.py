"""``POST /debug/route``: the routing decision for a request body, explained, without sending it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.affinity import NO_WORKER
from router.gateway import Router
from router.request_parsing import ParsedRequest


def explain(
    router: Router, parsed: ParsedRequest, endpoint: str, headers: Mapping[str, str]
) -> dict[str, Any]:
    """What the router would do with this request of ``endpoint`` (chat, completions, responses)
    and why: each candidate's predicted cached tokens (what the router counts: the index's match
    less the last block of a whole-block prompt, none where the worker cuts the prompt to fit) beside
    the index's match, and load (own, other replicas', the last report's rest); a worker that does not
    serve the request's model is listed, not available. Reads state; sends nothing."""
    route = router.route_request(parsed)
    group = router.affinity_group(parsed, endpoint != "completions", headers)
    only = router.response_holder(parsed.body.get("previous_response_id"))  # a follow-up: its worker
    decision, outcome = router.decide(
        route, parsed.model, set(), group, only, preview=True, fit_tokens=parsed.fit_tokens
    )
    matched = router.index.match(route.block_hashes)
    pick = None if decision is None else router.workers.get(decision.url)
    cut = pick is not None and router.cuts(parsed, route, pick)  # the pick keeps the prompt's end

    def held(url: str) -> int:  # the index's match for ``url``, in tokens
        if decision is not None and url in decision.matched_tokens:
            return decision.matched_tokens[url]
        return matched.get(url, 0) * route.block_size

    def predicted(worker: Any) -> int:  # NOTE: as the gateway counts it when it sends the request
        return 0 if router.cuts(parsed, route, worker) else route.cacheable(held(worker.url))

    # NOTE: the workers the decision chose among, before the affinity group and the prompt's length
    # narrowed them (the reason says so)
    available = {w.url for w in router.workers.candidates(parsed.model)}
    refused = router.group_unavailable(group, parsed.model)  # NOTE: as the gateway answers it
    unavailable = "no healthy worker" if refused is None else refused.message
    return {
        "worker": None if decision is None else decision.url,
        "predicted_cached_tokens": None if pick is None else predicted(pick),
        "reason": decision.reason if decision is not None else unavailable,
        "policy": router.policy.name,
        # the worker the pick would be told to fetch the prompt's KV from (--kv-fetch-min-tokens)
        "kv_source": None if decision is None or cut else router.kv_source(decision, parsed.cache_salt),
        "affinity_group": group,
        "affinity_outcome": NO_WORKER if decision is None else outcome,  # as the request is counted
        "prompt_tokens": route.prompt_tokens,
        # echo + logprobs: the worker computes the whole prompt, so nothing is matched (routed by load)
        "whole_prompt_computed": parsed.full_prefill,
        "block_size": route.block_size,
        "blocks": len(route.block_hashes),
        "block_hashes": [str(h) for h in route.block_hashes],  # strings: exact in any JSON client
        "candidates": [
            {
                "url": w.url,
                "healthy": w.healthy,
                "available": w.url in available,  # healthy, its breaker allowing, serving the model
                "load": w.load,
                "in_flight": w.in_flight,
                "pending_prefill_tokens": w.pending_prefill,
                "peer_in_flight": w.peer_queue,  # other replicas', as announced (replica sync)
                "peer_pending_prefill_tokens": w.peer_prefill,
                "others_queue": w.others_queue,  # the last report's rest
                "others_prefill_tokens": w.others_prefill,
                "matched_tokens": held(w.url),  # the blocks the index holds for it, in tokens
                "predicted_cached_tokens": predicted(w),  # of them, what it would serve from cache
            }
            for w in router.workers
        ],
    }
