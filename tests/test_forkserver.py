"""tests.forkserver, through start_module: the children it forks run as ``python -m`` would run them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import warnings

import pytest

from tests.support import ROOT, ForkedProcess, fork_server_for, start_module


def _exec_environ(pid: int) -> dict[str, str]:
    """The environment a process was exec'd with (a fresh interpreter's; not a forked child's changes)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if item]
    return {k.decode(): v.decode() for k, v in pairs}


def _printed_env(tmp_path, *names: str) -> dict:
    """What a forked ``python -m tests.print_env`` sees of ``names``."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    server = fork_server_for(env)
    assert server is not None
    log = tmp_path / "print_env.log"
    assert server.start("tests.print_env", list(names), str(log), env).wait(30) == 0
    return json.loads(log.read_text())


@pytest.mark.skipif(
    os.environ.get("RADIXGATE_TEST_FORK") == "0", reason="RADIXGATE_TEST_FORK=0: no fork server"
)
def test_a_forked_child_sees_this_tests_environment_and_reports_the_signal_that_ends_it(
    tmp_path, monkeypatch
):
    backend = start_module("loadtest.echo_backend", [], str(tmp_path))  # the fork server may start here
    try:
        assert isinstance(backend.proc, ForkedProcess)
        assert backend.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            backend.proc.wait(0.05)
        backend.proc.kill()
        assert backend.proc.wait(10) == -signal.SIGKILL
    finally:
        backend.stop()
    # pytest changes PYTEST_CURRENT_TEST from phase to phase: the child sees this one's, not the server's first
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a later test (call)")
    assert _printed_env(tmp_path, "PYTEST_CURRENT_TEST", "PYTHONPATH") == {
        "PYTEST_CURRENT_TEST": "a later test (call)",
        "PYTHONPATH": ROOT,
    }


def test_a_forked_module_exits_with_its_status_and_writes_its_output_to_the_log(tmp_path):
    with pytest.raises(AssertionError, match="router exited with 2") as failed:
        start_module("router", ["--no-such-flag"], str(tmp_path))
    assert "unrecognized arguments: --no-such-flag" in str(failed.value)
    (log,) = tmp_path.glob("router-*.log")
    assert "usage:" in log.read_text()


def test_a_start_under_another_environment_runs_a_fresh_interpreter(tmp_path):
    backend = start_module("loadtest.echo_backend", [], str(tmp_path), env={"RADIXGATE_TEST_MARK": "1"})
    try:
        assert isinstance(backend.proc, subprocess.Popen)
        assert _exec_environ(backend.proc.pid)["RADIXGATE_TEST_MARK"] == "1"
    finally:
        backend.stop()


@pytest.mark.skipif(
    os.environ.get("RADIXGATE_TEST_FORK") == "0", reason="RADIXGATE_TEST_FORK=0: no fork server"
)
def test_a_first_start_under_a_changed_environment_leaves_the_server_the_sessions(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXGATE_TEST_MARK", "changed")
    with pytest.warns(
        UserWarning, match=r"fresh interpreter: os.environ differs .* \['RADIXGATE_TEST_MARK'\]"
    ):
        changed = start_module("loadtest.echo_backend", [], str(tmp_path))
    changed.stop()
    assert isinstance(changed.proc, subprocess.Popen)
    monkeypatch.undo()
    again = start_module("loadtest.echo_backend", [], str(tmp_path))
    again.stop()
    assert isinstance(again.proc, ForkedProcess)


@pytest.mark.skipif(
    os.environ.get("RADIXGATE_TEST_FORK") == "0", reason="RADIXGATE_TEST_FORK=0: no fork server"
)
def test_a_start_after_a_library_set_its_default_cache_dir_is_still_forked(tmp_path):
    # importing torch._dynamo (as transformers' generation utilities do) puts TORCHINDUCTOR_CACHE_DIR into
    # os.environ for the rest of the process: every later start must not fall back to a fresh interpreter
    import torch._dynamo  # noqa: F401

    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no word of a fresh interpreter either
        backend = start_module("loadtest.echo_backend", [], str(tmp_path))
    backend.stop()
    assert isinstance(backend.proc, ForkedProcess)
    # and the child still sees the test's environment whole, that variable included
    assert _printed_env(tmp_path, "TORCHINDUCTOR_CACHE_DIR") == {
        "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]
    }
