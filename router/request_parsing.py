"""Reading and validating OpenAI request bodies: what the router needs, nothing more.

Bad input raises RouterError (an OpenAI-shaped 4xx); workers validate sampling parameters."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mmh3
import orjson
from starlette.requests import Request

from router.block_hash import CACHE_SALT_ERROR, valid_cache_salt
from router.errors import RouterError
from router.responses_input import TEXT_PARTS, chat_tools, prompt_messages, template_options
from router.tokenization import ByteTokenizer, ChatTemplateError, PromptTokenizer, chat_options


class ClientGone(Exception):
    """The client disconnected before the answer was complete."""


@dataclass(slots=True)
class ParsedRequest:
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool
    token_ids: Sequence[int]  # bytes for the bytes tokenizer (one id per byte), else a list
    sequences: int = 1  # sequences the worker will run: n x prompts (a batch), for the load count
    other_prompt_tokens: int = 0  # a batch's prompts after the first (routed by the first), counted uncached
    # /v1/responses only: a follow-up (previous_response_id: its worker holds the history), what
    # affinity rules read (the prompt as chat messages), and that streams carry usage unasked
    follow_up: bool = False
    affinity_body: dict[str, Any] | None = None
    usage_in_stream: bool = False
    # /v1/completions with echo + logprobs: the worker computes the whole prompt (a cached prefix
    # has no logits), so no prefix match saves anything: routed by load, all of it counted as prefill
    full_prefill: bool = False
    cache_salt: str | None = None  # vLLM's: the prompt's prefixes are this salt's own (block_hash.salted)
    # tokens of the longest prompt, which a worker's context must hold; None: the worker cuts the
    # prompt to fit (truncate_prompt_tokens -1, the Responses API's truncation: auto)
    fit_tokens: int | None = None
    # the worker cuts the prompt when its context cannot hold it (its end, or its newest turns, kept):
    # then none of the prompt's prefix is what that worker computes
    cut_to_fit: bool = False


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """``read_asgi_body`` for a Starlette request (the admin and debug endpoints)."""
    return await read_asgi_body(request.receive, request.headers.get("content-length"), limit, timeout)


async def read_asgi_body(
    receive: Callable[[], Awaitable[dict]], declared: str | None, limit: int, timeout: float | None = None
) -> bytes:
    """The body from raw ASGI ``receive``, refusing (413) more than ``limit`` bytes without
    reading them all, and (408) one not all arrived within ``timeout`` seconds (a client trickling
    its body holds a connection and a file descriptor). Raises ClientGone if the client disconnects
    mid-body."""
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise RouterError(413, f"request body exceeds {limit} bytes", "body_too_large")
    try:
        async with asyncio.timeout(timeout):
            return await _read_asgi_body(receive, limit)
    except TimeoutError:
        raise RouterError(
            408, f"the request body did not arrive within {timeout:g} s", "body_timeout"
        ) from None


async def _read_asgi_body(receive: Callable[[], Awaitable[dict]], limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RouterError(413, f"request body exceeds {limit} bytes", "body_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# Arrays and objects nested in a request body, at most. JSON schemas, tools and content parts go
# through code that recurses per level (schema checks, the chat template's JSON, orjson.dumps, whose
# own bound is ~254), so a body past this is refused whole, not failed deep inside (a 500).
MAX_JSON_DEPTH = 128
JSON_DEPTH_ERROR = f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
# A larger body is parsed (and tokenized) in a thread: megabytes of JSON take long enough on the
# event loop to stall every other request's stream.
PARSE_INLINE_BYTES = 64 * 1024


def too_deep(raw: bytes, body: Any) -> bool:
    """Does the parsed ``body`` nest arrays and objects past MAX_JSON_DEPTH levels? ``raw``, its
    bytes, rules most bodies out at once: fewer opening brackets than the bound, not that deep.
    Else one level at a time: no object is kept per value (a tuple each, for a body of a million
    values, woke the garbage collector over all of them: 2.5x slower)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    level: list = [body]
    for _ in range(MAX_JSON_DEPTH):
        below: list = []
        for value in level:
            for child in value.values() if isinstance(value, dict) else value:
                if isinstance(child, (dict, list)):
                    below.append(child)
        if not below:
            return False
        level = below
    return True


def _common_fields(raw: bytes) -> tuple[dict[str, Any], str | None, bool]:
    """The JSON object body, its ``model`` and ``stream``, checked."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object", "invalid_request")
    if too_deep(raw, body):
        raise RouterError(400, JSON_DEPTH_ERROR, "invalid_request")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RouterError(400, "'model' must be a string", "invalid_type")
    stream = body.get("stream")  # NOTE: null is no stream, as OpenAI and the worker read it
    if stream is not None and not isinstance(stream, bool):
        raise RouterError(400, "'stream' must be a boolean", "invalid_type")
    if not valid_cache_salt(body.get("cache_salt")):
        raise RouterError(400, CACHE_SALT_ERROR, "invalid_type")
    return body, model, bool(stream)


STREAM_OPTIONS_ERROR = (
    "'stream_options' must be an object with a boolean 'include_usage' (and vLLM's 'continuous_usage_stats')"
)
STREAM_OPTIONS_NO_STREAM = "'stream_options' is only allowed when 'stream' is true"


def stream_options_error(body: dict[str, Any]) -> tuple[str, str | None] | None:
    """What is wrong with the ``stream_options`` of a chat or completion request, if anything (the
    message, the error code): it is null, or an object whose ``include_usage`` and
    ``continuous_usage_stats`` are booleans, null or absent, sent with ``stream: true`` (OpenAI
    refuses it on a request that does not stream). One rule for the router and the worker."""
    options = body.get("stream_options")
    if options is None:
        return None
    if not isinstance(options, dict) or not all(
        isinstance(options.get(k, False), (bool, type(None)))
        for k in ("include_usage", "continuous_usage_stats")
    ):
        return STREAM_OPTIONS_ERROR, "invalid_type"
    return None if body.get("stream") is True else (STREAM_OPTIONS_NO_STREAM, None)


def _check_stream_options(body: dict[str, Any]) -> None:
    """Checked here because the router rewrites ``stream_options`` for streams
    (``with_stream_usage``): a malformed one would otherwise pass."""
    if error := stream_options_error(body):
        raise RouterError(400, *error)


def parse_request(
    raw: bytes, chat: bool, tokenizer: PromptTokenizer, template_decides: TemplateDecides | None = None
) -> ParsedRequest:
    """Validate what the router needs of an OpenAI request and tokenize its prompt. ``template_decides``:
    is the tokenizer's chat template the one a model's workers render with (None: always)?"""
    body, model, stream = _common_fields(raw)
    _check_stream_options(body)
    rest: list = []  # a batch's prompts after the first
    special = body.get("add_special_tokens") is not False  # NOTE: the worker refuses one not a boolean
    try:
        if chat:
            if "messages" not in body:
                raise ValueError("missing required field 'messages'")
            # NOTE: tools are part of the prompt (the template renders them): a shared tool set is
            # a shared prefix, so it counts for routing like a shared system prompt does
            messages = with_stand_ins(body["messages"], "text")
            token_ids = _encode_chat_of(model, template_decides, tokenizer, messages, body.get("tools"),
                                        chat_options(body))  # fmt: skip
        else:
            token_ids, rest = _prompt_tokens(body, tokenizer, special)
    except ValueError as exc:
        raise RouterError(400, str(exc), "invalid_request") from None
    # NOTE: an entry of the wrong type counts 0 here; the worker refuses the request
    lengths = [len(_encode_prompt(tokenizer, p, special)) if isinstance(p, str) else len(p) if isinstance(p, list)
               else 0 for p in rest]  # fmt: skip
    n = body.get("n")
    n = n if type(n) is int and 1 <= n <= 1024 else 1  # the worker validates it; odd values count 1 here
    full = not chat and body.get("echo") is True and body.get("logprobs") is not None
    keep = body.get("truncate_prompt_tokens")  # NOTE: the worker validates it; odd values cut nothing here
    if type(keep) is int and keep >= 1:  # the worker computes each prompt's last ``keep`` tokens
        token_ids, lengths = token_ids[max(0, len(token_ids) - keep) :], [min(size, keep) for size in lengths]
    cut = type(keep) is int and keep == -1  # the most the worker's context holds: known there
    fit = None if cut else max([len(token_ids), *lengths])
    return ParsedRequest(body, raw, model, stream, token_ids, n * (1 + len(rest)), sum(lengths), full_prefill=full,
                         cache_salt=body.get("cache_salt"), fit_tokens=fit, cut_to_fit=cut)  # fmt: skip


def parse_responses_request(
    raw: bytes, tokenizer: PromptTokenizer, template_decides: TemplateDecides | None = None
) -> ParsedRequest:
    """A /v1/responses request: routed by ``instructions`` + ``input`` rendered as chat, or, with
    ``previous_response_id``, pinned to the worker that holds that conversation (router.responses_input)."""
    body, model, stream = _common_fields(raw)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise RouterError(400, "'previous_response_id' must be a string", "invalid_type")
    try:
        messages = prompt_messages(
            body.get("instructions"), [], with_stand_ins(body.get("input"), "input_text")
        )
        tools = chat_tools(body.get("tools"))
        # NOTE: a follow-up's prompt starts with a history only its worker has: nothing to match
        options = chat_options(template_options(body))
        token_ids: Sequence[int] = (
            b""
            if previous is not None
            else _encode_chat_of(model, template_decides, tokenizer, messages, tools, options)
        )
    except ValueError as exc:
        raise RouterError(400, str(exc), "invalid_request") from None
    parsed = ParsedRequest(
        body,
        raw,
        model,
        stream,
        token_ids,
        follow_up=previous is not None,
        usage_in_stream=True,
        cache_salt=body.get("cache_salt"),
        fit_tokens=None if previous is not None or body.get("truncation") == "auto" else len(token_ids),
        cut_to_fit=body.get("truncation") == "auto",
    )
    parsed.affinity_body = {"model": model, "messages": messages}
    return parsed


def with_stand_ins(messages: Any, text_type: str) -> Any:
    """``messages`` (chat messages, or Responses input items) with every content part that is not
    text (an image, audio, a file) as a text part standing in for it: ``<type digest>``, the digest of
    the part as sent. For routing only: the body goes upstream as it came, for a backend that reads
    the parts (a radixgate worker refuses them); two prompts with the same image share that prefix.
    The parts are a message's ``content``, or a Responses tool result's ``output``; a Responses
    reasoning item's parts are its text (``reasoning_text``, ``summary_text``), rendered as the next
    assistant turn's reasoning as the worker renders them."""
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        if isinstance(message, dict) and message.get("type") == "reasoning":
            out.append(message)
            continue
        for field in ("content", "output"):
            parts = message.get(field) if isinstance(message, dict) else None
            if isinstance(parts, list) and any(_stands_in(part) for part in parts):
                stand_ins = [{"type": text_type, "text": _stand_in(p)} if _stands_in(p) else p for p in parts]
                message = {**message, field: stand_ins}
        out.append(message)
    return out


_TEXT_LIKE = (*TEXT_PARTS, "refusal")  # NOTE: an assistant's refusal part is text (the worker renders it)


def _stands_in(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] not in _TEXT_LIKE


def _stand_in(part: dict[str, Any]) -> str:
    digest = mmh3.hash128(orjson.dumps(part, option=orjson.OPT_SORT_KEYS))
    return f"<{part['type']} {digest:032x}>"


def with_stream_usage(parsed: ParsedRequest) -> tuple[bytes, bool]:
    """The body to send upstream for a stream, and whether the router must take the usage chunk
    out again: the router reads usage (cached tokens) from every stream for its hit-rate metrics,
    so it sets ``stream_options.include_usage`` where the client did not (OpenAI's default is no
    usage chunk, and clients index ``choices[0]`` of every chunk). ``stream_options`` was checked
    by ``parse_request``."""
    options = parsed.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return parsed.raw, False
    # NOTE: vLLM's continuous_usage_stats counts only with include_usage: the client gets no usage
    kept = {k: v for k, v in (options or {}).items() if k != "continuous_usage_stats"}
    body = {**parsed.body, "stream_options": {**kept, "include_usage": True}}
    return orjson.dumps(body), True


# The bytes tokenizer hands over ``bytes`` (a sequence of ids): no list of one int per byte.
def _encode_prompt(tokenizer: PromptTokenizer, text: str, special: bool = True) -> Sequence[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_prompt_bytes(text)
    return tokenizer.encode_prompt(text) if special else tokenizer.encode_text(text)


def _encode_chat(
    tokenizer: PromptTokenizer, messages: Any, tools: Any = None, options: dict[str, bool] | None = None
) -> Sequence[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_chat_bytes(messages, tools, **(options or {}))
    return tokenizer.encode_chat(messages, tools, **(options or {}))


# Does the router's chat template decide for this request's ``model`` (its workers render with it)?
TemplateDecides = Callable[[str | None], bool]


def _encode_chat_of(
    model: str | None, template_decides: TemplateDecides | None, tokenizer: PromptTokenizer, messages: Any,
    tools: Any = None, options: dict[str, bool] | None = None,
) -> Sequence[int]:  # fmt: skip
    """``_encode_chat``, but a refusal of the chat template is the router's 400 only for a model whose
    workers render with that template: another model's workers judge the conversation with their own,
    and the router routes it by its ``bytes`` rendering, an estimate as their counts are anyway."""
    try:
        return _encode_chat(tokenizer, messages, tools, options)
    except ChatTemplateError:
        if template_decides is None or template_decides(model):
            raise
    return ByteTokenizer().encode_chat(messages, tools, **(options or {}))


def _prompt_tokens(
    body: dict[str, Any], tokenizer: PromptTokenizer, special: bool = True
) -> tuple[Sequence[int], list]:
    """The ids of the prompt to route by (a batch's first) and the batch's other prompts."""
    if "prompt" not in body:
        raise ValueError("missing required field 'prompt'")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return _encode_prompt(tokenizer, prompt, special), []
    if isinstance(prompt, list) and prompt:
        first = prompt[0]  # a batch of prompts is routed by its first prompt
        if all(type(t) is int and 0 <= t < 2**32 for t in prompt):
            return list(prompt), []
        if isinstance(first, str):  # NOTE: the others may be strings or ids, as the worker takes them
            return _encode_prompt(tokenizer, first, special), prompt[1:]
        if isinstance(first, list) and all(type(t) is int and 0 <= t < 2**32 for t in first):
            return list(first), prompt[1:]
    raise ValueError("'prompt' must be a string, a list of strings, or a list of token ids (0 <= id < 2**32)")
