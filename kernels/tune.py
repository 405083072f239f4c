"""`python -m kernels.tune`: time every candidate tile configuration of the extend, decode and LoRA kernels
on a few representative shapes, check each one's output against SDPA (LoRA's deltas against torch's
ops), and print the fastest next to the current default (kernels.*.default_config). Needs CUDA; it changes no default itself.

A candidate that fails to compile or launch (too much shared memory, say) or computes a wrong answer
is recorded with its reason and never chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kernels import bench, compile_cases, compile_check, timing
from kernels.bench_report import MAX_REL_ERR  # the bench's accuracy bound: one for both

EXTEND_SHAPES = (
    bench.ExtendShape(batch=16, prefix=0, new=1024),
    bench.ExtendShape(batch=4, prefix=0, new=4096),
    bench.ExtendShape(batch=16, prefix=4096, new=1024),
    bench.ExtendShape(batch=4, prefix=16384, new=256),
    # each side of where the long-prefix tiles stop winning (2048 new tokens over a deep prefix; kernels.sweep)
    bench.ExtendShape(batch=4, prefix=8192, new=256),
    bench.ExtendShape(batch=4, prefix=16384, new=1024),
)
DECODE_SHAPES = (
    bench.DecodeShape(batch=1, context=16384),
    bench.DecodeShape(batch=32, context=4096),
    bench.DecodeShape(batch=8, context=65536),
)
# LoRA deltas (kernels/lora.py): a decode step's gate/up projection (kernels.bench's shape), these many
# requests on one adapter, in the segments the worker passes (kernels.reference.lora_segments)
LORA_ROWS = (1, 16, 64)
LORA_K_PER_SPLIT = (64, 128, 256, 512, 1024)  # the shrink's least columns per split
LORA_BLOCK_N = (64, 128, 256)  # the expand's out columns per program
SPLIT_LENGTHS = (64, 128, 256, 512, 1024)  # tokens: decode's min_split_len, tried on the best tile
SPLIT_WAVES = (1, 2, 4, 8)  # decode's split_waves, tried on the best tile and split length


def extend_candidates() -> list[Any]:
    from kernels.extend_attention import ExtendConfig

    return [ExtendConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
            for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]  # fmt: skip


def decode_candidates(min_split_len: int = 256, fp8_f16: bool = False) -> list[Any]:
    """The decode tiles kernels.tune times, each widening an fp8 pool to fp16 or not (``fp8_f16``)."""
    from kernels.decode_attention import DecodeConfig

    pipelined = [DecodeConfig(block_n=n, min_split_len=min_split_len, num_warps=w, num_stages=s, fp8_f16=fp8_f16)
                 for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3)]  # fmt: skip
    # NOTE: Triton keeps one shared-memory buffer for gathered K/V whatever num_stages is, so a program
    # waits for each tile's loads before its dot; prefetch loads the next tile into registers instead
    # (num_stages 1: nothing for Triton to pipeline). At 128 x 4 warps it spills on sm_90 (compile_check).
    prefetched = [DecodeConfig(block_n=n, min_split_len=min_split_len, num_warps=w, num_stages=1, prefetch=True,
                               fp8_f16=fp8_f16)
                  for n in (32, 64, 128) for w in (4, 8)]  # fmt: skip
    # with the slots a tile ahead (prefetch_slots) Triton buffers the K/V copies twice from 3 stages; at 2 the
    # flag is tried on the best below
    slots_ahead = [DecodeConfig(block_n=n, min_split_len=min_split_len, num_warps=w, num_stages=3, prefetch_slots=True,
                                fp8_f16=fp8_f16)
                   for n in (32, 64, 128) for w in (2, 4, 8)]  # fmt: skip
    return pipelined + prefetched + slots_ahead


def lora_candidates() -> list[Any]:
    from kernels.lora import LoraConfig

    return [LoraConfig(k_per_split=k, block_n=n) for k in LORA_K_PER_SPLIT for n in LORA_BLOCK_N]


def best_row(rows: list[dict]) -> dict | None:
    """The fastest row that ran and was accurate (None when none did)."""
    ok = [r for r in rows if r.get("ms") is not None and r.get("rel_err", 1.0) <= MAX_REL_ERR]
    return min(ok, key=lambda r: r["ms"], default=None)


def try_config(
    call: Callable[[], torch.Tensor],
    ref: torch.Tensor,
    config: Any,
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> dict:
    """One candidate: its output's error against ``ref`` and its median time (``timer``, default
    kernels.timing.time_ms: eager calls), or why it has none."""
    row: dict[str, Any] = {"config": dataclasses.asdict(config)}
    try:
        out = call()
        if out.is_cuda:
            torch.cuda.synchronize()
        row["rel_err"] = bench._rel_err(out, ref)
        if row["rel_err"] > MAX_REL_ERR or row["rel_err"] != row["rel_err"]:  # too large, or NaN
            row["error"] = f"inaccurate: rel err {row['rel_err']:.2e} > {MAX_REL_ERR:.0e}"
            return row
        row["ms"] = (timer or timing.time_ms)(call)
    except Exception as exc:  # Triton raises several kinds: out of resources, compilation errors
        first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
        row["error"] = f"{type(exc).__name__}: {first_line}"
    return row


def run_candidates(
    configs: list[Any],
    launch: Callable[[Any], torch.Tensor],
    out: torch.Tensor,
    ref: torch.Tensor,
    rejected: dict[tuple, str] | None = None,
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> list[dict]:
    """try_config for each configuration; ``launch(cfg)`` runs the kernel into ``out``, which is
    NaN-poisoned first so that an element the kernel never writes fails the error check. A
    configuration in ``rejected`` (config_key -> reason, from static_check) is recorded, not run."""
    rows = []
    for cfg in configs:
        reason = (rejected or {}).get(config_key(cfg))
        if reason is not None:
            rows.append({"config": dataclasses.asdict(cfg), "error": reason})
            continue

        def call(cfg: Any = cfg) -> torch.Tensor:
            return launch(cfg)

        out.fill_(float("nan"))
        rows.append(try_config(call, ref, cfg, timer))
    return rows


def config_key(config: Any) -> tuple:
    """A hashable identity for a configuration: its class name and field values."""
    return (type(config).__name__, *dataclasses.astuple(config))


def static_check(
    model: bench.Model, arch: int, cases: list | None = None, jobs: int = 1, pool: torch.dtype | None = None
) -> dict[tuple, str]:
    """Compile every tile candidate (over a ``pool`` KV pool; None: the model's dtype), or ``cases`` (from
    kernels.compile_cases), for ``arch`` without running it; config_key -> why, for each one that spills
    registers or does not fit. The candidates compile in ``jobs`` processes (compile_check.compile_many;
    ``cases`` in this one).
    NOTE: one process took over 80 s on the H100 machine (16 cores) and was cut by gpu-bench's deadline
    (2026-11-27); --no-static-check skips it (spilling candidates are then timed too)."""
    shape = compile_cases.Shape(model.dtype, model.num_q_heads, model.num_kv_heads, model.head_dim, 4096)
    if cases is None:
        compiled = compile_check.compile_many(compile_cases.tune_candidates, (shape, True, pool), arch, jobs)
    else:
        compiled = [(case, compile_check.compile_rows(case[2], arch)) for case in cases]
    rejected: dict[tuple, str] = {}
    for case, rows in compiled:
        bad = [r for r in rows if not r["ok"]]
        if bad:
            r = bad[0]
            rejected[config_key(case[-1])] = (
                f"static check (sm_{arch}): {r.get('error') or ''}" if r["kernel"] is None else
                f"static check (sm_{arch}): {r['kernel']} spills {r['spill_bytes']} B/thread, "
                f"{r['regs']} registers, {r['shared_bytes']} B shared, {r['blocks_per_sm']} blocks/SM"
            )  # fmt: skip
    return rejected


def with_default(candidates: list[Any], default: Any) -> list[Any]:
    """The candidates, the current default first when it is not among them (so it is always timed)."""
    return candidates if default in candidates else [default, *candidates]


def tune_extend(
    shape: bench.ExtendShape,
    model: bench.Model,
    device: torch.device,
    gen: torch.Generator,
    rejected: dict[tuple, str] | None = None,
    pool: torch.dtype | None = None,
) -> dict:
    """Every extend candidate on ``shape`` (the prefix in a ``pool`` KV pool: None, the model's dtype)."""
    from kernels import extend_attention as ext

    kernel_args = bench.extend_inputs(shape, model, device, gen)
    if pool is not None:
        kernel_args = bench.in_pool(kernel_args, pool, (3, 4))
    ref = bench.sdpa_extend(*bench.extend_sdpa_args(shape, model, kernel_args))
    out = torch.empty_like(kernel_args[0])
    # NOTE: the tiles the worker would take for this batch (its longest prefix and new tokens pick them)
    default = ext.default_config(
        model.head_dim,
        bench.DTYPES[model.dtype],
        ext.device_arch(device),
        shape.prefix,
        shape.batch * shape.new,
        pool,
    )

    def launch(cfg: Any) -> torch.Tensor:
        return ext.extend_attention(*kernel_args, max_extend_len=shape.new, out=out, config=cfg)

    rows = run_candidates(with_default(extend_candidates(), default), launch, out, ref, rejected)
    return summarize_shape(
        "extend", dataclasses.asdict(shape), default, rows, bench.extend_flops(shape, model)
    )


def tune_decode(
    shape: bench.DecodeShape,
    model: bench.Model,
    device: torch.device,
    gen: torch.Generator,
    rejected: dict[tuple, str] | None = None,
    pool: torch.dtype | None = None,
) -> dict:
    """Every decode candidate on ``shape`` (its K/V in a ``pool`` KV pool: None, the model's dtype)."""
    from kernels import decode_attention as dec

    kernel_args = bench.decode_inputs(shape, model, device, gen)
    if pool is not None:
        kernel_args = bench.in_pool(kernel_args, pool, (1, 2))
    ref = bench.sdpa_decode(*bench.decode_sdpa_args(shape, model, kernel_args))
    out = torch.empty_like(kernel_args[0])
    default = dec.default_config(
        model.head_dim, bench.DTYPES[model.dtype], dec.device_arch(device), shape.batch, pool
    )

    def launch(cfg: Any) -> torch.Tensor:
        return dec.decode_attention(*kernel_args, max_kv_len=shape.context, out=out, config=cfg)

    # NOTE: timed as CUDA-graph replays, as the worker runs decode steps: eager calls would measure
    # Python's launch cost (~0.15 ms on an H200 host), as long as a whole call at short contexts.
    timer = timing.time_replay_ms
    # NOTE: the tiles widen an fp8 pool as the default does (fp8_f16); the other way is tried on the best below
    tiles = decode_candidates(default.min_split_len, default.fp8_f16)
    rows = run_candidates(with_default(tiles, default), launch, out, ref, rejected, timer)
    tile = best_row(rows)
    if tile is not None:  # then the split length, on the best tile
        base = dec.DecodeConfig(**tile["config"])
        lengths = [n for n in SPLIT_LENGTHS if n != base.min_split_len]
        rows += run_candidates(
            [dataclasses.replace(base, min_split_len=n) for n in lengths], launch, out, ref, timer=timer
        )
    best = best_row(rows)
    if best is not None:  # then how many waves of programs the split count aims for
        base = dec.DecodeConfig(**best["config"])
        waves = [w for w in SPLIT_WAVES if w != base.split_waves]
        rows += run_candidates(
            [dataclasses.replace(base, split_waves=w) for w in waves], launch, out, ref, timer=timer
        )
    # then the best with its merge in the split kernel, then the best launched as programmatic dependents,
    # then the best with its slots a tile ahead (each flag flipped: off if the best had it); over an fp8 pool
    # under a bf16 q, then the best with its tiles widened to fp16 (DecodeConfig.fp8_f16)
    flags = ["fused_merge", "pdl", "prefetch_slots"]
    if dec.widens_fp8_to_fp16(kernel_args[0].dtype, kernel_args[1].dtype):
        flags.append("fp8_f16")
    for flag in flags:
        best = best_row(rows)
        if best is not None:
            base = dec.DecodeConfig(**best["config"])
            flipped = dataclasses.replace(base, **{flag: not getattr(base, flag)})
            rows += run_candidates([flipped], launch, out, ref, timer=timer)
    nbytes = bench.decode_bytes(shape, model, kernel_args[-1].element_size(), kernel_args[1].element_size())
    return summarize_shape("decode", dataclasses.asdict(shape), default, rows, nbytes)


def tune_lora(rows: int, model: bench.Model, device: torch.device, gen: torch.Generator) -> dict:
    """Every LoRA candidate on one decode step's gate/up deltas, ``rows`` requests on one adapter: its
    deltas checked against torch's, then timed as CUDA-graph replays (how the worker runs decode)."""
    from kernels import lora, reference

    dtype = bench.DTYPES[model.dtype]
    x, base, a, b, indptr, slots = bench.lora_case(rows, 1, dtype, device, gen)
    cap = reference.LORA_BLOCK_ROWS
    seg_indptr, seg_slots = bench.worker_segments(indptr, slots)
    ref = bench.lora_per_adapter(x, base.clone(), a, b, [torch.arange(rows, device=device)]) - base
    out = base.clone()
    default = lora.default_config(dtype, lora.device_arch(device))

    def delta(cfg: Any) -> torch.Tensor:
        out.copy_(base)
        return lora.lora_add(x, out, a, b, seg_indptr, seg_slots, cap, cfg) - base

    def timer(cfg: Any) -> Callable[[Callable[[], Any]], float]:
        """Times the kernels alone, without delta's copy."""
        return lambda _: timing.time_replay_ms(
            lambda cfg=cfg: lora.lora_add(x, out, a, b, seg_indptr, seg_slots, cap, cfg)
        )

    results = [try_config(lambda cfg=cfg: delta(cfg), ref, cfg, timer(cfg))
               for cfg in with_default(lora_candidates(), default)]  # fmt: skip
    # then the best launched as programmatic dependents, then the best with the expand's partials several
    # splits a load (each flag flipped: off if the best had it)
    for flag in ("pdl", "batched_partials"):
        best = best_row(results)
        if best is not None:
            cfg = dataclasses.replace(lora.LoraConfig(**best["config"]), **{flag: not best["config"][flag]})
            results.append(try_config(lambda cfg=cfg: delta(cfg), ref, cfg, timer(cfg)))
    return summarize_shape("lora", {"rows": rows, "adapters": 1}, default, results,
                           bench.lora_bytes(rows, 1, model.elem_bytes))  # fmt: skip


def summarize_shape(kind: str, shape: dict, default: Any, rows: list[dict], work: int) -> dict:
    """Default vs best for one shape; ``work`` is FLOPs (extend) or bytes (decode, lora)."""
    default_cfg = dataclasses.asdict(default)
    default_row = next((r for r in rows if r["config"] == default_cfg), None)
    best = best_row(rows)
    default_ms = None if default_row is None else default_row.get("ms")
    return {
        "kind": kind,
        "shape": shape,
        "work": work,
        "default": {"config": default_cfg, "ms": default_ms},
        "best": best,
        "speedup_vs_default": None if best is None or default_ms is None else default_ms / best["ms"],
        "rows": rows,
    }


def format_table(results: list[dict]) -> str:
    """One line per shape: default time, best time, best config (printed last)."""
    lines = [f"{'kind':<7}{'shape':<34}{'default ms':>11}{'best ms':>9}{'speedup':>9}  best config"]

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for r in results:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        best = r["best"] or {}
        cfg = " ".join(f"{k}={v}" for k, v in best.get("config", {}).items()) or "-"
        lines.append(
            f"{r['kind']:<7}{shape:<34}{fmt(r['default']['ms'], '.3f'):>11}{fmt(best.get('ms'), '.3f'):>9}"
            f"{fmt(r['speedup_vs_default'], '.2f'):>9}  {cfg}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kernels.tune", description=__doc__)
    ap.add_argument("--kind", choices=("extend", "decode", "lora", "all"), default="all")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default docs/benchmarks/kernels-tune-<gpu>.json)"
    )
    ap.add_argument("--no-static-check", action="store_true",
                    help="time every candidate, even those that spill registers when compiled")  # fmt: skip
    ap.add_argument("--kv-dtype", choices=("model", "fp8"), default="model",
                    help="the extend and decode kernels' KV pool: the model's dtype, or fp8 (e4m3 from sm_89, e5m2 "
                         "before) as --kv-cache-dtype fp8 serves it; the defaults timed are that pool's")  # fmt: skip
    bench.add_model_args(ap)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = bench.start_gpu_run("kernels.tune", args)
    if run is None:
        return 2
    device, gpu, model, gen = run.device, run.gpu, run.model, run.gen
    started = time.time()
    from kernels.extend_attention import device_arch

    pool = compile_cases.fp8_pool(device_arch(device)) if args.kv_dtype == "fp8" else None
    rejected: dict[tuple, str] = {}
    if not args.no_static_check:
        try:
            rejected = static_check(model, device_arch(device), jobs=compile_check.default_jobs(), pool=pool)
        except Exception as exc:  # the check only saves time: without it every candidate is timed
            print(f"static check skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"static check: {len(rejected)} candidate(s) spill or do not fit; not timed", file=sys.stderr)
    results = []
    if args.kind in ("extend", "all"):
        for shape in EXTEND_SHAPES:
            results.append(tune_extend(shape, model, device, gen, rejected, pool))
            torch.cuda.empty_cache()
            print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr)
    if args.kind in ("decode", "all"):
        for shape in DECODE_SHAPES:
            results.append(tune_decode(shape, model, device, gen, rejected, pool))
            torch.cuda.empty_cache()
            print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr)
    if args.kind in ("lora", "all"):
        for rows in LORA_ROWS:
            results.append(tune_lora(rows, model, device, gen))
            print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr)
    doc = bench.run_record(
        run,
        " ".join(["python -m kernels.tune", *argv]),
        "kernels.timing median, L2 evicted by a read before each run; extend: eager calls; "
        "decode and lora: CUDA-graph replays",
    )
    doc |= {
        "kv_dtype": str(pool or bench.DTYPES[model.dtype]).removeprefix("torch."),
        "max_rel_err": MAX_REL_ERR,
        "results": results,
        "wall_s": round(time.time() - started, 1),
    }
    compile_check.record_loaded_kernels(doc)  # every candidate's registers and spills on this GPU
    fp8 = "-fp8" if pool is not None else ""  # NOTE: beside the 16-bit pool's record, not over it
    out = args.out or Path("docs/benchmarks") / f"kernels-tune-{bench.gpu_slug(gpu)}{fp8}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
