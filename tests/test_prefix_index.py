"""Prefix index: matching across workers, worker events, the global LRU budget, worker removal."""

from __future__ import annotations

import gc
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.block_hash import block_hashes
from router.kv_events import StoredBlocks
from router.prefix_index import PrefixIndex


def chain(tokens: list[int], block_size: int = 1) -> list[int]:
    return block_hashes(tokens, block_size)


def _holds(index: PrefixIndex, worker: str, h: int) -> bool:
    """Whether the index holds block ``h`` for ``worker`` (a mid-chain block only matches from the root)."""
    slot = index._slot.get(worker)
    nid = index._where.get(h)
    return slot is not None and nid is not None and bool(index._mask[nid] >> slot & 1)


def test_one_match_reports_every_worker_prefix_length() -> None:
    index = PrefixIndex()
    hashes = chain(list(range(300)))
    lengths = {f"w{i}": (i * 7) % 300 for i in range(200)}
    for worker, n in lengths.items():
        index.add_worker(worker)
        index.insert(worker, hashes[:n])
    expected = {w: n for w, n in lengths.items() if n > 0}
    assert index.match(hashes) == expected
    # A prompt that diverges after block 10 matches at most 10 blocks anywhere.
    other = chain(list(range(10)) + [9999] * 20)
    assert index.match(other) == {w: min(n, 10) for w, n in expected.items()}
    assert index.match(chain([12345, 1])) == {}
    assert index.match([]) == {}


def test_stored_event_extends_a_prefix_and_removed_event_cuts_it() -> None:
    index = PrefixIndex()
    hashes = chain(list(range(10)))
    index.apply_stored("a", None, hashes[:4])
    index.apply_stored("a", hashes[3], hashes[4:8])
    assert index.match(hashes) == {"a": 8}
    index.apply_removed("a", hashes[6:8])
    assert index.match(hashes) == {"a": 6}
    # A hole ends the match even though later blocks are still held.
    index.apply_removed("a", [hashes[2]])
    assert index.match(hashes) == {"a": 2}
    assert index.worker_entries("a") == 5
    index.apply_removed("a", [123, 456])  # unknown hashes are ignored
    index.apply_removed("nobody", hashes)
    assert index.num_entries == 5


def test_run_with_unknown_parent_is_recorded_and_matches_once_the_prefix_is_known() -> None:
    index = PrefixIndex()
    hashes = chain(list(range(8)))
    index.apply_stored("a", hashes[3], hashes[4:])  # parent never seen by this index
    assert index.worker_entries("a") == 4
    assert index.match(hashes) == {}
    index.insert("a", hashes[:4])  # the prefix above becomes known (optimistic insert)
    assert index.match(hashes) == {"a": 8}


def test_clear_worker_forgets_only_that_worker() -> None:
    index = PrefixIndex()
    hashes = chain(list(range(6)))
    index.insert("a", hashes)
    index.insert("b", hashes[:3])
    index.clear_worker("a")
    assert index.match(hashes) == {"b": 3}
    assert index.worker_entries("a") == 0
    assert index.num_entries == 3
    index.insert("a", hashes[:2])  # still a known worker after a clear
    assert index.match(hashes) == {"a": 2, "b": 3}


def test_remove_worker_drops_entries_and_its_bit_is_reused_clean() -> None:
    index = PrefixIndex()
    hashes = chain(list(range(5)))
    for w in ("a", "b", "c"):
        index.insert(w, hashes)
    index.remove_worker("b")
    assert index.num_entries == 10
    assert index.match(hashes) == {"a": 5, "c": 5}
    assert "b" not in index.workers
    index.add_worker("d")  # takes b's freed bit
    assert index._slot["d"] == 1
    assert index.match(hashes) == {"a": 5, "c": 5}
    index.insert("d", hashes[:2])
    assert index.match(hashes) == {"a": 5, "c": 5, "d": 2}
    index.remove_worker("a")
    index.remove_worker("c")
    index.remove_worker("d")
    assert index.num_entries == 0 and index.num_nodes == 0


def test_budget_evicts_leaves_before_their_ancestors() -> None:
    index = PrefixIndex(max_entries=6)
    first = chain([1, 2, 3, 4])
    index.insert("a", first)
    index.insert("b", chain([7, 8, 9]))  # 7 entries > 6: one of "a"'s must go
    assert index.num_entries == 6
    assert index.match(first) == {"a": 3}  # the leaf went, not the root
    index.insert("b", chain([7, 8, 9, 10, 11]))  # two more entries over budget
    assert index.num_entries == 6
    assert index.match(first) == {"a": 1}


def test_touching_a_leaf_keeps_its_ancestors_alive() -> None:
    index = PrefixIndex(max_entries=8)
    hashes = chain([1, 2, 3])
    index.insert("a", hashes[:2])
    index.insert("b", chain([5, 6, 7, 8]))
    # The stored event touches a's run and its ancestors, so b's older entries go first.
    index.apply_stored("a", hashes[1], hashes[2:])
    index.insert("c", chain([9, 10]))
    assert index.num_entries == 8
    assert index.match(hashes) == {"a": 3}


def test_budget_is_never_exceeded_and_prefixes_stay_closed() -> None:
    rng = random.Random(7)
    index = PrefixIndex(max_entries=200)
    workers = [f"w{i}" for i in range(6)]
    prompts = [chain([rng.randrange(4) for _ in range(rng.randrange(1, 40))]) for _ in range(60)]
    for step in range(600):
        worker, prompt = rng.choice(workers), rng.choice(prompts)
        if rng.random() < 0.7:
            index.insert(worker, prompt)
        else:
            # Like a worker: store the part of the prompt after what it already holds.
            cut = min(index.match(prompt).get(worker, 0), len(prompt) - 1)
            index.apply_stored(worker, prompt[cut - 1] if cut else None, prompt[cut:])
        assert index.num_entries <= 200
        assert sum(index.worker_entries(w) for w in workers) == index.num_entries
        if step % 25 == 0:
            # Evicting leaves first never opens a hole: every held block's parent is held too.
            for w in workers:
                for prompt in prompts:
                    held = [_holds(index, w, h) for h in prompt]
                    assert held == sorted(held, reverse=True), "a held block below an evicted one"


def test_a_single_insert_longer_than_the_budget_keeps_its_leading_blocks() -> None:
    index = PrefixIndex(max_entries=5)
    hashes = chain(list(range(12)))
    index.insert("a", hashes)
    assert index.num_entries == 5
    assert index.match(hashes) == {"a": 5}


# ---- property test against a brute-force model ------------------------------------------------

WORKERS = ["a", "b", "c"]
prompts_st = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=5)
op_st = st.tuples(
    st.sampled_from(["insert", "stored", "removed", "clear", "remove_worker"]),
    st.sampled_from(WORKERS),
    st.integers(0, 4),  # which prompt
    st.integers(0, 8),  # cut points
    st.integers(0, 8),
)


def model_match(model: set[tuple[str, tuple[int, ...]]], tokens: list[int]) -> dict[str, int]:
    out = {}
    for w in WORKERS:
        n = 0
        while n < len(tokens) and (w, tuple(tokens[: n + 1])) in model:
            n += 1
        if n:
            out[w] = n
    return out


@settings(max_examples=150, deadline=None)
@given(prompts=prompts_st, ops=st.lists(op_st, max_size=30))
def test_index_matches_a_brute_force_model(prompts: list[list[int]], ops: list[tuple]) -> None:
    index = PrefixIndex(max_entries=10_000)  # no budget pressure
    model: set[tuple[str, tuple[int, ...]]] = set()
    for kind, w, which, i, j in ops:
        tokens = prompts[which % len(prompts)]
        hashes = chain(tokens)
        lo, hi = sorted((min(i, len(tokens)), min(j, len(tokens))))
        if kind == "insert":
            index.insert(w, hashes[:hi])
            model |= {(w, tuple(tokens[: k + 1])) for k in range(hi)}
        elif kind == "stored":
            index.apply_stored(w, hashes[lo - 1] if lo else None, hashes[lo:hi])
            model |= {(w, tuple(tokens[: k + 1])) for k in range(lo, hi)}
        elif kind == "removed":
            index.apply_removed(w, hashes[lo:hi])
            model -= {(w, tuple(tokens[: k + 1])) for k in range(lo, hi)}
        elif kind == "clear":
            index.clear_worker(w)
            model = {e for e in model if e[0] != w}
        else:
            index.remove_worker(w)
            model = {e for e in model if e[0] != w}
        assert index.num_entries == len(model)
        for probe in prompts:
            assert index.match(chain(probe)) == model_match(model, probe)
    for w in WORKERS:
        assert index.worker_entries(w) == sum(1 for e in model if e[0] == w)


def test_stored_run_under_a_mid_run_parent_branches_there() -> None:
    index = PrefixIndex()
    hashes = chain(list(range(10)))
    index.insert("a", hashes)
    branch = block_hashes([99, 98], 1, parent=hashes[3])  # a different continuation of blocks 0-3
    index.apply_stored("b", hashes[3], branch)
    assert index.match(hashes[:4] + branch) == {"a": 4}  # b lacks blocks 0-3: a hole at block 0
    index.insert("b", hashes[:4])
    assert index.match(hashes[:4] + branch) == {"a": 4, "b": 6}
    assert index.match(hashes) == {"a": 10, "b": 4}


def test_removed_middle_block_reattaches_when_stored_again() -> None:
    index = PrefixIndex()
    hashes = chain(list(range(12)))
    index.insert("a", hashes)
    index.apply_removed("a", [hashes[5]])
    assert index.match(hashes) == {"a": 5}
    assert index.worker_entries("a") == 11
    index.apply_stored("a", hashes[4], [hashes[5]])  # the hole is filled: the tail matches again
    assert index.match(hashes) == {"a": 12}
    assert index.num_entries == 12 and index.num_nodes == 12


def test_eviction_under_steady_churn_keeps_budget_and_no_holes() -> None:
    rng = random.Random(3)
    index = PrefixIndex(max_entries=500)
    system = list(range(1000, 1040))
    for step in range(300):
        tokens = system + [rng.randrange(50) for _ in range(rng.randrange(0, 60))]
        index.insert(f"w{step % 5}", chain(tokens))
        assert index.num_entries <= 500
        _check_invariants(index)
    # The shared prefix is touched by every request, so it outlives the unique tails.
    assert max(index.match(chain(system)).values()) == len(system)


def _check_invariants(index: PrefixIndex) -> None:
    """The module's stated invariants, from the outside of its public interface."""
    run, mask, confirmed = index._run, index._mask, index._confirmed
    touched, ticks = index._touched, index._ticks
    nodes = []
    stack = [n for runs in index._roots.values() for n in runs.values()]
    while stack:
        node = stack.pop()
        nodes.append(node)
        assert len(nodes) <= len(index._where) + 1, "a cycle in the tree"
        assert (node in index._parent) != (node in index._up), "a node with a parent and a parent hash"
        for first, child in index._kids.get(node, {}).items():
            assert index._parent[child] == node and run[child][0] == first and touched[child] <= touched[node]
            stack.append(child)
    assert len(nodes) == len(set(nodes)) == index._nodes
    for fields in (run, mask, confirmed, touched):  # a dead node's fields go with it
        assert set(fields) == set(nodes)
    assert set(index._kids) <= set(nodes) and all(index._kids.values()), "children kept for nodes with none"
    assert set(index._parent) | set(index._up) == set(nodes) and set(ticks) <= set(nodes)
    assert all(mask[n] and run[n] and confirmed[n] & ~mask[n] == 0 for n in nodes)
    assert sum(len(run[n]) for n in nodes) == len(index._where)
    assert all(index._where[h] == n for n in nodes for h in run[n])
    assert sum(len(run[n]) * mask[n].bit_count() for n in nodes) == index.num_entries <= index.max_entries
    assert sum(index._counts) == index.num_entries
    for n in nodes:  # each holder's last touch is known once a node has two, and none is after the node's
        holders = {i for i in range(len(index._counts)) if mask[n] >> i & 1}
        assert n in ticks or len(holders) == 1
        assert n not in ticks or set(ticks[n]) <= holders
        assert max(ticks.get(n, {}).values(), default=0) <= touched[n]
    queued = {nid for _, _, nid in index._leaves}
    assert all(n in queued for n in nodes if n not in index._kids), "a leaf missing from the heap"
    for slot, held in enumerate(index._held):  # each worker's node ids, against a scan of every node
        assert set(held) == {n for n in nodes if mask[n] >> slot & 1}, f"slot {slot}'s node ids"


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "stored", "bogus", "removed", "clear", "take_back"]),
            st.sampled_from(WORKERS),
            st.lists(st.integers(0, 3), min_size=1, max_size=12),
            st.integers(0, 12),
        ),
        max_size=40,
    ),
    budget=st.integers(1, 40),
)
def test_invariants_hold_under_budget_pressure_and_bogus_events(ops: list[tuple], budget: int) -> None:
    index = PrefixIndex(max_entries=budget)
    inserts: list[tuple[str, list[int], int]] = []
    for kind, w, tokens, cut in ops:
        hashes = chain(tokens)
        cut = min(cut, len(hashes))
        if kind == "take_back":  # an earlier insert refused: what goes is a tail
            if inserts:
                w, hashes, tick = inserts[cut % len(inserts)]
                held = index.match(hashes).get(w, 0)
                index.take_back(w, hashes, tick)
                after = [_holds(index, w, h) for h in hashes]
                assert after[:held] == sorted(after[:held], reverse=True), "a take-back opened a hole"
        elif kind == "insert":
            inserts.append((w, hashes, index.insert(w, hashes)))
        elif kind == "stored":
            index.apply_stored(w, hashes[cut - 1] if cut else None, hashes[cut:])
        elif kind == "bogus":  # repeated hashes, a parent inside its own run, unknown parents
            index.apply_stored(w, hashes[-1], hashes[cut:] + hashes[:cut] + hashes[cut:])
        elif kind == "removed":
            index.apply_removed(w, hashes[cut:] + hashes[: cut // 2])
        else:
            index.clear_worker(w)
        _check_invariants(index)
        index.match(hashes)


def test_stored_and_removed_churn_does_not_grow_bookkeeping() -> None:
    index = PrefixIndex()
    base = chain([1, 2, 3])
    index.insert("a", base)
    for i in range(3000):  # each cycle leaves a dead leaf behind in the eviction queue
        run = block_hashes([i + 10], 1, parent=base[-1])
        index.apply_stored("a", base[-1], run)
        index.apply_removed("a", run)
    assert index.match(base) == {"a": 3} and index.num_entries == 3
    assert len(index._leaves) <= 2 * index._nodes + 1024
    _check_invariants(index)


def test_take_back_removes_only_what_nothing_touched_since() -> None:
    """A refused request's insert is undone, but not the blocks a later insert or a stored event
    touched (another request relies on them), and never with a hole."""
    shared, a_tail, b_tail = list(range(1, 9)), [100, 101, 102], [200, 201]
    index = PrefixIndex()
    a_tick = index.insert("w", chain(shared + a_tail))
    index.take_back("w", chain(shared + a_tail), a_tick)
    assert index.match(chain(shared + a_tail)) == {}  # nothing else touched it: all of it goes
    a_tick = index.insert("w", chain(shared + a_tail))
    index.insert("w", chain(shared + b_tail))  # B, routed on the same prefix, sent after A
    index.take_back("w", chain(shared + a_tail), a_tick)
    # B's blocks stay, the shared prefix with them; A's own tail goes (B's touch named only the
    # prefix, so it split A's node there)
    assert index.match(chain(shared + b_tail)) == {"w": len(shared) + len(b_tail)}
    assert index.match(chain(shared + a_tail)) == {"w": len(shared)}
    assert index.num_entries == len(shared) + len(b_tail)
    c = chain([7, 7, 7, 7])
    c_tick = index.insert("w", c)
    index.apply_stored("w", None, c)  # the worker says it stored them: they stay
    index.take_back("w", c, c_tick)
    assert index.match(c) == {"w": 4}


def test_take_back_is_not_kept_by_another_workers_request_for_the_same_prompt() -> None:
    """A request to worker b, given up while queued there, is taken back though a request for the same
    prompt went to worker a meanwhile: a's insert relies on a's bit, not b's (b's was kept for good,
    and b was predicted a cache it never held). b's own later request still keeps it."""
    prompt, other = chain(list(range(1, 30))), chain([*range(1, 10), 500, 501])
    index = PrefixIndex()
    tick = index.insert("b", prompt)
    index.insert("a", prompt)
    index.apply_stored("a", None, prompt)  # a computed it
    index.take_back("b", prompt, tick)
    assert index.match(prompt) == {"a": len(prompt)}
    _check_invariants(index)
    tick = index.insert("b", prompt)
    index.insert("a", other)  # a request to a on part of it, then one to b on part of it
    index.insert("b", other)
    index.take_back("b", prompt, tick)
    assert index.match(prompt) == {"a": len(prompt), "b": 9}  # b keeps what its second request relies on
    assert index.match(other) == {"a": len(other), "b": len(other)}
    _check_invariants(index)
    # a stored event of the worker under the prompt's last block says it holds the prompt: its
    # take-back keeps it, another worker on the same blocks or not (no hole under the stored run)
    answer = chain([*range(1, 30), 50, 51])[len(prompt) :]
    fresh = PrefixIndex()
    tick = fresh.insert("d", prompt)
    fresh.insert("b", prompt)
    fresh.apply_stored("d", prompt[-1], answer)
    fresh.take_back("d", prompt, tick)
    assert fresh.match(prompt + answer) == {"b": len(prompt), "d": len(prompt) + len(answer)}
    _check_invariants(fresh)


def test_take_back_keeps_the_prefill_chunks_the_worker_stored_and_drops_the_rest() -> None:
    """A long prompt abandoned between prefill chunks: the worker stored its first chunks (their
    events touch those blocks only), so the take-back leaves exactly them."""
    prompt = chain(list(range(1000, 1040)))
    index = PrefixIndex()
    tick = index.insert("w", prompt)
    index.apply_stored("w", None, prompt[:16])  # chunk 1
    index.apply_stored("w", prompt[15], prompt[16:32])  # chunk 2; the client leaves during chunk 3
    index.take_back("w", prompt, tick)
    assert index.match(prompt) == {"w": 32}
    assert index.num_entries == 32
    _check_invariants(index)
    # a second request's insert of the whole prompt, before the take-back, keeps all of it
    tick = index.insert("w", prompt)
    index.insert("w", prompt)
    index.take_back("w", prompt, tick)
    assert index.match(prompt) == {"w": 40}
    # an insert of a shorter prompt on the same blocks touches only those: a refused longer one goes
    other = chain(list(range(2000, 2030)))
    tick = index.insert("v", other)
    index.insert("v", other[:10])
    index.take_back("v", other, tick)
    assert index.match(other) == {"v": 10}
    _check_invariants(index)


def test_a_followed_take_back_removes_a_predicted_prefix_no_stored_event_named() -> None:
    """Where the index follows the worker's events (Policy.on_refused), a take-back covers the prefix
    its request was predicted to find too: a document only other abandoned requests put there
    goes with the last of them, while what a stored event named stays whatever touched it."""
    doc, q1, q2 = list(range(1, 41)), [100, 101], [200, 201]
    index = PrefixIndex()
    first = index.insert("w", chain(doc + q1))  # predicted nothing there
    second = index.insert("w", chain(doc + q2))  # routed there on the first one's prediction
    index.take_back("w", chain(doc + q1), first)
    assert index.match(chain(doc + q2)) == {"w": len(doc) + len(q2)}  # the second relies on the document
    assert index.match(chain(doc + q1)) == {"w": len(doc)}
    index.take_back("w", chain(doc + q2), second)
    assert index.num_entries == 0
    _check_invariants(index)
    # the same with the document stored by the worker: it stays, the question goes
    index.apply_stored("w", None, chain(doc))
    tick = index.insert("w", chain(doc + q2))
    index.take_back("w", chain(doc + q2), tick)
    assert index.match(chain(doc + q2)) == {"w": len(doc)} and index.num_entries == len(doc)
    # a stored leaf that an insert goes on from is not extended with the unconfirmed blocks
    tick = index.insert("w", chain(doc + q1))
    index.take_back("w", chain(doc + q1), tick)
    assert index.match(chain(doc + q1)) == {"w": len(doc)} and index.num_entries == len(doc)
    # without the worker's events nothing tells the two apart: the predicted prefix is not looked at
    # (Policy.on_refused passes only what follows it), and the rest goes by ticks alone
    tick = index.insert("v", chain(doc + q1))
    index.insert("v", chain(doc + q2))
    index.take_back("v", chain(doc + q1)[len(doc) :], tick)
    assert index.match(chain(doc + q1)) == {"w": len(doc), "v": len(doc)}
    _check_invariants(index)


def test_the_garbage_collector_walks_one_object_per_node_and_none_per_block() -> None:
    """A full collection's pause grows with what the collector tracks: blocks (millions at the
    default budget) must not be among it, and a node (hundreds of thousands for short prompts) only
    as its run's array, which references nothing."""
    prompts = [(chain([i % 4] * 10 + [i] * 20), chain([i % 4] * 10 + [i] * 5)) for i in range(200)]
    index = PrefixIndex(max_entries=5000)
    gc.collect()
    before = len(gc.get_objects())
    for i, (routed, stored) in enumerate(prompts):
        index.insert(f"w{i % 3}", routed)
        index.apply_stored(f"w{i % 5}", None, stored)
        if i % 7 == 0:
            index.apply_removed(f"w{i % 3}", routed[-3:])  # splits and drops too
    gc.collect()  # a collection stops tracking tuples of ints (the heap's entries)
    assert index._nodes > 300 and index.num_nodes > 3000
    assert len(gc.get_objects()) - before <= index._nodes + 40  # a few dicts per index, no more per node
    assert all(len(gc.get_referents(run)) <= 1 for run in index._run.values())  # its type, not each hash
    assert not gc.is_tracked(index._where)  # ints to ints
    assert not any(gc.is_tracked(ids) for ids in index._held)  # each worker's node ids: ints to None
    _check_invariants(index)


def _held_runs(index: PrefixIndex, worker: str) -> list[StoredBlocks]:
    """What ``worker`` holds, as a snapshot's runs (one per node, its parent's last hash before it)."""
    slot = index._slot[worker]
    runs = []
    for nid in index._held[slot]:
        parent = index._run[index._parent[nid]][-1] if nid in index._parent else index._up[nid]
        runs.append(StoredBlocks(list(index._run[nid]), parent, []))  # type: ignore[arg-type]
    return runs


def _state(index: PrefixIndex, hashes: set[int]) -> dict[int, tuple[int, int]]:
    """Block -> (its holders, those confirmed by a stored event), by worker name (not bit)."""

    def names(mask: int) -> frozenset[str]:
        return frozenset(index._names[i] for i in range(len(index._names)) if mask >> i & 1)  # type: ignore[misc]

    out = {}
    for h in hashes:
        nid = index._where.get(h)
        if nid is not None:
            out[h] = (names(index._mask[nid]), names(index._confirmed[nid]))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_resync_by_difference_ends_as_clear_and_apply(seed: int) -> None:
    """Re-syncing a worker from its snapshot by difference (drop what the snapshot does not name,
    apply only the runs that add or confirm blocks) leaves the index as clearing the worker and applying
    every run would: the same blocks per worker, confirmed alike, the same matches, and later
    events land alike."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(24):  # prompts sharing prefixes, so nodes are split and shared between workers
        base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
        cut = rng.randrange(len(base) + 1)
        prompts.append(base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(1, 10))])
    chains = [chain(p) for p in prompts]
    every = {h for c in chains for h in c}

    def span() -> tuple[list[int], int, int]:
        hashes = rng.choice(chains)
        lo, hi = sorted(rng.sample(range(len(hashes) + 1), 2))
        return hashes, lo, hi

    def random_ops(n: int, kinds: list[str]) -> list[tuple]:
        ops = []
        for _ in range(n):
            kind = rng.choice(kinds)
            w = rng.choice(WORKERS)
            hashes, lo, hi = span()
            if kind == "insert" or kind == "take_back":
                ops.append((kind, w, hashes[:hi]))
            elif kind == "stored":
                ops.append((kind, w, hashes[lo - 1] if lo else None, hashes[lo:hi]))
            elif kind == "removed":
                ops.append((kind, w, hashes[lo:hi]))
            elif rng.random() < 0.2:
                ops.append((kind, w))
        return ops

    def snapshot(index: PrefixIndex, w: str) -> list[StoredBlocks]:
        """The worker's current runs, some dropped or cut short, plus new runs (some under a parent
        nobody holds): a snapshot that differs from what the index believes."""
        runs = []
        for run in _held_runs(index, w) if rng.random() < 0.8 else []:
            if rng.random() < 0.15:
                continue
            cut = len(run.block_hashes) if rng.random() < 0.8 else rng.randrange(1, len(run.block_hashes) + 1)
            runs.append(StoredBlocks(run.block_hashes[:cut], run.parent_hash, []))
        for _ in range(rng.randrange(0, 6)):
            hashes, lo, hi = span()
            runs.append(StoredBlocks(hashes[lo:hi], hashes[lo - 1] if lo else None, []))  # type: ignore[arg-type]
        rng.shuffle(runs)
        return runs

    def replay(index: PrefixIndex, ops: list[tuple], ticks: list[int]) -> None:
        for op in ops:
            kind, w = op[0], op[1]
            if kind == "insert":
                ticks.append(index.insert(w, op[2]))
            elif kind == "take_back" and ticks:
                index.take_back(w, op[2], ticks[len(op[2]) % len(ticks)])
            elif kind == "stored":
                index.apply_stored(w, op[2], op[3])
            elif kind == "removed":
                index.apply_removed(w, op[2])
            elif kind == "clear":
                index.clear_worker(w)

    cleared, diffed = PrefixIndex(max_entries=100_000), PrefixIndex(max_entries=100_000)  # no eviction
    ticks_c: list[int] = []
    ticks_d: list[int] = []
    kinds = ["insert", "stored", "stored", "removed", "take_back", "clear"]
    for _ in range(6):
        ops = random_ops(rng.randrange(5, 40), kinds)
        replay(cleared, ops, ticks_c)
        replay(diffed, ops, ticks_d)
        w = rng.choice(WORKERS)
        if w not in diffed._slot:
            continue
        # NOTE: blocks a re-sync keeps are not touched (clear and apply makes them the newest), and a
        # take-back reads touches: from here on the two are compared on what does not read them
        kinds = [k for k in kinds if k != "take_back"]
        runs = snapshot(diffed, w)
        cleared.clear_worker(w)
        for run in runs:
            cleared.apply_stored(w, run.parent_hash, run.block_hashes)
        if rng.random() < 0.5:
            list(diffed.resync_steps(w, runs))  # in one go
        else:  # as the event subscriber does: a slice at a time
            for _ in diffed.resync_steps(w, runs, slice_runs=2):
                _check_invariants(diffed)
        for index in (cleared, diffed):
            _check_invariants(index)
        assert _state(diffed, every) == _state(cleared, every)
        assert all(diffed.worker_entries(x) == cleared.worker_entries(x) for x in WORKERS)
        assert diffed.num_entries == cleared.num_entries
        for hashes in chains:
            assert diffed.match(hashes) == cleared.match(hashes)
            for k in range(1, len(hashes)):
                assert diffed.match(hashes[:k]) == cleared.match(hashes[:k])
