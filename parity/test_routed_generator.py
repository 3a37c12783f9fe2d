"""Routed generator, part 1: the router (ref and fast) and its fault policy, behind fake generators.

The fakes follow ``GeneratorProtocol`` and nothing more:
    ManualGen  futures settled by hand from the test thread (the callbacks then run there, so
               a scripted sequence of events is deterministic); gated, observable weight loads;
               ``restart()`` fails what it holds and comes back at version 0, like a new process
    TimedGen   an engine with ``lanes`` parallel lanes and a latency per request, driven by one
               shared clock thread; scripted failures; slow loads
    InstantGen a future that is already done when ``submit`` returns
Routers whose tests depend on time (deadlines, back-offs) get a ``ManualClock``: time moves only
when the test advances it, so every breaker transition is deterministic and instant.  Every test
runs on both implementations, and ``test_ref_and_fast_make_the_same_decisions`` drives both
through one scripted sequence (submits with sessions, successes, failures, submit errors, futures
that never settle, time passing, restarts, mark_healthy, drain and hot-swap syncs, failed loads)
and compares every dispatch, every outcome, every health event and the final counters.
Synchronization uses Events, joins and ``wait_until`` on observable state, never a sleep standing
in for an ordering.  The chaos tests (many threads, thousands of requests) are in
parity/test_fleet_chaos.py; the Ray fleet in parity/test_ray_fleet.py.
"""
from __future__ import annotations

import math
import random
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future

import pytest
import torch

import fast.routed_generator as fast_rg
import ref.routed_generator as ref_rg
from fleet_sim import Clock, ManualClock, wait_until

IMPLS = [pytest.param(ref_rg, id="ref"), pytest.param(fast_rg, id="fast")]
TIMEOUT = 20.0  # generous: the machine is shared; a hang still fails


@pytest.fixture(params=IMPLS)
def rg(request):
    return request.param


def req(rg, i, session=None, prompt=(1, 2, 3)):
    return rg.Request(list(prompt), request_id=f"r{i}", session_id=session)


# ----------------------------------------------------------------------------- fakes

class ManualGen:
    """Futures settled by hand; every submit is appended to ``log`` (shared across a fleet)."""

    def __init__(self, rg, name, log=None, version=0):
        self.rg, self.name, self.policy_version = rg, name, version
        self.log = log if log is not None else []
        self.pending = []                # [(request, future, version at admission)]
        self.submit_error = None         # raised by every submit while set
        self.submit_error_once = None    # raised by the next submit only
        self.instant = False             # settle every future inside submit (success)
        self.instant_once = False        # settle the next one inside submit
        self.load_gate = None            # load_weights waits for this Event when set...
        self.gate_only = None            # ...only for loads of this version, when set
        self.load_started = threading.Event()
        self.gated_started = threading.Event()
        self.gated_thread = None         # the latest load that waited at the gate
        self.at_gate = set()             # the loads waiting at the gate now
        self.load_error = None
        self.load_thread = None
        self.running = False             # mark futures running at submit (the router cannot cancel them)
        self.serve_version = None        # stamp completions with this version instead of the real one
        self.loads = []                  # (version, requests in flight when the load began)
        self.lock = threading.Lock()

    def submit(self, request):
        with self.lock:
            self.log.append((self.name, request.request_id))
            err, self.submit_error_once = self.submit_error or self.submit_error_once, None
            if err is not None:
                raise err
            fut = Future()
            if self.running:
                fut.set_running_or_notify_cancel()
            self.pending.append((request, fut, self.policy_version))
            instant, self.instant_once = self.instant or self.instant_once, False
        if instant:  # completes before submit returns: the router's callback runs in here
            self.settle(len(self.pending) - 1)
        return fut

    def settle(self, index=0, error=None):
        with self.lock:
            request, fut, v0 = self.pending.pop(index)
        if fut.cancelled():  # the router gave up on it (deadline) and cancelled it
            return
        if error is None:
            v0, v1 = (v0, self.policy_version) if self.serve_version is None else (self.serve_version,) * 2
            samples = [self.rg.Completion(request.request_id, list(request.prompt_token_ids), [7, 8], [-0.5, -0.25],
                                          "length", self.name, v0, v1, i) for i in range(request.sampling.n)]
            fut.set_result(samples if request.sampling.n > 1 else samples[0])
        else:
            fut.set_exception(error)

    def restart(self, error=None):
        """A new process: what it held fails, and it comes back with its initial weights (version 0)."""
        with self.lock:
            held, self.pending = self.pending, []
            self.policy_version = 0
        for _, fut, _ in held:
            if not fut.cancelled():
                fut.set_exception(error or RuntimeError(f"{self.name}: process died"))

    def load_weights(self, state_dict, version):
        self.load_thread = threading.current_thread()
        self.loads.append((version, len(self.pending)))
        gated = self.load_gate is not None and self.gate_only in (None, version)
        if gated:
            self.gated_thread = threading.current_thread()
            self.at_gate.add(self.gated_thread)
            self.gated_started.set()
        self.load_started.set()
        if gated:
            try:
                assert self.load_gate.wait(TIMEOUT), "load gate never opened"
            finally:
                self.at_gate.discard(threading.current_thread())
        if self.load_error is not None:
            raise self.load_error
        self.policy_version = version


@pytest.fixture
def clock():
    c = Clock()
    yield c
    c.close()


@pytest.fixture
def manual():
    return ManualClock()


class TimedGen:
    """An engine with ``lanes`` parallel lanes (FIFO beyond them) and ``latency`` seconds per request.

    ``fail(request, n) -> None | "raise" | "fail"`` scripts failures by submission number n."""

    def __init__(self, rg, name, clock, *, latency, lanes=4, fail=None, load_time=0.0):
        self.rg, self.name, self.clock = rg, name, clock
        self.latency, self.lanes, self.fail, self.load_time = latency, lanes, fail, load_time
        self.policy_version = 0
        self.lock = threading.Lock()
        self.busy, self.waiting = 0, deque()
        self.n_submitted = self.outstanding = self.max_outstanding = 0
        self.completed_ids, self.loads = [], []

    def submit(self, request):
        with self.lock:
            n = self.n_submitted
            self.n_submitted += 1
            action = self.fail(request, n) if self.fail else None
            if action == "raise":
                raise RuntimeError(f"{self.name}: engine is dead")
            self.outstanding += 1
            self.max_outstanding = max(self.max_outstanding, self.outstanding)
            job = (request, Future(), self.policy_version, action)
            start = self.busy < self.lanes
            if start:
                self.busy += 1
            else:
                self.waiting.append(job)
        if start:
            self.clock.call_later(self.latency(request), lambda: self._finish(job))
        return job[1]

    def _finish(self, job):
        request, fut, v0, action = job
        with self.lock:
            nxt = self.waiting.popleft() if self.waiting else None
            if nxt is None:
                self.busy -= 1
            self.outstanding -= 1
            version = self.policy_version
            if action is None:
                self.completed_ids.append(request.request_id)
        if nxt is not None:
            self.clock.call_later(self.latency(nxt[0]), lambda: self._finish(nxt))
        if action == "fail":
            fut.set_exception(RuntimeError(f"{self.name}: lost the request"))
        else:
            fut.set_result(self.rg.Completion(request.request_id, list(request.prompt_token_ids), [1],
                                              [-1.0], "length", self.name, v0, version))

    def load_weights(self, state_dict, version):
        with self.lock:
            self.loads.append((version, self.outstanding))
        if self.load_time:
            time.sleep(self.load_time)  # simulated transfer time; nothing waits on it for ordering
        self.policy_version = version


class InstantGen:
    """``submit`` returns a future that is already done."""

    def __init__(self, rg, name):
        self.rg, self.name, self.policy_version = rg, name, 0
        self.lock = threading.Lock()
        self.completed_ids = []

    def submit(self, request):
        with self.lock:
            self.completed_ids.append(request.request_id)
        fut = Future()
        fut.set_result(self.rg.Completion(request.request_id, request.prompt_token_ids, [0], [0.0], "length",
                                          self.name, self.policy_version, self.policy_version))
        return fut

    def load_weights(self, state_dict, version):
        self.policy_version = version


def names(log):
    return [g for g, _ in log]


# ----------------------------------------------------------------------------- data types and errors

def test_data_types(rg):
    sp = rg.SamplingParams()
    fields = (sp.max_new_tokens, sp.temperature, sp.top_k, sp.top_p, sp.stop_token_ids, sp.seed)
    assert fields == (16, 0.0, 0, 1.0, (), None)
    assert rg.SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    a, b = rg.Request([1, 2]), rg.Request(torch.tensor([5, 6, 7]))
    assert a.request_id != b.request_id and a.request_id.startswith("req-")
    assert b.prompt_token_ids == [5, 6, 7] and isinstance(b.prompt_token_ids[0], int)
    assert rg.Request([1], request_id="mine").request_id == "mine"
    ids = set()
    threads = [threading.Thread(target=lambda: ids.update(rg.Request([1]).request_id for _ in range(500)))
               for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(ids) == 2000  # unique across threads
    for kw, match in [(dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
                      (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                      (dict(stop_token_ids=[-1]), "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            rg.SamplingParams(**kw)
    with pytest.raises(TypeError, match="seed"):
        rg.SamplingParams(seed=1.5)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        rg.Request([])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        rg.Request([1, -2])
    with pytest.raises(TypeError, match="prompt_token_ids"):
        rg.Request([1.5])
    with pytest.raises(TypeError, match="prompt_token_ids"):
        rg.Request(torch.randn(3))
    with pytest.raises(TypeError, match="prompt_token_ids"):
        rg.Request("hello")
    with pytest.raises(TypeError, match="sampling"):
        rg.Request([1], sampling={"max_new_tokens": 3})
    with pytest.raises(TypeError, match="session_id"):
        rg.Request([1], session_id=["unhashable"])
    assert isinstance(ManualGen(rg, "g"), rg.GeneratorProtocol)


def test_constructor_and_argument_errors(rg):
    gens = [ManualGen(rg, "a"), ManualGen(rg, "b")]
    with pytest.raises(ValueError, match="round_robin, least_loaded, sticky, power_of_two"):
        rg.GeneratorRouter(gens, policy="random")
    with pytest.raises(ValueError, match="generators"):
        rg.GeneratorRouter([])
    with pytest.raises(ValueError, match="unique"):
        rg.GeneratorRouter([ManualGen(rg, "a"), ManualGen(rg, "a")])
    with pytest.raises(TypeError, match=r"generators\[1\].*submit"):
        rg.GeneratorRouter([gens[0], object()])
    for kw, match in [(dict(max_inflight=0), "max_inflight"), (dict(max_retries=-1), "max_retries"),
                      (dict(max_sessions=0), "max_sessions"), (dict(failure_threshold=0), "failure_threshold"),
                      (dict(request_timeout_s=0), "request_timeout_s"), (dict(sync_timeout_s=-1.0), "sync_timeout_s"),
                      (dict(request_timeout_s=float("nan")), "request_timeout_s"),
                      (dict(backoff_s=(0.0, 1.0)), "backoff_s"),
                      (dict(backoff_s=(2.0, 1.0)), "backoff_s"), (dict(backoff_s=0.5), "backoff_s")]:
        with pytest.raises(ValueError, match=match):
            rg.GeneratorRouter(gens, **kw)
    with pytest.raises(TypeError, match="clock"):
        rg.GeneratorRouter(gens, clock=time.monotonic)
    router = rg.GeneratorRouter(gens, request_timeout_s=math.inf)  # inf: no deadline
    with pytest.raises(ValueError, match="timeout_s"):
        router.submit(req(rg, "t"), timeout_s=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        router.sync_weights({}, 1, timeout_s=0)
    with pytest.raises(TypeError, match="request"):
        router.submit([1, 2, 3])
    bad = req(rg, "mutated")
    bad.session_id = ["made unhashable after construction"]
    with pytest.raises(TypeError, match="session_id"):
        router.submit(bad)
    assert router.queued == 0
    with pytest.raises(TypeError, match=r"requests\[1\]"):
        router.generate([req(rg, 0), "no"])
    assert gens[0].log == []  # nothing was submitted before the bad one was found
    with pytest.raises(ValueError, match="hot_swap, drain"):
        router.sync_weights({}, 1, mode="rolling")
    with pytest.raises(TypeError, match="version"):
        router.sync_weights({}, 1.0)
    with pytest.raises(TypeError, match="state_dict"):
        router.sync_weights([1], 1)
    with pytest.raises(ValueError, match="name must be one of a, b"):
        router.mark_healthy("c")


# ----------------------------------------------------------------------------- policies

def test_round_robin_cycles_and_skips_unhealthy(rg, manual):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(3)]
    router = rg.GeneratorRouter(gens, policy="round_robin", failure_threshold=1, clock=manual)
    for i in range(9):
        router.submit(req(rg, i))
    assert names(log) == ["g0", "g1", "g2"] * 3
    assert [router.stats()[g.name]["dispatched"] for g in gens] == [3, 3, 3]
    gens[1].settle(error=RuntimeError("boom"))  # g1 leaves the rotation; its request is retried elsewhere
    log.clear()
    for i in range(9, 13):
        router.submit(req(rg, i))
    assert "g1" not in names(log)
    assert router.stats()["g1"]["healthy"] is False and router.stats()["g1"]["state"] == "open"


def test_least_loaded_ties_go_to_least_recently_chosen(rg):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(3)]
    router = rg.GeneratorRouter(gens, policy="least_loaded")
    for i in range(3):
        router.submit(req(rg, i))
    assert names(log) == ["g0", "g1", "g2"]  # all idle: never-chosen go first, in order
    gens[1].settle()
    router.submit(req(rg, 3))
    assert names(log)[-1] == "g1"  # the only one with load 0
    gens[0].settle()
    gens[2].settle()
    gens[1].settle()
    for i in range(4, 7):  # all idle again: least recently chosen first (g0, g2, g1)
        router.submit(req(rg, i))
    assert names(log)[-3:] == ["g0", "g2", "g1"]
    assert router.stats()["g0"]["inflight"] == 1


def test_least_loaded_steers_away_from_loaded_generator(rg):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(3)]
    router = rg.GeneratorRouter(gens, policy="least_loaded")
    for i in range(3):
        router.submit(req(rg, i))
    for i in range(3, 30):  # g1 and g2 finish at once, g0 never does
        for g in gens[1:]:
            while g.pending:
                g.settle()
        router.submit(req(rg, i))
    assert Counter(names(log))["g0"] == 1


def test_power_of_two_distribution_and_seed(rg):
    def run(seed, n_req=2000):
        gens = [InstantGen(rg, f"g{i}") for i in range(4)]
        router = rg.GeneratorRouter(gens, policy="power_of_two", seed=seed)
        router.generate([req(rg, i) for i in range(n_req)])
        return [len(g.completed_ids) for g in gens], [g.completed_ids[:50] for g in gens]
    counts, order = run(1)
    assert sum(counts) == 2000 and all(400 <= c <= 600 for c in counts), counts
    assert run(1)[1] == order  # a seed makes it reproducible
    assert run(2)[1] != order
    # Two generators: both are always drawn, so it is least-loaded exactly.
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(2)]
    router = rg.GeneratorRouter(gens, policy="power_of_two", seed=0)
    router.submit(req(rg, 0))
    for i in range(1, 20):
        router.submit(req(rg, i))
        gens[1].settle()
    assert names(log) == ["g0"] + ["g1"] * 19
    # One generator works too (no pair to draw).
    one = rg.GeneratorRouter([InstantGen(rg, "solo")], policy="power_of_two")
    assert [c.generator_id for c in one.generate([req(rg, i) for i in range(3)])] == ["solo"] * 3


def test_sticky_stays_put_and_moves_off_a_dead_generator(rg, manual):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(3)]
    router = rg.GeneratorRouter(gens, policy="sticky", max_sessions=3, clock=manual)
    home = {}
    for rnd in range(4):
        for s in "abc":
            router.submit(req(rg, f"{s}{rnd}", session=s))
            home.setdefault(s, log[-1][0])
            assert log[-1][0] == home[s], "a session left its generator"
    assert sorted(home.values()) == ["g0", "g1", "g2"]  # new sessions spread least-loaded
    # g(a) fails: a's next request fails there, its retry avoids g(a), and a re-pins where it went.
    dead = next(g for g in gens if g.name == home["a"])
    dead.submit_error = RuntimeError("engine is dead")
    fut = router.submit(req(rg, "a-x", session="a"))
    assert log[-2][0] == dead.name and log[-1][0] != dead.name
    new_home = log[-1][0]
    next(g for g in gens if g.name == new_home).settle(-1)
    assert fut.result(TIMEOUT).generator_id == new_home
    assert router.stats()[dead.name]["healthy"]  # one failure does not open its breaker (threshold 3)
    dead.submit_error = None
    router.submit(req(rg, "a-y", session="a"))
    assert log[-1][0] == new_home  # a stays at its new home
    # No session: least-loaded, no pin.
    router.submit(req(rg, "anon"))
    assert router.stats()[log[-1][0]]["dispatched"] >= 1


def test_sticky_lru_evicts_the_least_recently_used_session(rg):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(2)]
    router = rg.GeneratorRouter(gens, policy="sticky", max_sessions=2)
    for s in "xyz":  # x -> g0, y -> g1, z -> g0 (tie: least recently chosen); z evicts x
        router.submit(req(rg, f"{s}0", session=s))
    assert names(log) == ["g0", "g1", "g0"]
    router.submit(req(rg, "x1", session="x"))  # x forgotten: least-loaded g1, not its old g0
    assert names(log)[-1] == "g1"
    router.submit(req(rg, "y1", session="y"))  # re-pinning x evicted y: tie, least recently chosen g0
    assert names(log)[-1] == "g0"
    router.submit(req(rg, "z1", session="z"))  # z was the oldest when y re-pinned: gone, least-loaded g1
    assert names(log)[-1] == "g1"
    while gens[1].pending:  # g1 idle, g0 loaded: only a live pin still sends y to g0
        gens[1].settle()
    router.submit(req(rg, "y2", session="y"))
    assert names(log)[-1] == "g0"


def test_sticky_full_generator_serves_elsewhere_keeps_pin(rg):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(2)]
    router = rg.GeneratorRouter(gens, policy="sticky", max_inflight=1)
    router.submit(req(rg, 0, session="s"))
    router.submit(req(rg, 1, session="s"))  # g0 full: g1 this once
    assert names(log) == ["g0", "g1"]
    gens[0].settle()
    gens[1].settle()
    router.submit(req(rg, 2, session="s"))
    assert names(log)[-1] == "g0"  # the pin survived


def test_prefix_affinity_keeps_a_prefix_on_one_generator_within_the_slack(rg):
    """Requests behind one 32-token prefix follow the generator that got the first one, until it is more
    than affinity_slack requests busier than the least loaded; another prefix goes least loaded; the
    longest match wins; a generator out of rotation is never chosen for its prefix."""
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(3)]
    router = rg.GeneratorRouter(gens, policy="prefix_affinity", affinity_block=16, affinity_slack=2)
    system = list(range(100, 132))
    for i in range(4):                               # g0 gets the prefix; then 3 more while within the slack
        router.submit(rg.Request(system + [i], request_id=f"a{i}"))
    assert names(log) == ["g0"] * 3 + ["g1"], names(log)     # a3: g0 would be 3 busier than g1 (slack 2)
    router.submit(rg.Request([7] * 40, request_id="other"))   # no match: least loaded (g2)
    router.submit(rg.Request(system + [9], request_id="a4"))  # g0 (3 in flight) vs least loaded g2... (1)
    assert names(log)[-2:] == ["g2", "g1"], names(log)        # the longest run: g0 and g1 both hold 2 blocks
    while gens[0].pending:                                    # g0 idle again: it gets the prefix back
        gens[0].settle()
    router.submit(rg.Request(system + [10], request_id="a5"))
    assert names(log)[-1] == "g0"
    deep = system + list(range(200, 216))                     # a third block: only its holder matches it
    router.submit(rg.Request(deep + [1], request_id="d0"))
    router.submit(rg.Request(deep + [2], request_id="d1"))
    assert names(log)[-2] == names(log)[-1]


def test_groups_through_the_router(rg, manual):
    """A request with sampling.n = 3 comes back as the generator's three completions; when its
    generator fails it, the group is retried elsewhere as a whole, served once."""
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(2)]
    router = rg.GeneratorRouter(gens, clock=manual, request_timeout_s=5.0)
    group = rg.Request([1, 2, 3], rg.SamplingParams(n=3, temperature=1.0, seed=4), request_id="grp")
    f = router.submit(group)
    gens[0].settle(error=RuntimeError("g0 died"))
    gens[1].settle()
    samples = f.result(TIMEOUT)
    assert [c.sample_index for c in samples] == [0, 1, 2] and {c.generator_id for c in samples} == {"g1"}
    assert names(log) == ["g0", "g1"]
    # A generator that answers a group with one completion is a broken answer, not a result.
    gens[0].policy_version = gens[1].policy_version = 0
    bad = router.submit(rg.Request([4], rg.SamplingParams(n=2), request_id="bad"))
    g = next(g for g in gens if g.pending)
    request, fut, v0 = g.pending.pop(0)
    fut.set_result(rg.Completion(request.request_id, [4], [1], [-1.0], "length", g.name, v0, v0))
    assert not bad.done() or bad.exception() is not None
    assert router.stats()[g.name]["stale"] == 1


def test_max_inflight_queue_in_arrival_order(rg):
    log = []
    gens = [ManualGen(rg, "g0", log), ManualGen(rg, "g1", log)]
    router = rg.GeneratorRouter(gens, policy="least_loaded", max_inflight=2)
    futs = [router.submit(req(rg, i)) for i in range(10)]
    assert len(log) == 4 and router.queued == 6
    assert all(router.stats()[g.name]["inflight"] == 2 for g in gens)
    order = [rid for _, rid in log]
    rnd = random.Random(0)
    while router.queued or any(g.pending for g in gens):
        g = rnd.choice([g for g in gens if g.pending])
        g.settle(rnd.randrange(len(g.pending)))
        assert all(len(x.pending) <= 2 for x in gens)
        order = [rid for _, rid in log]
    assert order == [f"r{i}" for i in range(10)]  # dispatched in arrival order
    assert all(f.done() for f in futs)
    # A cancelled queued request is never dispatched.
    a, b, c = (router.submit(req(rg, f"c{i}")) for i in range(3))
    router.submit(req(rg, "c3"))
    router.submit(req(rg, "c4"))
    cancelled = router.submit(req(rg, "c5"))
    assert cancelled.cancel()
    while any(g.pending for g in gens):
        for g in gens:
            while g.pending:
                g.settle()
    assert "c5" not in [rid for _, rid in log] and router.queued == 0


def test_least_loaded_capped_beats_uncapped_round_robin(rg, clock):
    """One generator 5x slower: least-loaded with a cap sends it little work and finishes sooner.  "Sooner"
    is measured as the busiest generator's work (its requests' latencies over its lanes: the makespan's
    lower bound), which depends on where requests went, not on how busy this machine is."""
    latency = {0: 0.02, 1: 0.004, 2: 0.004, 3: 0.004}

    def run(policy, cap):
        gens = [TimedGen(rg, f"g{i}", clock, lanes=4, latency=lambda r, s=latency[i]: s) for i in range(4)]
        router = rg.GeneratorRouter(gens, policy=policy, max_inflight=cap)
        out = router.generate([req(rg, i) for i in range(160)])
        assert len({c.request_id for c in out}) == 160
        busiest = max(len(g.completed_ids) * latency[i] / 4 for i, g in enumerate(gens))
        return busiest, len(gens[0].completed_ids), max(g.max_outstanding for g in gens)
    rr_busy, rr_slow, _ = run("round_robin", None)
    ll_busy, ll_slow, ll_max = run("least_loaded", 4)
    assert rr_slow == 40                         # uncapped round robin: a quarter to the slow one
    assert ll_slow <= 24, ll_slow                # least-loaded: ~6% expected (rate 0.8 of 12.8 per ms)
    assert ll_max <= 4                           # the cap holds
    assert ll_busy < 0.75 * rr_busy, (ll_busy, rr_busy)  # expected ~0.45x (the fast ones then hold the most)


# ----------------------------------------------------------------------------- failures

def test_failover_loses_and_duplicates_nothing(rg, clock):
    def flaky(kind, from_n):
        return lambda request, n: kind if n >= from_n else None
    gens = [TimedGen(rg, "g0", clock, latency=lambda r: 0.001),
            TimedGen(rg, "g1", clock, latency=lambda r: 0.002, fail=lambda r, n: "fail" if n in (5, 6) else None),
            TimedGen(rg, "g2", clock, latency=lambda r: 0.001, fail=flaky("raise", 10)),
            TimedGen(rg, "g3", clock, latency=lambda r: 0.001, fail=flaky("fail", 20))]
    router = rg.GeneratorRouter(gens, policy="least_loaded", max_inflight=3, max_retries=3, failure_threshold=1,
                                clock=ManualClock())  # no time passes for the router: the opened stay open
    barrier = threading.Barrier(4)
    results = {}

    def worker(k):
        barrier.wait()
        futs = {f"t{k}-{i}": router.submit(rg.Request([k, i], request_id=f"t{k}-{i}")) for i in range(75)}
        for rid, f in futs.items():
            results[rid] = f.result(TIMEOUT)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join(TIMEOUT * 2) for t in threads]
    assert len(results) == 300 and all(c.request_id == rid for rid, c in results.items())
    served = Counter(rid for g in gens for rid in g.completed_ids)
    assert set(served) == set(results) and set(served.values()) == {1}, "a request was lost or served twice"
    by_gen = Counter(c.generator_id for c in results.values())
    assert by_gen["g2"] <= 10 and by_gen["g3"] <= 20  # nothing served after they died
    stats = router.stats()
    assert stats["g2"]["healthy"] is False and stats["g3"]["healthy"] is False and stats["g1"]["healthy"] is False
    assert "engine is dead" in stats["g2"]["last_error"]
    assert sum(s["inflight"] for s in stats.values()) == 0 and router.queued == 0
    assert sum(s["completed"] for s in stats.values()) == 300


class FailingGen:
    """Every request fails at once: ``submit`` raises, or returns a future that has already failed."""

    def __init__(self, rg, name, how):
        self.name, self.policy_version, self.how = name, 0, how

    def submit(self, request):
        if self.how == "raise":
            raise RuntimeError(f"{self.name}: engine is dead")
        fut = Future()
        fut.set_exception(RuntimeError(f"{self.name}: lost the request"))
        return fut

    def load_weights(self, state_dict, version):
        self.policy_version = version


def test_every_generator_failing_gives_an_error_not_a_hang(rg, manual):
    """Every generator fails every request: breakers open, back off (0.5, 1, 2, 4, 5, 5 ... s), probe,
    fail again; each request fails after max_retries + 1 attempts with every cause, none hangs."""
    gens = [FailingGen(rg, "g0", "fail"), FailingGen(rg, "g1", "raise"), ManualGen(rg, "g2")]
    gens[2].submit_error = ConnectionError("g2 unreachable")
    router = rg.GeneratorRouter(gens, max_retries=5, max_inflight=1, failure_threshold=1, clock=manual,
                                request_timeout_s=1000.0)
    futs = [router.submit(req(rg, i)) for i in range(6)]
    assert {s["state"] for s in router.stats().values()} == {"open"} and router.queued == 6  # waiting
    steps = 0
    while not all(f.done() for f in futs):
        manual.advance(0.25)  # back-offs end, probes fail: every failure here is synchronous
        steps += 1
        assert steps < 400, "requests hang"
    for f in futs:
        exc = f.exception(0)
        assert isinstance(exc, rg.RouterError) and "after 6 attempts" in str(exc)
        assert {"g0", "g1", "g2"} <= {name for name, _ in exc.causes}
        assert "g2 unreachable" in str(exc) and "engine is dead" in str(exc) and "lost the request" in str(exc)
    opened = [float(d.split()[1]) for _, g, e, d in router.health_events() if g == "g0" and e == "opened"]
    assert opened[:6] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0], opened  # exponential, capped
    # Retries exhausted while a healthy generator remains still fails with every cause.
    a, b, c = ManualGen(rg, "a"), ManualGen(rg, "b"), ManualGen(rg, "c")
    router = rg.GeneratorRouter([a, b, c], policy="round_robin", max_retries=1)
    f = router.submit(req(rg, "x"))
    a.settle(error=RuntimeError("a broke"))
    b.settle(error=RuntimeError("b broke"))
    exc = f.exception(TIMEOUT)
    assert isinstance(exc, rg.RouterError) and [n for n, _ in exc.causes] == ["a", "b"]
    assert router.stats()["c"]["dispatched"] == 0


def test_bad_request_fails_alone(rg):
    g = ManualGen(rg, "g0")
    router = rg.GeneratorRouter([g])
    g.submit_error_once = ValueError("prompt_token_ids too long for this engine")
    with pytest.raises(ValueError, match="too long"):
        router.submit(req(rg, 0)).result(TIMEOUT)
    s = router.stats()["g0"]
    assert s["healthy"] and s["inflight"] == 0 and s["failures"] == 0
    f = router.submit(req(rg, 1))
    g.settle()
    assert f.result(TIMEOUT).generator_id == "g0"


def test_queued_requests_fail_when_the_fleet_stays_down(rg, manual):
    """The only generator opens: queued requests wait for its re-admission, at most timeout_s each."""
    g = ManualGen(rg, "only")
    router = rg.GeneratorRouter([g], max_inflight=1, max_retries=3, failure_threshold=1, clock=manual,
                                request_timeout_s=2.0, backoff_s=(5.0, 5.0))
    futs = [router.submit(req(rg, i)) for i in range(4)]
    manual.advance(1.0)
    late = router.submit(req(rg, "late"), timeout_s=3.0)  # its own deadline
    assert router.queued == 4
    g.settle(error=RuntimeError("gone"))                 # at t = 1: open for 5 s, the fleet is down
    assert router.queued == 5 and not any(f.done() for f in futs)
    manual.advance(1.999)
    assert not any(f.done() for f in futs)
    manual.advance(0.002)                                # t = 3.001: 2 s since the fleet went down
    for f in futs:
        exc = f.exception(0)
        assert isinstance(exc, rg.RouterError) and "no generator in rotation for 2 s" in str(exc), exc
        assert "gone" in str(exc)
    assert not late.done()                               # 3 s for this one
    manual.advance(1.0)
    assert isinstance(late.exception(0), rg.RouterError) and router.queued == 0
    assert [e for _, _, e, _ in router.health_events()] == ["opened", "fleet_down"]


def test_deep_synchronous_chains_do_not_recurse(rg):
    """A queue far longer than the recursion limit drains in one call through a generator that
    completes inside ``submit``: each completion frees the slot for the next dispatch, which
    must not nest one call deeper per request."""
    g = ManualGen(rg, "g0")
    router = rg.GeneratorRouter([g], max_inflight=1)
    first = router.submit(req(rg, "first"))
    n = sys.getrecursionlimit() * 3
    queued = [router.submit(req(rg, i)) for i in range(n)]
    assert router.queued == n and not any(f.done() for f in queued)
    g.instant = True
    g.settle()  # frees the slot: the whole queue runs through g inside this call
    assert first.done() and all(f.done() for f in queued)
    assert [f.result().request_id for f in queued] == [f"r{i}" for i in range(n)]
    assert router.queued == 0 and router.stats()["g0"]["completed"] == n + 1


# ----------------------------------------------------------------------------- the fault policy

def test_deadline_retries_elsewhere_and_drops_the_late_result(rg, manual):
    log = []
    a, b = ManualGen(rg, "a", log), ManualGen(rg, "b", log)
    router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual, request_timeout_s=10.0)
    f = router.submit(req(rg, "x"))
    manual.advance(9.99)
    assert names(log) == ["a"] and not f.done()
    manual.advance(0.02)  # its deadline: a takes a strike, its future is cancelled, b gets the retry
    assert names(log) == ["a", "b"] and a.pending[0][1].cancelled()
    a.pending.clear()
    st = router.stats()["a"]
    assert (st["timeouts"], st["failures"], st["inflight"], st["state"]) == (1, 1, 0, "closed")
    b.settle()
    assert f.result(0).generator_id == "b"
    # A future the generator already runs cannot be cancelled: its late result is dropped.
    a.running = True
    g = router.submit(req(rg, "y"), timeout_s=1.0)  # a per-request deadline
    assert names(log)[-1] == "a"
    manual.advance(1.01)
    assert names(log)[-1] == "b" and not g.done()
    a.settle()  # late: dropped, not served
    assert not g.done() and router.stats()["a"]["late"] == 1
    b.settle()
    assert g.result(0).generator_id == "b" and router.stats()["a"]["completed"] == 0
    # A deadline is per attempt: with max_retries=2 a request that nobody answers fails after 3.
    h = router.submit(req(rg, "z"), timeout_s=1.0)
    for _ in range(3):
        manual.advance(1.01)
    exc = h.exception(0)
    assert isinstance(exc, rg.RouterError) and "after 3 attempts" in str(exc) and "no result within 1 s" in str(exc)


def test_breaker_threshold_backoff_and_probe(rg, manual):
    """Isolated failures never open it; three in a row do; after the back-off one probe decides."""
    log = []
    a, b = ManualGen(rg, "a", log), ManualGen(rg, "b", log)
    router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual, backoff_s=(0.5, 2.0))
    on_a = 0
    for i in range(30):  # every other request a gets fails: never three in a row
        f = router.submit(req(rg, i))
        while not f.done():
            if a.pending:
                on_a += 1
                a.settle(error=RuntimeError("blip") if on_a % 2 else None)
            else:
                b.settle()
        assert f.exception(0) is None
    assert router.stats()["a"]["state"] == "closed" and router.stats()["a"]["failures"] > 3
    while router.stats()["a"]["state"] == "closed":  # now a fails everything: three in a row open it
        f = router.submit(req(rg, "bad"))
        while not f.done():
            a.settle(error=RuntimeError("down")) if a.pending else b.settle()
    assert router.stats()["a"]["consecutive" if False else "failures"] > 3
    for i in range(4):  # all to b while a backs off
        router.submit(req(rg, f"b{i}"))
        assert log[-1][0] == "b"
        b.settle()
    manual.advance(0.5)
    assert router.stats()["a"]["state"] == "half_open"
    router.submit(req(rg, "probe"))
    router.submit(req(rg, "after-probe"))
    assert names(log)[-2:] == ["a", "b"]  # one probe only
    a.settle(error=RuntimeError("still down"))  # probe fails: open again, twice as long
    b.settle()
    b.settle()
    manual.advance(0.99)
    assert router.stats()["a"]["state"] == "open"
    manual.advance(0.02)
    assert router.stats()["a"]["state"] == "half_open"
    router.submit(req(rg, "probe2"))
    a.settle()  # probe succeeds: closed, back-off reset
    assert router.stats()["a"]["state"] == "closed"
    events = [(e, d.split()[1] if e == "opened" else "") for _, g, e, d in router.health_events() if g == "a"]
    assert events == [("opened", "0.5"), ("readmitting", ""), ("half_open", ""), ("opened", "1"),
                      ("readmitting", ""), ("half_open", ""), ("closed", "")]


def test_a_restarted_generator_never_serves_stale_weights(rg, manual):
    """A generator that lost its weights is refused at dispatch (it reports a version below its floor)
    and its stale completions are never served; it is re-synced before its probe."""
    log = []
    a, b = ManualGen(rg, "a", log), ManualGen(rg, "b", log)
    router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual)
    weights = {"w": torch.full((2,), 3.0)}
    router.sync_weights(weights, 3)
    f = router.submit(req(rg, 0))
    assert names(log) == ["a"]
    a.restart()  # its request fails and goes to b; a now reports version 0
    assert names(log) == ["a", "b"]
    b.settle()
    assert f.result(0).min_policy_version == 3
    g = router.submit(req(rg, 1))  # round robin picks a: refused before submit (0 < floor 3), b serves
    assert names(log)[-1] == "b" and "refused" not in names(log)
    b.settle()
    assert g.result(0).generator_id == "b" and "below the 3 it was admitted with" in router.stats()["a"]["last_error"]
    # A generator that reports the right version but serves older weights: the completion is refused.
    c = ManualGen(rg, "c", log, version=3)
    router = rg.GeneratorRouter([c, b], policy="round_robin", clock=manual)
    c.serve_version = 0
    h = router.submit(req(rg, 2))
    c.settle()
    assert names(log)[-1] == "b" and not h.done()
    b.settle()
    assert h.result(0).generator_id == "b" and router.stats()["c"]["completed"] == 0
    # Re-admission after the back-off re-syncs a (version 0 -> 3) before its probe.
    a.restart()
    a.submit_error = None
    router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual, failure_threshold=1)
    b.policy_version = 3
    router.sync_weights(weights, 4)  # both load 4
    a.restart()                       # back to 0
    fut = router.submit(req(rg, 3))   # refused at dispatch: open
    b.settle()
    assert fut.result(0).generator_id == "b" and router.stats()["a"]["state"] == "open"
    a.load_started.clear()
    manual.advance(0.5)
    assert a.load_started.wait(TIMEOUT)
    wait_until(lambda: router.stats()["a"]["state"] == "half_open", what="re-sync")
    assert a.policy_version == 4 and a.loads[-1][0] == 4
    probe = router.submit(req(rg, 4))
    a.settle()
    assert probe.result(0).min_policy_version == 4 and router.stats()["a"]["state"] == "closed"


@pytest.mark.parametrize("mode", ["drain", "hot_swap"])
def test_sync_deadline_drops_a_hung_generator(rg, manual, mode):
    """drain: a's request never finishes; hot_swap: a's load never returns.  Either way the sync
    ends at its deadline without a, b serves the new version, and a is re-synced once it returns."""
    log = []
    a, b = ManualGen(rg, "a", log), ManualGen(rg, "b", log)
    router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual, sync_timeout_s=5.0,
                                request_timeout_s=60.0)
    stuck = router.submit(req(rg, "stuck"))  # a never settles it
    gate = threading.Event()
    if mode == "hot_swap":
        a.load_gate = gate
    t, box = _start_sync(router, 1, mode)
    if mode == "drain":
        wait_until(lambda: router.stats()["b"]["policy_version"] == 1, what="b to load")
    else:
        assert a.load_started.wait(TIMEOUT)
        wait_until(lambda: b.policy_version == 1, what="b to load")
    assert t.is_alive()
    manual.advance(5.01)
    t.join(TIMEOUT)
    assert isinstance(box.get("error"), rg.RouterError) and "a: TimeoutError" in str(box["error"])
    st = router.stats()
    assert router.policy_version == 1 and st["a"]["state"] == "open" and st["b"]["policy_version"] == 1
    later = router.submit(req(rg, "later"))
    assert names(log)[-1] == "b"
    b.settle()
    assert (later.result(0).min_policy_version, later.result(0).max_policy_version) == (1, 1)
    if mode == "hot_swap":
        manual.advance(1.0)  # back-off over, but a's load is still running: a waits for it
        assert router.stats()["a"]["state"] == "open"
        gate.set()           # the load returns (late): a now holds 1, no re-sync needed...
        wait_until(lambda: a.policy_version == 1, what="the late load")
        assert router.stats()["a"]["state"] == "open"  # ...but its older request is still out
        a.settle()           # it ends (within its deadline: served, admitted at 0 on a's floor 0)
        assert (stuck.result(0).min_policy_version, stuck.result(0).max_policy_version) == (0, 1)
        assert router.stats()["a"]["state"] == "half_open"
    else:
        manual.advance(60.0)  # stuck's deadline: retried on b; a's older attempts are over: re-sync
        b.settle()
        assert stuck.result(0).generator_id == "b"
        wait_until(lambda: router.stats()["a"]["state"] == "half_open", what="re-admission")
        assert a.loads[-1][0] == 1 and a.policy_version == 1
    assert [e for _, g, e, _ in router.health_events() if g == "a"][:2] == ["sync_missed", "opened"]


def test_close_is_bounded(rg):
    g = ManualGen(rg, "never")  # never settles anything
    router = rg.GeneratorRouter([g], max_inflight=1)
    inflight, queued = router.submit(req(rg, 0)), router.submit(req(rg, 1))
    t0 = time.monotonic()
    router.close(timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0
    for f in (inflight, queued):
        assert isinstance(f.exception(0), rg.RouterError) and "closed" in str(f.exception(0))
    with pytest.raises(RuntimeError, match="closed"):
        router.submit(req(rg, 2))
    g.settle()  # a late result after close is dropped quietly
    with rg.GeneratorRouter([InstantGen(rg, "i")]) as r:  # close() in __exit__, nothing outstanding
        assert r.generate([req(rg, 3)])[0].generator_id == "i"


# ----------------------------------------------------------------------------- fleet faults, part 2 (issue 22)

class MortalGen(ManualGen):
    """A ManualGen with the protocol's optional ``dead`` attribute: a process out of restarts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dead = False


@pytest.mark.parametrize("order", ["sync_during_readmission", "readmission_during_sync"])
@pytest.mark.parametrize("b_fails", [False, True])
def test_the_last_sync_wins_over_a_readmission(rg, manual, order, b_fails):
    """a restarted (version 0) and is re-admitted (re-synced to 1) while a sync to 2 runs, whichever
    starts first: a joins the sync and serves 2, or the sync says it did not reach a; it never
    reports success while a serves 1, nor calls a "not in rotation" when a is back.  (3 rounds)"""
    for _ in range(3):
        a, b = ManualGen(rg, "a"), ManualGen(rg, "b")
        router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual, sync_timeout_s=60.0,
                                    failure_threshold=1)
        router.sync_weights({"w": torch.ones(2)}, 1)
        a.restart()                                  # a new process: version 0, below its floor 1
        f = router.submit(req(rg, "x"))              # refused by a (it lost its weights): b serves
        b.settle()
        assert f.result(TIMEOUT).generator_id == "b" and router.stats()["a"]["state"] == "open"
        gate_a, gate_b = threading.Event(), threading.Event()
        b.load_gate, b.gate_only = gate_b, 2         # b's load of 2 takes a while
        if b_fails:
            b.load_error = RuntimeError("b: bad shard")
        if order == "sync_during_readmission":
            a.load_gate, a.gate_only = gate_a, 1     # a's re-sync to 1 takes a while
            manual.advance(0.5)                      # the back-off ends: a re-syncs to 1 ...
            assert a.gated_started.wait(TIMEOUT)
            t, box = _start_sync(router, 2, "hot_swap")  # ... while the sync to 2 starts
            assert b.gated_started.wait(TIMEOUT)
            gate_a.set()                             # a's re-admission ends during the sync
        else:
            t, box = _start_sync(router, 2, "hot_swap")
            assert b.gated_started.wait(TIMEOUT)
            manual.advance(0.5)                      # a's re-admission starts and ends during the sync
        wait_until(lambda: a.policy_version == 2 or router.stats()["a"]["state"] == "half_open", what="a back")
        gate_b.set()
        t.join(TIMEOUT)
        assert not t.is_alive()
        wait_until(lambda: router.stats()["a"]["state"] in ("half_open", "open"), what="a settled")
        if b_fails:  # the error names b, and only b: a loaded 2
            assert isinstance(box.get("error"), rg.RouterError)
            assert [name for name, _ in box["error"].causes] == ["b"], box["error"]
        else:
            assert not box, box
        assert router.policy_version == 2
        assert a.policy_version == 2, f"a serves version {a.policy_version} after the sync to 2 ended"
        probe = router.submit(req(rg, "probe"))       # a is half-open: its probe
        a.settle()
        assert probe.result(TIMEOUT).min_policy_version == 2 and router.stats()["a"]["state"] == "closed"


def test_a_generator_dropped_from_a_drain_and_rejoining_loads_once(rg, manual):
    """Drain to 1: a's load waits for a's request; the request fails, a is opened and dropped from
    the sync, then re-admitted at once (mark_healthy) and joins the sync again.  The thread of a's
    first turn must end without loading: one load of a, never two at once.  (The race is lost in
    most rounds without turns: the dropped thread wakes after a has joined again.)  (20 rounds)"""
    for _ in range(20):
        a, b = ManualGen(rg, "a"), ManualGen(rg, "b")
        router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual, failure_threshold=1)
        f = router.submit(req(rg, "x"))              # round robin: a holds it
        gate = threading.Event()
        a.load_gate = b.load_gate = gate             # loads wait here until every check is made
        t, box = _start_sync(router, 1, "drain")
        assert b.gated_started.wait(TIMEOUT)         # b idle: its load began; a's waits for x
        a.settle(error=RuntimeError("a failed"))     # a opened: dropped from the sync ...
        router.mark_healthy("a")                     # ... and back in it (nothing to re-sync)
        assert a.gated_started.wait(TIMEOUT)
        time.sleep(0.05)                             # room for a second load to show itself
        assert len(a.loads) == 1, f"a was loaded {len(a.loads)} times: {a.loads}"
        gate.set()
        t.join(TIMEOUT)
        assert not t.is_alive() and not box, box
        # x, retried on b once the drain ended: the load's thread hands it to b after the sync ends,
        # so sync_weights may return first
        wait_until(lambda: b.pending, what="x retried on b")
        b.settle()
        assert f.result(TIMEOUT).generator_id == "b"
        assert a.loads == [(1, 0)] and b.loads == [(1, 0)] and router.policy_version == 1
        router.close()


def test_an_engine_refusing_a_request_costs_the_generator_nothing(rg, manual):
    """ValueError / TypeError as a generator future's exception (an engine inside an actor refused
    the request): the request fails alone with that type, is not retried, and nobody is struck."""
    log = []
    a, b = ManualGen(rg, "a", log), ManualGen(rg, "b", log)
    router = rg.GeneratorRouter([a, b], policy="round_robin", clock=manual, failure_threshold=1)
    for i, exc in enumerate([ValueError("needs 62 KV slots; the pool has 8"), TypeError("prompt of floats")]):
        f = router.submit(req(rg, i))
        (a, b)[i].settle(error=exc)  # round robin: a, then b
        with pytest.raises(type(exc), match=str(exc)):
            f.result(TIMEOUT)
    assert len(log) == 2  # one attempt each: nothing retried
    for s in router.stats().values():
        assert (s["failures"], s["state"], s["inflight"]) == (0, "closed", 0), s
    assert [e for _, _, e, _ in router.health_events()] == []


@pytest.mark.parametrize("mode", ["drain", "hot_swap"])
def test_close_ends_a_sync_under_way(rg, mode):
    """The router's own clock (real time).  drain: a's request never ends; hot_swap: a's load never
    returns.  close() during the sync ends it at once (RouterError naming a); a sync after close()
    raises.  (3 rounds)"""
    for _ in range(3):
        a, b = ManualGen(rg, "a"), ManualGen(rg, "b")
        router = rg.GeneratorRouter([a, b], policy="round_robin", sync_timeout_s=30.0, request_timeout_s=30.0)
        router.submit(req(rg, "stuck"))            # on a, never settled
        gate = threading.Event()
        if mode == "hot_swap":
            a.load_gate = gate
        t, box = _start_sync(router, 1, mode)
        wait_until(lambda: b.policy_version == 1, what="b to load")
        t0 = time.monotonic()
        router.close()
        t.join(5.0)
        try:
            assert not t.is_alive(), f"sync_weights still waits {time.monotonic() - t0:.1f} s after close()"
            err = box.get("error")
            assert isinstance(err, rg.RouterError) and [n for n, _ in err.causes] == ["a"], err
            assert "closed" in str(err) and router.policy_version == 1
            with pytest.raises(RuntimeError, match="closed"):
                router.sync_weights({}, 2)
        finally:
            gate.set()


def test_a_request_waits_when_its_last_generator_lost_its_weights(rg, manual):
    """The only generator restarts (version 0, below its floor 1): the first dispatch finds it and
    opens it, and the request waits for its re-admission (re-synced to 1) up to its deadline instead
    of burning its retries on it at once.  (3 rounds)"""
    for _ in range(3):
        a = ManualGen(rg, "a")
        router = rg.GeneratorRouter([a], clock=manual, request_timeout_s=30.0)  # failure_threshold 3
        router.sync_weights({"w": torch.ones(2)}, 1)
        a.restart()
        f = router.submit(req(rg, "waits"))
        assert not f.done(), f"the request failed at once: {f.exception(0)!r}"
        st = router.stats()["a"]
        assert (st["state"], st["dispatched"], st["failures"]) == ("open", 1, 1), st
        manual.advance(0.5)                            # a's back-off: re-synced to 1, then the request
        wait_until(lambda: router.stats()["a"]["dispatched"] == 2, what="the request to reach a again")
        assert router.stats()["a"]["state"] == "half_open" and a.policy_version == 1
        a.settle()
        c = f.result(TIMEOUT)
        assert (c.generator_id, c.min_policy_version) == ("a", 1) and router.stats()["a"]["state"] == "closed"


def test_a_dead_generator_is_removed_once(rg, manual):
    """A generator that reports ``dead`` leaves the fleet when the router would dispatch to it, open
    it or re-admit it: state "dead", one health event, never re-admitted or synced again; a sync
    afterwards does not wait for it and says so; with every generator dead, requests fail at once."""
    log = []
    a, b, c = MortalGen(rg, "a", log), ManualGen(rg, "b", log), MortalGen(rg, "c", log)
    router = rg.GeneratorRouter([a, b, c], policy="round_robin", clock=manual, failure_threshold=1,
                                sync_timeout_s=60.0)
    f = router.submit(req(rg, 0))                  # on a
    a.dead = True
    a.restart(RuntimeError("a: actor died"))       # a's request fails: a would open, it is removed
    b.settle()
    assert f.result(TIMEOUT).generator_id == "b"
    g = router.submit(req(rg, 1))                  # on c, which fails; c is opened (not dead yet)
    c.settle(error=RuntimeError("c: actor died"))
    b.settle()
    assert g.result(TIMEOUT).generator_id == "b" and router.stats()["c"]["state"] == "open"
    c.dead = True                                  # it dies for good while open
    for _ in range(5):
        manual.advance(30.0)                       # back-offs end again and again
    st = router.stats()
    assert (st["a"]["state"], st["c"]["state"], st["b"]["state"]) == ("dead", "dead", "closed"), st
    events = [(g, e) for _, g, e, _ in router.health_events() if g in ("a", "c")]
    assert events == [("a", "removed"), ("c", "opened"), ("c", "removed")], events
    for gen in (a, c):
        gen.load_gate = threading.Event()          # a load would hang: the sync must not try one
    router.sync_weights({"w": torch.ones(2)}, 1)
    assert a.loads == c.loads == [] and b.policy_version == 1
    synced = [d for _, g, e, d in router.health_events() if e == "synced"]
    assert synced == ["version 1 (hot_swap): loaded by 1 of 3; dead: a, c"], synced
    with pytest.raises(ValueError, match="dead"):
        router.mark_healthy("a")
    h = router.submit(req(rg, 2))
    assert names(log)[-1] == "b"
    # Every generator dead: queued and new requests fail at once (found dead by a failure, or at
    # re-admission while requests wait for it).
    for when in ("failure", "readmission"):
        only = MortalGen(rg, "only")
        solo = rg.GeneratorRouter([only], clock=manual, failure_threshold=1, request_timeout_s=600.0)
        queued = solo.submit(req(rg, 3))
        if when == "failure":
            only.dead = True
        only.restart(RuntimeError("only: actor died"))
        if when == "readmission":
            assert solo.stats()["only"]["state"] == "open" and not queued.done()
            only.dead = True
            manual.advance(0.5)
        for fut in (queued, solo.submit(req(rg, 4))):
            exc = fut.exception(TIMEOUT)
            assert isinstance(exc, rg.RouterError) and "every generator is dead" in str(exc), (when, exc)
    b.settle()
    assert h.result(TIMEOUT).generator_id == "b"


def test_submit_checks_every_field_it_reads(rg):
    """Whoever built the request (this file's Request, the other file's, any object with the fields),
    and whatever was changed after construction: a bad field raises in submit, nothing is dispatched."""
    g = ManualGen(rg, "g")
    router = rg.GeneratorRouter([g])
    other = fast_rg if rg is ref_rg else ref_rg

    def bad_sampling(**change):
        sp = rg.SamplingParams(max_new_tokens=4)
        for k, v in change.items():
            object.__setattr__(sp, k, v)  # a frozen dataclass changed anyway
        return sp
    cases = [(dict(sampling=bad_sampling(max_new_tokens=0)), ValueError, "max_new_tokens"),
             (dict(sampling=bad_sampling(max_new_tokens=-3)), ValueError, "max_new_tokens"),
             (dict(sampling=bad_sampling(max_new_tokens=2.0)), ValueError, "max_new_tokens"),
             (dict(sampling=bad_sampling(temperature=-0.5)), ValueError, "temperature"),
             (dict(sampling=bad_sampling(temperature=float("nan"))), ValueError, "temperature"),
             (dict(sampling=bad_sampling(top_k=-1)), ValueError, "top_k"),
             (dict(sampling=bad_sampling(top_p=1.5)), ValueError, "top_p"),
             (dict(sampling=bad_sampling(stop_token_ids=(3, -1))), ValueError, "stop_token_ids"),
             (dict(sampling=bad_sampling(stop_token_ids="ab")), TypeError, "stop_token_ids"),
             (dict(sampling=bad_sampling(seed=1.5)), TypeError, "seed"),
             (dict(sampling={"max_new_tokens": 3}), TypeError, "sampling"),
             (dict(prompt_token_ids=(1, 2, 3)), TypeError, "prompt_token_ids"),
             (dict(prompt_token_ids=[1.0, 2.0]), TypeError, "prompt_token_ids"),
             (dict(prompt_token_ids=[]), ValueError, "prompt_token_ids"),
             (dict(prompt_token_ids=[1, -2]), ValueError, "prompt_token_ids"),
             (dict(request_id=7), TypeError, "request_id")]
    for build in (rg.Request, other.Request):
        for change, error, field in cases:
            r = build([1, 2, 3], rg.SamplingParams(max_new_tokens=4) if build is rg.Request else
                      other.SamplingParams(max_new_tokens=4))
            for k, v in change.items():
                setattr(r, k, v)
            with pytest.raises(error, match=field):
                router.submit(r)
    class Duck:  # noqa: E306 - any object with the fields
        prompt_token_ids, request_id, session_id = [1, 2], "duck", None
        sampling = bad_sampling(max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        router.submit(Duck())
    assert g.log == [] and router.queued == 0
    Duck.sampling = rg.SamplingParams(max_new_tokens=2)
    f = router.submit(Duck())
    g.settle()
    assert f.result(TIMEOUT).request_id == "duck"


# ----------------------------------------------------------------------------- weight sync and versions

def _start_sync(router, version, mode):
    box = {}

    def target():
        try:
            router.sync_weights({"w": torch.ones(2)}, version, mode=mode)
        except Exception as exc:  # reported to the test through box
            box["error"] = exc
    t = threading.Thread(target=target, name="sync_weights")
    t.start()
    return t, box


def test_version_rules(rg, manual):
    gens = [ManualGen(rg, "g0", version=3), ManualGen(rg, "g1", version=1)]
    router = rg.GeneratorRouter(gens, clock=manual)
    assert router.policy_version == 3
    for bad in (3, 2):
        with pytest.raises(ValueError, match="version must increase"):
            router.sync_weights({}, bad)
    router.sync_weights({}, 4, mode="drain")
    assert router.policy_version == 4 and [g.policy_version for g in gens] == [4, 4]
    # Concurrent calls are serialized: the second waits for the first's loads.
    gate = threading.Event()
    for g in gens:
        g.load_gate = gate
        g.load_started.clear()
    t5, box5 = _start_sync(router, 5, "hot_swap")
    assert gens[0].load_started.wait(TIMEOUT)
    t6, box6 = _start_sync(router, 6, "hot_swap")
    t6.join(0.2)
    assert t6.is_alive() and [v for v, _ in gens[0].loads] == [4, 5]  # 6 has not started
    gate.set()
    t5.join(TIMEOUT)
    t6.join(TIMEOUT)
    assert not box5 and not box6 and [v for v, _ in gens[0].loads] == [4, 5, 6]
    with pytest.raises(ValueError, match="already serves version 6"):
        router.sync_weights({}, 5)
    # A failed load opens that generator; the rest serve the new version.
    gens[1].load_error = RuntimeError("bad shard")
    sd7 = {"w": torch.full((2,), 7.0)}
    with pytest.raises(rg.RouterError, match="bad shard"):
        router.sync_weights(sd7, 7)
    st = router.stats()
    assert router.policy_version == 7 and st["g0"]["policy_version"] == 7 and st["g1"]["state"] == "open"
    f = router.submit(req(rg, 0))
    assert gens[0].pending and not gens[1].pending
    gens[0].settle()
    assert f.result(TIMEOUT).max_policy_version == 7
    # An open generator is skipped by the next sync and re-synced when its back-off ends: with
    # the router's last weights (version 8), before its probe.
    gens[1].load_error = None
    sd8 = {"w": torch.full((2,), 8.0)}
    router.sync_weights(sd8, 8)
    assert gens[1].loads[-1][0] == 7 and gens[1].policy_version == 6  # 7 failed; 8 not tried: it is open
    gens[1].load_started.clear()
    manual.advance(0.5)
    assert gens[1].load_started.wait(TIMEOUT)
    wait_until(lambda: router.stats()["g1"]["state"] == "half_open", what="re-admission")
    assert gens[1].loads[-1][0] == 8 and router.stats()["g1"]["floor"] == 8
    probe = router.submit(req(rg, "probe"), timeout_s=5.0)
    assert len(gens[1].pending) == 1  # the probe goes to the half-open generator (least loaded)
    gens[1].settle()
    assert probe.result(TIMEOUT).generator_id == "g1" and router.stats()["g1"]["state"] == "closed"
    events = [(g, e) for _, g, e, _ in router.health_events()]
    assert [e for g, e in events if g == "g1"] == ["sync_missed", "opened", "readmitting", "resynced",
                                                   "half_open", "closed"]
    # A generator that returns from load_weights without reporting the version is out too.
    class Liar(ManualGen):
        def load_weights(self, state_dict, version):
            pass
    router = rg.GeneratorRouter([ManualGen(rg, "ok"), Liar(rg, "liar")])
    with pytest.raises(rg.RouterError, match="policy_version is 0"):
        router.sync_weights({}, 1)
    assert not router.stats()["liar"]["healthy"]
    # Every load failing leaves the version where it was (the same version may be retried once
    # the generator is back in rotation).
    g = ManualGen(rg, "solo")
    g.load_error = RuntimeError("disk")
    router = rg.GeneratorRouter([g], clock=manual)
    with pytest.raises(rg.RouterError):
        router.sync_weights({}, 1)
    assert router.policy_version == 0 and router.stats()["solo"]["state"] == "open"
    with pytest.raises(rg.RouterError, match="reached 0 of 1.*not in rotation"):
        router.sync_weights({}, 1)  # nothing in rotation to load into
    g.load_error = None
    manual.advance(0.5)  # back in (half-open); no weights were synced, it still holds its floor
    router.sync_weights({}, 1)
    assert router.stats()["solo"]["state"] == "half_open" and router.policy_version == 1


def test_hot_swap_keeps_serving_during_a_slow_load(rg):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(2)]
    router = rg.GeneratorRouter(gens, policy="round_robin")
    before = [router.submit(req(rg, i)) for i in range(2)]  # admitted at version 0, in flight across the swap
    gate = threading.Event()
    for g in gens:
        g.load_gate = gate
    t, box = _start_sync(router, 1, "hot_swap")
    for g in gens:
        assert g.load_started.wait(TIMEOUT)
    during = [router.submit(req(rg, i)) for i in range(2, 6)]  # served while both are loading
    for g in gens:
        while len(g.pending) > 1:
            g.settle(-1)
    for f in during:
        c = f.result(TIMEOUT)
        assert (c.min_policy_version, c.max_policy_version) == (0, 0)
    assert all(v_inflight == 1 for g in gens for _, v_inflight in g.loads)  # loads began with requests in flight
    gate.set()
    t.join(TIMEOUT)
    assert not box and [g.policy_version for g in gens] == [1, 1]
    for g in gens:
        g.settle()
    for f in before:
        c = f.result(TIMEOUT)
        assert (c.min_policy_version, c.max_policy_version) == (0, 1)  # spans the swap and says so
    after = router.submit(req(rg, 9))
    gens[0].settle() if gens[0].pending else gens[1].settle()
    assert after.result(TIMEOUT).min_policy_version == 1


def test_drain_stops_dispatch_finishes_inflight_then_loads(rg):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(2)]
    router = rg.GeneratorRouter(gens, policy="sticky")
    inflight = [router.submit(req(rg, i, session=f"s{i}")) for i in range(2)]
    gate = threading.Event()
    for g in gens:
        g.load_gate = gate
    t, box = _start_sync(router, 1, "drain")
    wait_until(lambda: all(s["draining"] for s in router.stats().values()), what="drain to start")
    queued = [router.submit(req(rg, i, session=f"s{i % 2}")) for i in range(2, 6)]
    assert len(log) == 2 and router.queued == 4  # nothing new reaches a draining generator
    assert not any(g.load_started.is_set() for g in gens)  # each waits for its in-flight request
    gens[0].settle()
    assert gens[0].load_started.wait(TIMEOUT) and gens[0].loads == [(1, 0)]
    assert not gens[1].load_started.is_set()
    gens[1].settle()
    assert gens[1].load_started.wait(TIMEOUT) and gens[1].loads == [(1, 0)]
    gate.set()
    t.join(TIMEOUT)
    assert not box and [g.policy_version for g in gens] == [1, 1]
    wait_until(lambda: len(log) == 6, what="queued requests to dispatch")
    for g in gens:
        while g.pending:
            g.settle()
    for f in inflight:
        c = f.result(TIMEOUT)
        assert (c.min_policy_version, c.max_policy_version) == (0, 0)
    for f in queued:
        c = f.result(TIMEOUT)
        assert (c.min_policy_version, c.max_policy_version) == (1, 1)


def test_drain_never_mixes_versions_under_load(rg, clock):
    rnd = random.Random(0)
    lat = {f"g{i}": [rnd.uniform(0.001, 0.006) for _ in range(400)] for i in range(3)}
    gens = [TimedGen(rg, f"g{i}", clock, lanes=2, load_time=0.005,
                     latency=lambda r, name=f"g{i}": lat[name][hash(r.request_id) % 400]) for i in range(3)]
    router = rg.GeneratorRouter(gens, policy="least_loaded", max_inflight=3)
    stop = threading.Event()
    futures, lock = [], threading.Lock()

    def producer(k):
        i = 0
        while not stop.is_set() or i < 40:
            f = router.submit(rg.Request([k, i], request_id=f"p{k}-{i}"))
            with lock:
                futures.append((router.policy_version, f))
            i += 1
            if i % 8 == 0:
                f.result(TIMEOUT)  # pace the producer with the engines, not with a sleep
    threads = [threading.Thread(target=producer, args=(k,)) for k in range(2)]
    [t.start() for t in threads]
    for v in (1, 2, 3):
        router.sync_weights({"w": torch.full((2,), float(v))}, v, mode="drain")
        assert all(g.policy_version == v for g in gens)  # every generator serves it on return
    stop.set()
    [t.join(TIMEOUT) for t in threads]
    assert all(outstanding == 0 for g in gens for _, outstanding in g.loads)  # loaded only when idle
    versions = Counter()
    for v_at_submit, f in futures:
        c = f.result(TIMEOUT)
        assert c.min_policy_version == c.max_policy_version, "drain mixed two versions in one completion"
        assert c.min_policy_version >= v_at_submit  # submitted after sync(v) returned => served with >= v
        versions[c.min_policy_version] += 1
    assert len(futures) >= 80 and len(versions) >= 2


# ----------------------------------------------------------------------------- threads

def test_many_threads_submit_at_once(rg, clock):
    gens = [InstantGen(rg, "i0"), InstantGen(rg, "i1"),
            TimedGen(rg, "t0", clock, lanes=8, latency=lambda r: 0.0005),
            TimedGen(rg, "t1", clock, lanes=8, latency=lambda r: 0.001)]
    for policy in ("least_loaded", "power_of_two"):
        for g in gens:
            g.completed_ids.clear()
        router = rg.GeneratorRouter(gens, policy=policy, max_inflight=6, seed=0)
        n_threads, per = 8, 150
        barrier = threading.Barrier(n_threads)
        out = [None] * n_threads

        def worker(k):
            barrier.wait()
            futs = [router.submit(rg.Request([1], request_id=f"{policy}-{k}-{i}", session_id=i % 5))
                    for i in range(per)]
            out[k] = [f.result(TIMEOUT).request_id for f in futs]
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
        [t.start() for t in threads]
        [t.join(TIMEOUT * 2) for t in threads]
        got = [rid for chunk in out for rid in chunk]
        assert len(got) == len(set(got)) == n_threads * per
        served = Counter(rid for g in gens for rid in g.completed_ids)
        assert set(served) == set(got) and set(served.values()) == {1}
        stats = router.stats()
        assert sum(s["dispatched"] for s in stats.values()) == n_threads * per
        assert sum(s["inflight"] for s in stats.values()) == 0 and router.queued == 0


# ----------------------------------------------------------------------------- ref == fast

class _DeferredThreads:
    """Stands in for the ``threading`` module inside a router under ``_script``: the threads the
    router starts for re-admissions, and for the loads of generators that join a sync under way,
    start only when the script runs them (``run``, between two events), one at a time, in the order
    the router started them.  Started at once, two of them (or one and the thread that started it)
    would race to dispatch what waits for them, and the dispatch log's order would be the
    scheduler's, not the router's.  The loads ``sync_weights`` itself starts run at once."""

    def __init__(self):
        self.deferred = deque()

    def __getattr__(self, name):  # Lock, Condition, local, ...: the real ones
        return getattr(threading, name)

    def Thread(self, **kwargs):  # noqa: N802 - threading.Thread's name
        thread = threading.Thread(**kwargs)
        name = kwargs.get("name", "")
        if not (name.startswith("readmit-") or (name.startswith("load-")
                                                and threading.current_thread().name != "sync_weights")):
            return thread
        deferred = self.deferred

        class Deferred:
            def start(self):
                deferred.append(thread)
        return Deferred()

    def run(self, settled) -> bool:
        """Run the deferred threads in order: a re-admission to its end, a load until ``settled(thread)``
        (at its gate, or waiting for a drain); whether any ran.  They may defer more."""
        ran = bool(self.deferred)
        while self.deferred:
            thread = self.deferred.popleft()
            thread.start()
            if thread.name.startswith("readmit-"):
                thread.join(TIMEOUT)
                assert not thread.is_alive(), f"{thread.name} hangs"
            else:
                wait_until(lambda: settled(thread), what=thread.name)
        return ran


def _script(rg, policy, cap, seed, steps=300):
    """Drive a router through a seeded sequence of events on a manual clock; return everything observable."""
    real, threads = rg.threading, _DeferredThreads()
    rg.threading = threads
    try:
        return _script_run(rg, policy, cap, seed, steps, threads)
    finally:
        rg.threading = real


def _script_run(rg, policy, cap, seed, steps, threads):
    log = []
    gens = [ManualGen(rg, f"g{i}", log) for i in range(5)]
    clock = ManualClock()
    router = rg.GeneratorRouter(gens, policy=policy, max_inflight=cap, max_retries=2, max_sessions=4, seed=seed,
                                request_timeout_s=4.0, sync_timeout_s=1e6, failure_threshold=2, backoff_s=(0.5, 2.0),
                                clock=clock)
    rnd = random.Random(seed)
    futures = []
    version = 0
    sync = None  # (thread, box, mode, targets) while a sync is under way
    before = set(threading.enumerate())

    def quiet():
        """Let the router's threads finish what the last event started before the next one: the
        threads it deferred (re-admissions, loads of generators that joined a sync), and the loads of
        a drain's targets, until they reach the sync's gate (or wait for their requests)."""
        def settled(t):  # ended, held at its gate, or a drain's load waiting for g's requests first
            g = next(g for g in gens if t.name == f"load-{g.name}")
            if not t.is_alive():
                return True
            if t in g.at_gate:
                return True   # this very thread waits at the gate (not only an earlier load of g)
            # Before its load, a drain's load waits until g holds no request: only the script can settle them.
            return (sync is not None and sync[2] == "drain" and g.load_thread is not t
                    and router.stats()[g.name]["inflight"] > 0)
        moved = True
        while moved:  # finishing one may start another
            moved = threads.run(settled)
            for t in threading.enumerate():
                if t not in before and t.name.startswith("load-") and not settled(t):
                    wait_until(lambda: settled(t), what=t.name)
                    moved = True

    def settle_some(error_rate):
        busy = [g for g in gens if g.pending]
        if busy:
            g = rnd.choice(busy)
            err = RuntimeError(f"{g.name} failed") if rnd.random() < error_rate else None
            g.settle(rnd.randrange(len(g.pending)), error=err)

    def end_sync():
        thread, box, mode, targets = sync
        if mode == "drain":  # loads wait for in-flight requests; nothing is dispatched meanwhile
            while any(g.pending for g in targets):
                for g in targets:
                    while g.pending:
                        g.settle()
                quiet()
        released = []

        def next_load():  # the targets in order, then generators re-admitted meanwhile (they joined)
            return next((g for g in targets if g not in released), None) or next(
                (g for g in gens if g not in released and g.gated_started.is_set()), None)
        while (g := next_load()) is not None:  # one load at a time, each joined with the router's work after it
            # (a target opened during the sync was dropped from it: it does not load)
            wait_until(lambda: g.gated_started.is_set() or not router.stats()[g.name]["draining"], what="load")
            if g.gated_started.is_set():
                g.load_gate.set()
                g.gated_thread.join(TIMEOUT)
            released.append(g)
            quiet()
        thread.join(TIMEOUT)
        assert not thread.is_alive(), ("sync hangs", router.stats())
        for g in gens:
            g.load_gate = g.load_error = g.gate_only = None
            g.gated_started.clear()
        return box

    sync_errors = []
    for step in range(steps):
        op = rnd.choices(["submit", "settle", "settle_bad", "submit_raises", "instant", "heal", "sync", "time",
                          "restart", "running"], weights=[10, 8, 1.5, 0.5, 1, 0.5, 0.6, 1.5, 0.3, 0.3])[0]
        if op == "submit":
            session = rnd.choice([None, "a", "b", "c", "d", "e", "f"])
            timeout = rnd.choice([None, None, None, 1.0])
            prompt = rnd.choice(([1] * 20, [2] * 33, [1] * 16 + [3] * 4, [4])) + [step]   # shared prefixes
            futures.append(router.submit(rg.Request(prompt, request_id=f"s{step}", session_id=session),
                                         timeout_s=timeout))
        elif op == "settle":
            settle_some(0.0)
        elif op == "settle_bad":
            settle_some(1.0)
        elif op == "submit_raises":
            rnd.choice(gens).submit_error_once = RuntimeError("refused")
        elif op == "instant":  # its next request completes inside submit (nested router work)
            rnd.choice(gens).instant_once = True
        elif op == "heal" and sync is None:  # (a re-admission may load; loads are gated during syncs)
            router.mark_healthy(rnd.choice(gens).name)
        elif op == "time":  # deadlines pass, back-offs end, re-admissions and probes happen
            clock.advance(rnd.choice([0.3, 0.6, 1.1, 2.5]), between=quiet)
        elif op == "restart":  # a new process: what it held fails; it is back at version 0
            rnd.choice(gens).restart()
        elif op == "running":  # its futures run at once: the router cannot cancel them, late results come
            g = rnd.choice(gens)
            g.running = not g.running
        elif op == "sync":
            if sync is None:
                mode = rnd.choice(["drain", "hot_swap"])
                version += 1
                states = router.stats()
                targets = [g for g in gens if states[g.name]["state"] in ("closed", "half_open")]
                for g in gens:
                    g.load_gate, g.gate_only = threading.Event(), version
                    g.load_error = RuntimeError("load failed") if rnd.random() < 0.15 else None
                thread, box = _start_sync(router, version, mode)
                sync = (thread, box, mode, targets)
                if not targets:  # nothing in rotation: it ends at once, before the next event
                    thread.join(TIMEOUT)
                elif mode == "drain":  # the sync has taken its targets before the next event
                    wait_until(lambda: all(router.stats()[g.name]["draining"] for g in targets), what="drain")
                else:
                    wait_until(lambda: all(g.gated_started.is_set() for g in targets), what="hot-swap loads")
            else:
                box = end_sync()
                sync_errors.append(type(box.get("error")).__name__)
                sync = None
        quiet()
    if sync is not None:
        sync_errors.append(type(end_sync().get("error")).__name__)
    for g in gens:
        g.submit_error_once, g.instant_once = None, False
    for _ in range(200):  # settle everything, let every deadline and back-off pass
        for g in gens:
            while g.pending:
                g.settle()
        clock.advance(1.0, between=quiet)
        if all(f.done() for f in futures):
            break
    outcomes = []
    for f in futures:
        assert f.done(), "a request was left hanging"
        exc = f.exception()
        if exc is None:
            c = f.result()
            outcomes.append(("ok", c.request_id, c.generator_id, c.min_policy_version, c.max_policy_version))
        else:
            outcomes.append(("error", type(exc).__name__, [n for n, _ in getattr(exc, "causes", [])]))
    stats = {k: {m: v for m, v in s.items() if m != "last_error"} for k, s in router.stats().items()}
    return dict(log=log, outcomes=outcomes, stats=stats, sync_errors=sync_errors, queued=router.queued,
                events=router.health_events())


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "sticky", "power_of_two", "prefix_affinity"])
@pytest.mark.parametrize("cap", [None, 2])
def test_ref_and_fast_make_the_same_decisions(policy, cap):
    seen = Counter()
    for seed in range(3):
        a = _script(ref_rg, policy, cap, seed)
        b = _script(fast_rg, policy, cap, seed)
        for key in ("log", "outcomes", "stats", "sync_errors", "queued", "events"):
            assert a[key] == b[key], f"ref and fast differ in {key} (policy={policy}, cap={cap}, seed={seed})"
        ids = Counter(rid for _, rid in a["log"])
        events = Counter(e for _, _, e, _ in a["events"])
        seen.update(dispatches=len(a["log"]), retried=sum(n > 1 for n in ids.values()),
                    failed=sum(o[0] == "error" for o in a["outcomes"]),
                    served=sum(o[0] == "ok" for o in a["outcomes"]),
                    spans=sum(o[0] == "ok" and o[3] < o[4] for o in a["outcomes"]),
                    syncs=len(a["sync_errors"]), failed_syncs=a["sync_errors"].count("RouterError"),
                    timeouts=sum(s["timeouts"] for s in a["stats"].values()),
                    late=sum(s["late"] for s in a["stats"].values()), **events)
    # The script must really exercise the router, or equality would prove little.
    assert seen["dispatches"] > 300 and seen["served"] > 250, seen
    assert seen["retried"] > 0 and seen["failed"] > 0 and seen["spans"] > 0, seen
    assert seen["syncs"] >= 3 and seen["failed_syncs"] > 0, seen
    assert seen["timeouts"] > 0 and seen["opened"] > 0 and seen["half_open"] > 0 and seen["closed"] > 0, seen
    assert seen["resynced"] > 0 and seen["late"] > 0 and (seen["fleet_down"] > 0 or cap is not None), seen


def test_memory_stays_bounded(rg):
    """The sticky map keeps at most max_sessions sessions; fast's lazy heaps (choice and deadlines)
    keep O(n) and O(attempts in flight) entries."""
    gens = [InstantGen(rg, f"g{i}") for i in range(4)]
    for policy in ("sticky", "least_loaded", "round_robin"):
        router = rg.GeneratorRouter(gens, policy=policy, max_sessions=16, max_inflight=2)
        for i in range(3000):
            router.submit(rg.Request([1], session_id=i))
        assert len(router._sessions) == (16 if policy == "sticky" else 0)
        if rg is fast_rg:
            assert len(router._heap) <= 2 * len(gens) + 64 + 1
            assert len(router._deadlines) <= 64 + 1 and router._n_live == 0
