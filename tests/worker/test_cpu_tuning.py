"""worker.assembly.tune_cpu_process: torch threads, and glibc keeping freed multi-MiB blocks for reuse
instead of unmapping them (each reuse would page-fault them in again). Measured in child processes by
the minor page faults of the median allocate/fill/free cycle of a 48 MiB tensor."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

CYCLES = textwrap.dedent("""\
    import resource, sys, torch
    if sys.argv[1] == "tuned":
        from worker.assembly import tune_cpu_process
        tune_cpu_process(1)
        assert torch.get_num_threads() == 1, torch.get_num_threads()
    def cycle():
        x = torch.empty(48 << 20, dtype=torch.uint8)
        x.fill_(1)
        del x
    cycle()
    faults = []
    for _ in range(11):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cycle()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sorted(faults)[5])  # the median cycle: an odd cycle that maps a fresh block does not count
    """)


def faults_per_cycle(mode: str) -> float:
    proc = subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc thresholds are glibc's")
def test_tuned_process_reuses_freed_blocks_instead_of_faulting_them_in_again():
    plain, tuned = faults_per_cycle("plain"), faults_per_cycle("tuned")
    pages = (48 << 20) // 4096
    assert plain > pages / 2  # default glibc: every cycle maps the block afresh
    assert tuned < plain / 5, (plain, tuned)
