"""``/v1/responses`` on the worker: OpenAI's Responses API for text (create, stream, retrieve,
delete). Stored conversations live in a bounded LRU on this worker only; their ids carry this
worker's tag (router.responses_input) so that any router sends a ``previous_response_id`` here,
where both the conversation and its KV cache are. Never blocks the engine; bad input is a 4xx."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from router.responses_input import (
    chat_tool_choice,
    chat_tools,
    input_messages,
    new_response_id,
    prompt_messages,
    template_options,
    worker_tag,
)
from worker.api_params import APIError, call_reader, chat_ids, output_guide, sampling_params, tools_of
from worker.engine_api import RequestOutput
from worker.guided import CONSTRAINT_KEYS
from worker.openai_format import event_stream, logprob_entry
from worker.reasoning import Splitter
from worker.responses_output import Events, OutputItems
from worker.tool_calls import ToolOutput

if TYPE_CHECKING:  # pragma: no cover - typing only
    from worker.server import WorkerAPI


@dataclass
class StoredResponse:
    messages: list[dict[str, Any]] | None  # the conversation so far, without instructions (None: in progress)
    response: dict  # the response object, as GET returns it
    size: int = 0  # bytes it stands for (its JSON's), against the store's bound
    # this turn's input, as GET .../input_items lists it
    input_items: list[dict] = field(default_factory=list)


class ResponseStore:
    """Stored responses by id, least recently used dropped beyond ``max_entries`` or ``max_bytes`` (their
    sizes in all; one larger than the bound is not kept); responses being generated apart (they count
    against no bound and push no finished one out)."""

    def __init__(self, max_entries: int, max_bytes: int = 1 << 30) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0  # the stored entries' sizes, in all
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._pending: dict[str, StoredResponse] = {}  # being generated: what GET answers (messages None)
        self._deleted: set[str] = set()  # of those, deleted meanwhile: not stored when they end

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, entry: StoredResponse) -> None:
        if self.max_entries <= 0 or entry.size > self.max_bytes:
            return
        old = self._entries.pop(rid, None)
        self.bytes += entry.size - (old.size if old else 0)
        self._entries[rid] = entry
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= self._entries.popitem(last=False)[1].size

    def begin(self, rid: str, response: dict, input_items: list[dict] | None = None) -> None:
        """A response being generated: GET answers it ``in_progress``, a follow-up is refused."""
        self._pending[rid] = StoredResponse(None, response, 0, input_items or [])

    def finish(self, rid: str, entry: StoredResponse) -> None:
        """The finished response, unless it was deleted while it was generated."""
        self._pending.pop(rid, None)
        if rid in self._deleted:
            self._deleted.discard(rid)
            return
        self.put(rid, entry)

    def abandon(self, rid: str) -> None:
        """A response that never finished (the client left, it failed): no longer in progress."""
        self._pending.pop(rid, None)
        self._deleted.discard(rid)

    def get(self, rid: str) -> StoredResponse | None:
        """A stored response, or one being generated (``messages`` None)."""
        pending = self._pending.get(rid)
        if pending is not None:
            return pending
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        if self._pending.pop(rid, None) is not None:  # NOTE: being generated: not stored when it ends
            self._deleted.add(rid)
            return True
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _logprobs(body: dict, tools: Any) -> int | None:
    """The alternatives per token (``top_logprobs``, 0-20) when ``include`` asks for
    ``message.output_text.logprobs``, else None."""
    include, top = body.get("include") or [], body.get("top_logprobs")
    if not isinstance(include, list) or any(i != LOGPROBS_INCLUDE for i in include):
        raise APIError(400, f"'include' supports only {LOGPROBS_INCLUDE!r}")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):
        raise APIError(400, "'top_logprobs' must be an integer in [0, 20]")
    if LOGPROBS_INCLUDE not in include:
        return None
    if tools is not None and tools.choice != "none":
        raise APIError(400, "output logprobs are not available with tools")
    return top or 0


def _chat_format(fmt: Any) -> Any:
    """The Responses API's ``text.format`` (json_schema fields inline) as chat's ``response_format``."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


async def _fitted(
    messages: list[dict], kept: int, tokenizer: Any, tools: list[dict] | None, context: int,
    options: dict | None = None,
) -> list[int]:  # fmt: skip
    """``truncation: auto``: the prompt with the fewest of the oldest turns after the first ``kept``
    messages (the instructions) dropped that fits the context; with only the last message left and
    still too long, that prompt (the engine refuses it as too long). What is kept starts at a user
    message, a turn's start (templates that check the roles alternate refuse an assistant reply
    first), where one is left; else at a message that is not a tool result (it goes with its call)."""
    rest = messages[kept:]
    users = [i for i, m in enumerate(rest) if m["role"] == "user"]

    def without(k: int) -> list[dict]:
        turn = next((i for i in users if i >= k), None)
        if turn is not None:
            while turn > k and rest[turn - 1]["role"] in ("system", "developer"):  # NOTE: instructions
                turn -= 1  # given mid-conversation lead into the turn: not part of the dropped answer
            return messages[:kept] + rest[turn:]
        while k < len(rest) - 1 and rest[k]["role"] == "tool":
            k += 1
        return messages[:kept] + rest[k:]

    lo, hi, best, step = 1, len(rest) - 1, None, 1
    while lo <= hi:  # NOTE: each render is a tokenization: O(log n) of them, not one per message
        # NOTE: galloping back from the newest message (1, 3, 7, ... kept) until a render does not fit,
        # then a bisection: renders about the context's size, however long the conversation
        mid = max(lo, hi + 1 - step) if lo == 1 else (lo + hi) // 2
        ids = await chat_ids(without(mid), tokenizer, tools, options)
        if len(ids) < context:
            best, hi, step = ids, mid - 1, 2 * step
        else:
            lo = mid + 1
    return best if best is not None else await chat_ids(without(len(rest) - 1), tokenizer, tools, options)


def _check_metadata(metadata: Any) -> None:
    """OpenAI's limits on `metadata`: at most 16 pairs, keys up to 64 characters, string values up
    to 512; it is echoed back in the response object, so clients parse it as such a map."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise APIError(400, "'metadata' must be an object of at most 16 string pairs")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise APIError(400, f"'metadata' entry {key[:64]!r}: keys up to 64 characters, "
                           "values strings up to 512")  # fmt: skip


_ITEM_ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
}


def listed_input_items(input_: Any) -> list[dict]:
    """``input`` (checked already) as GET .../input_items lists it: a string as one user message, each
    item with its type, its id (the client's, or one made here) and a status; a message's text as parts
    (``input_text``, or ``output_text`` with its annotations for the assistant's), a reasoning item with
    its summary."""
    if isinstance(input_, str):
        input_ = [{"role": "user", "content": input_}]
    items = []
    for item in input_:
        kind = item.get("type", "message")
        out = {**item, "type": kind}
        if not isinstance(out.get("id"), str) or not out["id"]:
            out["id"] = _ITEM_ID_PREFIXES[kind] + uuid.uuid4().hex
        if out.get("status") not in ("in_progress", "completed", "incomplete"):
            out["status"] = "completed"
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = out.get("content")
            parts = [{"type": part, "text": content}] if isinstance(content, str) else content
            out["content"] = [{**p, "annotations": p.get("annotations", [])} if p.get("type") == "output_text" else p
                              for p in parts]  # fmt: skip
        elif kind == "reasoning":
            out.setdefault("summary", [])
        items.append(out)
    return items


def _not_found(rid: Any) -> APIError:
    return APIError(404, f"response {rid!r} not found on this worker", "response_not_found")


class ResponsesAPI:
    """The endpoints, bound to one worker's API object (engine, tokenizer, disconnect polling)."""

    def __init__(self, api: WorkerAPI, max_stored: int, max_stored_bytes: int = 1 << 30) -> None:
        self.api = api
        self.store = ResponseStore(max_stored, max_stored_bytes)
        self.tag = worker_tag(api.engine.publisher.worker)  # NOTE: the URL routers know it by

    # ------------------------------------------------------------------ create
    async def create(self, request: Request) -> Response:
        api = self.api
        body = await api._body(request)
        try:
            chat_form = {"tools": chat_tools(body.get("tools")), "tool_choice": chat_tool_choice(body.get("tool_choice")),
                         "parallel_tool_calls": body.get("parallel_tool_calls", True)}  # fmt: skip
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        tools = tools_of(chat_form)
        text = body.get("text")
        if text is not None and not isinstance(text, dict):
            raise APIError(400, "'text' must be an object such as {'format': {'type': 'json_schema', ...}}")
        text_format = (text or {}).get("format")
        if text_format is not None and (
            not isinstance(text_format, dict)
            or text_format.get("type") not in ("text", "json_object", "json_schema")
        ):
            raise APIError(400, "'text.format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
        # NOTE: a json_schema format needs its name and its schema, as OpenAI's
        if text_format is not None and text_format["type"] == "json_schema":
            if not isinstance(text_format.get("name"), str) or not text_format["name"]:
                raise APIError(400, "'text.format.name' is required: the schema's name (a string)",
                               "missing_required_parameter")  # fmt: skip
            if not isinstance(text_format.get("schema"), dict):
                raise APIError(400, "'text.format.schema' is required: a JSON Schema object",
                               "missing_required_parameter")  # fmt: skip
        stray = sorted(k for k in CONSTRAINT_KEYS if body.get(k) is not None)
        if stray:  # NOTE: chat's spellings, refused rather than ignored (OpenAI: an unknown parameter)
            raise APIError(400, f"{stray[0]!r} does not apply to /v1/responses: an output's format is "
                           "'text': {'format': {'type': 'json_schema', ...}}", "unknown_parameter")  # fmt: skip
        fmt = {"response_format": _chat_format(text_format)}
        store = True if body.get("store") is None else body["store"]
        if not isinstance(store, bool):
            raise APIError(400, "'store' must be a boolean")
        store = store and self.store.max_entries > 0  # NOTE: --max-stored-responses 0 keeps none: said so
        truncation = body.get("truncation") or "disabled"
        if truncation not in ("disabled", "auto"):
            raise APIError(400, f"'truncation' must be 'auto' or 'disabled', got {truncation!r}")
        _check_metadata(body.get("metadata"))
        if not isinstance(body.get("reasoning"), (dict, type(None))):
            raise APIError(400, "'reasoning' must be an object such as {'effort': 'low'}")
        if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
            raise APIError(400, "'n' and 'best_of' are not supported here: a response has one output")
        for name in ("conversation", "prompt", "background"):  # NOTE: refused, not silently dropped
            if body.get(name) not in (None, False):
                raise APIError(400, f"'{name}' is not supported: send the input itself (previous_response_id "
                               "chains a conversation)")  # fmt: skip
        history: list[dict[str, str]] = []
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):  # NOTE: bad input, as the router says
            raise APIError(400, "'previous_response_id' must be a string", "invalid_type")
        if previous is not None:
            entry = self.store.get(previous)
            if entry is None:
                raise _not_found(previous)
            if entry.messages is None:
                raise APIError(400, f"response {previous!r} is still in progress: follow it up once it is done",
                               "response_in_progress")  # fmt: skip
            if entry.response["status"] == "failed":
                raise APIError(400, f"response {previous!r} failed: follow up the one before it, or send the "
                               "conversation again", "response_failed")  # fmt: skip
            history = entry.messages
        try:
            messages = prompt_messages(body.get("instructions"), history, body.get("input"))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        engine = api.engine
        options = template_options(body)
        # NOTE: without truncation a conversation surely past the context is refused before it is tokenized
        context = engine.max_total_tokens if truncation == "disabled" else None
        ids = await chat_ids(messages, engine.tokenizer, tools and tools.tools, options, context)
        if truncation == "auto" and len(ids) >= engine.max_total_tokens:
            kept = 1 if body.get("instructions") else 0
            ids = await _fitted(
                messages, kept, engine.tokenizer, tools and tools.tools, engine.max_total_tokens, options
            )
        logprobs = _logprobs(body, tools)
        thinking = api.prompt_thinks(ids)
        guide = await output_guide(fmt, api.engine.guides, tools, api.tool_call_parser, thinking,
                                   not api.harmony, functools.partial(api.while_there, request))  # fmt: skip
        params = sampling_params(body, engine.tokenizer, engine.max_total_tokens, "max_output_tokens", logprobs,
                                 engine.vocab_size, guide)  # fmt: skip
        params = api.for_model(api.reasoning_params(params), body)
        outputs: asyncio.Queue = asyncio.Queue()
        live: dict[int, str] = {}
        first = await api._submit(
            request, [(0, ids, params, None)], outputs, live, hold=not body.get("stream")
        )
        if first is None:
            return Response(status_code=499)
        conversation = history + input_messages(body["input"])
        reads = call_reader(tools, guide)
        reader = ToolOutput(reads, api.call_parser) if reads is not None else None
        rid = new_response_id(self.tag)
        turn = _Turn(self, body, rid, len(ids), conversation, store, reader, logprobs is not None,
                     api.splitter(thinking, reader is not None, params.guide, tools, ids))  # fmt: skip
        if store:
            self.store.begin(rid, turn.response("in_progress"), turn.input_items)
        if body.get("stream"):
            return event_stream(self._stream(request, outputs, live, first, turn))
        out: RequestOutput | None = first
        try:
            while out is not None:
                if out.error is not None:
                    raise APIError(out.error_status or 500, out.error, out.error_code)
                turn.add(out)
                if out.finish_reason is not None:
                    live.clear()
                    return Response(orjson.dumps(turn.finish()[0]), media_type="application/json")
                out = await api._next(request, outputs, live)
            return Response(status_code=499)
        finally:
            api._abort(live)
            turn.end()

    async def _stream(
        self,
        request: Request,
        outputs: asyncio.Queue,
        live: dict[int, str],
        first: RequestOutput,
        turn: _Turn,
    ) -> AsyncIterator[bytes]:
        events = turn.events
        out: RequestOutput | None = first
        try:
            yield events.send("response.created", response=turn.response("in_progress"))
            yield events.send("response.in_progress", response=turn.response("in_progress"))
            if (
                turn.reader is None and turn.thinking is None
            ):  # plain text: the message opens at once, as OpenAI's does
                for event in turn.items.open_message():
                    yield event
            while out is not None:
                if out.error is not None:  # NOTE: as OpenAI's: the open item closed, then response.failed
                    for event in turn.fail(out.error_status or 500, out.error_code, out.error):
                        yield event
                    break
                for event in turn.add(out):
                    yield event
                if out.finish_reason is not None:
                    live.clear()
                    final, closing = turn.finish()
                    for event in closing:
                        yield event
                    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                    yield events.send(kind, response=final)
                    break
                out = await self.api._next(request, outputs, live)
        finally:
            self.api._abort(live)  # NOTE: client gone or failed: free the request's pages now
            turn.end()

    # ------------------------------------------------------------------ retrieve, delete
    async def retrieve(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        entry = self.store.get(rid)
        if entry is None:
            raise _not_found(rid)
        return Response(orjson.dumps(entry.response), media_type="application/json")

    async def input_items(self, request: Request) -> Response:
        """GET /v1/responses/{id}/input_items: the input items of that response (this turn's, as OpenAI
        lists them), a page at a time: ``limit`` (1-100, default 20), ``order`` (``desc``, the default, or
        ``asc``), ``after`` (an item id: the items that follow it in that order)."""
        rid = request.path_params["response_id"]
        entry = self.store.get(rid)
        if entry is None:
            raise _not_found(rid)
        query = request.query_params
        unknown = sorted(set(query) - {"limit", "order", "after", "include"})
        if unknown:
            raise APIError(
                400, f"unknown query parameter {unknown[0]!r}: limit, order and after are supported"
            )
        if query.getlist("include"):  # NOTE: images' URLs and the like: this worker's input is text
            raise APIError(400, "'include' is not supported here: the input items are text, listed whole")
        limit = query.get("limit", "20")
        if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= 100):
            raise APIError(400, f"'limit' must be an integer in [1, 100], got {limit!r}")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"'order' must be 'asc' or 'desc', got {order!r}")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        after = query.get("after")
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise APIError(400, f"response {rid!r} has no input item {after!r}")
            items = items[at + 1 :]
        page = items[: int(limit)]
        body = {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}  # fmt: skip
        return Response(orjson.dumps(body), media_type="application/json")

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if not self.store.delete(rid):
            raise _not_found(rid)
        return Response(
            orjson.dumps({"id": rid, "object": "response", "deleted": True}), media_type="application/json"
        )


class _Turn:
    """One response as it is generated: its output items, counts and the objects the API returns."""

    def __init__(
        self, endpoint: ResponsesAPI, body: dict, rid: str, prompt_tokens: int, messages: list, store: bool,
        reader: ToolOutput | None = None, logprobs: bool = False, thinking: Splitter | None = None,
    ) -> None:  # fmt: skip
        self.endpoint, self.body, self.rid, self.store = endpoint, body, rid, store
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.messages = messages  # earlier turns + this input, without instructions
        self.input_items = listed_input_items(body.get("input") or [])
        self.reader = reader  # with tools: reads calls out of the text
        self.thinking = thinking  # with --reasoning-parser: the thinking apart, as a reasoning item
        self.output_tokens = self.cached_tokens = self.cache_written = 0
        self.finish_reason: str | None = None
        self.events = Events()
        self.items = OutputItems(self.events, logprobs)
        self.finished = False
        self._logprobs: list[dict] = []  # entries of the answer's tokens whose text is not out yet
        self._unsure = 0  # of those, the first ones, not known as the answer's yet (it may think first)

    def add(self, out: RequestOutput) -> list[bytes]:
        """Account one engine output; the stream events for its text."""
        self.output_tokens, self.cached_tokens = out.completion_tokens, out.cached_tokens
        self.cache_written = out.cache_written_tokens
        self.finish_reason = out.finish_reason or self.finish_reason
        # NOTE: with a reasoning parser the output text's logprobs are its answer's tokens only, not
        # the thinking's or harmony's headers and markers (the splitter judges a token by its own text)
        answer = True if self.thinking is None else self.thinking.count(out.token_ids, out.own_text())
        if out.logprobs is not None and answer is not False:
            self._logprobs.append(
                logprob_entry(self.endpoint.api.token_names, (out.token_ids[0], out.logprobs))
            )
            self._unsure += answer is None
        text, deltas = out.text, []
        if self.thinking is not None:
            thought, text = self.thinking.take(text, out.finish_reason is not None)
            deltas = [{"reasoning": thought}] if thought else []
            if self._unsure and self.thinking.is_answer() is not None:  # NOTE: known now: the answer's
                # first tokens (no text came while unknown) were the thinking's (or a header) if it opened with them
                if not self.thinking.lead_was_answer():
                    del self._logprobs[: self._unsure]
                self._unsure = 0
        if self.reader is None:
            deltas += [{"content": text, "logprobs": self._logprobs}] if text else []
            self._logprobs = [] if text else self._logprobs  # NOTE: held-back text keeps its numbers
        else:
            deltas += self.reader.feed(text) + (self.reader.flush() if out.finish_reason else [])
        events = [event for d in deltas for event in self.items.delta(d)]
        if out.finish_reason is not None and self._logprobs:  # tokens of no text (a stop string's)
            events += self.items.add_logprobs(self._logprobs)
            self._logprobs = []
        return events

    def end(self) -> None:
        """The request is over: a response that did not finish is no longer in progress."""
        if self.store and not self.finished:
            self.endpoint.store.abandon(self.rid)

    def response(
        self, status: str, output: list | None = None, usage: dict | None = None, error: dict | None = None
    ) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": incomplete, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": body.get("model") or self.endpoint.api.name,
            "output": output or [], "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"), "store": self.store,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "truncation": body.get("truncation") or "disabled", "usage": usage,
            "metadata": body.get("metadata") or {}, "reasoning": body.get("reasoning"),
            **({"simulated": True} if self.endpoint.api.engine.simulated else {}),
        }  # fmt: skip

    def fail(self, status: int, code: str | None, message: str) -> list[bytes]:
        """A stream's generation failed after its head: the open item closed ``incomplete`` and
        ``response.failed`` (its ``error`` one of OpenAI's codes, ours its ``type``); GET then answers
        the failed response (stored unless the client said not to), which no follow-up continues."""
        closing = self.items.close("incomplete", empty_message=False)
        error = {"code": "server_error" if status >= 500 else "invalid_prompt", "message": message,
                 "type": code or ("server_error" if status >= 500 else "invalid_request_error"), "param": None}  # fmt: skip
        final = self.response("failed", self.items.items, self._usage(), error)
        if self.store:
            size = sum(len(orjson.dumps(x)) for x in (self.messages, final, self.input_items))
            self.endpoint.store.finish(self.rid, StoredResponse(self.messages, final, size, self.input_items))
        self.finished = True
        return [*closing, self.events.send("response.failed", response=final)]

    def _usage(self) -> dict:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": self.cache_written,  # OpenAI's: what the prefill added to the cache
            },
            "output_tokens": self.output_tokens,
            "output_tokens_details": {
                "reasoning_tokens": self.thinking.reasoning_tokens if self.thinking else 0
            },
            "total_tokens": self.prompt_tokens + self.output_tokens,
        }

    def finish(self) -> tuple[dict, list[bytes]]:
        """The finished response object (stored with the conversation unless the client said not
        to) and the events that close its items."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        closing = self.items.close(status)
        final = self.response(status, self.items.items, self._usage())
        if self.reader is not None:
            self.endpoint.api.engine.metrics.tool_calls.inc(self.reader.calls)
        if self.store:
            conversation = [*self.messages, self.items.assistant_message()]
            # NOTE: its JSON's size (the history a follow-up shares counts in each: bounded alike)
            size = sum(len(orjson.dumps(x)) for x in (conversation, final, self.input_items))
            self.endpoint.store.finish(self.rid, StoredResponse(conversation, final, size, self.input_items))
        self.finished = True
        return final, closing
