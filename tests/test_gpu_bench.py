"""scripts/gpu-bench, the GPU machine's one command: off a GPU it refuses at once, says why, installs
nothing and writes no result; bad arguments are refused before anything runs."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import SLOW

ROOT = Path(__file__).resolve().parent.parent
SCRIPT, WHEELS = ROOT / "scripts" / "gpu-bench", ROOT / "scripts" / "gpu-wheels"


def run_script(*args: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_BENCH_SITE": str(site)}
    env.pop("OUT", None)  # the device tool's folder, never a default here
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(
    "step", ["kernels", *(pytest.param(s, marks=SLOW) for s in ("features", "moe", "fp8"))]
)
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


def test_every_step_is_named_alike_in_the_usage_the_parser_the_refusal_and_the_runner():
    """A step the parser takes is in the usage line and the unknown-step message, and main() runs it."""
    text = SCRIPT.read_text()
    usage = re.search(r"^# Usage: \S+ \S+ \[--quick\] \[([\w|]+) \.\.\.\]", text, re.M).group(1).split("|")
    taken = re.search(r"^ +(tests \| [\w| ]+)\) steps\+=", text, re.M).group(1).split(" | ")
    refused = re.search(r"unknown step '\$1' \(steps: ([\w ]+);", text).group(1).split()
    run = re.findall(r"^      (\w+)\)", text, re.M)
    assert usage == refused == [*taken, "all"] and sorted(run) == sorted(taken)
    assert "fp8" in taken


@pytest.mark.parametrize("name", ["GPU_BENCH_DEADLINE", "GPU_BENCH_TEST_TIMEOUT", "GPU_BENCH_TEST_JOBS"])
def test_a_setting_that_is_not_a_whole_number_is_refused_before_anything_runs(tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "6x")
    proc = run_script("tests", str(tmp_path / "out"), site=tmp_path / "site")
    assert proc.returncode == 2
    assert f"{name} must be a whole number, got '6x'" in proc.stderr
    assert not (tmp_path / "out").exists()


def _script_list(text: str, name: str) -> list[str]:
    """The words a bash script assigns to ``name`` (NAME="..." and NAME+=" ..." lines, or NAME=(...))."""
    words = []
    for match in re.finditer(rf'^{name}\+?=(?:"([^"]*)"|\(([^)]*)\))', text, re.M):
        words += (match.group(1) or match.group(2)).split()
    return words


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function (dotted, as written)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _third_party_imports(entries: list[Path]) -> set[str]:
    """Top-level names of what ``entries`` and the project modules they reach import from outside
    the project and the standard library."""
    ours = {"router", "worker", "kernels", "loadtest", "tests"}
    seen, todo, found = set(), list(entries), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in ours:
                found.add(top)
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # every package on the way, and the module itself
                base = ROOT.joinpath(*parts[:i])
                todo += [p for p in (base / "__init__.py", base.with_suffix(".py")) if p.exists()]
    return found - set(sys.stdlib_module_names) - {"__future__"}


def test_the_import_check_lists_every_module_the_steps_import():
    """A module the GPU machine lacks is caught by the probe, before any step runs, only if it is
    listed: every `python -m` the script runs (pytest: the gpu test folders) is followed through
    the project's own modules to what they import."""
    text = SCRIPT.read_text()
    steps = set(re.findall(r'"\$PYTHON" -m ([\w.]+)', text)) - {"pip"}
    assert {"worker.bench", "worker.bench_kv_transfer", "kernels.bench", "pytest"} <= steps
    entries = []
    for module in steps:
        if module == "pytest":
            entries += [*(ROOT / "tests" / "kernels").rglob("*.py"), *(ROOT / "tests" / "worker").rglob("*.py"),
                        ROOT / "tests" / "conftest.py", ROOT / "tests" / "support.py"]  # fmt: skip
        else:
            entries.append(ROOT.joinpath(*module.split(".")).with_suffix(".py"))
    needed = set(_script_list(text, "NEEDED_MODULES"))
    assert _third_party_imports(entries) - {"torch", "triton"} <= needed
    assert {"prometheus_client", "llguidance"} <= needed  # worker/metrics.py, worker/guided.py


def test_the_wheels_are_the_modules_the_image_lacks():
    """scripts/gpu-wheels downloads the distributions of the first line of NEEDED_MODULES, no more."""
    first_line = re.search(r'^NEEDED_MODULES="([^"]*)"', SCRIPT.read_text(), re.M).group(1).split()
    packages = {_canonical(p) for p in _script_list(WHEELS.read_text(), "PACKAGES")}
    dists = importlib.metadata.packages_distributions()
    assert {_canonical(d) for module in first_line for d in dists[module]} == packages


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def stand_in_gpu(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the script in an empty checkout, and an environment whose torch and triton are
    stand-ins that see one GPU. NOTE: an empty checkout, since wheels fetched into this one's .whl/
    (for the GPU's Python, not this one) would stop the install before the check under test."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "__version__ = 'stand-in'\n"
        "class cuda:\n    is_available = staticmethod(lambda: True)\n"
        "    get_device_name = staticmethod(lambda: 'Stand-in GPU')\n"
        "class version:\n    cuda = '0'\n"
    )
    (fake / "triton.py").write_text("__version__ = 'stand-in'\n")
    env = {**os.environ, "PYTHON": sys.executable, "GPU_BENCH_SITE": str(tmp_path / "site")}
    env["PYTHONPATH"] = str(fake)  # NOTE: ahead of site-packages: the stand-ins shadow any real torch
    env.pop("OUT", None)
    script = tmp_path / "checkout" / "scripts" / "gpu-bench"
    script.parent.mkdir(parents=True)
    script.write_text(SCRIPT.read_text())
    return script, env


def test_a_module_that_does_not_import_stops_the_run_before_any_step(tmp_path):
    """With a (stand-in) GPU there but prometheus_client missing, nothing runs and the log says why."""
    script, env = stand_in_gpu(tmp_path)
    (tmp_path / "fake" / "prometheus_client.py").write_text("raise ImportError('not on this machine')\n")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(script), "kernels", str(out)], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 4, proc.stdout + proc.stderr
    log = (out / "gpu-bench.log").read_text()
    assert "cannot import prometheus_client (not on this machine). Nothing was run" in log
    assert "=== kernels" not in log and [p.name for p in out.iterdir()] == ["gpu-bench.log"]


def kill_session(sid: int) -> None:
    """SIGKILL every process left in session ``sid`` (the script's steps run under `timeout`, which
    gives each its own process group)."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(ValueError, OSError):
            if os.getsid(int(entry.name)) == sid:
                os.kill(int(entry.name), signal.SIGKILL)


@pytest.mark.parametrize("jobs", [None, pytest.param("1", marks=SLOW)], ids=["default_jobs", "one_process"])
def test_a_gpu_test_that_hangs_ends_its_folder_and_the_next_one_runs(tmp_path, jobs):
    """A gpu test stuck where no signal reaches it (a C call, as a CUDA call that never returns) ends
    its pytest process at GPU_BENCH_TEST_TIMEOUT, not at pytest's 300 s or the run's deadline, with its
    stack in the log, also where the kernels' tests run in several processes (pytest-xdist); the
    worker folder's tests still run and write their report."""
    script, env = stand_in_gpu(tmp_path)
    checkout = script.parent.parent
    (checkout / "kernels").mkdir()
    (checkout / "kernels" / "__init__.py").write_text("")
    (checkout / "kernels" / "bench.py").write_text("def gpu_slug(name):\n    return 'stand-in'\n")
    # NOTE: SIGALRM blocked, so only a timeout that does not wait for a signal handler can end it
    stuck = "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM}); time.sleep(300)"
    for folder, body in (("kernels", stuck), ("worker", "pass")):
        (checkout / "tests" / folder).mkdir(parents=True)
        (checkout / "tests" / folder / f"test_{folder}.py").write_text(
            f"import signal\nimport time\n\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_one():\n    {body}\n"
        )
    out = tmp_path / "out"
    env["GPU_BENCH_TEST_TIMEOUT"] = "3"
    if jobs:
        env["GPU_BENCH_TEST_JOBS"] = jobs
    proc = subprocess.Popen(["bash", str(script), "tests", str(out)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        proc.wait(timeout=120)
    finally:  # NOTE: without the timeout the stuck test would outlive this one by minutes
        kill_session(proc.pid)
    log = (out / "gpu-bench.log").read_text()
    assert proc.returncode == 1 and "gpu-bench: failed: tests" in log, log
    kernels_log = log[log.index("=== tests kernels:") : log.index("=== tests worker:")]
    if jobs is None:  # GPU_BENCH_TEST_JOBS' default: 6 processes, the stuck line in faulthandler's dump
        assert " -n 6 " in kernels_log and 'test_kernels.py", line 9 in test_one' in kernels_log
    else:  # one process: pytest-timeout's dump, with the source
        assert " -n " not in kernels_log and "Timeout" in kernels_log and "time.sleep(300)" in kernels_log
    assert re.search(r"=== tests kernels: exit \d+ in [1-5]?[0-9]s", log), log
    assert "=== tests worker: exit 0" in log and "1 passed" in log
    assert (out / "tests-worker-stand-in.xml").exists()
