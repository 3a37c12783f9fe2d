"""Run a command in a private network namespace, for tests whose processes talk over sockets.

``run_isolated(argv)`` runs ``argv`` under ``unshare``: a new network namespace whose only
interface is loopback (brought up first), so Ray's and gloo's only address is 127.0.0.1 and
nothing can reach or be reached from outside; and a new PID namespace (with its own /proc), so
when the command ends, or is killed at its timeout, the kernel ends every process it started
(Ray's GCS, raylets, workers): nothing outlives the test.  ``unavailable()`` says why a namespace
cannot be made here (no unshare, no privilege, no user namespaces), for the test to skip with.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess

_UNSHARE = ["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child"]
_LOOPBACK_THEN = 'ip link set lo up && exec "$@"'


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when a namespace can be made here, else the reason it cannot."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"no {tool} command: cannot make a private network namespace"
    try:
        probe = subprocess.run([*_UNSHARE, "sh", "-c", _LOOPBACK_THEN, "sh", "true"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0:
        return f"cannot make a private network namespace (needs root or user namespaces): {probe.stderr.strip()}"
    return None


def run_isolated(argv: list[str], *, timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run argv in a private network + PID namespace; kill all of it after ``timeout`` seconds."""
    proc = subprocess.Popen([*_UNSHARE, "sh", "-c", _LOOPBACK_THEN, "sh", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # unshare dies, --kill-child takes the namespace's init with it
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} did not finish within {timeout} s; "
                             f"its output:\n{out[-6000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)
