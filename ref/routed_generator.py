"""Routed generator: the reference (readable Python, the specification of routing and faults).

Example::

    # routed_generator.py, generator_engine.py and decoder_lm.py, copied next to this script
    from decoder_lm import DecoderLM, ModelConfig
    from generator_engine import Generator
    from routed_generator import GeneratorRouter, Request, SamplingParams

    config = ModelConfig(vocab_size=128, max_seq_len=64)
    router = GeneratorRouter([Generator(DecoderLM(config), name=f"g{i}", kv_cache_memory=2 ** 24) for i in range(2)],
                             policy="least_loaded")
    done = router.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=4, seed=i)) for i in range(4)])
    print([(c.generator_id, c.token_ids) for c in done])
    router.close()

What it computes
    The serving side of RL rollouts: several generators (inference engines) behind one router
    that spreads requests over them, survives their faults, and pushes trainer weights to all
    of them between or during generation.  Every completion says which weights produced it: the
    policy versions in force when the request was admitted and when it finished.  The router
    talks to a generator only through ``GeneratorProtocol`` (four members), so any engine sits
    behind it: generator_engine.py's ``Generator``, a vLLM or SGLang engine wrapped in a few
    lines, or fast/routed_generator.py's Ray actors.  Neither file imports the other.

The rules (n generators; load(g) = attempts dispatched to g that have not ended)
    eligible(g)   in rotation: closed(g) and not draining(g) and load(g) < max_inflight (None: no
                  cap), or half_open(g) with no probe out and not draining(g) (cap 1: its probe)
    round_robin   argmin over eligible g of last_chosen(g): a fixed cycle while every
                  generator is eligible; one that was skipped goes first when it comes back
    least_loaded  argmin over eligible g of (load(g), last_chosen(g)): ties go to the least
                  recently chosen
    power_of_two  draw i != j uniformly from all n; the less loaded (same key) of those two
                  that are eligible; least_loaded when neither is
    sticky        pin[session_id] when it is eligible; least_loaded (keeping the pin) when it is
                  closed but full; least_loaded and re-pin when it is not closed, draining, or
                  the session is new.  The pin map is an LRU of ``max_sessions`` sessions.  A
                  request without a session_id goes least_loaded.
    prefix_affinity  (a cache-aware router, as SGLang's) the router indexes the prompts it routed:
                  the chain of their blocks of ``affinity_block`` tokens (and the partial last
                  one), each block's key hashed with its parent's, mapped to the generators sent
                  it; an LRU of ``max_sessions`` keys.  A request goes to the eligible generator
                  sent the longest run of its prompt's blocks from the start (ties: least loaded),
                  where its prefix's KV most likely is still cached (a group's samples, the
                  requests behind one system prompt), unless that one's load exceeds the least
                  loaded eligible generator's by more than ``affinity_slack``: then least_loaded,
                  so one hot generator is not driven into preemption.  No match: least_loaded.
                  The chosen generator joins the request's blocks.
    queue         a request that finds no eligible generator waits in the router's queue;
                  queued requests leave in arrival order (a retried request keeps its place)
    retry         a retried request avoids the generators that failed it while another one is
                  closed or half-open (the policy then chooses among the rest)
    versions      min_policy_version = version in force at admission, max_policy_version =
                  version at finish; drain => min == max; staleness = max - min

The fault policy (t = the router's clock; every rule is tested against fast's implementation)
    attempt       one dispatch of a request.  It ends when the generator's future settles, or
                  at its deadline t_dispatch + timeout_s (``submit``'s, else request_timeout_s).
    bad request   ValueError / TypeError from the generator's ``submit`` or as its future's
                  exception (the engine, or an actor's engine, refused this request): the request
                  fails alone with that error; the generator is not blamed, nothing is retried.
    failure       ``submit`` raising anything else, a future that fails otherwise or is cancelled,
                  a deadline passed, or lost weights (floor, below).  The request goes back to its
                  place in the queue, at most ``max_retries`` times, then fails with
                  ``RouterError`` listing every cause.  A result that comes after its attempt
                  ended is dropped (counted as ``late``): nothing is served twice.
    breaker       closed --failure_threshold consecutive failures (a success resets the count)-->
                  open for back-off b_k = min(first * 2^k, cap), ``backoff_s = (first, cap)``,
                  k = times opened since it last closed --b_k elapsed--> re-admission -->
                  half_open: one probe request --success--> closed (k = 0); --failure--> open
                  (k + 1).  Lost weights, or a failed or late weight load, open it at once.  Only
                  the probe decides a half-open generator; outcomes of older attempts only count.
    floor         the version a generator holds at least: its version at construction, then the
                  version of its last successful load.  Dispatching to a generator whose
                  policy_version is below its floor, or a completion whose min_policy_version is
                  below the floor in force at dispatch, is lost weights (a restarted process): a
                  stale completion is never served, and no retry goes back to that generator
                  before it is re-admitted.
    re-admission  (after a back-off, or ``mark_healthy``), once the generator's older attempts
                  have ended: one whose policy_version is below the router's is loaded with the
                  router's last synced weights first (the load has the sync deadline; failing or
                  missing it: open again); then half_open (``mark_healthy``: closed).  With no
                  weights synced yet, it is re-admitted once it reports its floor again (a process
                  restarted before any sync holds its construction weights).  One that returns
                  while a sync is under way joins that sync as a target: the loads of one
                  generator never overlap, and the last sync wins.
    dead          a generator whose optional ``dead`` attribute is true can never serve again (a
                  process out of restarts).  When the router would open or re-admit it, it is
                  removed instead: state "dead", one health event "removed"; it is never chosen,
                  re-admitted or synced again, and its attempts still in flight end as usual.
                  With every generator dead, queued and new requests fail at once.
    fleet down    no generator closed or half-open: queued requests wait for a re-admission;
                  one that waited timeout_s since it was queued or since the fleet went down
                  (the later) fails with ``RouterError``.
    weight sync   loads into every generator closed or half-open (an open one is re-synced when
                  it is re-admitted; one re-admitted meanwhile joins) before ``timeout_s`` (drain
                  included); one that fails or misses the deadline is dropped from the sync and
                  opened.  The router's version becomes the new one if at least one generator
                  loaded it.  Syncs run one after another: each waits for the one before, which
                  ends by its own deadline or at ``close()``.
    close()       no new requests or syncs; waits at most ``timeout_s`` for what is in flight,
                  fails the rest, ends a sync under way (its pending loads are dropped and
                  ``sync_weights`` raises ``RouterError``), stops the clock; never waits on a
                  generator call.

The clock
    ``clock`` is an object with ``now() -> seconds`` and ``call_at(t, fn)`` (run ``fn()`` in some
    thread at time >= t).  The default is real time with one thread, started by the first
    deadline; tests pass a manual clock and advance it, so every timing rule is deterministic.

Data types (the same in ref and fast, and in generator_engine.py)
    SamplingParams (max_new_tokens, temperature, top_k, top_p, stop_token_ids, seed, n), Request
    (prompt_token_ids list[int], sampling, request_id str, session_id hashable or None; the router
    reads these fields, so either file's Request is routed), Completion (request_id,
    prompt_token_ids, token_ids, logprobs, finish_reason, generator_id, min_policy_version,
    max_policy_version, sample_index), state_dict (Mapping[str, torch.Tensor], passed on untouched;
    the router keeps the last one synced, a reference, to re-sync returning generators).
    A group: ``sampling.n > 1`` asks for n samples of the prompt (GRPO); the generator's answer is
    the list of its n completions, routed, served and retried whole (against the floor: the oldest
    min_policy_version among them; anything but a list of n is a broken answer).

Supported, and what raises
    Generators >= 1 with unique names; every method may be called from many threads at once.
    ValueError for an unknown policy or mode (naming the choices), an empty generator list,
    duplicate names, an argument out of range, a version that does not increase, a request field
    out of range; TypeError for an object that lacks a protocol member, a request field of the
    wrong type (``submit`` checks every field it reads, whoever built the request), a non-int
    version; RuntimeError for ``submit`` or ``sync_weights`` after ``close()``.  Limits (README): a done-callback of
    a router future must not block on another router future or call ``sync_weights``.

References
    vLLM router / SGLang model-gateway policies (round robin, least-loaded, cache-aware
    stickiness, power of two); Mitzenmacher, The Power of Two Choices in Randomized Load
    Balancing (2001); Nygard, Release It! (the circuit breaker, 2007) and Envoy's outlier
    detection (ejection with growing back-off); PipelineRL (Piche et al., 2025) in-flight weight
    updates; AReaL / slime / verl weight sync between trainer and rollout engines.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import operator
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Protocol, runtime_checkable

import torch

__all__ = ["SamplingParams", "Request", "Completion", "GeneratorProtocol", "RouterError", "GeneratorRouter",
           "POLICIES", "SYNC_MODES"]

POLICIES = ("round_robin", "least_loaded", "sticky", "power_of_two", "prefix_affinity")
SYNC_MODES = ("hot_swap", "drain")
CLOSED, OPEN, READMITTING, HALF_OPEN, DEAD = "closed", "open", "readmitting", "half_open", "dead"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_index(t) -> bool:
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


# ----------------------------------------------------------------------------- data types

# (field, rule, what it must be, error): SamplingParams applies them at construction, the router's
# submit to every request it routes (whoever built it, and whatever was changed after).
_SAMPLING_RULES = (
    ("max_new_tokens", lambda v: _is_int(v) and v >= 1, "an int >= 1", ValueError),
    ("temperature", lambda v: _is_real(v) and v >= 0, "a float >= 0 (0 = greedy)", ValueError),
    ("top_k", lambda v: _is_int(v) and v >= 0, "an int >= 0 (0 = off)", ValueError),
    ("top_p", lambda v: _is_real(v) and 0 < v <= 1, "in (0, 1] (1 = off)", ValueError),
    ("stop_token_ids", lambda v: isinstance(v, (tuple, list)) and all(map(_is_index, v)), "a sequence of ints",
     TypeError),
    ("stop_token_ids", lambda v: all(operator.index(t) >= 0 for t in v), "token ids >= 0", ValueError),
    ("seed", lambda v: v is None or _is_int(v), "an int or None", TypeError),
    ("n", lambda v: _is_int(v) and v >= 1, "an int >= 1", ValueError),
)


def _check_sampling(sp, what: str = "") -> None:
    for field, rule, expected, error in _SAMPLING_RULES:
        if not hasattr(sp, field):
            raise TypeError(f"{what.rstrip('.') or 'sampling'} must be a SamplingParams, got {type(sp).__name__} "
                            f"(no {field})")
        value = getattr(sp, field)
        if not rule(value):
            label = "n (samples of the prompt)" if field == "n" else field
            raise error(f"{what}{label} must be {expected}, got {value!r}")
    if sp.seed is not None and not -2 ** 63 <= sp.seed <= 2 ** 64 - sp.n:   # sample i draws from seed + i
        raise ValueError(f"{what}seed must be in [-2**63, 2**64 - n] (sample i is seeded with seed + i), "
                         f"got {sp.seed}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.  Frozen: one instance may be shared by many requests."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1

    def __post_init__(self):
        stops = self.stop_token_ids
        if isinstance(stops, Iterable) and not isinstance(stops, (str, bytes)):
            object.__setattr__(self, "stop_token_ids", tuple(stops))
        _check_sampling(self)  # the rules the router's submit also applies to every request
        object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in self.stop_token_ids))


_request_ids = itertools.count()  # next() on a count is atomic under the GIL: ids stay unique across threads


@dataclasses.dataclass
class Request:
    """One prompt to complete.  A missing ``request_id`` is filled with a unique one."""

    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    request_id: str | None = None
    session_id: Hashable | None = None

    def __post_init__(self):
        prompt = self.prompt_token_ids
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
                raise TypeError(f"prompt_token_ids must be a 1-D integer tensor, got {prompt.dtype} "
                                f"of shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise TypeError(f"prompt_token_ids must be a sequence of ints, got {type(prompt).__name__}")
        try:
            prompt = [operator.index(t) for t in prompt]
        except TypeError:
            raise TypeError("prompt_token_ids must hold ints (token ids)") from None
        if not prompt:
            raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
        if min(prompt) < 0:
            raise ValueError(f"prompt_token_ids must be token ids >= 0, got {min(prompt)}")
        self.prompt_token_ids = prompt
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.request_id is None:
            self.request_id = f"req-{next(_request_ids)}"
        elif not isinstance(self.request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(self.request_id).__name__}")
        try:
            hash(self.session_id)
        except TypeError:
            raise TypeError(f"session_id must be hashable, got {type(self.session_id).__name__}") from None


@dataclasses.dataclass
class Completion:
    """What a generator returns for one request, stamped with the weights that produced it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    generator_id: str
    min_policy_version: int
    max_policy_version: int
    sample_index: int = 0


@runtime_checkable
class GeneratorProtocol(Protocol):
    """What the router needs from a generator (an inference engine), and nothing more.

    ``name: str`` unique among one router's generators.  ``policy_version: int`` the version
    it serves; changes inside ``load_weights``; drops only when the engine restarts (a new
    process reports what it holds, and is re-synced before re-admission); reading it never blocks.
    ``submit(request) -> concurrent.futures.Future[Completion]`` returns at once, from any thread
    (also inside a done-callback of its own futures: so an engine never settles a future while
    holding a lock ``submit`` takes).  ValueError / TypeError, raised by ``submit`` or as the
    future's exception = bad input; any other exception, a failed or cancelled future, or none by
    the deadline = a broken generator.  The completion carries ``generator_id = name`` and the
    versions at admission and at finish.
    ``load_weights(state_dict, version)`` blocks; the engine may keep serving and switch between
    decoding steps (a request across the switch has min < max); afterwards ``policy_version ==
    version`` and later requests use the new weights; raises on failure.
    Optional: ``dead: bool``, true once the generator can never serve again (e.g. a process out of
    restarts); reading it never blocks.  Without it a generator is never dead.
    A vLLM ``LLMEngine`` wrapper is a few lines: ``submit`` adds the request and returns a Future
    its step loop settles; ``load_weights`` calls the weight-update hook, then sets the version.
    """

    name: str
    policy_version: int

    def submit(self, request: Request) -> Future:
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        ...


class RouterError(RuntimeError):
    """A request no generator could serve, or a weight sync that failed on some generators.

    ``causes`` lists ``(generator name, exception)`` for every failure behind it."""

    def __init__(self, message: str, causes=()):
        self.causes = list(causes)
        if self.causes:
            message += ": " + "; ".join(f"{name}: {exc!r}" for name, exc in self.causes)
        super().__init__(message)


# ----------------------------------------------------------------------------- book-keeping

class _Member:
    """The router's record of one generator."""

    def __init__(self, index: int, gen, last_chosen: int):
        self.index, self.gen, self.name = index, gen, gen.name
        self.inflight = 0             # the load: attempts dispatched and not ended
        self.dispatched = self.completed = self.failures = self.timeouts = self.late = self.stale = 0
        self.state, self.draining = CLOSED, False
        self.consecutive = 0          # failures since the last success
        self.opened = 0               # k: times opened since it last closed
        self.reopen_at = math.inf     # when an open generator's back-off ends
        self.probe_out = False        # a half-open generator's probe is in flight
        self.close_on_return = False  # mark_healthy: re-admit closed, not half-open
        self.loading = False          # a load_weights call of the router's is running
        self.readmit_deadline = math.inf  # a re-admission's load must end by then
        self.floor = gen.policy_version
        self.last_error: BaseException | None = None
        self.last_chosen = last_chosen  # the router's tick when it was last chosen


class _Ticket:
    """One request on its way through the router (it keeps its arrival number across retries)."""

    def __init__(self, seq: int, request: Request, future: Future, timeout_s: float, now: float):
        self.seq, self.request, self.future, self.timeout_s = seq, request, future, timeout_s
        self.queued_at = now
        self.causes: list[tuple[str, BaseException]] = []
        self.started = False  # the user can no longer cancel it


class _Attempt:
    """One dispatch of a ticket to a generator."""

    def __init__(self, ticket: _Ticket, member: _Member, deadline: float, probe: bool):
        self.ticket, self.member, self.deadline, self.probe = ticket, member, deadline, probe
        self.floor = member.floor   # a completion below it is stale
        self.live = True          # False once it ended (settled, expired)
        self.future = None        # the generator's future, once submit returned


class _Sync:
    """One ``sync_weights`` call: the loads it waits for and what became of them."""

    def __init__(self, state_dict, version: int, mode: str, deadline: float, members: list):
        self.state_dict, self.version, self.mode, self.deadline = state_dict, version, mode, deadline
        self.targets = list(members)  # grows when a re-admitted generator joins
        # Each pending load's thread holds a turn of its own: a generator dropped from the sync and
        # joining it again gets a new turn, so the thread of its old turn ends without loading.
        self.pending = {s: object() for s in members}
        self.loaded, self.errors = [], {}
        self.skipped: list[tuple[str, BaseException]] = []  # the others, as the sync ended


class _RealClock:
    """Real time: ``now()`` is time.monotonic(); ``call_at(t, fn)`` runs fn in the clock's thread."""

    def __init__(self):
        self._cv = threading.Condition()
        self._due: list = []               # min-heap of (t, seq, fn)
        self._seq = itertools.count()
        self._thread = None
        self._stopped = False

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, t: float, fn) -> None:
        with self._cv:
            if self._stopped:
                return
            heapq.heappush(self._due, (t, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="router-clock", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cv.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._stopped:
                    return
                fn = heapq.heappop(self._due)[2]
            fn()  # outside the clock's lock: it takes the router's

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()


# ----------------------------------------------------------------------------- the router

class GeneratorRouter:
    """Routes requests over generators, handles their faults, syncs their weights (module docstring).

    All book-keeping happens under one lock; generator calls and user-future callbacks run
    outside it.  Work found under the lock (dispatch a request, settle a user future, re-admit
    a generator) goes to a per-thread work list, so a generator that settles futures
    synchronously inside ``submit`` does not make the dispatch recurse.
    """

    def __init__(self, generators, *, policy: str = "least_loaded", max_inflight: int | None = None,
                 max_retries: int = 2, max_sessions: int = 65536, seed: int | None = None,
                 request_timeout_s: float = 300.0, sync_timeout_s: float = 300.0, failure_threshold: int = 3,
                 backoff_s: tuple[float, float] = (0.5, 5.0), clock=None, affinity_block: int = 16,
                 affinity_slack: int = 4):
        generators = _checked_arguments(generators, policy, max_inflight, max_retries, max_sessions,
                                        request_timeout_s, sync_timeout_s, failure_threshold, backoff_s, clock)
        for name, value, low in (("affinity_block", affinity_block, 1), ("affinity_slack", affinity_slack, 0)):
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.affinity_block, self.affinity_slack = affinity_block, affinity_slack
        n = len(generators)
        self.policy, self.max_inflight, self.max_retries = policy, max_inflight, max_retries
        self.max_sessions = max_sessions
        self.request_timeout_s, self.sync_timeout_s = float(request_timeout_s), float(sync_timeout_s)
        self.failure_threshold, self.backoff_s = failure_threshold, (float(backoff_s[0]), float(backoff_s[1]))
        self._own_clock = clock is None
        self._clock = _RealClock() if clock is None else clock
        # Initial ticks -n..-1: never-chosen generators count as chosen long ago, in list order.
        self._members = [_Member(i, g, i - n) for i, g in enumerate(generators)]
        self._by_name = {s.name: s for s in self._members}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a load ended, a drain emptied, a sync finished
        self._sync_lock = threading.Lock()                # serializes sync_weights
        self._queue: list[tuple[int, _Ticket]] = []      # min-heap on arrival number
        self._attempts: set[_Attempt] = set()             # live attempts
        self._arrivals = itertools.count()
        self._tick = 0
        self._sessions: OrderedDict[Hashable, _Member] = OrderedDict()  # LRU: oldest first
        self._prefixes: OrderedDict[int, set] = OrderedDict()         # block key -> generator names, LRU
        self._rng = random.Random(seed)
        self._version = max(g.policy_version for g in generators)
        self._weights = None                              # the last state dict synced (for re-syncs)
        self._sync: _Sync | None = None
        self._down_since = None                           # when the fleet went down (none in rotation)
        self._wake_at = math.inf                          # the earliest clock call pending
        self._events: deque = deque(maxlen=1000)
        self._avoid = frozenset()                         # generators a retry is steered away from
        self._closed = False
        self._local = threading.local()

    # ------------------------------------------------------------------ public API

    @property
    def policy_version(self) -> int:
        """The newest version a ``sync_weights`` call has delivered (at start: the generators' max)."""
        with self._lock:
            return self._version

    @property
    def queued(self) -> int:
        """Requests waiting in the router for an eligible generator."""
        with self._lock:
            return len(self._queue)

    def submit(self, request: Request, *, timeout_s: float | None = None) -> Future:
        """Route one request; the future resolves to its ``Completion`` (or a ``RouterError``).
        ``timeout_s`` is this request's deadline per attempt (default: ``request_timeout_s``)."""
        _check_request(request)
        timeout_s = self.request_timeout_s if timeout_s is None else _check_timeout("timeout_s", timeout_s)
        future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the router is closed")
            ticket = _Ticket(next(self._arrivals), request, future, timeout_s, self._clock.now())
            heapq.heappush(self._queue, (ticket.seq, ticket))
            work = self._pump()
        self._run(work)
        return future

    def generate(self, requests, *, timeout_s: float | None = None) -> list[Completion]:
        """Submit every request, wait, return the completions in request order.

        Raises the first failure in request order (the other requests still complete)."""
        requests = list(requests)
        for i, r in enumerate(requests):
            _check_request(r, f"requests[{i}]")
        futures = [self.submit(r, timeout_s=timeout_s) for r in requests]
        return [f.result() for f in futures]

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, mode: str = "hot_swap",
                     timeout_s: float | None = None) -> None:
        """Load ``state_dict`` as ``version`` into every generator in rotation, all in parallel.

        ``hot_swap``: generators keep serving while they load (a completion may span two
        versions and says so).  ``drain``: each generator stops receiving requests, its
        in-flight requests finish, it loads, it returns to rotation (no completion spans two
        versions).  ``timeout_s`` (default ``sync_timeout_s``) bounds the whole call.  Calls
        run one after another; ``version`` must be larger than every version synced before.
        A generator whose load fails, that does not report ``version`` afterwards, or that
        misses the deadline is opened (re-synced when it returns) and this raises
        ``RouterError`` once the others are done; generators left in rotation serve ``version``.
        """
        if mode not in SYNC_MODES:
            raise ValueError(f"mode must be one of {', '.join(SYNC_MODES)}; got {mode!r}")
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
        timeout_s = self.sync_timeout_s if timeout_s is None else _check_timeout("timeout_s", timeout_s)
        with self._sync_lock:  # (the call before ends by its deadline, or at close())
            with self._lock:
                if self._closed:
                    raise RuntimeError("the router is closed")
                if version <= self._version:
                    raise ValueError(f"version must increase: got {version}, the router already serves "
                                     f"version {self._version}")
                targets = [s for s in self._members if s.state in (CLOSED, HALF_OPEN) and not s.loading]
                sync = self._sync = _Sync(state_dict, version, mode, self._clock.now() + timeout_s, targets)
                for s in targets:  # drain: all at once, so no request slips in between two of them
                    s.draining = mode == "drain"
                    s.loading = mode == "hot_swap"  # a drain loads once the generator is idle
                self._schedule(sync.deadline)
                turns = list(sync.pending.items())  # (the first load may end the sync before the last starts)
                if not targets:
                    self._sync_finished(sync)
            for s, turn in turns:
                threading.Thread(target=self._sync_one, args=(s, sync, turn), name=f"load-{s.name}",
                                 daemon=True).start()
            with self._lock:  # (a load's thread hands queued requests to its generator after this wakes)
                self._changed.wait_for(lambda: self._sync is not sync)  # its deadline, or close(), ends it
        causes = [(s.name, sync.errors[s.name]) for s in sync.targets if s.name in sync.errors]
        if not sync.loaded or causes:
            raise RouterError(f"weight sync to version {version} reached {len(sync.loaded)} of "
                              f"{len(self._members)} generators", causes + sync.skipped)

    def mark_healthy(self, name: str) -> None:
        """Re-admit a generator now (after an operator fixed it): re-synced first if stale, then closed."""
        member = self._member(name)
        with self._lock:
            if member.state == DEAD:
                raise ValueError(f"{name} is dead (removed from the fleet): it cannot be re-admitted")
            if member.state == OPEN:
                member.reopen_at, member.close_on_return = -math.inf, True
                work = self._readmit_due(self._clock.now())
            else:
                member.close_on_return = member.state != CLOSED
                if member.state == HALF_OPEN:
                    self._close_breaker(member)
                work = []
            work += self._pump()
        self._run(work)

    def stats(self) -> dict[str, dict]:
        """Per generator: dispatched, inflight, completed, failures, timeouts, late (results after
        their deadline, dropped), stale (completions below the floor, refused), state (closed, open,
        readmitting, half_open, dead), healthy (state == "closed"), draining, floor, policy_version,
        last_error (repr or None)."""
        with self._lock:
            out = {s.name: dict(dispatched=s.dispatched, inflight=s.inflight, completed=s.completed,
                                failures=s.failures, timeouts=s.timeouts, late=s.late, stale=s.stale, state=s.state,
                                healthy=s.state == CLOSED, draining=s.draining, floor=s.floor,
                                last_error=None if s.last_error is None else repr(s.last_error))
                   for s in self._members}
        for s in self._members:  # read outside the lock: it belongs to the engine
            out[s.name]["policy_version"] = s.gen.policy_version
        return out

    def health_events(self) -> list[tuple]:
        """The fleet's health events since the last call, as ``(t, generator, event, detail)``;
        events: opened, readmitting, resynced, half_open, closed, sync_missed, removed (dead), and with
        generator None synced and fleet_down; the last 1000 are kept."""
        with self._lock:
            events, self._events = list(self._events), deque(maxlen=1000)
        return events

    def close(self, *, timeout_s: float = 0.0) -> None:
        """Stop taking requests and syncs; wait at most ``timeout_s`` (real time) for those queued or
        in flight, then fail the rest with ``RouterError``, end a sync under way (its pending loads
        dropped); stop the clock.  Generators stay open."""
        deadline = time.monotonic() + _check_timeout("timeout_s", timeout_s, zero=True)
        with self._lock:
            self._closed = True
            while (self._queue or self._attempts) and time.monotonic() < deadline:
                self._changed.wait(min(0.05, deadline - time.monotonic()))
            closed = RouterError("the router was closed before the request finished")
            work = [("fail", t.future, closed) for _, t in sorted(self._queue) if self._start(t)]
            attempts = sorted(self._attempts, key=lambda a: (a.deadline, a.ticket.seq))
            work += [("fail", a.ticket.future, closed) for a in attempts]
            for a in attempts:
                a.live = False
                a.member.inflight -= 1
            self._queue, self._attempts = [], set()
            sync = self._sync  # the clock stops, so its deadline never comes: it ends here
            if sync is not None:
                for s in sorted(sync.pending, key=lambda s: s.index):
                    s.draining = False
                    sync.errors[s.name] = RouterError(f"{s.name}: the router was closed before it loaded")
                sync.pending.clear()
                self._sync_finished(sync)  # (wakes sync_weights and its drain threads)
        if self._own_clock:
            self._clock.stop()
        self._run(work)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ choosing (under the lock)

    def _eligible(self, s: _Member) -> bool:
        if s.draining or s.name in self._avoid:
            return False
        if s.state == HALF_OPEN:
            return not s.probe_out
        return s.state == CLOSED and (self.max_inflight is None or s.inflight < self.max_inflight)

    def _least_loaded(self) -> _Member | None:
        return min((s for s in self._members if self._eligible(s)),
                   key=lambda s: (s.inflight, s.last_chosen), default=None)

    def _choose(self, ticket: _Ticket) -> _Member | None:
        """The generator for this request now, or None when none is eligible (it waits)."""
        failed = {name for name, _ in ticket.causes}
        if failed and any(s.state in (CLOSED, HALF_OPEN) and s.name not in failed for s in self._members):
            self._avoid = failed  # a retry goes elsewhere while it can
        try:
            return self._apply_policy(ticket.request)
        finally:
            self._avoid = frozenset()

    def _apply_policy(self, request: Request) -> _Member | None:
        if self.policy == "round_robin":
            return min((s for s in self._members if self._eligible(s)), key=lambda s: s.last_chosen, default=None)
        if self.policy == "least_loaded":
            return self._least_loaded()
        if self.policy == "power_of_two":
            n = len(self._members)
            if n == 1:
                pair = self._members
            else:
                i = self._rng.randrange(n)
                j = self._rng.randrange(n - 1)
                j += j >= i  # j uniform over the others
                pair = [self._members[i], self._members[j]]
            pair = [s for s in pair if self._eligible(s)]
            if not pair:
                return self._least_loaded()
            return min(pair, key=lambda s: (s.inflight, s.last_chosen))
        if self.policy == "prefix_affinity":
            return self._prefix_affinity(request)
        # sticky
        sid = request.session_id
        if sid is None:
            return self._least_loaded()
        pinned = self._sessions.get(sid)
        if pinned is not None and pinned.state == CLOSED and not pinned.draining and pinned.name not in self._avoid:
            self._sessions.move_to_end(sid)
            return pinned if self._eligible(pinned) else self._least_loaded()  # full: elsewhere this once
        chosen = self._least_loaded()
        if chosen is not None:  # new session, or its generator is out or draining: re-pin
            self._sessions[sid] = chosen
            self._sessions.move_to_end(sid)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return chosen

    def _prefix_affinity(self, request: Request) -> _Member | None:
        least = self._least_loaded()
        if least is None:
            return None
        keys = _block_keys(request.prompt_token_ids, self.affinity_block)
        matched: dict[str, int] = {}                  # generator -> blocks matched from the start
        for depth, key in enumerate(keys):
            grown = [name for name in self._prefixes.get(key, ()) if matched.get(name, 0) == depth]
            if not grown:
                break
            for name in grown:
                matched[name] = depth + 1
        chosen = least
        holders = [s for s in self._members if matched.get(s.name) and self._eligible(s)]
        if holders:
            best = min(holders, key=lambda s: (-matched[s.name], s.inflight, s.last_chosen))
            if best.inflight - least.inflight <= self.affinity_slack:
                chosen = best
        for key in keys:                              # it joins the request's blocks
            self._prefixes.setdefault(key, set()).add(chosen.name)
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.max_sessions:
            self._prefixes.popitem(last=False)
        return chosen

    def _pump(self) -> list:
        """Dispatch queued requests in arrival order while a generator is eligible.  Returns the
        work to do outside the lock."""
        now = self._fleet_status()
        if all(s.state == DEAD for s in self._members):
            return self._fail_queue_all_dead()
        work = []
        while self._queue:
            ticket = self._queue[0][1]
            if not self._start(ticket):  # the user cancelled it
                heapq.heappop(self._queue)
                continue
            member = self._choose(ticket)
            if member is None:
                break
            heapq.heappop(self._queue)
            probe = member.state == HALF_OPEN
            member.probe_out |= probe
            member.inflight += 1  # reserve before dispatch
            member.dispatched += 1
            self._tick += 1
            member.last_chosen = self._tick
            attempt = _Attempt(ticket, member, now + ticket.timeout_s, probe)
            self._attempts.add(attempt)
            self._schedule(attempt.deadline)
            work.append(("dispatch", attempt))
        return work

    def _fail_queue_all_dead(self) -> list:
        """Every generator is dead: nothing can ever serve what waits, so it fails now."""
        work = [("fail", t.future, RouterError(f"request {t.request.request_id}: every generator is dead", t.causes))
                for _, t in sorted(self._queue) if self._start(t)]
        self._queue = []
        return work

    def _fleet_status(self) -> float:
        """Note when the fleet goes down (no generator closed or half-open): queued requests then
        wait at most their timeout_s for a re-admission.  Returns the clock's time."""
        now = self._clock.now()
        if any(s.state in (CLOSED, HALF_OPEN) for s in self._members):
            self._down_since = None
            return now
        if self._down_since is None:
            self._down_since = now
            self._note(None, "fleet_down", "no generator in rotation: requests wait for a re-admission")
        if self._queue:
            self._schedule(min(max(t.queued_at, self._down_since) + t.timeout_s for _, t in self._queue))
        return now

    @staticmethod
    def _start(ticket: _Ticket) -> bool:
        """The user can no longer cancel it from here on; False when they already did."""
        if not ticket.started:
            ticket.started = True
            return ticket.future.set_running_or_notify_cancel()
        return True

    # ------------------------------------------------------------------ attempts (under the lock)

    def _end_attempt(self, attempt: _Attempt, completion, exc, *, blame: bool = True, lost: bool = False) -> list:
        """An attempt ended: serve the completion, or strike the generator and retry or fail.
        ``blame=False``: the request's own fault (bad input): it fails alone, nobody is struck.
        ``lost``: the generator lost its weights (refused at dispatch): it opens at once."""
        member, ticket = attempt.member, attempt.ticket
        if not attempt.live:  # it already ended (deadline passed): a late result, dropped
            member.late += blame and (exc is None or not isinstance(exc, CancelledError))
            return []
        attempt.live = False
        self._attempts.discard(attempt)
        member.inflight -= 1
        if member.inflight == 0:  # a drain, or a re-admission, may wait for this
            self._changed.notify_all()
        if attempt.probe and member.state == HALF_OPEN:
            member.probe_out = False
        served = _served_version(completion, ticket.request)
        if exc is None and not (_is_int(served) and served >= attempt.floor):
            member.stale += 1
            lost = _is_int(served)  # served below its floor: it lost its weights
            exc = RuntimeError(f"{member.name} served version {served}, below the {attempt.floor} it was admitted "
                               f"with: it lost its weights (restarted?)" if _is_int(served) else
                               f"{member.name} returned a {type(completion).__name__}, not a Completion (a list "
                               f"of n for sampling.n > 1)")
        if exc is None:
            member.completed += 1
            member.consecutive = 0
            if attempt.probe and member.state == HALF_OPEN:
                self._close_breaker(member)
            work = [("done", ticket.future, completion)]
        elif not blame:
            work = [("fail", ticket.future, exc)]
        else:
            self._strike(member, exc, attempt.probe, lost)
            ticket.causes.append((member.name, exc))
            if len(ticket.causes) > self.max_retries:
                work = [("fail", ticket.future, RouterError(
                    f"request {ticket.request.request_id} failed after {len(ticket.causes)} attempts",
                    ticket.causes))]
            else:
                ticket.queued_at = self._clock.now()
                heapq.heappush(self._queue, (ticket.seq, ticket))  # back to its place in line
                work = []
        return work + self._readmit_due(self._clock.now(), [member]) + self._pump()

    def _strike(self, member: _Member, exc: BaseException, probe: bool, lost: bool = False) -> None:
        member.failures += 1
        member.consecutive += 1
        member.last_error = exc
        if lost and member.state in (CLOSED, HALF_OPEN):  # nothing to serve until it is re-synced
            self._open(member, f"it lost its weights: {exc!r}")
        elif (probe and member.state == HALF_OPEN) or (
                member.state == CLOSED and member.consecutive >= self.failure_threshold):
            self._open(member, f"{member.consecutive} consecutive failures; last: {exc!r}")

    def _open(self, member: _Member, why: str) -> None:
        """Out of rotation for b_k = min(first * 2^k, cap); re-admission after that.  A generator
        that a sync is waiting for is dropped from it (it is re-synced when it returns).  A dead
        one is removed instead."""
        if _is_dead(member.gen):
            self._remove(member, why)
            return
        first, cap = self.backoff_s
        backoff = min(first * 2 ** member.opened, cap)
        member.opened += 1
        member.state, member.probe_out, member.draining = OPEN, False, False
        member.reopen_at = self._clock.now() + backoff
        self._schedule(member.reopen_at)
        self._note(member, "opened", f"for {backoff:g} s: {why}")
        if self._sync is not None and member in self._sync.pending:
            self._sync_ended(member, self._sync, RuntimeError(f"{member.name} was opened during the sync: {why}"))

    def _remove(self, member: _Member, why: str) -> None:
        """A dead generator leaves the fleet for good: never chosen, re-admitted or synced again (it
        stays in ``stats()`` as "dead"); its attempts in flight end as usual."""
        member.state, member.probe_out, member.draining, member.reopen_at = DEAD, False, False, math.inf
        self._note(member, "removed", f"dead for good: {why}")
        if self._sync is not None and member in self._sync.pending:
            self._sync_ended(member, self._sync, RuntimeError(f"{member.name} is dead for good: {why}"))

    def _close_breaker(self, member: _Member) -> None:
        member.state, member.probe_out, member.opened, member.consecutive = CLOSED, False, 0, 0
        member.close_on_return = False
        self._note(member, "closed", f"back in rotation at version {member.floor}")

    # ------------------------------------------------------------------ the clock (under the lock)

    def _schedule(self, t: float) -> None:
        """Make sure the clock calls ``_on_clock`` by time t."""
        if t < self._wake_at and t < math.inf and not self._closed:
            self._wake_at = t
            self._clock.call_at(t, self._on_clock)

    def _on_clock(self) -> None:
        """Whatever fell due: deadlines of attempts, of a sync, of waits while the fleet is down;
        back-offs that ended."""
        with self._lock:
            now = self._clock.now()
            self._wake_at = math.inf
            work = []
            for attempt in sorted(self._attempts, key=lambda a: (a.deadline, a.ticket.seq)):
                if attempt.deadline <= now:
                    attempt.member.timeouts += 1
                    work += [("cancel", attempt.future)] + self._end_attempt(attempt, None, TimeoutError(
                        f"{attempt.member.name}: no result within {attempt.ticket.timeout_s:g} s"))
            sync = self._sync
            if sync is not None and sync.deadline <= now:
                for member in sorted(sync.pending, key=lambda s: s.index):
                    self._sync_ended(member, sync, TimeoutError(f"{member.name}: not loaded within the sync deadline"))
            for member in self._members:
                if member.state == READMITTING and member.readmit_deadline <= now:
                    member.failures += 1
                    member.last_error = TimeoutError(f"{member.name}: re-sync missed the sync deadline")
                    self._open(member, "its re-sync missed the sync deadline")
            if self._down_since is not None:
                for seq, t in sorted(self._queue):
                    if max(t.queued_at, self._down_since) + t.timeout_s <= now:
                        self._queue.remove((seq, t))
                        work.append(("fail", t.future, RouterError(
                            f"request {t.request.request_id}: no generator in rotation for {t.timeout_s:g} s",
                            t.causes + [(s.name, s.last_error) for s in self._members if s.last_error is not None])))
                heapq.heapify(self._queue)
            work += self._readmit_due(now)  # (nothing else can have become eligible: no _pump here)
            if all(s.state == DEAD for s in self._members):  # (removed just now: what waits can fail)
                work += self._fail_queue_all_dead()
            self._fleet_status()
            later = [a.deadline for a in self._attempts] + [s.reopen_at for s in self._members
                                                             if s.state == OPEN and s.reopen_at > now]
            later += [s.readmit_deadline for s in self._members if s.state == READMITTING]
            if sync is not None and sync.pending:
                later.append(sync.deadline)
            self._schedule(min(later, default=math.inf))
        self._run(work)

    # ------------------------------------------------------------------ weights and re-admission

    def _sync_one(self, member: _Member, sync: _Sync, turn: object) -> None:
        """One generator's part of a weight sync (its own thread), while ``turn`` is its pending turn."""
        if sync.mode == "drain":
            with self._lock:
                self._changed.wait_for(lambda: member.inflight == 0 or sync.pending.get(member) is not turn)
                if sync.pending.get(member) is not turn:  # dropped (opened, the deadline), maybe joined again
                    return
                member.loading = True
        error = self._load(member, sync.state_dict, sync.version)
        with self._lock:
            member.loading = False
            if sync.pending.get(member) is turn:
                self._sync_ended(member, sync, error)
            work = self._readmit_due(self._clock.now()) + self._pump()
        self._run(work)

    def _sync_ended(self, member: _Member, sync: _Sync, error) -> None:
        sync.pending.pop(member, None)
        member.draining = False
        if error is None:
            member.floor = sync.version
            sync.loaded.append(member)
        else:
            sync.errors[member.name] = error
            self._note(member, "sync_missed", f"version {sync.version}: {error!r}")
            if member.state in (CLOSED, HALF_OPEN):  # (not when it was opened or removed during the sync)
                member.failures += 1
                member.last_error = error
                self._open(member, f"dropped from the sync to version {sync.version}")
        if not sync.pending and self._sync is sync:
            self._sync_finished(sync)
        self._changed.notify_all()

    def _sync_finished(self, sync: _Sync) -> None:
        """The last load ended (or was dropped): the router serves the new version if any generator has it."""
        self._sync = None
        if sync.loaded:
            self._version, self._weights = sync.version, sync.state_dict
        sync.skipped = [(s.name, RuntimeError("dead for good: removed from the fleet" if s.state == DEAD else
                                              f"not in rotation ({s.state}): re-synced before it returns"))
                        for s in self._members if s not in sync.targets]
        dead = [s.name for s in self._members if s.state == DEAD]
        self._note(None, "synced", f"version {sync.version} ({sync.mode}): loaded by {len(sync.loaded)} of "
                                   f"{len(self._members)}" + (f"; dead: {', '.join(dead)}" if dead else ""))
        self._changed.notify_all()

    def _load(self, member: _Member, state_dict, version: int):
        """Call the generator's load_weights (outside the lock); the error, or None."""
        try:
            member.gen.load_weights(state_dict, version)
            if member.gen.policy_version != version:
                raise RuntimeError(f"{member.name}.load_weights(version={version}) returned but its "
                                   f"policy_version is {member.gen.policy_version}")
        except Exception as exc:  # noqa: BLE001 - any failure of the engine's load takes it out
            return exc
        return None

    def _readmit_due(self, now: float, members=None) -> list:
        """Open generators (of ``members``, default all) whose back-off ended, whose older attempts have
        all ended and that no load of ours is running on, start re-admission."""
        work = []
        for s in self._members if members is None else members:
            if s.state == OPEN and s.reopen_at <= now and _is_dead(s.gen):  # it died for good meanwhile
                self._remove(s, "found dead at re-admission")
            elif s.state == OPEN and s.reopen_at <= now and not s.loading and s.inflight == 0:
                s.state, s.loading = READMITTING, True
                self._note(s, "readmitting", f"after {s.opened} opening(s)")
                work.append(("readmit", s))
        return work

    def _readmit(self, member: _Member) -> None:
        """Re-admission (module docstring): re-sync a stale generator, then half-open (or closed).
        Runs in its own thread when it loads weights; the clock opens the generator again if the
        load misses the sync deadline."""
        while True:
            with self._lock:
                version, weights = self._version, self._weights
            have = member.gen.policy_version
            if have >= version or (weights is None and have >= member.floor):
                error = None
            elif weights is None:
                error = RuntimeError(f"{member.name} reports version {have}, below its floor {member.floor}, and no "
                                     f"weights were synced yet to load into it")
            else:
                with self._lock:
                    member.readmit_deadline = self._clock.now() + self.sync_timeout_s
                    self._schedule(member.readmit_deadline)
                error = self._load(member, weights, version)
            with self._lock:
                member.readmit_deadline = math.inf
                if member.state != READMITTING:  # the clock opened it: the load came too late
                    member.loading = False
                    work = self._readmit_due(self._clock.now()) + self._pump()
                elif error is None and self._version != version:
                    continue  # a sync landed meanwhile: load that one too
                elif error is not None:
                    member.loading = False
                    member.failures += 1
                    member.last_error = error
                    self._open(member, f"re-admission failed: {error!r}")
                    work = self._pump()
                else:
                    member.loading = False
                    if version > member.floor or have < member.floor:
                        member.floor = version
                        self._note(member, "resynced", f"to version {version}")
                    if member.close_on_return:
                        self._close_breaker(member)
                    else:
                        member.state = HALF_OPEN
                        self._note(member, "half_open", "one probe request decides")
                    work = self._join_sync(member) + self._pump()
            self._run(work)
            return

    def _join_sync(self, member: _Member) -> list:
        """A generator back in rotation while a sync is under way becomes one of its targets: it
        loads that sync's version after its re-admission's load (one generator's loads never
        overlap), so the last sync wins and no sync reports success while it serves older weights."""
        sync = self._sync
        if sync is None:
            return []
        if member not in sync.targets:
            sync.targets.append(member)
        sync.errors.pop(member.name, None)  # dropped from this sync before: its new load decides
        sync.pending[member] = turn = object()  # a new turn: a thread of an earlier one ends unloaded
        member.draining = sync.mode == "drain"
        member.loading = sync.mode == "hot_swap"
        return [("sync", member, sync, turn)]

    # ------------------------------------------------------------------ doing (outside the lock)

    def _run(self, work: list) -> None:
        pending = getattr(self._local, "pending", None)
        if pending is not None:  # this thread is already working through a list: add to it
            pending.extend(work)
            return
        self._local.pending = pending = deque(work)
        try:
            while pending:
                kind, *args = pending.popleft()
                if kind == "dispatch":
                    self._dispatch(*args)
                elif kind == "readmit":
                    member = args[0]
                    if member.gen.policy_version < self._version and self._weights is not None:
                        threading.Thread(target=self._readmit, args=(member,), name=f"readmit-{member.name}",
                                         daemon=True).start()  # a load: in a thread of its own
                    else:
                        self._readmit(member)  # nothing to load: at once, in this thread
                elif kind == "sync":  # a generator joined the sync under way: its load, in a thread
                    threading.Thread(target=self._sync_one, args=args, name=f"load-{args[0].name}",
                                     daemon=True).start()
                elif kind == "cancel":
                    if args[0] is not None:
                        args[0].cancel()
                else:
                    try:
                        if kind == "done":
                            args[0].set_result(args[1])
                        else:  # "fail"
                            args[0].set_exception(args[1])
                    except InvalidStateError:  # someone else settled the user's future: theirs stands
                        pass
        finally:
            self._local.pending = None

    def _dispatch(self, attempt: _Attempt) -> None:
        member = attempt.member
        have = member.gen.policy_version
        if have < attempt.floor or _is_dead(member.gen):  # refused: it has nothing right to serve
            exc = RuntimeError(f"{member.name} is dead for good" if _is_dead(member.gen) else
                               f"{member.name} reports version {have}, below the {attempt.floor} it was "
                               f"admitted with: it lost its weights (restarted?)")
            with self._lock:
                work = self._end_attempt(attempt, None, exc, lost=True)
            self._run(work)
            return
        try:
            fut = member.gen.submit(attempt.ticket.request)
            if not isinstance(fut, Future):
                raise RuntimeError(f"{member.name}.submit returned {type(fut).__name__}, not a Future")
        except Exception as exc:  # noqa: BLE001 - ValueError / TypeError: the request's fault; else the generator's
            with self._lock:
                work = self._end_attempt(attempt, None, exc, blame=not _is_bad_input(exc))
            self._run(work)
        else:
            attempt.future = fut
            fut.add_done_callback(functools.partial(self._on_done, attempt))

    def _on_done(self, attempt: _Attempt, fut: Future) -> None:  # the generator future's done-callback
        if fut.cancelled():
            completion, exc = None, CancelledError(f"{attempt.member.name} cancelled the request")
        elif fut.exception() is not None:
            completion, exc = None, fut.exception()
        else:
            completion, exc = fut.result(), None
        with self._lock:  # a ValueError / TypeError is the engine refusing this request: not its fault
            work = self._end_attempt(attempt, completion, exc, blame=not _is_bad_input(exc))
        self._run(work)

    def _note(self, member, event: str, detail: str) -> None:
        self._events.append((self._clock.now(), None if member is None else member.name, event, detail))

    def _member(self, name: str) -> _Member:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise ValueError(f"name must be one of {', '.join(self._by_name)}; got {name!r}") from None


def _block_keys(prompt: list, block: int) -> list:
    """prefix_affinity's keys of a prompt: one per block of ``block`` tokens (the last may be shorter),
    each the hash of (its parent's key, its tokens)."""
    keys, key = [], 0
    for start in range(0, len(prompt), block):
        key = hash((key, tuple(prompt[start:start + block])))
        keys.append(key)
    return keys


def _served_version(completion, request):
    """The oldest weights a generator's answer was produced with: a Completion's min_policy_version,
    or for a group (``sampling.n > 1``) the oldest of its n completions; None when it is neither."""
    if request.sampling.n == 1:
        return getattr(completion, "min_policy_version", None)
    if not isinstance(completion, list) or len(completion) != request.sampling.n:
        return None
    versions = [getattr(c, "min_policy_version", None) for c in completion]
    return min(versions) if all(_is_int(v) for v in versions) else None


def _is_dead(gen) -> bool:
    """A generator's optional ``dead`` attribute (GeneratorProtocol): true once it can never serve again."""
    return getattr(gen, "dead", False) is True


def _is_bad_input(exc) -> bool:
    """ValueError / TypeError from a generator: it refused this request (the request's fault, not its)."""
    return isinstance(exc, (ValueError, TypeError))


def _check_request(request, what: str = "request") -> None:
    """Every field the router reads or hands to a generator, whoever built the request: a missing
    field, a wrong type or a value out of range raises here, before any generator sees it."""
    missing = [f for f in ("prompt_token_ids", "sampling", "request_id", "session_id") if not hasattr(request, f)]
    if missing:
        raise TypeError(f"{what} must be a Request, got {type(request).__name__} (no {', '.join(missing)})")
    prompt = request.prompt_token_ids
    if not isinstance(prompt, list):
        raise TypeError(f"{what}.prompt_token_ids must be a list of ints (token ids), got {type(prompt).__name__}")
    try:
        lowest = min(map(operator.index, prompt), default=None)  # one pass at C speed
    except TypeError:
        bad = next(t for t in prompt if not _is_index(t))
        raise TypeError(f"{what}.prompt_token_ids must hold ints (token ids), got {type(bad).__name__}") from None
    if lowest is None:
        raise ValueError(f"{what}.prompt_token_ids must hold at least one token, got an empty prompt")
    if lowest < 0:
        raise ValueError(f"{what}.prompt_token_ids must be token ids >= 0, got {lowest}")
    _check_sampling(request.sampling, f"{what}.sampling.")
    if not isinstance(request.request_id, str):
        raise TypeError(f"{what}.request_id must be a str, got {type(request.request_id).__name__}")
    try:
        hash(request.session_id)  # checked here: the policy hashes it under the lock
    except TypeError:
        raise TypeError(f"{what}.session_id must be hashable, got {type(request.session_id).__name__}") from None


def _check_timeout(name: str, value, zero: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value >= 0 if zero else value > 0):
        raise ValueError(f"{name} must be a number of seconds {'>= 0' if zero else '> 0 (math.inf: none)'}, "
                         f"got {value!r}")
    return float(value)


def _checked_arguments(generators, policy, max_inflight, max_retries, max_sessions, request_timeout_s,
                       sync_timeout_s, failure_threshold, backoff_s, clock) -> list:
    """The router's constructor arguments checked; the generators as a list."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    try:
        generators = list(generators)
    except TypeError:
        raise TypeError(f"generators must be a list of generators, got {type(generators).__name__}") from None
    if not generators:
        raise ValueError("generators must be a non-empty list of objects following GeneratorProtocol "
                         "(name, policy_version, submit, load_weights); got an empty list")
    for i, g in enumerate(generators):
        missing = [m for m in ("name", "policy_version", "submit", "load_weights") if not hasattr(g, m)]
        if missing:
            raise TypeError(f"generators[{i}] ({type(g).__name__}) does not follow GeneratorProtocol: "
                            f"it lacks {', '.join(missing)}")
        if not isinstance(g.name, str) or not _is_int(g.policy_version):
            raise TypeError(f"generators[{i}] must have a str name and an int policy_version, got "
                            f"{type(g.name).__name__} and {type(g.policy_version).__name__}")
    names = [g.name for g in generators]
    if len(set(names)) != len(names):
        raise ValueError(f"generator names must be unique, got {names}")
    if max_inflight is not None and (not _is_int(max_inflight) or max_inflight < 1):
        raise ValueError(f"max_inflight must be None or an int >= 1, got {max_inflight!r}")
    for name, value, low in (("max_retries", max_retries, 0), ("max_sessions", max_sessions, 1),
                             ("failure_threshold", failure_threshold, 1)):
        if not _is_int(value) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    for name, value in (("request_timeout_s", request_timeout_s), ("sync_timeout_s", sync_timeout_s)):
        _check_timeout(name, value)
    if (not isinstance(backoff_s, tuple) or len(backoff_s) != 2
            or not all(isinstance(b, (int, float)) for b in backoff_s)
            or not 0 < backoff_s[0] <= backoff_s[1] < math.inf):
        raise ValueError(f"backoff_s must be (first, cap) seconds with 0 < first <= cap, got {backoff_s!r}")
    if clock is not None and not (callable(getattr(clock, "now", None)) and callable(getattr(clock, "call_at", None))):
        raise TypeError(f"clock must have now() and call_at(t, fn), got {type(clock).__name__}")
    return generators
