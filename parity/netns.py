"""Run a command in a private network namespace, for tests whose processes talk over sockets.

``run_isolated(argv)`` runs ``argv`` under ``unshare``: a new network namespace whose only interface
is loopback (brought up first), so Ray's and gloo's only address is 127.0.0.1 and nothing can reach
or be reached from outside.  Where the kernel allows it, also a new PID namespace with its own
/proc: when the command ends, or is killed at its timeout, the kernel ends every process it started
(Ray's GCS, raylets, workers), so nothing outlives the test.  Where only the network namespace can
be made, the command runs in a process group of its own that is killed whole at the timeout.  A
process group, not a session: on kernels with autogroup scheduling
(/proc/sys/kernel/sched_autogroup_enabled: on here, and in many distributions) each session is
scheduled as one unit and nice levels count only inside it, so a command in a session of its own
takes a whole core from make parity's background builds (nice 19, in pytest's session) instead of
having them yield (measured on one core: a spinning process got 0.50 of it beside a nice-19 spinner
when started in a session of its own, 0.97 in the spinner's session).  ``unavailable()`` says why no
namespace can be made here (no unshare, no privilege, no user namespaces), for the test to skip
with.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys

_NET_AND_PID = ["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child"]
_NET = ["unshare", "--net"]
_LOOPBACK_THEN = 'ip link set lo up && exec "$@"'


def _works(prefix: list[str]) -> str | None:
    try:
        probe = subprocess.run([*prefix, "sh", "-c", _LOOPBACK_THEN, "sh", "true"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    return None if probe.returncode == 0 else probe.stderr.strip() or f"exit code {probe.returncode}"


@functools.lru_cache(maxsize=1)
def _prefix() -> tuple[list[str] | None, str | None]:
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return None, f"no {tool} command: cannot make a private network namespace"
    if _works(_NET_AND_PID) is None:
        return _NET_AND_PID, None
    why = _works(_NET)
    if why is None:
        return _NET, None
    return None, f"cannot make a private network namespace (needs root or user namespaces): {why}"


def unavailable() -> str | None:
    """None when a namespace can be made here, else the reason it cannot."""
    return _prefix()[1]


def run_isolated(argv: list[str], *, timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run argv in a private network namespace (and PID namespace where possible); kill all of it
    after ``timeout`` seconds."""
    prefix, why = _prefix()
    if prefix is None:
        raise RuntimeError(why)
    # (setpgid in the child; preexec_fn, the only way before Python 3.11, is unsafe in threaded parents)
    group = dict(process_group=0) if sys.version_info >= (3, 11) else dict(start_new_session=True)
    proc = subprocess.Popen([*prefix, "sh", "-c", _LOOPBACK_THEN, "sh", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **group)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # with a PID namespace, --kill-child takes all of it along
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} did not finish within {timeout} s; "
                             f"its output:\n{out[-6000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)
