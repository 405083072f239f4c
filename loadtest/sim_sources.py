"""Request sources for the fleet simulator: generated workloads (loadtest/workloads.py) and
recorded traces (loadtest/trace.py), as timed token-id requests with their follow-ups."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from loadtest.trace import TRACE_BLOCK_TOKENS, read_trace
from loadtest.workloads import continue_body, generate, random_text
from router.tokenization import ByteTokenizer


def _synthetic_ids(rid: int, n: int) -> np.ndarray:
    """Token ids for generated output nobody else shares (only the finished sequence is cached)."""
    return ((np.arange(n, dtype=np.int64) + (1 << 29) + rid * 1031) % (1 << 31)).astype(np.int32)


class WorkloadSource:
    """A loadtest.workloads workload as token ids: UTF-8 bytes of the prompt rendered like the
    router's default ``bytes`` tokenizer. A multi-turn reply is seeded text of ``max_tokens``
    characters; the worker caches prompt + reply (whole pages, up to the reply's last token, which
    has no K/V), so the next turn can hit nearly all of it."""

    weight = 1.0  # real tokens per simulated token

    def __init__(self, name: str, n: int, rate: float, max_tokens: int, seed: int, options: dict) -> None:
        self.name, self.rate, self.seed, self.options = name, rate, seed, options
        self.reqs = generate(name, n, seed=seed, rate=rate, max_tokens=max_tokens, **options)
        self._next = {r.after: r.id for r in self.reqs if r.after is not None}
        self._tok = ByteTokenizer()
        self.reset()

    def describe(self) -> dict[str, Any]:
        return {"workload": self.name, "requests": len(self.reqs), "rate": self.rate, "seed": self.seed,
                "options": self.options}  # fmt: skip

    def reset(self) -> None:
        self._full: dict[int, dict] = {}  # full bodies a later turn still has to extend

    def first_turns(self) -> list[tuple[float, int]]:
        return sorted((r.arrival_s, r.id) for r in self.reqs if r.after is None)

    def _reply(self, rid: int) -> str:
        return random_text(random.Random(f"reply:{self.seed}:{rid}"), self.output_steps(rid))

    def prompt_ids(self, rid: int) -> np.ndarray:
        r = self.reqs[rid]
        body = r.body if r.after is None else continue_body(self._full.pop(r.after), self._reply(r.after), r)
        if rid in self._next:
            self._full[rid] = body
        text = (
            self._tok.render_chat(body["messages"], body.get("tools"))
            if "messages" in body
            else body["prompt"]
        )
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    def output_ids(self, rid: int) -> np.ndarray:
        if rid in self._next:
            return np.frombuffer(self._reply(rid).encode(), np.uint8).astype(np.int32)
        return _synthetic_ids(rid, self.output_steps(rid))

    def output_steps(self, rid: int) -> int:
        return max(1, int(self.reqs[rid].body.get("max_tokens") or 1))

    def group(self, rid: int) -> str:
        """What shares the request's prefix; a request that shares nothing is a group of its own (as the
        trace's records without hash ids are), so ``sticky`` does not pin all of them to one worker."""
        group = self.reqs[rid].group
        return f"unique-{rid}" if group == "unique" else group

    def next_turn(self, rid: int) -> int | None:
        return self._next.get(rid)

    def think_s(self, rid: int) -> float:
        return self.reqs[rid].think_time_s

    def drop_conversation(self, rid: int) -> int:
        """``rid`` was rejected: its later turns are never sent. Returns how many."""
        dropped, nxt = 0, self._next.get(rid)
        self._full.pop(rid, None)
        while nxt is not None:
            dropped, nxt = dropped + 1, self._next.get(nxt)
        return dropped


class TraceSource:
    """A Mooncake trace with each 512-token hash id mapped straight to ``tokens_per_block``
    synthetic token ids (id * tokens_per_block + j), so leading shared ids are shared prefixes.
    Costs are charged in real tokens: one simulated token stands for ``weight`` real ones."""

    def __init__(self, path: str, limit: int | None, tokens_per_block: int, time_scale: float, seed: int):
        if tokens_per_block <= 0 or TRACE_BLOCK_TOKENS % tokens_per_block:
            raise ValueError(f"tokens per block must divide {TRACE_BLOCK_TOKENS}")
        self.path, self.tpb, self.time_scale = path, tokens_per_block, time_scale
        self.recs = read_trace(path, limit)
        self.weight = TRACE_BLOCK_TOKENS / tokens_per_block

    def describe(self) -> dict[str, Any]:
        return {"trace": self.path, "requests": len(self.recs), "tokens_per_block": self.tpb,
                "time_scale": self.time_scale}  # fmt: skip

    def reset(self) -> None:
        pass

    def first_turns(self) -> list[tuple[float, int]]:
        t0 = self.recs[0].timestamp_ms if self.recs else 0.0
        return sorted(((r.timestamp_ms - t0) / 1e3 * self.time_scale, i) for i, r in enumerate(self.recs))

    def prompt_ids(self, rid: int) -> np.ndarray:
        rec, tpb = self.recs[rid], self.tpb
        n = max(1, rec.input_length * tpb // TRACE_BLOCK_TOKENS)
        nb = -(-n // tpb)
        # NOTE: blocks past the record's ids are private to it: a range no hash id reaches.
        private = (1 << 30) + rid * 512 * tpb
        bases = [rec.hash_ids[b] * tpb if b < len(rec.hash_ids) else private + b * tpb for b in range(nb)]
        ids = (np.asarray(bases, dtype=np.int64)[:, None] + np.arange(tpb)).reshape(-1)[:n]
        return (ids % (1 << 31)).astype(np.int32)

    def output_ids(self, rid: int) -> np.ndarray:
        return _synthetic_ids(rid, -(-self.output_steps(rid) // int(self.weight)))

    def output_steps(self, rid: int) -> int:
        return max(1, self.recs[rid].output_length)

    def group(self, rid: int) -> str:
        ids = self.recs[rid].hash_ids
        return f"root-{ids[0]}" if ids else f"private-{rid}"

    def next_turn(self, rid: int) -> int | None:
        return None

    def think_s(self, rid: int) -> float:
        return 0.0

    def drop_conversation(self, rid: int) -> int:
        return 0


Source = WorkloadSource | TraceSource
