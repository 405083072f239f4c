"""What a kernels.bench result decides: the rule of each candidate that waits for a GPU run (docs/kernels.md,
"Candidates and the rules that take them") applied to the result's numbers, and the gpu-bench step to run next
on the same machine. Reads a result; changes no default itself (a person applies what a rule takes).

`python -m kernels.bench_rules RESULT.json [--seconds S]` prints one line a rule, then the next step's command
as its last line, so a device call can run it while the machine is still held: `eval "$(... | tail -1)"`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kernels.bench_report import LONG_CONTEXT, MANY_REQUESTS, split_speedup, summarize

DEEP_PREFIX = 8192  # extend_attention.DEEP_PREFIX: where the eager split is on (a test keeps them equal)
FP8_REGIMES = (("below", lambda b: b < MANY_REQUESTS), ("from", lambda b: b >= MANY_REQUESTS))  # batch
# the next step, by what the rules took: (its deadline in s, the gpu-bench arguments)
TUNE_DECODE = (300, "tune /tmp/gt -- --kind decode")
TUNE_FP8_DECODE = (200, "tune /tmp/gt -- --kind decode --kv-dtype fp8")
TUNE_FP8_EXTEND = (200, "tune /tmp/gt -- --kind extend --kv-dtype fp8")
FP8_ENGINE = (150, "worker /tmp/gw -- --kv-cache-dtype fp8_e4m3")
MARGIN_S = 20  # of the seconds a call has left, kept for what runs after the step (packing its files)
# extend_fp8_speedup_min before the fp8 pool's extend tiles (FP8_PREFIX_TILES) were tuned: H200, 2026-11-29,
# second run, 0.705 at 16 x (16384 + 1024)
LAST_EXTEND_FP8_MIN = 0.705


@dataclass(frozen=True)
class Decision:
    rule: str  # its label in docs/kernels.md's table, e.g. "1(a)"
    what: str  # what taking it changes
    taken: bool | None  # None: this result did not time it
    why: str  # the numbers the rule read
    candidate: str | None = None  # 1(a), 1(b): the decode candidate the rule weighs

    def line(self) -> str:
        verdict = {True: "TAKE", False: "keep", None: "untimed"}[self.taken]
        return f"{self.rule:6} {verdict:8} {self.what}: {self.why}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def decode_candidates(speedups: dict[str, dict]) -> list[Decision]:
    """1(a)-(c): the slots a tile ahead (`slots`) or its pipelined tiles (`pipelined`) below MANY_REQUESTS,
    `slots` from it, and PDL with them (`slots_pdl`) where it passes the same test as the candidate taken."""

    def below(name: str) -> tuple[bool | None, str]:
        s = speedups.get(name)
        if s is None or s["at_batch_1_long_context"] is None:
            return None, f"{name} not timed at 1 x {LONG_CONTEXT}"
        at, least = s["at_batch_1_long_context"], s["min_elsewhere_below_many_requests"]
        ok = at >= 1.02 and least is not None and least >= 0.98
        return ok, f"{name} {_fmt(at)} at 1 x {LONG_CONTEXT} (>= 1.02), least below {_fmt(least)} (>= 0.98)"

    def many(name: str) -> tuple[bool | None, str]:
        s = speedups.get(name)
        if s is None or s["min_from_many_requests"] is None:
            return None, f"{name} not timed from {MANY_REQUESTS} requests"
        least, most = s["min_from_many_requests"], s["max_from_many_requests"]
        return (
            least >= 1.0 and most >= 1.02,
            f"{name} least {_fmt(least)} (>= 1.0), most {_fmt(most)} (>= 1.02)",
        )

    def with_pdl(taken: bool | None, pdl: bool | None) -> bool | None:
        return None if taken is None or pdl is None else taken and pdl

    timed = [n for n in ("slots", "pipelined") if below(n)[0] is not None]
    faster = max(timed, key=lambda n: speedups[n]["at_batch_1_long_context"], default="slots")
    taken, why = below(faster)
    pdl, pdl_why = below("slots_pdl")
    taken_many, why_many = many("slots")
    pdl_many, pdl_many_why = many("slots_pdl")
    return [
        Decision("1(a)", f"decode below {MANY_REQUESTS} requests takes `{faster}`", taken, why, faster),
        Decision("1(c)", "with PDL (`slots_pdl`) below", with_pdl(taken, pdl), pdl_why),
        Decision(
            "1(b)", f"decode from {MANY_REQUESTS} requests takes `slots`", taken_many, why_many, "slots"
        ),
        Decision("1(c)", "with PDL (`slots_pdl`) from", with_pdl(taken_many, pdl_many), pdl_many_why),
    ]


def fp8_decode(rows: list[dict]) -> list[Decision]:
    """11(a), (b), (c), (e), per regime of the fp8 pool's decode tiles: the default's speed-up over each
    candidate, the candidate's time over the default's, is `fp8_default_over_<name>` (below 1: the
    candidate is faster)."""
    rules = (
        ("11(a)", "short_tiles", "goes back to FP8_SHORT_TILES", lambda xs: min(xs) < 0.95, "least < 0.95"),
        ("11(b)", "flip_f16", "stops widening to fp16", lambda xs: max(xs) < 1.0, "every row < 1.0"),
        ("11(c)", "pdl", "takes pdl=True", lambda xs: max(xs) < 0.95, "every row < 0.95"),
        ("11(e)", "slots", "takes prefetch_slots=True", lambda xs: max(xs) < 0.98, "every row < 0.98"),
    )
    out = []
    for rule, name, what, test, bound in rules:
        for regime, within in FP8_REGIMES:
            xs = [r[f"fp8_default_over_{name}"] for r in rows
                  if within(r["batch"]) and f"fp8_default_over_{name}" in r]  # fmt: skip
            label = f"fp8 decode {regime} {MANY_REQUESTS} requests {what}"
            if not xs:
                out.append(Decision(rule, label, None, f"`{name}` not timed there"))
                continue
            out.append(Decision(rule, label, test(xs), f"`{name}` {_fmt(min(xs))}-{_fmt(max(xs))} ({bound})"))
    return out


def extend_split(rows: list[dict]) -> Decision:
    """2: the eager prefix split stays on from DEEP_PREFIX cached tokens only if it is no slower there."""
    xs = [split_speedup(r) for r in rows if r["prefix"] >= DEEP_PREFIX and "triton_split_tflops" in r]
    what = f"the eager split from {DEEP_PREFIX} cached tokens is raised or turned off"
    if not xs:
        return Decision("2", what, None, f"no split row from {DEEP_PREFIX} cached tokens")
    return Decision("2", what, min(xs) < 1.0, f"split over unsplit, least {_fmt(min(xs))} (< 1.0)")


def short_extend(summary: dict, decode_takes_slots: bool) -> list[Decision]:
    """20(a)-(c): the short extend's rows a program and its slots a tile ahead
    (`verify_default_over_<name>_*`: the candidate's time over the default's; above 1 the default is
    faster)."""
    narrow, wide = summary.get("verify_default_over_narrow_max"), summary.get("verify_default_over_wide_max")
    slots = summary.get("verify_default_over_slots_max")
    bound = 1.02 if decode_takes_slots else 0.98

    def below(x: float | None, limit: float, strict: bool) -> bool | None:
        return None if x is None else (x < limit if strict else x <= limit)

    return [
        Decision("20(a)", "short extend MAX_ROWS back to 16", below(narrow, 1.0, True),
                 f"narrow over default, most {_fmt(narrow)} (< 1.0)"),
        Decision("20(b)", "short extend MAX_ROWS 64 (64-token tiles above 32 rows)", below(wide, 0.95, False),
                 f"wide over default, most {_fmt(wide)} (<= 0.95)"),
        Decision("20(c)", "short extend takes its slots a tile ahead", below(slots, bound, False),
                 f"slots over default, most {_fmt(slots)} (<= {bound})"),
    ]  # fmt: skip


def decide(result: dict) -> list[Decision]:
    """Every rule's decision on ``result`` (a kernels.bench JSON), in docs/kernels.md's order."""
    summary = summarize(result)  # NOTE: from the rows, so a result older than a field still reads
    decode = decode_candidates(summary["decode_candidate_speedups"])
    takes_slots = any(d.taken and d.candidate == "slots" for d in decode)
    fp8_extend = summary.get("extend_fp8_speedup_min")
    rerun = None if fp8_extend is None else fp8_extend <= LAST_EXTEND_FP8_MIN
    why = f"extend_fp8_speedup_min {_fmt(fp8_extend)} (not above {LAST_EXTEND_FP8_MIN})"
    extend_tune = Decision("11(d)", "the fp8 extend tune runs again", rerun, why)
    return [
        *decode,
        extend_split(result.get("extend", [])),
        *fp8_decode(result.get("decode", [])),
        extend_tune,
        *short_extend(summary, takes_slots),
    ]


def next_step(decisions: Sequence[Decision], seconds: float | None = None) -> str:
    """The gpu-bench command to run next on the same machine: the decode tune when the pipelined tiles are
    taken (1(d): it picks among them), else the fp8 decode tune when a regime goes back to its old tiles
    (11(a)), else the fp8 extend tune (11(d)), else the fp8 pool's engine rows. ``seconds``: what the call
    has left; the step's deadline shrinks to fit (the step then writes the rows it measured in time)."""
    taken = [d for d in decisions if d.taken]
    if any(d.rule == "1(a)" and d.candidate == "pipelined" for d in taken):
        deadline, step = TUNE_DECODE
    elif any(d.rule == "11(a)" for d in taken):
        deadline, step = TUNE_FP8_DECODE
    elif any(d.rule == "11(d)" for d in taken):
        deadline, step = TUNE_FP8_EXTEND
    else:
        deadline, step = FP8_ENGINE
    if seconds is not None:
        deadline = max(1, min(deadline, int(seconds) - MARGIN_S))
    return f"GPU_BENCH_DEADLINE={deadline} bash scripts/gpu-bench {step}"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kernels.bench_rules", description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a kernels.bench JSON")
    ap.add_argument("--seconds", type=float, default=None,
                    help="what the device call has left: the next step's deadline fits it")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        result = json.loads(args.result.read_text(encoding="utf-8"))
        decisions = decide(result)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"kernels.bench_rules: cannot read {args.result} as a kernels.bench result: {exc!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    device = result.get("device", {}).get("name", "?")
    print(
        f"# rules on {args.result} ({device}); TAKE: the rule takes it (apply it by hand), keep: it does not"
    )
    for d in decisions:
        print(f"# {d.line()}")
    print(next_step(decisions, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
