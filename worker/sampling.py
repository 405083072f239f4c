"""Sampling: per-request temperature / top-k / top-p / seed over a batch of float32 logits.

Pure function of (logits, params, generators); never mutates the logits passed in. Stop handling
(strings, stop ids, max_tokens) belongs to the engine; the parameters only travel with the request.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import reference
from router.block_hash import CACHE_SALT_ERROR, valid_cache_salt
from worker.attention import kernel_ops

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
_MIN_TEMPERATURE, _MAX_TEMPERATURE = 1e-6, 1e6  # what sampling divides by (see _divisor)
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's bound for top_logprobs)
# per request: each output token is checked against every stop string and bad word, on the engine thread
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256

# (sampled token's logprob, top ids, their logprobs), most likely first
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 = all tokens
    min_p: float = 0.0  # [0, 1]: tokens less likely than min_p x the likeliest one's probability are dropped
    seed: int | None = None  # same seed, same prompt -> same tokens
    max_tokens: int = 16  # output tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # special tokens are not text (vLLM's; False: decoded as their names)
    include_stop_str_in_output: bool = False  # a stop string that ends the output is part of it (vLLM's)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob + the top k
    # None: none; k >= 0: every prompt token's logprob (after the first) + the top k at its position.
    # The whole prompt is then computed, cached or not: a cached prefix has no logits.
    prompt_logprobs: int | None = None
    # history-dependent adjustments, applied by worker.penalties before sampling
    repetition_penalty: float = 1.0  # > 0; 1 = off
    frequency_penalty: float = 0.0  # [-2, 2]
    presence_penalty: float = 0.0  # [-2, 2]
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's); None: any
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences never generated (vLLM's)
    min_tokens: int = 0  # output tokens before EOS / stop ids may be sampled
    # scheduling, not sampling (carried here as the request's parameters): lower is served first
    priority: int = 0
    adapter: int = 0  # the LoRA adapter serving the request (0: the base model), by the worker's order
    cache_salt: str | None = None  # vLLM's: cached prefixes shared only with requests of the same salt
    guide: Any = None  # a worker.guided.Guide: the output must follow its grammar (structured outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of an n > 1 request: a seeded request gives it the seed + index, so its
        choices differ from each other and each is reproducible."""
        if index == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=(self.seed + index) % 2**64)

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field; returns self so calls can chain. The
        real-valued fields (temperature, top_p, the penalties, logit_bias values) become floats:
        a JSON integer such as 2**63 is a valid temperature, but not as an int64 tensor."""

        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        temperature = _finite_float(self.temperature)
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        top_p = _finite_float(self.top_p)
        if top_p is None or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        min_p = _finite_float(self.min_p)
        if min_p is None or not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self.temperature, self.top_p, self.min_p = temperature, top_p, min_p
        if not integer(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not integer(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be an integer in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed!r}")
        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not integer(self.priority) or not -(2**31) <= self.priority < 2**31:
            raise ValueError(f"priority must be an integer in [-2**31, 2**31), got {self.priority!r}")
        # NOTE: bounded: each token of each choice is searched for every stop string, on the engine thread
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
        if (
            not isinstance(self.stop_token_ids, list)
            or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
            or not all(integer(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise ValueError(
                f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} non-negative integers"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                f"include_stop_str_in_output must be a boolean, got {self.include_stop_str_in_output!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = _finite_float(getattr(self, name))
            if value is None or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {getattr(self, name)!r}")
            setattr(self, name, value)
        rp = _finite_float(self.repetition_penalty)
        if rp is None or rp <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        self.repetition_penalty = rp
        if not isinstance(self.logit_bias, dict) or not all(
            integer(t) and t >= 0 and (b := _finite_float(v)) is not None and -100.0 <= b <= 100.0
            for t, v in self.logit_bias.items()
        ):
            raise ValueError("logit_bias must map token ids to numbers in [-100, 100]")
        self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list) or not allowed or not all(integer(t) and t >= 0 for t in allowed)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, list) and w and all(integer(t) and t >= 0 for t in w) for w in self.bad_words
        ):
            raise ValueError("bad_words must be a list of token id lists")
        if len(self.bad_words) > 2 * MAX_BAD_WORDS:  # NOTE: each word on its own and after a space
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")
        if not integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (
            not integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not integer(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if self.guide is not None and (self.ignore_eos or self.min_tokens):
            # NOTE: a finished grammar allows EOS only, which both of these forbid
            raise ValueError("ignore_eos and min_tokens cannot be combined with structured outputs")
        if not valid_cache_salt(self.cache_salt):
            raise ValueError(CACHE_SALT_ERROR)
        if self.guide is not None and self.allowed_token_ids is not None:
            # NOTE: the grammar's tokens and these need not meet: no token would be left to sample
            raise ValueError("allowed_token_ids cannot be combined with structured outputs or tools")
        return self


def _finite_float(value: object) -> float | None:
    """``value`` as a finite float; None for a bool, a non-number, NaN, an infinity, or an int too
    large for a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded from ``params.seed`` (None when unseeded). Keep one per request for its
    whole life so that its token stream, not just its first token, is reproducible."""
    if params.seed is None:
        return None
    seed = params.seed % 2**64
    if torch.device(device).type == "cpu":
        # NOTE: the CPU generator (a Mersenne twister) keeps a seed's low 32 bits: seeds 2**32 apart drew
        # the same tokens. Its high half is folded in (a seed below 2**32 is unchanged); CUDA's keeps 64
        seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return torch.Generator(device=device).manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` [B, V] float32 -> int64 [B] (on logits' device).

    ``generators[i]`` drives request i's randomness; when ``generators`` is None, seeded requests
    get a fresh generator from their seed on each call.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} sampling params")
    if generators is None:
        generators = [make_generator(p, logits.device) for p in params]
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    index = on_device(rows, logits.device, torch.int64)
    scores = logits.index_select(0, index).float()
    temps = on_device([_divisor(params[i].temperature) for i in rows], logits.device, scores.dtype)
    scores = _tempered(scores, temps.unsqueeze(1))
    scores = _mask_min_p(scores, [params[i].min_p for i in rows])
    scores = _mask_top_k_top_p(scores, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
    probs = scores.softmax(dim=-1)
    # NOTE: exponential race: argmax(p / E), E ~ Exp(1), draws from p. A seeded row's noise comes
    # from its own generator, so one request's seed never depends on its batch neighbours; the
    # unseeded rows share one draw from the default generator (one kernel for all of them).
    noise = torch.empty_like(probs)
    seeded = [(j, generators[i]) for j, i in enumerate(rows) if generators[i] is not None]
    if len(seeded) < len(rows):
        noise.exponential_()
    for j, generator in seeded:
        noise[j].exponential_(generator=generator)
    out[index] = (probs / noise).argmax(dim=-1)
    return out


def on_device(values: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (a list or a numpy array) as a tensor on ``device``, copied from pinned memory
    without waiting for the work queued on the device (the step a sampled step may be queued
    behind: --overlap-schedule)."""
    host = torch.tensor(values, dtype=dtype)  # NOTE: a copy: the caller may reuse its array
    if device.type == "cuda":
        # NOTE: torch.tensor(numpy_array, pin_memory=True) raises; pinning the built tensor works
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _tempered(scores: torch.Tensor, divisors: torch.Tensor | float) -> torch.Tensor:
    """Scores [rows, V] over their temperature's divisor, each row less its top score first (the same
    distribution): a large logit over a tiny temperature passed float32's range, and +inf made the
    row NaN, which samples id 0 whatever was banned."""
    return (scores - scores.amax(dim=-1, keepdim=True)) / divisors


def _divisor(temperature: float) -> float:
    """What a row's float32 logits are divided by: the temperature, kept where float32 division
    stays finite (a valid 1e-300 or 1e300 would make inf / 0 and then NaN, and a NaN row samples
    tokens that top-k, a grammar or min_tokens excluded). Below 1e-6 sampling is the argmax but
    for ties; above 1e6 it is uniform over the tokens allowed."""
    return min(max(float(temperature), _MIN_TEMPERATURE), _MAX_TEMPERATURE)


# NOTE: up to this many rows the vocabulary sort beats the top-p threshold kernel (one program per
# row, 32 passes over it): the whole top-p mask on an H100 at vocabulary 128,256, call and device ms,
# sorted 0.45 / 0.51 / 0.51 / 0.55 / 0.61 / 0.90 at 1 / 2 / 4 / 8 / 16 / 32 rows, the kernel's
# 0.54 / 0.58 / 0.59 / 0.62 / 0.60 / 0.62 (docs/benchmarks/sampling-nvidia-h100-80gb-hbm3.json:
# python -m worker.bench_sampling's sorted_mask_wins_up_to, the largest batch the sort still won).
SORT_MAX_ROWS = 8


def _mask_min_p(scores: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Set to -inf every token whose probability is under its row's ``min_p`` times the likeliest
    token's: p_i < min_p * p_max is s_i < s_max + ln(min_p) on the scores (logits over the
    temperature), so no softmax is needed, and the same tokens stay whether top-k / top-p cut the
    row before or after (they keep the likeliest token and renormalise the rest alike)."""
    if all(p <= 0.0 for p in min_p):
        return scores
    floor = on_device([math.log(p) if p > 0.0 else -math.inf for p in min_p], scores.device, scores.dtype)
    threshold = scores.max(dim=-1, keepdim=True).values + floor.unsqueeze(1)
    return scores.masked_fill(scores < threshold, float("-inf"))


def _mask_top_k_top_p(
    scores: torch.Tensor, top_k: list[int], top_p: list[float], *, sort_max_rows: int | None = None
) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k and its top-p nucleus; ties at a cut all stay
    (the k-th score's, the nucleus' last), so a row keeps the same tokens whichever way it is ranked,
    as it must: the ranking depends on the batch. It is ranked by topk when every row has a top_k;
    on the kernels, when some row has none and there are more than ``sort_max_rows`` rows (default
    SORT_MAX_ROWS), by cuts and a threshold kernel instead (_mask_without_sort); else by sorting the
    vocabulary (topk and sort order tied scores differently: a cut by rank alone kept other tokens)."""
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return scores
    vocab = scores.shape[-1]
    keep = [vocab if k == -1 else min(k, vocab) for k in top_k]
    width = max(keep)
    ops = kernel_ops(scores.device)
    many = scores.shape[0] > (SORT_MAX_ROWS if sort_max_rows is None else sort_max_rows)
    if width == vocab and ops is not reference and many:
        return _mask_without_sort(scores, keep, top_p, ops)
    # NOTE: only the ranked scores are used, not which of tied tokens ranks first (the ranking's)
    if width < vocab:  # every row keeps at most `width` tokens: its candidates, in order, from topk
        sorted_scores = scores.topk(width, dim=-1).values
    else:
        sorted_scores = scores.sort(dim=-1, descending=True).values
    k = on_device(keep, scores.device, torch.int64).unsqueeze(1)
    kth = sorted_scores.gather(1, k - 1)  # each row's k-th score: everything at or above it stays
    if all(p >= 1.0 for p in top_p):
        return scores.masked_fill(scores < kth, float("-inf"))
    ranks = torch.arange(width, device=scores.device).unsqueeze(0)
    sorted_scores = sorted_scores.masked_fill(ranks >= k, float("-inf"))
    # the mass over what top-k kept, its ties past the k ranked included (they all score the k-th's)
    past = ((scores >= kth).sum(dim=-1, keepdim=True) - k).clamp(min=0)
    total = torch.cat([sorted_scores, kth + past.to(scores.dtype).log()], dim=-1).logsumexp(
        dim=-1, keepdim=True
    )
    probs = (sorted_scores - total).exp()
    # a token stays if the tokens ranked above it hold less than top_p of the mass (the top one always)
    mass_before = probs.cumsum(dim=-1) - probs
    p = on_device(top_p, scores.device, probs.dtype).unsqueeze(1)
    # NOTE: the top token is kept explicitly (a top_p that underflows float32 to 0 would drop it), and
    # a top_p of 1 keeps every token (float32 sums reach 1 before the last ones)
    kept = ((mass_before < p) | (ranks == 0) | (p >= 1.0)) & (ranks < k)
    last = sorted_scores.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)  # the nucleus' lowest
    return scores.masked_fill(scores < last, float("-inf"))


def _mask_without_sort(scores: torch.Tensor, keep: list[int], top_p: list[float], ops: Any) -> torch.Tensor:
    """_mask_top_k_top_p on the kernels for a batch in which some row has no top_k (``keep``: each
    row's k, the vocabulary size for none), without sorting the vocabulary: each top-k row is cut
    below its k-th score (from topk of the largest such k), then every row below its top-p threshold
    on what is left (kernels/sampling.py). Ties at a cut all stay."""
    vocab = scores.shape[-1]
    limited = [k for k in keep if k < vocab]
    if limited:
        kth = scores.topk(max(limited), dim=-1).values
        k = on_device(keep, scores.device, torch.int64).unsqueeze(1)
        cut = kth.gather(1, k.clamp(max=kth.shape[1]) - 1).masked_fill(k == vocab, float("-inf"))
        scores = scores.masked_fill(scores < cut, float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = scores.softmax(dim=-1)
        p = on_device(top_p, scores.device, torch.float32)
        # NOTE: a top_p of 1 keeps every token (float32 sums reach 1 before the last ones)
        threshold = ops.top_p_threshold(probs, p).masked_fill(p >= 1.0, 0.0)
        scores = scores.masked_fill(probs < threshold.unsqueeze(1), float("-inf"))
    return scores


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: Sequence[int]) -> list[TokenLogprobs]:
    """For each row of ``logits`` [B, V]: the log-probability of ``tokens[i]`` and the ``top[i]``
    most likely tokens with theirs, under the model's own distribution (log-softmax of the raw
    logits: before temperature, top-k and top-p, so equal prompts give equal numbers whatever the
    sampling settings). One transfer to the host for the whole batch."""
    if logits.dim() != 2 or logits.shape[0] != len(top) or tokens.shape != (len(top),):
        raise ValueError(
            f"logits {tuple(logits.shape)} / tokens {tuple(tokens.shape)} do not match {len(top)} rows"
        )
    return logprob_lists(*(t.tolist() for t in logprob_tensors(logits, tokens, top)), top)


def logprob_tensors(
    logits: torch.Tensor, tokens: torch.Tensor, top: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_logprobs' numbers on ``logits``' device, nothing read back: the chosen tokens'
    log-probabilities [B], and the top max(top) log-probabilities and ids per row [B, k]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1).long()).squeeze(1)
    values, ids = logp.topk(min(max(top, default=0), logp.shape[1]), dim=-1)
    return chosen, values, ids


def logprob_lists(chosen: list, values: list, ids: list, top: Sequence[int]) -> list[TokenLogprobs]:
    """logprob_tensors' numbers, read back as lists, per row: (logprob, top ids, top logprobs)."""
    return [(c, i[:n], v[:n]) for c, i, v, n in zip(chosen, ids, values, top, strict=True)]


def accept_draft(
    logits: torch.Tensor, draft: Sequence[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """Speculative decoding's check of one request's draft tokens: ``logits`` [k + 1, V] are the
    model's rows for its last token and its k drafts. Returns the drafts it keeps (a leading run)
    then one token of its own, so 1 to k + 1 tokens: the tokens sampling them one at a time gives.
    Each row draws its token as ``sample`` does (an exponential race over the row's distribution
    after temperature, top-k and top-p); a draft is kept while it is the row's draw, and the first
    draw that differs ends the run (a draft d is kept with probability p(d), as in the rule of
    Leviathan et al. for a draft that is one fixed token). A seeded ``generator`` is left where
    decoding the tokens returned one at a time leaves it: the rows past them give back their
    draws, so a seeded request gets the same tokens whether or not a step speculates."""
    k = len(draft)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {k} draft tokens")
    if params.greedy:
        return accept_greedy(logits.argmax(dim=-1).tolist(), draft)
    scores = _mask_min_p(_tempered(logits.float(), _divisor(params.temperature)), [params.min_p] * (k + 1))
    scores = _mask_top_k_top_p(scores, [params.top_k] * (k + 1), [params.top_p] * (k + 1))
    probs = scores.softmax(dim=-1)
    noise = torch.empty_like(probs)
    if generator is None:
        noise.exponential_()
        return accept_greedy((probs / noise).argmax(dim=-1).tolist(), draft)
    # NOTE: row by row, each draw the size of a decode step's (one row), so row j's noise is what
    # the (j + 1)-th token decoded one at a time would draw; the state before each row is kept to
    # give back the draws of the rows after the returned tokens
    states = []
    for row in noise:
        states.append(generator.get_state())
        row.exponential_(generator=generator)
    tokens = accept_greedy((probs / noise).argmax(dim=-1).tolist(), draft)
    if len(tokens) <= k:
        generator.set_state(states[len(tokens)])
    return tokens


def accept_greedy(best: Sequence[int], draft: Sequence[int]) -> list[int]:
    """``accept_draft`` for a greedy request from its rows' argmax ids (k + 1 of them)."""
    kept = 0
    while kept < len(draft) and best[kept] == draft[kept]:
        kept += 1
    return [*draft[:kept], int(best[kept])]
