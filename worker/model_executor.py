"""Runs scheduled steps through the torch model: launch (a CUDA graph replay or the eager forward, then
sampling queued on the device) and collect (tokens and logprobs read back), and moves KV slabs in and out
of the pool. Never schedules, and never touches the radix cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker.engine_api import LaunchedStep, RequestState, chainable_step
from worker.penalties import adjusts
from worker.request import ScheduledBatch


@dataclass
class _Launched:
    """A decode or extend step ModelExecutor.launch queued. ``raw``: its logits (rows that sample),
    ``reqs``: those rows' requests. Once sampled (``tokens`` set): what collect reads back (the
    tokens, then the logprob tensors of the ``asking`` rows; pinned copies on CUDA, valid once
    ``ready`` has happened) and ``guided``: rows whose grammar takes its token at collect."""

    raw: Any
    reqs: list
    tokens: Any = None
    out: list = field(default_factory=list)
    asking: list[int] = field(default_factory=list)
    top: list[int] = field(default_factory=list)
    guided: list[int] = field(default_factory=list)
    ready: Any = None

    @property
    def states(self) -> list[RequestState]:
        return [r.payload for r in self.reqs]


def _chained_inputs(batch: ScheduledBatch, tokens: Any) -> Any:
    """The new tokens of a decode step scheduled ahead, on ``tokens``' device without a sync: the
    step before's sampled ``tokens`` picked by ``batch.inputs_from``, the host's where it is -1."""
    import torch

    from worker.sampling import on_device

    rows = batch.inputs_from
    if rows is None or len(rows) != len(batch.requests) or batch.mode != "decode":
        raise ValueError("a step after another is a decode step with inputs_from, one row per request")
    if np.array_equal(rows, np.arange(len(rows))):  # NOTE: the common case: the same requests again
        return tokens[: len(rows)]
    mine = np.flatnonzero(rows >= 0)
    ids = on_device(batch.input_ids.tolist(), tokens.device, torch.int64)
    taken = tokens.index_select(0, on_device(rows[mine].tolist(), tokens.device, torch.int64))
    return ids.index_copy_(0, on_device(mine.tolist(), tokens.device, torch.int64), taken)


def _generators(states: list[RequestState], device: Any) -> list[Any]:
    """Each request's RNG (None unless seeded), made on first use on ``device`` and kept in its state."""
    from worker.sampling import make_generator

    for st in states:
        if st.generator is None and st.params.seed is not None:
            st.generator = make_generator(st.params, device)
    return [st.generator for st in states]


def _histories(reqs: list[Any]) -> list[Any]:
    """What worker.penalties reads of each request: its tokens so far, prompt length, stop ids, memo."""
    return [(r.token_ids, r.prompt_len, r.stop_token_ids, r.payload.memo) for r in reqs]


class ModelExecutor:
    """Runs a scheduled step through the torch model and samples the requests that need a token."""

    def __init__(
        self, model: Any, kv_pool: Any, device: Any, decode_graphs: Any = None, extend_graphs: Any = None
    ) -> None:
        self.model, self.kv_pool, self.device = model, kv_pool, device
        self.decode_graphs = decode_graphs  # a DecodeGraphRunner (CUDA) or None: every step eager
        self.extend_graphs = extend_graphs  # an ExtendGraphRunner (CUDA) or None: every step eager
        self.graph_steps = 0  # decode steps replayed from a graph (the rest ran eagerly)
        self.extend_graph_steps = 0  # extend and verify steps replayed from a graph
        self.vocab_size = model.config.vocab_size  # the logits' width (may exceed the tokenizer's)

    @property
    def tensor_parallel_size(self) -> int:
        return self.model.shard.size

    def read_kv(self, slots: Any, lo: int = 0, hi: int | None = None) -> Any:
        """Slabs ``lo`` .. ``hi`` of pool ``slots`` [hi - lo, n, KV heads, dim] (worker.kv_pages),
        every rank's heads, on the CPU."""
        from worker.kv_pages import read_kv

        # NOTE: a tensor-parallel model has its own, across ranks
        return getattr(self.model, "read_kv", read_kv)(self.kv_pool, slots, lo, hi)

    def write_kv(self, slots: Any, slabs: Any, lo: int = 0) -> None:
        """Write slabs ``lo`` .. ([m, n, KV heads (all ranks'), dim]) into pool ``slots``."""
        from worker.kv_pages import write_kv

        getattr(self.model, "write_kv", write_kv)(self.kv_pool, slots, slabs, lo)

    def close(self) -> None:
        """Release what the model holds outside this process (the other tensor-parallel ranks)."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    def run(self, batch: ScheduledBatch) -> list[int]:
        logits = self._logits(batch)
        sampling = [r for r, s in zip(batch.requests, batch.sample, strict=True) if s]
        return self._sample(logits, sampling) if sampling else []

    def _logits(self, batch: ScheduledBatch, input_ids: Any = None) -> Any:
        """The step's forward: logits of each request that samples (rows in order). ``input_ids``:
        its new tokens on the device instead of ``batch.input_ids`` (a decode step)."""
        import torch

        from worker.sampling import on_device

        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            logits = self.decode_graphs.run(batch, input_ids)
            self.graph_steps += 1
        elif self.extend_graphs is not None and self.extend_graphs.can_run(batch):
            logits = self.extend_graphs.run(batch)
            self.extend_graph_steps += 1
        elif batch.mode == "extend" and any(r.full_prefill for r in batch.requests):  # prompt logprobs
            logits = self._forward_scoring_prompts(batch, self._forward_batch(batch))
        else:
            fb = self._forward_batch(batch)
            if input_ids is not None:
                fb.input_ids, fb.inputs_on_device = input_ids, True
            logits = self.model.forward(fb, self.kv_pool)
        rows = [i for i, s in enumerate(batch.sample) if s]
        if len(rows) != len(batch.sample):
            logits = logits.index_select(0, on_device(rows, logits.device, torch.int64))
        return logits

    def launch(self, batch: ScheduledBatch, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue a decode or extend step on the device and return without waiting for it: the
        forward and the sampling are enqueued, the tokens start their copy to pinned host memory.
        ``after``: the launched step whose tokens are this decode step's inputs (``inputs_from``;
        taken on the device). Logprobs are computed now too, read back with the tokens. A step after
        another with a request under a grammar has only its forward queued here: its sampling needs
        the grammar's state after the step before's token, so it is queued when its tokens are first
        needed (the next launch, or collect), by then the step before has been collected. Steps with
        prompt logprobs (see chainable_step) run to the end here, as ``run``."""
        if not chainable_step(batch):
            if after is not None:
                raise ValueError("only a chainable decode step takes its inputs from the step before")
            return LaunchedStep(self.run(batch))
        input_ids = None if after is None else _chained_inputs(batch, self._sampled(after).tokens)
        reqs = [r for r, s in zip(batch.requests, batch.sample, strict=True) if s]
        step = _Launched(self._logits(batch, input_ids), reqs)
        if after is None:
            self._sample_launched(step)
        elif all(r.payload.params.guide is None for r in reqs):
            # NOTE: a chained step samples every row (a decode step); a row taking its input from the
            # step before has that token, its newest, on the device only
            self._sample_launched(step, (input_ids, np.flatnonzero(batch.inputs_from >= 0).tolist()))
        return LaunchedStep(pending=step, chainable=True)

    def _sampled(self, launched: LaunchedStep) -> _Launched:
        """The launched step, its sampling queued (now, if it was waiting for the step before)."""
        step: _Launched = launched.pending
        if step.tokens is None:
            # NOTE: the step before has been collected and committed: every row's history and
            # grammar now hold its token (rows it ended are dropped at commit, so left as they are)
            self._sample_launched(step)
        return step

    def _sample_launched(self, step: _Launched, unseen: tuple[Any, list[int]] | None = None) -> None:
        """Queue the step's sampling (penalties and bias, grammar masks, sampling, logprobs) and
        the copies collect reads, without waiting for the device. ``unseen``: (input ids on the
        device, rows whose newest token they hold and their history lacks; worker.penalties)."""
        import torch

        from worker.guided import constrain
        from worker.penalties import adjust_logits
        from worker.sampling import logprob_tensors, on_device, sample

        raw, states = step.raw, step.states
        params = [st.params for st in states]
        logits = raw  # NOTE: logprobs come from the raw logits, before penalties and bias
        if any(adjusts(p) for p in params):
            logits = adjust_logits(raw, params, _histories(step.reqs), unseen)
        # NOTE: a request ended since this step was scheduled (by the step before, an abort) has a
        # row that commit drops; its grammar may have finished: no mask, and it takes no token
        step.guided = [j for j, (r, st) in enumerate(zip(step.reqs, states, strict=True))
                       if st.params.guide is not None and r.finish_reason is None]  # fmt: skip
        if step.guided:
            logits = constrain(logits, states, step.guided)
        tokens = step.tokens = sample(logits, params, _generators(states, logits.device))
        step.out = [tokens]
        step.asking = [j for j, st in enumerate(states) if st.params.logprobs is not None]
        if step.asking:  # NOTE: from the logits now: the next step's replay overwrites the graph's output
            index = on_device(step.asking, raw.device, torch.int64)
            step.top = [states[j].params.logprobs for j in step.asking]
            step.out += logprob_tensors(raw.index_select(0, index), tokens.index_select(0, index), step.top)
        if tokens.is_cuda:  # NOTE: collect waits for this event, not for the steps queued after it
            step.out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                        for t in step.out]  # fmt: skip
            step.ready = torch.cuda.Event()
            step.ready.record()

    def collect(self, launched: LaunchedStep) -> list[int]:
        """The tokens of a launched step (waits for them); its logprobs go to each asking request's
        ``step_logprobs`` and its guided rows' grammars take their tokens, as ``run`` leaves them."""
        from worker.guided import advance
        from worker.sampling import logprob_lists

        if launched.result is not None:
            return launched.result
        step = self._sampled(launched)
        if step.ready is not None:
            step.ready.synchronize()
        ids, *numbers = (t.tolist() for t in step.out)
        states = step.states
        if step.asking:
            for j, lp in zip(step.asking, logprob_lists(*numbers, step.top), strict=True):
                states[j].step_logprobs = lp
        advance([states[j] for j in step.guided], [ids[j] for j in step.guided])
        return ids

    def _sample(self, logits: Any, reqs: list[Any]) -> list[int]:
        """One token per request from its row of ``logits``, waiting for them: what a launched step
        samples (penalties and bias, the grammar's mask, sampling, logprobs of the raw row to
        ``step_logprobs``), then what collect does (the grammar advanced)."""
        step = _Launched(logits, list(reqs))
        self._sample_launched(step)
        return self.collect(LaunchedStep(pending=step))

    def _forward_batch(self, batch: ScheduledBatch) -> Any:
        """The step's ForwardBatch on the model's device, with its LoRA rows when it has any."""
        from worker.forward_batch import ForwardBatch
        from worker.model.lora import lora_batch

        fb = ForwardBatch.from_step(batch, self.device)
        adapters = [r.adapter for r in batch.requests]
        if any(adapters):
            fb.lora = lora_batch(self.model.lora_stack, adapters, batch.qo_indptr, fb.max_extend_len)
        return fb

    def verify(self, batch: ScheduledBatch) -> list[list[int]]:
        """A verify step (speculative decoding): logits for every new token, then each request's
        accepted tokens (worker.sampling.accept_draft) and their logprobs when it asks. Each row is
        scored as one-at-a-time decoding would score it (penalties over the history up to it, the
        grammar's mask in its state there); a request without drafts is sampled as in a decode step."""
        import torch

        from worker.guided import draft_masks, matcher_of
        from worker.penalties import adjust_logits
        from worker.sampling import accept_draft, accept_greedy, token_logprobs

        assert batch.drafts is not None
        if self.extend_graphs is not None and self.extend_graphs.can_run(batch, "all"):
            logits = self.extend_graphs.run(batch, "all")
            self.extend_graph_steps += 1
        else:
            fb = self._forward_batch(batch)
            fb.return_all_logits = fb.verify = True
            logits = self.model.forward(fb, self.kv_pool)
        qo = batch.qo_indptr.tolist()
        out: list[list[int]] = [[] for _ in batch.requests]
        # NOTE: requests without drafts (nothing matched) take their one token as a decode step gives it
        plain = [i for i, d in enumerate(batch.drafts) if not d]
        if plain:
            last = torch.tensor([qo[i] for i in plain], device=logits.device)
            for i, token in zip(
                plain, self._sample(logits[last], [batch.requests[i] for i in plain]), strict=True
            ):
                st = batch.requests[i].payload
                out[i] = [token]
                st.verify_logprobs = None if st.step_logprobs is None else [st.step_logprobs]
                st.step_logprobs = None
        drafted = [i for i, d in enumerate(batch.drafts) if d]
        plain_greedy = [i for i in drafted if _plain_greedy(batch.requests[i].payload.params)]
        best = logits.argmax(dim=-1).tolist() if plain_greedy else []  # NOTE: one transfer for all of them
        for i in drafted:
            req, draft = batch.requests[i], batch.drafts[i]
            st: RequestState = req.payload
            _generators([st], logits.device)
            rows = logits[qo[i] : qo[i + 1]]
            if _plain_greedy(st.params):
                tokens = accept_greedy(best[qo[i] : qo[i + 1]], draft)
            else:
                # NOTE: row j as decoding would see it after draft[:j]: penalties and bias over that
                # history, then the grammar's mask in the state it would be in
                scores = rows
                if adjusts(st.params):
                    n = len(draft) + 1
                    before = [draft[:j] for j in range(n)]  # the drafts each row's history lacks
                    scores = adjust_logits(rows, [st.params] * n, _histories([req]) * n, drafted=before)
                if st.params.guide is not None:
                    allowed = draft_masks(st, draft, rows.shape[1], rows.device)
                    ninf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
                    scores = torch.where(allowed, scores, ninf)
                tokens = accept_draft(scores, draft, st.params, st.generator)
                if st.params.guide is not None:
                    matcher_of(st).consume_tokens(tokens)
            if st.params.logprobs is not None:
                index = torch.tensor(tokens, device=logits.device)
                top = [st.params.logprobs] * len(tokens)
                st.verify_logprobs = token_logprobs(rows[: len(tokens)], index, top)
            out[i] = tokens
        return out

    def _forward_scoring_prompts(self, batch: ScheduledBatch, fb: Any) -> Any:
        """An extend step where some requests want their prompt's logprobs: logits for every new
        token of those, the last of the others; the prompt numbers go to each request's state and
        the last row per request comes back, as a plain forward gives it."""
        import torch

        from worker.sampling import token_logprobs

        qo = batch.qo_indptr
        rows: list[int] = []
        last: list[int] = []
        for i, req in enumerate(batch.requests):
            a, b = int(qo[i]), int(qo[i + 1])
            rows.extend(range(a, b) if req.payload.params.prompt_logprobs is not None else (b - 1,))
            last.append(len(rows) - 1)
        fb.logit_rows = torch.tensor(rows, device=self.device)
        logits = self.model.forward(fb, self.kv_pool)
        offset = 0
        for i, req in enumerate(batch.requests):
            st, start, end = req.payload, batch.starts[i], batch.ends[i]
            k = st.params.prompt_logprobs
            if k is None:
                offset += 1
                continue
            # NOTE: the row at position p predicts the token at p + 1; prompt tokens only
            n = max(0, min(end - start, req.prompt_len - 1 - start))
            for a in range(0, n, SCORE_ROWS):  # bounded [rows, vocab] log-softmax temporaries
                m = min(SCORE_ROWS, n - a)
                target = torch.tensor(req.token_ids[start + 1 + a : start + 1 + a + m], device=logits.device)
                scored = token_logprobs(logits[offset + a : offset + a + m], target, [k] * m)
                for j, entry in enumerate(scored):
                    st.prompt_logprobs[start + 1 + a + j] = entry
            offset += end - start
        return logits[torch.tensor(last, device=logits.device)]


SCORE_ROWS = 256  # prompt positions scored per log-softmax
EXTEND_GRAPH_REQUESTS = 32  # most requests an extend graph takes (unless verify steps take more)


def _plain_greedy(params: Any) -> bool:
    """Greedy with nothing that changes a row before its argmax (penalties, bias, a grammar)."""
    return params.greedy and params.guide is None and not adjusts(params)


def model_executor(cfg: Any, model: Any, pool: Any, device: Any, max_context: int) -> ModelExecutor:
    """The executor for ``model``; on CUDA its decode steps (--cuda-graph-max-bs > 0) and short
    extend and verify steps (--cuda-graph-extend-tokens > 0) replay CUDA graphs, captured here, after
    the KV pool exists (the graphs address its tensors)."""
    decode = extend = None
    max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running)
    # NOTE: the other ranks of a tensor-parallel model run every step eagerly, so rank 0 does too
    if device.type != "cuda" or cfg.tensor_parallel_size != 1:
        return ModelExecutor(model, pool, device)
    pool_tokens = pool.allocator.num_pages * pool.page_size
    per_request = min(max_context, pool_tokens)  # the most slots a request reads
    if max_bs > 0:
        from worker.cuda_graph import DecodeGraphRunner

        # NOTE: so no step of <= max_bs requests goes to the eager path for want of index room
        decode = DecodeGraphRunner(model, pool, max_bs, max_bs * per_request)
    extend_tokens = min(cfg.cuda_graph_extend_tokens, cfg.chunked_prefill_tokens)
    if extend_tokens > 0:
        from worker.extend_graph import ExtendGraphRunner

        # NOTE: a "last" graph computes logits for all of its request rows, so keep them few: prefill
        # steps hold a handful of requests, verify steps up to --speculative-max-batch
        requests = min(extend_tokens, cfg.max_running, max(EXTEND_GRAPH_REQUESTS, cfg.speculative_max_batch))
        verify = cfg.speculative_tokens > 0  # every token's logits: only verify steps ask for them
        # NOTE: prefixes past the pool's size (only shared ones could) send a step to the eager path
        max_kv = min(requests * per_request, pool_tokens)
        variants = {"auto": None, "on": True, "off": False}[cfg.cuda_graph_extend_variants]
        extend = ExtendGraphRunner(model, pool, extend_tokens, requests, max_kv, verify,
                                   all_max_new=cfg.speculative_tokens + 1 if verify else None,
                                   prefix_variants=variants)  # fmt: skip
    return ModelExecutor(model, pool, device, decode, extend)
