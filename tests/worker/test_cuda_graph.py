"""Decode graphs: a padded, replayed decode step computes what the eager step computes, and padded
rows touch nothing but the scratch slot.

On CPU the capture itself is replaced by re-running the function over the same static buffers (the
only part that needs a GPU); the gpu-marked test captures real CUDA graphs."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
import torch

from worker.assembly import build_engine
from worker.bench_speculative import generate
from worker.config import WorkerConfig
from worker.cuda_graph import DecodeGraphRunner, graph_batch_sizes
from worker.engine import Engine
from worker.forward_batch import ForwardBatch
from worker.kv_pool import KVPool, slots_for
from worker.model import load_model
from worker.request import ScheduledBatch
from worker.sampling import SamplingParams

PAGE = 4  # tokens


class EagerReplay:
    """Replays by calling the captured function again, into the output tensor of the first call.
    ``lazy``: the capture calls nothing and the first replay sizes the (float32) output, for models on
    interpreted kernels, where every forward is slow and most captured sizes never replay."""

    def __init__(self, lazy: bool = False) -> None:
        self.lazy = lazy
        self.captured: list[int] = []  # rows of each capture's output, in capture order (not lazy)

    def capture(self, fn):
        out = torch.empty(0) if self.lazy else fn()
        if not self.lazy:
            self.captured.append(out.shape[0])

        def replay() -> None:
            with torch.inference_mode():
                got = fn()
                if self.lazy:
                    out.resize_(got.shape)
                out.copy_(got)

        return replay, out


def test_a_captured_graph_holds_the_tensors_its_function_holds(monkeypatch):
    """A CUDA graph reads the memory of every tensor its function held at capture (a static batch's
    qo_indptr, say). Its replay must keep that function: a tensor freed after the capture goes back
    to the allocator while the graph still reads it. torch.cuda's streams and graphs are stand-ins
    here (only what the replay holds is checked); pytest -m gpu replays real graphs."""
    import contextlib
    import gc
    import weakref

    from worker.cuda_graph import CudaGraphBackend

    replays = []
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    graph = types.SimpleNamespace(replay=lambda: replays.append(1), pool=lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    held = torch.arange(5, dtype=torch.int32)  # like a static batch's qo_indptr, made outside the capture
    alive = weakref.ref(held)
    replay, _ = CudaGraphBackend().capture(lambda t=held: t + 1)
    del held
    gc.collect()
    assert alive() is not None
    replay()
    assert replays == [1]
    del replay
    gc.collect()
    assert alive() is None


def test_static_inputs_fill_two_host_mirrors_in_turn():
    """A step scheduled ahead is filled while the step before may not have been copied to the device
    yet: the mirror that step was filled in must stay as it was until the step after next."""
    from worker.cuda_graph import StaticInputs

    inputs = StaticInputs({"a": 4, "b": 6}, torch.device("cpu"))
    inputs.put("a", np.array([1, 2, 3]), 4, pad=-1)
    inputs.put("b", np.array([7, 8]))
    inputs.upload()
    first = inputs.device_buf.clone()
    assert first[:6].tolist() == [1, 2, 3, -1, 7, 8]
    inputs.put("a", np.array([5]), 4)  # the next step, filled before the first one's copy has run
    inputs.put("b", np.array([9, 9, 9]))
    filled = [m[:7].tolist() for m in inputs._mirrors]
    assert [1, 2, 3, -1, 7, 8] in [f[:6] for f in filled]  # NOTE: the first step's mirror is intact
    inputs.upload()
    assert inputs.device_buf[:7].tolist() == [5, 0, 0, 0, 9, 9, 9]
    inputs.put("a", np.array([4, 4, 4, 4]))  # the step after next reuses the first mirror
    inputs.upload()
    assert inputs.device_buf[:4].tolist() == [4, 4, 4, 4]


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(0) == []


class Fleet:
    """Requests with prompts of different lengths prefilled into a pool; builds their decode steps."""

    def __init__(
        self, model, device: str, lengths: list[int], seed: int = 0, room: int = 8, pool_pages: int = 256
    ) -> None:
        c = model.config
        self.model = model
        self.pool = KVPool(pool_pages, PAGE, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype, device)
        rng = np.random.default_rng(seed)
        self.tokens = [rng.integers(0, 256, n).tolist() for n in lengths]
        # NOTE: pages for ``room`` more tokens each (8: eight decode steps)
        self.pages = [self.pool.allocator.alloc(-(-(n + room) // PAGE)) for n in lengths]
        slots = [slots_for(p, 0, n, PAGE).tolist() for p, n in zip(self.pages, lengths, strict=True)]
        batch = ForwardBatch.build("extend", self.tokens, [0] * len(lengths), slots, [[] for _ in lengths],
                                   device=device)  # fmt: skip
        model(batch, self.pool)

    def decode_step(self, rows: list[int], next_tokens: list[int]) -> ScheduledBatch:
        """Requests ``rows`` each add one token (position = their current length)."""
        pos = [len(self.tokens[r]) for r in rows]
        all_slots = [slots_for(self.pages[r], 0, p + 1, PAGE) for r, p in zip(rows, pos, strict=True)]
        for r, t in zip(rows, next_tokens, strict=True):
            self.tokens[r].append(t)
        lens = [len(s) for s in all_slots]
        return ScheduledBatch(
            mode="decode",
            requests=[types.SimpleNamespace(adapter=0)] * len(rows),  # type: ignore[list-item]
            starts=pos,
            ends=[p + 1 for p in pos],
            sample=[True] * len(rows),
            input_ids=np.array(next_tokens, dtype=np.int64),
            positions=np.array(pos, dtype=np.int64),
            out_slots=np.array([s[-1] for s in all_slots], dtype=np.int64),
            qo_indptr=np.arange(len(rows) + 1, dtype=np.int32),
            kv_indptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
            kv_indices=np.concatenate(all_slots).astype(np.int64),
        )


def eager_logits(
    model, pool, step: ScheduledBatch, all_logits: bool = False, lora: bool = True
) -> torch.Tensor:
    """The step run eagerly (every token's logits with ``all_logits``), with its requests' LoRA
    adapters unless ``lora`` is False."""
    from worker.model.lora import lora_batch

    batch = ForwardBatch.from_step(step, pool.k_cache[0].device)
    batch.return_all_logits = all_logits
    if lora:
        batch.lora = lora_batch(model.lora_stack, [r.adapter for r in step.requests], batch.qo_indptr,
                                batch.max_extend_len)  # fmt: skip
    return model(batch, pool)


def assert_same_pool_but_scratch(got: KVPool, want: KVPool) -> None:
    """Every slot's K and V alike in both pools, but the scratch row's (padding writes it)."""
    real = slice(0, got.scratch_slot)
    for g, e in zip(got.k_cache + got.v_cache, want.k_cache + want.v_cache, strict=True):
        torch.testing.assert_close(g[real], e[real], rtol=1e-5, atol=1e-5)


def clone_pool_into(dst: KVPool, src: KVPool) -> None:
    for d, s in zip(dst.k_cache + dst.v_cache, src.k_cache + src.v_cache, strict=True):
        d.copy_(s)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu").model


def test_replayed_steps_match_eager_steps_at_every_padding(tiny):
    """Batches of 1, 3, 5 and 8 requests (padded to 1, 4, 8, 8) over prompts of different lengths:
    same logits and same pool contents as eager steps on a copy of the pool."""
    lengths = [5, 17, 9, 30, 2, 12, 21, 7]
    graphed, eager = Fleet(tiny, "cpu", lengths), Fleet(tiny, "cpu", lengths)
    backend = EagerReplay()
    runner = DecodeGraphRunner(tiny, graphed.pool, max_batch=8, max_kv_indices=8 * 64, backend=backend)
    assert backend.captured == [8, 4, 2, 1]  # largest first
    rng = np.random.default_rng(1)
    for rows in ([3], [0, 4, 6], [1, 2, 3, 5, 7], list(range(8)), [6]):
        toks = rng.integers(0, 256, len(rows)).tolist()
        step_g, step_e = graphed.decode_step(rows, toks), eager.decode_step(rows, toks)
        assert runner.can_run(step_g)
        got = runner.run(step_g).clone()
        want = eager_logits(tiny, eager.pool, step_e)
        assert got.shape == want.shape == (len(rows), tiny.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert_same_pool_but_scratch(graphed.pool, eager.pool)


def test_padded_rows_write_only_the_scratch_slot(tiny):
    fleet = Fleet(tiny, "cpu", [6, 11, 3])
    runner = DecodeGraphRunner(tiny, fleet.pool, max_batch=8, max_kv_indices=512, backend=EagerReplay())
    for t in fleet.pool.k_cache + fleet.pool.v_cache:  # NOTE: the captures wrote what padding writes again
        t[fleet.pool.scratch_slot] = 1234.5
    before = [t.clone() for t in fleet.pool.k_cache + fleet.pool.v_cache]
    step = fleet.decode_step([0, 1, 2], [65, 66, 67])  # 3 requests -> the 4-row graph: one padded row
    logits = runner.run(step)
    assert torch.isfinite(logits).all()
    changed = set()
    for old, new in zip(before, fleet.pool.k_cache + fleet.pool.v_cache, strict=True):
        changed |= set(torch.nonzero((old != new).flatten(1).any(1)).flatten().tolist())
    assert changed == {*step.out_slots.tolist(), fleet.pool.scratch_slot}


def test_steps_a_graph_cannot_hold_run_eagerly(tiny):
    fleet = Fleet(tiny, "cpu", [4, 4, 4])
    runner = DecodeGraphRunner(tiny, fleet.pool, max_batch=2, max_kv_indices=10, backend=EagerReplay())
    assert runner.can_run(fleet.decode_step([0, 1], [1, 2]))  # 2 requests x 5 slots = 10 indices
    assert not runner.can_run(fleet.decode_step([0, 1, 2], [1, 2, 3]))  # 3 requests > 2
    assert not runner.can_run(fleet.decode_step([0, 1], [1, 2]))  # 2 x 7 slots > 10 indices
    prefill = fleet.decode_step([2], [4])
    prefill.mode = "extend"
    assert not runner.can_run(prefill)
    lora = fleet.decode_step([2], [5])
    assert runner.can_run(lora)
    lora.requests = [types.SimpleNamespace(adapter=1)]  # LoRA rows are not in the captured graph
    assert not runner.can_run(lora)
    with pytest.raises(ValueError):
        DecodeGraphRunner(tiny, fleet.pool, max_batch=0, max_kv_indices=9, backend=EagerReplay())


async def test_engine_with_decode_graphs_generates_the_same_tokens():
    """The executor replays decode steps through the runner (batch sizes shrinking as requests
    finish) and the greedy tokens equal those of an engine without graphs."""
    prompts = [
        f"Request {i}: tell me about paged attention and radix caches." * (1 + i % 3) for i in range(6)
    ]
    lengths = [3, 9, 14, 5, 11, 7]  # tokens generated: batches of 6, 5, 4, ... requests decode together

    async def run_all(engine: Engine) -> list[list[int]]:
        def params(n: int) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

        return await asyncio.gather(*(generate(engine, engine.tokenizer.encode_prompt(p), params(n))
                                      for p, n in zip(prompts, lengths, strict=True)))  # fmt: skip

    cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=4096)
    plain, graphed = build_engine(cfg), build_engine(cfg)
    executor = graphed.executor
    executor.decode_graphs = DecodeGraphRunner(executor.model, executor.kv_pool, max_batch=8,
                                               max_kv_indices=8 * 4096, backend=EagerReplay())  # fmt: skip
    for engine in (plain, graphed):
        engine.start()
    try:
        want, got = await run_all(plain), await run_all(graphed)
    finally:
        plain.stop()
        graphed.stop()
    assert got == want
    assert [len(t) for t in got] == lengths
    assert executor.graph_steps >= max(lengths) - 1  # every decode step went through the graphs
    assert plain.executor.graph_steps == 0


def mixed_model(device: str, dtype: torch.dtype):
    """The tiny model's shape as a mixture of experts (8 experts, 2 a token) whose first layer attends a
    sliding window of 64 tokens, every score soft-capped: what a decode graph of Qwen3-MoE, Mistral or
    Gemma 2 captures beyond a dense model's (the experts' routing and sort, windows, caps), random weights."""
    import dataclasses

    from worker.bench import random_llama
    from worker.model.tiny import tiny_config

    config = dataclasses.replace(tiny_config(), num_experts=8, experts_per_token=2, moe_intermediate_size=128,
                                 sliding_window=64, sliding_layers=(0,), attn_logit_softcapping=30.0)  # fmt: skip
    return random_llama(config, device, dtype, seed=3)


def test_replayed_mixture_window_and_cap_steps_match_eager_steps():
    """mixed_model's decode steps through the runner (the graphs' functions run eagerly here) against
    eager steps: the same logits and pool."""
    model = mixed_model("cpu", torch.float32)
    lengths = [5, 70, 9, 130, 2]
    graphed, eager = Fleet(model, "cpu", lengths), Fleet(model, "cpu", lengths)
    clone_pool_into(eager.pool, graphed.pool)
    runner = DecodeGraphRunner(
        model, graphed.pool, max_batch=8, max_kv_indices=8 * 256, backend=EagerReplay()
    )
    rng = np.random.default_rng(4)
    for rows in ([3], [0, 1, 4], list(range(5))):
        toks = rng.integers(0, 256, len(rows)).tolist()
        step_g, step_e = graphed.decode_step(rows, toks), eager.decode_step(rows, toks)
        torch.testing.assert_close(runner.run(step_g).clone(), eager_logits(model, eager.pool, step_e),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        assert_same_pool_but_scratch(graphed.pool, eager.pool)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["tiny", "mixed"])
def test_cuda_graph_replay_matches_eager_on_the_gpu(kind):
    """Real capture (Triton kernels inside the graph) against eager steps on a copy of the pool; "mixed":
    mixed_model, whose experts' routing and sort, window and cap are captured too."""
    model = load_model("tiny", "cuda").model if kind == "tiny" else mixed_model("cuda", torch.bfloat16)
    lengths = [5, 40, 9, 130, 2, 64, 21, 7, 300, 16]
    graphed, eager = Fleet(model, "cuda", lengths), Fleet(model, "cuda", lengths)
    clone_pool_into(eager.pool, graphed.pool)
    runner = DecodeGraphRunner(model, graphed.pool, max_batch=16, max_kv_indices=16 * 256)
    rng = np.random.default_rng(2)
    for rows in ([3], [0, 8, 6], list(range(10)), [9, 1]):
        toks = rng.integers(0, 256, len(rows)).tolist()
        step_g, step_e = graphed.decode_step(rows, toks), eager.decode_step(rows, toks)
        got = runner.run(step_g).float().cpu()
        want = eager_logits(model, eager.pool, step_e).float().cpu()
        err = ((got - want).norm() / want.norm()).item()
        # NOTE: bf16, and the padded batch may pick other GEMM kernels: equal up to rounding
        assert err < 1e-2, f"graph vs eager relative error {err:.2e}"
    # worker.bench times the GPU's share of a step by replaying the captured forward alone
    from worker.bench_parts import time_graph_replays

    logits = runner.run(step_g)  # a view of the size-2 graph's output; the same step again
    before = logits.clone()
    times = time_graph_replays(runner, [1, 3, 16, 17], reps=5)
    assert list(times) == ["1", "3", "16"]  # 17 is past the largest graph: not timed
    assert all(0 < ms < 1e3 for ms in times.values()), times
    with torch.inference_mode():  # the graph's output buffer is an inference tensor
        logits.fill_(float("nan"))
    runner.replay_of(2)()
    assert torch.equal(logits, before)


def with_adapters(step: ScheduledBatch, adapters: list[int]) -> ScheduledBatch:
    step.requests = [types.SimpleNamespace(adapter=a) for a in adapters]  # type: ignore[misc]
    return step


def test_lora_steps_replay_their_own_graphs():
    """With adapters loaded before the capture, every size is captured twice; a step mixing two
    adapters and the base replays the LoRA graph (padded rows without an adapter) and matches its
    eager step, a base step the plain graph. An adapter that makes the stack grow sends LoRA steps
    back to the eager path."""
    from tests.kernels.test_model_kernels import add_adapters
    from worker.model.lora import LoraAdapter

    model = load_model("tiny", "cpu").model
    add_adapters(model)
    lengths = [5, 17, 9, 30, 2]
    graphed, eager = Fleet(model, "cpu", lengths), Fleet(model, "cpu", lengths)
    backend = EagerReplay()
    runner = DecodeGraphRunner(model, graphed.pool, max_batch=4, max_kv_indices=4 * 64, backend=backend)
    assert backend.captured == [4, 4, 2, 2, 1, 1]
    rng = np.random.default_rng(3)
    for rows, adapters in (
        ([0, 1, 2], [1, 0, 2]),
        ([3], [2]),
        ([4, 0], [0, 0]),
        ([1, 2, 3, 4], [2, 2, 1, 1]),
    ):
        toks = rng.integers(0, 256, len(rows)).tolist()
        step_g = with_adapters(graphed.decode_step(rows, toks), adapters)
        step_e = with_adapters(eager.decode_step(rows, toks), adapters)
        assert runner.can_run(step_g)
        got = runner.run(step_g).clone()
        base = eager_logits(model, eager.pool, step_e, lora=False)  # NOTE: its K/V are overwritten next
        want = eager_logits(model, eager.pool, step_e)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(got, base, rtol=1e-2, atol=1e-2) == (not any(adapters))  # adapters matter
        assert_same_pool_but_scratch(graphed.pool, eager.pool)
    big = LoraAdapter("wide", 64, 1.0)
    big.weights[(0, "o")] = (
        torch.zeros(64, model.layers[0].o_proj.shape[1]),
        torch.zeros(model.config.hidden_size, 64),
    )
    model.add_lora(big)  # NOTE: a larger rank than the stack has: its tensors are reallocated
    step = with_adapters(graphed.decode_step([0], [1]), [1])
    assert not runner.can_run(step)
    assert runner.can_run(with_adapters(graphed.decode_step([1], [1]), [0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_graph_replay_matches_eager_on_the_gpu():
    """Real capture of the LoRA graphs (the Triton LoRA kernels inside them) against eager steps, the
    LoRA segments joined across neighbouring requests of one adapter."""
    from tests.kernels.test_model_kernels import add_adapters

    model = load_model("tiny", "cuda").model
    add_adapters(model)
    lengths = [5, 40, 9, 130, 2, 64, 21] + [7 + 5 * i for i in range(13)]
    graphed, eager = Fleet(model, "cuda", lengths), Fleet(model, "cuda", lengths)
    clone_pool_into(eager.pool, graphed.pool)
    runner = DecodeGraphRunner(model, graphed.pool, max_batch=24, max_kv_indices=24 * 256)
    rng = np.random.default_rng(5)
    # NOTE: the last step's 18 neighbours on adapter 1 make two segments (16 rows + 2) in its graph
    for rows, adapters in (([3], [1]), ([0, 6, 2], [2, 0, 1]), (list(range(7)), [1, 2, 0, 2, 1, 0, 2]),
                           (list(range(20)), [1] * 18 + [2, 0])):  # fmt: skip
        toks = rng.integers(0, 256, len(rows)).tolist()
        step_g = with_adapters(graphed.decode_step(rows, toks), adapters)
        step_e = with_adapters(eager.decode_step(rows, toks), adapters)
        assert runner.can_run(step_g)
        got = runner.run(step_g).float().cpu()
        want = eager_logits(model, eager.pool, step_e).float().cpu()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-2, f"LoRA graph vs eager relative error {err:.2e}"


def test_adapters_loaded_after_the_capture_into_room_made_for_them_replay_the_lora_graphs():
    """--max-loras: room made before the capture, no adapter yet; adapters loaded afterwards (as at
    runtime) run in the LoRA graphs and match their eager steps."""
    from tests.kernels.test_model_kernels import add_adapters

    model = load_model("tiny", "cpu").model
    model.lora_stack.reserve(2, 6)
    fleet, eager = Fleet(model, "cpu", [7, 12]), Fleet(model, "cpu", [7, 12])
    backend = EagerReplay()
    runner = DecodeGraphRunner(model, fleet.pool, max_batch=2, max_kv_indices=64, backend=backend)
    assert backend.captured == [2, 2, 1, 1] and runner.lora.stack is model.lora_stack
    add_adapters(model)
    assert model.lora_stack.version == runner.lora.version
    step = with_adapters(fleet.decode_step([0, 1], [3, 4]), [2, 1])
    assert runner.can_run(step)
    want = eager_logits(model, eager.pool, with_adapters(eager.decode_step([0, 1], [3, 4]), [2, 1]))
    torch.testing.assert_close(runner.run(step), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("room", [0, 1])
def test_an_adapter_loaded_at_runtime_without_room_in_the_graphs_is_logged(caplog, room):
    from worker.model.lora import LoraAdapter, add_adapter

    engine = build_engine(WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=1024, max_loras=room))
    executor = engine.executor
    executor.decode_graphs = DecodeGraphRunner(executor.model, executor.kv_pool, max_batch=2, max_kv_indices=64,
                                               backend=EagerReplay())  # fmt: skip
    adapter = LoraAdapter("late", 4, 1.0)
    out, inp = executor.model.layers[0].qkv_proj.shape
    adapter.weights[(0, "qkv")] = (torch.zeros(4, inp), torch.zeros(out, 4))
    with caplog.at_level("WARNING", logger="worker.engine"):
        assert add_adapter(engine, adapter) == 1
    warned = [r for r in caplog.records if "no room for it" in r.getMessage()]
    assert len(warned) == (0 if room else 1)
    assert executor.decode_graphs.lora.current() == bool(room)


def test_replay_of_is_the_replay_a_step_runs(tiny):
    fleet = Fleet(tiny, "cpu", [5, 9, 3])
    runner = DecodeGraphRunner(tiny, fleet.pool, max_batch=4, max_kv_indices=64, backend=EagerReplay())
    logits = runner.run(fleet.decode_step([0, 1], [7, 8]))
    want = logits.clone()
    with torch.inference_mode():  # the graph's output buffer is an inference tensor
        logits.fill_(float("nan"))
    runner.replay_of(2)()  # the same static inputs: the same logits, into the same buffer
    assert torch.equal(logits, want)
