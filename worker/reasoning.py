"""Reasoning output (``--reasoning-parser``): a chat answer's thinking, between ``<think>`` and
``</think>`` (Qwen3, DeepSeek-R1 and the models trained like them), is returned apart from its
content, as ``reasoning`` (vLLM's and OpenAI's name for it) and ``reasoning_content`` (DeepSeek's and
SGLang's), streamed or not.

An answer is thinking from its start when it opens with ``<think>`` (leading whitespace allowed) or
when its prompt ends inside an open ``<think>`` (chat templates that start the thinking themselves:
DeepSeek-R1, Qwen3's thinking-only releases); the thinking ends at ``</think>`` and the rest is
content. An answer that does not start thinking is all content; one cut off while thinking is all
reasoning. The tags themselves are in neither. The split does not depend on how the text is cut
into stream chunks: text that may be the start of a tag is held back until it is known.

gpt-oss answers in its harmony format instead: messages ``<|channel|>NAME<|message|>TEXT<|end|>``, each
after ``<|start|>assistant``; the ``analysis`` channel is its thinking, ``final`` (and ``commentary``,
its preambles) the content, a message ``to=functions.NAME`` a tool call (HarmonySplitter; the answer
decoded with its special tokens kept).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

OPEN, CLOSE = "<think>", "</think>"
# vLLM's names; qwen3 and deepseek_r1 read the same tags, gpt_oss harmony's channels
PARSERS = ("none", "qwen3", "deepseek_r1", "gpt_oss")
# the parsers that read their markers from special tokens: answers are decoded with them kept
SPECIAL_TOKEN_PARSERS = ("gpt_oss",)


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag`` (kept back for the next chunk)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Does a rendered prompt end inside a ``<think>`` it opened (the answer starts as thinking)?"""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class Splitter:
    """What both splitters share: ``feed`` a piece of the answer, ``flush`` at its end."""

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def flush(self) -> tuple[str, str]:
        raise NotImplementedError

    def count(self, token_ids: Sequence[int]) -> None:
        """Account the tokens just generated (before their text is fed)."""
        raise NotImplementedError

    def is_answer(self) -> bool | None:
        """Is the next token counted part of the answer (content), not thinking or markers? None
        while that is not known yet (the answer's first tokens, before it shows whether it thinks)."""
        raise NotImplementedError

    def lead_was_answer(self) -> bool:
        """Once ``is_answer`` is known: were the tokens counted while it was not (None) the answer's?"""
        raise NotImplementedError

    def take(self, text: str, final: bool) -> tuple[str, str]:
        """``feed(text)``, and when the answer ends with it (``final``) what was held back too."""
        reasoning, content = self.feed(text)
        if final:
            rest = self.flush()
            reasoning, content = reasoning + rest[0], content + rest[1]
        return reasoning, content


class ReasoningSplitter(Splitter):
    """One choice's text, fed as it is generated, split into (reasoning, content) pieces."""

    def __init__(self, thinking: bool = False) -> None:
        self._state = "reasoning" if thinking else "start"  # start: not yet known whether it thinks
        self._pending = ""  # text held back: possibly the start of a tag
        self.reasoning_tokens = 0  # tokens generated while thinking, the tags' own included
        self._undecided = 0  # tokens generated before it was known whether the answer thinks

    def is_answer(self) -> bool | None:
        return None if self._state == "start" else self._state == "content"

    def lead_was_answer(self) -> bool:
        return not self.reasoning_tokens  # NOTE: they count as thinking if the answer opened with it

    def count(self, token_ids: Sequence[int]) -> None:
        """Attribute the tokens just generated, before their text is fed: to the thinking while it
        lasts (the one that closes it included)."""
        if self._state == "reasoning":
            self.reasoning_tokens += len(token_ids)
        elif self._state == "start":
            self._undecided += len(token_ids)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (with what was held back) makes known."""
        text, self._pending = self._pending + text, ""
        reasoning = content = ""
        while text:
            if self._state == "start":
                lead = text.lstrip()
                if lead.startswith(OPEN):
                    text, self._state = lead[len(OPEN) :], "reasoning"
                    self.reasoning_tokens, self._undecided = self.reasoning_tokens + self._undecided, 0
                elif OPEN.startswith(lead):  # whitespace, or a part of the tag: not known yet
                    self._pending = text
                    return reasoning, content
                else:
                    self._state, self._undecided = "content", 0
            elif self._state == "reasoning":
                at = text.find(CLOSE)
                if at >= 0:
                    reasoning += text[:at]
                    text, self._state = text[at + len(CLOSE) :], "content"
                else:
                    keep = _held(text, CLOSE)
                    reasoning += text[: len(text) - keep]
                    self._pending = text[len(text) - keep :]
                    return reasoning, content
            else:
                content += text
                text = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The end of the answer: what was held back, as what it turned out to be."""
        text, self._pending = self._pending, ""
        if self._state == "reasoning":
            return text, ""
        return "", text


def split(text: str, thinking: bool = False) -> tuple[str, str]:
    """A whole answer as (reasoning, content)."""
    return ReasoningSplitter(thinking).take(text, final=True)


# harmony's markers (gpt-oss): a message's header ends at MESSAGE, its text at one of BODY_ENDS
CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"([^\s<]*)")  # a header's channel: up to a space or a marker
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")  # a message's tool: to=functions.NAME, before or after the channel
_OPEN_CALL, _CLOSE_CALL = "<tool_call>", "</tool_call>"  # how a call reaches worker.tool_calls (hermes)
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")


class HarmonySplitter(Splitter):
    """ReasoningSplitter's interface over gpt-oss's harmony messages: the ``analysis`` channel's text is
    reasoning, every other channel's content; headers (``<|start|>assistant<|channel|>final``) and markers
    are in neither. A message addressed to a tool (``to=functions.NAME`` in its header) is a call: it goes
    to the content whole, once it ends, as the hermes call ``<tool_call>{"name": NAME, "arguments": TEXT}
    </tool_call>`` that worker.tool_calls reads (the default --tool-call-parser). Text before any marker
    (an answer that is not in the format, e.g. under a JSON grammar) is content once the answer ends
    without one."""

    def __init__(self, thinking: bool = False, ends: Mapping[int, str] | None = None) -> None:
        """``ends``: the end tokens (EOS ids: gpt-oss's ``<|call|>``, ``<|return|>``) by id, with their
        marker: the engine keeps such a token out of the text, so an answer it ends is closed by it here
        (a call it ends is whole, not cut off)."""
        del thinking  # NOTE: harmony names each message's channel; nothing is inferred from the prompt
        self._ends = ends or {}
        self._last: int | None = None  # the last token generated
        self._state = "header"  # header: reading up to <|message|>; body: a message's text
        self._channel = ""
        self._recipient = ""  # the tool a message is addressed to ("" for none)
        self._call = ""  # the text of a message to a tool, so far
        self._header = ""  # the current header's text so far
        self._seen_marker = False
        self._pending = ""  # body text held back: possibly the start of a marker
        self.reasoning_tokens = 0  # tokens generated in analysis messages (their markers included)

    def is_answer(self) -> bool | None:
        if self._state == "header" and not self._seen_marker:  # NOTE: a header, or an answer in no message
            return None
        return self._state == "body" and self._channel != "analysis" and not self._recipient

    def lead_was_answer(self) -> bool:
        return not self._seen_marker  # NOTE: the first message's header, unless no message came

    def count(self, token_ids: Sequence[int]) -> None:
        if self._state == "body" and self._channel == "analysis" and not self._recipient:
            self.reasoning_tokens += len(token_ids)
        if token_ids:
            self._last = token_ids[-1]

    def feed(self, text: str) -> tuple[str, str]:
        text, self._pending = self._pending + text, ""
        reasoning = content = ""
        while text:
            if self._state == "header":
                text, self._header = self._header + text, ""
                at = text.find(MESSAGE)
                if at < 0:
                    self._header = text
                    break
                header, text = text[:at], text[at + len(MESSAGE) :]
                self._seen_marker, self._state = True, "body"
                channel, recipient = _CHANNEL_NAME.search(header), _RECIPIENT.search(header)
                self._channel = channel.group(1) if channel else ""
                self._recipient = recipient.group(1).removeprefix("functions.") if recipient else ""
                continue
            ends = [(at, end) for end in BODY_ENDS if (at := text.find(end)) >= 0]
            if ends:
                at, end = min(ends)
                body, text = text[:at], text[at + len(end) :]
                self._state = "header"
            else:
                keep = max(_held(text, end) for end in BODY_ENDS)
                body, self._pending, text = text[: len(text) - keep], text[len(text) - keep :], ""
            if self._recipient:
                self._call += body
                if self._state == "header":  # NOTE: the call is whole
                    content += self._take_call()
            elif self._channel == "analysis":
                reasoning += body
            else:
                content += body
        return reasoning, content

    def _take_call(self) -> str:
        call = {"name": self._recipient, "arguments": self._call.strip()}
        self._call, self._recipient = "", ""
        return f"{_OPEN_CALL}{json.dumps(call, ensure_ascii=False)}{_CLOSE_CALL}"

    def flush(self) -> tuple[str, str]:
        end = self._ends.get(self._last) if self._state == "body" else None  # type: ignore[arg-type]
        if end is not None:  # NOTE: the answer's last token ended its message
            reasoning, content = self.feed(end)
            rest = self.flush()
            return reasoning + rest[0], content + rest[1]
        text, self._pending = self._pending, ""
        if self._state == "header":  # NOTE: an answer with no message at all is plain content
            text, self._header = ("" if self._seen_marker else self._header), ""
            return "", text
        if self._recipient:  # NOTE: a call cut off: its text is content, as a hermes call cut off is
            text, self._call, self._recipient = self._call + text, "", ""
            return "", text
        return (text, "") if self._channel == "analysis" else ("", text)


def splitter(parser: str, thinking: bool = False, ends: Mapping[int, str] | None = None) -> Splitter:
    """The splitter of ``--reasoning-parser`` ``parser`` (not "none") for one answer (``ends``:
    HarmonySplitter's)."""
    return HarmonySplitter(ends=ends) if parser == "gpt_oss" else ReasoningSplitter(thinking)
