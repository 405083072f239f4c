"""Worker HTTP API (starlette): OpenAI completions and chat, tokenize, and the app that also serves
the Responses API (worker/responses_api.py) and the operational endpoints (worker/ops_api.py). It
validates and streams; it never blocks on the model, and bad input never reaches the engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.api_keys import APIKeys
from router.errors import (
    HTTP_ERROR_HANDLERS,
    QUEUE_FULL_RETRY_AFTER_S,
    RouterError,
    error_payload,
    error_response,
)
from router.kv_events import KV_SOURCE_HEADER
from router.request_id import RequestId
from router.request_parsing import PARSE_INLINE_BYTES
from router.tokenization import prompt_special_tokens
from worker import reasoning
from worker.api_params import (
    MAX_CHOICES,
    APIError,
    call_reader,
    chat_ids,
    chat_logprobs,
    check_body,
    continuous_usage,
    echo_texts,
    engine_error,
    include_usage,
    output_guide,
    prompt_ids,
    read_bounded,
    sampling_params,
    tools_of,
    truncation_keep,
)
from worker.engine import Engine
from worker.engine_api import RequestOutput
from worker.guided import JSON_KINDS
from worker.kv_pages import EXPORT_PATH
from worker.kv_transfer import KVTransfer
from worker.openai_format import Choice, Responses, TokenNames, event_stream, sse_json
from worker.openai_format import usage as usage_so_far
from worker.ops_api import OpsAPI
from worker.reasoning import SPECIAL_TOKEN_PARSERS, prompt_opens_thinking
from worker.responses_api import ResponsesAPI
from worker.sampling import SamplingParams
from worker.tool_calls import ToolOutput, ToolRequest

log = logging.getLogger("worker.server")
T = TypeVar("T")

MAX_BODY_BYTES = 32 * 1024 * 1024
_POLL_S = 0.5  # while waiting for tokens: how often to check for a gone client or a dead engine
_TICK = object()  # put in a waited-on output queue every _POLL_S (WorkerAPI._tick)
_TAKEN_AT_ONCE = 256  # outputs taken without letting the event loop run other tasks, at most


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + sse_json(obj) + b"\n\n"


async def _client_gone(request: Request, tick: bool = False) -> bool:
    """Has the client disconnected? Asks the server at most once per ``_POLL_S`` per request, or
    at each ``tick`` (the ticker's wake-up, ``_POLL_S`` apart: its own clock runs a little ahead of
    the request's, so the limit would skip every other tick)."""
    now = time.monotonic()
    if not tick and now < getattr(request.state, "disconnect_check_at", 0.0):
        return False
    request.state.disconnect_check_at = now + _POLL_S
    return await request.is_disconnected()


# guide kinds whose whole answer is JSON (a format's, a forced call's): under gpt_oss's parser no harmony
# message, so nothing to split
WHOLE_JSON = frozenset({*JSON_KINDS, "tool_call"})


class WorkerAPI:
    """Routes bound to one engine."""

    def __init__(
        self, engine: Engine, tool_call_parser: str = "hermes", kv: KVTransfer | None = None,
        reasoning_parser: str = "none",
    ) -> None:  # fmt: skip
        self.engine = engine
        self.kv = kv  # fetches a prompt's cached KV from the worker a router names (worker/kv_transfer.py)
        self.tool_call_parser = tool_call_parser  # how `auto` tool calls are read from the text
        self.reasoning = reasoning_parser != "none"  # chat answers' thinking apart (worker/reasoning.py)
        self.reasoning_parser = reasoning_parser
        # gpt-oss: harmony's markers are special tokens, its calls its own messages (no calls grammar)
        self.harmony = reasoning_parser in SPECIAL_TOKEN_PARSERS
        # NOTE: the harmony splitter hands a call on marked for the harmony reader, whatever --tool-call-parser says
        self.call_parser = "harmony" if self.harmony else tool_call_parser
        self._ends = {i: m for m in reasoning.BODY_ENDS if (i := engine.guides.special_id(m)) is not None}
        # harmony's markers by id (those the tokenizer has as special tokens): where a prompt's last message opens
        self._markers = {
            i: m
            for m in (*reasoning.BODY_ENDS, reasoning.MESSAGE)
            if (i := engine.guides.special_id(m)) is not None
        }
        self.name = engine.served_model_name
        self.token_names = TokenNames(engine.tokenizer)
        self.ends_at: float | None = None  # time.monotonic() at which requests in flight end (shutdown)
        self._polled: set[asyncio.Queue] = set()  # output queues being waited on (see _next)
        self._ticker: asyncio.Task | None = None
        self._taken = 0  # outputs _next took without waiting since the loop last ran others

    def prompt_thinks(self, prompt: list[int]) -> bool | None:
        """With --reasoning-parser, whether the chat ``prompt`` opened the thinking (a template that
        starts it itself, as DeepSeek-R1's does); None without the parser, and with gpt_oss's."""
        if not self.reasoning or self.harmony:
            return None  # NOTE: harmony names each message's channel; a grammar constrains the whole answer
        tail = self.engine.tokenizer.decode(prompt[-16:], skip_special_tokens=False)  # type: ignore[call-arg]
        return prompt_opens_thinking(tail)

    def open_header(self, prompt: list[int]) -> str | None:
        """gpt-oss: the header of the message a chat ``prompt`` ends inside (its last marker is a
        <|message|>: an assistant prefill, ``continue_final_message``), from its <|start|> on; else None."""
        for at in range(len(prompt) - 1, -1, -1) if self._markers else ():
            marker = self._markers.get(prompt[at])
            if marker is None:
                continue
            if marker != reasoning.MESSAGE:
                return None
            start = next((i for i in range(at - 1, -1, -1) if self._markers.get(prompt[i]) == "<|start|>"), 0)
            return self.engine.tokenizer.decode(prompt[start:at], skip_special_tokens=False)  # type: ignore[call-arg]
        return None

    def splitter(
        self, thinking: bool | None, calls: bool = True, guide: Any = None, tools: ToolRequest | None = None,
        prompt: list[int] | None = None,
    ) -> reasoning.Splitter | None:  # fmt: skip
        """A chat answer's reasoning splitter (with --reasoning-parser; ``calls``: a tool call reader
        takes its content; ``tools``: the request's; ``prompt``: its ids); None where there is nothing to
        split: without the parser, and with gpt_oss's under a JSON constraint (a forced call, a JSON
        format), whose answer is in no harmony message (it streams as content, not held to its end for a
        marker that cannot come)."""
        if not self.reasoning or (self.harmony and guide is not None and guide.kind in WHOLE_JSON):
            return None
        names = [t["function"]["name"] for t in tools.tools] if tools is not None else []
        opened = self.open_header(prompt) if self.harmony and prompt else None
        return reasoning.splitter(self.reasoning_parser, bool(thinking), self._ends, calls, names, opened)

    def end_requests_at(self, deadline: float) -> None:
        """From ``deadline`` (time.monotonic()) on, every request still in flight is aborted and answered
        with a 503 (an error event in a stream): the process is about to stop serving it."""
        self.ends_at = deadline

    async def while_there(self, request: Request, work: Awaitable[T]) -> T:
        """``work`` (a grammar's compile, a KV fetch) awaited while the client is there: cancelled
        once it has left (asked every ``_POLL_S``), an APIError 499 then. NOTE: a request waiting on
        it is not in ``_next``, and a non-streamed handler is not cancelled when its client goes."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait([task], timeout=_POLL_S))[0]:
                if await _client_gone(request, tick=True):
                    task.cancel()
                    await asyncio.wait([task])  # NOTE: its own cleanup (a fetch's pages) done first
                    if task.cancelled():
                        raise APIError(499, "the client disconnected while its request was prepared")
            return task.result()
        finally:
            task.cancel()  # NOTE: nothing once it is done; else the handler itself was cancelled

    async def _body(self, request: Request) -> dict:
        raw, models = await read_bounded(request, MAX_BODY_BYTES), self.engine.served_models()
        if len(raw) <= PARSE_INLINE_BYTES:
            return check_body(raw, models)
        return await run_in_threadpool(check_body, raw, models)  # NOTE: off the loop the streams share

    def for_model(self, params: SamplingParams, body: dict) -> SamplingParams:
        """``params`` for the body's model: the base, or one of its LoRA adapters."""
        model = body.get("model")
        if model in (None, self.name):
            return params
        # NOTE: adapter ids are positions in adapter_names (+1); an unloaded one keeps its slot
        try:
            adapter = self.engine.adapter_names.index(model) + 1
        except ValueError:  # NOTE: unloaded since the body was checked
            raise APIError(404, f"model {model!r} is not served here", "model_not_found") from None
        return dataclasses.replace(params, adapter=adapter)

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        if body.get("tools"):
            raise APIError(400, "'tools' apply to /v1/chat/completions")
        if body.get("suffix"):  # NOTE: refused, not ignored: the client asked for an insertion
            raise APIError(400, "'suffix' (text to insert the completion before) is not supported")
        # NOTE: the integer 0 only: false and 0.0 equal it, and are refused as any other non-integer
        zero_tokens = type(body.get("max_tokens")) is int and body["max_tokens"] == 0
        if zero_tokens and not body.get("echo"):
            raise APIError(400, "max_tokens 0 needs echo (it scores the prompt and generates nothing)")
        context = self.engine.max_total_tokens
        keep = truncation_keep(body, context)
        try:
            special = prompt_special_tokens(body)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        prompts, cut = await prompt_ids(
            body["prompt"], self.engine.tokenizer, self.engine.vocab_size, context, keep, special
        )
        if len(prompts) * (body.get("n") or 1) > MAX_CHOICES:
            raise APIError(400, f"prompts x n must be at most {MAX_CHOICES}")
        guide = await output_guide(
            body, self.engine.guides, while_there=functools.partial(self.while_there, request)
        )
        # NOTE: echo with max_tokens 0 scores the prompt: one token is generated and not answered
        scoring = body.get("echo") is True and zero_tokens
        fields = {**body, "max_tokens": 1} if scoring else body
        logprobs = body.get("logprobs")
        params = sampling_params(
            fields, self.engine.tokenizer, 16, "max_tokens", logprobs, self.engine.vocab_size, guide
        )
        echo = echo_texts(body["prompt"], prompts, self.engine.tokenizer, cut) if body.get("echo") else None
        if echo is not None and params.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
        params = self.for_model(params, body)
        return await self._generate(request, body, prompts, params, chat=False, echo=echo, scoring=scoring)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        if body.get("echo"):
            raise APIError(400, "'echo' applies to /v1/completions")
        logprobs = chat_logprobs(body)
        tools = tools_of(body)
        context = self.engine.max_total_tokens
        keep = truncation_keep(body, context)
        ids = await chat_ids(
            body.get("messages"), self.engine.tokenizer, tools and tools.tools, body, context, keep
        )
        if not ids:
            raise APIError(400, "the conversation renders to an empty prompt")
        tok, max_tokens = self.engine.tokenizer, self.engine.max_total_tokens
        thinking = self.prompt_thinks(ids)
        guide = await output_guide(body, self.engine.guides, tools, self.tool_call_parser, thinking,
                                   not self.harmony, functools.partial(self.while_there, request))  # fmt: skip
        params = self.for_model(self.reasoning_params(
            sampling_params(body, tok, max_tokens, "max_completion_tokens", logprobs, self.engine.vocab_size,
                            guide)
        ), body)  # fmt: skip
        return await self._generate(
            request, body, [ids], params, chat=True, tools=call_reader(tools, guide), thinking=thinking
        )

    def reasoning_params(self, params: SamplingParams) -> SamplingParams:
        """A chat answer's ``params`` as the reasoning parser reads it: decoded with its special tokens kept
        where they mark the reasoning (gpt-oss's harmony messages; the splitter drops them)."""
        if self.harmony:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    async def _generate(
        self, request: Request, body: dict, prompts: list[list[int]], params: SamplingParams, chat: bool,
        tools: ToolRequest | None = None, echo: list[str] | None = None, scoring: bool = False,
        thinking: bool | None = None,
    ) -> Response:  # fmt: skip
        """Submit n choices per prompt (all sharing one output queue; choice p * n + i is prompt p's
        i-th) and answer: one JSON body once every choice is finished, or a stream of their chunks
        as they come. ``thinking`` (chat with --reasoning-parser, ``prompt_thinks``): each choice's
        thinking is split off its content."""
        n = body.get("n") or 1
        outputs: asyncio.Queue = asyncio.Queue()
        live: dict[int, str] = {}  # choice index -> engine request id, until it finishes
        choices = [Choice(p * n + i, prompt=p) for p in range(len(prompts)) for i in range(n)]
        reader = tools is not None and tools.choice != "none"
        for c in choices:
            if chat:
                c.reasoning = self.splitter(thinking, reader, params.guide, tools, prompts[c.prompt])
            if reader:
                c.tools = ToolOutput(tools, self.call_parser)
            if echo is not None:
                c.echo, c.scoring_only = echo[c.prompt], scoring
                c.prompt_ids = prompts[c.prompt] if params.prompt_logprobs is not None else None
        prompt_tokens = [len(ids) for ids in prompts]
        jobs = [(c.index, prompts[c.prompt], params.for_choice(c.index % n), (id(outputs), c.prompt) if n > 1 else None)
                for c in choices]  # fmt: skip
        first = await self._submit(request, jobs, outputs, live, hold=not body.get("stream"))
        if first is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        resp = Responses(
            rid,
            body.get("model") or self.name,
            chat,
            self.token_names,
            params.logprobs is not None,
            self.engine.simulated,
            prompts if body.get("return_token_ids") is True else None,  # NOTE: vLLM's; checked as a boolean
            body.get("return_tokens_as_token_ids") is True,
        )
        resp.show_reasoning = body.get("include_reasoning") is not False
        if body.get("stream"):
            return event_stream(
                self._stream(
                    request,
                    outputs,
                    live,
                    first,
                    choices,
                    resp,
                    prompt_tokens,
                    include_usage(body),
                    continuous_usage(body),
                )
            )
        out: RequestOutput | None = first
        try:
            while out is not None:
                if out.error is not None:
                    raise APIError(out.error_status or 500, out.error, out.error_code)
                if choices[out.index].collect(out):
                    del live[out.index]
                if not live:
                    answer = resp.whole(choices, prompt_tokens)
                    self.engine.metrics.tool_calls.inc(sum(c.tools.calls for c in choices if c.tools))
                    return _json(answer)
                out = await self._next(request, outputs, live)
            return Response(status_code=499)
        finally:
            self._abort(live)

    async def _submit(
        self, request: Request, jobs: list[tuple[int, list[int], SamplingParams, Any]], outputs: asyncio.Queue,
        live: dict[int, str], hold: bool = False,
    ) -> RequestOutput | None:  # fmt: skip
        """Submit engine requests ``(index, prompt ids, params, prompt group)`` answering on
        ``outputs`` and wait for the first output; None if the client left. A refusal or a first
        output that is an error is an APIError, with every submitted request aborted; so is a client
        that leaves while its prompts' KV is fetched (the fetch stopped, nothing submitted). More choices
        than the worker ever takes at once (its running slots and its queue) is a 400: a 429 would
        have the client retry what never fits. ``hold``: a whole answer (Engine.submit): its first
        output is its last."""
        most = self.engine.max_waiting + self.engine.max_running
        if len(jobs) > most:
            raise APIError(
                400,
                f"this request has {len(jobs)} choices (prompts x n) and this worker takes at most {most} "
                f"requests at once (--max-running plus --max-waiting); send fewer per request",
            )
        source = request.headers.get(KV_SOURCE_HEADER)
        if source and self.kv is not None and self.kv.enabled:
            # NOTE: the n choices of a prompt share its list; prompt logprobs compute the whole
            # prompt (a cached prefix would not be used); LoRA adapters' KV is not moved, nor a
            # salted prompt's (its cache is its salt's own)
            prompts = {id(ids): ids for _, ids, params, _ in jobs
                       if params.adapter == 0 and params.prompt_logprobs is None
                       and params.cache_salt is None}  # fmt: skip
            await self.while_there(request, self.kv.pull(source, list(prompts.values())))
        # NOTE: a client that left while its grammar compiled or its KV came, since it was last asked
        if await _client_gone(request, tick=True):
            return None
        try:
            for index, ids, params, group in jobs:
                live[index] = self.engine.submit(ids, params, outputs, index, group, hold).rid
            first = await self._next(request, outputs, live)
        except BaseException as exc:
            self._abort(live)
            error = engine_error(exc)
            if error is not None:
                raise error from None
            raise
        if first is not None and first.error is not None:
            self._abort(live)
            raise APIError(first.error_status or 500, first.error, first.error_code)
        guide = jobs[0][2].guide
        if guide is not None:
            self.engine.metrics.constrained.labels(guide.kind).inc()
        return first

    def _abort(self, live: dict[int, str]) -> None:
        """Cancel the choices still running (client gone, or another choice failed)."""
        for rid in live.values():
            self.engine.abort(rid)
        live.clear()

    async def _next(
        self, request: Request, outputs: asyncio.Queue, live: dict[int, str]
    ) -> RequestOutput | None:
        """The next output of any live choice; None (and the choices aborted) if the client went away."""
        while True:
            # NOTE: an output already queued is taken at once; an empty queue is waited on without a timeout
            # of its own (asyncio.wait_for makes a Task per call, and a stream waits once per token): the
            # ticker puts _TICK in every queue waited on, every _POLL_S
            try:
                out = outputs.get_nowait()
            except asyncio.QueueEmpty:
                self._polled.add(outputs)
                if self._ticker is None:
                    self._ticker = asyncio.get_running_loop().create_task(self._tick())
                try:
                    out = await outputs.get()
                finally:
                    self._polled.discard(outputs)
                self._taken = 0
            else:
                self._taken += 1
                if self._taken >= _TAKEN_AT_ONCE:  # NOTE: a whole answer's outputs come at once (hold)
                    self._taken = 0
                    await asyncio.sleep(0)  # the loop serves the others between
            tick = out is _TICK
            if tick:
                out = None
            # NOTE: asked by the clock, not only when outputs stop: a decoding request has one every
            # step, and a non-streamed answer writes nothing that would fail on a closed socket
            if await _client_gone(request, tick):
                self._abort(live)
                return None
            if self.ends_at is not None and time.monotonic() >= self.ends_at:
                self._abort(live)
                return RequestOutput(finish_reason="error", error="the worker is shutting down",
                                     error_status=503, error_code="shutting_down")  # fmt: skip
            if out is not None:
                return out
            if not self.engine.alive:
                return RequestOutput(finish_reason="error", error="engine stopped", error_status=503)

    async def _tick(self) -> None:
        """Wake every reader waiting for outputs once per _POLL_S (its checks: client gone, shutdown);
        ends once nobody waits."""
        try:
            while self._polled:
                await asyncio.sleep(_POLL_S)
                for q in list(self._polled):
                    if q.empty():
                        q.put_nowait(_TICK)
        finally:
            self._ticker = None

    async def _stream(
        self,
        request: Request,
        outputs: asyncio.Queue,
        live: dict[int, str],
        first: RequestOutput,
        choices: list[Choice],
        resp: Responses,
        prompt_tokens: list[int],
        usage: bool,
        continuous: bool = False,
    ) -> AsyncIterator[bytes]:
        out: RequestOutput | None = first

        def send(chunk: dict) -> bytes:  # NOTE: continuous_usage_stats: every chunk with the usage so far
            if continuous:
                chunk["usage"] = usage_so_far(prompt_tokens, choices)
            return _sse(chunk)

        # NOTE: the events of the outputs already queued go out in one write (one body message, one
        # syscall); a loop that keeps up still sends each token as it comes
        buf: list[bytes] = []
        try:
            if resp.chat:
                for c in choices:
                    buf.append(send(resp.role_chunk(c.index, c.tools is not None and c.tools.forced)))
            while out is not None:
                if out.error is not None:
                    error = error_payload(
                        out.error_status or 500, out.error, out.error_code or "internal_error"
                    )
                    buf += (_sse(error), b"data: [DONE]\n\n")
                    break
                c = choices[out.index]
                if c.add(out):
                    del live[out.index]
                if c.tools is not None:
                    for chunk in resp.tool_chunks(c, out.text, out.finish_reason):
                        buf.append(send(chunk))
                elif (text := c.visible(out)) and (chunk := resp.chunk(c, text)) is not None:
                    buf.append(send(chunk))
                if out.finish_reason is not None:
                    if c.tools is None:
                        buf.append(send(resp.chunk(c, "", out.finish_reason)))  # type: ignore[arg-type]
                    else:
                        self.engine.metrics.tool_calls.inc(c.tools.calls)
                    if not live:
                        if usage:
                            buf.append(send(resp.usage_chunk(choices, prompt_tokens)))
                        buf.append(b"data: [DONE]\n\n")
                        break
                if buf and outputs.empty():
                    data = b"".join(buf)
                    buf.clear()
                    yield data
                out = await self._next(request, outputs, live)
            if buf:
                yield b"".join(buf)
        finally:
            self._abort(live)  # NOTE: client gone, stream cancelled or a choice failed: free pages now

    async def tokenize(self, request: Request) -> Response:
        """``prompt`` (as /v1/completions tokenizes it) or ``messages`` (rendered as chat does)."""
        body = await self._body(request)
        tok = self.engine.tokenizer
        if "messages" in body:
            ids = await chat_ids(body["messages"], tok, body.get("tools"), body)
        elif isinstance(body.get("prompt"), str):
            try:
                encode = tok.encode_prompt if prompt_special_tokens(body) else tok.encode_text
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
            ids = await run_in_threadpool(encode, body["prompt"])
        else:
            raise APIError(400, "'prompt' (a string) or 'messages' is required")
        return _json({"count": len(ids), "max_model_len": self.engine.max_total_tokens, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await self._body(request)
        ids, tok = body.get("tokens"), self.engine.tokenizer
        vocab = max(tok.vocab_size, self.engine.vocab_size)  # NOTE: a padded embedding's ids read as ""
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})")
        # NOTE: special tokens kept: the text /tokenize counted (a chat prompt's markers)
        return _json({"prompt": await run_in_threadpool(tok.decode, ids, skip_special_tokens=False)})


def create_app(
    engine: Engine, admin_token: str | None = None, max_stored_responses: int = 1024,
    tool_call_parser: str = "hermes", api_key: str | None = None, kv_transfer_max_mib: int = 1024,
    kv_fetch_timeout_s: float = 5.0, kv_link_ms_per_token: float = 0.0, kv_transfer_max_wait_ms: float = 200.0,
    reasoning_parser: str = "none", kv_hints: str = "keyed", max_stored_responses_mib: int = 1024,
    body_timeout_s: float = 30.0,
) -> Starlette:  # fmt: skip
    """The worker app; its lifespan starts the engine (if not started) and stops it. With
    ``api_key`` every endpoint but /health and /metrics (probes, scrapers) needs it. ``kv_hints``
    (--kv-hints): who may name a KV source. ``body_timeout_s``: a request's body must have arrived
    within it (else 408), as the router's own setting of that name."""
    kv = KVTransfer(engine, api_key, kv_transfer_max_mib << 20, kv_fetch_timeout_s, kv_link_ms_per_token,
                    kv_transfer_max_wait_ms / 1e3)  # fmt: skip
    # NOTE: a hint names where this worker's cache gets KV from: keyed, only from holders of the fleet's key
    hints = kv_hints == "any" or (kv_hints == "keyed" and bool(api_key))
    api = WorkerAPI(engine, tool_call_parser, kv if hints else None, reasoning_parser)
    ops = OpsAPI(engine, admin_token)
    responses = ResponsesAPI(api, max_stored_responses, max_stored_responses_mib << 20)
    keys = APIKeys([api_key] if api_key else [])

    def guarded(handler: Any, open_: bool = False) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                if not open_:
                    keys.check(request.headers.get("authorization"))
                return await handler(request)
            except RouterError as exc:  # the key check
                return error_response(exc.status, exc.message, exc.code)
            except APIError as exc:  # NOTE: %r: the message may quote the request (no forged log lines)
                log.info("%s %s -> %d: %r", request.method, request.url.path, exc.status, exc.message)
                retry = QUEUE_FULL_RETRY_AFTER_S if exc.code == "queue_full" else None
                return error_response(exc.status, exc.message, exc.code, retry)
            except Exception:  # a bug must not take the worker down: answer 500 and log it
                log.exception("%s %s failed", request.method, request.url.path)
                return error_response(500, "internal error", "internal_error")

        return endpoint

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        try:
            yield
        finally:
            await kv.close()
            await run_in_threadpool(engine.stop)

    routes = [
        Route("/v1/completions", guarded(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(api.chat), methods=["POST"]),
        Route("/v1/responses", guarded(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", guarded(responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}/input_items", guarded(responses.input_items), methods=["GET"]),
        Route("/v1/responses/{response_id}", guarded(responses.delete), methods=["DELETE"]),
        Route("/v1/models", guarded(ops.models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(ops.model), methods=["GET"]),
        Route("/tokenize", guarded(api.tokenize), methods=["POST"]),
        Route("/detokenize", guarded(api.detokenize), methods=["POST"]),
        Route("/health", guarded(ops.health, open_=True), methods=["GET"]),
        Route("/metrics", guarded(ops.metrics, open_=True), methods=["GET"]),
        Route("/v1/cache/info", guarded(ops.cache_info), methods=["GET"]),
        Route("/v1/cache/flush", guarded(ops.cache_flush), methods=["POST"]),
        Route("/v1/load_lora_adapter", guarded(ops.load_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", guarded(ops.unload_adapter), methods=["POST"]),
        Route("/v1/cache/snapshot", guarded(ops.cache_snapshot), methods=["GET"]),
        Route("/v1/cache/events", guarded(ops.cache_events), methods=["GET"]),
        Route(EXPORT_PATH, guarded(kv.export), methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=HTTP_ERROR_HANDLERS,
        middleware=[Middleware(RequestId)],
    )
    app.state.kv_transfer = kv
    app.state.body_timeout_s = body_timeout_s  # NOTE: read by api_params.read_bounded
    app.state.api = api  # NOTE: python -m worker ends requests in flight as its shutdown timeout ends
    app.state.kv_publisher = engine.publisher  # NOTE: python -m worker ends its event streams at shutdown
    return app
