"""Every Python block in README.md runs as written, the way a user would run it.

A block's first line is a comment naming the files it needs, e.g.
``# ref/ or fast/ paged_varlen_attention.py, copied next to this script``.  For each directory
named there (``ref/``, ``fast/``) the block runs once: the named files of that directory are
copied into an empty folder, the block is written there as a script and run as a fresh interpreter
runs it from that folder (parity/warm_python.py forks it from a process that has imported torch and
triton only), so it sees nothing of this repository but those files (the copy-one-file promise).
fast/ runs on the CPU through the Triton interpreter (``TRITON_INTERPRET=1``), as the README's CPU
instructions say.  A block that uses Ray runs in a
private network namespace (parity/netns.py: loopback only), and so does one that starts tensor-parallel
processes (``tensor_parallel_size``).  A block that names a checkpoint directory ``tiny-<family>`` (a path a
user would point at their own checkpoint) finds one there: the test writes a tiny random Hugging Face
model of that family with ``save_pretrained`` (parity/hf_models.py), nothing downloaded.  A block that uses
transformers runs as on a machine without fla (which ``make install`` never installs; ``make roofline``
does): transformers then runs its own PyTorch Gated DeltaNet, the oracle such a block compares with.  A
block must finish without error within its time limit; what it prints is shown on failure.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from warm_python import run_script

ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"#\s*((?:ref/|fast/)(?:\s+or\s+(?:ref/|fast/))?)\s+(.*?),\s*copied next to this script")
MODULE = re.compile(r"\b([a-z_]+)\.py\b")
TIMEOUT_S = 240


def _blocks() -> list[tuple[int, str]]:
    """(line number, source) of every ```python block in the README."""
    text = (ROOT / "README.md").read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        out.append((text[:m.start()].count("\n") + 1, m.group(1)))
    return out


def _cases():
    cases = []
    for line, source in _blocks():
        first = source.splitlines()[0]
        header = HEADER.search(first)
        if header is None:
            cases.append(pytest.param(line, source, None, [], id=f"README-line-{line}-no-header"))
            continue
        files = [name + ".py" for name in MODULE.findall(header.group(2))]
        for where in re.findall(r"ref/|fast/", header.group(1)):
            cases.append(pytest.param(line, source, where.rstrip("/"), files,
                                      id=f"README-line-{line}-{where.rstrip('/')}"))
    return cases


@pytest.mark.parametrize("line,source,where,files", _cases())
def test_readme_block_runs(line, source, where, files, tmp_path):
    assert where is not None, (f"README.md line {line}: a Python block must start with a comment naming the "
                               f"files it needs, e.g. '# ref/ or fast/ foo.py, copied next to this script'")
    assert files, f"README.md line {line}: the header names no .py file"
    for name in files:
        src = ROOT / where / name
        assert src.exists(), f"README.md line {line}: {where}/{name} does not exist"
        shutil.copy(src, tmp_path / name)
    for family in set(re.findall(r"tiny-([a-z0-9_]+)", source)):
        from hf_models import hf_model
        hf_model(family, seed=0).save_pretrained(tmp_path / f"tiny-{family}")
    if "transformers" in source:       # no fla on the path: transformers' own delta rule, as after make install
        (tmp_path / "fla").mkdir()
        (tmp_path / "fla" / "__init__.py").write_text("raise ImportError('fla is not installed here')\n")
    script = tmp_path / "example.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["TRITON_INTERPRET"] = "1" if where == "fast" else "0"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    argv = [sys.executable, str(script)]
    if "ray" in source or "tensor_parallel_size" in source:
        from netns import run_isolated, unavailable
        if unavailable():
            pytest.skip(unavailable())
        proc = run_isolated(argv, timeout=TIMEOUT_S, cwd=tmp_path, env=env)
    else:
        proc = run_script(script, cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"README.md line {line} ({where}/) failed:\n{proc.stdout[-6000:]}"
