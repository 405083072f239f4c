"""Engine: one thread owns the scheduler, radix cache, KV pool and executor (model or cost model).

The HTTP event loop talks to it only through a thread-safe inbox and per-request asyncio queues fed
with loop.call_soon_threadsafe, so the loop never blocks on the model. Stop strings, EOS and
max_tokens end requests here; text is detokenised incrementally.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
import types
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

from router.detokenizer import IncrementalDetokenizer
from router.tokenization import PromptTokenizer
from worker.cache_salt import SaltSpaces
from worker.engine_api import (
    EngineDeadError,
    Executor,
    LaunchedStep,
    PromptTooLongError,
    RequestHandle,
    RequestOutput,
    RequestState,
)
from worker.guided import GuideCompiler, check_drafts, constraint_failure
from worker.kv_pool import PageAllocator
from worker.kv_publisher import KVPublisher
from worker.metrics import EngineSnapshot, WorkerMetrics
from worker.radix_cache import RadixCache
from worker.request import QueueFullError, Request, ScheduledBatch, SchedulerConfig, SchedulerStats
from worker.sampling import SamplingParams
from worker.scheduler import Scheduler

log = logging.getLogger("worker.engine")
# A whole (non-streamed) answer's outputs reach its reader this many at a time (Engine.submit's hold):
# its reader wakes once per batch, not per step, and the engine keeps no more than a batch of them
HELD_OUTPUTS = 64


def ban_failure(st: RequestState, req: Request, token: int, at: int) -> str | None:
    """Why ``token``, sampled at ``req.token_ids[at]``, was one the request's bans ruled out, or None. A
    row with no token left (``allowed_token_ids`` whose every token ``bad_words`` or ``min_tokens``
    banned at this step) samples id 0; the request ends with this error instead, the token not output."""
    params = st.params
    if not (params.allowed_token_ids is not None or params.bad_words or params.min_tokens):
        return None
    ids, done = req.token_ids, at - req.prompt_len  # NOTE: done: output tokens before this one
    if params.allowed_token_ids is not None and "allowed_set" not in st.memo:
        st.memo["allowed_set"] = frozenset(params.allowed_token_ids)
    # NOTE: each token is checked: only a word's own length of the output is looked at, never a copy of it all
    banned = (
        (params.allowed_token_ids is not None and token not in st.memo["allowed_set"])
        or (done < params.min_tokens and token in req.stop_token_ids)
        or any(w[-1] == token and len(w) - 1 <= done and ids[at - len(w) + 1 : at] == w[:-1]
               for w in params.bad_words)
    )  # fmt: skip
    if not banned:
        return None
    return ("no token was left to sample: bad_words, min_tokens or allowed_token_ids banned every token "
            "at this step")  # fmt: skip


class Engine:
    """Owns everything request-related on one thread; see the module docstring."""

    def __init__(
        self,
        executor: Executor,
        allocator: PageAllocator,
        cache: RadixCache,
        scheduler_config: SchedulerConfig,
        tokenizer: PromptTokenizer,
        max_context: int,  # tokens the model serves (prompt + output)
        publisher: KVPublisher,
        served_model_name: str,
        simulated: bool = False,
        warmup_tokens: int = 0,
        adapter_names: Sequence[str] = (),
        stall_timeout_s: float = 120.0,
        overlap: bool = False,
    ) -> None:
        self.executor = executor
        # NOTE: an executor with launch/collect runs a step asynchronously; with ``overlap`` the engine
        # keeps the next decode step queued behind the running one (see _advance)
        self.overlap = overlap
        self._running: tuple[ScheduledBatch, LaunchedStep] | None = None  # launched, not committed
        self.allocator = allocator
        self.cache = cache
        self.salts = SaltSpaces(cache)  # cache_salt namespaces (engine thread)
        self._parked: deque[Request] = deque()  # salted requests waiting for a namespace, in order
        self.scheduler = Scheduler(scheduler_config, allocator, cache)
        self.tokenizer = tokenizer
        # the model's token ids (its embedding's rows, its logits' width): a checkpoint's tokenizer may
        # name fewer (a padded embedding) or more (an added token the embedding lacks)
        self.vocab_size: int = getattr(executor, "vocab_size", tokenizer.vocab_size)
        self.guides = GuideCompiler(tokenizer, self.vocab_size)
        self.page_size = scheduler_config.page_size
        self.capacity_tokens = allocator.num_pages * self.page_size
        self.max_total_tokens = min(max_context, self.capacity_tokens)  # prompt + output
        self.publisher = publisher
        self.served_model_name = served_model_name
        # LoRA adapters beside the base: id i is adapter_names[i - 1] (None once unloaded; ids are
        # never reused, so a name loaded again gets a fresh id and cache range)
        self.adapter_names: list[str | None] = list(adapter_names)
        self.simulated = simulated
        self.warmup_tokens = warmup_tokens  # prompt tokens of the request run before serving; 0 = none
        self.stall_timeout_s = stall_timeout_s
        # NOTE: monotonic time the engine thread's current piece of work began; None while it waits
        # for work. A step stuck in a collective (a hung tensor-parallel rank) shows as a stall.
        self.busy_since: float | None = None
        self.ready = threading.Event()  # set once the warm-up is over (at once without one)
        self.max_waiting = scheduler_config.max_waiting
        self.max_running = scheduler_config.max_running
        self._inbox: queue.Queue[tuple] = queue.Queue()
        # requests submitted that the snapshot does not count yet (in the inbox, or taken since)
        self._queued = 0
        self._taken = 0  # engine thread: of those, taken from the inbox since the last snapshot
        self._queued_lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # engine thread only
        self._finished: Counter[str] = Counter()
        self._outbox: list[tuple[RequestState, RequestOutput]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        self._snap = EngineSnapshot()
        self.metrics = WorkerMetrics(self.snapshot, lambda: dict(publisher.stats))
        self._refresh()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.publisher.start()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        self.publisher.close()
        close = getattr(self.executor, "close", None)
        if close is not None and not (self._thread is not None and self._thread.is_alive()):
            close()

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def stalled(self) -> bool:
        """Has the engine thread been on one step (or call) longer than ``stall_timeout_s``?"""
        since = self.busy_since
        return since is not None and time.monotonic() - since > self.stall_timeout_s

    def snapshot(self) -> EngineSnapshot:
        """Latest state (any thread; refreshed after every step). Its ``waiting`` also counts the
        requests submitted since, which the engine thread takes at its next step."""
        with self._queued_lock:
            snap, queued = self._snap, self._queued
        return dataclasses.replace(snap, waiting=snap.waiting + queued) if queued else snap

    # ------------------------------------------------------------------ API for the event loop
    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        outputs: asyncio.Queue | None = None,
        index: int = 0,
        prompt_group: Any = None,
        hold: bool = False,
    ) -> RequestHandle:
        """Queue a request. Raises EngineDeadError, PromptTooLongError, QueueFullError or ValueError.
        Its outputs go to ``outputs`` (a new queue by default) tagged with ``index``, so the choices
        of one n > 1 request can share one queue; their ``prompt_group`` tells the scheduler they
        share the prompt (its prefill backlog counts it once). ``hold``: a whole answer (not
        streamed): its outputs are delivered ``HELD_OUTPUTS`` at a time (and when it finishes or
        fails), so its reader wakes once per batch, not once a step."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_total_tokens:  # NOTE: first: a cheap refusal of a prompt of millions of ids
            raise PromptTooLongError(
                f"the prompt has {n} tokens; this worker serves at most {self.max_total_tokens - 1} "
                f"(context {self.max_total_tokens} tokens including at least one output token)"
            )
        if (bad := next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)) is not None:
            raise ValueError(f"the prompt holds token id {bad}, which the model has no embedding for "
                             f"(its vocabulary is [0, {self.vocab_size}))")  # fmt: skip
        max_tokens = min(params.max_tokens, self.max_total_tokens - n)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        if params.allowed_token_ids is not None:  # NOTE: a row with no token left would sample id 0
            left = set(params.allowed_token_ids) - {w[0] for w in params.bad_words if len(w) == 1}
            if not left:
                raise ValueError("bad_words bans every token allowed_token_ids allows")
            if params.min_tokens and left <= eos | set(params.stop_token_ids):
                raise ValueError("min_tokens bans every token allowed_token_ids allows (EOS and stop ids)")
        rid = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        handle = RequestHandle(
            rid, n, max_tokens, asyncio.Queue() if outputs is None else outputs, index, hold
        )
        req = Request(rid, prompt_ids, max_tokens, frozenset(eos | set(params.stop_token_ids)),
                      prompt_group=prompt_group, priority=params.priority,
                      full_prefill=params.prompt_logprobs is not None,
                      speculative=True, adapter=params.adapter)  # fmt: skip
        detok = IncrementalDetokenizer(
            self.tokenizer, list(prompt_ids), skip_special_tokens=params.skip_special_tokens
        )
        if params.guide is not None and params.guide.shown:
            detok.show(params.guide.shown)  # NOTE: a tool call's tags are text for its reader
        req.payload = RequestState(
            handle=handle,
            loop=asyncio.get_running_loop(),
            params=params,
            detok=detok,
            hold=max((len(s) for s in params.stop), default=1) - 1,
            arrival=req.arrival,
        )
        if params.guide is not None:
            req.draft_check = functools.partial(check_drafts, req.payload)
        # NOTE: counted as it enters the inbox, in one step with the check (an error above counts nothing);
        # full at max_waiting beyond the free running slots: requests those take do not wait
        with self._queued_lock:
            snap = self._snap
            if self._queued + snap.waiting + snap.running >= self.max_waiting + self.max_running:
                self.metrics.queue_full.inc()
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            self._queued += 1
            self._inbox.put(("add", req))
        return handle

    def served_models(self) -> list[str]:
        """The base model's name, then the adapters loaded now."""
        return [self.served_model_name, *(n for n in self.adapter_names if n is not None)]

    def abort(self, rid: str) -> None:
        """Cancel a request (client gone); its pages are released on the engine thread."""
        self._inbox.put(("abort", rid))

    def post(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue ``fn`` to run on the engine thread between steps, in order with every other call;
        its future (cancelled before it runs: skipped). Safe from any thread."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps (cache flush, snapshot) and return its result."""
        return await asyncio.wrap_future(self.post(fn))

    async def flush_cache(self) -> tuple[int, int]:
        """Drop every cached page no request holds; returns the (device, host tier) pages freed."""

        def flush() -> tuple[int, int]:
            freed = self.cache.flush()
            self._publish_events()
            self._refresh()
            return freed

        return await self.call(flush)

    async def snapshot_events(self) -> bytes:
        """The cache as one encoded KV event batch consistent with the published stream."""

        def snap() -> bytes:
            self._publish_events()
            return self.publisher.snapshot_batch(self.cache.snapshot())

        return await self.call(snap)

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            if self.warmup_tokens > 0:
                self._warmup(self.warmup_tokens)
            self.ready.set()
            self.publisher.publish([], [], cleared=True, force=True)  # seq 0: a new, empty cache
            stuck = False  # NOTE: work, but no step to run (pages held by a transfer): wait for the inbox
            while not self._stopping:
                self.busy_since = None
                self._drain_inbox(
                    block=self._running is None
                    and (stuck or (not self.scheduler.has_work() and not self._parked))
                )
                if self._stopping:
                    break
                self._unpark()
                if self.busy_since is None:
                    self.busy_since = time.monotonic()
                stuck = False
                if self._running is None:
                    batch = self.scheduler.schedule()
                    self._running = None if batch is None else self._launch(batch)
                    stuck = batch is None and self.scheduler.has_work()
                if self._running is not None:
                    self._advance()
                self._publish_events()
                self._refresh()  # NOTE: before delivery, so /health after a response shows its release
                self._flush_outbox()
        except BaseException as exc:
            log.exception("engine thread died")
            self.dead = exc
            self._fail_everything(exc)

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self.busy_since = time.monotonic()
        while True:
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def queued(self) -> list[Request]:
        """Every request queued or running (engine thread), those waiting for a salt namespace too."""
        return [*self.scheduler.requests(), *self._parked]

    def _spaces_in_use(self) -> set[int]:
        """The cache namespaces queued or running requests use."""
        return {r.namespace for r in self.scheduler.requests()}  # type: ignore[misc]

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            req: Request = msg[1]
            self._taken += 1  # NOTE: counted as queued until the next snapshot counts it
            if req.adapter and self.adapter_names[req.adapter - 1] is None:  # NOTE: unloaded since its check
                self._finished["error"] += 1
                self._emit(req, RequestOutput(finish_reason="error", error="the LoRA adapter was unloaded",
                                              error_status=404, error_code="model_not_found"))  # fmt: skip
                return
            # NOTE: a new salt waits behind those already waiting for a namespace, or for one to free up
            salt = _salt_of(req)
            if salt is not None and (
                (self._parked and not self.salts.holds(req.adapter, salt)) or not self._salt_space(req)
            ):
                self._parked.append(req)
                self._requests[req.rid] = req
                return
            self._admit(req)
        elif kind == "abort":
            req = self._requests.pop(msg[1], None)
            if req is not None:
                if req in self._parked:
                    self._parked.remove(req)
                else:
                    self.scheduler.abort(req)
                self._finished["abort"] += 1
        elif kind == "call":
            fn, fut = msg[1], msg[2]
            if not fut.set_running_or_notify_cancel():  # NOTE: its caller was cancelled: skip it
                return
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _salt_space(self, req: Request) -> bool:
        """Give a salted request its salt's cache namespace; False when every one is in use."""
        salt = _salt_of(req)
        assert salt is not None
        model = self.cache.namespace if not req.adapter else self.adapter_names[req.adapter - 1]
        space = self.salts.space(req.adapter, model, salt, self._spaces_in_use)
        if space is None:
            return False
        req.namespace = space
        return True

    def _unpark(self) -> None:
        """Admit the requests that waited for a salt namespace, in order, while namespaces free up."""
        while self._parked and self._salt_space(self._parked[0]):
            self._admit(self._parked.popleft())

    def _admit(self, req: Request) -> None:
        try:
            self.scheduler.add(req)
            self._requests[req.rid] = req
        except QueueFullError as exc:  # NOTE: retractions put requests back in the queue since submit's check
            self._requests.pop(req.rid, None)
            self._finished["error"] += 1
            self.metrics.queue_full.inc()
            self._emit(req, RequestOutput(finish_reason="error", error=str(exc), error_status=429,
                                          error_code="queue_full"))  # fmt: skip

    def _advance(self) -> None:
        """Finish the running step. With overlap, the decode step after it is scheduled and launched
        first (Scheduler.schedule_ahead), so the device has it queued while this thread waits for
        the tokens, commits and delivers them, and schedules the one after."""
        batch, launched = self._running  # type: ignore[misc]
        self._running = None
        if self.overlap and launched.chainable:
            ahead = self.scheduler.schedule_ahead(batch)
            if ahead is not None:
                self._running = self._launch(ahead, launched)
        self._finish(batch, launched)

    def _launch(
        self, batch: ScheduledBatch, after: LaunchedStep | None = None
    ) -> tuple[ScheduledBatch, LaunchedStep] | None:
        """Start ``batch`` on the executor; ``after``: the launched step whose tokens are its inputs.
        Executors without ``launch`` (and verify steps) run the whole step here."""
        try:
            if batch.mode == "verify":
                return batch, LaunchedStep(self.executor.verify(batch))  # type: ignore[attr-defined]
            launch = getattr(self.executor, "launch", None)
            if launch is None:
                return batch, LaunchedStep(self.executor.run(batch))
            return batch, launch(batch, after)
        except Exception as exc:
            self._fail_step(batch, exc)
            return None

    def _finish(self, batch: ScheduledBatch, launched: LaunchedStep) -> None:
        """Wait for ``batch``'s tokens, commit them and deliver each request's output."""
        try:
            result = launched.result
            if result is None:
                result = self.executor.collect(launched)  # type: ignore[attr-defined]
        except Exception as exc:
            self._fail_step(batch, exc)
            return
        now = time.monotonic()
        if batch.mode == "verify":
            sizes = [len(r.token_ids) for r in batch.requests]
            for req, size in zip(self.scheduler.commit(batch, result), sizes, strict=True):
                self._on_tokens(req, now, size)
            return
        for req in self.scheduler.commit(batch, _per_request(batch, result)):
            self._on_token(req, now)

    def _fail_step(self, batch: ScheduledBatch, exc: Exception) -> None:
        log.exception("forward failed for %d requests", len(batch.requests))
        for req in self.scheduler.fail(batch):
            self._requests.pop(req.rid, None)
            self._finished["error"] += 1
            self._emit(req, RequestOutput(finish_reason="error", error=f"forward failed: {exc}",
                                          error_status=500))  # fmt: skip

    def _warmup(self, prompt_tokens: int, output_tokens: int = 4) -> None:
        """Run one throw-away request through schedule -> forward -> commit before any client's, so
        the first client does not pay for kernel compilation (Triton on CUDA) and first-use setup.
        It leaves no trace: its pages are flushed from the cache, their events dropped (seq 0,
        published next, announces an empty cache) and the counters reset. A failure is logged, not
        fatal: requests then fail the same way, each with its own error."""
        started = time.monotonic()
        n = max(1, min(prompt_tokens, self.max_total_tokens - output_tokens - 1))
        ids = [1 + i % 200 for i in range(n)]  # NOTE: valid ids in any vocabulary the worker loads
        req = Request("warmup", ids, max_tokens=max(1, min(output_tokens, self.max_total_tokens - n)))
        # NOTE: executors read only .params and .generator of a payload; nobody receives its tokens
        req.payload = types.SimpleNamespace(params=SamplingParams(), generator=None, memo={})
        self.scheduler.add(req)
        try:
            while self.scheduler.has_work():
                batch = self.scheduler.schedule()
                if batch is None:
                    break
                for r in self.scheduler.commit(batch, _per_request(batch, self.executor.run(batch))):
                    if r.finish_reason is not None:
                        self.scheduler.finish(r, r.finish_reason)
        except Exception:
            log.exception("warm-up forward failed; serving anyway")
        if req.finish_reason is None:
            self.scheduler.abort(req)
        self.cache.flush()
        self.cache.drain_events()
        self.scheduler.stats = SchedulerStats()
        log.info("warm-up: %d prompt + %d output tokens in %.2f s", n, req.num_output,
                 time.monotonic() - started)  # fmt: skip

    def _on_tokens(self, req: Request, now: float, size: int) -> None:
        """A verify step's tokens (those past ``size``), one at a time as decode steps give them;
        a stop string ends the request at its token and drops the tokens after it."""
        st: RequestState = req.payload
        tokens, final = req.token_ids[size:], req.finish_reason
        logprobs, st.verify_logprobs = st.verify_logprobs, None
        for j in range(len(tokens)):
            last = j == len(tokens) - 1
            req.finish_reason = final if last else None
            st.step_logprobs = None if logprobs is None else logprobs[j]
            if self._on_token(req, now, tokens[j], keep_tokens=None if last else size + j + 1):
                return

    def _on_token(self, req: Request, now: float, token: int | None = None,
                  keep_tokens: int | None = None) -> bool:  # fmt: skip
        """Deliver ``token`` (default: the request's last); True when the request finished."""
        st: RequestState = req.payload
        first = st.first_token_at is None
        if first:
            st.first_token_at = now
            self.metrics.ttft.observe(now - st.arrival)
        else:
            self.metrics.itl.observe(now - st.last_token_at)
        st.last_token_at = now
        token = req.token_ids[-1] if token is None else token
        finish = req.finish_reason
        # NOTE: a token the bans ruled out (its row had none left) ends the request before it, also
        # inside a verify step (a draft of id 0 matched the empty row's argmax) and at max_tokens
        at = len(req.token_ids) - 1 if keep_tokens is None else keep_tokens - 1  # this token's index
        banned = ban_failure(st, req, token, at) if finish in (None, "stop", "length") else None
        if banned is not None and keep_tokens is not None:
            keep_tokens = at  # the tokens from this one on are dropped
        # NOTE: a grammar's failure is checked at a step's last token (a verify step's matcher took all of
        # its tokens at once); a matcher in error allowed EOS only, so a "stop" may be its doing
        failure = banned or (
            constraint_failure(st) if finish in (None, "stop", "length") and keep_tokens is None else None
        )
        if failure is not None:
            finish = "error"
        logprobs, st.step_logprobs = st.step_logprobs, None
        own = ""  # this token's text (with what the detokenizer kept back until it)
        if finish in ("stop", "error") and token in req.stop_token_ids:  # EOS / stop ids are neither text
            logprobs = None  # nor tokens of the answer
        elif failure is not None:  # NOTE: the token the grammar refused (its row had none it allows left)
            logprobs = None  # is not the answer's either: the text so far breaks no constraint
        else:
            own = st.detok.feed([token])
        if finish is not None:
            own += st.detok.flush()
        st.pending += own
        # NOTE: the stop string that completed first ends the output: the one that ends first (at one end,
        # the longest), however many characters this token brought (text a character at a time agrees)
        found = min(
            ((i + len(s), i, s) for s in st.params.stop if (i := st.pending.find(s)) >= 0), default=None
        )
        stop_reason: str | int | None = None
        if found is not None:
            end = found[0] if st.params.include_stop_str_in_output else found[1]
            text, st.pending, finish, failure, stop_reason = st.pending[:end], "", "stop", None, found[2]
        elif finish is not None:
            text, st.pending = st.pending, ""
        else:
            keep = max(0, len(st.pending) - st.hold)
            text, st.pending = st.pending[:keep], st.pending[keep:]
        if finish is not None:
            req.finish_reason = finish
            self.scheduler.finish(req, finish, keep_tokens)
            self._requests.pop(req.rid, None)
            self._finished[finish] += 1
            self.metrics.e2e.observe(now - st.arrival)
        if finish == "stop" and stop_reason is None and token in st.params.stop_token_ids:
            # NOTE: as vLLM's: EOS is no stop reason, even where stop_token_ids names it too
            stop_reason = token if st.params.ignore_eos or token not in self.tokenizer.eos_token_ids else None
        out = RequestOutput(text=text, token_ids=[token], token_text=own, stop_reason=stop_reason,
                            finish_reason=None if failure else finish, logprobs=logprobs)  # fmt: skip
        if first and st.params.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + [st.prompt_logprobs.get(p) for p in range(1, req.prompt_len)]
        # NOTE: tokens of its verify step after this one are not out yet
        self._emit(req, out, req.num_output if keep_tokens is None else keep_tokens - req.prompt_len)
        if failure is not None:  # NOTE: the text so far, then the error (a stream's error event)
            self._emit(req, RequestOutput(finish_reason="error", error=failure, error_status=400,
                                          error_code="constraint_failed"))  # fmt: skip
        return finish is not None

    def _emit(self, req: Request, out: RequestOutput, completion_tokens: int | None = None) -> None:
        out.prompt_tokens = req.prompt_len
        out.cached_tokens = max(req.cached_tokens, 0)
        out.cache_written_tokens = req.cache_written
        out.completion_tokens = req.num_output if completion_tokens is None else completion_tokens
        out.index = req.payload.handle.index
        self._outbox.append((req.payload, out))

    def _flush_outbox(self) -> None:
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for st, out in self._outbox:
            h = st.handle
            if h.hold and out.finish_reason is None and out.error is None and len(h.held) < HELD_OUTPUTS - 1:
                h.held.append(out)  # NOTE: a whole answer: its reader wakes once every HELD_OUTPUTS steps
                continue
            items = by_loop[st.loop]
            if h.held:
                items.extend((h.outputs, o) for o in h.held)
                h.held = []
            items.append((h.outputs, out))
        self._outbox = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_deliver, items)

    def _publish_events(self) -> None:
        stored, removed, cleared = self.cache.drain_events()
        self.publisher.publish(stored, removed, cleared)

    def _refresh(self) -> None:
        s, cache = self.scheduler.stats, self.cache
        snap = EngineSnapshot(
            t=time.monotonic(),
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting + len(self._parked),
            prefill_backlog_tokens=self.scheduler.prefill_backlog,
            kv_pages_total=self.allocator.num_pages,
            kv_pages_free=self.allocator.num_free,
            kv_pages_cached=cache.total_pages,
            kv_pages_evictable=cache.evictable_pages,
            page_size=self.page_size,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens,
            evicted_pages=cache.evicted_pages,  # NOTE: for room, by steps and by KV transfers alike
            retractions=s.retractions,
            host_pages_total=cache.host.num_pages if cache.host else 0,
            host_pages_cached=cache.host_pages,
            host_offloaded_pages=cache.offloaded_pages,
            host_loaded_pages=cache.loaded_pages,
            host_dropped_pages=cache.host_dropped_pages,
            verify_steps=s.verify_steps,
            ahead_steps=s.ahead_steps,
            salt_namespaces=len(self.salts),
            salt_waiting=len(self._parked),
            draft_tokens=s.draft_tokens,
            accepted_tokens=s.accepted_tokens,
            finished=dict(self._finished),
        )
        with self._queued_lock:  # NOTE: together: no reader counts a request twice, or not at all
            self._snap, self._queued, self._taken = snap, self._queued - self._taken, 0
        self.metrics.record(snap)

    def _fail_everything(self, exc: BaseException) -> None:
        """The engine died: end every request and pending call so no client waits forever."""
        for req in list(self._requests.values()):
            self._emit(req, RequestOutput(finish_reason="error", error=f"engine stopped: {exc}",
                                          error_status=503))  # fmt: skip
        self._requests.clear()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "add":
                self._emit(msg[1], RequestOutput(finish_reason="error", error="engine stopped",
                                                 error_status=503))  # fmt: skip
            elif msg[0] == "call" and msg[2].set_running_or_notify_cancel():  # NOTE: not if cancelled
                msg[2].set_exception(EngineDeadError("the engine stopped"))
        with contextlib.suppress(Exception):
            self._flush_outbox()


def _salt_of(req: Request) -> str | None:
    """A request's ``cache_salt`` (None: none; the warm-up has no parameters)."""
    return None if req.payload is None else req.payload.params.cache_salt


def _per_request(batch: ScheduledBatch, sampled: Sequence[int]) -> list[int]:
    """The executor's sampled tokens (one per sampling request) spread over the batch; -1 where a
    request sampled nothing this step (a prefill chunk that is not its last)."""
    it = iter(sampled)
    return [next(it) if s else -1 for s in batch.sample]


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
