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
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("none", "qwen3", "deepseek_r1")  # vLLM's names; both read the same tags


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


class ReasoningSplitter:
    """One choice's text, fed as it is generated, split into (reasoning, content) pieces."""

    def __init__(self, thinking: bool = False) -> None:
        self._state = "reasoning" if thinking else "start"  # start: not yet known whether it thinks
        self._pending = ""  # text held back: possibly the start of a tag
        self.reasoning_tokens = 0  # tokens generated while thinking, the tags' own included
        self._undecided = 0  # tokens generated before it was known whether the answer thinks

    def count(self, tokens: int) -> None:
        """Attribute ``tokens`` just generated, before their text is fed: to the thinking while it
        lasts (the one that closes it included)."""
        if self._state == "reasoning":
            self.reasoning_tokens += tokens
        elif self._state == "start":
            self._undecided += tokens

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

    def take(self, text: str, final: bool) -> tuple[str, str]:
        """``feed(text)``, and when the answer ends with it (``final``) what was held back too."""
        reasoning, content = self.feed(text)
        if final:
            rest = self.flush()
            reasoning, content = reasoning + rest[0], content + rest[1]
        return reasoning, content


def split(text: str, thinking: bool = False) -> tuple[str, str]:
    """A whole answer as (reasoning, content)."""
    return ReasoningSplitter(thinking).take(text, final=True)
