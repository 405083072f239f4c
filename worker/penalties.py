"""Logit adjustments that depend on a request's history: repetition / frequency / presence
penalties, ``logit_bias``, ``min_tokens``, ``bad_words`` and ``allowed_token_ids``. Applied to the
raw float32 logits before sampling (greedy included); logprobs are read from the logits before these
adjustments.

Semantics (those of vLLM and HF, which OpenAI clients expect):
- ``repetition_penalty`` r over every token of prompt and output: a positive logit is divided by r,
  a negative one multiplied (r > 1 discourages repeats, r < 1 encourages them);
- ``frequency_penalty`` f and ``presence_penalty`` p over the output only: logit -= f * count + p
  * (count > 0);
- ``logit_bias``: token id -> value added to its logit;
- ``min_tokens`` m: while fewer than m tokens are out, EOS and ``stop_token_ids`` cannot be sampled;
- ``bad_words`` (token sequences): a word's last token cannot be sampled where the output ends with
  the rest of the word (a one-token word never);
- ``allowed_token_ids``: no other token can be sampled (applied last, so the bans above still hold).

Rows that use none of them cost nothing. The others are adjusted together, a handful of tensor ops
per step whatever their number: each kind of adjustment is one scatter over flat (row, token)
indices. A request's ``memo`` keeps what carries over between its steps: the prompt's distinct ids
(on the logits' device) and its output ids as a numpy array, to which each step appends only the
tokens that are new, so the host's work per step grows with the batch, not with the output's
length; the output ids are copied to the device as one array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.sampling import SamplingParams, on_device

# (token ids so far: prompt + output, prompt length, ids that end the request, the request's memo
# dict for what carries over between its steps: its prompt's distinct ids and its output ids so far,
# or None)
History = tuple[Sequence[int], int, frozenset[int], dict | None]


_FINITE = torch.finfo(torch.float32).max


def adjusts(p: SamplingParams) -> bool:
    return bool(
        p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
        or p.logit_bias
        or p.min_tokens
        or p.bad_words
        or p.allowed_token_ids is not None
    )


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History],
    unseen: tuple[torch.Tensor, Sequence[int]] | None = None,
    drafted: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """``logits`` [B, V] with each row adjusted for its request; the input is returned untouched
    when no row needs anything, else a new float32 tensor. Beyond each row's history:
    - ``unseen``: (tokens [B] on the logits' device, rows): each of those rows' newest output token
      is ``tokens[row]``, not yet in its history (a step scheduled ahead of the one that samples it:
      --overlap-schedule);
    - ``drafted``: per row, draft tokens that follow its history (a verify step scores row j of a
      request as if ``draft[:j]`` were out); they are not kept in the memo.

    Nothing here waits for the device: index lists travel through pinned memory, and no op has an
    output whose size depends on the data."""
    rows = [i for i, p in enumerate(params) if adjusts(p)]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]

    def tensor(values: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return on_device(values, device, dtype)

    some = len(rows) < len(params)
    index = tensor(rows, torch.long) if some else None
    sub = logits.index_select(0, index).float() if some else logits.float().clone()
    flat = sub.view(-1)
    ps = [params[i] for i in rows]
    hs = [histories[i] for i in rows]
    pending = set() if unseen is None else set(unseen[1])
    late = [r for r, i in enumerate(rows) if i in pending]  # adjusted rows with a token on the device

    extra = [()] * len(rows) if drafted is None else [drafted[i] for i in rows]
    # the output's tokens as flat indices (row * vocab + id), for penalties and repetition
    outputs = [_output_ids(h) for h in hs]
    counts = [
        o.size + len(e) + (rows[r] in pending) for r, (o, e) in enumerate(zip(outputs, extra, strict=True))
    ]
    per_row = [
        np.concatenate([o, np.asarray(e, dtype=np.int64)]) if e else o
        for o, e in zip(outputs, extra, strict=True)
    ]
    output = np.concatenate([ids + r * vocab for r, ids in enumerate(per_row)])
    out_flat = tensor(output, torch.long)
    if late:
        assert unseen is not None
        newest = unseen[0].index_select(0, tensor([rows[r] for r in late], torch.long))
        out_flat = torch.cat([out_flat, newest.long() + tensor([r * vocab for r in late], torch.long)])

    # NOTE: every update below touches only the (row, token) pairs it concerns: no [rows, vocab]
    # temporaries; where a pair repeats, each write puts the same value
    if any(p.repetition_penalty != 1.0 for p in ps):
        prompts = [_prompt_ids(h, device, vocab) for h in hs]
        sizes = [t.numel() for t in prompts]
        offsets = torch.repeat_interleave(  # NOTE: output_size given: no wait for the device to count
            tensor([r * vocab for r in range(len(hs))], torch.long),
            tensor(sizes, torch.long),
            output_size=sum(sizes),
        )
        seen = torch.cat([torch.cat(prompts) + offsets, out_flat])
        rp = tensor([float(p.repetition_penalty) for p in ps], torch.float32)[seen // vocab]
        values = flat[seen]
        # NOTE: clamped: an extreme penalty (1e-39, 1e39) made values inf, and an inf row NaN, which
        # samples id 0 whatever was banned
        flat[seen] = torch.where(values > 0, values / rp, values * rp).clamp_(-_FINITE, _FINITE)
    if (output.size or late) and any(p.frequency_penalty or p.presence_penalty for p in ps):
        f = tensor([float(p.frequency_penalty) for p in ps], torch.float32)
        pr = tensor([float(p.presence_penalty) for p in ps], torch.float32)
        owner = out_flat // vocab
        flat[out_flat] = flat[out_flat] - pr[owner]  # once per distinct token
        flat.index_add_(0, out_flat, -f[owner])  # once per occurrence: -f x count
    bias = [(r * vocab + t, float(b)) for r, p in enumerate(ps) for t, b in p.logit_bias.items() if t < vocab]
    if bias:
        flat.index_add_(
            0, tensor([i for i, _ in bias], torch.long), tensor([b for _, b in bias], torch.float32)
        )
    stops = [
        r * vocab + t
        for r, (p, (_, _, stop_ids, _), count) in enumerate(zip(ps, hs, counts, strict=True))
        if count < p.min_tokens
        for t in stop_ids
        if t < vocab
    ]
    if stops:
        # NOTE: index_fill_ takes the scalar as an argument; an indexed assignment of a Python float
        # copies it to the device as a tensor, which waits for the device (a sync in a chained step)
        flat.index_fill_(0, tensor(stops, torch.long), float("-inf"))
    banned, if_newest = _bad_word_bans(ps, per_row, late, vocab)
    if banned:
        flat.index_fill_(0, tensor(banned, torch.long), float("-inf"))
    if if_newest:
        # NOTE: the token before a word's last is the newest, still on the device: compared there
        assert unseen is not None
        newest = unseen[0].index_select(0, tensor([rows[r] for _, r, _ in if_newest], torch.long)).long()
        hit = newest == tensor([t for _, _, t in if_newest], torch.long)
        ban = torch.zeros(len(if_newest), dtype=torch.float32, device=device).masked_fill_(hit, float("-inf"))
        flat.index_add_(0, tensor([i for i, _, _ in if_newest], torch.long), ban)
    allowed = [r for r, p in enumerate(ps) if p.allowed_token_ids is not None]
    if allowed:
        keep = torch.cat([_allowed_ids(ps[r], hs[r], device, vocab) + r * vocab for r in allowed])
        values = flat[keep]
        sub.index_fill_(0, tensor(allowed, torch.long), float("-inf"))
        flat[keep] = values
    if not some:
        return sub
    return logits.float().index_copy(0, index, sub)


def _bad_word_bans(
    ps: Sequence[SamplingParams], outputs: Sequence[np.ndarray], late: Sequence[int], vocab: int
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The (row, token) pairs, as flat indices, that the rows' bad words ban at this step: a word's
    last token where the output ends with the rest of it. A ``late`` row's newest token is not in its
    output yet: for a word it may complete, (flat index, row, the token the newest must be)."""
    banned: list[int] = []
    if_newest: list[tuple[int, int, int]] = []
    late_rows = set(late)
    for r, p in enumerate(ps):
        out = outputs[r]
        for word in p.bad_words:
            *head, last = word
            if last >= vocab:
                continue
            expected = None
            if r in late_rows and head:
                *head, expected = head
            if len(head) > out.size or (head and out[out.size - len(head) :].tolist() != head):
                continue
            if expected is None:
                banned.append(r * vocab + last)
            else:
                if_newest.append((r * vocab + last, r, expected))
    return banned, if_newest


def _allowed_ids(p: SamplingParams, history: History, device: torch.device, vocab: int) -> torch.Tensor:
    """A request's ``allowed_token_ids`` in the vocabulary, on ``device`` (kept in its memo)."""
    memo = history[3]
    cached = None if memo is None else memo.get("allowed_ids")
    if cached is None or cached.device != device:
        assert p.allowed_token_ids is not None
        cached = on_device([t for t in p.allowed_token_ids if t < vocab], device, torch.long)
        if memo is not None:
            memo["allowed_ids"] = cached
    return cached


def _output_ids(history: History) -> np.ndarray:
    """A request's output ids (int64), from its memo: only the tokens out since the last call are
    appended (the buffer doubles when full). The history is assumed to only grow; a shorter one
    starts the buffer again."""
    ids, prompt_len, _, memo = history
    total = len(ids) - prompt_len
    if memo is None:
        return np.asarray(ids[prompt_len:], dtype=np.int64)
    buf, known = memo.get("output_ids", (None, 0))
    if buf is None or total < known:
        buf, known = np.empty(max(16, total), dtype=np.int64), 0
    if total > known:
        if total > buf.size:
            grown = np.empty(max(2 * buf.size, total), dtype=np.int64)
            grown[:known] = buf[:known]
            buf = grown
        buf[known:total] = ids[prompt_len + known :]
        memo["output_ids"] = (buf, total)
    return buf[:total]


def _prompt_ids(history: History, device: torch.device, vocab: int) -> torch.Tensor:
    """The distinct ids of a request's prompt on ``device``, from its memo after the first step."""
    ids, prompt_len, _, memo = history
    cached = None if memo is None else memo.get("prompt_ids")
    if cached is None or cached.device != device:
        cached = on_device(sorted({t for t in ids[:prompt_len] if t < vocab}), device, torch.long)
        if memo is not None:
            memo["prompt_ids"] = cached
    return cached
