"""kernels.compile_replay: an interpreted test run records its launches, and each distinct one compiles for
sm_90 here; a launch Triton refuses fails the command, naming the tests that made it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernels import compile_replay

TEST = "tests/kernels/test_fp8_linear.py::test_the_kernel_matches_the_reference[interpret-decode-float16-row-float8_e4m3fn]"


def _run(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", compile_replay.ENV)}
    return subprocess.run([sys.executable, *args], env=env | env_vars, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory):
    """The launches of one interpreted fp8 linear test."""
    directory = tmp_path_factory.mktemp("launches")
    proc = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", TEST, TRITON_INTERPRET="1",
                **{compile_replay.ENV: str(directory)})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return directory


def test_an_interpreted_run_records_each_launch_with_what_it_specializes_on(recorded):
    launches, tests, unrecorded = compile_replay.load(recorded)
    kernel = [launch for launch in launches if launch["kernel"] == "_fp8_linear_kernel"]
    assert len(kernel) == 1 and not unrecorded
    [launch] = kernel
    assert launch["module"] == "kernels.fp8_linear" and tests[json.dumps(launch, sort_keys=True)] == [TEST]
    assert {"tensor": "float16", "aligned": True} in launch["args"]  # x
    assert {"tensor": "float8_e4m3fn", "aligned": True} in launch["args"]  # the weight
    ints = [a for a in launch["args"] if isinstance(a, int) and not isinstance(a, bool)]
    assert ints and set(ints) <= {1, 16, 17}  # M = 3, N = 64, K = 96: classes, not values
    assert launch["kwargs"]["BLOCK_K"] == 16 and launch["kwargs"]["X_FP8"] is False  # constexprs as they are


def test_each_distinct_launch_compiles_for_sm90_and_a_refused_one_fails_naming_its_tests(recorded, tmp_path):
    proc = _run("-m", "kernels.compile_replay", str(recorded), "--arch", "90", "--jobs", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launches, _, _ = compile_replay.load(recorded)
    assert f"{len(launches)} distinct launches compiled for sm_90, 0 failed" in proc.stdout
    # the same launch with 8-deep steps: below tl.dot's least depth (16), which only the compiler checks
    lines = [
        json.loads(line)
        for file in recorded.glob("launches-*.jsonl")
        for line in file.read_text().splitlines()
    ]
    bad = [
        line | {"kwargs": line["kwargs"] | {"BLOCK_K": 8}}
        for line in lines
        if line["kernel"] == "_fp8_linear_kernel"
    ]
    (tmp_path / "launches-1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in bad[:1]))
    proc = _run("-m", "kernels.compile_replay", str(tmp_path), "--arch", "90", "--jobs", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED kernels.fp8_linear._fp8_linear_kernel" in proc.stdout and "K >= 16" in proc.stdout
    assert TEST in proc.stdout and "1 distinct launches compiled for sm_90, 1 failed" in proc.stdout
