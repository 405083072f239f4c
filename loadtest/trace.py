"""Mooncake-format trace replay: JSONL records (timestamp ms, lengths, 512-token block ids) -> requests.

Each block id becomes a fixed block of text seeded by the id, so requests that share leading
ids share an exact text prefix. Never invents sharing the trace does not have.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from loadtest.workloads import Request, random_text

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake release


@dataclass(slots=True)
class TraceRecord:
    timestamp_ms: float  # arrival, milliseconds from the trace start
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: list[int]  # one id per block_tokens-token block of the prompt


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The first ``limit`` records (all when None) of a JSONL trace; blank lines are skipped."""
    records: list[TraceRecord] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
                records.append(
                    TraceRecord(
                        float(row["timestamp"]),
                        int(row["input_length"]),
                        int(row["output_length"]),
                        [int(h) for h in row["hash_ids"]],
                    )
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from e
    return records


def block_text(hash_id: int, n_chars: int, seed: int = 0) -> str:
    """The text of one block: depends only on (seed, hash_id, n_chars)."""
    return random_text(random.Random(f"trace-block:{seed}:{hash_id}"), n_chars)


def trace_requests(
    records: list[TraceRecord],
    *,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    block_chars: int | None = None,
    time_scale: float = 1.0,
    max_input_tokens: int | None = None,
    max_tokens: int | None = None,
    api: str = "chat",
    model: str = "default",
    seed: int = 0,
) -> list[Request]:
    """Requests replaying ``records``.

    - ``block_chars`` (default ``block_tokens``): characters of text per block; smaller values
      shrink every prompt by ``block_chars / block_tokens`` (a CPU-sized replay), keeping the
      block sharing structure.
    - ``time_scale``: multiplies arrival times (0.1 = ten times faster); the earliest arrives at 0.
    - ``max_input_tokens``: prompts are cut to this many trace tokens before scaling.
    - ``max_tokens``: caps each request's ``output_length``.
    """
    block_chars = block_tokens if block_chars is None else block_chars
    # NOTE: a NaN or infinite scale makes NaN arrivals, and every request is sent at once
    if block_tokens <= 0 or block_chars <= 0 or not 0 <= time_scale < math.inf:
        raise ValueError(
            "block_tokens and block_chars must be positive, time_scale >= 0 and finite (got block_tokens "
            f"{block_tokens}, block_chars {block_chars}, time_scale {time_scale})"
        )
    cache: dict[int, str] = {}
    # NOTE: the earliest, not the first line: an arrival before 0 would be sent at once, not in its gap
    t0 = min((rec.timestamp_ms for rec in records), default=0.0)
    out: list[Request] = []
    for i, rec in enumerate(records):
        n_tokens = rec.input_length if max_input_tokens is None else min(rec.input_length, max_input_tokens)
        n_chars = max(1, n_tokens * block_chars // block_tokens)
        n_blocks = -(-n_chars // block_chars)
        parts = []
        for b in range(n_blocks):
            if b < len(rec.hash_ids):
                h = rec.hash_ids[b]
                if h not in cache:
                    cache[h] = block_text(h, block_chars, seed)
                parts.append(cache[h])
            else:  # NOTE: a record longer than its ids: the tail is private to this request
                parts.append(random_text(random.Random(f"trace-tail:{seed}:{i}:{b}"), block_chars))
        text = "".join(parts)[:n_chars]
        out_len = max(1, rec.output_length if max_tokens is None else min(rec.output_length, max_tokens))
        body: dict = {"model": model, "max_tokens": out_len, "temperature": 0.0}
        if api in ("chat", "responses"):  # NOTE: the driver turns a chat body into a Responses one
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        arrival = (rec.timestamp_ms - t0) / 1000.0 * time_scale
        group = f"root-{rec.hash_ids[0]}" if rec.hash_ids else "empty"
        out.append(Request(i, arrival, api, body, group))
    return out


def load_trace(path: str | Path, *, limit: int | None = None, **options) -> list[Request]:
    """``read_trace`` then ``trace_requests`` with ``options``."""
    return trace_requests(read_trace(path, limit), **options)
