"""Logit adjustments that depend on a request's history: repetition / frequency / presence
penalties, ``logit_bias`` and ``min_tokens``. Applied to the raw float32 logits before sampling
(greedy included); logprobs are read from the logits before these adjustments.

Semantics (those of vLLM and HF, which OpenAI clients expect):
- ``repetition_penalty`` r over every token of prompt and output: a positive logit is divided by r,
  a negative one multiplied (r > 1 discourages repeats, r < 1 encourages them);
- ``frequency_penalty`` f and ``presence_penalty`` p over the output only: logit -= f * count + p
  * (count > 0);
- ``logit_bias``: token id -> value added to its logit;
- ``min_tokens`` m: while fewer than m tokens are out, EOS and ``stop_token_ids`` cannot be sampled.

Rows that use none of them cost nothing; the others cost a few small ops each per step (the output's
token counts are rebuilt from its ids every step: O(output length)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.sampling import SamplingParams

# (token ids so far: prompt + output, prompt length, ids that end the request)
History = tuple[Sequence[int], int, frozenset[int]]


def adjusts(p: SamplingParams) -> bool:
    return bool(
        p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
        or p.logit_bias
        or p.min_tokens
    )


def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History]
) -> torch.Tensor:
    """``logits`` [B, V] with each row adjusted for its request; the input is returned untouched
    when no row needs anything, else a new tensor."""
    rows = [i for i, p in enumerate(params) if adjusts(p)]
    if not rows:
        return logits
    out = logits.float().clone()
    vocab, device = out.shape[1], out.device
    for i in rows:
        p, row = params[i], out[i]
        ids, prompt_len, stop_ids = histories[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(ids)), device=device, dtype=torch.long)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = ids[prompt_len:]
        if (p.frequency_penalty or p.presence_penalty) and len(output):
            counts = torch.bincount(torch.tensor(list(output), device=device), minlength=vocab)[
                :vocab
            ].float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        bias = {t: b for t, b in p.logit_bias.items() if t < vocab}
        if bias:
            index = torch.tensor(list(bias), device=device, dtype=torch.long)
            row[index] += torch.tensor(list(bias.values()), device=device, dtype=row.dtype)
        stops = sorted(t for t in stop_ids if t < vocab)
        if len(output) < p.min_tokens and stops:
            row[torch.tensor(stops, device=device, dtype=torch.long)] = float("-inf")
    return out
