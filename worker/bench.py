"""Worker benchmark: prefill and decode tokens/s and TTFT with a cached prefix, through the real engine.

`python -m worker.bench [--model tiny|llama3-8b-shape|qwen3-30b-a3b-shape|gpt-oss-20b-shape] [...]` drives Engine.submit
in-process (scheduler, radix cache, model); it never starts an HTTP server and never reads a checkpoint
from disk.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import orjson

from worker import bench_radix
from worker.bench_parts import time_graph_replays, time_host_copies
from worker.bench_report import decode_floor, machine_info, markdown_table, measure_copy_gbs
from worker.config import KV_CACHE_DTYPES, WorkerConfig
from worker.engine import Engine
from worker.engine_api import RequestOutput
from worker.model.config import ModelConfig
from worker.sampling import SamplingParams

LLAMA3_8B_SHAPE = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,  # tokens
)
# Qwen3-30B-A3B's shape: 48 layers of 128 experts (8 a token, 768 units each), 30.5B parameters, 3.3B a token
QWEN3_30B_A3B_SHAPE = ModelConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,  # units (no layer of it is dense)
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=8192,  # tokens (as the 8B shape's, for the same prompts)
    qk_norm=True,
    num_experts=128,
    experts_per_token=8,
    moe_intermediate_size=768,
    model_type="qwen3_moe",
)
# gpt-oss-20b's shape: 24 layers of 32 experts (4 a token, 2,880 units each) in MXFP4 as released (random codes),
# attention sinks, every other layer windowed over 128 tokens; 20.9B parameters, 3.6B a token
GPT_OSS_20B_SHAPE = ModelConfig(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=150000.0,
    max_position_embeddings=8192,  # tokens (as the 8B shape's, for the same prompts)
    qkv_bias=True,
    o_bias=True,
    num_experts=32,
    experts_per_token=4,
    moe_intermediate_size=2880,
    moe_bias=True,
    expert_activation="clamped_swiglu",
    attention_sinks=True,
    sliding_window=128,
    sliding_layers=tuple(range(0, 24, 2)),
    mxfp4_experts=True,
    model_type="gpt_oss",
)
SHAPES = {
    "llama3-8b-shape": LLAMA3_8B_SHAPE,
    "qwen3-30b-a3b-shape": QWEN3_30B_A3B_SHAPE,
    "gpt-oss-20b-shape": GPT_OSS_20B_SHAPE,
}  # random bf16 weights
MODELS = ("tiny", *SHAPES)
CACHED_FRACTIONS = (0.0, 0.5, 0.9)  # of the prompt already in the radix cache before a TTFT request
# a long conversation's next turn: a --follow-up-context prompt whose all but its last this many tokens
# are cached (the extend graphs' prefix split is for this case)
FOLLOW_UP_TOKENS = 100
# what a client asking for everything costs per decode step: every history-dependent adjustment
# (worker/penalties.py) and the top-5 logprobs, still greedy so the tokens stay comparable
ADJUSTED = {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2,
            "logit_bias": {5: 1.0}, "min_tokens": 1, "logprobs": 5}  # fmt: skip
# what most clients ask: sampling (unseeded) with a nucleus; the sampler's own cost per decode step
SAMPLED = {"temperature": 0.7, "top_p": 0.9}
REQUEST_TIMEOUT_S = 600.0
# flag -> (normal default, --quick default); an explicit flag always wins
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "prompt_tokens": (2048, 256),
    "follow_up_context": (8000, 512),
    "batches": ("1,16,64", "1,4"),
    "decode_steps": (64, 8),
    "decode_prompt_tokens": (512, 32),
    "prefill_prompts": (4, 2),
    "reps": (5, 2),
    "radix_iters": (200, 10),
}


@dataclass
class BenchParams:
    model: str
    device: str  # resolved: cpu | cuda
    prompt_tokens: int  # prefill and TTFT prompts
    follow_up_context: int  # the follow-up TTFT prompt (FOLLOW_UP_TOKENS of it uncached)
    batches: list[int]
    decode_steps: int  # generated tokens per decode request (ignore_eos)
    decode_prompt_tokens: int  # prompt of each decode request (the decode context starts here)
    prefill_prompts: int  # uncached prompts submitted together for the prefill measurement
    reps: int  # TTFT requests per cached fraction (median reported)
    radix_iters: int
    cpu_threads: int  # requested; 0 = torch's default
    kv_cache_tokens: int | None
    host_cache_tokens: int
    block_size: int
    chunked_prefill_tokens: int
    cuda_graph_max_bs: int  # decode steps of up to this many requests replay CUDA graphs (CUDA only)
    cuda_graph_extend_tokens: int  # extend steps of up to this many new tokens replay CUDA graphs (CUDA only)
    seed: int
    quick: bool
    tensor_parallel_size: int = 1  # ranks the model is split over (worker/tensor_parallel.py)
    overlap_schedule: str = "auto"  # decode steps scheduled while the one before runs (auto: on CUDA)
    kv_cache_dtype: str = "auto"  # the KV pool's dtype (--kv-cache-dtype: auto or an fp8 format)
    fp8_weights: bool = False  # the projections kept in fp8 with 128x128 block scales (kernels.fp8_linear)
    fp8_activations: bool = False  # with fp8_weights: their inputs quantized per token (W8A8)
    kv_scales: bool = False  # over an fp8 pool: random KV scales, each KV head's its own (a release's)


class IdTokenizer:
    """Stand-in tokenizer for a model without one (the engine only decodes): decoded text is empty."""

    def __init__(self, vocab_size: int) -> None:
        self.name, self.vocab_size, self.eos_token_ids = "ids", vocab_size, []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes | None:
        return None


def random_llama(config: ModelConfig, device: Any, dtype: Any, seed: int = 0) -> Any:
    """A LlamaForCausalLM with random weights generated directly on ``device`` (no host copy)."""
    import torch

    from worker.model import LlamaForCausalLM

    model = LlamaForCausalLM(config, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype == torch.float8_e4m3fn:  # NOTE: projections kept in fp8: codes of rms 64
                codes = torch.empty(param.shape, device=device).normal_(0.0, 64.0, generator=gen)
                param.copy_(codes.clamp(-448.0, 448.0))
            elif name.endswith("input_scale"):  # NOTE: static input scales: O(1) inputs unclipped
                param.fill_(2.0**-6)
            elif name.endswith("kv_pool_scale"):  # NOTE: an fp8 pool's K and V scales, each KV head's its own
                # (no powers of two: they round otherwise than the unscaled values do)
                heads = torch.arange(param.shape[1], device=device)
                param.copy_(torch.tensor([[0.03], [0.0125]], device=device) * (1 + heads / 4))
            elif param.dtype == torch.float32 and name.endswith(("_scale", "_scales")):
                # NOTE: their scales (experts' too): weights of rms 1/sqrt(fan_in), as below
                weight = name.removesuffix("_scales") if name.endswith("_scales") else name[:-6] + "_proj"
                param.fill_(model.get_parameter(weight).shape[-1] ** -0.5 / 64)
            elif param.dtype == torch.uint8 and not name.endswith("_scales"):
                param.random_(0, 256, generator=gen)  # NOTE: MXFP4 experts' codes: any
            elif param.dtype == torch.uint8:  # NOTE: their scales: weights of rms ~1/sqrt(fan_in), as below
                fan_in = param.shape[-1] * 32  # (random codes' values have an rms of 2.93)
                param.fill_(127 + round(-math.log2(2.93 * fan_in**0.5)))
            elif param.dim() == 1:
                param.fill_(1.0)  # RMSNorm gains (Llama has no biases)
            else:  # NOTE: std 1/sqrt(fan_in) keeps activations O(1) through 32 layers in bf16
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    model.settle_scales()
    return model


def fp8_projections(config: ModelConfig, fp8_activations: bool = False) -> ModelConfig:
    """``config`` with its projections kept in fp8, one scale a 128 x 128 block (Qwen3's and DeepSeek's fp8
    releases as --fp8-weights fp8 serves them); ``fp8_activations``: their inputs quantized per token
    (--fp8-activations dynamic)."""
    return replace(config, fp8_weights=True, fp8_weight_block=(128, 128), fp8_projections=True,
                   fp8_activations=fp8_activations)  # fmt: skip


def bench_model(name: str, device: str, dtype: str = "auto") -> Any:
    """The model a step benchmark times: the built-in tiny model, or a SHAPES model with random
    weights; in ``dtype`` (a --dtype value: "auto" is the device's default)."""
    import torch

    from worker.model import load_model
    from worker.model.loader import model_dtype

    dev = torch.device(device)
    dt = model_dtype(dtype, dev)
    return load_model("tiny", dev, dt).model if name == "tiny" else random_llama(SHAPES[name], dev, dt)


def build_bench_engine(cfg: WorkerConfig, model_config: ModelConfig | None = None) -> Engine:
    """``build_engine(cfg)`` for tiny; for a shape-only config the same wiring with random weights."""
    import torch

    from worker.assembly import assemble_engine, build_engine, host_tier, make_kv_pool, tune_cpu_process
    from worker.model.loader import model_dtype
    from worker.model_executor import model_executor

    if model_config is None:
        return build_engine(cfg)
    device = torch.device(cfg.device)
    if device.type == "cpu":
        tune_cpu_process(cfg.cpu_threads)
    dtype = model_dtype(cfg.dtype, device)
    model = random_llama(model_config, device, dtype)
    mc = model_config
    # NOTE: the worker's own sizing (--kv-cache-dtype, --mem-fraction)
    pool = make_kv_pool(cfg, model, device)
    executor, tokenizer = model_executor(cfg, model, pool, device, mc.max_context), IdTokenizer(mc.vocab_size)
    # NOTE: assemble_engine is build_engine's own wiring (cache, publisher, scheduler); only the model differs
    name = cfg.served_model_name or "random"
    return assemble_engine(cfg, executor, pool.allocator, tokenizer, mc.max_context, name,  # type: ignore[arg-type]
                           host=host_tier(cfg, pool))  # fmt: skip


# ---------------------------------------------------------------------------- driving requests
@dataclass
class Trace:
    submitted: float  # perf_counter s
    token_times: list[float]  # arrival of each generated token at the caller (perf_counter s)
    last: RequestOutput


async def run_request(engine: Engine, prompt: list[int], max_tokens: int, extra: dict | None = None) -> Trace:
    """Submit one greedy ignore_eos request (``extra``: more SamplingParams fields, or others in
    their place) and collect its tokens' arrival times."""
    # NOTE: the engine thread calls .tolist() on the sampled ids before emitting, which waits for
    # the device, so an output that reaches us carries a finished step (CUDA included).
    params = SamplingParams(
        **{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **(extra or {})}
    )
    submitted = time.perf_counter()
    handle = engine.submit(prompt, params)
    times: list[float] = []
    while True:
        out = await asyncio.wait_for(handle.outputs.get(), REQUEST_TIMEOUT_S)
        now = time.perf_counter()
        if out.error is not None:
            raise RuntimeError(f"request failed: {out.error}")
        times.extend([now] * len(out.token_ids))
        if out.finish_reason is not None:
            return Trace(submitted, times, out)


class Prompts:
    """Distinct random token-id prompts (so nothing is cached by accident)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def make(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, size=n).tolist()


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


async def measure_prefill(engine: Engine, p: BenchParams, prompts: Prompts) -> dict:
    """Uncached prompts submitted together, one output token each: computed prompt tokens / wall s."""
    await engine.flush_cache()
    batch = [prompts.make(p.prompt_tokens) for _ in range(p.prefill_prompts)]
    _sync(p.device)
    before, t0 = engine.snapshot(), time.perf_counter()
    await asyncio.gather(*(run_request(engine, x, 1) for x in batch))
    elapsed = time.perf_counter() - t0
    computed = engine.snapshot().prefill_tokens - before.prefill_tokens
    return {
        "computed_tokens": computed,
        "elapsed_s": round(elapsed, 4),
        "tokens_per_s": round(computed / elapsed, 1),
    }


async def measure_decode(
    engine: Engine, p: BenchParams, prompts: Prompts, batch: int, extra: dict | None = None
) -> dict:
    """``batch`` requests decoding together (each with ``extra`` sampling fields). Measured over the window in which all of them decode:
    from the last first token (every prefill done) to the first finish (nobody left yet)."""
    await engine.flush_cache()
    _sync(p.device)
    before = engine.snapshot()
    traces = await asyncio.gather(
        *(
            run_request(engine, prompts.make(p.decode_prompt_tokens), p.decode_steps, extra)
            for _ in range(batch)
        )
    )
    start = max(t.token_times[0] for t in traces)
    first_done = min(traces, key=lambda t: t.token_times[-1])
    end = first_done.token_times[-1]
    # NOTE: every request gets one token per step inside the window, so count the window's steps on
    # one request: callers wake one after another, so stamps of one step differ by µs between them.
    steps = sum(1 for x in first_done.token_times if start < x <= end)
    if steps == 0 or end <= start:
        raise RuntimeError(f"no decode step with all {batch} requests running; raise --decode-steps")
    window = end - start  # s
    after = engine.snapshot()
    counted = after.decode_tokens - before.decode_tokens  # whole run, incl. outside the window
    return {"batch": batch, "window_steps": steps, "window_tokens": batch * steps, "window_s": round(window, 5),
            "tokens_per_s": round(batch * steps / window, 1), "step_ms": round(window / steps * 1e3, 3),
            "decode_tokens_counted": counted, "overlap": engine.overlap,
            "overlapped_steps": after.ahead_steps - before.ahead_steps}  # fmt: skip


def replayed_variants(graphs: Any) -> collections.Counter[str]:
    """Extend steps replayed so far by an ExtendGraphRunner (or None), by the capture's variant."""
    return collections.Counter(graphs.variant_steps if graphs is not None else {})


async def measure_ttft(
    engine: Engine, p: BenchParams, prompts: Prompts, fraction: float, from_host: bool = False,
    follow_up: int | None = None,
) -> dict:  # fmt: skip
    """Warm the cache with the first ``fraction`` of a prompt (``from_host``: then move it to the
    host tier; ``follow_up``: a prompt of that many tokens, all but FOLLOW_UP_TOKENS of it), time the
    full prompt's first token on an idle engine; token counts come from the engine's counters."""
    ttfts, computed, cached, loaded, whole = [], [], [], [], []  # ms, tokens, tokens, tokens, tokens
    executor: Any = engine.executor  # NOTE: a ModelExecutor: the benchmark runs the model
    graphs = executor.extend_graphs
    graphed, variants = executor.extend_graph_steps, replayed_variants(graphs)
    length = follow_up or p.prompt_tokens
    for _ in range(p.reps):
        await engine.flush_cache()
        prompt = prompts.make(length)
        prefix = len(prompt) - FOLLOW_UP_TOKENS if follow_up else int(len(prompt) * fraction)
        if prefix:
            await run_request(engine, prompt[:prefix], 1)
        if from_host:
            await engine.call(lambda: engine.cache.evict(engine.cache.total_pages))
        _sync(p.device)
        before = engine.snapshot()
        trace = await run_request(engine, prompt, 1)
        ttfts.append((trace.token_times[0] - trace.submitted) * 1e3)
        after = engine.snapshot()
        computed.append(after.prefill_tokens - before.prefill_tokens)
        loaded.append((after.host_loaded_pages - before.host_loaded_pages) * after.page_size)
        cached.append(trace.last.cached_tokens)
        whole.append(prefix // after.page_size * after.page_size)  # the warmed prefix's whole pages
    # NOTE: cached_fraction is the share asked for (the JSON's meaning since the first runs); the
    # share reached is cached_tokens / prompt_tokens, short of warmed_pages_tokens when the hit failed
    row = {"prompt_tokens": length, "cached_fraction": round(prefix / length, 4) if follow_up else fraction,
           "cached_fraction_reached": round(min(cached) / length, 4), "warmed_pages_tokens": min(whole),
           "from": "host" if from_host else "device",
           "cached_tokens": min(cached), "computed_tokens": max(computed), "host_loaded_tokens": min(loaded),
           "ttft_ms_median": round(statistics.median(ttfts), 3), "ttft_ms_min": round(min(ttfts), 3),
           "ttft_ms_max": round(max(ttfts), 3),
           "extend_graph_steps": executor.extend_graph_steps - graphed,
           "graph_variants": dict(replayed_variants(graphs) - variants)}  # fmt: skip
    return {**row, "follow_up": True} if follow_up else row


async def run_engine_benchmarks(engine: Engine, p: BenchParams) -> dict:
    # NOTE: tiny prompts are byte ids only (no special tokens); other models draw from the vocabulary
    prompts = Prompts(256 if p.model == "tiny" else engine.tokenizer.vocab_size, p.seed)
    # warm-up: first calls pay for allocator growth, kernel selection and (CUDA) Triton compilation
    await run_request(engine, prompts.make(p.prompt_tokens), 4)
    warm = [prompts.make(p.decode_prompt_tokens) for _ in range(max(p.batches))]
    await asyncio.gather(*(run_request(engine, x, 4) for x in warm))
    prefill = await measure_prefill(engine, p, prompts)
    decode = [await measure_decode(engine, p, prompts, b) for b in p.batches]
    if engine.overlap:  # the same batch-1 steps one at a time: what overlapping the host work saves
        await engine.call(lambda: setattr(engine, "overlap", False))
        try:
            decode.append(await measure_decode(engine, p, prompts, min(p.batches)))
        finally:
            await engine.call(lambda: setattr(engine, "overlap", True))
    adjusted = await measure_decode(engine, p, prompts, max(p.batches), ADJUSTED)
    sampled = await measure_decode(engine, p, prompts, max(p.batches), SAMPLED)
    ttft = [await measure_ttft(engine, p, prompts, f) for f in CACHED_FRACTIONS]
    if engine.cache.host is not None:  # the same 90% hit, copied back from host memory
        ttft.append(await measure_ttft(engine, p, prompts, CACHED_FRACTIONS[-1], from_host=True))
    graphs = engine.executor.extend_graphs  # type: ignore[attr-defined]
    if graphs is not None:  # the same 90% hit with its prefill launched eagerly: what the graphs save
        await engine.call(lambda: setattr(engine.executor, "extend_graphs", None))
        try:
            ttft.append({**await measure_ttft(engine, p, prompts, CACHED_FRACTIONS[-1]), "eager": True})
        finally:
            await engine.call(lambda: setattr(engine.executor, "extend_graphs", graphs))
    # NOTE: the prompt and its one output token within the model's context
    follow_up = min(p.follow_up_context, engine.max_total_tokens - 1)
    ttft.append(await measure_ttft(engine, p, prompts, 0.0, follow_up=follow_up))
    # the same turn over the default graphs only: what the prefix variants save
    if graphs is not None and any(graphs.configs.values()):
        await engine.call(lambda: setattr(graphs, "prefix_variants", False))
        try:
            ttft.append(
                {**await measure_ttft(engine, p, prompts, 0.0, follow_up=follow_up), "prefix_variants": False}
            )
        finally:
            await engine.call(lambda: setattr(graphs, "prefix_variants", True))
    await engine.flush_cache()
    return {
        "prefill": prefill,
        "decode": decode,
        "decode_adjusted": {
            **adjusted,
            "sampling": {**ADJUSTED, "logit_bias": {str(k): v for k, v in ADJUSTED["logit_bias"].items()}},
        },
        "decode_sampled": {**sampled, "sampling": SAMPLED},
        "ttft": ttft,
    }


# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m worker.bench", description=__doc__)
    ap.add_argument("--model", choices=MODELS, default="tiny",
                    help="tiny, or Llama-3-8B-shaped with random bf16 weights (CUDA only)")  # fmt: skip
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--prompt-tokens", type=int, help="prefill and TTFT prompt length (tokens)")
    ap.add_argument("--follow-up-context", type=int,
                    help=f"the follow-up TTFT row's prompt (tokens): all but its last {FOLLOW_UP_TOKENS} cached, "
                         "as a long conversation's next turn")  # fmt: skip
    ap.add_argument("--batches", help="decode batch sizes, comma-separated")
    ap.add_argument("--decode-steps", type=int, help="tokens generated per decode request")
    ap.add_argument("--decode-prompt-tokens", type=int, help="prompt length of decode requests (tokens)")
    ap.add_argument("--prefill-prompts", type=int, help="uncached prompts in the prefill measurement")
    ap.add_argument("--reps", type=int, help="TTFT requests per cached fraction")
    ap.add_argument("--radix-iters", type=int, help="iterations of each radix microbenchmark")
    ap.add_argument("--cpu-threads", type=int, default=0, help="torch threads on CPU (0 = torch default)")
    ap.add_argument("--kv-cache-tokens", type=int, help="KV pool size (default: the worker's)")
    ap.add_argument("--host-cache-tokens", type=int,
                    help="host-memory KV tier for the TTFT-from-host row (default: 2 x --prompt-tokens; 0 = none)")  # fmt: skip
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--chunked-prefill-tokens", type=int, default=2048, help="prompt tokens per prefill step")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=WorkerConfig.cuda_graph_max_bs,
                    help="CUDA: decode steps of up to N requests replay captured graphs (0 = eager)")  # fmt: skip
    ap.add_argument("--cuda-graph-extend-tokens", type=int, default=WorkerConfig.cuda_graph_extend_tokens,
                    help="CUDA: extend steps of up to N new tokens replay captured graphs (0 = eager)")  # fmt: skip
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="split the tiny model over N ranks (CPU processes, or GPUs cuda:0..N-1)")  # fmt: skip
    ap.add_argument("--overlap-schedule", choices=["auto", "on", "off"], default="auto",
                    help="schedule each decode step while the one before runs (auto: on CUDA); when on, "
                         "the smallest batch is also timed one step at a time")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="the KV pool's dtype, as the worker's flag (fp8: one byte a K/V value)")  # fmt: skip
    ap.add_argument("--fp8-weights", action="store_true",
                    help="the projections in fp8 with 128x128 block scales, as an fp8 checkpoint's served with "
                         "--fp8-weights fp8 (kernels.fp8_linear); random codes")  # fmt: skip
    ap.add_argument("--fp8-activations", action="store_true",
                    help="with --fp8-weights: the projections' inputs quantized to fp8 per token and "
                         "multiplied fp8 by fp8, as --fp8-activations dynamic serves them")  # fmt: skip
    ap.add_argument("--kv-scales", action="store_true",
                    help="with an fp8 --kv-cache-dtype: the pool over KV scales, each layer's and KV head's "
                         "its own, as a release's k_scale / v_scale are served (random values)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test: seconds on CPU)")
    ap.add_argument("--out", help="write the results as JSON here")
    return ap


def resolve_params(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchParams:
    """Explicit flags, else the --quick or normal defaults; the device resolved; bad input exits."""
    import torch

    sizes = {
        k: v[int(args.quick)] if getattr(args, k) is None else getattr(args, k) for k, v in DEFAULTS.items()
    }
    try:
        sizes["batches"] = [int(b) for b in str(sizes["batches"]).split(",")]
    except ValueError:
        parser.error("--batches must be comma-separated integers, e.g. 1,16,64")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.model != "tiny" and device != "cuda":
        parser.error(f"--model {args.model} needs a CUDA GPU (16-61 GB of bf16 weights; one prefill "
                     "would take minutes on CPU); use --model tiny on CPU")  # fmt: skip
    if min(sizes["batches"] + [v for k, v in sizes.items() if k != "batches"]) <= 0:
        parser.error("sizes, counts and batch sizes must be positive")
    if args.cuda_graph_max_bs < 0 or args.cuda_graph_extend_tokens < 0:
        parser.error("--cuda-graph-max-bs and --cuda-graph-extend-tokens must be >= 0")
    if args.tensor_parallel_size < 1 or (args.tensor_parallel_size > 1 and args.model != "tiny"):
        parser.error("--tensor-parallel-size must be >= 1, and above 1 only with --model tiny")
    if sizes["decode_steps"] < 2:
        parser.error("--decode-steps must be at least 2 (the first token comes from prefill)")
    if args.fp8_activations and not args.fp8_weights:
        parser.error("--fp8-activations quantizes the inputs of fp8 projections: add --fp8-weights")
    if args.kv_scales and not args.kv_cache_dtype.startswith("fp8"):
        parser.error("--kv-scales scales an fp8 KV pool: add --kv-cache-dtype fp8_e4m3 (or fp8_e5m2)")
    return BenchParams(model=args.model, device=device, cpu_threads=args.cpu_threads, seed=args.seed,
                       kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size,
                       host_cache_tokens=2 * sizes["prompt_tokens"] if args.host_cache_tokens is None
                       else args.host_cache_tokens,
                       cuda_graph_max_bs=args.cuda_graph_max_bs, cuda_graph_extend_tokens=args.cuda_graph_extend_tokens,
                       chunked_prefill_tokens=args.chunked_prefill_tokens, quick=args.quick,
                       tensor_parallel_size=args.tensor_parallel_size, overlap_schedule=args.overlap_schedule,
                       kv_cache_dtype=args.kv_cache_dtype, fp8_weights=args.fp8_weights,
                       fp8_activations=args.fp8_activations, kv_scales=args.kv_scales, **sizes)  # fmt: skip


def run_benchmark(p: BenchParams, command: str) -> dict:
    """Build the engine from a WorkerConfig, run every measurement, return the JSON document."""
    load_start, t0 = os.getloadavg(), time.perf_counter()
    width = max(p.batches)
    cfg = WorkerConfig(model="tiny", device=p.device, block_size=p.block_size, cpu_threads=p.cpu_threads,
                       kv_cache_tokens=p.kv_cache_tokens, chunked_prefill_tokens=p.chunked_prefill_tokens,
                       host_cache_tokens=p.host_cache_tokens,
                       served_model_name=None if p.model == "tiny" else p.model,
                       cuda_graph_max_bs=p.cuda_graph_max_bs, cuda_graph_extend_tokens=p.cuda_graph_extend_tokens,
                       tensor_parallel_size=p.tensor_parallel_size, overlap_schedule=p.overlap_schedule,
                       kv_cache_dtype=p.kv_cache_dtype, max_running=max(256, width),
                       max_waiting=max(1024, 2 * width))  # fmt: skip
    cfg.validate()
    shape = SHAPES.get(p.model)
    if p.fp8_weights or p.kv_scales:  # NOTE: tiny too (random weights in its shape): a CPU smoke test
        from worker.model.tiny import tiny_config

        shape = shape or tiny_config()
    if p.fp8_weights:
        shape = fp8_projections(shape, p.fp8_activations)
    if p.kv_scales:
        shape = replace(shape, kv_scales=True)
    engine = build_bench_engine(cfg, shape)
    engine.start()
    try:
        results = asyncio.run(run_engine_benchmarks(engine, p))
    finally:
        engine.stop()
    model = engine.executor.model  # type: ignore[attr-defined]
    kv_dtype = engine.executor.kv_pool.dtype  # type: ignore[attr-defined]
    info = {"name": p.model, "dtype": str(model.dtype).removeprefix("torch."),
            "kv_dtype": str(kv_dtype).removeprefix("torch."),
            "parameters": sum(x.numel() for x in model.parameters()), "config": asdict(model.config)}  # fmt: skip
    machine = machine_info(p.device)
    machine["loadavg_start"] = [round(x, 2) for x in load_start]
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    host = engine.cache.host
    if host is not None and p.tensor_parallel_size == 1:  # NOTE: after the engine stopped
        # the hit's size in the TTFT-from-host row
        results["host_copies"] = time_host_copies(host, int(p.prompt_tokens * CACHED_FRACTIONS[-1]))
    runner = engine.executor.decode_graphs  # type: ignore[attr-defined]
    if runner is not None:  # NOTE: after the engine stopped: nothing else runs on the GPU
        results["decode_graph_replay_ms"] = time_graph_replays(runner, p.batches)
    floor = decode_floor(model, results["decode"], measure_copy_gbs(p.device),
                         results.get("decode_graph_replay_ms", {}).get("1"))  # fmt: skip
    radix = bench_radix.run(p.radix_iters, seed=p.seed)
    doc = {"benchmark": "worker", "command": command, "params": asdict(p), "machine": machine, "model": info,
           "kv_capacity_tokens": engine.capacity_tokens, **results, "decode_floor": floor,
           "decode_graph_steps": engine.executor.graph_steps,  # type: ignore[attr-defined]
           "extend_graph_steps": engine.executor.extend_graph_steps,  # type: ignore[attr-defined]
           "radix": radix, "wall_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    if p.device == "cuda":  # the Triton kernels the model ran, with registers and spills as loaded
        from kernels import compile_check

        compile_check.record_loaded_kernels(doc)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    doc = run_benchmark(resolve_params(args, parser), " ".join(["python -m worker.bench", *argv]))
    out = args.out
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "wb") as f:
            f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {out}")
    print(markdown_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
