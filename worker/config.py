"""Worker settings: one dataclass, filled from flags, with env defaults (RADIXGATE_WORKER_<FLAG>).

Defaults work on a laptop (CPU, the tiny model). Malformed values are errors at start-up."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.api_keys import header_token_ok
from worker.reasoning import PARSERS as REASONING_PARSERS

MXFP4_CHOICES = (
    "auto",
    "packed",
    "dequantized",
)  # --mxfp4-experts: how a checkpoint's MXFP4 experts are served
FP8_WEIGHT_CHOICES = ("auto", "fp8", "dequantized")  # --fp8-weights: an fp8 checkpoint's projections
QUANTIZATION_CHOICES = ("none", "fp8")  # --quantization: a 16-bit checkpoint's projections quantized at load
FP8_ACTIVATION_CHOICES = (
    "none",
    "dynamic",
    "static",
)  # --fp8-activations: fp8 projections' inputs kept or quantized
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "granite")  # worker.tool_calls reads each

# The worker extra's modules a worker cannot start without; the router's own install lacks them
WORKER_MODULES = ("numpy", "torch", "safetensors", "llguidance")
INSTALL_HINT = 'pip install "radixgate[worker]"'
ENV_PREFIX = "RADIXGATE_WORKER_"
KV_HINTS = ("keyed", "any", "off")  # --kv-hints: who may name a KV source (x-radixgate-kv-source)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's names
DTYPES = ("bfloat16", "float16", "float32")  # --dtype besides "auto"
# --kv-cache-dtype (worker.kv_pool.kv_cache_dtype); "fp8" is fp8_e4m3, as vLLM reads it
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def missing_modules() -> list[str]:
    """The worker's dependencies this Python cannot import (looked up, not imported)."""
    return [name for name in WORKER_MODULES if importlib.util.find_spec(name) is None]


@dataclass
class WorkerConfig:
    model: str = "tiny"  # "tiny" or a local HF model directory
    engine: str = "model"  # "model" (real forward) or "sim" (cost-model forward, see sim_engine.py)
    host: str = "127.0.0.1"
    port: int = 8100
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = (
        "auto"  # weights, activations and KV: auto (bfloat16 on CUDA, float32 on CPU) or one of DTYPES
    )
    block_size: int = 16  # tokens per KV page = block size of the KV events
    kv_cache_tokens: int | None = None  # KV pool size (tokens); default: --mem-fraction on CUDA
    # tokens a request may hold (prompt + output); default: the model's context
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"  # the KV pool's dtype: auto (--dtype's) or fp8 (half the bytes a token)
    mxfp4_experts: str = "auto"  # MXFP4 experts (gpt-oss) kept packed or dequantized (worker.model.loader)
    fp8_weights: str = "auto"  # an fp8 checkpoint's projections kept in fp8 or dequantized (model.loader)
    quantization: str = "none"  # fp8: a 16-bit checkpoint's projections quantized to fp8 at load
    fp8_activations: str = "none"  # dynamic / static: the fp8 projections' inputs quantized (W8A8)
    host_cache_tokens: int = 0  # host-memory KV tier (tokens) that evicted pages move to; 0 = none
    mem_fraction: float = (
        0.85  # of free GPU memory after loading the model (and its adapters), for the KV pool
    )
    max_running: int = 256  # requests admitted at once
    cuda_graph_max_bs: int = 128  # decode steps of up to this many requests replay CUDA graphs; 0 = off
    cuda_graph_extend_tokens: int = (
        256  # extend/verify steps of up to this many new tokens replay graphs; 0 = off
    )
    # extend graphs also captured in the attention configurations that win over long cached prefixes,
    # replayed by each step's longest prefix: auto (on CUDA from sm_90, where measured) | on | off
    cuda_graph_extend_variants: str = "auto"
    # schedule the next decode step while the current one runs: auto (on CUDA) | on | off
    overlap_schedule: str = "auto"
    chunked_prefill_tokens: int = 2048  # prompt tokens per prefill step
    schedule_policy: str = "lpm"  # lpm | fcfs
    max_wait_s: float = 5.0  # LPM age bound: a request queued longer goes first
    decode_reserve_tokens: int = 256  # decode tokens per request kept free when admitting
    max_waiting: int = 1024  # queued requests before HTTP 429
    redis_url: str | None = None  # KV events to the Redis Stream radixgate:kv:<served name>
    stream_maxlen: int = 10_000  # entries kept in that stream (approximate trim)
    advertise_url: str | None = None  # how routers reach this worker; default http://host:port
    served_model_name: str | None = None  # default: the model's name ("tiny" or the directory name)
    admin_token: str | None = None  # required by the cache flush and the LoRA load / unload when set
    api_key: str | None = None  # required (Authorization: Bearer) on every endpoint but /health, /metrics
    # KV moved between workers (worker/kv_transfer.py): host memory for transfers under way (MiB),
    # 0 = off (the router's x-radixgate-kv-source hint ignored, /v1/kv/export refused)
    kv_transfer_max_mib: int = 1024
    kv_fetch_timeout_s: float = 5.0  # a request's KV fetches from the source worker, all its prompts
    kv_transfer_max_wait_ms: float = 200.0  # a transfer queued behind more than this is refused (0: never)
    # who may name a KV source (x-radixgate-kv-source): keyed (only on a worker with --api-key), any, off
    kv_hints: str = "keyed"
    max_stored_responses: int = 1024  # /v1/responses kept for previous_response_id (LRU); 0 = none
    max_stored_responses_mib: int = 1024  # ... and their size in all (their JSON), MiB
    tool_call_parser: str = "hermes"  # how tool_choice=auto calls are read from text: TOOL_CALL_PARSERS
    reasoning_parser: str = "none"  # chat answers' thinking apart (worker.reasoning.PARSERS)
    log_level: str = "info"
    cpu_threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default (all cores)
    warmup_tokens: int = 128  # prompt tokens of a throw-away request run before serving; 0 = none
    stall_timeout_s: float = 120.0  # one engine step (or call) running longer: /health answers 503
    # on SIGTERM, how long requests in flight may run on; those still running then end with a 503 (an
    # error event in a stream) rather than a cut connection
    shutdown_timeout_s: float = 5.0
    lora_adapters: list[str] = field(default_factory=list)  # "NAME=PATH" of PEFT LoRA directories
    # LoRA weight room made at start-up, so adapters loaded at runtime keep the CUDA graphs: adapters, rank
    max_loras: int = 0
    max_lora_rank: int = 16
    tensor_parallel_size: int = 1  # ranks (GPUs) one model is split over (worker/tensor_parallel.py)
    # speculative decoding by prompt lookup (worker/speculative.py): draft tokens per step; 0 = off
    speculative_tokens: int = 0
    speculative_ngram_max: int = 4  # longest suffix looked up in the request's own tokens
    speculative_ngram_min: int = 2  # shortest
    speculative_max_batch: int = 32  # decode steps with more running requests do not speculate
    # --engine sim only (see worker/sim_engine.py for the defaults' sources)
    sim_prefill_ms_per_token: float = 0.07
    sim_decode_base_ms: float = 7.0
    sim_decode_ms_per_seq: float = 0.06
    sim_context_tokens: int = 8192
    sim_host_copy_ms_per_token: float = 0.003
    sim_kv_fetch_ms_per_token: float = 0.12

    def validate(self) -> None:
        for name in ("api_key", "admin_token"):  # NOTE: "" (an empty Secret) would turn the guard off
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"--{name.replace('_', '-')} (or {ENV_PREFIX}{name.upper()}) is empty: "
                                 "give it a value or leave it unset")  # fmt: skip
            if value is not None and not header_token_ok(value.strip()):
                raise ValueError(f"--{name.replace('_', '-')} must be printable ASCII without spaces "
                                 "(a header carries it)")  # fmt: skip
        if self.engine not in ("model", "sim"):
            raise ValueError("--engine must be model or sim")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError("--device must be auto, cuda or cpu")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError("--schedule-policy must be lpm or fcfs")
        if self.kv_hints not in KV_HINTS:  # NOTE: argparse checks flags, not env
            raise ValueError(f"--kv-hints must be one of {', '.join(KV_HINTS)}, not {self.kv_hints!r}")
        if self.overlap_schedule not in ("auto", "on", "off"):  # NOTE: argparse checks flags, not env
            raise ValueError(f"--overlap-schedule must be auto, on or off, not {self.overlap_schedule!r}")
        if self.stream_maxlen < 1:
            raise ValueError("--stream-maxlen must be positive")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1..65535, not {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        if self.redis_url:
            from router.resp import redis_url_error  # NOTE: here, not at import: only with --redis-url

            if error := redis_url_error(self.redis_url):  # the reading the KV publisher's client makes of it
                raise ValueError(f"--redis-url {error}")
        if not self.host.strip():  # NOTE: uvicorn would listen on every interface, IPv4 and IPv6
            raise ValueError(
                "--host must not be empty (0.0.0.0 listens on every interface, 127.0.0.1 here only)"
            )
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_running", "chunked_prefill_tokens", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.mxfp4_experts not in MXFP4_CHOICES:
            raise ValueError(f"--mxfp4-experts must be one of {', '.join(MXFP4_CHOICES)}")
        if self.fp8_weights not in FP8_WEIGHT_CHOICES:
            raise ValueError(f"--fp8-weights must be one of {', '.join(FP8_WEIGHT_CHOICES)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.fp8_activations not in FP8_ACTIVATION_CHOICES:
            raise ValueError(f"--fp8-activations must be one of {', '.join(FP8_ACTIVATION_CHOICES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2 (one prompt and one output token)")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError("--kv-cache-tokens must hold at least one block")
        if self.max_stored_responses < 0:
            raise ValueError("--max-stored-responses must be >= 0")
        if self.max_stored_responses_mib < 1:
            raise ValueError("--max-stored-responses-mib must be >= 1")
        if self.host_cache_tokens < 0:
            raise ValueError("--host-cache-tokens must be >= 0")
        if 0 < self.host_cache_tokens < self.block_size:  # NOTE: no whole page: a tier that holds nothing
            raise ValueError("--host-cache-tokens must hold at least one block (or be 0: no host tier)")
        sim_costs = ("sim_prefill_ms_per_token", "sim_decode_base_ms", "sim_decode_ms_per_seq",
                     "sim_host_copy_ms_per_token", "sim_kv_fetch_ms_per_token")  # fmt: skip
        for name in sim_costs:
            if not getattr(self, name) >= 0:  # NOTE: NaN fails too
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.sim_context_tokens < 2:
            raise ValueError("--sim-context-tokens must be at least 2 (one prompt and one output token)")
        if (
            self.kv_transfer_max_mib < 0
            or not self.kv_fetch_timeout_s > 0
            or not self.kv_transfer_max_wait_ms >= 0
        ):
            raise ValueError(
                "--kv-transfer-max-mib and --kv-transfer-max-wait-ms must be >= 0 and --kv-fetch-timeout-s > 0"
            )
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError("--mem-fraction must be in (0, 1]")
        if self.cuda_graph_max_bs < 0 or self.cuda_graph_extend_tokens < 0:
            raise ValueError("--cuda-graph-max-bs and --cuda-graph-extend-tokens must be >= 0")
        if self.cuda_graph_extend_variants not in ("auto", "on", "off"):
            raise ValueError("--cuda-graph-extend-variants must be auto, on or off")
        if self.cpu_threads < 0:
            raise ValueError("--cpu-threads must be >= 0")
        if self.warmup_tokens < 0:
            raise ValueError("--warmup-tokens must be >= 0")
        if not self.stall_timeout_s > 0:
            raise ValueError("--stall-timeout-s must be > 0")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError("--shutdown-timeout-s must be >= 0")
        if not self.max_wait_s >= 0 or self.decode_reserve_tokens < 0:  # NOTE: NaN fails too
            raise ValueError("--max-wait-s and --decode-reserve-tokens must be >= 0")
        if self.speculative_tokens < 0:
            raise ValueError("--speculative-tokens must be >= 0")
        if self.speculative_tokens and self.engine == "sim":
            raise ValueError(
                "--speculative-tokens needs --engine model (the sim has no logits to check drafts)"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("--speculative-ngram-min and -max need 1 <= min <= max")
        if self.speculative_max_batch < 1:
            raise ValueError("--speculative-max-batch must be positive")
        names = [a.partition("=")[0] for a in self.lora_adapters]
        if any(
            "=" not in a or not n or not a.partition("=")[2]
            for a, n in zip(self.lora_adapters, names, strict=True)
        ):
            raise ValueError("--lora-adapter takes NAME=PATH")
        served = self.served_model_name or os.path.basename(
            os.path.normpath(self.model)
        )  # as the loader names it
        if len(set(names)) != len(names) or served in names:
            raise ValueError("--lora-adapter names must differ from each other and from the model's")
        if (self.lora_adapters or self.max_loras) and self.engine == "sim":
            raise ValueError("--lora-adapter and --max-loras need --engine model")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("--max-loras must be >= 0 and --max-lora-rank >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        if self.tensor_parallel_size > 1 and self.engine == "sim":
            raise ValueError("--tensor-parallel-size needs --engine model")

    def resolved_advertise_url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        if ":" in host:  # an IPv6 literal: bracketed in a URL
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


def unknown_env(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``RADIXGATE_WORKER_`` names in ``environ`` that no flag has, each with the likeliest one meant (a
    misspelt RADIXGATE_WORKER_API_KEY would leave the key guard off without a trace)."""
    known = sorted(a.dest.upper() for a in build_parser()._actions if a.dest != "help")
    out = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX) :] not in known:
            near = difflib.get_close_matches(name[len(ENV_PREFIX) :], known, 1)  # NOTE: not the shared prefix
            out.append((name, ENV_PREFIX + near[0] if near else None))
    return out


def _env(name: str, default: Any) -> Any:
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def build_parser() -> argparse.ArgumentParser:
    d = WorkerConfig()
    p = argparse.ArgumentParser(prog="python -m worker", description="radixgate inference worker")

    def opt(flag: str, kind: Any, help_text: str, **kw: Any) -> None:
        name = flag.lstrip("-").replace("-", "_")
        p.add_argument(flag, type=kind, default=_env(name, getattr(d, name)), help=help_text, **kw)

    opt("--model", str, "'tiny' or a local HF model directory")
    opt("--engine", str, "model (real forward) or sim (cost model)", choices=["model", "sim"])
    opt("--host", str, "bind address")
    opt("--port", int, "bind port")
    opt("--device", str, "auto | cuda | cpu", choices=["auto", "cuda", "cpu"])
    opt(
        "--dtype",
        str,
        "weights, activations and KV: auto (bfloat16 on CUDA, float32 on CPU)",
        choices=["auto", *DTYPES],
    )
    opt("--block-size", int, "tokens per KV page (the advertised block size)")
    opt(
        "--kv-cache-tokens",
        int,
        "KV pool size in tokens (default: --mem-fraction on CUDA, 64k capped at 4 GiB on CPU, 400k with --engine sim)",
    )
    opt(
        "--max-model-len",
        int,
        "the context served, prompt and output tokens together (default: the model's own; a smaller one "
        "also shrinks its RoPE tables)",
    )
    opt(
        "--kv-cache-dtype",
        str,
        "the KV pool's dtype: auto (--dtype's) or fp8_e4m3 (also fp8) / fp8_e5m2 (one byte a value: twice "
        "the tokens cached in the same memory, each K/V value rounded to 3 / 2 mantissa bits, saturated at "
        "448 / 57344; fp8_e4m3 needs sm_89+ on CUDA)",
        choices=list(KV_CACHE_DTYPES),
    )
    opt(
        "--mxfp4-experts",
        str,
        "a checkpoint's MXFP4 experts (gpt-oss): packed (a quarter of bf16's bytes, decoded in the expert "
        "GEMMs), dequantized (to --dtype at load) or auto (packed on CUDA, dequantized on the CPU)",
        choices=list(MXFP4_CHOICES),
    )
    opt(
        "--fp8-weights",
        str,
        "an fp8 checkpoint's attention, dense MLP and expert projections: fp8 (kept in fp8 with their scales, "
        "half of bf16's bytes, widened tile by tile in kernels.fp8_linear and kernels.moe), dequantized (to "
        "--dtype at load) or auto (fp8 on CUDA from sm_89 where the checkpoint and the ranks allow, "
        "dequantized otherwise)",
        choices=list(FP8_WEIGHT_CHOICES),
    )
    opt(
        "--quantization",
        str,
        "fp8: a 16-bit checkpoint's attention, dense MLP and expert projections quantized to fp8 (e4m3) at "
        "load, one scale a row, and served as --fp8-weights fp8 serves an fp8 checkpoint (half of bf16's "
        "bytes; CUDA from sm_89, or the CPU's reference path); none: as stored",
        choices=list(QUANTIZATION_CHOICES),
    )
    opt(
        "--fp8-activations",
        str,
        "dynamic: the input of every projection served in fp8 (--fp8-weights fp8, --quantization fp8) "
        "quantized to fp8 (e4m3) per token at each call, one scale a run of the weight blocks' columns "
        "(128 in Qwen3's and DeepSeek's releases) or a row, and multiplied fp8 by fp8 (W8A8: Hopper's fp8 "
        "tensor cores; what an fp8 checkpoint's activation_scheme dynamic intends; the experts' GEMMs "
        "likewise); static: quantized by the checkpoint's calibrated input scales instead (activation_scheme "
        "static: one a projection, the largest of q/k/v's and of gate/up's, of a layer's experts'); none: "
        "16-bit inputs, the weights widened exactly",
        choices=list(FP8_ACTIVATION_CHOICES),
    )
    opt(
        "--host-cache-tokens",
        int,
        "host-memory KV tier in tokens: evicted KV pages move there and come back on a hit "
        "(a copy instead of a prefill); 0 = none",
    )
    opt(
        "--kv-transfer-max-mib",
        int,
        "KV moved between workers: the most this worker holds in host memory for transfers under way, "
        "fetches (before a request a router hinted with x-radixgate-kv-source) and exports together, "
        "in MiB; each streams, holding two groups of layers (a group at most 1/16 of this, or one "
        "layer's K or V when larger), so one transfer carries at most this / 2 per layer's K or V "
        "(0 = off)",
    )
    opt(
        "--kv-transfer-max-wait-ms",
        float,
        "a KV transfer that would wait longer than this behind those under way (their bytes left at "
        "the rate transfers have come) is refused: the source answers busy, a receiver does not ask "
        "(0 = never)",
    )
    opt(
        "--kv-hints",
        str,
        "who may name a worker to fetch a prompt's KV from (the routers' x-radixgate-kv-source): keyed "
        "(only on a worker with --api-key, whose every request carries the fleet's key), any (any client: "
        "for a network where only routers reach the workers), off (none). A client that names a source "
        "of its own could fill this worker's cache with KV that is not its prompt's",
        choices=list(KV_HINTS),
    )
    opt(
        "--kv-fetch-timeout-s",
        float,
        "longest a request's KV fetches from another worker may take, all its prompts together (seconds); "
        "a fetch asks for no more than its link has brought in half the time left",
    )
    opt(
        "--mem-fraction",
        float,
        "fraction of the GPU memory free after the model and its LoRA adapters are loaded, for the KV pool",
    )
    opt("--max-running", int, "requests admitted at once")
    opt("--cuda-graph-max-bs", int, "CUDA: decode steps of up to N requests replay captured graphs (0 = off)")
    opt(
        "--cuda-graph-extend-tokens",
        int,
        "CUDA: prefill and verify steps of up to N new tokens (cache hits' short prefills, speculative "
        "decoding) replay captured graphs (0 = off)",
    )
    opt(
        "--cuda-graph-extend-variants",
        str,
        "CUDA: capture each extend graph also in the attention configurations that win over long cached "
        "prefixes (larger tiles; the prefix split, more programs) and replay the one for each step's "
        "longest prefix (up to three times the extend graphs): auto (from sm_90), on, off",
        choices=["auto", "on", "off"],
    )
    opt(
        "--overlap-schedule",
        str,
        "queue the next decode step on the device before the current one's tokens are back, so "
        "scheduling, output delivery and input copies overlap the forward: auto (on CUDA), on, off",
        choices=["auto", "on", "off"],
    )
    opt("--chunked-prefill-tokens", int, "prompt tokens per prefill step")
    opt("--schedule-policy", str, "lpm (longest cached prefix first) or fcfs", choices=["lpm", "fcfs"])
    opt("--max-wait-s", float, "LPM age bound in seconds")
    opt("--decode-reserve-tokens", int, "decode tokens per request kept free when admitting")
    opt("--max-waiting", int, "queued requests before 429")
    opt("--redis-url", str, "publish KV events to this Redis (redis://host:port/0)")
    opt("--stream-maxlen", int, "entries kept in the Redis Stream")
    opt("--advertise-url", str, "URL routers use for this worker (default http://host:port)")
    opt("--served-model-name", str, "model id in the API (default: the model's name)")
    opt(
        "--admin-token",
        str,
        "token required by POST /v1/cache/flush, /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    opt(
        "--api-key",
        str,
        "key every endpoint but /health and /metrics requires as 'Authorization: Bearer KEY' (routers "
        "send it with --worker-api-key; prefer env RADIXGATE_WORKER_API_KEY, which process listings do not show)",
    )
    opt(
        "--max-stored-responses",
        int,
        "responses kept for previous_response_id, least recently used dropped (0 = none)",
    )
    opt(
        "--max-stored-responses-mib",
        int,
        "the stored responses' size in all (their conversations' JSON), least recently used dropped past it",
    )
    opt(
        "--tool-call-parser",
        str,
        "format of tool calls in text (tool_choice auto): hermes (<tool_call>{...}</tool_call>, the "
        "built-in template's), llama3_json, mistral ([TOOL_CALLS]...) or granite (<|tool_call|>[...])",
        choices=list(TOOL_CALL_PARSERS),
    )
    opt(
        "--reasoning-parser",
        str,
        "chat answers' thinking (<think>...</think>, Qwen3 and DeepSeek-R1) returned apart from the "
        "content, as reasoning and reasoning_content: none, qwen3 or deepseek_r1 (the same tags), or gpt_oss "
        "(harmony's analysis channel)",
        choices=list(REASONING_PARSERS),
    )
    opt("--log-level", str, " | ".join(LOG_LEVELS))
    opt("--cpu-threads", int, "torch threads on CPU (0 = all cores; give each of N local workers cores/N)")
    opt(
        "--warmup-tokens",
        int,
        "prompt tokens of a throw-away request run before /health reports ready "
        "(compiles kernels before the first client's request; 0 = none)",
    )
    opt(
        "--stall-timeout-s",
        float,
        "an engine step (or a call on the engine thread) running longer than this is a stall: /health "
        "answers 503 'stalled' until it ends, so routers send work elsewhere (a hung tensor-parallel rank)",
    )
    opt(
        "--shutdown-timeout-s",
        float,
        "on SIGTERM, seconds the requests in flight may run on (new ones go elsewhere: /health answers "
        "503); those still running then end with a 503, in a stream an error event, which a router "
        "retries elsewhere where nothing was sent yet. Keep it under the pod's grace period",
    )
    opt(
        "--speculative-tokens",
        int,
        "speculative decoding by prompt lookup: up to N draft tokens per request per decode step, taken "
        "from where the request's last tokens occurred earlier in its prompt or output (0 = off)",
    )
    opt("--speculative-ngram-max", int, "longest suffix of a request's tokens looked up for drafts")
    opt("--speculative-ngram-min", int, "shortest suffix looked up for drafts")
    opt("--speculative-max-batch", int, "decode steps with more running requests than this do not speculate")
    opt(
        "--tensor-parallel-size",
        int,
        "split the model over N ranks: GPUs cuda:0..N-1 (one process each, NCCL), or N CPU processes (gloo)",
    )
    p.add_argument(
        "--lora-adapter",
        dest="lora_adapters",
        action="append",
        default=None,  # NOTE: not the env's list: append would add the flags to it (flags replace env)
        metavar="NAME=PATH",
        help="serve a PEFT LoRA adapter directory as model NAME beside the base (repeat for more; env "
        "RADIXGATE_WORKER_LORA_ADAPTERS=NAME=PATH,...)",
    )
    opt(
        "--max-loras",
        int,
        "LoRA adapters whose weights get room at start-up (0: only those of --lora-adapter): "
        "adapters loaded at runtime within it keep steps on CUDA graphs",
    )
    opt("--max-lora-rank", int, "the largest adapter rank that room holds")
    opt("--sim-prefill-ms-per-token", float, "sim: prefill cost per uncached token (ms)")
    opt("--sim-decode-base-ms", float, "sim: decode step cost at batch size 1 (ms)")
    opt("--sim-decode-ms-per-seq", float, "sim: extra decode step cost per running request (ms)")
    opt("--sim-context-tokens", int, "sim: context length of the simulated model (tokens)")
    opt(
        "--sim-host-copy-ms-per-token",
        float,
        "sim: cost of a token's KV copied to or from the host tier, or for a transfer to or from another "
        "worker (ms)",
    )
    opt(
        "--sim-kv-fetch-ms-per-token",
        float,
        "sim: a KV export to another worker takes this long per token it sends, for the link (ms)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Flags (and env defaults) -> a validated WorkerConfig; exits with usage on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.lora_adapters is None:
        args.lora_adapters = [a for a in _env("lora_adapters", "").split(",") if a]
    cfg = WorkerConfig(**vars(args))
    cfg.log_level = cfg.log_level.lower()  # NOTE: uvicorn knows only the lower-case names
    for name in ("api_key", "admin_token"):  # NOTE: a Secret file's newline: no header can carry it
        if getattr(cfg, name) is not None:
            setattr(cfg, name, getattr(cfg, name).strip())
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg
