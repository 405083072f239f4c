"""``--engine sim``: the real server, scheduler, radix cache and KV events, with the model forward
replaced by a cost model that sleeps. For routing and load tests without a GPU; its tokens are
deterministic pseudo-random bytes, never model output, and every response says ``"simulated": true``.

Cost model (ms): an extend step costs ``prefill_ms_per_token`` x uncached new tokens; a decode step
costs ``decode_base_ms + decode_ms_per_seq`` x batch size. The defaults are ESTIMATES for
Llama-3-8B in bf16 on one H100 SXM, not measurements: prefill 0.07 ms/token (~14k tokens/s, within
the 10-20k tokens/s range commonly reported for vLLM/SGLang at this size; 16 GFLOP/token at ~25%
of the 989 TFLOP/s bf16 peak); decode 7 ms at batch 1 (16 GB of weights read at ~70% of 3.35 TB/s)
plus 0.06 ms per running sequence (KV reads and per-sequence compute at moderate context). The KV
pool defaults to 400k tokens: (80 GB x 0.85 - 16 GB weights) / 128 KiB per token. With a host tier
(``--host-cache-tokens``) every page copied to or from it adds ``host_copy_ms_per_token`` x its
tokens to the step being scheduled: 0.003 ms, 128 KiB per token over ~45 GB/s of pinned-memory copies
(an estimate for PCIe 5).

KV moved between workers (worker/kv_transfer.py) works as on a real worker, over a placeholder pool
of 4 bytes a token (one layer, one head, one float16 dim: what moves is the exchange, not KV); each
token exported or imported costs ``host_copy_ms_per_token`` on that engine's next step (the
device-host copy), and the source takes ``--sim-kv-fetch-ms-per-token`` per token it exports for the
link (0.12 ms: Llama-3-8B's 128 KiB at ~1.1 GB/s, an estimate for the HTTP path).
One H200 measured 0.027 ms/token prefill, 5.2 ms decode at batch 1, 0.027 ms/token host copies and
0.18-0.24 ms/token KV fetches for this shape (docs/benchmarks/gpu-nvidia-h200.md); the defaults stay
the estimates the committed simulations used.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import mmh3
import numpy as np

from router.tokenization import ByteTokenizer
from worker.assembly import assemble_engine, host_tier
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.engine_api import LaunchedStep, chainable_step
from worker.guided import advance, allowed_mask, matcher_of
from worker.kv_pages import read_kv, write_kv
from worker.kv_pool import KVPool, PageAllocator
from worker.request import ScheduledBatch

DEFAULT_SIM_KV_TOKENS = 400_000  # estimate for Llama-3-8B on an 80 GB H100, see the docstring
_PRINTABLE = np.arange(32, 127)  # byte tokens the simulated model emits (printable ASCII)
_BYTE_VOCAB = ByteTokenizer().vocab_size  # its vocabulary (bytes + specials), for grammar masks


class SimExecutor:
    """Sleeps for the modelled step time; the next token is a hash of the request's recent context."""

    tensor_parallel_size = 1

    def __init__(
        self, prefill_ms_per_token: float, decode_base_ms: float, decode_ms_per_seq: float,
        host_copy_ms_per_token: float = 0.0, num_pages: int = 0, page_size: int = 16,
    ) -> None:  # fmt: skip
        self.num_pages, self.page_size = num_pages, page_size
        self.transferred = 0  # tokens of KV exported or imported (a device-host copy each)
        self.prefill_ms_per_token = prefill_ms_per_token
        self.decode_base_ms = decode_base_ms
        self.decode_ms_per_seq = decode_ms_per_seq
        self.host_copy_ms_per_token = host_copy_ms_per_token
        self.simulated_s = 0.0  # total modelled time, for reports
        self.copied_tokens: Callable[[], int] = lambda: (
            0
        )  # host-tier tokens copied so far (the cache's count)
        self._copied = 0
        self._busy_until = 0.0  # monotonic s when the last launched step is done

    @functools.cached_property
    def kv_pool(self) -> KVPool:
        """The placeholder KV a transfer moves: 4 bytes a token (made on first use)."""
        import torch

        return KVPool(self.num_pages, self.page_size, 1, 1, 1, torch.float16, "cpu")

    def read_kv(self, slots: Any, lo: int = 0, hi: int | None = None) -> Any:
        kv = read_kv(self.kv_pool, slots, lo, hi)
        self.transferred += slots.numel() * kv.shape[0] / (2 * self.kv_pool.num_layers)  # NOTE: slabs a token
        return kv

    def write_kv(self, slots: Any, slabs: Any, lo: int = 0) -> None:
        self.transferred += slabs.shape[1] * slabs.shape[0] / (2 * self.kv_pool.num_layers)
        write_kv(self.kv_pool, slots, slabs, lo)

    def step_ms(self, batch: ScheduledBatch) -> float:
        # NOTE: host-tier copies happen while a step is scheduled, so they delay that step
        copied = self.copied_tokens() + self.transferred
        copy_ms, self._copied = self.host_copy_ms_per_token * (copied - self._copied), copied
        if batch.mode == "extend":
            return self.prefill_ms_per_token * batch.num_new_tokens + copy_ms
        return self.decode_base_ms + self.decode_ms_per_seq * len(batch.requests) + copy_ms

    def _queue(self, batch: ScheduledBatch) -> float:
        """Put ``batch`` on the modelled device, behind the step before: when it will be done."""
        cost_s = self.step_ms(batch) / 1000.0
        self.simulated_s += cost_s
        self._busy_until = max(time.monotonic(), self._busy_until) + cost_s
        return self._busy_until

    def run(self, batch: ScheduledBatch) -> list[int]:
        return self.collect(LaunchedStep(pending=(batch, self._queue(batch))))

    def launch(self, batch: ScheduledBatch, after: LaunchedStep | None = None) -> LaunchedStep:
        """A modelled device: a chainable step is queued behind the one before (its time starts
        when that one's ends) and ``collect`` sleeps until it is done; other steps run now."""
        if not chainable_step(batch):
            return LaunchedStep(self.run(batch))
        return LaunchedStep(pending=(batch, self._queue(batch)), chainable=True)

    def collect(self, launched: LaunchedStep) -> list[int]:
        if launched.result is not None:
            return launched.result
        batch, done_at = launched.pending
        time.sleep(max(0.0, done_at - time.monotonic()))
        # NOTE: a step's tokens hash its context, which holds the step before's token by now
        return self._tokens(batch)

    def _tokens(self, batch: ScheduledBatch) -> list[int]:
        out = []
        for req, start, end, sample in zip(
            batch.requests, batch.starts, batch.ends, batch.sample, strict=True
        ):
            k = req.payload.params.prompt_logprobs
            if (
                k is not None and batch.mode == "extend"
            ):  # NOTE: certain, as its tokens are: 0, no alternative
                for p in range(start + 1, min(end + 1, req.prompt_len)):
                    req.payload.prompt_logprobs[p] = (
                        0.0,
                        [req.token_ids[p]] if k else [],
                        [0.0] if k else [],
                    )
            if sample:
                context = np.asarray(req.token_ids[max(0, end - 8) : end], dtype=np.uint32).tobytes()
                h = mmh3.hash(context + end.to_bytes(4, "little"), signed=False)
                st = req.payload
                if st.params.guide is None:
                    out.append(int(_PRINTABLE[h % _PRINTABLE.size]))
                else:  # structured outputs: the hash picks among the tokens the grammar allows
                    allowed = allowed_mask([matcher_of(st)], _BYTE_VOCAB)[0]
                    choices = allowed.nonzero().flatten()
                    out.append(int(choices[h % choices.numel()]))
                    advance([st], out[-1:])
                top = req.payload.params.logprobs
                if top is not None:  # NOTE: the next token is certain here: logprob 0, no alternative
                    req.payload.step_logprobs = (0.0, out[-1:] if top else [], [0.0] if top else [])
        return out


def build_sim_engine(cfg: WorkerConfig) -> Engine:
    """An Engine over a page allocator only (no tensors), the byte tokenizer and the cost model."""
    capacity = cfg.kv_cache_tokens or DEFAULT_SIM_KV_TOKENS
    allocator = PageAllocator(max(1, capacity // cfg.block_size))
    executor = SimExecutor(cfg.sim_prefill_ms_per_token, cfg.sim_decode_base_ms, cfg.sim_decode_ms_per_seq,
                           cfg.sim_host_copy_ms_per_token, allocator.num_pages, cfg.block_size)  # fmt: skip
    name = cfg.served_model_name or cfg.model
    engine = assemble_engine(
        cfg,
        executor,
        allocator,
        ByteTokenizer(),
        min(cfg.sim_context_tokens, cfg.max_model_len or cfg.sim_context_tokens),  # the model's, then served
        name,
        simulated=True,
        host=host_tier(cfg, None),
    )
    cache = engine.cache
    executor.copied_tokens = lambda: (cache.offloaded_pages + cache.loaded_pages) * cfg.block_size
    return engine
