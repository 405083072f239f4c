"""The test tiers: each_value_once's cover keeps every value of every parameter in the default tier, and
the tests marked slow are left out of a run unless --full (or RADIXGATE_FULL_TESTS=1) asks for them."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

from tests.support import ROOT, each_value_once


def split(params: list) -> tuple[list[tuple], list[tuple]]:
    default = [tuple(p.values) for p in params if not p.marks]
    slow = [tuple(p.values) for p in params if p.marks]
    assert all(m.name == "slow" for p in params for m in p.marks)
    return default, slow


def test_every_value_of_every_axis_runs_in_as_many_cases_as_the_longest_axis():
    axes = [range(8), "abcde", [True, False]]
    default, slow = split(each_value_once(*axes))
    assert sorted(default + slow) == sorted(itertools.product(*axes))  # the whole product, once each
    assert len(default) == 8
    for i, axis in enumerate(axes):
        assert {case[i] for case in default} == set(axis)
    assert len({(c[1], c[2]) for c in default}) == 8  # no (letter, flag) pair twice while one is new


def test_where_the_cover_has_room_it_takes_pairs_not_run_yet():
    """Four windows x split or not x packed or not: the four cases the windows need run every pair of the
    other two (a cover by values alone could pair split with packed every time)."""
    default, _ = split(each_value_once([1, 7, 33, 400], [1, 4], [False, True]))
    assert len(default) == 4 and {(c[1], c[2]) for c in default} == {
        (1, False),
        (1, True),
        (4, False),
        (4, True),
    }


def test_a_tuple_value_is_one_value_spliced_into_the_case_and_named_in_the_id():
    shapes = [(16, 4, 4), (32, 8, 2), (64, 8, 1)]
    params = each_value_once(shapes, ["x", "y"])
    default, slow = split(params)
    assert len(default) == 3 and len(slow) == 3
    assert {case[:3] for case in default} == set(shapes) and {case[3] for case in default} == {"x", "y"}
    assert all(len(p.values) == 4 for p in params)
    assert params[0].id == "16/4/4-x"


def test_a_single_axis_runs_whole():
    default, slow = split(each_value_once([1, 2, 3]))
    assert default == [(1,), (2,), (3,)] and slow == []


STEPS = "tests/test_gpu_bench.py::test_a_step_without_cuda_fails_clearly_and_changes_nothing"
STEPS_BY_NAME = ("tests/test_gpu_bench.py", "-k", "step_without_cuda")  # selected, not named


def collected(*args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_the_slow_cases_are_deselected_unless_the_full_tier_is_asked_for():
    """gpu-bench's refusal without CUDA, one step of four in the default tier."""
    assert collected(*STEPS_BY_NAME, env={"RADIXGATE_FULL_TESTS": ""}).startswith("1/")
    assert collected(*STEPS_BY_NAME, "--full", env={"RADIXGATE_FULL_TESTS": ""}).startswith("4/")
    assert collected(*STEPS_BY_NAME, env={"RADIXGATE_FULL_TESTS": "1"}).startswith("4/")


def test_a_slow_case_or_test_named_on_the_command_line_runs():
    assert collected(f"{STEPS}[moe]", env={"RADIXGATE_FULL_TESTS": ""}).startswith("1 test collected")
    assert collected(STEPS, env={"RADIXGATE_FULL_TESTS": ""}).startswith("4 tests collected")
