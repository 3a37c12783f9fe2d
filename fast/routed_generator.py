"""Routed generator: the fast version.  A cheap router with the reference's fault policy, and a
supervised fleet of generators on Ray.

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
    The same router, data types, protocol and fault policy as ``ref/routed_generator.py``, the
    specification (read its docstring for the routing rules, the circuit breaker, deadlines,
    version-gated re-admission and weight sync): on the same sequence of events, with the same
    clock, both routers make the same decisions and record the same health events (parity/
    checks it event by event).  What this file changes is how the work is done, and it adds
    ``ray_generators``: engines as Ray actors behind the same protocol.

The router: what makes it cheap (costs per request, n generators)
    - No thread per request, none at rest: dispatch runs in the submitting thread and in the
      thread that settles a generator's future; one clock thread with a single alarm handles
      deadlines and back-offs.
    - O(log n) choice: one binary heap of (load, last_chosen, index) (``(last_chosen, index)``
      for round_robin) with lazy invalidation: an entry is pushed whenever a generator's key
      changes or it becomes eligible again, and a popped entry whose key is stale or whose
      generator is not eligible is dropped.  The heap is rebuilt from the eligible generators
      when it holds more than 2n + 64 entries, so memory stays O(n).  A retry steered away from
      the generators that failed it skips past them and puts them back (O(k log n) for k
      failures).  power_of_two is O(1) plus the same heap as fallback; the reference scans all
      n generators per request.
    - Deadlines: one heap of (deadline, arrival, attempt), lazily invalidated and compacted
      (more than 2 x live + 64 entries: rebuilt), so a request costs O(log a) for a attempts in
      flight; the reference scans every attempt in flight when its clock wakes.
    - The queue is a deque of fresh arrivals plus a small heap of retried requests; the common
      path with an empty queue touches neither.  ``__slots__`` records, one lock acquisition on
      submit and one on completion.

The fleet on Ray (``ray_generators``)
    ``ray_generators(make_generator, n)`` starts n Ray actors, each building its engine with
    ``make_generator()`` (any picklable zero-argument callable, e.g. ``functools.partial(
    Generator, config, device="cuda")``), and returns n handles that follow the protocol, so
    ``GeneratorRouter(ray_generators(...))`` works as it is.  ``ray`` is imported inside that
    function only: this file imports with torch alone.
    requests     ``submit`` sends the request to the actor (an async actor awaits the engine's
                 future, so one actor serves many requests at once) and returns a Future that
                 the reply settles.  The request is checked like the router checks it, and against
                 the engine's vocabulary and context, so bad input still raises in ``submit``; a
                 ValueError / TypeError the engine raises inside the actor fails the future with
                 the same type and the engine's message (the router fails that request alone).
    supervision  actors restart on death (``max_restarts``; Ray does not retry their tasks: the
                 router retries the requests elsewhere).  A handle that sees its actor die (or a
                 reply from a new incarnation) reports policy_version -1 and asks the actor what
                 it is until it answers: Ray's ActorUnavailableError means it is restarting (ask
                 again), so the new process is heard from even when no sync ever comes (it holds
                 its construction weights); ActorDiedError means dead for good (out of restarts,
                 or killed): ``dead`` turns true and the router removes it.  Meanwhile the router
                 refuses it, opens it, and re-syncs it before re-admitting it; a load waits while
                 Ray reports the actor as restarting.
    ray          the running instance (``ray.init(address=...)`` first, for a cluster), else the one
                 RAY_ADDRESS names if it answers within ``connect_timeout_s``, else a new local one.
    weights      each version is put into Ray's object store once, as one flat byte buffer
                 (zero-copy for the actors on the trainer's node, one transfer per other node),
                 and every actor loads from there; actors load independently, so one failing
                 never breaks the others, and a restarted actor is re-synced from the same
                 object.  The trainer is any process holding a state dict: no process group,
                 no world size, membership may change.
    collective   ``weight_transport=sender`` (fast/weight_sync.py's ``WeightSender`` in the trainer's
                 process, or an object with its ``receiver(name)`` / ``header(name, version)`` /
                 ``send(name, state_dict, version)``): each actor connects ``sender.receiver(name)`` on
                 every rank of its engine at start-up (and again after a restart: Ray re-runs the
                 actor's constructor, and a new receiver makes both sides form new channels), and a
                 load is one call to the actor (the header) while this process streams the buckets
                 straight into each rank's shadow weights (shard to shard, verified).  An actor whose
                 receiver could not connect (the trainer's address unreachable from its node, an
                 engine without ``connect_weights``) loads through the object store, the fallback; a
                 failed collective load is a failed load (the router opens the generator and re-syncs
                 it at re-admission, over new channels).
    placement    actors spread over the cluster's nodes (scheduling strategy "SPREAD" unless
                 ``actor_options`` say otherwise); ``num_cpus`` / ``num_gpus`` per actor.

Data types (the same in ref and fast)
    SamplingParams, Request, Completion, state_dict: as in the reference.

Supported, and what raises
    As the reference.  ``ray_generators``: ImportError naming ray when it is not installed;
    ValueError for n < 1 or bad options; the modules ``make_generator`` needs must be importable
    on every node (Ray puts the driver's working directory on the workers' path; on a real
    cluster pass ``actor_options={"runtime_env": {...}}``).  Limits: without ``weight_transport``,
    CPU tensors travel through the object store (GPU weights are copied to host once per version);
    a handle's ``submit`` costs a Ray task round trip (~1 ms), so batches of requests belong in one
    router, not in one call.

References
    As the reference; Ray (Moritz et al., OSDI 2018): actors, fault tolerance (max_restarts),
    the object store; verl / OpenRLHF / NeMo-RL rollout workers as Ray actors; vLLM router /
    SGLang model gateway.
"""
from __future__ import annotations

import array
import dataclasses
import heapq
import itertools
import math
import operator
import random
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Protocol, runtime_checkable

import torch

__all__ = ["SamplingParams", "Request", "Completion", "GeneratorProtocol", "RouterError", "GeneratorRouter",
           "POLICIES", "SYNC_MODES", "ray_generators"]

POLICIES = ("round_robin", "least_loaded", "sticky", "power_of_two", "prefix_affinity")
SYNC_MODES = ("hot_swap", "drain")
CLOSED, OPEN, READMITTING, HALF_OPEN, DEAD = "closed", "open", "readmitting", "half_open", "dead"
_UP = (CLOSED, HALF_OPEN)
_UNCAPPED = sys.maxsize


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
    """What the router needs from a generator: ``name``, ``policy_version`` (never blocks; may drop
    only when the engine restarts), ``submit(request) -> Future[Completion]`` (never blocks;
    ValueError / TypeError, raised or as the future's exception = bad input),
    ``load_weights(state_dict, version)`` (blocking); optional ``dead: bool`` (true once it can
    never serve again).  The reference's docstring has the full contract."""

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
    """The router's record of one generator, its breaker included."""

    __slots__ = ("index", "gen", "name", "inflight", "dispatched", "completed", "failures", "timeouts", "late", "stale",
                 "state", "draining", "consecutive", "opened", "reopen_at", "probe_out", "close_on_return",
                 "loading", "readmit_deadline", "floor", "last_error", "last_chosen")

    def __init__(self, index: int, gen, last_chosen: int):
        self.index, self.gen, self.name = index, gen, gen.name
        self.inflight = self.dispatched = self.completed = self.failures = self.timeouts = self.late = self.stale = 0
        self.state = CLOSED
        self.draining = self.probe_out = self.close_on_return = self.loading = False
        self.consecutive = self.opened = 0
        self.reopen_at = self.readmit_deadline = math.inf
        self.floor = gen.policy_version
        self.last_error = None
        self.last_chosen = last_chosen


class _Ticket:
    """One request on its way through the router (its arrival number survives retries)."""

    __slots__ = ("seq", "request", "future", "timeout_s", "queued_at", "causes", "started")

    def __init__(self, seq: int, request, future: Future, timeout_s: float, now: float):
        self.seq, self.request, self.future, self.timeout_s, self.queued_at = seq, request, future, timeout_s, now
        self.causes = None  # a list once an attempt failed
        self.started = False


class _Attempt:
    """One dispatch; calling it with the generator's future is the future's done-callback."""

    __slots__ = ("router", "ticket", "member", "deadline", "probe", "floor", "live", "future")

    def __init__(self, router, ticket: _Ticket, member: _Member, deadline: float, probe: bool):
        self.router, self.ticket, self.member, self.deadline, self.probe = router, ticket, member, deadline, probe
        self.floor, self.live, self.future = member.floor, True, None

    def __call__(self, fut: Future) -> None:
        self.router._settled(self, fut)


@dataclasses.dataclass(eq=False)
class _SyncRecord:
    """One ``sync_weights`` call: the loads still pending, and what became of the others."""

    state_dict: Mapping
    version: int
    mode: str
    deadline: float
    targets: list                       # grows when a re-admitted generator joins
    loaded: list = dataclasses.field(default_factory=list)
    errors: dict = dataclasses.field(default_factory=dict)
    skipped: list = dataclasses.field(default_factory=list)  # (name, why) of the others, as it ended

    def __post_init__(self):
        self.targets = list(self.targets)
        self.pending = {s: object() for s in self.targets}  # each load thread's turn (the reference's rule)


class _Alarm:
    """Real time with a single alarm: ``call_at`` keeps the earliest (t, fn); the router re-arms it
    every time it runs, so one pending call is all it needs."""

    def __init__(self):
        self._cv = threading.Condition()
        self._at, self._fn = math.inf, None
        self._thread, self._stopped = None, False

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, t: float, fn) -> None:
        with self._cv:
            if t < self._at and not self._stopped:
                self._at, self._fn = t, fn
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="router-clock", daemon=True)
                    self._thread.start()
                self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and self._at > time.monotonic():
                    self._cv.wait(None if self._at == math.inf else self._at - time.monotonic())
                if self._stopped:
                    return
                fn, self._at = self._fn, math.inf
            fn()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()


def _set_result(future: Future, value) -> None:
    try:
        future.set_result(value)
    except InvalidStateError:  # someone else settled the user's future: theirs stands
        pass


def _set_exception(future: Future, exc: BaseException) -> None:
    try:
        future.set_exception(exc)
    except InvalidStateError:
        pass


def _cancel(future, _) -> None:
    if future is not None:
        future.cancel()


# ----------------------------------------------------------------------------- the router

class GeneratorRouter:
    """Routes requests over generators, handles their faults, syncs their weights.  The contract and
    every rule are the reference's; the work lists hold ``(function, a, b)`` calls."""

    def __init__(self, generators, *, policy: str = "least_loaded", max_inflight: int | None = None,
                 max_retries: int = 2, max_sessions: int = 65536, seed: int | None = None,
                 request_timeout_s: float = 300.0, sync_timeout_s: float = 300.0, failure_threshold: int = 3,
                 backoff_s: tuple[float, float] = (0.5, 5.0), clock=None, affinity_block: int = 16,
                 affinity_slack: int = 4):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        try:
            generators = list(generators)
        except TypeError:
            raise TypeError(f"generators must be a list of generators, got {type(generators).__name__}") from None
        _check_generators(generators)
        if max_inflight is not None and (not _is_int(max_inflight) or max_inflight < 1):
            raise ValueError(f"max_inflight must be None or an int >= 1, got {max_inflight!r}")
        for name, value, low in (("max_retries", max_retries, 0), ("max_sessions", max_sessions, 1),
                                 ("failure_threshold", failure_threshold, 1), ("affinity_block", affinity_block, 1),
                                 ("affinity_slack", affinity_slack, 0)):
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.request_timeout_s = _seconds("request_timeout_s", request_timeout_s)
        self.sync_timeout_s = _seconds("sync_timeout_s", sync_timeout_s)
        if not (isinstance(backoff_s, tuple) and len(backoff_s) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in backoff_s)
                and 0 < backoff_s[0] <= backoff_s[1] < math.inf):
            raise ValueError(f"backoff_s must be (first, cap) seconds with 0 < first <= cap, got {backoff_s!r}")
        if clock is not None and not all(callable(getattr(clock, m, None)) for m in ("now", "call_at")):
            raise TypeError(f"clock must have now() and call_at(t, fn), got {type(clock).__name__}")
        n = len(generators)
        self.policy, self.max_inflight, self.max_retries = policy, max_inflight, max_retries
        self.max_sessions, self.affinity_block, self.affinity_slack = max_sessions, affinity_block, affinity_slack
        self.failure_threshold, self.backoff_s = failure_threshold, (float(backoff_s[0]), float(backoff_s[1]))
        self._own_clock, self._clock = clock is None, _Alarm() if clock is None else clock
        self._cap = _UNCAPPED if max_inflight is None else max_inflight
        self._rr = policy == "round_robin"
        self._members = [_Member(i, g, i - n) for i, g in enumerate(generators)]
        self._by_name = {s.name: s for s in self._members}
        self._n_up = n                                   # generators closed or half-open
        self._n_dead = 0                                 # generators removed for good
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._sync_lock = threading.Lock()
        self._fresh: deque[_Ticket] = deque()            # never-dispatched arrivals, in arrival order
        self._retry: list[tuple[int, _Ticket]] = []      # retried requests: min-heap on arrival number
        self._deadlines: list[tuple] = []                # (deadline, arrival, n, attempt): lazy min-heap
        self._n_live = 0                                 # attempts in flight
        self._stamp = itertools.count()
        self._arrivals = itertools.count()
        self._tick = 0
        self._sessions: OrderedDict = OrderedDict()
        self._prefixes: OrderedDict = OrderedDict()      # prefix_affinity: block key -> generator names
        self._rng = random.Random(seed)
        self._version = max(g.policy_version for g in generators)
        self._weights = None
        self._sync = None                                # the _SyncRecord under way
        self._down_since = None
        self._wake_at = math.inf
        self._events: deque = deque(maxlen=1000)
        self._closed = False
        self._local = threading.local()
        self._heap: list[tuple] = []
        self._rebuild_heap()

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
            return len(self._fresh) + len(self._retry)

    def submit(self, request: Request, *, timeout_s: float | None = None) -> Future:
        """Route one request; the future resolves to its ``Completion`` (or a ``RouterError``)."""
        _check_request(request)
        timeout_s = self.request_timeout_s if timeout_s is None else _seconds("timeout_s", timeout_s)
        future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the router is closed")
            ticket = _Ticket(next(self._arrivals), request, future, timeout_s, self._clock.now())
            if self._fresh or self._retry or not self._n_up:
                self._fresh.append(ticket)
                work = self._pump()
            else:  # the common case, _pump() on a queue holding only this ticket, inlined
                self._down_since = None
                ticket.started = True
                future.set_running_or_notify_cancel()  # nobody else holds it yet: cannot be cancelled
                member = self._choose(ticket)
                if member is None:
                    self._fresh.append(ticket)  # it waits at the head of the queue
                    work = ()
                else:
                    work = (self._reserve(ticket, member, ticket.queued_at),)
        self._run(work)
        return future

    def generate(self, requests, *, timeout_s: float | None = None) -> list[Completion]:
        """Submit every request, wait, return the completions in request order (raises the first failure)."""
        requests = list(requests)
        for i, r in enumerate(requests):
            _check_request(r, f"requests[{i}]")
        futures = [self.submit(r, timeout_s=timeout_s) for r in requests]
        return [f.result() for f in futures]

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, mode: str = "hot_swap",
                     timeout_s: float | None = None) -> None:
        """Load ``state_dict`` as ``version`` into every generator in rotation, all in parallel, within
        ``timeout_s`` (default ``sync_timeout_s``).  ``hot_swap`` or ``drain``; the reference's
        docstring has the rules (missers opened and re-synced on return; ``RouterError``)."""
        if mode not in SYNC_MODES:
            raise ValueError(f"mode must be one of {', '.join(SYNC_MODES)}; got {mode!r}")
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
        timeout_s = self.sync_timeout_s if timeout_s is None else _seconds("timeout_s", timeout_s)
        drain = mode == "drain"
        with self._sync_lock:  # (the call before ends by its deadline, or at close())
            with self._lock:
                if self._closed:
                    raise RuntimeError("the router is closed")
                if version <= self._version:
                    raise ValueError(f"version must increase: got {version}, the router already serves "
                                     f"version {self._version}")
                targets = [s for s in self._members if s.state in _UP and not s.loading]
                sync = self._sync = _SyncRecord(state_dict, version, mode, self._clock.now() + timeout_s, targets)
                for s in targets:
                    s.draining, s.loading = drain, not drain
                self._schedule(sync.deadline)
                turns = list(sync.pending.items())  # (the first load may end the sync before the last starts)
                if not targets:
                    self._sync_over(sync)
            for s, turn in turns:
                threading.Thread(target=self._sync_one, args=(s, sync, turn), name=f"load-{s.name}",
                                 daemon=True).start()
            with self._lock:
                self._changed.wait_for(lambda: self._sync is not sync)  # its deadline, or close(), ends it
        causes = [(s.name, sync.errors[s.name]) for s in sync.targets if s.name in sync.errors]
        if not sync.loaded or causes:
            raise RouterError(f"weight sync to version {version} reached {len(sync.loaded)} of "
                              f"{len(self._members)} generators", causes + sync.skipped)

    def mark_healthy(self, name: str) -> None:
        """Re-admit a generator now: re-synced first if stale, then closed."""
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
                    self._to_closed(member)
                work = []
            work += self._pump()
        self._run(work)

    def stats(self) -> dict[str, dict]:
        """Per generator: the reference's counters (dispatched, inflight, completed, failures, timeouts,
        late, stale, state, healthy, draining, floor, policy_version, last_error)."""
        with self._lock:
            out = {s.name: dict(dispatched=s.dispatched, inflight=s.inflight, completed=s.completed,
                                failures=s.failures, timeouts=s.timeouts, late=s.late, stale=s.stale, state=s.state,
                                healthy=s.state == CLOSED, draining=s.draining, floor=s.floor,
                                last_error=None if s.last_error is None else repr(s.last_error))
                   for s in self._members}
        for s in self._members:
            out[s.name]["policy_version"] = s.gen.policy_version
        return out

    def health_events(self) -> list[tuple]:
        """``(t, generator, event, detail)`` since the last call (the reference's events)."""
        with self._lock:
            events, self._events = list(self._events), deque(maxlen=1000)
        return events

    def close(self, *, timeout_s: float = 0.0) -> None:
        """No new requests or syncs; wait at most ``timeout_s`` for those queued or in flight, fail the
        rest, end a sync under way (its pending loads dropped); stop the clock.  Generators stay open."""
        deadline = time.monotonic() + _seconds("timeout_s", timeout_s, zero=True)
        with self._lock:
            self._closed = True
            while (self._fresh or self._retry or self._n_live) and time.monotonic() < deadline:
                self._changed.wait(min(0.05, deadline - time.monotonic()))
            closed = RouterError("the router was closed before the request finished")
            queued = sorted([*self._fresh, *(t for _, t in self._retry)], key=lambda t: t.seq)
            work = [(_set_exception, t.future, closed) for t in queued if self._start(t)]
            for _, _, _, a in sorted(self._deadlines):
                if a.live:
                    a.live = False
                    a.member.inflight -= 1
                    work.append((_set_exception, a.ticket.future, closed))
            self._fresh, self._retry, self._deadlines, self._n_live = deque(), [], [], 0
            sync = self._sync  # the clock stops, so its deadline never comes: it ends here
            if sync is not None:
                for s in sorted(sync.pending, key=lambda s: s.index):
                    s.draining = False
                    sync.errors[s.name] = RouterError(f"{s.name}: the router was closed before it loaded")
                sync.pending.clear()
                self._sync_over(sync)  # (wakes sync_weights and its drain threads)
        if self._own_clock:
            self._clock.stop()
        self._run(work)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the heap (under the lock)

    def _eligible(self, s: _Member) -> bool:
        if s.draining:
            return False
        return (s.state == CLOSED and s.inflight < self._cap) or (s.state == HALF_OPEN and not s.probe_out)

    def _push(self, s: _Member) -> None:
        """Give an eligible generator an entry with its current key (the heap's invariant)."""
        if self._eligible(s):
            if len(self._heap) > 2 * len(self._members) + 64:  # mostly stale entries: start over
                self._rebuild_heap()
            else:
                heapq.heappush(self._heap, (s.last_chosen, s.index) if self._rr else
                               (s.inflight, s.last_chosen, s.index))

    def _rebuild_heap(self) -> None:
        self._heap = [(s.last_chosen, s.index) if self._rr else (s.inflight, s.last_chosen, s.index)
                      for s in self._members if self._eligible(s)]
        heapq.heapify(self._heap)

    def _best(self, avoid=()) -> _Member | None:
        """The eligible generator with the smallest key, skipping those in ``avoid`` (put back after)."""
        heap, members, skipped, found = self._heap, self._members, [], None
        while heap:
            e = heap[0]
            s = members[e[-1]]
            if not self._eligible(s) or e[0] != (s.last_chosen if self._rr else s.inflight) or (
                    not self._rr and e[1] != s.last_chosen):
                heapq.heappop(heap)  # stale
            elif s.name in avoid:
                skipped.append(heapq.heappop(heap))
            else:
                found = s  # left in place: reserving it changes its key, so it goes stale
                break
        for e in skipped:
            heapq.heappush(heap, e)
        return found

    def _set_state(self, s: _Member, state: str) -> None:
        self._n_up += (state in _UP) - (s.state in _UP)
        self._n_dead += (state == DEAD) - (s.state == DEAD)
        s.state = state
        self._push(s)

    # ------------------------------------------------------------------ choosing (under the lock)

    def _choose(self, ticket: _Ticket) -> _Member | None:
        avoid = ()
        if ticket.causes:  # a retry goes elsewhere while another generator is in rotation
            failed = {name for name, _ in ticket.causes}
            if any(s.state in _UP and s.name not in failed for s in self._members):
                avoid = failed
        policy = self.policy
        if policy == "least_loaded" or policy == "round_robin":
            return self._best(avoid)
        if policy == "power_of_two":
            members = self._members
            if len(members) == 1:
                a = b = members[0]
            else:
                i = self._rng.randrange(len(members))
                j = self._rng.randrange(len(members) - 1)
                j += j >= i
                a, b = members[i], members[j]
            ok_a = self._eligible(a) and a.name not in avoid
            ok_b = self._eligible(b) and b.name not in avoid
            if ok_a and ok_b:
                return a if (a.inflight, a.last_chosen) < (b.inflight, b.last_chosen) else b
            return a if ok_a else b if ok_b else self._best(avoid)
        if policy == "prefix_affinity":
            return self._prefix_affinity(ticket.request, avoid)
        sid = ticket.request.session_id  # sticky
        if sid is None:
            return self._best(avoid)
        sessions = self._sessions
        pinned = sessions.get(sid)
        if pinned is not None and pinned.state == CLOSED and not pinned.draining and pinned.name not in avoid:
            sessions.move_to_end(sid)
            return pinned if pinned.inflight < self._cap else self._best(avoid)
        chosen = self._best(avoid)
        if chosen is not None:
            sessions[sid] = chosen
            sessions.move_to_end(sid)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        return chosen

    def _prefix_affinity(self, request, avoid) -> _Member | None:
        """The reference's rule: the longest run of the prompt's blocks, unless that generator is more
        than affinity_slack busier than the least loaded one; O(blocks + holders)."""
        least = self._best(avoid)
        if least is None:
            return None
        keys = _block_keys(request.prompt_token_ids, self.affinity_block)
        prefixes, matched = self._prefixes, {}
        for depth, key in enumerate(keys):
            grown = [name for name in prefixes.get(key, ()) if matched.get(name, 0) == depth]
            if not grown:
                break
            for name in grown:
                matched[name] = depth + 1
        chosen = least
        holders = [s for s in (self._by_name[n] for n in matched) if self._eligible(s) and s.name not in avoid]
        if holders:
            best = min(holders, key=lambda s: (-matched[s.name], s.inflight, s.last_chosen))
            if best.inflight - least.inflight <= self.affinity_slack:
                chosen = best
        for key in keys:
            prefixes.setdefault(key, set()).add(chosen.name)
            prefixes.move_to_end(key)
        while len(prefixes) > self.max_sessions:
            prefixes.popitem(last=False)
        return chosen

    def _pump(self) -> list:
        """Dispatch queued requests in arrival order while a generator is eligible."""
        now = self._fleet_status()
        if self._n_dead == len(self._members):
            return self._fail_queue_all_dead()
        work = []
        fresh, retry = self._fresh, self._retry
        while fresh or retry:
            from_retry = bool(retry) and (not fresh or retry[0][0] < fresh[0].seq)
            ticket = retry[0][1] if from_retry else fresh[0]
            if not self._start(ticket):
                fresh.popleft()  # only fresh tickets are not started
                continue
            member = self._choose(ticket)
            if member is None:
                break
            heapq.heappop(retry) if from_retry else fresh.popleft()
            work.append(self._reserve(ticket, member, now))
        return work

    def _fail_queue_all_dead(self) -> list:
        """Every generator is dead: nothing can ever serve what waits, so it fails now."""
        queued = sorted([*self._fresh, *(t for _, t in self._retry)], key=lambda t: t.seq)
        self._fresh, self._retry = deque(), []
        return [(_set_exception, t.future, RouterError(f"request {t.request.request_id}: every generator is dead",
                                                       t.causes or [])) for t in queued if self._start(t)]

    def _fleet_status(self) -> float:
        now = self._clock.now()
        if self._n_up:
            self._down_since = None
            return now
        if self._down_since is None:
            self._down_since = now
            self._note(None, "fleet_down", "no generator in rotation: requests wait for a re-admission")
        if self._fresh or self._retry:
            self._schedule(min(max(t.queued_at, self._down_since) + t.timeout_s
                               for t in itertools.chain(self._fresh, (t for _, t in self._retry))))
        return now

    @staticmethod
    def _start(ticket: _Ticket) -> bool:
        if not ticket.started:
            ticket.started = True
            return ticket.future.set_running_or_notify_cancel()
        return True

    def _reserve(self, ticket: _Ticket, s: _Member, now: float) -> tuple:
        """Count the request against the generator, give it a deadline; the dispatch call to make."""
        probe = s.state == HALF_OPEN
        s.probe_out |= probe
        s.inflight += 1
        s.dispatched += 1
        self._tick += 1
        s.last_chosen = self._tick
        self._push(s)
        attempt = _Attempt(self, ticket, s, now + ticket.timeout_s, probe)
        self._n_live += 1
        if len(self._deadlines) > 2 * self._n_live + 64:  # mostly ended attempts: keep the live ones
            self._deadlines = [e for e in self._deadlines if e[3].live]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (attempt.deadline, ticket.seq, next(self._stamp), attempt))
        if attempt.deadline < self._wake_at:
            self._schedule(attempt.deadline)
        return (self._dispatch, attempt, None)

    # ------------------------------------------------------------------ attempts and breakers (under the lock)

    def _end(self, attempt: _Attempt, completion, exc, blame: bool = True, lost: bool = False) -> list:
        """An attempt ended (the reference's ``_end_attempt``; blame=False: the request's own fault;
        lost: the generator lost its weights, it opens at once)."""
        s, ticket = attempt.member, attempt.ticket
        if not attempt.live:
            s.late += blame and (exc is None or not isinstance(exc, CancelledError))
            return []
        attempt.live = False
        self._n_live -= 1
        s.inflight -= 1
        if s.inflight == 0:
            self._changed.notify_all()
        probe_back = attempt.probe and s.state == HALF_OPEN
        if probe_back:
            s.probe_out = False
        if not s.draining and (probe_back or not self._rr or s.inflight == self._cap - 1):
            self._push(s)  # eligible again, its key changed, or it was full and has room again
        if exc is None:
            served = _served_version(completion, ticket.request)
            if not (_is_int(served) and served >= attempt.floor):
                s.stale += 1
                lost = _is_int(served)  # served below its floor: it lost its weights
                exc = RuntimeError(f"{s.name} served version {served}, below the {attempt.floor} it was admitted "
                                   f"with: it lost its weights (restarted?)" if _is_int(served) else
                                   f"{s.name} returned a {type(completion).__name__}, not a Completion (a list "
                                   f"of n for sampling.n > 1)")
        if exc is None:
            s.completed += 1
            s.consecutive = 0
            if attempt.probe and s.state == HALF_OPEN:
                self._to_closed(s)
            work = [(_set_result, ticket.future, completion)]
        elif not blame:
            work = [(_set_exception, ticket.future, exc)]
        else:
            s.failures += 1
            s.consecutive += 1
            s.last_error = exc
            if lost and s.state in _UP:  # nothing to serve until it is re-synced
                self._to_open(s, f"it lost its weights: {exc!r}")
            elif (attempt.probe and s.state == HALF_OPEN) or (
                    s.state == CLOSED and s.consecutive >= self.failure_threshold):
                self._to_open(s, f"{s.consecutive} consecutive failures; last: {exc!r}")
            if ticket.causes is None:
                ticket.causes = []
            ticket.causes.append((s.name, exc))
            if len(ticket.causes) > self.max_retries:
                work = [(_set_exception, ticket.future, RouterError(
                    f"request {ticket.request.request_id} failed after {len(ticket.causes)} attempts", ticket.causes))]
            else:
                ticket.queued_at = self._clock.now()
                heapq.heappush(self._retry, (ticket.seq, ticket))
                work = []
        if s.state == OPEN and s.inflight == 0:
            work += self._readmit_due(self._clock.now(), (s,))
        if self._fresh or self._retry or not self._n_up:
            work += self._pump()
        else:  # what _pump() does with an empty queue and a generator in rotation
            self._down_since = None
        return work

    def _to_open(self, s: _Member, why: str) -> None:
        if _is_dead(s.gen):
            self._remove(s, why)
            return
        first, cap = self.backoff_s
        backoff = min(first * 2 ** s.opened, cap)
        s.opened += 1
        s.probe_out = s.draining = False
        self._set_state(s, OPEN)
        s.reopen_at = self._clock.now() + backoff
        self._schedule(s.reopen_at)
        self._note(s, "opened", f"for {backoff:g} s: {why}")
        sync = self._sync
        if sync is not None and s in sync.pending:
            self._sync_done(s, sync, RuntimeError(f"{s.name} was opened during the sync: {why}"))

    def _remove(self, s: _Member, why: str) -> None:
        """A dead generator leaves the fleet for good (it stays in ``stats()`` as "dead")."""
        s.probe_out = s.draining = False
        s.reopen_at = math.inf
        self._set_state(s, DEAD)
        self._note(s, "removed", f"dead for good: {why}")
        sync = self._sync
        if sync is not None and s in sync.pending:
            self._sync_done(s, sync, RuntimeError(f"{s.name} is dead for good: {why}"))

    def _to_closed(self, s: _Member) -> None:
        s.probe_out, s.opened, s.consecutive, s.close_on_return = False, 0, 0, False
        self._set_state(s, CLOSED)
        self._note(s, "closed", f"back in rotation at version {s.floor}")

    # ------------------------------------------------------------------ the clock (under the lock)

    def _schedule(self, t: float) -> None:
        if t < self._wake_at and t < math.inf and not self._closed:
            self._wake_at = t
            self._clock.call_at(t, self._on_clock)

    def _on_clock(self) -> None:
        with self._lock:
            now = self._clock.now()
            self._wake_at = math.inf
            work = []
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                attempt = heapq.heappop(heap)[3]
                if attempt.live:
                    attempt.member.timeouts += 1
                    work.append((_cancel, attempt.future, None))
                    work += self._end(attempt, None, TimeoutError(
                        f"{attempt.member.name}: no result within {attempt.ticket.timeout_s:g} s"))
            sync = self._sync
            if sync is not None and sync.deadline <= now:
                for s in sorted(sync.pending, key=lambda s: s.index):
                    self._sync_done(s, sync, TimeoutError(f"{s.name}: not loaded within the sync deadline"))
            for s in self._members:
                if s.state == READMITTING and s.readmit_deadline <= now:
                    s.failures += 1
                    s.last_error = TimeoutError(f"{s.name}: re-sync missed the sync deadline")
                    self._to_open(s, "its re-sync missed the sync deadline")
            if self._down_since is not None:
                self._expire_waiting(now, work)
            work += self._readmit_due(now)
            if self._n_dead == len(self._members):  # (removed just now: what waits can fail)
                work += self._fail_queue_all_dead()
            self._fleet_status()
            while heap and not heap[0][3].live:
                heapq.heappop(heap)
            later = [heap[0][0]] if heap else []
            later += [s.reopen_at if s.state == OPEN else s.readmit_deadline for s in self._members
                      if (s.state == OPEN and s.reopen_at > now) or s.state == READMITTING]
            if self._sync is not None:
                later.append(self._sync.deadline)
            self._schedule(min(later, default=math.inf))
        self._run(work)

    def _expire_waiting(self, now: float, work: list) -> None:
        """The fleet is down: queued requests that waited their timeout_s fail."""
        fresh_expired = [t for t in self._fresh if max(t.queued_at, self._down_since) + t.timeout_s <= now]
        retry_expired = [t for _, t in self._retry if max(t.queued_at, self._down_since) + t.timeout_s <= now]
        if not fresh_expired and not retry_expired:
            return
        gone = {id(t) for t in fresh_expired + retry_expired}
        self._fresh = deque(t for t in self._fresh if id(t) not in gone)
        self._retry = [e for e in self._retry if id(e[1]) not in gone]
        heapq.heapify(self._retry)
        causes = [(s.name, s.last_error) for s in self._members if s.last_error is not None]
        for t in sorted(fresh_expired + retry_expired, key=lambda t: t.seq):
            work.append((_set_exception, t.future, RouterError(
                f"request {t.request.request_id}: no generator in rotation for {t.timeout_s:g} s",
                (t.causes or []) + causes)))

    # ------------------------------------------------------------------ weights and re-admission

    def _sync_one(self, s: _Member, sync: _SyncRecord, turn: object) -> None:
        if sync.mode == "drain":
            with self._lock:
                self._changed.wait_for(lambda: s.inflight == 0 or sync.pending.get(s) is not turn)
                if sync.pending.get(s) is not turn:
                    return
                s.loading = True
        error = _load(s.gen, sync.state_dict, sync.version)
        with self._lock:
            s.loading = False
            if sync.pending.get(s) is turn:
                self._sync_done(s, sync, error)
            work = self._readmit_due(self._clock.now()) + self._pump()
        self._run(work)

    def _sync_done(self, s: _Member, sync: _SyncRecord, error) -> None:
        sync.pending.pop(s, None)
        s.draining = False
        if error is None:
            s.floor = sync.version
            sync.loaded.append(s)
            self._push(s)
        else:
            sync.errors[s.name] = error
            self._note(s, "sync_missed", f"version {sync.version}: {error!r}")
            if s.state in _UP:  # (not when it was opened or removed during the sync)
                s.failures += 1
                s.last_error = error
                self._to_open(s, f"dropped from the sync to version {sync.version}")
        if not sync.pending and self._sync is sync:
            self._sync_over(sync)
        self._changed.notify_all()

    def _sync_over(self, sync: _SyncRecord) -> None:
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

    def _readmit_due(self, now: float, members=None) -> list:
        work = []
        for s in self._members if members is None else members:
            if s.state == OPEN and s.reopen_at <= now and _is_dead(s.gen):  # it died for good meanwhile
                self._remove(s, "found dead at re-admission")
            elif s.state == OPEN and s.reopen_at <= now and not s.loading and s.inflight == 0:
                self._set_state(s, READMITTING)
                s.loading = True
                self._note(s, "readmitting", f"after {s.opened} opening(s)")
                work.append((self._readmit_start, s, None))
        return work

    def _readmit_start(self, s: _Member, _) -> None:
        if s.gen.policy_version < self._version and self._weights is not None:
            threading.Thread(target=self._readmit, args=(s,), name=f"readmit-{s.name}", daemon=True).start()
        else:
            self._readmit(s)

    def _readmit(self, s: _Member) -> None:
        """Re-sync a stale generator, then half-open (``mark_healthy``: closed); the reference's rules."""
        while True:
            with self._lock:
                version, weights = self._version, self._weights
            have = s.gen.policy_version
            error = None
            if have < version and weights is not None:
                with self._lock:
                    s.readmit_deadline = self._clock.now() + self.sync_timeout_s
                    self._schedule(s.readmit_deadline)
                error = _load(s.gen, weights, version)
            elif have < version and have < s.floor:
                error = RuntimeError(f"{s.name} reports version {have}, below its floor {s.floor}, and no "
                                     f"weights were synced yet to load into it")
            with self._lock:
                s.readmit_deadline = math.inf
                if s.state == READMITTING and error is None and self._version != version:
                    continue  # a sync landed meanwhile: load that one too
                s.loading = False
                if s.state != READMITTING:  # the clock opened it: the load came too late
                    work = self._readmit_due(self._clock.now()) + self._pump()
                elif error is not None:
                    s.failures += 1
                    s.last_error = error
                    self._to_open(s, f"re-admission failed: {error!r}")
                    work = self._pump()
                else:
                    if version > s.floor or have < s.floor:
                        s.floor = version
                        self._note(s, "resynced", f"to version {version}")
                    if s.close_on_return:
                        self._to_closed(s)
                    else:
                        self._set_state(s, HALF_OPEN)
                        self._note(s, "half_open", "one probe request decides")
                    work = self._join_sync(s) + self._pump()
            self._run(work)
            return

    def _join_sync(self, s: _Member) -> list:
        """Back in rotation while a sync is under way: one of its targets now (the reference's rule:
        its loads never overlap, the last sync wins)."""
        sync = self._sync
        if sync is None:
            return []
        if s not in sync.targets:
            sync.targets.append(s)
        sync.errors.pop(s.name, None)
        sync.pending[s] = turn = object()
        s.draining, s.loading = sync.mode == "drain", sync.mode == "hot_swap"
        return [(self._start_load, s, (sync, turn))]

    def _start_load(self, s: _Member, sync_turn: tuple) -> None:
        threading.Thread(target=self._sync_one, args=(s, *sync_turn), name=f"load-{s.name}", daemon=True).start()

    # ------------------------------------------------------------------ doing (outside the lock)

    def _run(self, work) -> None:
        local = self._local
        pending = getattr(local, "pending", None)
        if pending is not None:  # this thread is already working through a list: add to it
            pending.extend(work)
            return
        local.pending = pending = deque(work)
        try:
            while pending:
                fn, a, b = pending.popleft()
                fn(a, b)
        finally:
            local.pending = None

    def _dispatch(self, attempt: _Attempt, _) -> None:
        s = attempt.member
        gen = s.gen
        have = gen.policy_version
        if have < attempt.floor or _is_dead(gen):  # refused: it has nothing right to serve
            exc = RuntimeError(f"{s.name} is dead for good" if _is_dead(gen) else
                               f"{s.name} reports version {have}, below the {attempt.floor} it was "
                               f"admitted with: it lost its weights (restarted?)")
            with self._lock:
                work = self._end(attempt, None, exc, True, True)
            self._run(work)
            return
        try:
            fut = gen.submit(attempt.ticket.request)
            if not isinstance(fut, Future):
                raise RuntimeError(f"{s.name}.submit returned {type(fut).__name__}, not a Future")
        except Exception as exc:  # noqa: BLE001 - ValueError / TypeError: the request's fault; else the generator's
            with self._lock:
                work = self._end(attempt, None, exc, not isinstance(exc, (ValueError, TypeError)))
            self._run(work)
        else:
            attempt.future = fut
            fut.add_done_callback(attempt)

    def _settled(self, attempt: _Attempt, fut: Future) -> None:
        try:  # one look at the future in the common case
            completion, exc = fut.result(), None
        except CancelledError as exc_:
            mine = fut.cancelled()  # (not an engine that failed it with a CancelledError of its own)
            completion, exc = None, CancelledError(f"{attempt.member.name} cancelled the request") if mine else exc_
        except Exception as exc_:  # noqa: BLE001 - whatever the engine failed with
            completion, exc = None, exc_
        with self._lock:  # a ValueError / TypeError is the engine refusing this request: not its fault
            work = self._end(attempt, completion, exc, not isinstance(exc, (ValueError, TypeError)))
        # Inside a work list, so a user callback that submits again from there appends to it
        # instead of nesting one call deeper per request.
        self._run(work)

    def _note(self, s, event: str, detail: str) -> None:
        self._events.append((self._clock.now(), None if s is None else s.name, event, detail))

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


def _load(gen, state_dict, version: int):
    """``gen.load_weights`` (outside the lock): the error, or None."""
    try:
        gen.load_weights(state_dict, version)
        if gen.policy_version != version:
            raise RuntimeError(f"{gen.name}.load_weights(version={version}) returned but its "
                               f"policy_version is {gen.policy_version}")
    except Exception as exc:  # noqa: BLE001 - any failure of the engine's load takes it out
        return exc
    return None


def _check_generators(generators: list) -> None:
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


def _is_dead(gen) -> bool:
    """A generator's optional ``dead`` attribute (GeneratorProtocol): true once it can never serve again."""
    return getattr(gen, "dead", False) is True


def _check_request(request, what: str = "request") -> None:
    """Every field the router reads or hands to a generator, whoever built the request (the reference's rules)."""
    try:
        hash(request.session_id)  # the policy hashes it under the lock
        prompt, sampling, request_id = request.prompt_token_ids, request.sampling, request.request_id
    except AttributeError as exc:
        raise TypeError(f"{what} must be a Request, got {type(request).__name__} (no {exc.name})") from None
    except TypeError:
        raise TypeError(f"{what}.session_id must be hashable, got {type(request.session_id).__name__}") from None
    if not isinstance(prompt, list):
        raise TypeError(f"{what}.prompt_token_ids must be a list of ints (token ids), got {type(prompt).__name__}")
    try:
        array.array("Q", prompt)  # ints >= 0 (0.7 us for 64 tokens: a third of min(map(operator.index, ...)))
    except TypeError:
        bad = next(t for t in prompt if not _is_index(t))
        raise TypeError(f"{what}.prompt_token_ids must hold ints (token ids), got {type(bad).__name__}") from None
    except OverflowError:
        raise ValueError(f"{what}.prompt_token_ids must be token ids >= 0, got {min(prompt)}") from None
    if not prompt:
        raise ValueError(f"{what}.prompt_token_ids must hold at least one token, got an empty prompt")
    try:  # the common case in one expression (what _check_sampling accepts); the table names the field otherwise
        n, t, k, top_p, stops, seed, samples = (sampling.max_new_tokens, sampling.temperature, sampling.top_k,
                                                sampling.top_p, sampling.stop_token_ids, sampling.seed, sampling.n)
        ok = (type(n) is int and n >= 1 and type(k) is int and k >= 0 and type(t) in (float, int) and t >= 0
              and type(top_p) in (float, int) and 0 < top_p <= 1 and type(samples) is int and samples >= 1
              and (seed is None or type(seed) is int and -2 ** 63 <= seed <= 2 ** 64 - samples)
              and (stops == () or (type(stops) is tuple and all(type(i) is int and i >= 0 for i in stops))))
    except AttributeError:
        ok = False
    if not ok:
        _check_sampling(sampling, f"{what}.sampling.")
    if not isinstance(request_id, str):
        raise TypeError(f"{what}.request_id must be a str, got {type(request_id).__name__}")


def _seconds(name: str, value, zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be a number of seconds {'>= 0' if zero else '> 0 (math.inf: none)'}, "
                         f"got {value!r}")
    return float(value)


# ============================================================================= the fleet on Ray

def ray_generators(make_generator, n: int, *, name_prefix: str = "ray-gen", max_restarts: int = 8,
                   num_cpus: float = 1.0, num_gpus: float = 0.0, actor_options: dict | None = None,
                   call_timeout_s: float = 300.0, startup_timeout_s: float = 600.0,
                   connect_timeout_s: float = 30.0, ray_init_options: dict | None = None,
                   weight_transport=None) -> list:
    """Start ``n`` Ray actors, each serving ``make_generator()``; return n protocol handles.

    ``make_generator`` is a picklable zero-argument callable that builds an engine (anything with
    the protocol; its ``config.vocab_size`` / ``config.max_seq_len``, when present, let ``submit``
    refuse bad input at once).  Actors restart on death up to ``max_restarts`` times (-1: forever);
    Ray does not retry their calls (the router retries requests elsewhere).  ``actor_options`` are
    passed to ``ActorClass.options`` (e.g. ``scheduling_strategy``, ``runtime_env``,
    ``resources``).  ``call_timeout_s`` bounds a handle's ``load_weights``; ``startup_timeout_s`` the
    wait for every engine to be built.
    Ray: the instance this process already joined (``ray.init(address=...)`` first, to use a
    cluster); else the one ``RAY_ADDRESS`` names, which must answer within ``connect_timeout_s``
    (ConnectionError otherwise: ``ray.init`` alone retries a dead address for many minutes;
    ``RAY_ADDRESS=auto`` goes to ``ray.init`` unchecked); else a
    new local instance (``address="local"``: never one a stale session file of Ray's temp directory
    names).  ``ray_init_options`` go to that ``ray.init`` call.
    ``weight_transport``: a trainer-side sender (fast/weight_sync.py's ``WeightSender``): loads go through
    its process groups instead of the object store (module docstring, "collective").
    Each handle has ``name``, ``policy_version``, ``submit``, ``load_weights``, ``dead`` (true once
    Ray reports the actor dead for good: out of restarts, or killed), ``pid`` and ``node_id`` of its
    actor's process (after a restart: refreshed on the first reply), ``weights_path`` ("collective" or
    "object_store", with ``transport_error`` saying why not collective) and ``close()`` (kills it).
    """
    ray = _ray()
    if not _is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not callable(make_generator):
        raise TypeError(f"make_generator must be a zero-argument callable, got {type(make_generator).__name__}")
    if not _is_int(max_restarts) or max_restarts < -1:
        raise ValueError(f"max_restarts must be an int >= -1 (-1: forever), got {max_restarts!r}")
    call_timeout_s = _seconds("call_timeout_s", call_timeout_s)
    startup_timeout_s = _seconds("startup_timeout_s", startup_timeout_s)
    connect_timeout_s = _seconds("connect_timeout_s", connect_timeout_s)
    for method in ("receiver", "header", "send"):
        if weight_transport is not None and not callable(getattr(weight_transport, method, None)):
            raise TypeError(f"weight_transport must have {method}() (fast/weight_sync.py's WeightSender), got "
                            f"{type(weight_transport).__name__}")
    if not ray.is_initialized():
        _start_ray(connect_timeout_s, ray_init_options or {})
    options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts, max_task_retries=0,
                   scheduling_strategy="SPREAD", max_concurrency=1000)
    options.update(actor_options or {})
    actor_class = ray.remote(_EngineActor)
    names = [f"{name_prefix}{i}" for i in range(n)]
    receivers = [None if weight_transport is None else weight_transport.receiver(name) for name in names]
    actors = [actor_class.options(**options).remote(make_generator, r) for r in receivers]
    try:
        infos = ray.get([a.describe.remote() for a in actors], timeout=startup_timeout_s)
    except Exception:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise
    store = _WeightStore()
    return [_RayGenerator(name, actor, info, store, call_timeout_s, weight_transport)
            for name, actor, info in zip(names, actors, infos)]


def _ray():
    """The ray module, imported at first use: only the Ray fleet needs it, so this file imports with
    torch alone (the one place it is imported)."""
    try:
        import ray
    except ImportError:
        raise ImportError("ray_generators needs ray (pip install 'ray>=2.40'); the router itself does not") from None
    return ray


def _start_ray(timeout_s: float, options: dict) -> None:
    """Join the Ray instance RAY_ADDRESS names, once it answers within ``timeout_s``; else start a
    local one.  Never ``ray.init()`` bare: it follows Ray's session file to the last cluster this
    machine joined, and retries one that is gone for many minutes."""
    import os
    import socket
    ray = _ray()
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address in ("", "local"):
        ray.init(address="local", **{"include_dashboard": False, **options})
        return
    if address == "auto":  # whatever Ray finds on this machine: asked for, so not second-guessed (nor bounded)
        ray.init(address="auto", **options)
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"RAY_ADDRESS={address} did not answer within {timeout_s:g} s ({exc}); unset it to "
                              f"start a local Ray instance, or call ray.init(address=...) first") from None
    ray.init(address=address, **options)


class _EngineActor:
    """What runs inside each Ray actor (an async actor: one event loop awaits many requests)."""

    def __init__(self, make_generator, weight_receiver=None):
        import os
        self.engine = make_generator()
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"  # a new one after every restart
        self.transport_error = None if weight_receiver is not None else "no weight_transport"
        if weight_receiver is not None:    # every rank joins the trainer's channels (again, after a restart)
            try:
                self.engine.connect_weights(weight_receiver)
            except Exception as exc:  # noqa: BLE001 - the object store is the fallback; describe says why
                self.transport_error = f"{type(exc).__name__}: {exc}"

    async def describe(self) -> dict:
        import os
        ray = _ray()
        config = getattr(self.engine, "config", None)
        return dict(incarnation=self.incarnation, version=self.engine.policy_version, pid=os.getpid(),
                    node_id=ray.get_runtime_context().get_node_id(),
                    vocab_size=getattr(config, "vocab_size", None), max_seq_len=getattr(config, "max_seq_len", None),
                    transport_error=self.transport_error)

    async def generate(self, request) -> tuple:
        """(incarnation, the completion's fields), or for a group (sampling.n > 1) a list of them."""
        import asyncio
        result = await asyncio.wrap_future(self.engine.submit(request))  # a cancelled call cancels the engine's
        samples = [(c.request_id, c.prompt_token_ids, c.token_ids, c.logprobs, c.finish_reason,   # future
                    c.min_policy_version, c.max_policy_version, getattr(c, "sample_index", 0))
                   for c in (result if isinstance(result, list) else [result])]
        return (self.incarnation, samples if isinstance(result, list) else samples[0])

    async def load(self, packed: tuple, version: int) -> tuple:
        import asyncio
        tensors = _unpack_weights(packed)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.load_weights, tensors, version)
        return self.incarnation, self.engine.policy_version

    async def receive(self, version: int, header: dict) -> tuple:
        """A collective load: every rank of the engine receives its shard from the trainer's sender."""
        import asyncio
        import functools
        if self.transport_error is not None:
            raise RuntimeError(f"this actor has no weight receiver: {self.transport_error}")
        receive = functools.partial(self.engine.receive_weights, version, header=header)
        await asyncio.get_running_loop().run_in_executor(None, receive)
        return self.incarnation, self.engine.policy_version


class _WeightStore:
    """Each version goes into Ray's object store once; every handle's load_weights sends that reference."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key, self._ref = None, None  # (version, id of the state dict): the object it was put as

    def ref(self, state_dict, version: int):
        ray = _ray()
        with self._lock:
            if self._key != (version, id(state_dict)):
                self._ref = None  # the old version's object can go
                self._ref = ray.put(_pack_weights(state_dict))
                self._key = (version, id(state_dict))
            return self._ref


def _pack_weights(state_dict: Mapping) -> tuple:
    """A state dict as (meta, one flat uint8 array): zero-copy for readers on the same node.
    meta = [(name, dtype, shape, byte offset)]; offsets 64-byte aligned so every view is aligned."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    meta, offset = [], 0
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // 64) * 64
    flat = torch.empty(offset, dtype=torch.uint8)
    for (_, _, _, start), t in zip(meta, state_dict.values()):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)  # (contiguous: no copy when it already is)
        flat[start:start + raw.numel()].copy_(raw)  # from any device: one copy to host
    return meta, flat.numpy()


def _cause(exc):
    """The exception an actor raised, without Ray's remote traceback around it."""
    return getattr(exc, "cause", None) or exc


def _unpack_weights(packed: tuple) -> dict:
    """Views of the flat buffer (read-only when it maps the object store: the engine copies them in)."""
    import warnings
    meta, array = packed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: nothing writes to it
        flat = torch.from_numpy(array)
    out = {}
    for name, dtype, shape, start in meta:
        dtype = getattr(torch, dtype)
        size = math.prod(shape) * dtype.itemsize
        out[name] = flat[start:start + size].view(dtype).view(shape)
    return out


class _RayGenerator:
    """A Ray actor behind ``GeneratorProtocol`` (made by ``ray_generators``)."""

    _ASK_AGAIN_S = 0.5  # while Ray restarts the actor, ask what it is this often

    def __init__(self, name: str, actor, info: dict, store: _WeightStore, call_timeout_s: float, transport=None):
        self.name, self._actor, self._store, self._call_timeout_s = name, actor, store, call_timeout_s
        self._transport = transport
        self._lock = threading.Lock()
        self._incarnation, self._version = info["incarnation"], info["version"]
        self.pid, self.node_id = info["pid"], info["node_id"]
        self._vocab, self._max_seq_len = info["vocab_size"], info["max_seq_len"]
        self.transport_error = info["transport_error"]
        self._dead = False

    @property
    def weights_path(self) -> str:
        """How the actor's process (as last heard) loads weights: "collective" or "object_store"."""
        return "collective" if self.transport_error is None else "object_store"

    @property
    def policy_version(self) -> int:
        """What the actor's engine holds, as last heard; -1 after its process died, until the new one
        is heard from."""
        return self._version

    @property
    def dead(self) -> bool:
        """True once Ray reports the actor dead for good (out of restarts, or killed): the router
        removes it from the fleet."""
        return self._dead

    def submit(self, request) -> Future:
        _check_request(request)  # (the router checked it too; a handle may be called alone)
        prompt = request.prompt_token_ids
        if self._vocab is not None and max(prompt) >= self._vocab:
            raise ValueError(f"prompt_token_ids must be token ids in [0, {self._vocab}), got {max(prompt)}")
        if self._max_seq_len is not None and len(prompt) >= self._max_seq_len:
            raise ValueError(f"prompt_token_ids: a prompt of {len(prompt)} tokens leaves no room to generate in "
                             f"a context of max_seq_len={self._max_seq_len}")
        future = Future()
        ref = self._actor.generate.remote(request)
        future.add_done_callback(lambda f: self._cancel(ref) if f.cancelled() else None)
        ref.future().add_done_callback(lambda rf: self._reply(future, rf))
        return future

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        ray = _ray()
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        deadline = time.monotonic() + self._call_timeout_s
        while True:
            if self.weights_path == "collective" and self._version == -1:   # restarting: nobody to stream to yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: its actor was still restarting after "
                                       f"{self._call_timeout_s:g} s") from None
                time.sleep(0.2)
                continue
            try:
                left = max(0.0, deadline - time.monotonic())
                if self.weights_path == "collective":
                    incarnation, loaded = self._load_collective(state_dict, version, left)
                else:
                    ref = self._store.ref(state_dict, version)
                    incarnation, loaded = ray.get(self._actor.load.remote(ref, version), timeout=left)
                break
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"{self.name}: load_weights(version={version}) took over "
                                   f"{self._call_timeout_s:g} s") from None
            except ray.exceptions.ActorUnavailableError:  # restarting: a load can be tried again
                self._died()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: its actor was still restarting after "
                                       f"{self._call_timeout_s:g} s") from None
                time.sleep(0.2)
            except ray.exceptions.RayActorError as exc:
                self._died()
                raise RuntimeError(f"{self.name}: its actor died during load_weights: {type(exc).__name__}") from None
            except ray.exceptions.RayTaskError as exc:
                cause = _cause(exc)
                raise RuntimeError(f"{self.name}: load_weights failed in the actor: {type(cause).__name__}: "
                                   f"{cause}") from None
        self._heard(incarnation, loaded)

    def _load_collective(self, state_dict, version: int, left: float) -> tuple:
        """One call to the actor (the header) while this thread streams the buckets; the actor's answer
        decides (it verified every bucket), the sender's failure is raised after it."""
        ray = _ray()
        header = self._transport.header(self.name, version)
        ref = self._actor.receive.remote(version, header)
        box: dict = {}

        def push():
            try:
                self._transport.send(self.name, state_dict, version)
            except Exception as exc:  # noqa: BLE001 - reported below, after the actor's answer
                box["error"] = exc
        pusher = threading.Thread(target=push, name=f"send-{self.name}", daemon=True)
        pusher.start()
        try:
            result = ray.get(ref, timeout=left)
        finally:     # one stream per handle at a time: a failed call still waits for it (it ends by its timeout)
            pusher.join()
        if "error" in box:
            raise RuntimeError(f"{self.name}: the weight transport failed: {box['error']}")
        return result

    def close(self) -> None:
        """Kill the actor (no restart); its requests fail, the router retries them elsewhere."""
        ray = _ray()
        self._dead = True
        ray.kill(self._actor, no_restart=True)

    def _reply(self, future: Future, rf) -> None:
        ray = _ray()
        try:
            incarnation, *fields = rf.result()
        except ray.exceptions.RayActorError as exc:  # its process died (or Ray is restarting it)
            self._died()
            outcome = RuntimeError(f"{self.name}: its actor died: {type(exc).__name__}")
        except (ray.exceptions.TaskCancelledError, CancelledError):
            outcome = CancelledError(f"{self.name}: cancelled")
        except ray.exceptions.RayTaskError as exc:  # the engine raised inside the actor
            cause = _cause(exc)
            if isinstance(cause, (ValueError, TypeError)):  # it refused this request: the same type, so
                kind = TypeError if isinstance(cause, TypeError) else ValueError  # the router fails it alone
                outcome = kind(f"{cause} (refused by {self.name}'s engine)")
            else:
                outcome = RuntimeError(f"{self.name}: the engine failed the request: {type(cause).__name__}: {cause}")
        except Exception as exc:  # noqa: BLE001 - anything else Ray raises
            outcome = RuntimeError(f"{self.name}: {type(exc).__name__}: {exc}")
        else:
            self._heard(incarnation, None)
            (fields,) = fields
            if isinstance(fields, list):                 # a group's n samples
                outcome = [Completion(*f[:5], self.name, *f[5:]) for f in fields]
            else:
                outcome = Completion(*fields[:5], self.name, *fields[5:])
        try:
            if not isinstance(outcome, BaseException):
                future.set_result(outcome)
            else:
                future.set_exception(outcome)
        except InvalidStateError:  # the router cancelled it (deadline): nobody waits for it
            pass

    def _heard(self, incarnation: str, version: int | None) -> None:
        """A reply: a new incarnation means the actor restarted; learn what its engine holds."""
        with self._lock:
            if incarnation != self._incarnation:
                self._incarnation = incarnation
                self._version = -1 if version is None else version
                self._refresh()
            elif version is not None:
                self._version = version

    def _died(self) -> None:
        with self._lock:
            if self._version != -1:
                self._version = -1
                self._refresh()

    def _refresh(self) -> None:
        """Ask the (restarted) actor what it is; -1 meanwhile.  Ray answers ActorUnavailableError
        while it restarts the actor (ask again shortly: a fleet that never syncs gets its actor back
        with its construction weights) and ActorDiedError once it is dead for good (``dead``).  Under
        the lock."""
        ray = _ray()
        ref = self._actor.describe.remote()

        def on_info(rf):
            try:
                info = rf.result()
            except ray.exceptions.ActorDiedError:  # out of restarts, or killed: it never comes back
                self._dead = True
                return
            except Exception:  # noqa: BLE001 - restarting (ActorUnavailableError), or the reply was lost
                if not self._dead:
                    retry = threading.Timer(self._ASK_AGAIN_S, self._ask_again)
                    retry.daemon = True
                    retry.start()
                return
            with self._lock:
                if info["incarnation"] == self._incarnation:   # a reply or a load was heard first
                    self.pid, self.node_id = info["pid"], info["node_id"]
                    self.transport_error = info["transport_error"]
                    if self._version == -1:
                        self._version = info["version"]
                elif self._version == -1:                       # the first news of the new process
                    self._incarnation, self._version = info["incarnation"], info["version"]
                    self.pid, self.node_id = info["pid"], info["node_id"]
                    self.transport_error = info["transport_error"]
        ref.future().add_done_callback(on_info)

    def _ask_again(self) -> None:
        with self._lock:
            if self._version == -1 and not self._dead:
                self._refresh()

    def _cancel(self, ref) -> None:
        ray = _ray()
        try:
            ray.cancel(ref)
        except Exception:  # noqa: BLE001 - already finished, or the actor is gone
            pass
