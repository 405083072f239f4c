"""`python -m kernels.compile_check`: compile every Triton kernel for a GPU architecture (sm_90, H100, by
default) on a machine without a GPU, and report what that GPU would be given: registers per thread,
spilled bytes, shared memory, estimated resident blocks per SM, and the instructions that decide speed
(tensor-core MMA kind, async copies, 128-bit loads, local-memory traffic).

It calls the real host wrappers (kernels.decode_attention / extend_attention / fused) on small CPU tensors,
so the specialisations (constexprs, 16-byte divisibility of pointers and strides) are the ones a CUDA
launch would compile; only the launch itself is skipped. ptxas, cuobjdump and nvdisasm come with Triton.
Exit status 1 when a default configuration spills or does not fit the architecture.
--candidates adds every kernels.tune candidate (kernels.tune itself runs this check before timing) and
kernels.bench_moe's.
--jobs N compiles in N processes (default: one per core, at most 16).
NOTE: these are compiler facts for the Triton here (its version is recorded), not speeds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-SM resources of one compute capability (CUDA programming guide, compute capabilities table)."""

    name: str
    smem_per_block: int  # bytes, opt-in maximum for one block
    smem_per_sm: int  # bytes
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    smem_reserved_per_block: int = 1024  # bytes the runtime keeps per resident block


ARCHS = {
    80: ArchLimits("sm_80 (A100)", smem_per_block=166912, smem_per_sm=167936),
    89: ArchLimits("sm_89 (L4, L40S)", smem_per_block=101376, smem_per_sm=102400, threads_per_sm=1536),
    90: ArchLimits("sm_90 (H100, H200)", smem_per_block=232448, smem_per_sm=233472),
}
SASS_OPS = (
    "HGMMA",
    "QGMMA",
    "HMMA",
    "QMMA",
    "LDGSTS",
    "UTMALDG",
    "LDG.E.128",
    "LDL",
    "STL",
    "ACQBULK",
    "PREEXIT",
)
_SASS_RE = re.compile(r"\b(HGMMA|QGMMA|HMMA|QMMA|LDGSTS|UTMALDG|LDG|LDL|STL|ACQBULK|PREEXIT)(\.[A-Z0-9_.]+)?")
_USAGE_RE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


class _CompileOnlyDriver:
    """Enough of a Triton driver to compile for ``arch``: there is no device, so nothing is launched."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list[tuple[str, Any]]]:
    """While active, every @triton.jit launch compiles for ``arch`` and returns without running; the
    compiled kernels are appended to the yielded list as (kernel name, CompiledKernel)."""
    from kernels import interpret_requested

    if interpret_requested():
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter compiles nothing")
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    compiled: list[tuple[str, Any]] = []
    launch = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    previous = driver._active  # NOTE: None on a machine without a GPU; reset_active() would raise there
    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = launch
        driver.set_active(previous)


def _tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """`cuobjdump --dump-resource-usage` output -> {function: {regs, stack, local}} (bytes per thread)."""
    return {
        m.group(1): {"regs": int(m.group(2)), "stack": int(m.group(3)), "local": int(m.group(5))}
        for m in _USAGE_RE.finditer(text)
    }


def count_sass_ops(sass: str) -> dict[str, int]:
    """Static counts of the instructions in SASS_OPS (LDG.E.128: 128-bit global loads)."""
    counts: collections.Counter[str] = collections.Counter()
    for m in _SASS_RE.finditer(sass):
        op, mods = m.group(1), m.group(2) or ""
        if op == "LDG":
            if mods.endswith(".128"):
                counts["LDG.E.128"] += 1
            continue
        counts[op] += 1
    return {op: counts.get(op, 0) for op in SASS_OPS}


def blocks_per_sm(limits: ArchLimits, regs: int, shared: int, num_warps: int) -> int:
    """Resident blocks per SM by registers (allocated per warp in units of 256), shared memory and
    threads; 0 when one block does not fit at all."""
    if shared > limits.smem_per_block or regs > 255:
        return 0
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = limits.regs_per_sm // (regs_per_warp * num_warps)
    by_smem = limits.smem_per_sm // (shared + limits.smem_reserved_per_block)
    by_threads = limits.threads_per_sm // (num_warps * 32)
    return min(by_regs, by_smem, by_threads, limits.blocks_per_sm)


def inspect_kernel(name: str, kernel: Any, limits: ArchLimits) -> dict[str, Any]:
    """One compiled kernel -> its report row (resources from cuobjdump, instructions from nvdisasm)."""
    md = kernel.metadata
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage_text = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = parse_resource_usage(usage_text).get(md.name)
    if usage is None:
        raise RuntimeError(f"cuobjdump reported no resource usage for {md.name}")
    ops = count_sass_ops(sass)
    blocks = blocks_per_sm(limits, usage["regs"], md.shared, md.num_warps)
    spill_bytes = usage["local"] + usage["stack"]
    return {
        "kernel": name,
        "regs": usage["regs"],
        "spill_bytes": spill_bytes,
        "shared_bytes": md.shared,
        "num_warps": md.num_warps,
        "num_stages": md.num_stages,
        "fp_fusion": md.enable_fp_fusion,
        "blocks_per_sm": blocks,
        "sass": ops,
        "ok": blocks > 0 and spill_bytes == 0 and ops["STL"] == 0,
    }


def compile_rows(call: Callable[[], Any], arch: int) -> list[dict[str, Any]]:
    """Run one host-wrapper call compiling for ``arch``: a report row per kernel it compiled, and an
    error row (kernel None, not ok) when Triton refused to compile."""
    rows = []
    with compile_only(arch) as compiled:
        try:
            call()
        except Exception as exc:  # a configuration Triton refuses to compile
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            # NOTE: a CompilationError's first line is where ("at 45:18:"), its last one what went wrong
            error = f"{type(exc).__name__}: {' ... '.join(dict.fromkeys([*lines[:1], *lines[-1:]]))[:240]}"
            rows.append({"kernel": None, "ok": False, "error": error})
    return [inspect_kernel(name, kernel, ARCHS[arch]) for name, kernel in compiled] + rows


def _compile_chunk(cases_of: Callable[..., list], source: tuple, indices: list[int], arch: int) -> list:
    """In a child process: (index, compile_rows) for the cases at ``indices`` of ``cases_of(*source)``."""
    cases = cases_of(*source)
    return [(i, compile_rows(cases[i][2], arch)) for i in indices]


def compile_many(
    cases_of: Callable[..., list], source: tuple, arch: int, jobs: int = 1
) -> list[tuple[Any, list[dict]]]:
    """(case, compile_rows of it) for every case ``cases_of(*source)`` lists (each a tuple whose third
    item is its call), in that order. With ``jobs`` > 1 the cases are shared among that many child
    processes (spawned: each rebuilds the list, so ``cases_of`` is a module-level function and
    ``source`` pickles), as one compilation runs on one core; the Triton cache they share keeps what
    each compiled."""
    cases = cases_of(*source)
    if jobs <= 1:
        return [(case, compile_rows(case[2], arch)) for case in cases]
    import concurrent.futures
    import multiprocessing

    count = len(cases)
    chunks = [list(range(start, count, jobs)) for start in range(min(jobs, count))]
    rows: list[list[dict]] = [[] for _ in range(count)]
    context = multiprocessing.get_context("spawn")  # NOTE: the parent may hold CUDA (kernels.tune)
    with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=context) as pool:
        jobs_args = zip(*[(cases_of, source, chunk, arch) for chunk in chunks], strict=True)
        for done in pool.map(_compile_chunk, *jobs_args):
            for i, case_rows in done:
                rows[i] = case_rows
    return list(zip(cases, rows, strict=True))


def default_jobs() -> int:
    """Processes compile_many uses by default: one per core this process may run on, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores))


def loaded_kernels() -> list[dict[str, Any]]:
    """Every kernels.* Triton kernel this process has compiled: its constexprs, launch shape and
    shared memory, and once loaded onto a GPU the registers and spills the driver reports (None
    before). kernels.bench and kernels.tune record this next to their timings.
    NOTE: reads Triton's per-device JIT caches (the same layout in Triton 3.6 and 3.9)."""
    from triton.runtime.jit import JITFunction

    from kernels import (
        decode_attention,
        extend_attention,
        extend_short,
        fp8_linear,
        fused,
        lora,
        moe,
        pointwise,
        sampling,
        split_merge,
    )

    rows = []
    for module in (
        extend_attention,
        extend_short,
        split_merge,
        decode_attention,
        pointwise,
        fused,
        fp8_linear,
        lora,
        moe,
        sampling,
    ):
        for fn in vars(module).values():
            if not isinstance(fn, JITFunction) or not fn.__name__.endswith("_kernel"):
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    md = kernel.metadata
                    constants = {fn.arg_names[k[0]]: v for k, v in kernel.src.constants.items()
                                 if len(k) == 1 and isinstance(v, (int, float, str, bool))}  # fmt: skip
                    # NOTE: the KV pool's element type where the kernel reads or writes one ("*fp8e4nv": fp8)
                    pool = getattr(kernel.src, "signature", {}).get("K_cache")
                    rows.append({
                        "kernel": md.name, "constants": constants, "num_warps": md.num_warps,
                        "num_stages": md.num_stages, "shared_bytes": md.shared,
                        "regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                        **({"pool": pool} if pool else {}),
                    })  # fmt: skip
    return rows


def record_loaded_kernels(doc: dict[str, Any]) -> None:
    """doc["compiled"] = loaded_kernels(); a failure (Triton internals moved) is recorded instead of
    raised, so a benchmark's measurements are never lost to this diagnostic."""
    try:
        doc["compiled"] = loaded_kernels()
    except Exception as exc:
        doc["compiled_error"] = f"{type(exc).__name__}: {exc}"


def _cases(args: argparse.Namespace) -> list[tuple[str, dict, Callable[[], Any]]]:
    """The cases to compile: the defaults, and with args.candidates every kernels.tune candidate and
    kernels.bench_moe's and kernels.bench_fp8_linear's."""
    from kernels import compile_cases

    cases = _default_cases(args)
    if args.candidates:
        shape = compile_cases.Shape(
            args.dtypes[0], args.q_heads, args.kv_heads, args.head_dims[0], args.hidden
        )
        cases += compile_cases.tune_candidates(shape) + compile_cases.moe_candidates(shape)
        cases += compile_cases.fp8_linear_candidates(shape)
    return cases


def _default_cases(args: argparse.Namespace) -> list[tuple[str, dict, Callable[[], Any]]]:
    from kernels import compile_cases

    cases: dict[str, tuple[str, dict, Callable[[], Any]]] = {}
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            shape = compile_cases.Shape(dtype, args.q_heads, args.kv_heads, head_dim, args.hidden)
            for case in compile_cases.defaults(shape, args.arch):
                cases.setdefault(case[0], case)  # rms_norm does not depend on head_dim: compiled once
    if args.only is None:
        return list(cases.values())
    kinds = {label.split()[0] for label in cases}  # NOTE: some exist only on some archs and shapes
    listed = f"(cases here: {', '.join(sorted(kinds))})"
    if not kinds & set(args.only):
        raise ValueError(f"--only {' '.join(args.only)}: no such kernel case {listed}")
    if absent := [kind for kind in args.only if kind not in kinds]:
        print(f"compile_check: --only {' '.join(absent)}: no such case on sm_{args.arch} for these shapes "
              f"{listed}", file=sys.stderr)  # fmt: skip
    return [case for label, case in cases.items() if label.split()[0] in args.only]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compile the cases for args.arch; the report as a dict (rows per kernel and a pass/fail)."""
    import triton

    limits = ARCHS[args.arch]
    rows: list[dict[str, Any]] = []
    for (label, config, _), case_rows in compile_many(_cases, (args,), args.arch, args.jobs):
        rows += [{"case": label, "config": config, **row} for row in case_rows]
    defaults_ok = all(r["ok"] for r in rows if not r["case"].startswith("candidate"))
    return {
        "command": " ".join(["python -m kernels.compile_check", *args.argv]),
        "arch": args.arch,
        "arch_name": limits.name,
        "triton": triton.__version__,
        "limits": dataclasses.asdict(limits),
        "rows": rows,
        "defaults_ok": defaults_ok,
    }


def format_table(report: dict[str, Any]) -> str:
    """Markdown table of the report rows."""
    head = ("| case | kernel | config | regs | spill B | smem KiB | warps | stages | blocks/SM | "
            "HGMMA | QGMMA | HMMA | QMMA | LDGSTS | LDG.128 | ACQBULK | PREEXIT | ok |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["rows"]:
        cfg = " ".join(f"{k}={v}" for k, v in r["config"].items())
        if r.get("kernel") is None:
            lines.append(f"| {r['case']} | - | {cfg} |" + " |" * (head.count("|") - 5) + f" {r['error']} |")
            continue
        s = r["sass"]
        lines.append(
            f"| {r['case']} | {r['kernel']} | {cfg} | {r['regs']} | {r['spill_bytes']} | "
            f"{r['shared_bytes'] / 1024:.1f} | {r['num_warps']} | {r['num_stages']} | {r['blocks_per_sm']} | "
            f"{s['HGMMA']} | {s['QGMMA']} | {s['HMMA']} | {s['QMMA']} | {s['LDGSTS']} | {s['LDG.E.128']} | "
            f"{s['ACQBULK']} | {s['PREEXIT']} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    lim = report["limits"]
    failing = sorted(
        {r["case"] for r in report["rows"] if not r["ok"] and not r["case"].startswith("candidate")}
    )
    verdict = (
        "every default fits and spills nothing"
        if not failing
        else f"defaults that FAIL: {', '.join(failing)}"
    )
    return "\n".join([
        f"# Triton kernels compiled for {report['arch_name']} (no GPU; compiler facts, not speeds)",
        "",
        f"`{report['command']}`, Triton {report['triton']}. "
        f"Limits: {lim['smem_per_block'] // 1024} KiB shared memory per block, {lim['regs_per_sm']} registers "
        f"and {lim['threads_per_sm']} threads per SM. Result: {verdict}.",
        "",
        "Counts are static instructions in the SASS (not executions). HGMMA = Hopper warpgroup MMA (16-bit), "
        "QGMMA = its fp8 form, HMMA = mma.sync (16-bit), QMMA = its fp8 form (sm_89+), "
        "LDGSTS = cp.async into shared memory, LDG.128 = 128-bit global loads, "
        "ACQBULK / PREEXIT = griddepcontrol.wait / launch_dependents (programmatic dependent launch). "
        "blocks/SM is an occupancy estimate from registers, shared memory and threads.",
        "",
        format_table(report),
        "",
    ])  # fmt: skip


def _head_dim(text: str) -> int:
    """--head-dims value: any even head_dim the kernels take (RoPE rotates halves), 16 to 512."""
    d = int(text)
    if d % 2 != 0 or not 16 <= d <= 512:
        raise argparse.ArgumentTypeError(f"head_dim {d}: expected an even number from 16 to 512")
    return d


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__)
    ap.add_argument("--arch", type=int, choices=sorted(ARCHS), default=90)
    ap.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16", "fp32"), default=["bf16", "fp16"])
    ap.add_argument("--head-dims", nargs="+", type=_head_dim, default=[128, 64], metavar="D",
                    help="even head dims, 16 to 512 (e.g. 64 80 96 128 256)")  # fmt: skip
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096, help="RMSNorm width")
    ap.add_argument("--only", nargs="+", default=None, metavar="CASE",
                    help="compile only the default cases whose label starts with these words (extend, "
                    "extend-long-prefix, decode, lora_add, ...; an unknown one lists them)")  # fmt: skip
    ap.add_argument("--candidates", action="store_true", help="also every kernels.tune candidate")
    ap.add_argument("--jobs", type=int, default=default_jobs(),
                    help="processes compiling at once (default: one per core, at most 16)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="JSON path; a .md table is written next to it")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (RuntimeError, ValueError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"compile_check: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(format_markdown(report))
    print(format_table(report))
    return 0 if report["defaults_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
