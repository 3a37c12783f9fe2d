"""Routed generator: the fast version (cheap routing at high request rates).  Part 1: the router.

What it computes
    The same router as ``ref/routed_generator.py``, the specification, with the same data
    types, protocol, policies, queue order, failover, weight-sync modes and version stamps:
    on the same sequence of events both make the same decisions (``parity/`` drives both
    through one scripted sequence and compares every dispatch).  Several generators
    (inference engines) sit behind one router that spreads requests over them, retries a
    request elsewhere when a generator fails, and pushes trainer weights to every generator
    between or during generation.  Each completion carries the policy versions in force when
    its request was admitted and when it finished.

The rules (n generators; load(g) = requests dispatched to g whose futures have not settled)
    eligible(g)   healthy(g) and not draining(g) and (max_inflight is None or load(g) < max_inflight)
    round_robin   argmin over eligible g of last_chosen(g)
    least_loaded  argmin over eligible g of (load(g), last_chosen(g))
    power_of_two  i != j uniform over all n; the less loaded eligible one; least_loaded if neither
    sticky        pin[session_id] if eligible; least_loaded keeping the pin if only full;
                  least_loaded and re-pin otherwise (LRU of at most max_sessions sessions)
    queue         arrival order; a retried request keeps its place
    versions      min_policy_version at admission, max_policy_version at finish; drain => equal

What makes it cheap (costs per request, n generators)
    - No thread per request, none at rest: dispatch runs in the submitting thread and in the
      thread that settles a generator's future.
    - O(log n) choice: one binary heap of (load, last_chosen, index) (``(last_chosen, index)``
      for round_robin) with lazy invalidation: an entry is pushed whenever a generator's key
      changes or it becomes eligible again, and a popped entry whose key is stale or whose
      generator is not eligible is dropped.  The heap is rebuilt from the eligible generators
      when it holds more than 2n + 64 entries, so memory stays O(n).  power_of_two is O(1) plus the same
      heap as fallback; the reference scans all n generators per request.
    - The queue is a deque of fresh arrivals (already in arrival order) plus a small heap of
      retried requests, instead of one heap over everything; the common path with an empty
      queue does not touch either.
    - The sticky map is an LRU ``OrderedDict`` bounded by ``max_sessions``: O(1) per request,
      O(max_sessions) memory.
    - ``__slots__`` records, a healthy-generator counter instead of a scan, bound methods as
      future callbacks, and one lock acquisition on submit and one on completion.
    Measured by bench/routed_generator.py (router overhead per request against calling the
    generator directly, throughput at 1..64 generators, makespan / p99 per policy, staleness).

Data types (the same in ref and fast)
    SamplingParams  max_new_tokens int >= 1 (16), temperature float >= 0 (0 = greedy),
                    top_k int >= 0 (0 = off), top_p in (0, 1] (1 = off), stop_token_ids
                    tuple[int], seed int or None
    Request         prompt_token_ids list[int] (a 1-D integer tensor or any sequence of ints
                    is accepted), sampling SamplingParams, request_id str (filled with a
                    unique "req-<n>" when None), session_id hashable or None
    Completion      request_id str, prompt_token_ids list[int], token_ids list[int], logprobs
                    list[float], finish_reason "stop" | "length" | "abort", generator_id str,
                    min_policy_version int, max_policy_version int
    state_dict      Mapping[str, torch.Tensor], passed to load_weights untouched

Supported, and what raises
    As the reference: any number of generators >= 1 with unique names, many threads at once,
    no request lost or completed twice, ``RouterError`` listing every cause for a request no
    generator can serve, ValueError / TypeError from ``submit`` fail only that request.
    ValueError for an unknown policy or mode (naming the choices), an empty generator list,
    duplicate names, out-of-range max_inflight / max_retries / max_sessions, a version that
    does not increase; TypeError for an object lacking a protocol member, a request that is
    not a ``Request``, a version that is not an int.  Limits: no timeouts (a generator whose
    futures never settle stalls a drain); the request at the head of the queue can no longer
    be cancelled; a done-callback must not block on another router future or call
    ``sync_weights``.

References
    vLLM router / SGLang model-gateway policies; Mitzenmacher, The Power of Two Choices in
    Randomized Load Balancing (2001); PipelineRL (Piche et al., 2025) in-flight weight
    updates; AReaL / slime / verl trainer-to-rollout weight sync.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import operator
import random
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Protocol, runtime_checkable

import torch

__all__ = ["SamplingParams", "Request", "Completion", "GeneratorProtocol", "RouterError", "GeneratorRouter",
           "POLICIES", "SYNC_MODES"]

POLICIES = ("round_robin", "least_loaded", "sticky", "power_of_two")
SYNC_MODES = ("hot_swap", "drain")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- data types

@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.  Frozen: one instance may be shared by many requests."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a float >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        try:
            stops = tuple(operator.index(t) for t in self.stop_token_ids)
        except TypeError:
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}") from None
        if any(t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")


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


@runtime_checkable
class GeneratorProtocol(Protocol):
    """What the router needs from a generator (an inference engine), and nothing more.

    ``name: str``
        Unique among the generators of one router; constant.
    ``policy_version: int``
        The version of the weights it serves now.  Changes only inside ``load_weights``;
        never decreases.
    ``submit(request) -> concurrent.futures.Future[Completion]``
        Queues the request and returns at once (never blocks on generation).  Thread-safe,
        and callable from any thread, including from inside a done-callback of a future it
        returned: the router dispatches queued work there.  So an engine must never settle
        a future while it holds a lock that ``submit`` takes.  The future must settle
        eventually: a dead engine fails its futures.  ValueError / TypeError raised by
        ``submit`` mean the request can never be served (bad input); any other exception,
        or a future that fails or is cancelled, means the generator is broken.  The
        completion carries ``generator_id = name``, the request's id and prompt, and the
        versions in force when the request was admitted and when it finished.
    ``load_weights(state_dict, version) -> None``
        Blocking.  May be called while requests are in flight: the engine keeps serving and
        switches weights between decoding steps (a request running across the switch then
        has min_policy_version < max_policy_version).  When it returns, ``policy_version ==
        version`` and every request admitted afterwards uses the new weights.  Raises on
        failure.

    A wrapper around vLLM's ``LLMEngine`` is a few lines: ``submit`` adds the request and
    returns a Future that the engine's step loop settles; ``load_weights`` calls the engine's
    weight-update hook and then sets ``policy_version``.
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

class _Slot:
    """The router's record of one generator."""

    __slots__ = ("index", "gen", "name", "inflight", "dispatched", "completed", "failures", "healthy",
                 "draining", "last_error", "last_chosen")

    def __init__(self, index: int, gen, last_chosen: int):
        self.index, self.gen, self.name = index, gen, gen.name
        self.inflight = self.dispatched = self.completed = self.failures = 0
        self.healthy, self.draining = True, False
        self.last_error = None
        self.last_chosen = last_chosen


class _Ticket:
    """One request on its way through the router; ``on_done`` is the generator future's callback."""

    __slots__ = ("seq", "request", "future", "causes", "started", "slot", "router")

    def __init__(self, seq: int, request: Request, future: Future, router: GeneratorRouter):
        self.seq, self.request, self.future, self.router = seq, request, future, router
        self.causes = None  # a list once an attempt failed
        self.started = False
        self.slot = None

    def on_done(self, fut: Future) -> None:
        self.router._on_done(self, fut)


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


_UNCAPPED = sys.maxsize


# ----------------------------------------------------------------------------- the router

class GeneratorRouter:
    """Routes requests over generators; syncs their weights.  The contract is the reference's."""

    def __init__(self, generators, *, policy: str = "least_loaded", max_inflight: int | None = None,
                 max_retries: int = 2, max_sessions: int = 65536, seed: int | None = None):
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
        if not _is_int(max_retries) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if not _is_int(max_sessions) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")

        n = len(generators)
        self.policy, self.max_inflight, self.max_retries, self.max_sessions = policy, max_inflight, max_retries, max_sessions
        self._cap = _UNCAPPED if max_inflight is None else max_inflight
        self._rr = policy == "round_robin"
        self._slots = [_Slot(i, g, i - n) for i, g in enumerate(generators)]
        self._by_name = {s.name: s for s in self._slots}
        self._n_healthy = n
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._sync_lock = threading.Lock()
        self._fresh: deque[_Ticket] = deque()            # never-dispatched arrivals, in arrival order
        self._retry: list[tuple[int, _Ticket]] = []      # retried requests: min-heap on arrival number
        self._arrivals = itertools.count()
        self._tick = 0
        self._sessions: OrderedDict = OrderedDict()
        self._rng = random.Random(seed)
        self._version = max(g.policy_version for g in generators)
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

    def submit(self, request: Request) -> Future:
        """Route one request; the future resolves to its ``Completion`` (or a ``RouterError``)."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__}")
        try:
            hash(request.session_id)  # checked here: the policy hashes it under the lock
        except TypeError:
            raise TypeError(f"request.session_id must be hashable, got {type(request.session_id).__name__}") from None
        future = Future()
        with self._lock:
            ticket = _Ticket(next(self._arrivals), request, future, self)
            if self._fresh or self._retry or not self._n_healthy:
                self._fresh.append(ticket)
                work = self._pump()
                slot = None
            else:
                # The common case, _pump() on a queue holding only this ticket, inlined.
                ticket.started = True
                future.set_running_or_notify_cancel()  # nobody else holds it yet: cannot be cancelled
                slot = self._choose(request)
                if slot is None:
                    self._fresh.append(ticket)  # it waits at the head of the queue
                else:
                    self._reserve(slot)
                work = None
        if slot is not None:
            if getattr(self._local, "pending", None) is None:
                self._dispatch(ticket, slot)  # its callbacks open their own work list
            else:
                self._local.pending.append((self._dispatch, ticket, slot))
        elif work:
            self._run(work)
        return future

    def generate(self, requests) -> list[Completion]:
        """Submit every request, wait, return the completions in request order.

        Raises the first failure in request order (the other requests still complete)."""
        requests = list(requests)
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__}")
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, mode: str = "hot_swap") -> None:
        """Load ``state_dict`` as ``version`` into every generator, all in parallel.

        ``hot_swap``: generators keep serving while they load.  ``drain``: each generator
        stops receiving requests, finishes its in-flight ones, loads, returns to rotation.
        Serialized; ``version`` must increase; a failed load takes that generator out of
        rotation and raises ``RouterError`` once the others are done; a successful load
        brings an unhealthy generator back.  (The reference's docstring has the details.)
        """
        if mode not in SYNC_MODES:
            raise ValueError(f"mode must be one of {', '.join(SYNC_MODES)}; got {mode!r}")
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
        with self._sync_lock:
            with self._lock:
                if version <= self._version:
                    raise ValueError(f"version must increase: got {version}, the router already serves "
                                     f"version {self._version}")
                if mode == "drain":
                    for s in self._slots:
                        s.draining = True
            errors: dict = {}
            loaders = [threading.Thread(target=self._load_one, args=(s, state_dict, version, mode, errors),
                                        name=f"load-{s.name}", daemon=True) for s in self._slots]
            for t in loaders:
                t.start()
            for t in loaders:
                t.join()
            with self._lock:
                if len(errors) < len(self._slots):
                    self._version = version
            if errors:
                raise RouterError(f"weight sync to version {version} failed on {len(errors)} of "
                                  f"{len(self._slots)} generators (now out of rotation)",
                                  [(s.name, errors[s.name]) for s in self._slots if s.name in errors])

    def mark_healthy(self, name: str) -> None:
        """Put a generator back into rotation (after an operator fixed it)."""
        slot = self._slot(name)
        with self._lock:
            self._set_healthy(slot, True)
            work = self._pump()
        self._run(work)

    def stats(self) -> dict[str, dict]:
        """Per generator: dispatched, inflight, completed, failures, healthy, draining,
        policy_version, last_error (repr or None)."""
        with self._lock:
            out = {s.name: dict(dispatched=s.dispatched, inflight=s.inflight, completed=s.completed,
                                failures=s.failures, healthy=s.healthy, draining=s.draining,
                                last_error=None if s.last_error is None else repr(s.last_error))
                   for s in self._slots}
        for s in self._slots:
            out[s.name]["policy_version"] = s.gen.policy_version
        return out

    # ------------------------------------------------------------------ the heap (under the lock)

    def _key(self, s: _Slot) -> tuple:
        return (s.last_chosen, s.index) if self._rr else (s.inflight, s.last_chosen, s.index)

    def _push(self, s: _Slot) -> None:
        """Give an eligible generator an entry with its current key (the heap's invariant)."""
        if s.healthy and not s.draining and s.inflight < self._cap:
            heap = self._heap
            if len(heap) > 2 * len(self._slots) + 64:  # mostly stale entries: start over
                self._rebuild_heap()
            else:
                heapq.heappush(heap, (s.last_chosen, s.index) if self._rr else (s.inflight, s.last_chosen, s.index))

    def _rebuild_heap(self) -> None:
        cap = self._cap
        self._heap = [self._key(s) for s in self._slots if s.healthy and not s.draining and s.inflight < cap]
        heapq.heapify(self._heap)

    def _best(self) -> _Slot | None:
        """The eligible generator with the smallest key: drop stale or ineligible tops first."""
        heap, slots, cap = self._heap, self._slots, self._cap
        while heap:
            e = heap[0]
            s = slots[e[-1]]
            if s.healthy and not s.draining and s.inflight < cap and (
                    e[0] == s.last_chosen if self._rr else (e[0] == s.inflight and e[1] == s.last_chosen)):
                return s  # left in place: reserving it changes its key, so it goes stale
            heapq.heappop(heap)
        return None

    def _set_healthy(self, s: _Slot, healthy: bool) -> None:
        if s.healthy != healthy:
            s.healthy = healthy
            self._n_healthy += 1 if healthy else -1
            if healthy:
                self._push(s)

    # ------------------------------------------------------------------ choosing (under the lock)

    def _choose(self, request: Request) -> _Slot | None:
        policy = self.policy
        if policy == "least_loaded" or policy == "round_robin":
            return self._best()
        cap = self._cap
        if policy == "power_of_two":
            slots = self._slots
            n = len(slots)
            if n == 1:
                a = b = slots[0]
            else:
                i = self._rng.randrange(n)
                j = self._rng.randrange(n - 1)
                j += j >= i
                a, b = slots[i], slots[j]
            ok_a = a.healthy and not a.draining and a.inflight < cap
            ok_b = b.healthy and not b.draining and b.inflight < cap
            if ok_a and ok_b:
                return a if (a.inflight, a.last_chosen) < (b.inflight, b.last_chosen) else b
            if ok_a or ok_b:
                return a if ok_a else b
            return self._best()
        # sticky
        sid = request.session_id
        if sid is None:
            return self._best()
        sessions = self._sessions
        pinned = sessions.get(sid)
        if pinned is not None and pinned.healthy and not pinned.draining:
            sessions.move_to_end(sid)
            return pinned if pinned.inflight < cap else self._best()
        chosen = self._best()
        if chosen is not None:
            sessions[sid] = chosen
            sessions.move_to_end(sid)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        return chosen

    def _pump(self) -> list:
        """Dispatch queued requests in arrival order while a generator is eligible."""
        work = []
        fresh, retry = self._fresh, self._retry
        while fresh or retry:
            from_retry = bool(retry) and (not fresh or retry[0][0] < fresh[0].seq)
            ticket = retry[0][1] if from_retry else fresh[0]
            if not ticket.started:  # only fresh tickets are not started
                ticket.started = True
                if not ticket.future.set_running_or_notify_cancel():
                    fresh.popleft()
                    continue
            if not self._n_healthy:
                self._fail_all(work)
                break
            slot = self._choose(ticket.request)
            if slot is None:
                break
            if from_retry:
                heapq.heappop(retry)
            else:
                fresh.popleft()
            self._reserve(slot)
            work.append((self._dispatch, ticket, slot))
        return work

    def _reserve(self, s: _Slot) -> None:
        """Count the request against the generator before it is dispatched."""
        s.inflight += 1
        s.dispatched += 1
        self._tick += 1
        s.last_chosen = self._tick
        self._push(s)

    def _fail_all(self, work: list) -> None:
        """No healthy generator: every queued request fails, in arrival order."""
        causes = [(s.name, s.last_error) for s in self._slots if s.last_error is not None]
        tickets = sorted(list(self._fresh) + [t for _, t in self._retry], key=lambda t: t.seq)
        self._fresh.clear()
        self._retry.clear()
        for t in tickets:
            if not t.started:
                t.started = True
                if not t.future.set_running_or_notify_cancel():
                    continue
            work.append((_set_exception, t.future, RouterError(
                f"request {t.request.request_id} failed: no healthy generator left", (t.causes or []) + causes)))

    # ------------------------------------------------------------------ doing (outside the lock)

    def _run(self, work: list) -> None:
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

    def _dispatch(self, ticket: _Ticket, slot: _Slot) -> None:
        try:
            fut = slot.gen.submit(ticket.request)
            if not isinstance(fut, Future):
                raise RuntimeError(f"{slot.name}.submit returned {type(fut).__name__}, not a Future")
        except (ValueError, TypeError) as exc:  # the request's fault: fail it, keep the generator
            with self._lock:
                self._release(slot)
                work = [(_set_exception, ticket.future, exc)] + self._pump()
            self._run(work)
        except Exception as exc:
            self._settle_failure(ticket, slot, exc)
        else:
            ticket.slot = slot
            fut.add_done_callback(ticket.on_done)

    def _release(self, s: _Slot) -> None:
        s.inflight -= 1
        if s.draining:
            if s.inflight == 0:
                self._drained.notify_all()
        elif not self._rr or s.inflight == self._cap - 1:  # key changed, or it was full and has room again
            self._push(s)

    def _on_done(self, ticket: _Ticket, fut: Future) -> None:
        slot = ticket.slot
        try:
            completion = fut.result()
        except CancelledError as exc:
            self._settle_failure(ticket, slot, CancelledError(f"{slot.name} cancelled the request")
                                 if fut.cancelled() else exc)
            return
        except Exception as exc:
            self._settle_failure(ticket, slot, exc)
            return
        work = [(_set_result, ticket.future, completion)]
        with self._lock:
            self._release(slot)
            slot.completed += 1
            if self._fresh or self._retry:
                work += self._pump()
        # Inside a work list, so a user callback that submits again from there appends to it
        # instead of nesting one call deeper per request.
        self._run(work)

    def _settle_failure(self, ticket: _Ticket, slot: _Slot, exc: BaseException) -> None:
        with self._lock:
            self._release(slot)
            slot.failures += 1
            self._set_healthy(slot, False)
            slot.last_error = exc
            if ticket.causes is None:
                ticket.causes = []
            ticket.causes.append((slot.name, exc))
            if len(ticket.causes) > self.max_retries:
                work = [(_set_exception, ticket.future, RouterError(
                    f"request {ticket.request.request_id} failed after {len(ticket.causes)} attempts",
                    ticket.causes))]
            else:
                heapq.heappush(self._retry, (ticket.seq, ticket))
                work = []
            work += self._pump()
        self._run(work)

    def _load_one(self, slot: _Slot, state_dict, version: int, mode: str, errors: dict) -> None:
        if mode == "drain":
            with self._drained:
                self._drained.wait_for(lambda: slot.inflight == 0)
        error = None
        try:
            slot.gen.load_weights(state_dict, version)
            if slot.gen.policy_version != version:
                raise RuntimeError(f"{slot.name}.load_weights(version={version}) returned but its "
                                   f"policy_version is {slot.gen.policy_version}")
        except Exception as exc:
            error = exc
        with self._lock:
            slot.draining = False
            if error is None:
                self._set_healthy(slot, True)
                self._push(slot)  # back from draining (a duplicate entry is harmless)
            else:
                errors[slot.name] = error
                slot.failures += 1
                self._set_healthy(slot, False)
                slot.last_error = error
            work = self._pump()
        self._run(work)

    def _slot(self, name: str) -> _Slot:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise ValueError(f"name must be one of {', '.join(self._by_name)}; got {name!r}") from None
