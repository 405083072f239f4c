"""Extend graphs: a padded, replayed extend or verify step computes what the eager step computes, and
its padding touches nothing but the scratch slot.

On CPU the capture itself is replaced by re-running the function over the same static buffers (the
only part that needs a GPU); the gpu-marked test captures real CUDA graphs."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from tests.worker.test_cuda_graph import (
    EagerReplay,
    Fleet,
    assert_same_pool_but_scratch,
    clone_pool_into,
    eager_logits,
)
from worker.assembly import build_engine
from worker.bench_speculative import generate
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.extend_graph import ExtendGraphRunner, graph_token_sizes
from worker.kv_pool import KVPool, slots_for
from worker.model import load_model
from worker.request import ScheduledBatch
from worker.sampling import SamplingParams

PAGE = 4  # tokens
ROOM = 40  # tokens each request may add after its prompt


class Cached(Fleet):
    """Requests whose prompts are already in a pool (cached prefixes); builds extend steps of more tokens."""

    def __init__(self, model, device: str, lengths: list[int], seed: int = 0, pool_pages: int = 512) -> None:
        super().__init__(model, device, lengths, seed, room=ROOM, pool_pages=pool_pages)

    def step(self, rows: list[int], new: list[list[int]], mode: str = "extend") -> ScheduledBatch:
        """Requests ``rows`` each add their ``new`` tokens after what they hold (their cached prefix)."""
        pos = [len(self.tokens[r]) for r in rows]
        prefix = [slots_for(self.pages[r], 0, p, PAGE) for r, p in zip(rows, pos, strict=True)]
        out = [slots_for(self.pages[r], p, p + len(t), PAGE) for r, p, t in zip(rows, pos, new, strict=True)]
        for r, t in zip(rows, new, strict=True):
            self.tokens[r] += t
        return ScheduledBatch(
            mode=mode,  # type: ignore[arg-type]
            requests=[types.SimpleNamespace(adapter=0, full_prefill=False)] * len(rows),  # type: ignore[list-item]
            starts=pos,
            ends=[p + len(t) for p, t in zip(pos, new, strict=True)],
            sample=[True] * len(rows),
            input_ids=np.array([x for t in new for x in t], dtype=np.int64),
            positions=np.concatenate([np.arange(p, p + len(t)) for p, t in zip(pos, new, strict=True)]),
            out_slots=np.concatenate(out).astype(np.int64),
            qo_indptr=np.concatenate([[0], np.cumsum([len(t) for t in new])]).astype(np.int32),
            kv_indptr=np.concatenate([[0], np.cumsum([len(s) for s in prefix])]).astype(np.int32),
            kv_indices=np.concatenate(prefix).astype(np.int64),
            drafts=[t[1:] for t in new] if mode == "verify" else None,
        )


def changed_slots(before: list[torch.Tensor], pool: KVPool) -> set[int]:
    changed: set[int] = set()
    for old, new in zip(before, pool.k_cache + pool.v_cache, strict=True):
        changed |= set(torch.nonzero((old != new).flatten(1).any(1)).flatten().tolist())
    return changed


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu").model


def test_graph_token_sizes():
    assert graph_token_sizes(0) == []
    assert graph_token_sizes(5) == [5]
    assert graph_token_sizes(8) == [8]
    assert graph_token_sizes(64) == [8, 16, 32, 64]
    assert graph_token_sizes(100) == [8, 16, 32, 64, 100]


STEPS = (  # (requests, new tokens of each): padded to 8, 16, 16 (no padding tokens), 32 and 64 tokens
    ([2], [5]),
    ([0, 3, 5], [3, 7, 2]),
    ([1, 4], [9, 7]),
    ([0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]),
    ([2, 4], [30, 3]),
)


@pytest.mark.parametrize("kind", ["last", "all"])
def test_replayed_steps_match_eager_steps_at_every_padding(tiny, kind):
    """Extend steps over cached prefixes, padded to every captured size (and exactly filling one):
    the same logits and the same pool contents as eager steps on a copy of the pool."""
    lengths = [5, 17, 9, 30, 2, 12]
    graphed, eager = Cached(tiny, "cpu", lengths), Cached(tiny, "cpu", lengths)
    backend = EagerReplay()
    runner = ExtendGraphRunner(tiny, graphed.pool, max_tokens=64, max_requests=6, max_kv_indices=6 * 128,
                               all_logits=True, backend=backend)  # fmt: skip
    # largest first, both kinds: "last" gives a row per request row (6, or fewer for 8 tokens), "all" per token
    assert backend.captured == [6, 64, 6, 32, 6, 16, 6, 8]
    rng = np.random.default_rng(1)
    for rows, counts in STEPS:
        new = [rng.integers(0, 256, n).tolist() for n in counts]
        step_g, step_e = graphed.step(rows, new), eager.step(rows, new)
        assert runner.can_run(step_g, kind)
        got = runner.run(step_g, kind).clone()
        want = eager_logits(tiny, eager.pool, step_e, all_logits=kind == "all")
        assert (
            got.shape == want.shape == (len(rows) if kind == "last" else sum(counts), tiny.config.vocab_size)
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert_same_pool_but_scratch(graphed.pool, eager.pool)


@pytest.mark.parametrize("kind", ["last", "all"])
def test_steps_with_adapters_replay_the_lora_graphs(kind):
    """Adapters at capture: extend steps mixing two adapters and the base replay the LoRA graphs and
    match their eager steps, logits and pool."""
    from tests.kernels.test_model_kernels import add_adapters

    model = load_model("tiny", "cpu").model
    add_adapters(model)
    lengths = [5, 17, 9, 30, 2, 12]
    graphed, eager = Cached(model, "cpu", lengths), Cached(model, "cpu", lengths)
    backend = EagerReplay()
    runner = ExtendGraphRunner(model, graphed.pool, max_tokens=64, max_requests=6, max_kv_indices=6 * 128,
                               all_logits=True, backend=backend)  # fmt: skip
    assert len(backend.captured) == 16  # 4 sizes x 2 kinds x with and without adapters
    rng = np.random.default_rng(2)
    for rows, counts in STEPS:
        new = [rng.integers(0, 256, n).tolist() for n in counts]
        # NOTE: adapters 1, 2 and the base by request, so some steps hold neighbours of one adapter (their
        # requests then share LoRA segments)
        adapters = [(1 + r // 2) % 3 for r in rows]
        step_g, step_e = graphed.step(rows, new), eager.step(rows, new)
        for step in (step_g, step_e):
            step.requests = [types.SimpleNamespace(adapter=a, full_prefill=False) for a in adapters]
        assert runner.can_run(step_g, kind)
        got = runner.run(step_g, kind).clone()
        want = eager_logits(model, eager.pool, step_e, all_logits=kind == "all")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert_same_pool_but_scratch(graphed.pool, eager.pool)


def test_padding_writes_only_the_scratch_slot(tiny):
    cached = Cached(tiny, "cpu", [6, 11, 3])
    runner = ExtendGraphRunner(tiny, cached.pool, 32, 4, 256, backend=EagerReplay())
    for t in cached.pool.k_cache + cached.pool.v_cache:  # NOTE: the captures wrote what padding writes again
        t[cached.pool.scratch_slot] = 1234.5
    before = [t.clone() for t in cached.pool.k_cache + cached.pool.v_cache]
    step = cached.step([0, 2], [[65, 66, 67], [68, 69]])  # 5 tokens -> the 8-token graph: 3 padding
    logits = runner.run(step)
    assert logits.shape == (2, tiny.config.vocab_size) and torch.isfinite(logits).all()
    assert changed_slots(before, cached.pool) == {*step.out_slots.tolist(), cached.pool.scratch_slot}


def test_steps_a_graph_cannot_hold_run_eagerly(tiny):
    cached = Cached(tiny, "cpu", [4, 4, 4])
    runner = ExtendGraphRunner(tiny, cached.pool, 16, 2, 12, backend=EagerReplay())
    assert runner.can_run(cached.step([0, 1], [[1] * 8, [2] * 8]))  # 16 tokens, 2 requests, 8 indices
    assert not runner.can_run(cached.step([0], [[1] * 17]))  # past the largest graph
    assert not runner.can_run(cached.step([0, 1, 2], [[1], [2], [3]]))  # 3 requests > 2
    assert not runner.can_run(cached.step([0, 1], [[1], [2]]))  # prefixes of 13 + 9 slots > 12 indices
    assert not runner.can_run(cached.step([2], [[1]], mode="verify"), "all")  # no "all" graphs captured
    fresh = Cached(tiny, "cpu", [4, 4])
    assert not runner.can_run(fresh.step([0], [[]]))  # no tokens
    lora = fresh.step([0], [[5]])
    assert runner.can_run(lora)
    lora.requests = [types.SimpleNamespace(adapter=1, full_prefill=False)]  # LoRA rows are not captured
    assert not runner.can_run(lora)
    lora.requests = [types.SimpleNamespace(adapter=0, full_prefill=True)]  # prompt logprobs: own logit rows
    assert not runner.can_run(lora)
    decode = fresh.step([1], [[6]])
    decode.mode = "decode"
    assert not runner.can_run(decode)
    with pytest.raises(ValueError):
        ExtendGraphRunner(tiny, fresh.pool, 0, 2, 12, backend=EagerReplay())


def test_all_graphs_are_launched_for_the_verify_steps_bound(tiny):
    """With ``all_max_new`` the "all" graphs' kernels are launched for requests of at most that many
    new tokens (a verify step's drafts + 1): such a step replays and matches its eager step, one with a
    longer request runs eagerly. "last" graphs keep their size as the bound."""
    graphed, eager = Cached(tiny, "cpu", [4, 6, 8]), Cached(tiny, "cpu", [4, 6, 8])
    runner = ExtendGraphRunner(tiny, graphed.pool, 16, 3, 64, all_logits=True, backend=EagerReplay(),
                               all_max_new=3)  # fmt: skip
    assert runner._static_batch(16, "all", False).max_extend_len == 3
    assert runner._static_batch(16, "last", False).max_extend_len == 16
    rows, new = [0, 2], [[1, 2, 3], [4]]
    step_g, step_e = graphed.step(rows, new, mode="verify"), eager.step(rows, new, mode="verify")
    assert runner.can_run(step_g, "all")
    torch.testing.assert_close(
        runner.run(step_g, "all"),
        eager_logits(tiny, eager.pool, step_e, all_logits=True),
        rtol=1e-5,
        atol=1e-5,
    )
    assert not runner.can_run(graphed.step([1], [[1, 2, 3, 4]], mode="verify"), "all")
    assert runner.can_run(graphed.step([1], [[1, 2, 3, 4]]), "last")


async def run_all(engine: Engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # NOTE: one at a time: each later prompt finds the earlier ones' prefix cached
    return [await generate(engine, engine.tokenizer.encode_prompt(p), params) for p in prompts]


async def test_engine_with_extend_graphs_generates_the_same_tokens():
    """Cache hits prefill their uncached tail and speculative decoding verifies drafts through the
    graphs; the greedy tokens equal those of an engine without graphs."""
    shared = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3
    prompts = [shared + f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 2) for i in range(4)]
    cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=4096, speculative_tokens=3,
                       speculative_ngram_min=1)  # fmt: skip
    plain, graphed = build_engine(cfg), build_engine(cfg)
    executor = graphed.executor
    executor.extend_graphs = ExtendGraphRunner(executor.model, executor.kv_pool, 64, 8, 8 * 4096,
                                               all_logits=True, backend=EagerReplay(),
                                               all_max_new=cfg.speculative_tokens + 1)  # fmt: skip
    kinds: list[str] = []
    replay = executor.extend_graphs.run
    executor.extend_graphs.run = lambda batch, kind="last": (kinds.append(kind), replay(batch, kind))[1]
    for engine in (plain, graphed):
        engine.start()
    try:
        want, got = await run_all(plain, prompts, 40), await run_all(graphed, prompts, 40)
    finally:
        plain.stop()
        graphed.stop()
    assert got == want
    assert [len(t) for t in got] == [40] * len(prompts)
    stats = graphed.scheduler.stats
    assert stats.cached_tokens > 0  # the later prompts' shared prefix was a cache hit
    assert stats.verify_steps > 0  # drafts were checked
    assert {"last", "all"} <= set(kinds)  # prefill tails and verify steps both replayed
    assert executor.extend_graph_steps == len(kinds) and plain.executor.extend_graph_steps == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_extend_graph_replay_matches_eager_on_the_gpu():
    """Real capture (Triton kernels inside the graph) against eager steps on a copy of the pool."""
    model = load_model("tiny", "cuda").model
    lengths = [5, 40, 9, 130, 2, 64]
    rng = np.random.default_rng(2)
    for kind in ("last", "all"):  # NOTE: fresh requests per kind: STEPS fill each one's ROOM once
        graphed, eager = Cached(model, "cuda", lengths), Cached(model, "cuda", lengths)
        clone_pool_into(eager.pool, graphed.pool)
        runner = ExtendGraphRunner(model, graphed.pool, 64, 6, 6 * 256, all_logits=True)
        for rows, counts in STEPS:
            new = [rng.integers(0, 256, n).tolist() for n in counts]
            step_g, step_e = graphed.step(rows, new), eager.step(rows, new)
            got = runner.run(step_g, kind).float().cpu()
            want = eager_logits(model, eager.pool, step_e, all_logits=kind == "all").float().cpu()
            err = ((got - want).norm() / want.norm()).item()
            # NOTE: bf16, and the padded step may pick other GEMM kernels: equal up to rounding
            assert err < 1e-2, f"{kind}: graph vs eager relative error {err:.2e}"


def test_static_inputs_keep_the_kernels_contract_after_a_wider_step(tiny):
    """A narrow step after a wide one in the same graph: the rows past its requests are empty (no
    tokens, no prefix), never the wide step's leftovers (the kernels would read past their data)."""
    cached = Cached(tiny, "cpu", [3, 5, 7, 9])
    runner = ExtendGraphRunner(tiny, cached.pool, 16, 4, 256, backend=EagerReplay())
    runner.run(cached.step([0, 1, 2, 3], [[1, 2], [3, 4], [5, 6], [7, 8]]))
    narrow = cached.step([1], [[9, 10, 11]])
    runner.run(narrow)
    static = runner._static_batch(runner.padded_size(narrow.num_new_tokens), "last", False)
    assert static.qo_indptr.tolist() == [0, 3, 3, 3, 3]
    assert static.kv_indptr.tolist() == [0, 7, 7, 7, 7]  # request 1's 5 prompt + 2 earlier tokens
    assert static.out_slots[3:].tolist() == [cached.pool.scratch_slot] * 5


def test_steps_over_long_prefixes_replay_the_graphs_of_their_prefix_variant(monkeypatch):
    """With ``prefix_variants`` each graph that runs the extend kernel (more than SHORT_EXTEND tokens a
    request) is captured in kernels.extend_attention.graph_configs' configurations too (a bf16 model of
    head dim 128: the long-prefix tiles, and the prefix split where it adds programs); a step replays
    the one graph_variant picks for its longest cached prefix (here: the long-prefix tiles from 10
    cached tokens, the split from max(20, the graph's tokens)), and each gives the eager step's logits
    from its own output buffer."""
    from kernels import extend_attention as ext
    from worker.bench import random_llama
    from worker.model import ModelConfig

    monkeypatch.setattr(ext, "INTERPRETED", False)  # the compiled tile choices (the reference path runs)
    monkeypatch.setattr(ext, "GRAPH_LONG_TILES_MIN_PREFIX", 10)
    monkeypatch.setattr(ext, "SPLIT_GRAPH_MIN_PREFIX", 20)
    monkeypatch.setattr(ext, "SPLIT_GRAPH_PREFIX_PER_TOKEN", 1)
    config = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=128, max_position_embeddings=512)  # fmt: skip
    model = random_llama(config, "cpu", torch.bfloat16, seed=5)
    lengths = [5, 17, 9, 30, 2, 12]
    graphed, eager = Cached(model, "cpu", lengths), Cached(model, "cpu", lengths)
    assert (
        ExtendGraphRunner(model, graphed.pool, 64, 6, 6 * 128, backend=EagerReplay()).configs[64, "last"]
        == {}
    )
    seen: list = []  # each replayed forward's extend_config
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda b, pool: (seen.append(b.extend_config), forward(b, pool))[1])
    runner = ExtendGraphRunner(
        model, graphed.pool, 64, 6, 6 * 128, backend=EagerReplay(), prefix_variants=True
    )
    split = dataclasses.replace(ext.SM90_TILES, split_prefix=True)
    assert {size: runner.configs[size, "last"] for size in runner.sizes} == {
        8: {}, 16: {}, 32: {"long_prefix": ext.LONG_PREFIX_TILES, "split": split},
        64: {"long_prefix": ext.LONG_PREFIX_TILES, "split": split}}  # fmt: skip
    assert len(seen) == 8  # captures: the default of each size and two variants at 32 and 64
    rng = np.random.default_rng(3)
    want = []
    for rows, counts in STEPS:
        new = [rng.integers(0, 256, n).tolist() for n in counts]
        step_g, step_e = graphed.step(rows, new), eager.step(rows, new)
        size, prefix = runner.padded_size(step_g.num_new_tokens), step_g.max_prefix_tokens
        want.append("default" if size < 32 else "split" if prefix >= max(20, size) else
                    "long_prefix" if prefix >= 10 else "default")  # fmt: skip
        seen.clear()
        got = runner.run(step_g).float()
        assert seen == [runner.configs[size, "last"].get(want[-1])]
        ref = eager_logits(model, eager.pool, step_e).float()
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2  # NOTE: bf16; another step's logits: ~1
    assert want == ["default", "default", "default", "split", "long_prefix"]  # 21 over 37 cached; 33 over 17
    assert runner.variant_steps == {"default": 3, "split": 1, "long_prefix": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefix_variant_graphs_match_eager_on_the_gpu():
    """Real captures of every prefix variant (a bf16 model of head dim 128, the thresholds as shipped):
    steps over cached prefixes of 3,000 and 1,500 tokens replay the split graphs, one over 700 the
    long-prefix tiles, short prefixes and an 8-token step the default; each gives the eager step's
    logits (the eager step takes the kernel's own default configuration)."""
    from kernels.extend_attention import device_arch
    from worker.bench import random_llama
    from worker.model import ModelConfig

    if device_arch(torch.device("cuda")) < 90:
        pytest.skip("the long-prefix tiles are captured from sm_90")
    config = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=128, max_position_embeddings=4096)  # fmt: skip
    model = random_llama(config, "cuda", torch.bfloat16, seed=5)
    lengths = [1500, 40, 700, 3000, 9, 600]
    graphed, eager = (Cached(model, "cuda", lengths, pool_pages=1600) for _ in range(2))
    clone_pool_into(eager.pool, graphed.pool)
    runner = ExtendGraphRunner(model, graphed.pool, 64, 6, 6 * 1024, prefix_variants=True)
    assert {size: sorted(runner.configs[size, "last"]) for size in runner.sizes} == {
        8: [], 16: [], 32: ["long_prefix", "split"], 64: ["long_prefix", "split"]}  # fmt: skip
    rng = np.random.default_rng(4)
    steps = (([3], [30]), ([2], [40]), ([1, 4], [20, 20]), ([0, 5], [20, 30]), ([1], [8]))
    for rows, counts in steps:
        new = [rng.integers(0, 256, n).tolist() for n in counts]
        step_g, step_e = graphed.step(rows, new), eager.step(rows, new)
        got = runner.run(step_g).float().cpu()
        want = eager_logits(model, eager.pool, step_e).float().cpu()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-2, f"{rows}: graph vs eager relative error {err:.2e}"  # NOTE: bf16
    # 3,000 and 1,500 cached: split; 700: long-prefix tiles; 40: default; 8 tokens: no variant captured
    assert runner.variant_steps == {"split": 2, "long_prefix": 1, "default": 2}
