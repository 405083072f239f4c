"""Putting an Engine together: KV pool sizing, the CPU process settings, and the one place where radix
cache, KV event publisher and scheduler are wired around an executor (the model's, worker/model_executor.py;
the sim cost model; or a benchmark's random-weight model)."""

from __future__ import annotations

import logging
from typing import Any

from router.tokenization import PromptTokenizer
from worker.engine import Engine
from worker.engine_api import Executor
from worker.host_cache import HostKVPool
from worker.kv_pool import KVPool, PageAllocator, kv_cache_dtype
from worker.kv_publisher import KVPublisher
from worker.model_executor import model_executor
from worker.radix_cache import RadixCache
from worker.request import SchedulerConfig

log = logging.getLogger("worker.engine")


def kv_pool_pages(cfg: Any, page_bytes: int, device: Any) -> int:
    """Pages for the KV pool: --kv-cache-tokens, else --mem-fraction of free GPU memory (CUDA),
    else 64k tokens capped at 4 GiB (CPU)."""
    if cfg.kv_cache_tokens:
        return max(1, cfg.kv_cache_tokens // cfg.block_size)
    if device.type == "cuda":
        import torch

        free_bytes, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free_bytes * cfg.mem_fraction) // page_bytes)
    return max(1, min(65536 // cfg.block_size, (4 << 30) // page_bytes))


def tune_cpu_process(threads: int) -> None:
    """Settings for a worker process computing on the CPU: torch's thread count (0 = torch's
    default) and glibc's malloc thresholds.
    NOTE: every step allocates and frees multi-MiB tensors (gathered K/V, activations). glibc serves
    those with mmap and gives them back with munmap, so each step page-faults them in again. Higher
    mmap and trim thresholds keep freed blocks in the heap for reuse (decode at batch 64 +21-25%,
    prefill +10-15% on the tiny model, docs/benchmarks/worker-cpu.md), at the cost of a resident
    size that does not shrink after a peak. Not glibc (musl, macOS): only the threads are set."""
    import ctypes

    import torch

    if threads:
        torch.set_num_threads(threads)  # NOTE: oversubscribed cores make CPU decode 10x slower
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h> parameter numbers
    mallopt(m_mmap_threshold, 256 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def build_engine(cfg: Any) -> Engine:
    """Load the model named by a WorkerConfig and wire pool, cache, publisher and scheduler."""
    import torch

    from worker.model import load_model
    from worker.model.loader import model_dtype

    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: no CUDA device is available to this process (or torch is a CPU build)"
        )
    else:
        device = torch.device(cfg.device)
    if cfg.tensor_parallel_size > 1:
        from worker.tensor_parallel import start_ranks

        loaded, pool, host = start_ranks(cfg, device)
    else:
        if device.type == "cpu":
            tune_cpu_process(cfg.cpu_threads)
        loaded = load_model(
            cfg.model,
            device,
            model_dtype(cfg.dtype, device),
            max_model_len=cfg.max_model_len,
            mxfp4_experts=cfg.mxfp4_experts,
            fp8_weights=cfg.fp8_weights,
            quantization=cfg.quantization,
            fp8_activations=cfg.fp8_activations,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )
        load_adapters(cfg, loaded.model)  # NOTE: before the pool, which takes a share of what is left
        pool = make_kv_pool(cfg, loaded.model, device)
        host = host_tier(cfg, pool)
    mc = loaded.config
    name = cfg.served_model_name or loaded.name
    pool_bytes = pool.num_pages * KVPool.page_bytes(
        cfg.block_size, mc.num_layers, pool.k_cache[0].shape[1], mc.head_dim, pool.dtype
    )
    log.info("model %s on %s: KV pool %d pages x %d tokens, %s (%.1f MiB per rank)", name, device,
             pool.num_pages, cfg.block_size, str(pool.dtype).removeprefix("torch."), pool_bytes / 2**20)  # fmt: skip
    if mc.fp8_weights or mc.fp8_projections:
        served = "kept in fp8" if mc.fp8_weights else "quantized to fp8 at load"
        mode = mc.input_quantization
        inputs = {"dynamic": "per token", "static": "by the checkpoint's input scales"}.get(mode)
        log.info(
            "projections %s%s",
            served if mc.fp8_projections else "of the fp8 checkpoint dequantized at load",
            f", their inputs quantized to fp8 {inputs} (--fp8-activations {mode})" if inputs else "",
        )
    if mc.kv_scales:
        log.info("KV pool holds K and V over the checkpoint's KV scales (self_attn.k_scale / v_scale)")
    executor = model_executor(cfg, loaded.model, pool, device, mc.max_context)
    return assemble_engine(cfg, executor, pool.allocator, loaded.tokenizer, mc.max_context, name, host=host)


def make_kv_pool(cfg: Any, model: Any, device: Any, agree: Any = None) -> KVPool:
    """The KV pool for ``model``'s KV heads (this rank's, when tensor parallel); ``agree`` maps the
    pages this process can hold to the pages every rank uses."""
    import torch

    mc = model.config
    kv_heads = mc.num_kv_heads // model.shard.size
    dtype = kv_cache_dtype(cfg.kv_cache_dtype, model.dtype, device)
    page_bytes = KVPool.page_bytes(cfg.block_size, mc.num_layers, kv_heads, mc.head_dim, dtype)
    pages = kv_pool_pages(cfg, page_bytes, device)
    if agree is not None:
        pages = agree(pages)
    try:
        return KVPool(pages, cfg.block_size, mc.num_layers, kv_heads, mc.head_dim, dtype, device)
    except (MemoryError, RuntimeError) as exc:  # NOTE: torch's out-of-memory errors are RuntimeErrors
        if not isinstance(exc, MemoryError | torch.OutOfMemoryError) and "allocat" not in str(exc):
            raise
        size = pages * page_bytes / 2**30
        raise ValueError(f"the KV pool ({pages} pages, {size:.1f} GiB) cannot be allocated on {device}: "
                         "lower --kv-cache-tokens (or --mem-fraction)") from None  # fmt: skip


def load_adapters(cfg: Any, model: Any) -> None:
    """Room for --max-loras adapters, then ``--lora-adapter NAME=PATH`` each onto the model
    (``model.lora``, ids 1, 2, ...)."""
    from worker.model.lora import check_room, load_adapter

    stack = model.lora_stack
    if cfg.max_loras:
        stack.reserve(cfg.max_loras, cfg.max_lora_rank)
    if cfg.lora_adapters:
        check_room(model, len(cfg.lora_adapters))
    for spec in cfg.lora_adapters:
        name, _, path = spec.partition("=")
        model.add_lora(load_adapter(name, path, model))
        log.info("LoRA adapter %s from %s (rank %d)", name, path, model.lora[-1].rank)
    if stack.slots:
        log.info("LoRA weights: room for %d adapters, %.1f MiB", stack.slots, stack.nbytes() / 2**20)


def host_tier(cfg: Any, pool: KVPool | None) -> HostKVPool | None:
    """The host-memory KV tier ``--host-cache-tokens`` asks for (bookkeeping only without a pool)."""
    pages = cfg.host_cache_tokens // cfg.block_size
    if pages <= 0:
        return None
    host = HostKVPool(pages, pool)
    if pool is not None:
        log.info("host KV tier: %d pages x %d tokens (%.1f MiB)", pages, cfg.block_size,
                 pages * HostKVPool.page_bytes(pool) / 2**20)  # fmt: skip
    return host


def assemble_engine(
    cfg: Any, executor: Executor, allocator: PageAllocator, tokenizer: PromptTokenizer, max_context: int,
    name: str, simulated: bool = False, host: HostKVPool | None = None,
) -> Engine:  # fmt: skip
    """Wire cache, KV publisher and scheduler around any executor (the model, the sim cost model,
    or a benchmark's random-weight model): the one place an Engine is put together."""
    from worker.kv_publisher import stream_name

    adapters = [a.partition("=")[0] for a in getattr(cfg, "lora_adapters", [])]
    cache = RadixCache(
        allocator, cfg.block_size, namespace=name, enable_events=True, host=host, adapters=adapters
    )
    publisher = KVPublisher(
        worker=cfg.resolved_advertise_url(),
        block_size=cfg.block_size,
        redis_url=cfg.redis_url,
        stream=stream_name(name),
        stream_maxlen=cfg.stream_maxlen,
    )
    sched = SchedulerConfig(
        page_size=cfg.block_size,
        max_running=cfg.max_running,
        chunked_prefill_tokens=cfg.chunked_prefill_tokens,
        policy=cfg.schedule_policy,
        max_wait_s=cfg.max_wait_s,
        max_waiting=cfg.max_waiting,
        decode_reserve_tokens=cfg.decode_reserve_tokens,
        speculative_tokens=cfg.speculative_tokens,
        speculative_max_ngram=cfg.speculative_ngram_max,
        speculative_min_ngram=cfg.speculative_ngram_min,
        speculative_max_batch=cfg.speculative_max_batch,
    )
    # NOTE: the cost model compiles nothing, so a simulated worker serves at once
    warmup = 0 if simulated else cfg.warmup_tokens
    overlap = getattr(cfg, "overlap_schedule", "auto")
    if overlap == "auto":  # NOTE: only an asynchronous device gains: on the CPU a step runs at launch
        overlap = "on" if str(getattr(executor, "device", "")).startswith("cuda") else "off"
    return Engine(
        executor,
        allocator,
        cache,
        sched,
        tokenizer,
        max_context,
        publisher,
        name,
        simulated,
        warmup,
        adapters,
        cfg.stall_timeout_s,
        overlap == "on",
    )
