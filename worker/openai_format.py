"""OpenAI response bodies for the worker: whole answers, stream chunks, usage and logprobs, in the
chat shape and the legacy completions shape, built from what the engine produced per choice.

Logprobs entries name tokens by their text (the tokenizer's decode of that one token, special
tokens included) and, in the chat shape, their bytes (``None`` where the vocabulary cannot say).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.responses import StreamingResponse

from router.tokenization import PromptTokenizer
from worker.engine_api import RequestOutput
from worker.reasoning import Splitter
from worker.sampling import TokenLogprobs
from worker.tool_calls import ToolOutput

Logprob = tuple[int, TokenLogprobs | None]  # a token and its numbers (None: a prompt's first token)


class TokenNames:
    """Token id -> (text, UTF-8 bytes as a list of ints or None), memoised: a stream with top-20
    logprobs names 21 tokens per generated token, mostly the same few hundred. The text is the
    token's bytes where they are whole characters, else its decode alone (U+FFFD for part of one)."""

    def __init__(self, tokenizer: PromptTokenizer, max_entries: int = 1 << 16) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._names: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        name = self._names.get(token_id)
        if name is None:
            if len(self._names) >= self.max_entries:
                self._names.clear()
            raw = self.tokenizer.token_bytes(token_id)
            text = _utf8(raw)
            if text is None:  # NOTE: part of a character, or bytes the vocabulary does not give: its decode
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)  # type: ignore[call-arg]
            name = self._names[token_id] = (text, None if raw is None else list(raw))
        return name


def _utf8(raw: bytes | None) -> str | None:
    """A token's bytes as text when they are whole UTF-8 characters: the text it adds to an answer
    (a SentencePiece ``▁word`` piece is " word", where decoding it alone strips the space)."""
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass
class Choice:
    """One choice of a request as it is being answered."""

    index: int
    prompt: int = 0  # which prompt of a batched completions request
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)  # not yet sent (stream) or all of them
    text_offset: int = 0  # completions shape: characters of token text before the next token
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids id that ended it
    completion_tokens: int = 0
    cached_tokens: int = 0
    tools: ToolOutput | None = None  # chat with tools: the text becomes content and tool calls
    reasoning: Splitter | None = None  # chat with --reasoning-parser: thinking apart from content
    # completions ``echo``: the prompt's text, sent before the first output, and its ids (whose
    # logprobs come with the first output when logprobs are asked for)
    echo: str | None = None
    prompt_ids: list[int] | None = None
    scoring_only: bool = False  # max_tokens 0 with echo: the one token generated is not answered
    token_ids: list[int] = field(default_factory=list)  # generated ids not yet sent (return_token_ids)
    prompt_sent: bool = False  # a stream's choice has sent its prompt's ids (completions shape)

    reasoning_text: list[str] = field(default_factory=list)  # a whole answer's thinking (with ``reasoning``)

    def visible(self, out: RequestOutput) -> str:
        """The text of ``out`` the client sees (the echoed prompt first)."""
        head, self.echo = self.echo or "", None
        return head + ("" if self.scoring_only else out.text)

    def collect(self, out: RequestOutput) -> bool:
        """A whole answer's part: keep the text of ``out`` (its thinking apart, with ``reasoning``) and
        account it (``add``); True when it finishes this choice."""
        finished = self.add(out)  # NOTE: first: the splitter knows the last token before it splits its text
        text = self.visible(out)
        if self.reasoning is not None:
            thought, text = self.reasoning.take(text, finished)
            self.reasoning_text.append(thought)
        self.text.append(text)
        return finished

    def add(self, out: RequestOutput) -> bool:
        """Account one engine output (its text aside; its tokens counted as thinking or not by their
        own text); True when it finishes this choice."""
        if self.reasoning is not None:
            self.reasoning.count(out.token_ids, out.own_text())
        if out.prompt_logprobs is not None and self.prompt_ids is not None:
            self.logprobs.extend(zip(self.prompt_ids, out.prompt_logprobs, strict=True))
        if out.logprobs is not None and not self.scoring_only:
            self.logprobs.append((out.token_ids[0], out.logprobs))
        if not self.scoring_only:
            self.token_ids += out.token_ids
        self.completion_tokens, self.cached_tokens = out.completion_tokens, out.cached_tokens
        if self.scoring_only:
            self.completion_tokens = 0
        if out.finish_reason is not None:
            self.finish_reason = (
                "length" if self.scoring_only and out.finish_reason != "error" else out.finish_reason
            )
            self.stop_reason = None if self.scoring_only else out.stop_reason
        return out.finish_reason is not None


# NOTE: JSON allows these raw, but line readers built on str.splitlines (Python's, httpx's
# iter_lines) cut an event's data line at them; escaped, every event stays one line.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_json(obj: Any) -> bytes:
    """``obj`` as JSON for one server-sent event's data line."""
    data = orjson.dumps(obj)
    if b"\xe2\x80" in data or b"\xc2\x85" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A streamed answer (server-sent events), not buffered by proxies on the way."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


def logprob_entry(names: TokenNames, entry: Logprob) -> dict:
    """One token's ``{token, logprob, bytes, top_logprobs}`` (chat's and the Responses API's shape)."""
    token, (logprob, top_ids, top_lps) = entry  # type: ignore[misc]
    text, raw = names(token)
    top = []
    for tid, lp in zip(top_ids, top_lps, strict=True):
        t, b = names(tid)
        top.append({"token": t, "logprob": lp, "bytes": b})
    return {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": top}


def usage(prompt_tokens: list[int], choices: list[Choice]) -> dict:
    """One request's usage: each prompt once, the tokens of every choice, and as cached per prompt
    the fewest any of its choices found (the others share the pages the first one computed)."""
    completion = sum(c.completion_tokens for c in choices)
    cached = [min(c.cached_tokens for c in choices if c.prompt == p) for p in range(len(prompt_tokens))]
    out = {
        "prompt_tokens": sum(prompt_tokens),
        "completion_tokens": completion,
        "total_tokens": sum(prompt_tokens) + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached)},
    }
    if choices and choices[0].reasoning is not None:  # NOTE: --reasoning-parser: the thinking's share
        thinking = sum(c.reasoning.reasoning_tokens for c in choices if c.reasoning is not None)
        out["completion_tokens_details"] = {"reasoning_tokens": thinking}
    return out


class Responses:
    """Bodies of one request's answer: ``chat`` picks the shape, ``logprobs`` whether choices
    carry a logprobs object (else ``null``)."""

    def __init__(
        self, rid: str, model: str, chat: bool, names: TokenNames, logprobs: bool, simulated: bool,
        prompt_ids: list[list[int]] | None = None, ids_as_tokens: bool = False,
    ) -> None:  # fmt: skip
        self.rid, self.model, self.chat = rid, model, chat
        self.names, self.logprobs, self.simulated = names, logprobs, simulated
        if ids_as_tokens:  # NOTE: vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
            self.names = lambda t: (f"token_id:{t}", names(t)[1])  # type: ignore[assignment]
        # vLLM's return_token_ids: each prompt's ids, and every choice's generated ids (EOS included)
        self.prompt_ids = prompt_ids
        self.show_reasoning = True  # vLLM's include_reasoning: false drops the thinking (still split off)
        self.created = int(time.time())

    def _ids(self, c: Choice, choice: dict, first: bool) -> dict:
        """``choice`` with the ids generated since the last chunk (and with the completions shape, on
        the first, the prompt's), when the request asked for them."""
        if self.prompt_ids is not None:
            if first and not self.chat:
                choice["prompt_token_ids"] = self.prompt_ids[c.prompt]
            choice["token_ids"], c.token_ids = c.token_ids, []
        return choice

    def _envelope(self, obj: str, **rest: Any) -> dict:
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, **rest}
        if self.simulated:
            body["simulated"] = True
        return body

    def whole(self, choices: list[Choice], prompt_tokens: list[int]) -> dict:
        """The non-streamed answer."""
        out = []
        for c in choices:
            text = "".join(c.text)
            lp = self._take_logprobs(c)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if c.tools is not None:
                    message = c.tools.message(text)
                    finish = c.tools.finish_reason(finish)
                if c.reasoning is not None:
                    message["content"] = message["content"] or None  # NOTE: all thinking: no content
                    if self.show_reasoning:
                        message["reasoning"] = message["reasoning_content"] = (
                            "".join(c.reasoning_text) or None
                        )
                choice = {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish,
                          "stop_reason": c.stop_reason}  # fmt: skip
            else:
                choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}  # fmt: skip
            out.append(self._ids(c, choice, True))
        obj = "chat.completion" if self.chat else "text_completion"
        if self.chat and self.prompt_ids is not None:
            return self._envelope(obj, choices=out, usage=usage(prompt_tokens, choices),
                                  prompt_token_ids=self.prompt_ids[0])  # fmt: skip
        return self._envelope(obj, choices=out, usage=usage(prompt_tokens, choices))

    def role_chunk(self, index: int, forced_call: bool = False) -> dict:
        """A chat stream's first chunk of a choice (``forced_call``: a ``tool_choice`` that forces
        calls, whose answer has no content: null, as the whole answer's, as OpenAI sends it)."""
        delta = {"role": "assistant", "content": None if forced_call else ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if self.prompt_ids is not None:
            choice["token_ids"] = []
            return self._envelope(
                "chat.completion.chunk", choices=[choice], prompt_token_ids=self.prompt_ids[0]
            )
        return self._envelope("chat.completion.chunk", choices=[choice])

    def chunk(self, c: Choice, text: str, finish_reason: str | None = None) -> dict | None:
        """A stream chunk with ``text`` and the logprobs of the tokens generated since the last
        (``null`` when there are none, as on a finish chunk); None when it would say nothing (text
        held back as a possible reasoning tag: an empty ``content`` would tell clients the answer
        has begun)."""
        lp = self._take_logprobs(c) if c.logprobs else None
        if self.chat:
            reasoning = ""
            if c.reasoning is not None:
                reasoning, text = self._split(c, text, finish_reason is not None)
                if not (reasoning or text or finish_reason or lp or self.prompt_ids is not None):
                    return None
            # NOTE: with a reasoning parser, no empty content while text is held (a chunk that carries
            # only logprobs or token ids says nothing of the answer having begun)
            empty_ok = finish_reason is None and c.reasoning is None
            delta = {"content": text} if text or empty_ok else {}
            if reasoning:
                delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            return self._envelope("chat.completion.chunk", choices=[self._ids(c, choice, False)])
        choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        first, c.prompt_sent = not c.prompt_sent, True
        return self._envelope("text_completion", choices=[self._ids(c, choice, first)])

    def tool_chunks(self, c: Choice, text: str, finish_reason: str | None = None) -> list[dict]:
        """A chat stream's chunks for a choice with tools: ``text`` as content and tool call deltas
        (none while text is held back), then the finish chunk when ``finish_reason`` is given."""
        assert c.tools is not None
        reasoning = ""
        if c.reasoning is not None:
            reasoning, text = self._split(c, text, finish_reason is not None)
        deltas = [{"reasoning": reasoning, "reasoning_content": reasoning}] if reasoning else []
        deltas += c.tools.feed(text) + (c.tools.flush() if finish_reason is not None else [])
        out = []
        for delta in deltas:
            lp = self._take_logprobs(c) if c.logprobs else None
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": None}
            out.append(self._envelope("chat.completion.chunk", choices=[self._ids(c, choice, False)]))
        if finish_reason is not None:
            lp = self._take_logprobs(c) if c.logprobs else None
            choice = {"index": c.index, "delta": {}, "logprobs": lp,
                      "finish_reason": c.tools.finish_reason(finish_reason), "stop_reason": c.stop_reason}  # fmt: skip
            out.append(self._envelope("chat.completion.chunk", choices=[self._ids(c, choice, False)]))
        return out

    def _split(self, c: Choice, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of a stream's next ``text`` for choice ``c`` (all of it when ``final``)."""
        assert c.reasoning is not None
        reasoning, content = c.reasoning.take(text, final)
        return (reasoning if self.show_reasoning else ""), content

    def usage_chunk(self, choices: list[Choice], prompt_tokens: list[int]) -> dict:
        """A stream's last chunk (before ``[DONE]``): no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, choices=[], usage=usage(prompt_tokens, choices))

    # ------------------------------------------------------------------ logprobs
    def _take_logprobs(self, c: Choice) -> dict | None:
        if not self.logprobs:
            return None
        entries, c.logprobs = c.logprobs, []
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        return self._completion_logprobs(c, entries)

    def _chat_entry(self, entry: Logprob) -> dict:
        return logprob_entry(self.names, entry)

    def _completion_logprobs(self, c: Choice, entries: list[Logprob]) -> dict:
        """The legacy shape: parallel lists; each ``top_logprobs`` dict holds the top tokens and
        the sampled one (so up to k + 1 keys; tokens spelt alike, as the pieces of one UTF-8 character that
        each read "\ufffd", share a key holding the likeliest's logprob); ``text_offset`` counts
        characters of token text."""
        tokens, lps, tops, offsets = [], [], [], []
        for token, numbers in entries:
            text = self.names(token)[0]
            tokens.append(text)
            if numbers is None:  # an echoed prompt's first token: nothing predicts it
                lps.append(None)
                tops.append(None)
            else:
                logprob, top_ids, top_lps = numbers
                top: dict[str, float] = {}
                for tid, lp in zip(top_ids, top_lps, strict=True):  # most likely first: it keeps a shared key
                    top.setdefault(self.names(tid)[0], lp)
                top.setdefault(text, logprob)
                lps.append(logprob)
                tops.append(top)
            offsets.append(c.text_offset)
            c.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
