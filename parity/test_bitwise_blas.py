"""The batch-invariant mode is bitwise under every CPU kernel family, not only this machine's.

Each case runs parity/bitwise_probe.py (the invariant matmul, the attention routes, the Gated DeltaNet chunk
form's rows and layer, engine == alone == trainer under preemption for an attention-only model with Qwen2 /
Qwen3 / Llama 3's flags, a Qwen3.5-MoE-style hybrid: Gated DeltaNet, attention and experts, and gpt-oss's
layout: sinks, a sliding window, biases, clamped experts) in two subprocesses (its engine checks and the rest)
whose environment forces other CPU kernels: numpy's OpenBLAS (``OPENBLAS_CORETYPE``: it runs the Triton
interpreter's ``tl.dot``), and torch's ATen and MKL kernels (``ATEN_CPU_CAPABILITY``,
``MKL_ENABLE_INSTRUCTIONS``).  The kernel families differ in how they round the slots of a tile (OpenBLAS's
Haswell sgemm rounds rows 6-11 of 16 apart from the others; the generic and AVX-512 ones do not), so a mode
that passes here by the luck of one BLAS fails here under another.  The machine's default kernels run
in-process in parity/test_batch_invariant_engine.py and parity/test_batch_invariant_attention.py.  CPU only:
the GPU tier of those files runs the contract on a GPU.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest

from conftest import ON_GPU, background_process, job_result, start_job

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


def own_corename() -> str:
    """The OpenBLAS kernel family this machine selects by itself (what the in-process tests already run)."""
    from bitwise_probe import openblas_corename
    return openblas_corename().lower()


def make_parity_family() -> str:
    """The one family make parity probes (the others run in make parity-all): Haswell / Zen's AVX2 sgemm, whose
    tile rounding broke the mode once, unless this machine runs it by itself, then the generic scalar one."""
    name, _, corenames, needs = next(k for k in KERNELS if k[0] == "avx2-haswell-zen")
    return name if own_corename() not in corenames and needs <= cpu_flags() else "generic-scalar"


_STARTED: list = []


# Each family's probe in two processes, its checks split by what they run, so that at the end of a run, where the
# probe is the last background job (queued behind the builds), it fills both cores: under the generic scalar
# kernels on a 2-core Zen 1 the engine checks take ~171 CPU s, the kernel checks ~90 (one process left a core
# idle for the last ~3 minutes of make parity).  (part, the probe's --only arguments)
PROBE_PARTS = [("engines", ["--only", "engine"]),
               ("kernels", ["--only", "matmul", "--only", "attention", "--only", "gdn"])]


def start_probes(items=None) -> None:
    """Every selected kernel family's probe, queued as background jobs at the lowest CPU priority as soon as the
    session's tests are collected (conftest.py), behind the ahead-of-time builds: each part runs mostly on one
    core (the interpreter), so they use what the interpreter tests leave idle, and the tests below only read
    their reports."""
    if _STARTED or ON_GPU:
        return
    _STARTED.append(True)
    selected = None if items is None else {item.callspec.params["name"] for item in items
                                           if item.originalname == "test_bitwise_under_every_cpu_kernel_family"}
    for name, env, _, needs in KERNELS:
        if needs <= cpu_flags() and (selected is None or name in selected):
            for part, only in PROBE_PARTS:
                start_job(f"blas-probe-{name}-{part}", functools.partial(
                    background_process, [sys.executable, str(PROBE), *only], env={**os.environ, **env}))


def probe_report(name: str) -> tuple[dict, int, str]:
    """Family ``name``'s probe report, its parts' checks merged: (report, the worst exit code, the logs)."""
    reports, returncode, logs = [], 0, ""
    for part, _ in PROBE_PARTS:
        run = job_result(f"blas-probe-{name}-{part}", timeout=1800)
        returncode, logs = max(returncode, run["returncode"], key=abs), logs + run["log"]
        lines = [ln for ln in run["log"].splitlines() if ln.startswith("{")]
        assert lines, f"the probe's {part} printed no report (exit {run['returncode']}): {run['log'][-3000:]}"
        reports.append(json.loads(lines[-1]))
    assert len({(r["corename"], r["aten"]) for r in reports}) == 1, reports     # the parts ran the same kernels
    return {**reports[0], "checks": {k: c for r in reports for k, c in r["checks"].items()}}, returncode, logs


# make parity probes one family other than this machine's own (a probe costs about 3 CPU-minutes); make
# parity-all every family this CPU can run.
_IN_MAKE_PARITY = None if ON_GPU else make_parity_family()
PARAMS = [pytest.param(*k, id=k[0], marks=[] if ON_GPU or k[0] == _IN_MAKE_PARITY else [pytest.mark.slow])
          for k in KERNELS]


@pytest.mark.skipif(ON_GPU, reason="CPU kernel families; the GPU tier checks the mode on a GPU")
@pytest.mark.parametrize("name,env,corenames,needs", PARAMS)
def test_bitwise_under_every_cpu_kernel_family(name, env, corenames, needs):
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    report, returncode, err = probe_report(name)
    print(f"\n{env}: OpenBLAS {report['corename']}, ATen {report['aten']}: {report['checks']}")
    assert report["corename"].lower() in corenames, f"{env} ran OpenBLAS's {report['corename']} kernels"
    failed = {check: c for check, c in report["checks"].items() if c["error"] or c["bitwise"] != c["total"]}
    assert not failed, f"not bitwise under {env}: {failed}"
    assert len(report["checks"]) == 6 and all(c["total"] > 0 for c in report["checks"].values()), report
    assert returncode == 0, err[-3000:]


@pytest.mark.parametrize("own,flags,family", [
    ("skylakex", {"avx", "avx2", "fma", "avx512f"}, "avx2-haswell-zen"),   # an AVX-512 CPU: the AVX2 family
    ("haswell", {"avx", "avx2", "fma"}, "generic-scalar"),                # runs the AVX2 family by itself
    ("zen", {"avx", "avx2", "fma"}, "generic-scalar"),
    ("sandybridge", {"avx"}, "generic-scalar"),                           # cannot run the AVX2 family
])
def test_make_parity_probes_a_family_the_machine_does_not_run(own, flags, family, monkeypatch):
    """make parity's one family: Haswell / Zen's AVX2 sgemm where the CPU can run it and does not by itself,
    else the generic scalar one (the first entry of KERNELS used to be taken on every machine)."""
    monkeypatch.setattr(sys.modules[__name__], "own_corename", lambda: own)
    monkeypatch.setattr(sys.modules[__name__], "cpu_flags", lambda: flags)
    assert make_parity_family() == family
