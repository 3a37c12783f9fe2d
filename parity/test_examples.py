"""Every file in ref/ and fast/ says how to use it: its docstring opens with an example that runs as written.

A file copied into another project does not bring the README, so its own docstring shows the call.  The
example is the first ``::`` block of the module docstring, within its opening lines; its first line names the
files it needs (``# generator_engine.py and decoder_lm.py, copied next to this script``).  Each runs in an
empty folder holding only those files of the same directory, as a fresh interpreter runs it (fast/ through the
Triton interpreter, ``TRITON_INTERPRET=1``, as on a machine without a GPU; parity/warm_python.py forks it from a
process that has imported torch and triton only), and must finish without error.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from warm_python import run_script

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for folder in ("ref", "fast") for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
OPENING_LINES = 12          # the example starts within the docstring's first lines: "opens with"
TIMEOUT_S = 240


def example(path: Path) -> tuple[str, list[str]]:
    """(the example's code, the files its first line names)."""
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines[:OPENING_LINES]) if line.startswith("Example") and
                  line.rstrip().endswith("::")), None)
    assert start is not None, f"{path.parent.name}/{path.name}: the docstring does not open with 'Example...::'"
    body = []
    for line in lines[start + 2:]:
        if line.strip() and not line.startswith("    "):
            break
        body.append(line)
    code = textwrap.dedent("\n".join(body)).strip() + "\n"
    header = code.splitlines()[0]
    assert header.startswith("#") and "copied next to this script" in header, (
        f"{path.name}: the example's first line must name the files it needs, got {header!r}")
    files = [name + ".py" for name in re.findall(r"\b([a-z_]+)\.py\b", header)]
    assert path.name in files, f"{path.name}: the example does not name its own file"
    return code, files


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_docstring_example_runs(path, tmp_path):
    code, files = example(path)
    for name in files:
        shutil.copy(path.parent / name, tmp_path / name)
    (tmp_path / "example.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1" if path.parent.name == "fast" else "0"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = run_script(tmp_path / "example.py", cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{path.parent.name}/{path.name}'s example failed:\n{proc.stdout[-6000:]}"
    assert proc.stdout.strip(), f"{path.name}'s example printed nothing"
    print(f"\n{path.parent.name}/{path.name}: {proc.stdout.strip()[-200:]}")
