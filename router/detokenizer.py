"""Generated ids to streamed text (the worker's output side of router.tokenization's tokenizers)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from router.tokenization import PromptTokenizer

_REPLACEMENT = "\ufffd"
# A UTF-8 character is a lead byte and at most 3 continuation bytes, so a detokenizer window that
# starts inside a character is at most 3 tokens past the character's first one.
_MAX_STEPS_BACK = 3
# ids a window may grow to while its text still ends inside a character: past it, what is held goes out
# (bytes no later byte completes, e.g. continuation bytes with no first byte), or every feed would
# decode the whole answer again
_MAX_WINDOW = 64


class IncrementalDetokenizer:
    """Streams text from generated ids: ``feed`` returns only newly completed text.

    NOTE: trailing U+FFFD (half a UTF-8 character, or an unfinished byte-fallback sequence) is held
    back until the character completes or ``flush`` is called (or, bytes no later byte completes, until
    the window has grown to ``_MAX_WINDOW`` ids). Text is decoded over a short window
    of ids (re-anchored at clean boundaries) that starts with a few earlier ids, so tokenizers that
    strip a leading space at the start of a decode (SentencePiece) still space words correctly.
    The window never starts inside a character: SentencePiece's byte fallback decodes a whole run
    of ``<0xNN>`` tokens as U+FFFD when any of it is not UTF-8, so a run cut mid-character would
    stay U+FFFD for every byte token that joins it later.
    Special tokens are not text, except those ``show`` names (a tool call's tags for its reader), or
    all of them with ``skip_special_tokens`` false.
    """

    def __init__(
        self, tokenizer: PromptTokenizer, prompt_ids: Sequence[int] = (), context: int = 5,
        skip_special_tokens: bool = True,
    ) -> None:  # fmt: skip
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._context = max(1, context)  # ids kept before the unread ones
        self._shown: frozenset[int] = frozenset()  # special tokens decoded as their text
        self._special: dict[int, bool] = {}  # token id -> is it special (asked only once one is shown)
        self._ids: list[int] = [int(t) for t in list(prompt_ids)[-(self._context + _MAX_STEPS_BACK) :]]
        self._start = self._prompt_start()  # the window is _ids[_start:]
        self._emitted = 0  # chars of the window's text already out
        self._unfinished = ""  # the prompt's trailing U+FFFD: a character the output may complete
        self._prompt_out()

    def _prompt_out(self) -> None:
        """The prompt's text is out, but for a character its last ids leave unfinished (U+FFFD): if the
        output completes it, it is the output's; if not, its U+FFFD stays the prompt's."""
        ids = self._ids[self._start :]
        text = self._decode(ids)
        self._emitted = len(text.rstrip(_REPLACEMENT))
        # NOTE: SentencePiece's byte fallback makes a whole run of byte tokens U+FFFD when it ends
        # unfinished: the whole characters before the unfinished one's first byte are the prompt's too
        lead = self._unfinished_from(ids)
        if 0 < lead < len(ids):
            self._emitted = max(self._emitted, len(self._decode(ids[:lead])))
        self._unfinished = text if self._emitted < len(text) else ""  # the prompt's text, when it ends so

    def _unfinished_from(self, ids: list[int]) -> int:
        """The index in ``ids`` of the token holding the first byte of a character they leave
        unfinished, read from the tokens' bytes; ``len(ids)`` when they end on a whole character, or
        a token's bytes are not known (a special token, an unknown piece)."""
        tail, owner = b"", []  # the last tokens' bytes, and which token each byte is of
        for i in range(len(ids) - 1, max(-1, len(ids) - 2 - _MAX_STEPS_BACK), -1):
            data = self._tok.token_bytes(ids[i])
            if not data:
                return len(ids)
            tail, owner = data + tail, [i] * len(data) + owner
            first = next((k for k in range(len(tail) - 1, -1, -1) if not 0x80 <= tail[k] < 0xC0), None)
            if first is not None:  # the last character's first byte: is the character whole?
                lead = tail[first]
                width = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
                return owner[first] if len(tail) - first < width else len(ids)
        return len(ids)

    def _first(self, text: str) -> None:
        """Before the first text after the prompt's (``text``: the window's): what of the prompt's
        trailing U+FFFD the output left as it was is the prompt's, not the output's."""
        if self._unfinished and len(text) > self._emitted:
            prompt, same = self._unfinished, self._emitted
            while same < min(len(prompt), len(text)) and prompt[same] == text[same]:
                same += 1
            self._emitted, self._unfinished = same, ""

    def show(self, special_ids: Collection[int]) -> None:
        """Decode these special tokens as their text (other special tokens stay hidden). Called
        before the first generated id is fed."""
        self._shown = frozenset(int(t) for t in special_ids)
        self._prompt_out()

    def feed(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in new_ids)
        text = self._decode(self._ids[self._start :])
        stable = len(text.rstrip(_REPLACEMENT))
        if stable > self._emitted:
            self._first(text)
        out = text[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        size = len(self._ids) - self._start
        # NOTE: a window held past _MAX_WINDOW ids with no start to restart at: it cannot complete
        if size > 2 * self._context and not self._restart_window(text) and size > _MAX_WINDOW:
            out += text[self._emitted :]
            self._start = len(self._ids) - self._context
            self._emitted = len(self._decode(self._ids[self._start :]))
        return out

    def _restart_window(self, text: str) -> bool:
        """Restart the window (``text`` its text) a few ids back, at the first start (stepping back)
        whose text is the end of ``text``, so the next decodes go on from the same characters; what is
        not out yet (a character the text ends inside) stays not out. A start inside a character
        decodes its first bytes as U+FFFD, which are out already. False where no start within reach
        will do (bytes that are not UTF-8): the window grows until a later feed finds one."""
        held = len(text) - self._emitted
        newest = len(self._ids) - self._context
        for start in range(newest, max(self._start, newest - _MAX_STEPS_BACK - 1), -1):
            window = self._decode(self._ids[start:])
            rest = window.lstrip(_REPLACEMENT) if held else window
            if text.endswith(rest) and len(rest) >= held:
                self._start, self._emitted = start, len(window) - held
                return True
        return False

    def _prompt_start(self) -> int:
        """Where the window starts in the prompt's last ids: ``context`` ids back, or up to
        ``_MAX_STEPS_BACK`` more to the token holding a character's first byte. (Read from the
        token's bytes: the prompt's text is out already, so no decode tells where it was cut.)"""
        start = max(0, len(self._ids) - self._context)
        for _ in range(_MAX_STEPS_BACK):
            data = self._tok.token_bytes(self._ids[start]) if start > 0 else None
            if not data or not 0x80 <= data[0] < 0xC0:  # not a UTF-8 continuation byte
                break
            start -= 1
        return start

    def flush(self) -> str:
        """Whatever is still held back (possibly U+FFFD for an unfinished character)."""
        text = self._decode(self._ids[self._start :])
        self._first(text)
        out = text[self._emitted :]
        self._emitted = len(text)
        return out

    def _decode(self, ids: list[int]) -> str:
        if not self._skip_special:
            return self._tok.decode(ids, skip_special_tokens=False)  # type: ignore[call-arg]
        if not self._shown:
            return self._tok.decode(ids)
        # NOTE: one decode with the shown tokens kept, as the tokenizer joins special tokens to text
        kept = [t for t in ids if t in self._shown or not self._is_special(t)]
        return self._tok.decode(kept, skip_special_tokens=False)  # type: ignore[call-arg]

    def _is_special(self, token_id: int) -> bool:
        """A special token is one the tokenizer decodes to nothing unless asked to keep specials."""
        special = self._special.get(token_id)
        if special is None:
            hidden = self._tok.decode([token_id]) == ""
            shown = self._tok.decode([token_id], skip_special_tokens=False) != ""  # type: ignore[call-arg]
            special = self._special[token_id] = hidden and shown
        return special
