"""The batch-invariant mode is bitwise under every CPU kernel family, not only this machine's.

Each case runs parity/bitwise_probe.py (the invariant matmul, the attention routes, engine == alone ==
trainer for an attention-only and a hybrid model under preemption) in a subprocess whose environment
forces other CPU kernels: numpy's OpenBLAS (``OPENBLAS_CORETYPE``: it runs the Triton interpreter's
``tl.dot``), and torch's ATen and MKL kernels (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``).
The kernel families differ in how they round the slots of a tile (OpenBLAS's Haswell sgemm rounds rows
6-11 of 16 apart from the others; the generic and AVX-512 ones do not), so a mode that passes here by
the luck of one BLAS fails here under another.  The machine's default kernels run in-process in
parity/test_batch_invariant_engine.py and parity/test_batch_invariant_attention.py.  CPU only: the GPU
tier of those files runs the contract on a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ON_GPU

PROBE = Path(__file__).resolve().parent / "bitwise_probe.py"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


# (id, environment, the OpenBLAS core names that environment may select, CPU flags it needs)
KERNELS = [
    ("generic-scalar", dict(OPENBLAS_CORETYPE="Prescott", ATEN_CPU_CAPABILITY="default",
                            MKL_ENABLE_INSTRUCTIONS="SSE4_2"), {"katmai", "prescott"}, set()),
    ("sandybridge-avx", dict(OPENBLAS_CORETYPE="Sandybridge"), {"sandybridge"}, {"avx"}),
    ("avx2-haswell-zen", dict(OPENBLAS_CORETYPE="Haswell", ATEN_CPU_CAPABILITY="avx2",
                              MKL_ENABLE_INSTRUCTIONS="AVX2"), {"haswell", "zen"}, {"avx2", "fma"}),
    ("avx512-skylakex", dict(OPENBLAS_CORETYPE="SkylakeX"), {"skylakex"}, {"avx512f"}),
]


@pytest.mark.skipif(ON_GPU, reason="CPU kernel families; the GPU tier checks the mode on a GPU")
@pytest.mark.parametrize("env,corenames,needs", [k[1:] for k in KERNELS], ids=[k[0] for k in KERNELS])
def test_bitwise_under_every_cpu_kernel_family(env, corenames, needs):
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    proc = subprocess.run([sys.executable, str(PROBE)], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the probe printed no report (exit {proc.returncode}): {proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    print(f"\n{env}: OpenBLAS {report['corename']}, ATen {report['aten']}: {report['checks']}")
    assert report["corename"].lower() in corenames, f"{env} ran OpenBLAS's {report['corename']} kernels"
    failed = {name: c for name, c in report["checks"].items() if c["error"] or c["bitwise"] != c["total"]}
    assert not failed, f"not bitwise under {env}: {failed}"
    assert len(report["checks"]) == 4 and all(c["total"] > 0 for c in report["checks"].values()), report
    assert proc.returncode == 0, proc.stderr[-3000:]
