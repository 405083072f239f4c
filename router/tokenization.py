"""Prompt tokenizers shared by the router and the worker (contract 2: the same request gives the same ids).

Two kinds: ``bytes`` (UTF-8 bytes, fixed chat template) and a model directory (tokenizer.json + chat
template rendered like HF does). Must never import torch: the router imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any, Protocol, runtime_checkable

from router.chat_tools import call_arguments, check_tool_calls, compact_json, normalize_tools
from router.token_bounds import hf_max_token_bytes, tokenizer_spec

_REPLACEMENT = "\ufffd"
# HF's marker for ``continue_final_message``: appended to the last message's content, and the
# rendered text is cut where it shows up (the template's end of turn after it is dropped)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@runtime_checkable
class PromptTokenizer(Protocol):
    """What the router and the worker need from a tokenizer."""

    name: str  # identity: equal names promise equal token ids for equal requests
    vocab_size: int
    eos_token_ids: list[int]
    # the most bytes of text one token stands for (router.token_bounds); None: no such bound holds
    max_token_bytes: int | None

    def encode_prompt(self, prompt: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...  # text alone: no special tokens (BOS)

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> list[int]: ...  # fmt: skip

    # encode_chat in two steps: the conversation as text, then that text's ids
    def render_chat(
        self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> str: ...  # fmt: skip

    def encode_chat_text(self, text: str) -> list[int]: ...  # render_chat's text as encode_chat encodes it

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes | None: ...


class ChatTemplateError(ValueError):
    """A model's chat template refused a conversation (its ``raise_exception``, request data of types it
    cannot render, no template at all): that model's verdict, not a malformed request's."""


def _with_thinking(message: dict) -> dict:
    """A message's reasoning under each name chat templates read it by, as transformers aliases them: the
    first of ``reasoning_content`` (Qwen3's, DeepSeek's), ``thinking`` (gpt-oss's) and ``reasoning`` (what
    this API returns beside the first) the message has is its ``reasoning_content``, and its ``thinking``
    where it has none."""
    thought = next(
        (
            message[k]
            for k in ("reasoning_content", "thinking", "reasoning")
            if isinstance(message.get(k), str)
        ),
        None,
    )
    return message if thought is None else {"thinking": thought, **message, "reasoning_content": thought}


def normalize_messages(messages: Any, keep_parts: bool = False) -> list[dict]:
    """Validate OpenAI chat messages; returns copies whose ``content`` is a plain string.

    Content may be a string, a list of ``{"type": "text", "text": ...}`` parts (joined with
    newlines; with ``keep_parts``, kept as a list of such parts, as transformers hands them to a
    template that loops over them), or None for an assistant message (then ""). Anything else raises
    ValueError. Other keys whose value is null are left out, as transformers leaves them out (a history
    of OpenAI's message objects carries ``"tool_calls": null``, which templates take for calls).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of message objects")
    out: list[dict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        calls = message.get("tool_calls")
        if calls is not None:
            check_tool_calls(calls, f"messages[{i}].tool_calls")
        if "content" not in message and not (role == "assistant" and calls):
            raise ValueError(f"messages[{i}] has no 'content'")
        content = message.get("content")
        if content is None and role == "assistant":
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts: list[str] = []
            for j, part in enumerate(content):
                # NOTE: an assistant's refusal part (OpenAI's) is its text, as vLLM reads it
                kind = part.get("type") if isinstance(part, dict) else None
                field = "refusal" if kind == "refusal" and role == "assistant" else "text"
                if kind != field:
                    raise ValueError(f"messages[{i}].content[{j}] must be a {{'type': 'text'}} part")
                if not isinstance(part.get(field), str):
                    raise ValueError(f"messages[{i}].content[{j}].{field} must be a string")
                parts.append(part[field])
            text = [{"type": "text", "text": t} for t in parts] if keep_parts else "\n".join(parts)
        else:
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**{k: v for k, v in message.items() if v is not None}, "content": text})
    return out


# variables the chat template gets from the request itself (chat_template_kwargs cannot set them)
_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                 "bos_token", "eos_token", "unk_token", "pad_token"})  # fmt: skip


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def prompt_special_tokens(body: dict) -> bool:
    """vLLM's ``add_special_tokens`` of a completions prompt (default true: the tokenizer's BOS and
    the like, as encode_prompt adds them; false: the text's own tokens alone, encode_text).
    ValueError when not a boolean."""
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise ValueError(f"'add_special_tokens' must be a boolean, got {special!r}")
    return special


def chat_options(body: dict) -> dict[str, Any]:
    """vLLM's ``add_generation_prompt`` (default true), ``continue_final_message`` (default
    false: true makes the model continue the last, assistant, message, an "assistant prefill"),
    ``chat_template_kwargs`` (more variables for the template, e.g. Qwen 3's ``enable_thinking``) and
    OpenAI's ``reasoning_effort`` (the template's ``reasoning_effort``, as gpt-oss's reads it) as
    ``encode_chat`` keyword arguments. ValueError when malformed or both true."""
    add = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message", False)
    if not isinstance(add, bool) or not isinstance(cont, bool):
        raise ValueError("'add_generation_prompt' and 'continue_final_message' must be booleans")
    if add and cont and "add_generation_prompt" in body:
        raise ValueError("'continue_final_message' and 'add_generation_prompt' cannot both be true")
    if body.get("add_special_tokens", False) is not False:  # NOTE: vLLM's; refused, not ignored
        raise ValueError(
            "'add_special_tokens' must be false for chat: the chat template writes the special tokens"
        )
    options: dict[str, Any] = {"add_generation_prompt": add and not cont, "continue_final_message": cont}
    if body.get("chat_template") is not None:  # NOTE: refused, not ignored: the model's own template is used
        raise ValueError("a per-request 'chat_template' is not supported: the model's own is used")
    documents = body.get("documents")
    if documents is not None:  # vLLM's: for templates that read them (RAG: Command R, Granite)
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise ValueError("'documents' must be a list of objects")
        options["documents"] = documents
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ValueError("'chat_template_kwargs' must be an object of template variables")
        taken = sorted(_TEMPLATE_VARIABLES & extra.keys())
        if taken:
            raise ValueError(f"'chat_template_kwargs' cannot set {', '.join(taken)}: the request sets them")
    effort = body.get("reasoning_effort")
    if effort is not None:  # NOTE: the variable gpt-oss's template reads; chat_template_kwargs' own wins
        if effort not in REASONING_EFFORTS:
            raise ValueError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}")
        extra = {"reasoning_effort": effort, **(extra or {})}
    if extra:
        options["template_kwargs"] = extra
    return options


def _final_to_continue(messages: list[dict]) -> str:
    """The content a ``continue_final_message`` prompt ends with (checked; its text parts' texts, joined)."""
    final = messages[-1]
    content = final["content"]
    text = content if isinstance(content, str) else "".join(part["text"] for part in content)
    if final["role"] != "assistant" or not text:
        raise ValueError("continue_final_message needs a last message from the assistant with content")
    return text


def _tagged_final(message: dict) -> dict:
    """The message a ``continue_final_message`` prompt ends with, ``_CONTINUE_TAG`` after its content (its
    last text part's, where the content is a list of parts, as transformers tags it)."""
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    last = content[-1]
    return {**message, "content": [*content[:-1], {**last, "text": last["text"] + _CONTINUE_TAG}]}


class ByteTokenizer:
    """Token id = UTF-8 byte value (0..255); special tokens follow (256 = ``<|eos|>``).

    The router's default ``bytes`` mode and the built-in ``tiny`` model's tokenizer. No BOS.
    """

    EOS = 256
    SPECIALS = ("<|eos|>",)

    def __init__(self) -> None:
        self.name = "bytes"
        self.vocab_size = 256 + len(self.SPECIALS)
        self.eos_token_ids = [self.EOS]
        self.max_token_bytes: int | None = 1  # NOTE: encoding gives one id per byte (never a special token)

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        return list(prompt.encode("utf-8"))

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_chat(
        self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> str:  # fmt: skip
        """The fixed plain chat template (it has no variables: ``template_kwargs`` change nothing;
        ``documents`` follow the tools as ``<|documents|>\\n{JSON list}\\n``):
        ``<|role|>\\n{content}\\n`` per message, then the generation prompt ``<|assistant|>\\n``
        (unless ``add_generation_prompt`` is false; with ``continue_final_message`` the last message
        stays open: no newline, no generation prompt). Tools come first, as
        ``<|tools|>\\n{JSON list}\\n`` (one tool set shared by many conversations is then their
        shared prefix); an assistant message's tool calls follow its content as
        ``<tool_call>{"name":...,"arguments":...}</tool_call>``, the form the worker's ``hermes``
        parser reads back; a tool's result is a ``tool`` message."""
        tools = normalize_tools(tools)
        messages = normalize_messages(messages)
        if continue_final_message:
            _final_to_continue(messages)
        parts = [f"<|tools|>\n{compact_json(tools)}\n"] if tools else []
        if documents:
            parts.append(f"<|documents|>\n{compact_json(documents)}\n")
        for m in messages:
            calls = "".join(
                f"<tool_call>{compact_json({'name': c['function']['name'], 'arguments': call_arguments(c)})}</tool_call>"
                for c in m.get("tool_calls") or ()
            )
            parts.append(f"<|{m['role']}|>\n{m['content']}{calls}\n")
        if continue_final_message:
            return "".join(parts)[:-1]
        return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **options: Any) -> list[int]:
        return self.encode_chat_text(self.render_chat(messages, tools, **options))

    def encode_chat_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    # The router's hot path: the same ids as ``bytes`` (a sequence of ints), without building a
    # list of one Python int per byte (~5 us per KiB of prompt).
    def encode_prompt_bytes(self, prompt: str) -> bytes:
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        return prompt.encode("utf-8")

    def encode_chat_bytes(
        self, messages: list[dict], tools: list[dict] | None = None, **options: Any
    ) -> bytes:
        return self.render_chat(messages, tools, **options).encode("utf-8")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytearray()
        text: list[str] = []
        for t in token_ids:
            t = int(t)
            if 0 <= t < 256:
                data.append(t)
            elif 256 <= t < self.vocab_size:
                if not skip_special_tokens:
                    text.append(data.decode("utf-8", errors="replace"))
                    data.clear()
                    text.append(self.SPECIALS[t - 256])
            else:
                raise ValueError(f"token id {t} outside the byte vocabulary [0, {self.vocab_size})")
        text.append(data.decode("utf-8", errors="replace"))
        return "".join(text)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for (a special token: its name's UTF-8)."""
        if 0 <= token_id < 256:
            return bytes((token_id,))
        if 256 <= token_id < self.vocab_size:
            return self.SPECIALS[token_id - 256].encode()
        return None


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _find_chat_templates(directory: str, config: dict) -> dict[str, str]:
    """The model's chat templates by name, as transformers reads them: ``default`` from
    chat_template.jinja, chat_template.json or tokenizer_config.json's ``chat_template`` (the first
    there), which may also be a list of named templates (Hermes 2 Pro, Command-R: ``tool_use``,
    ``rag``); then additional_chat_templates/<name>.jinja."""
    templates: dict[str, str] = {}
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            templates["default"] = f.read()
    else:
        template = _read_json(os.path.join(directory, "chat_template.json")).get("chat_template")
        if template is None:
            template = config.get("chat_template")
        if isinstance(template, str):
            templates["default"] = template
        elif isinstance(template, list):
            for t in template:
                if (
                    isinstance(t, dict)
                    and isinstance(t.get("name"), str)
                    and isinstance(t.get("template"), str)
                ):
                    templates[t["name"]] = t["template"]
    extra = os.path.join(directory, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as f:
                    templates.setdefault(name[: -len(".jinja")], f.read())
    return templates


_LONG_TEXT = 16_384  # characters: from here a text is encoded without holding the GIL


class PrefixIds:
    """Token ids of recently rendered chat prompts, by prefix, so a request encodes only the text it
    does not share with one seen before: a conversation's next turn, a new conversation on a known
    system prompt and tools, few-shot examples, a conversation branched at an earlier message (each
    was encoded whole: ~200 ms at 100k tokens). A prompt is cut only right after a special added
    token ``T`` (``<|eot_id|>``, ``<|im_end|>``, ...): ``tokenizers`` splits a text on its added
    tokens before it normalizes, pre-tokenizes or merges, and encodes each piece alone, so
    ids(A + B) == ids(A) + ids(B) when A ends with T, given (checked once, else ``T`` is never a
    cut): T is special, not normalized, without lstrip / rstrip / single_word; no other added token
    contains T or overlaps it (so T matches where it occurs); no truncation or padding; no Metaspace
    that prepends to the first piece only.

    Layout: a tree of pieces. A cut ``PIECE_CHARS`` or more past the last boundary is a boundary
    (read from the text before it alone, so prompts sharing a prefix share its boundaries). A piece
    runs from a boundary (or the start) to a later cut: a piece ends at each boundary, and at each
    prompt's last cut. It holds its own ids and its parent's key (the piece ending where it starts;
    the root: b""). Its key, the 128-bit BLAKE2b of the piece's text keyed by the parent's key (a
    chain: keyed, so no text can pass for another prefix's piece), names the whole prefix: a shared
    prefix is held once, and no text is kept. LRU over pieces; a prompt touches its chain from its
    last piece to the root, so a piece is evicted before its ancestors. A head shorter than
    PIECE_CHARS is not shared. Bounded by ``max_bytes`` between calls; thread-safe."""

    PIECE_CHARS = 1024  # the shortest piece a boundary ends (a piece costs ~300 bytes beside its ids)

    def __init__(
        self,
        tokenizer: Any,
        templates: Sequence[str] = (),
        max_bytes: int = 64 << 20,
        spec: dict | None = None,
    ) -> None:
        """``spec``: the tokenizer's ``tokenizer_spec``, where already read."""
        self.max_bytes = max_bytes
        self.cut_tokens = _exact_cut_tokens(tokenizer, templates, spec)
        self._pieces: OrderedDict[bytes, tuple[bytes, array]] = OrderedDict()  # key -> (parent, ids)
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def encode(self, text: str, encode: Callable[[list[str]], list[list[int]]]) -> list[int]:
        """The ids of ``text`` (``encode``: texts -> their ids), from its longest known prefix ending
        at a cut; the pieces it adds up to its last cut are kept."""
        cuts = sorted({i + len(t) for t in self.cut_tokens for i in _find_all(text, t)})
        if not cuts:
            return encode([text])[0]
        marks = _cuts_of(text, cuts, self.PIECE_CHARS)
        found, ids, own, rest = None, [], 0, marks  # the cut found, its prefix's ids, its piece's own
        for i in range(len(marks) - 1, -1, -1):  # NOTE: a key is hashed only when it is looked up
            with self._lock:
                chain = self._chain(marks[i].key_in(text))
            if chain is not None:
                found, own, rest = marks[i], len(chain[0]), marks[i + 1 :]
                for held in reversed(chain):
                    ids.extend(held)
                break
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        before = {0: 0}  # where a piece starts -> the count of ids before it
        if found is not None:
            before[found.start] = len(ids) - own
            before[found.at] = len(ids)
        # NOTE: a piece ends at each boundary past the cut found, and at the last cut
        ends = [m for m in rest if m.boundary or m is marks[-1]]
        bounds = [found.at if found is not None else 0, *(m.at for m in ends)]
        texts = [text[a:b] for a, b in itertools.pairwise(bounds)]
        if cuts[-1] < len(text):
            texts.append(text[cuts[-1] :])
        parts = iter(encode(texts) if texts else ())
        new = []
        for mark in ends:
            ids.extend(next(parts))
            new.append((mark.key_in(text), mark.parent, array("I", ids[before[mark.start] :])))
            before[mark.at] = len(ids)
        ids.extend(next(parts, ()))  # the text after the last cut
        # NOTE: a piece found that ends at no boundary is a parent of none: the new ones cover it
        replaced = found.key_in(text) if new and found is not None and not found.boundary else None
        self._keep(new, new[-1][0] if new else found.key_in(text), replaced)  # type: ignore[union-attr]
        return ids

    def describe(self) -> dict[str, int]:
        """Lookups that found a prefix / found none, and what the cache holds."""
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._pieces), "bytes": self._bytes}

    def _chain(self, key: bytes) -> list[array] | None:
        """The ids of the pieces from ``key``'s to the root; None if one is no longer held."""
        chain = []
        while key:
            held = self._pieces.get(key)
            if held is None:
                return None
            key, ids = held
            chain.append(ids)
        return chain

    def _keep(self, new: list[tuple[bytes, bytes, array]], last: bytes, replaced: bytes | None) -> None:
        """Add the ``new`` pieces in place of ``replaced``, touch the chain from ``last`` to the root
        (a piece is evicted before its ancestors), and evict the least recently used over the budget."""
        with self._lock:
            if replaced is not None and (gone := self._pieces.pop(replaced, None)) is not None:
                self._bytes -= _piece_bytes(gone[1])
            for key, parent, ids in new:
                if key not in self._pieces:
                    self._pieces[key] = (parent, ids)
                    self._bytes += _piece_bytes(ids)
            key = last
            while key in self._pieces:
                self._pieces.move_to_end(key)
                key = self._pieces[key][0]
            while self._bytes > self.max_bytes and self._pieces:
                self._bytes -= _piece_bytes(self._pieces.popitem(last=False)[1][1])


_PIECE_BYTES = 320  # a piece's memory beside its ids: key, tuple, array header, its slot in the dict


def _piece_bytes(ids: array) -> int:
    return _PIECE_BYTES + ids.itemsize * len(ids)


class _Cut:
    """A cut of a prompt (PrefixIds): the piece ending there."""

    __slots__ = ("_key", "at", "boundary", "parent", "start")

    def __init__(self, at: int, start: int, parent: bytes, boundary: bool, key: bytes | None) -> None:
        self.at, self.start, self.parent, self.boundary = at, start, parent, boundary
        self._key = key  # None until looked up (a boundary's is hashed at once)

    def key_in(self, text: str) -> bytes:
        """The key of the prefix ending here, hashed once."""
        if self._key is None:
            self._key = _digest(text, self.start, self.at, self.parent)
        return self._key


def _cuts_of(text: str, cuts: list[int], piece_chars: int) -> list[_Cut]:
    """Each cut with its piece: a cut ``piece_chars`` or more past the last boundary is one
    (PrefixIds). One hash a piece: another cut's key is hashed only where it is looked up."""
    out = []
    parent, start = b"", 0
    for at in cuts:
        boundary = at - start >= piece_chars
        key = _digest(text, start, at, parent) if boundary else None
        out.append(_Cut(at, start, parent, boundary, key))
        if boundary:
            parent, start = key, at  # type: ignore[assignment]
    return out


def _digest(text: str, start: int, cut: int, parent: bytes) -> bytes:
    """BLAKE2b-128 of ``text[start:cut]`` keyed by the parent piece's key (the root's: b"")."""
    data = text[start:cut].encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, key=parent, digest_size=16).digest()


def _find_all(text: str, token: str) -> Iterator[int]:
    i = text.find(token)
    while i >= 0:
        yield i
        i = text.find(token, i + len(token))


def _exact_cut_tokens(tokenizer: Any, templates: Sequence[str], spec: dict | None = None) -> list[str]:
    """The added tokens a prompt may be cut after (PrefixIds): of those the chat ``templates`` write
    (any subset is exact; a vocabulary may hold hundreds of reserved ones, each a scan of every
    prompt), none where the tokenizer's settings would make a cut inexact."""
    spec = spec if spec is not None else tokenizer_spec(tokenizer)
    if spec is None:
        return []
    pre = json.dumps(spec.get("pre_tokenizer"))
    if spec.get("truncation") or spec.get("padding") or ("Metaspace" in pre and '"first"' in pre):
        return []
    added = [a for a in spec.get("added_tokens") or () if isinstance(a.get("content"), str) and a["content"]]
    # NOTE: a single_word token's boundary is the character before it: after a cut there is none
    words_end = any(a.get("single_word") for a in added)
    return [
        a["content"]
        for a in added
        if a.get("special") and not any(a.get(k) for k in ("normalized", "lstrip", "rstrip", "single_word"))
        and any(a["content"] in template for template in templates)
        and not (words_end and re.search(r"\w$", a["content"]))
        and not any(_overlaps(a["content"], b["content"]) for b in added if b["content"] != a["content"])
    ]  # fmt: skip


def _overlaps(t: str, u: str) -> bool:
    """Could matching ``u`` keep ``t`` from matching where it occurs, or run past its end: ``u``
    contains ``t``, or a proper suffix of one is a proper prefix of the other."""
    return t in u or any(u.endswith(t[:k]) or t.endswith(u[:k]) for k in range(1, min(len(t), len(u))))


class HFTokenizer:
    """A model directory's tokenizer.json (via ``tokenizers``) plus its jinja chat template."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise ValueError(f"no tokenizer.json in {directory}")
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read())
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        # NOTE: the older layout names the special tokens in special_tokens_map.json alone; where both
        # name one, the map's wins, as transformers reads them
        named = {**config, **_read_json(os.path.join(directory, "special_tokens_map.json"))}
        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(named.get(key))
            if content is not None:
                self.special_tokens[key] = content
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        self._add_bos = config.get("add_bos_token")  # None: leave it to tokenizer.json's post-processor
        eos_ids: list[int] = []
        eos = self.special_tokens.get("eos_token")
        if eos is not None and self._tok.token_to_id(eos) is not None:
            eos_ids.append(self._tok.token_to_id(eos))
        for extra in ("generation_config.json", "config.json"):
            eos_ids += _as_id_list(_read_json(os.path.join(directory, extra)).get("eos_token_id"))
        self.eos_token_ids = list(dict.fromkeys(eos_ids))
        self.chat_templates = _find_chat_templates(directory, config)
        self._compiled_templates: dict[str, Any] = {}
        # NOTE: equal names promise equal ids for equal requests: so the settings that add BOS and
        # the chat templates (with the tokens they read) count, beside tokenizer.json
        digest.update(
            json.dumps([self._add_bos, self.special_tokens, self.chat_templates], sort_keys=True).encode()
        )
        self.name = f"hf:{digest.hexdigest()[:16]}"
        spec = tokenizer_spec(self._tok)  # NOTE: serialized and parsed once, for both
        self.prefix_ids = PrefixIds(self._tok, list(self.chat_templates.values()), spec=spec)
        self.max_token_bytes = hf_max_token_bytes(self._tok, spec)

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        ids = self._encode(prompt, self._add_bos is not False)
        if self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_text(self, text: str) -> list[int]:
        return self._encode(text, False)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, no special tokens: several at once through ``encode_batch`` (one call,
        in parallel, without the GIL)."""
        if len(texts) == 1:
            return [self._encode(texts[0], False)]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _encode(self, text: str, special: bool) -> list[int]:
        """``text``'s ids. A long text goes through ``encode_batch``, the same ids, which lets go of the
        GIL while it runs (``encode`` holds it: seconds for megabytes, in which a caller's thread pool
        did not keep the event loop going)."""
        if len(text) < _LONG_TEXT:
            return self._tok.encode(text, add_special_tokens=special).ids
        return self._tok.encode_batch([text], add_special_tokens=special)[0].ids

    def render_chat(
        self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> str:  # fmt: skip
        """The conversation as text, rendered by the model's chat template like HF does (``tools``
        passed to it; tool call arguments as JSON data, which templates expect, as vLLM does; a
        message's reasoning under each name templates read it by, ``_with_thinking``; the request's
        ``template_kwargs`` as more variables). With
        ``continue_final_message`` the text ends right after the last message's content, as HF
        cuts it (no end-of-turn, no generation prompt)."""
        tools = normalize_tools(tools)
        # NOTE: as transformers picks: a request with tools takes the ``tool_use`` template where there is one
        name = "tool_use" if tools and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        template = self._compiled(name)
        # NOTE: text parts stay a list for a template that loops over them (Gemma 3's, Llama 4's), as
        # transformers passes them; others get them joined, as vLLM does (a list would render as one)
        messages = [
            {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": call_arguments(c)}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in map(_with_thinking, normalize_messages(messages, template.loops_over_content))
        ]  # fmt: skip
        if continue_final_message:
            # NOTE: cut at a marker after the content, as HF does: searching for the content itself
            # finds a short prefill ("<", "im") inside the end-of-turn text the template writes after it
            _final_to_continue(messages)
            messages = [*messages[:-1], _tagged_final(messages[-1])]
        from jinja2 import TemplateError

        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                tools=tools,
                documents=documents,
                **self.special_tokens,
                **(template_kwargs or {}),
            )
        except (TemplateError, TypeError, ValueError, LookupError) as exc:
            # NOTE: raise_exception() in the template, or the request's data where the template wants
            # other types (a chat_template_kwargs value added to a string): a bad conversation, a 400
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        if not continue_final_message:
            return text
        end = text.rfind(_CONTINUE_TAG.strip())
        if end < 0:
            raise ChatTemplateError(
                "continue_final_message: the chat template does not write the last message"
            )
        # a template that trims the content also trimmed the marker's space: trim the cut text too
        return text[:end] if text.startswith(_CONTINUE_TAG, end) else text[:end].rstrip()

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **options: Any) -> list[int]:
        return self.encode_chat_text(self.render_chat(messages, tools, **options))

    def encode_chat_text(self, text: str) -> list[int]:
        # NOTE: the template writes BOS itself when the model wants one, so no special tokens here.
        return self.prefix_ids.encode(text, self._encode_texts)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, None where the vocabulary does not say: byte-level BPE
        pieces (GPT-2, Llama 3) map back through the byte alphabet, SentencePiece byte-fallback
        pieces ``<0xNN>`` are that byte, ``▁`` is a space."""
        from tokenizers import decoders

        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return None
        if isinstance(self._tok.decoder, decoders.ByteLevel):
            table = _byte_level_table()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return None if _REPLACEMENT in piece else piece.encode()  # NOTE: an added token, as written
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes((int(piece[3:5], 16),))
        text = piece.replace("\u2581", " ")
        return None if _REPLACEMENT in text else text.encode()

    def _compiled(self, name: str) -> Any:
        if name not in self._compiled_templates:
            self._compiled_templates[name] = _compile_template(self.chat_templates[name])
        return self._compiled_templates[name]


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet, inverted: the printable character that stands for each byte.
    Bytes that print as themselves (33-126, 161-172, 174-255) keep their code point; the other 68
    take 256, 257, ... in byte order."""
    direct = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in direct}
    for offset, b in enumerate(sorted(set(range(256)) - set(direct))):
        table[chr(256 + offset)] = b
    return table


def _compile_template(source: str) -> Any:
    """Jinja environment as HF builds it: sandboxed, trim/lstrip blocks, loop controls,
    ``{% generation %}`` blocks, ``raise_exception``, ``strftime_now`` and a non-ASCII-escaping
    ``tojson``."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: HF's AssistantTracker marks the assistant's
        text with it (for training masks; TRL's assistant_only_loss templates have it). The body
        renders unchanged, in its own scope as a call block, as HF renders it."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    def strftime_now(fmt: str) -> str:
        # NOTE: UTC on both sides (transformers uses the local time): a router and its workers in
        # other time zones, a day apart, rendered one prompt two ways (Llama 3.1 writes the date)
        return datetime.now(timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    template.loops_over_content = _loops_over_content(env.parse(source))
    return template


def _loops_over_content(ast: Any) -> bool:
    """Does a template loop over a message's ``content`` (``for part in message['content']``, filtered
    or not): then it reads content parts as a list."""
    from jinja2 import nodes

    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter | nodes.Test) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return True
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
    return False


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> PromptTokenizer:
    """``"bytes"`` or a directory holding tokenizer.json (a model directory). Loaded once per
    process (the start-up check and the app share it)."""
    if spec == "bytes":
        return ByteTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: expected 'bytes' or a directory with tokenizer.json")
