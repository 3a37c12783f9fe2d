"""Run a Python script as a fresh interpreter would, without importing torch and triton each time.

test_examples.py, test_readme.py and test_single_file.py run some seventy scripts, each "in a fresh
interpreter that sees nothing of this repository" (the copy-one-file promise).  Most of such a run is
importing torch and triton: 3.5-4 s on the CI machine class, over two minutes of make parity in all.
``run_script`` forks each script from a server process (multiprocessing's forkserver) that has imported
torch and triton and nothing else; the child then takes the environment, the working directory and the
argv it is given, a ``sys.path`` of the script's folder and the Python installation's own folders (nothing
of this repository or of pytest), runs the script as ``__main__`` with its stdout and stderr in a file, and
exits as the interpreter does (non-daemon threads joined, atexit functions run).  What a script sees is
what ``python script.py`` sees right after ``import torch, triton``:

- none of this repository's modules and none of pytest's are loaded (the server imports torch and triton
  only; this file, which carries the child's entry point, is dropped from ``sys.modules`` before the
  script runs);
- an import does not initialise CUDA, and Triton reads its settings (``TRITON_INTERPRET``) from the
  environment when a kernel is decorated or launched, so the child's environment applies to both;
- torch's thread pools start at their first use, in the child.

A script that starts processes of its own in a private network (Ray, tensor parallelism) still runs as a
real subprocess (parity/netns.py).
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_PRELOAD = ["torch", "triton"]
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD)
    return _CONTEXT


def _installation_paths() -> list[str]:
    """sys.path entries of the Python installation (stdlib, site-packages): what a fresh interpreter
    started in an empty folder has besides that folder."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    return [p for p in sys.path if p and any(os.path.realpath(p).startswith(r + os.sep) for r in roots)]


def _child(script: str, argv: list[str], cwd: str, env: dict, output: str) -> None:
    """The forked child: becomes ``python script`` run from ``cwd`` with ``env``, output into ``output``."""
    import atexit
    import runpy
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *_installation_paths()]
    sys.argv = [script, *argv]
    sys.modules.pop(__name__, None)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        for t in threading.enumerate():               # the interpreter's exit: wait for non-daemon threads
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def run_script(script, *, cwd, env: dict, timeout: float, argv=()) -> subprocess.CompletedProcess:
    """Run ``script`` as ``python script *argv`` from ``cwd`` with environment ``env`` (see above); returns
    a CompletedProcess with the exit code and stdout + stderr together in ``stdout``.  Killed and
    AssertionError after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "output.txt"
        proc = _context().Process(target=_child, args=(str(script), list(argv), str(cwd), dict(env), str(output)))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            text = output.read_text(errors="replace") if output.exists() else ""
            raise AssertionError(f"{script} did not finish within {timeout} s; its output:\n{text[-6000:]}")
        text = output.read_text(errors="replace") if output.exists() else ""
    return subprocess.CompletedProcess([sys.executable, str(script), *argv], proc.exitcode, text, None)
