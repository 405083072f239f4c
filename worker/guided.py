"""Structured outputs: a request's tokens constrained to a grammar, enforced token by token.

A constraint is one of: a JSON schema (OpenAI ``response_format`` ``json_schema``), any JSON object
(``json_object``), a regex, one string of a list (``choice``) or a Lark grammar (vLLM's
``structured_outputs`` / ``guided_*`` fields). Each is turned into an llguidance grammar; llguidance
walks the tokenizer's vocabulary and says, before every sampled token, which tokens keep the output
a prefix of the grammar's language (a bitmask), and EOS only once the output is complete.

- ``GuideCompiler`` (one per engine, any thread): grammar text -> ``Guide``; compiling a schema can
  take 100s of ms, so the API compiles on its thread pool (once for all the requests that ask for a
  grammar meanwhile) and keeps the last few hundred (tool schemas repeat; a kept one never waits
  for the pool) while the engine thread only copies a compiled matcher.
- ``constrain`` / ``advance`` (engine thread): mask a step's logits for its guided rows and feed
  each row's sampled token to its matcher. A request's matcher lives in its ``memo``; special
  tokens its grammar names (hermes' tool call tags) are text of its output (``Guide.shown``).

JSON is generated compact (no whitespace between tokens, ``,`` and ``:`` separators) unless the
schema's ``x-guidance`` says otherwise: a model left free to emit whitespace can spend its whole
budget on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import torch

from router.request_parsing import MAX_JSON_DEPTH, too_deep
from router.tokenization import ByteTokenizer, PromptTokenizer

JSON_DEFAULTS = {"whitespace_flexible": False}
_TOKEN_REF = re.compile(r"<\[(\d+)\]>")  # a token named by its id in an llguidance grammar
ANY_JSON_OBJECT = {"type": "object"}


@dataclass(frozen=True, eq=False)
class Guide:
    """A compiled constraint; ``matcher()`` gives each request (choice) its own state."""

    kind: str  # json_schema, json_object, regex, choice, grammar: for errors and metrics
    template: Any  # llguidance.LLMatcher at the grammar's start, never advanced
    # special tokens the grammar names (hermes' <tool_call> tags where they are special): they are
    # text of the output, so the request's detokenizer shows them (others stay hidden)
    shown: frozenset[int] = frozenset()
    # when the tokenizer names tokens past the model's vocabulary (the embedding's rows): the matcher's
    # token count (its masks are computed that wide, then cut to the logits') and the model's; else 0, 0
    width: int = 0
    vocab: int = 0

    def matcher(self) -> Any:
        return self.template.deep_copy()


def json_schema_grammar(schema: Any) -> str:
    from llguidance import LLMatcher

    if schema is True:  # NOTE: any JSON value; llguidance applies its options to object schemas only
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object (or true: any JSON value)")
    check_schema(schema)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except ValueError as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from None


_EXACT_INT = 2**53  # llguidance holds a schema's numbers as float64: integers past this change
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_VALUES = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
# maps of names to schemas
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _inexact(value: Any) -> bool:
    """An integer (at any depth) that float64 does not hold exactly."""
    if isinstance(value, list):
        return any(_inexact(v) for v in value)
    if isinstance(value, dict):
        return any(_inexact(v) for v in value.values())
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > _EXACT_INT


def _lone_backslash(regex: str) -> bool:
    """Does ``regex`` end in a backslash that escapes nothing (llguidance drops it)?"""
    return (len(regex) - len(regex.rstrip("\\"))) % 2 == 1


def check_schema(node: Any) -> None:
    """Refuse what llguidance would silently change rather than honour: an integer past 2**53 that
    bounds or names a value (it would allow its float64 neighbour), a pattern ending in a lone
    backslash (dropped)."""
    if isinstance(node, list):
        for item in node:
            check_schema(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _NAMED and isinstance(value, dict):  # NOTE: names, not keywords: "enum" may be a property
            if key == "patternProperties" and any(_lone_backslash(p) for p in value):
                raise ValueError("invalid JSON schema: a patternProperties name ends in a lone backslash")
            for sub in value.values():
                check_schema(sub)
        elif (key in _BOUNDS or key in ("const", "enum")) and _inexact(value):
            raise ValueError(f"invalid JSON schema: {key} holds an integer beyond 2**53, which the "
                             "constraint cannot keep exact")  # fmt: skip
        elif key == "pattern" and isinstance(value, str) and _lone_backslash(value):
            raise ValueError("invalid JSON schema: a pattern ends in a lone backslash")
        elif key not in _VALUES:
            check_schema(value)


def regex_grammar(regex: Any) -> str:
    from llguidance import LLMatcher

    if not isinstance(regex, str) or not regex:
        raise ValueError("a regex must be a non-empty string")
    if _lone_backslash(regex):
        raise ValueError("invalid regex: it ends in a lone backslash")
    return LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: Any) -> str:
    from llguidance import LLMatcher

    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("a choice must be a non-empty list of non-empty strings")
    # NOTE: one lexeme, a regex of the choices (a rule of alternatives stops at llguidance's 2,000
    # items a row); each character not a letter or digit is written \x{..}, safe in Lark's /.../
    alternatives = "|".join("".join(ch if ch.isascii() and ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in c)
                            for c in choices)  # fmt: skip
    return LLMatcher.grammar_from_lark(f"start: /(?:{alternatives})/")


MAX_GRAMMAR_RULES = 2000  # rules (and terminals) a request's own grammar may define
# a rule's or terminal's definition at a line's start: Lark's ``name:`` / ``?name.2:`` / ``NAME:``, GBNF's ``name ::=``
_RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::(?!:)|::=)", re.MULTILINE)


def lark_grammar(text: Any) -> str:
    """A Lark grammar, or a GBNF / EBNF one (``root ::= ...``, as llama.cpp, xgrammar and SGLang's
    ``ebnf`` write them), converted by llguidance; at most ``MAX_GRAMMAR_RULES`` rules. NOTE: llguidance
    compiles along chains of rules recursively (a chain of 100,000 overflowed even the compile threads'
    deep stack: COMPILE_STACK_BYTES), and the GBNF conversion takes time quadratic in them (3,000: 5.7 s)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(text, str) or not text.strip():
        raise ValueError("a grammar must be a non-empty Lark or GBNF grammar string")
    if (rules := len(_RULE_DEFINITION.findall(text))) > MAX_GRAMMAR_RULES:
        raise ValueError(f"the grammar defines {rules} rules; at most {MAX_GRAMMAR_RULES} are served")
    try:
        text = any_to_lark(text)
    except RecursionError:
        raise ValueError("the GBNF grammar is nested too deeply to convert") from None
    # NOTE: the converter's own error, or a plain Exception (a rule not found, no root rule)
    except Exception as exc:
        raise ValueError(f"the GBNF grammar does not parse: {exc}") from None
    return LLMatcher.grammar_from_lark(text)


THINK_GAP = 8  # whitespace characters a constrained answer may start with after the thinking


def thinking_first(grammar: str, opened: bool = False) -> str:
    """``grammar`` after a thinking block, so a thinking model (``--reasoning-parser``) thinks freely
    before its constrained answer, as its reasoning is split off: ``<think>`` free text ``</think>``
    first if the model writes it, or, when the prompt ``opened`` it, free text up to ``</think>``
    first in any case; up to ``THINK_GAP`` whitespace characters may follow it (a bound: a model
    left free to write whitespace there can spend its whole budget on it)."""
    try:
        top = json.loads(grammar)  # NOTE: llguidance's JSON form (schemas, regexes); else Lark text
    except json.JSONDecodeError:
        top = {"grammars": [{"lark_grammar": grammar}]}
    answer = top["grammars"][0]
    answer["name"] = answer.get("name") or "answer"
    start = f"think WS @{answer['name']}" if opened else f"(think WS)? @{answer['name']}"
    think = 'TEXT "</think>"' if opened else '"<think>" TEXT "</think>"'
    lark = (f"%llguidance {{}}\nstart: {start}\nthink[lazy]: {think}\nTEXT: /(.|\\n)*/\n"
            f"WS: /[ \\t\\r\\n]{{0,{THINK_GAP}}}/\n")  # fmt: skip
    top["grammars"] = [{"name": "thinking", "lark_grammar": lark}, *top["grammars"]]
    return json.dumps(top)


# vLLM's spellings: ``structured_outputs: {kind: value}`` and the older top-level ``guided_<kind>``
JSON_KINDS = ("json_schema", "json_object")  # the constraints whose answer is one JSON value
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# SGLang's: top-level ``regex``, ``json_schema`` (JSON text) and ``ebnf``
_SGLANG_KINDS = {"regex": "regex", "json_schema": "json_schema", "ebnf": "grammar"}
# what else structured_outputs may hold: never a fallback to free text here, so that flag is kept
_STRUCTURED_KEYS = {*_VLLM_KINDS, "json_object", "disable_fallback"}
# every body key requested_grammar reads: a body with none of them asks for free text
CONSTRAINT_KEYS = frozenset({"response_format", "structured_outputs", "guided_whitespace_pattern",
                             *(f"guided_{k}" for k in _VLLM_KINDS), *_SGLANG_KINDS})  # fmt: skip


def requested_grammar(body: dict) -> tuple[str, str] | None:
    """(kind, llguidance grammar) for the constraint a request body asks for, None for free text.
    ValueError for a malformed or ambiguous request (more than one constraint)."""
    asked: list[tuple[str, Any]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format must be {'type': 'text' | 'json_object' | 'json_schema'}")
        if fmt["type"] == "json_object":
            asked.append(("json_object", ANY_JSON_OBJECT))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("response_format json_schema needs a 'json_schema' object")
            asked.append(("json_schema", spec.get("schema", True)))  # no schema: any JSON value
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(
            k for k, v in structured.items() if k not in _STRUCTURED_KEYS and v is not None and v is not False
        )
        if unknown:
            raise ValueError(f"structured_outputs: {', '.join(map(repr, unknown))} not supported: "
                             f"{', '.join(sorted(_VLLM_KINDS))} or json_object are")  # fmt: skip
        asked += [(_VLLM_KINDS[k], v) for k, v in structured.items() if k in _VLLM_KINDS and v is not None]
        if structured.get("json_object"):
            asked.append(("json_object", ANY_JSON_OBJECT))
    asked += [
        (kind, body[f"guided_{k}"]) for k, kind in _VLLM_KINDS.items() if body.get(f"guided_{k}") is not None
    ]
    asked += [(kind, body[k]) for k, kind in _SGLANG_KINDS.items() if body.get(k) is not None]
    if body.get("guided_whitespace_pattern") is not None:
        raise ValueError(
            "'guided_whitespace_pattern' is not supported (JSON output takes the usual whitespace)"
        )
    if not asked:
        return None
    if len(asked) > 1:
        raise ValueError(
            f"one output constraint per request, got {len(asked)}: {', '.join(k for k, _ in asked)}"
        )
    return grammar_of(*asked[0])


def grammar_of(kind: str, value: Any) -> tuple[str, str]:
    """(kind, grammar) for one constraint; a JSON schema may come as JSON text."""
    if kind in JSON_KINDS:
        if isinstance(value, str):
            text = value.encode()
            try:
                value = orjson.loads(text)  # NOTE: json.loads ran out of Python's recursion at ~1,000 levels
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if too_deep(text, value):  # NOTE: as a body's schema is bounded (its checks recurse per level)
                raise ValueError(
                    f"the JSON schema nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
                )
        return kind, json_schema_grammar(value)
    if kind == "regex":
        return kind, regex_grammar(value)
    if kind == "choice":
        return kind, choice_grammar(value)
    return kind, lark_grammar(value)


COMPILE_STACK_BYTES = 256 * 2**20
COMPILE_THREADS = 4


class _DeepStackThreads:
    """Threads with a deep stack (``COMPILE_STACK_BYTES``, address space: only what is used is memory)
    for llguidance's compiles, which recurse along a grammar's chains of rules, ~8 KiB a link: on a
    thread's default 8 MiB a JSON schema of 1,000 chained ``$ref`` (70 KB) overflowed it, a SIGSEGV that
    took the worker down with every request in it. On 256 MiB, schemas meet llguidance's own size
    refusals first (a 400), and grammars ``MAX_GRAMMAR_RULES`` (a chain of 30,000 rules compiles)."""

    def __init__(self, count: int, stack_bytes: int) -> None:
        self._count, self._stack = count, stack_bytes
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            # NOTE: the stack size is the process's setting for threads started from now on: set, then put back
            before = threading.stack_size(self._stack)
            try:
                for i in range(self._count):
                    threading.Thread(target=self._work, name=f"guide-compile-{i}", daemon=True).start()
            finally:
                threading.stack_size(before)
            self._started = True

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        """``fn(*args)`` queued for one of the threads; cancelling its future before a thread takes
        it skips it."""
        self._start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future


COMPILES = _DeepStackThreads(COMPILE_THREADS, COMPILE_STACK_BYTES)


@dataclass(eq=False)
class _Compiling:
    """A grammar's compile queued or under way on COMPILES, and how many requests await it."""

    future: concurrent.futures.Future
    waiting: int = 0


class GuideCompiler:
    """Grammars compiled against one tokenizer, the last ``max_entries`` kept by (kind, grammar text),
    at most ``max_text_chars`` characters of grammar text among them (a compiled grammar holds ~45x its text: a
    20,000-option choice's 200 KB kept ~9 MB, and 256 such pinned GBs); a larger grammar is not kept."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        vocab_size: int,
        max_entries: int = 256,
        max_text_chars: int = 8 * 2**20,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)  # the model's logits may be wider
        self.model_vocab = vocab_size  # ... or narrower: tokens the tokenizer adds past the embedding
        self.max_entries = max_entries
        self.max_text_chars = max_text_chars
        self._text_chars = 0  # of the grammars kept
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[tuple[str, str], Guide] = OrderedDict()
        self._compiling: dict[tuple[str, str], _Compiling] = {}  # NOTE: event loop and compile threads
        self._specials = _special_tokens(tokenizer)  # text -> id; the vocabulary does not change

    async def compiled(self, kind: str, grammar: str) -> Guide:
        """``compile`` for a request on the event loop: a kept grammar at once, without queueing
        behind other requests' compiles; else compiled on COMPILES, once for all the requests that
        ask for it meanwhile. A request cancelled while it waits leaves; the last to leave cancels
        the compile (one not begun is skipped)."""
        key = (kind, grammar)
        with self._lock:
            guide = self._kept(key)
            if guide is not None:
                return guide
            job = self._compiling.get(key)
            if job is None:
                job = self._compiling[key] = _Compiling(COMPILES.submit(self.compile, kind, grammar))
            job.waiting += 1
        try:
            # NOTE: shielded: one waiter's cancellation must not cancel the compile the others await
            return await asyncio.shield(asyncio.wrap_future(job.future))
        finally:
            with self._lock:
                job.waiting -= 1
                if not job.waiting:
                    job.future.cancel()  # NOTE: nothing once it has run (its guide is kept)
                    if self._compiling.get(key) is job:
                        del self._compiling[key]

    def _kept(self, key: tuple[str, str]) -> Guide | None:
        """The kept Guide of ``key`` (now the most recently used), or None; under ``_lock``."""
        guide = self._compiled.get(key)
        if guide is not None:
            self._compiled.move_to_end(key)
        return guide

    def compile(self, kind: str, grammar: str) -> Guide:
        """A Guide for llguidance ``grammar`` text; ValueError naming the problem if it is invalid."""
        key = (kind, grammar)
        with self._lock:
            guide = self._kept(key)
            if guide is not None:
                return guide
        from llguidance import LLMatcher

        # NOTE: outside the lock: compiling drops the GIL, so other requests compile meanwhile
        template = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {template.get_error()}")
        wider = (self.vocab_size, self.model_vocab) if self.vocab_size > self.model_vocab else (0, 0)
        guide = Guide(kind, template, self._named_specials(grammar), *wider)
        size = len(grammar)
        if size > self.max_text_chars:
            return guide  # NOTE: compiled for this request only
        with self._lock:
            if key not in self._compiled:  # NOTE: another request may have compiled it meanwhile
                self._text_chars += size
            self._compiled[key] = guide
            while len(self._compiled) > self.max_entries or self._text_chars > self.max_text_chars:
                (_, dropped), _ = self._compiled.popitem(last=False)
                self._text_chars -= len(dropped)
        return guide

    def special_token(self, text: str) -> bool:
        """Is ``text`` one special token of this tokenizer (as ``<tool_call>`` is for some models)?
        An added token that is not special (Qwen's ``<tool_call>``) is text, as llguidance sees it."""
        return text in self._specials

    def special_id(self, text: str) -> int | None:
        """The id of special token ``text``; None when it is not one. A grammar names it ``<[id]>``
        (llguidance's form for a token whose text is not ``<...>``, as Mistral's ``[TOOL_CALLS]``)."""
        return self._specials.get(text)

    def _named_specials(self, grammar: str) -> frozenset[int]:
        """The special tokens (EOS aside) whose text ``grammar`` contains or whose id it names
        (``<[id]>``): a tag it references or forces, which the output's text must then show."""
        eos = set(self.tokenizer.eos_token_ids)
        by_id = {int(i) for i in _TOKEN_REF.findall(grammar)}
        return frozenset(
            token_id
            for text, token_id in self._specials.items()
            if token_id not in eos
            and (token_id in by_id or text in grammar or json.dumps(text)[1:-1] in grammar)
        )

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer


def _ll_tokenizer(tokenizer: PromptTokenizer, vocab_size: int) -> Any:
    """llguidance's view of a tokenizer: the bytes of every token, EOS, specials."""
    from llguidance import LLTokenizer, TokenizerWrapper
    from tokenizers import Tokenizer

    if isinstance(tokenizer, ByteTokenizer):

        class _Bytes:
            eos_token_id = ByteTokenizer.EOS
            bos_token_id = None
            tokens = [bytes((i,)) for i in range(256)] + [s.encode() for s in ByteTokenizer.SPECIALS]
            special_token_ids = list(range(256, tokenizer.vocab_size))

            def __call__(self, data: bytes) -> list[int]:
                return list(data)

        return LLTokenizer(TokenizerWrapper(_Bytes()), n_vocab=vocab_size)
    backend = getattr(tokenizer, "_tok", None)  # an HFTokenizer: its tokenizers.Tokenizer
    if backend is None:
        raise ValueError(f"structured outputs are not available for tokenizer {tokenizer.name!r}")
    eos = list(tokenizer.eos_token_ids)
    config = json.loads(backend.to_str())
    whole = LLTokenizer(json.dumps(_readable_decoder(config)), n_vocab=vocab_size, eos_token=eos or None)
    # NOTE: two departures from llguidance's reading of a tokenizer.json. It takes every added token
    # for a special one, which no text of a grammar can contain, but Qwen's <tool_call>, </tool_call>
    # and <think> are added tokens that are not special (the model writes them inside text); and it
    # tokenizes a grammar's forced text with special tokens read in it ("</tool_call>" as that special
    # token), a token it then refuses as not text, ending the answer. So it gets the vocabulary with
    # only the special tokens marked, and a tokenizer that reads no special token in text.
    # That tokenizer must also leave out the leading space a SentencePiece-style one adds to every
    # encode, as llguidance's own reading does (``_without_prefix_space``).
    text_only = Tokenizer.from_str(json.dumps(_without_prefix_space(json.loads(backend.to_str()))))
    text_only.encode_special_tokens = True

    class _Vocab:
        eos_token_id = whole.eos_token
        bos_token_id = getattr(tokenizer, "bos_token_id", None)
        tokens = [whole.decode_bytes([i]) for i in range(backend.get_vocab_size(with_added_tokens=True))]
        special_token_ids = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

        def __call__(self, text: bytes) -> list[int]:
            return text_only.encode(
                bytes(text).decode("utf-8", errors="replace"), add_special_tokens=False
            ).ids

    return LLTokenizer(TokenizerWrapper(_Vocab()), n_vocab=vocab_size, eos_token=eos or None)


def _readable_decoder(config: dict) -> dict:
    """A tokenizer.json whose ``Metaspace`` decoder (transformers' generic SentencePiece conversion)
    is spelt as the decoder sequence Llama's conversion writes ("▁" as a space, the first space
    stripped), which llguidance reads: it refuses a ``Metaspace`` one ("can't determine decoder
    type"), and every structured output and tool call of such a tokenizer was a 400. (The sequence
    also reads byte-fallback pieces as their bytes, which a Metaspace decoder does not; transformers
    writes one for models without byte fallback, which have no such pieces.)"""
    decoder = config.get("decoder")
    if not isinstance(decoder, dict) or decoder.get("type") != "Metaspace":
        return config
    space = decoder.get("replacement", "\u2581")
    strip = decoder.get("prepend_scheme", "always") != "never" and decoder.get("add_prefix_space", True)
    steps = [{"type": "Replace", "pattern": {"String": space}, "content": " "}, {"type": "ByteFallback"},
             {"type": "Fuse"}, *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if strip else [])]  # fmt: skip
    return {**config, "decoder": {"type": "Sequence", "decoders": steps}}


def _without_prefix_space(config: dict) -> dict:
    """A tokenizer.json made to tokenize text as the middle of a text: without the space a
    SentencePiece-style tokenizer (Llama 2, Mistral) prepends to every encode (a ``Prepend("▁")``
    normalizer, a ``Metaspace`` pre-tokenizer) or a byte-level one with ``add_prefix_space``.

    NOTE: llguidance tokenizes the text a grammar forces (``Hello`` of a choice, ``{"`` of JSON) and
    requires the tokens to spell exactly those bytes; with the marker they spell `` Hello``, the
    matcher errors and allows only EOS (an empty answer). The model writes the text with the
    same tokens a decode would read back, marker-free, so that is the tokenization to give."""

    def edit(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind == "Prepend":  # the marker itself (Llama 2's normalizer)
            return None
        if kind == "Sequence":
            key = "normalizers" if "normalizers" in node else "pretokenizers"
            return {**node, key: [n for n in map(edit, node.get(key) or []) if n is not None]}
        if kind in ("Metaspace", "ByteLevel"):
            node = dict(node)
            if "prepend_scheme" in node:  # Metaspace, tokenizers >= 0.19
                node["prepend_scheme"] = "never"
            if "add_prefix_space" in node:  # older Metaspace, ByteLevel
                node["add_prefix_space"] = False
        return node

    return {
        **config,
        "normalizer": edit(config.get("normalizer")),
        "pre_tokenizer": edit(config.get("pre_tokenizer")),
    }


def _special_tokens(tokenizer: PromptTokenizer) -> dict[str, int]:
    """Text -> id of the tokenizer's special tokens (an HFTokenizer's added tokens marked special)."""
    if isinstance(tokenizer, ByteTokenizer):
        return {text: ByteTokenizer.EOS + i for i, text in enumerate(ByteTokenizer.SPECIALS)}
    backend = getattr(tokenizer, "_tok", None)
    if backend is None:
        return {}
    return {token.content: i for i, token in backend.get_added_tokens_decoder().items() if token.special}


# ---------------------------------------------------------------------- engine thread
def matcher_of(state: Any) -> Any:
    """The request's matcher (made on its first sampled token), kept in its memo."""
    m = state.memo.get("matcher")
    if m is None:
        m = state.memo["matcher"] = state.params.guide.matcher()
    return m


def packed_masks(matchers: Sequence[Any], vocab: int) -> np.ndarray:
    """int32 [len(matchers), ceil(vocab / 32)]: bit t % 32 of word t // 32 set if token t is allowed."""
    words = (vocab + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.int32)
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(bits[i].ctypes.data, words * 4)
    return bits


def allowed_mask(
    matchers: Sequence[Any], vocab: int, device: torch.device | str = "cpu", width: int = 0
) -> torch.Tensor:
    """bool [len(matchers), vocab] on ``device``: the tokens each matcher allows next (computed over
    ``width`` tokens when the matchers know more than ``vocab``, Guide.width). A GPU gets the
    packed words (1/8 of the bytes) and unpacks them itself; the CPU unpacks with numpy (the words'
    bytes in memory order are tokens 0-7, 8-15, ...: little-endian, as on x86 and ARM)."""
    return unpack(packed_masks(matchers, max(vocab, width)), vocab, device)


def unpack(bits: np.ndarray, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Packed int32 words (``packed_masks``) -> bool [rows, vocab] on ``device``."""
    if torch.device(device).type == "cpu":
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(unpacked.view(np.bool_))
    from worker.sampling import on_device

    # NOTE: from pinned memory: the copy does not wait for the work queued on the device
    return unpack_on(on_device(bits, torch.device(device), torch.int32), vocab)


def unpack_on(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 words -> bool [rows, vocab], on the words' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(packed.shape[0], -1)[:, :vocab].bool()


def constrain(logits: torch.Tensor, states: Sequence[Any], rows: Sequence[int] | None = None) -> torch.Tensor:
    """``logits`` [B, V] with each guided row's disallowed tokens at -inf (a new tensor; the input
    is returned untouched when no row is guided). ``rows``: the rows to mask (default: every
    guided one). The masks are computed on the CPU while the GPU may still be running the step's
    forward: nothing here waits for it."""
    from worker.sampling import on_device

    if rows is None:
        rows = [i for i, st in enumerate(states) if st.params.guide is not None]
    if not rows:
        return logits
    width = max(states[i].params.guide.width for i in rows)
    blocked = ~allowed_mask([matcher_of(states[i]) for i in rows], logits.shape[1], logits.device, width)
    if len(rows) == len(states):
        return logits.masked_fill(blocked, float("-inf"))
    index = on_device(list(rows), logits.device, torch.int64)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(blocked, float("-inf")))


def advance(states: Sequence[Any], tokens: Sequence[int]) -> None:
    """Feed each guided row its sampled token. A token the matcher refuses (only possible when a
    row had no allowed token left) leaves it in an error state: every later mask allows EOS only."""
    for st, token in zip(states, tokens, strict=True):
        if st.params.guide is not None:
            matcher_of(st).consume_token(int(token))


def constraint_failure(state: Any) -> str | None:
    """Why a guided request's grammar can take no further token, or None: llguidance stopped in an
    error (a limit of its own reached mid-output, e.g. a regex of a million repetitions, or a
    token it refused). The request ends with this error instead of the EOS-only masks that follow."""
    if state.params.guide is None:
        return None
    m = state.memo.get("matcher")
    if m is None or not m.is_error():
        return None
    reason = m.get_error().split("\n", 1)[0]
    # NOTE: bad_words only: a logit_bias is added to the logits, so a token the grammar allows still beats
    # the -inf of those it does not, however low its bias
    why = "; bad_words may have banned every token it allowed" if state.params.bad_words else ""
    return f"the output constraint ({state.params.guide.kind.replace('_', ' ')}) failed: {reason}{why}"


def check_drafts(state: Any, drafts: list[int]) -> list[int]:
    """Speculative decoding under a grammar: the tokens the grammar forces next, when it does (a
    JSON key, punctuation: right whatever the model prefers, so always kept), else the leading
    drafts it allows."""
    m, vocab = matcher_of(state), state.params.guide.vocab
    forced = list(m.compute_ff_tokens())
    if vocab and any(t >= vocab for t in forced):  # NOTE: a token the model has no embedding for
        forced = []
    if forced:
        return forced
    return drafts[: m.validate_tokens(drafts)] if drafts else []


def draft_masks(state: Any, draft: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """bool [len(draft) + 1, vocab]: row j allows what the grammar allows after the request's
    tokens so far plus draft[:j] (the matcher is advanced through the draft and rolled back)."""
    m = matcher_of(state)
    words = (max(vocab, state.params.guide.width) + 31) // 32
    bits = np.zeros((len(draft) + 1, words), dtype=np.int32)
    for j in range(len(draft) + 1):
        m.unsafe_compute_mask_ptr(bits[j].ctypes.data, words * 4)
        if j < len(draft) and not m.consume_token(int(draft[j])):
            raise RuntimeError("a draft token the grammar refused reached a verify step")
    m.rollback(len(draft))
    return unpack(bits, vocab, device)
