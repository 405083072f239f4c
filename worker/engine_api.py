"""What the engine's callers hold: a request's handle, its output deltas, the engine's side of a
request, the executor protocol and the errors the HTTP layer maps to status codes. Plain data."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.detokenizer import IncrementalDetokenizer
from worker.request import ScheduledBatch
from worker.sampling import SamplingParams, TokenLogprobs


class EngineDeadError(RuntimeError):
    """The engine thread stopped; the worker cannot serve (HTTP 503)."""


class PromptTooLongError(ValueError):
    """The prompt does not fit the context or the KV pool (HTTP 400 context_length_exceeded)."""


@dataclass
class RequestOutput:
    """One delta for a request. The last one has ``finish_reason`` set (or ``error``)."""

    text: str = ""  # new text since the previous output
    token_ids: list[int] = field(default_factory=list)  # new generated ids
    # the text token_ids decoded to themselves, before any was held back for a stop string (None: text)
    token_text: str | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    # vLLM's: the stop string, or the stop_token_ids id, that ended it (None: EOS, a length, an error)
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the radix cache
    cache_written_tokens: int = 0  # prompt tokens whose pages the request added to the radix cache
    completion_tokens: int = 0  # generated so far
    error: str | None = None
    error_status: int = 0  # HTTP status for ``error`` (429 queue full, 500 model failure, 503 dead)
    error_code: str | None = None  # OpenAI error ``code`` for ``error`` (429: "queue_full")
    index: int = 0  # which of the request's choices (n > 1) this output belongs to
    logprobs: TokenLogprobs | None = None  # of token_ids[0], when the request asked for logprobs
    # first output of a request with prompt logprobs: one entry per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def own_text(self) -> str:
        """The text of ``token_ids`` alone (a token is judged by it: thinking or answer)."""
        return self.text if self.token_text is None else self.token_text


@dataclass
class RequestHandle:
    rid: str
    prompt_tokens: int
    max_tokens: int  # after clamping to the context / pool
    outputs: asyncio.Queue  # of RequestOutput (one queue may serve several choices: see .index)
    index: int = 0
    # a whole (non-streamed) answer: its outputs are delivered HELD_OUTPUTS at a time, not one per step
    hold: bool = False
    held: list = field(default_factory=list)  # engine thread: outputs not delivered yet (``hold``)


class Executor(Protocol):
    """Computes one scheduled step: returns one sampled token per request with ``batch.sample``.
    Executors that can check drafts (speculative decoding) also have ``verify(batch)``: a verify
    step's accepted tokens per request. Executors that run steps asynchronously also have
    ``launch(batch, after) -> LaunchedStep`` and ``collect(LaunchedStep) -> tokens`` (what ``run``
    returns); ``after`` is the launched step whose sampled tokens are ``batch``'s inputs
    (``batch.inputs_from``). Executors that compute on a KV pool have it as ``kv_pool`` (a KVPool)."""

    def run(self, batch: ScheduledBatch) -> list[int]: ...


@dataclass
class LaunchedStep:
    """A step an executor launched: ``result`` when it ran to the end at once, else ``pending``
    (the executor's own handle, for ``collect``). ``chainable``: a decode step may take its inputs
    from this one's tokens before they are collected (Scheduler.schedule_ahead)."""

    result: list[int] | None = None
    pending: Any = None
    chainable: bool = False


def chainable_step(batch: ScheduledBatch) -> bool:
    """Can a step be scheduled ahead of this one's tokens? Any decode step, and an extend step unless
    a request in it wants its prompt's logprobs (those are read back as the step runs). Penalties,
    bias and ``min_tokens`` read the token a step ahead lacks on the device
    (worker.penalties.adjust_logits, ``unseen``); a grammar's mask waits for it on the host, so such a
    step's sampling is queued after the step before is collected (ModelExecutor.launch)."""
    if batch.mode == "decode":
        return True
    return batch.mode == "extend" and not any(r.full_prefill for r in batch.requests)


@dataclass
class RequestState:
    """The engine's side of a request (the scheduler's ``Request.payload``)."""

    handle: RequestHandle
    loop: asyncio.AbstractEventLoop
    params: SamplingParams
    detok: IncrementalDetokenizer
    hold: int  # chars held back while they may start a stop string
    arrival: float  # monotonic s
    pending: str = ""  # detokenised text not yet sent
    first_token_at: float | None = None
    last_token_at: float = 0.0
    generator: Any = None  # per-request RNG, created by the executor for seeded requests
    step_logprobs: TokenLogprobs | None = None  # set by the executor with the token it samples
    verify_logprobs: list[TokenLogprobs] | None = None  # a verify step's: one per accepted token
    memo: dict = field(default_factory=dict)  # the executor's per-request cache (penalties)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # prompt position -> numbers
