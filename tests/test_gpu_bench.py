"""scripts/gpu-bench, the GPU machine's one command: off a GPU it refuses at once, says why, installs
nothing and writes no result; bad arguments are refused before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-bench"


def run_script(*args: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_BENCH_SITE": str(site)}
    env.pop("OUT", None)  # the device tool's folder, never a default here
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("step", ["kernels", "features"])
def test_a_step_without_cuda_fails_clearly_and_changes_nothing(tmp_path, step):
    out, site = tmp_path / "out", tmp_path / "site"
    proc = run_script(step, str(out), site=site)
    assert proc.returncode == 3
    assert "no CUDA GPU" in proc.stdout + proc.stderr
    assert [p.name for p in out.iterdir()] == ["gpu-bench.log"]  # no benchmark JSON or markdown
    assert "no CUDA GPU" in (out / "gpu-bench.log").read_text()
    assert not site.exists()  # the wheels are installed only once a GPU is there


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("tests", "kernels", "OUT", "--", "-x"), "name exactly one"),
        (("--fast",), "unknown option --fast"),
        (("kernel",), "unknown step 'kernel'"),  # a misspelt step is not taken for the output folder
        (("kernels", "OUT", "OUT"), "one OUTDIR only"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    args = tuple(str(tmp_path / "out") if a == "OUT" else a for a in args)
    proc = run_script(*args, site=tmp_path / "site")
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()
