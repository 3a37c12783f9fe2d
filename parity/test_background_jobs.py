"""conftest.py's background jobs (what test_compile.py, test_bitwise_blas.py and test_numerics_blas.py start at
collection and read later) start under any test's memory use."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import BACKGROUND_NICE, background_process


def test_a_background_job_starts_beside_a_large_address_space():
    """What failed a CI run: a job started while the process held more untouched address space than the machine
    has memory (test_large_index.py's lazily backed tensors, 4-9 GB each) could not start its child: a fork()
    charges the child a copy of every private writable mapping, and the kernel's heuristic overcommit refuses
    one larger than memory and swap (ENOMEM).  conftest.background_process starts the child with vfork (no
    preexec_fn: its priority from nice(1)), which copies nothing."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2":
        pytest.skip("strict overcommit: the address space below cannot be reserved")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    swap = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("SwapTotal:"))
    held = []
    while sum(t.numel() for t in held) <= ram + swap:        # untouched: address space, no memory
        held.append(torch.empty(ram // 2, dtype=torch.uint8))
    try:
        result = background_process([sys.executable, "-c", "import os; print('started at nice', os.nice(0))"],
                                    timeout=60)
    finally:
        del held
    assert result["returncode"] == 0 and f"started at nice {BACKGROUND_NICE}" in result["log"], result


def test_a_job_past_its_time_limit_says_so():
    """A job killed at its limit leaves a log that says it was (a CI run's BLAS probe ended as "exit -9" and an
    empty log: its limit, counted in wall time while the tests held both cores, had passed)."""
    result = background_process([sys.executable, "-c", "import time; print('begun', flush=True); time.sleep(60)"],
                                timeout=3)
    assert result["returncode"] == -9, result
    assert "begun" in result["log"] and "[killed by signal 9 after" in result["log"], result
    assert "its time limit (3 s of wall time)" in result["log"], result
    done = background_process([sys.executable, "-c", "print('done')"], timeout=60)
    assert done == dict(returncode=0, log="done\n"), done
