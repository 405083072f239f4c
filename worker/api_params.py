"""Reading OpenAI request bodies for the worker: the body's common fields, prompts as token ids,
and the sampling parameters. Every problem is an APIError with the HTTP status to answer; nothing
here touches the engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from router.errors import RouterError
from router.request_parsing import (
    JSON_DEPTH_ERROR,
    ClientGone,
    read_body,
    stream_options_error,
    too_deep,
)
from router.token_bounds import fewest_tokens
from router.tokenization import ByteTokenizer, PromptTokenizer, chat_options
from worker.engine_api import EngineDeadError, PromptTooLongError
from worker.guided import (
    CONSTRAINT_KEYS,
    JSON_KINDS,
    Guide,
    GuideCompiler,
    requested_grammar,
    thinking_first,
)
from worker.request import QueueFullError
from worker.sampling import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGPROBS, SamplingParams
from worker.tool_calls import (
    GRANITE_CALLS,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    MISTRAL_CALLS,
    PYTHON_TAG,
    ToolRequest,
    auto_grammar,
    forced_grammar,
    llama3_auto_grammar,
    tagged_auto_grammar,
    tool_request,
)

MAX_CHOICES = 64  # prompts x n per request (each choice is one engine request; a prompt's share pages)
# truncate_prompt_tokens cuts a text prompt of at most this many contexts (bound: router.token_bounds);
# one surely longer is refused before it is tokenized whole (the bytes tokenizer cuts any: its tail)
TRUNCATE_CONTEXTS = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


async def read_bounded(request: Request, limit: int) -> bytes:
    """The request's body; 413 past ``limit`` bytes, counted as they arrive (a chunked body
    declares no length), without reading the rest; 408 when it has not all arrived within the app's
    ``body_timeout_s`` (server.create_app): a client trickling it holds a connection for good."""
    try:
        return await read_body(request, limit, request.app.state.body_timeout_s)
    except RouterError as exc:
        raise APIError(exc.status, exc.message, exc.code) from None
    except ClientGone:
        raise APIError(499, "the client disconnected while sending its request") from None


def json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object; APIError 400 otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if too_deep(raw, body):
        raise APIError(400, JSON_DEPTH_ERROR)
    return body


def check_body(raw: bytes, served_models: Sequence[str]) -> dict:
    """The JSON body, with the fields every generation request shares checked; ``model`` (optional)
    is one of ``served_models`` (the base model, then its LoRA adapters)."""
    body = json_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):  # NOTE: bad input, as the router answers it
        raise APIError(400, "'model' must be a string", "invalid_type")
    if model is not None and model not in served_models:
        served = ", ".join(repr(m) for m in served_models)
        raise APIError(404, f"model {model!r} not found; this worker serves {served}", "model_not_found")
    n = body.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_CHOICES):
        raise APIError(400, f"'n' must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != (n or 1)):
        raise APIError(400, f"best_of other than n is not supported, got {best_of!r}")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise APIError(400, "'stream' must be a boolean")
    if not isinstance(body.get("echo") or False, bool):
        raise APIError(400, "'echo' must be a boolean")
    for flag in ("return_token_ids", "return_tokens_as_token_ids", "include_reasoning"):
        if not isinstance(body.get(flag) or False, bool):
            raise APIError(400, f"'{flag}' must be a boolean")
    if error := stream_options_error(body):
        raise APIError(400, *error)
    # NOTE: refused rather than ignored: an answer without the asked-for format or tool call would
    # look like success to the client
    if body.get("functions") or body.get("function_call"):
        raise APIError(400, "'functions' is deprecated and not supported; use 'tools' and 'tool_choice'")
    if body.get("use_beam_search"):
        raise APIError(400, "beam search ('use_beam_search') is not supported")
    if body.get("prompt_logprobs") is not None:
        raise APIError(
            400, "'prompt_logprobs' is not supported; /v1/completions with 'echo' and 'logprobs' gives them"
        )
    if body.get("modalities") not in (None, ["text"]) or body.get("audio") is not None:
        raise APIError(400, "only text output is supported ('modalities', 'audio')")
    return body


def tools_of(body: dict) -> ToolRequest | None:
    """The chat body's ``tools`` / ``tool_choice``; None without tools."""
    try:
        return tool_request(body)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def call_reader(tools: ToolRequest | None, guide: Guide | None) -> ToolRequest | None:
    """The tools whose calls are read out of the answer: none without tools or with ``tool_choice``
    none, nor where a JSON format the request asked for took the place of ``auto``'s calls grammar
    (its answer is the client's data: a JSON object with a "name" is not a call). A regex or grammar
    may spell calls in the parser's format: those are read."""
    if tools is None or tools.choice == "none":
        return None
    if tools.choice == "auto" and guide is not None and guide.kind in JSON_KINDS:
        return None
    return tools


async def output_guide(
    body: dict, compiler: GuideCompiler, tools: ToolRequest | None = None, parser: str = "hermes",
    thinking: bool | None = None, auto_calls: bool = True,
    while_there: Callable[[Awaitable[Guide]], Awaitable[Guide]] | None = None,
) -> Guide | None:  # fmt: skip
    """The constraint on the output: the structured output the body asks for, the one a forced
    tool call needs, or (``auto`` tools, nothing else asked, ``auto_calls``) well-formed calls in the
    parser's format in free text; compiled off the event loop (a large schema takes a while). None for
    free text. A bad one is a 400 naming the problem. ``thinking`` (with --reasoning-parser; True when
    the prompt opened the thinking): the constraint applies after the model's thinking. ``auto_calls``
    False: a model that writes its calls in its own messages (gpt-oss's harmony), which a calls
    grammar of text would forbid. ``while_there``: the wait for a compile, given up (an APIError)
    if the client leaves meanwhile (the server's ``WorkerAPI.while_there``)."""
    if tools is None and CONSTRAINT_KEYS.isdisjoint(body):
        return None  # NOTE: free text, most requests: no thread hop (~30 us of the event loop's time)
    try:  # NOTE: all of it off the event loop: a schema or tool list of megabytes takes seconds to write
        asked = await run_in_threadpool(_grammar, body, compiler, tools, parser, thinking, auto_calls)
        if asked is None:
            return None
        compiling = compiler.compiled(*asked)
        return await (compiling if while_there is None else while_there(compiling))
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _grammar(
    body: dict, compiler: GuideCompiler, tools: ToolRequest | None, parser: str, thinking: bool | None,
    auto_calls: bool,
) -> tuple[str, str] | None:  # fmt: skip
    """output_guide's (kind, grammar text), not compiled."""
    asked = requested_grammar(body)
    forced = forced_grammar(tools) if tools is not None else None
    if asked is not None and forced is not None:
        raise ValueError("a structured output format and a required tool call cannot be combined")
    if asked is None and forced is None and tools is not None and tools.choice == "auto" and auto_calls:
        special, token = compiler.special_token, compiler.special_id
        if parser == "hermes":
            forced = auto_grammar(tools, special("<tool_call>"), special("</tool_call>"))
        elif parser == "llama3_json":
            forced = llama3_auto_grammar(tools, special(PYTHON_TAG))
        elif parser == "mistral":
            args = (token(MISTRAL_ARGS), token(MISTRAL_CALL_ID))
            forced = tagged_auto_grammar(tools, MISTRAL_CALLS, token(MISTRAL_CALLS), *args)
        elif parser == "granite":
            forced = tagged_auto_grammar(tools, GRANITE_CALLS, token(GRANITE_CALLS))
    asked = asked or forced
    # NOTE: not around free text with calls (tool_auto), nor a constraint that spells the thinking
    # itself (it names </think>, "<\/think>" once escaped): that one is the whole answer's
    wrap = asked is not None and asked[0] != "tool_auto" and "/think>" not in asked[1]
    if wrap and thinking is not None:
        asked = (asked[0], thinking_first(asked[1], thinking))  # type: ignore[index]
    if asked is not None:
        hash(asked[1])  # NOTE: here, off the event loop: a str keeps its hash for the compiler's lookups
    return asked


def engine_error(exc: BaseException) -> APIError | None:
    """What a client is told when the engine refuses a request; None for anything unexpected."""
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), "context_length_exceeded")  # NOTE: as OpenAI and vLLM answer it
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "engine_dead")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return None


def include_usage(body: dict) -> bool:
    """Does the client want a stream's usage chunk (``stream_options.include_usage``)?"""
    return bool((body.get("stream_options") or {}).get("include_usage"))


def continuous_usage(body: dict) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): usage so far in
    every chunk too."""
    return include_usage(body) and (body.get("stream_options") or {}).get("continuous_usage_stats") is True


def chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (boolean) + ``top_logprobs`` as SamplingParams.logprobs."""
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if not isinstance(want, (bool, type(None))):
        raise APIError(400, "'logprobs' must be a boolean")
    if top is not None and not want:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
        # NOTE: checked here, by its own name: SamplingParams would name the field it becomes, logprobs
        raise APIError(400, f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
    return (0 if top is None else top) if want else None


def sampling_params(
    body: dict,
    tokenizer: PromptTokenizer,
    default_max_tokens: int,
    max_key: str,
    logprobs: Any,
    vocab_size: int,
    guide: Guide | None = None,
) -> SamplingParams:
    """The body's sampling fields (absent or null: the default), validated; token ids are bounded by
    ``vocab_size``, the model's."""

    def get(key: str, default: Any) -> Any:
        value = body.get(key)
        return default if value is None else value

    stop = get("stop", [])
    top_k = get("top_k", -1)
    # NOTE: the output bound as the client named it (chat's max_completion_tokens, the Responses API's
    # max_output_tokens, or max_tokens), so a refusal names the field that was sent
    max_name = max_key if body.get(max_key) is not None else "max_tokens"
    max_tokens = get(max_name, default_max_tokens)
    if type(max_tokens) is not int or max_tokens < 1:
        raise APIError(400, f"{max_name} must be an integer >= 1, got {max_tokens!r}")
    params = SamplingParams(
        temperature=get("temperature", 1.0),
        top_p=get("top_p", 1.0),
        top_k=-1
        if type(top_k) is int and top_k == 0
        else top_k,  # NOTE: not false or 0.0: a 400 as true and 1.0
        min_p=get("min_p", 0.0),
        seed=body.get("seed"),
        max_tokens=max_tokens,
        stop=[stop] if isinstance(stop, str) else stop,
        stop_token_ids=get("stop_token_ids", []),
        ignore_eos=get("ignore_eos", False),
        skip_special_tokens=get("skip_special_tokens", True),
        include_stop_str_in_output=get(
            "include_stop_str_in_output", get("no_stop_trim", False)
        ),  # SGLang's name
        logprobs=logprobs,
        repetition_penalty=get("repetition_penalty", 1.0),
        frequency_penalty=get("frequency_penalty", 0.0),
        presence_penalty=get("presence_penalty", 0.0),
        logit_bias=logit_bias(body.get("logit_bias"), vocab_size),
        allowed_token_ids=allowed_token_ids(body.get("allowed_token_ids"), vocab_size),
        bad_words=bad_words(body.get("bad_words"), tokenizer),
        min_tokens=get("min_tokens", 0),
        priority=get("priority", 0),
        cache_salt=body.get("cache_salt"),
        guide=guide,
    )
    try:
        return params.validate()
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def logit_bias(bias: Any, vocab_size: int) -> dict[int, Any]:
    """OpenAI's ``logit_bias`` (token ids as string keys) with int keys in the vocabulary."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must be an object mapping token ids to numbers")
    out = {}
    for key, value in bias.items():
        # NOTE: '²'.isdigit() too; int() refuses more than 4,300 digits (a ValueError, not an answer)
        if not (key.isascii() and key.isdigit()) or len(key) > 20 or int(key) >= vocab_size:
            shown = key if len(key) <= 40 else key[:40] + "..."
            raise APIError(400, f"logit_bias key {shown!r} is not a token id in [0, {vocab_size})")
        out[int(key)] = value
    return out


def allowed_token_ids(ids: Any, vocab_size: int) -> list[int] | None:
    """vLLM's ``allowed_token_ids``: the only tokens that may be sampled, in the vocabulary."""
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids:
        raise APIError(400, "allowed_token_ids must be a non-empty list of token ids")
    for t in ids:
        if type(t) is not int or not 0 <= t < vocab_size:
            raise APIError(400, f"allowed_token_ids: {t!r} is not a token id in [0, {vocab_size})")
    return sorted(set(ids))


def bad_words(words: Any, tokenizer: PromptTokenizer) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences the output must never contain: each word as text of its
    own and after a space (``" word"`` is other tokens in most vocabularies), without special tokens."""
    if words is None:
        return []
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise APIError(400, "bad_words must be a list of non-empty strings")
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise APIError(
            400, f"bad_words takes at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} characters"
        )
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            out.setdefault(tuple(tokenizer.encode_text(text)), None)
    return [list(ids) for ids in out if ids]


def echo_texts(
    prompt: Any, ids: list[list[int]], tokenizer: PromptTokenizer, cut: Sequence[bool] | None = None
) -> list[str]:
    """What ``echo`` sends back for each prompt: the string as given, or token ids decoded (so are
    prompts ``cut`` by truncate_prompt_tokens: what the model saw)."""
    given = prompt if _is_batch(prompt) else [prompt]
    cut = cut or [False] * len(ids)
    return [
        p if isinstance(p, str) and not c else tokenizer.decode(i)
        for p, i, c in zip(given, ids, cut, strict=True)
    ]


def truncation_keep(body: dict, context: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens`` as how many last tokens each prompt keeps: k >= 1 keeps k;
    -1 the most this worker serves (its context less one output token); None: prompts are not cut."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return None
    if type(k) is not int or not (k >= 1 or k == -1):
        raise APIError(400, f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k!r}")
    return context - 1 if k == -1 else k


def _fitting_ids(
    text: str, tokenizer: PromptTokenizer, context: int, keep: int | None, encode: Any
) -> tuple[list[int], bool]:
    """``encode(text)``'s ids cut to their last ``keep`` (None: not cut), and whether they were cut.
    NOTE: a text that surely has more tokens than the context serves (router.token_bounds) is refused
    before it is encoded: its list of ids would take 10-40x its size in memory, for a 400 anyway."""
    fewest = fewest_tokens(text, tokenizer.max_token_bytes)
    if (least := fewest if keep is None else min(fewest, keep)) >= context:
        raise APIError(
            400,
            f"the prompt has at least {least} tokens; this worker serves at most {context - 1} "
            f"(context {context} tokens including at least one output token)",
            "context_length_exceeded",
        )
    if keep is not None and fewest > keep:
        if isinstance(tokenizer, ByteTokenizer):  # NOTE: its ids are the text's bytes: the last keep of them
            return list(text.encode("utf-8")[-keep:]), True
        if fewest > TRUNCATE_CONTEXTS * context:
            raise APIError(
                400,
                f"the prompt has at least {fewest} tokens, too long even to truncate: truncate_prompt_tokens "
                f"cuts prompts of at most {TRUNCATE_CONTEXTS * context} tokens ({TRUNCATE_CONTEXTS} x the "
                "context)",
                "context_length_exceeded",
            )
    return _keep_last(encode(text), keep)


def _keep_last(ids: list[int], keep: int | None) -> tuple[list[int], bool]:
    """``ids`` cut to their last ``keep`` (None: not cut), and whether they were cut."""
    if keep is not None and len(ids) > keep:
        return ids[len(ids) - keep :], True
    return ids, False


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


async def prompt_ids(
    prompt: Any, tokenizer: PromptTokenizer, vocab_size: int, context: int, keep: int | None = None,
    special: bool = True,
) -> tuple[list[list[int]], list[bool]]:  # fmt: skip
    """``prompt`` as token id lists: a string, a list of ids (in [0, ``vocab_size``), the model's), or
    a batch (list) of either; each cut to its last ``keep`` tokens (``truncation_keep``), with which
    were cut. A text surely past the ``context`` (tokens) is refused untokenized (``_fitting_ids``).
    ``special``: a text gets the tokenizer's special tokens (BOS), as vLLM's ``add_special_tokens``."""
    given = prompt if _is_batch(prompt) else [prompt]
    if len(given) > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} prompts per request, got {len(given)}")
    encode = tokenizer.encode_prompt if special else tokenizer.encode_text
    out = [await _one_prompt(p, tokenizer, vocab_size, context, keep, encode) for p in given]
    return [ids for ids, _ in out], [cut for _, cut in out]


async def chat_ids(
    messages: Any, tokenizer: PromptTokenizer, tools: list[dict] | None = None, body: dict | None = None,
    context: int | None = None, keep: int | None = None,
) -> list[int]:  # fmt: skip
    """``messages`` (and ``tools``) rendered by the chat template and tokenized, with the body's
    ``add_generation_prompt`` / ``continue_final_message`` (a bad conversation: 400); cut to the last
    ``keep`` tokens. With ``context`` (tokens), a rendered prompt surely past it is refused untokenized."""

    def encode() -> list[int]:
        text = tokenizer.render_chat(messages, tools, **options)
        if context is None:
            return tokenizer.encode_chat_text(text)
        return _fitting_ids(text, tokenizer, context, keep, tokenizer.encode_chat_text)[0]

    try:
        options = chat_options(body or {})
        return await run_in_threadpool(encode)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


async def _one_prompt(
    prompt: Any, tokenizer: PromptTokenizer, vocab_size: int, context: int, keep: int | None, encode: Any
) -> tuple[list[int], bool]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty")
        return await run_in_threadpool(_fitting_ids, prompt, tokenizer, context, keep, encode)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if not prompt:
            raise APIError(400, "the prompt is empty")
        if any(not 0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})")
        return _keep_last(prompt, keep)
    raise APIError(400, "'prompt' must be a string, a list of token ids, or a list of either")
