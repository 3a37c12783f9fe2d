"""Clocks and waiting for the simulated fleets of parity/ and bench/ (never imported by ref/ or fast/).

Both clocks have the router's clock interface, ``now()`` and ``call_at(t, fn)``, plus
``call_later(delay, fn)`` for simulated engines:

    Clock         real time: one thread runs each callback when it is due (a simulated engine's
                  decoding loop, or a router's deadlines).  ``close()`` stops it.
    ManualClock   time moves only in ``advance(dt)``, which runs what fell due, in time order, in
                  the calling thread: breaker back-offs and deadlines become deterministic and
                  instant.

``wait_until(predicate)`` polls observable state until it holds (never a sleep standing in for an
ordering).
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time


class _Timeline:
    """A heap of (t, seq, fn) under a condition variable."""

    def __init__(self):
        self.cv = threading.Condition()
        self.heap: list = []
        self.seq = itertools.count()

    def call_at(self, t: float, fn) -> None:
        with self.cv:
            heapq.heappush(self.heap, (t, next(self.seq), fn))
            self.cv.notify()

    def call_later(self, delay: float, fn) -> None:
        self.call_at(self.now() + delay, fn)

    def now(self) -> float:
        raise NotImplementedError


class Clock(_Timeline):
    """Real time (``time.perf_counter``); callbacks run in the clock's thread, outside its lock."""

    def __init__(self):
        super().__init__()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="sim-clock", daemon=True)
        self.thread.start()

    def now(self) -> float:
        return time.perf_counter()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopped and (not self.heap or self.heap[0][0] > time.perf_counter()):
                    self.cv.wait(self.heap[0][0] - time.perf_counter() if self.heap else None)
                if self.stopped:
                    return
                now, due = time.perf_counter(), []
                while self.heap and self.heap[0][0] <= now:
                    due.append(heapq.heappop(self.heap)[2])
            for fn in due:  # callbacks submit more work
                fn()

    def close(self, timeout: float = 20.0) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify()
        self.thread.join(timeout)


class ManualClock(_Timeline):
    """Time that moves only in ``advance``."""

    def __init__(self, start: float = 0.0):
        super().__init__()
        self.t = start
        self.advancing = threading.Lock()  # one advance at a time

    def now(self) -> float:
        return self.t

    def advance(self, dt: float, between=None) -> None:
        """Move time forward by dt, running every callback that falls due, each at its own time;
        ``between()`` after each one (e.g. to let the threads a callback started finish first)."""
        with self.advancing:
            target = self.t + dt
            while True:
                with self.cv:
                    if not self.heap or self.heap[0][0] > target:
                        self.t = target
                        return
                    t, _, fn = heapq.heappop(self.heap)
                    self.t = max(self.t, t)
                fn()
                if between is not None:
                    between()


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll observable state until ``predicate()`` holds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)
