"""`python -m kernels.compile_replay DIR`: compile, for a GPU architecture on a machine without one, every
kernel launch that an interpreted run recorded, and report the launches Triton refuses to compile.

The interpreter runs a kernel as Python: a name defined in a loop and read after it, an fp8 dot of fewer
than 32 columns, a shape the code generator rejects, all run there and fail only when compiled. So the
kernel tests, run interpreted with KERNELS_RECORD_LAUNCHES=DIR (tests/kernels/conftest.py installs
``record_launches``), write each launch's kernel, argument kinds and constexprs to DIR (one JSON line a
launch, a file a process), and this command compiles each distinct launch for ``--arch`` (kernels.
compile_check's compile-only driver: no device, nothing runs). Exit status 1 when any launch fails to
compile, with its error and the tests that launched it.

What a launch specializes on is what a record keeps: a tensor's dtype and whether its address is 16-byte
aligned, an integer argument's class (1, a multiple of 16, other; 64-bit beyond int32), every constexpr's
and launch option's value. The tiles are the interpreter's (kernels' default_config picks tiny tiles
there), so compile_check's default cases, not these, tell registers and spills.
Usage: KERNELS_RECORD_LAUNCHES=/tmp/launches TRITON_INTERPRET=1 python -m pytest -n 2 tests/kernels, then
python -m kernels.compile_replay /tmp/launches [--arch 90] [--jobs N] (with the Triton the GPU runs).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "KERNELS_RECORD_LAUNCHES"
_INT32 = range(-(2**31), 2**31)


def _constexpr_names(fn: Callable) -> set[str]:
    """The parameters of a @triton.jit function annotated tl.constexpr (strings under postponed
    annotations)."""
    import triton.language as tl

    names = set()
    for p in inspect.signature(fn).parameters.values():
        ann = p.annotation
        if ann is tl.constexpr or (isinstance(ann, str) and ann.split(".")[-1] == "constexpr"):
            names.add(p.name)
    return names


def encode(value: Any, constexpr: bool) -> Any:
    """A launch argument as a record keeps it (see the module docstring); TypeError for a kind it cannot."""
    import torch

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, int):
        if constexpr:
            return value
        base = 1 if value == 1 else 16 if value % 16 == 0 else 17
        return base if value in _INT32 else base + 2**32
    if isinstance(value, float):
        return value if constexpr else 0.5
    raise TypeError(f"no record for a launch argument of type {type(value).__name__}")


def decode(value: Any) -> Any:
    """The stand-in a recorded argument compiles with: a 64-element CPU tensor of its dtype (offset one
    element where the recorded one was misaligned), or the recorded value."""
    import torch

    if isinstance(value, dict):
        base = torch.empty(64, dtype=getattr(torch, value["tensor"]))
        return base if value["aligned"] else base[1:]
    return value


def record_launches(directory: str | os.PathLike) -> None:
    """From now on, every interpreted kernel launch of this process appends its record to
    DIRECTORY/launches-<pid>.jsonl (then runs as before). A launch with an argument no record can keep
    is counted in the file as an "unrecorded" line instead."""
    from triton.runtime.interpreter import InterpretedFunction

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"launches-{os.getpid()}.jsonl"
    run = InterpretedFunction.run
    constexprs: dict[Callable, set[str]] = {}

    def recording_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if not warmup:
            names = constexprs.get(self.fn)
            if names is None:
                names = constexprs[self.fn] = _constexpr_names(self.fn)
            test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
            try:
                line = {
                    "module": self.fn.__module__, "kernel": self.fn.__name__,
                    "args": [encode(a, n in names) for a, n in zip(args, self.arg_names, strict=False)],
                    "kwargs": {k: encode(v, k in names or k not in self.arg_names) for k, v in kwargs.items()},
                    "test": test,
                }  # fmt: skip
            except TypeError as exc:
                line = {"unrecorded": f"{self.fn.__module__}.{self.fn.__name__}: {exc}", "test": test}
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def load(directory: str | os.PathLike) -> tuple[list[dict], dict[str, list[str]], list[str]]:
    """The distinct launches recorded in DIRECTORY (in a fixed order), the tests that made each (by its
    key), and the unrecorded launches' descriptions."""
    launches: dict[str, dict] = {}
    tests: dict[str, list[str]] = collections.defaultdict(list)
    unrecorded = []
    for file in sorted(Path(directory).glob("launches-*.jsonl")):
        for text in file.read_text().splitlines():
            line = json.loads(text)
            if "unrecorded" in line:
                unrecorded.append(line["unrecorded"])
                continue
            test = line.pop("test")
            key = json.dumps(line, sort_keys=True)
            launches.setdefault(key, line)
            if test and test not in tests[key]:
                tests[key].append(test)
    keys = sorted(launches)
    return [launches[k] for k in keys], {k: tests[k] for k in keys}, sorted(set(unrecorded))


def _label(launch: dict) -> str:
    constexprs = {k: v for k, v in launch["kwargs"].items() if not isinstance(v, dict)}
    return f"{launch['module']}.{launch['kernel']} {json.dumps(constexprs, sort_keys=True)}"


def replay_cases(directory: str) -> list[tuple[str, dict, Callable[[], Any]]]:
    """compile_check cases, one a distinct recorded launch: its call launches the compiled kernel on
    stand-in arguments (compile_check.compile_only keeps it from running)."""
    cases = []
    for launch in load(directory)[0]:

        def call(launch: dict = launch) -> Any:
            kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
            args = [decode(a) for a in launch["args"]]
            return kernel[(1,)](*args, **{k: decode(v) for k, v in launch["kwargs"].items()})

        cases.append((_label(launch), {"key": json.dumps(launch, sort_keys=True)}, call))
    return cases


def main(argv: list[str] | None = None) -> int:
    from kernels import compile_check

    ap = argparse.ArgumentParser(prog="python -m kernels.compile_replay", description=__doc__.split("\n")[0])
    ap.add_argument("directory", help=f"where an interpreted run with {ENV} set wrote its launches")
    ap.add_argument("--arch", type=int, choices=sorted(compile_check.ARCHS), default=90)
    ap.add_argument("--jobs", type=int, default=compile_check.default_jobs())
    args = ap.parse_args(argv)
    launches, tests, unrecorded = load(args.directory)
    if not launches:
        print(f"compile_replay: no launches recorded in {args.directory}", file=sys.stderr)
        return 2
    results = compile_check.compile_many(replay_cases, (args.directory,), args.arch, args.jobs)
    failed = [(case, rows) for case, rows in results if any(r["kernel"] is None for r in rows)]
    for (label, config, _), rows in failed:
        error = next(r["error"] for r in rows if r["kernel"] is None)
        example = tests[config["key"]]
        print(f"FAILED {label}\n  {error}\n  launched by {len(example)} tests, e.g. {example[:3]}")
    print(f"{len(results)} distinct launches compiled for sm_{args.arch}, {len(failed)} failed; "
          f"{len(unrecorded)} kinds of launch not recorded{': ' if unrecorded else ''}"
          f"{'; '.join(unrecorded[:5])}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
