"""Routed generator: the reference (readable Python, the specification).  Part 1: the router.

What it computes
    The serving side of RL rollouts: several generators (inference engines) behind one
    router that spreads requests over them, retries a request elsewhere when a generator
    fails, and pushes trainer weights to every generator between or during generation.
    Every completion says which weights produced it: the policy versions in force when the
    request was admitted and when it finished.  The router talks to a generator only
    through ``GeneratorProtocol`` (four members), so any engine (this file's own, or a vLLM
    or SGLang engine wrapped in a few lines) can sit behind it.

The rules (n generators; load(g) = requests the router has dispatched to g whose futures
have not settled, reserved before ``submit`` and released when the future settles)
    eligible(g)   healthy(g) and not draining(g) and (max_inflight is None or load(g) < max_inflight)
    round_robin   argmin over eligible g of last_chosen(g): a fixed cycle while every
                  generator is eligible; one that was skipped (full, draining) goes first
                  when it comes back
    least_loaded  argmin over eligible g of (load(g), last_chosen(g)): ties go to the least
                  recently chosen
    power_of_two  draw i != j uniformly from all n; the less loaded (same key) of those two
                  that are eligible; least_loaded when neither is
    sticky        pin[session_id] when it is eligible; least_loaded (keeping the pin) when it is
                  only full; least_loaded and re-pin when it is unhealthy or draining or the
                  session is new.  The pin map is an LRU of at most ``max_sessions`` sessions.
                  A request without a session_id goes least_loaded.
    queue         a request that finds no eligible generator waits in the router's queue;
                  queued requests leave in arrival order (a retried request keeps its place)
    failure       submit raising (other than ValueError/TypeError) or its future failing marks
                  the generator unhealthy and re-queues the request, at most max_retries times
    versions      min_policy_version = version in force at admission, max_policy_version =
                  version at finish; drain => min == max; staleness = max - min

Data types (the same in ref and fast)
    SamplingParams  max_new_tokens int >= 1 (16), temperature float >= 0 (0 = greedy),
                    top_k int >= 0 (0 = off), top_p in (0, 1] (1 = off), stop_token_ids
                    tuple[int], seed int or None
    Request         prompt_token_ids list[int] (a 1-D integer tensor or any sequence of ints
                    is accepted, stored as list[int]), sampling SamplingParams, request_id str
                    (filled with a unique "req-<n>" when None), session_id hashable or None
    Completion      request_id str, prompt_token_ids list[int], token_ids list[int], logprobs
                    list[float] (one per generated token), finish_reason "stop" | "length" |
                    "abort", generator_id str (the generator's name), min_policy_version int,
                    max_policy_version int
    state_dict      Mapping[str, torch.Tensor], passed to load_weights untouched

Supported, and what raises
    Any number of generators >= 1 with unique names; many threads may call ``submit``,
    ``generate``, ``sync_weights``, ``mark_healthy`` and ``stats`` at once.  The router has no
    thread of its own: it dispatches in the calling thread and in the threads that settle
    generator futures; ``sync_weights`` runs one loader thread per generator for its duration.
    No request is lost or completed twice: a request is re-dispatched only after its previous
    attempt failed, and its future is settled exactly once.  A request that no generator can
    serve (retries exhausted, or every generator unhealthy) fails with ``RouterError`` listing
    every cause.  ValueError / TypeError from ``submit`` are the request's fault (bad input):
    that request fails with that error and the generator stays in rotation.
    Raises ValueError for an unknown policy or mode (naming the choices), an empty generator
    list, duplicate names, max_inflight / max_retries / max_sessions out of range, a version
    that does not increase; TypeError for an object that lacks a protocol member, a request
    that is not a ``Request``, a version that is not an int.
    Limits: a generator whose futures never settle (neither result nor error) is not detected
    (there are no timeouts) and stalls a drain; the request at the head of the queue can no
    longer be cancelled; a done-callback of a router future runs in the thread that settled
    it and must not block on another router future or call ``sync_weights``.

References
    vLLM router / SGLang model-gateway policies (round robin, least-loaded, cache-aware
    stickiness, power of two); Mitzenmacher, The Power of Two Choices in Randomized Load
    Balancing (2001); PipelineRL (Piche et al., 2025) in-flight weight updates; AReaL / slime /
    verl weight sync between trainer and rollout engines.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import operator
import random
import threading
from collections import OrderedDict, deque
from concurrent.futures import CancelledError, Future, InvalidStateError
from collections.abc import Hashable, Iterable, Mapping
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

    def __init__(self, index: int, gen, last_chosen: int):
        self.index, self.gen, self.name = index, gen, gen.name
        self.inflight = 0          # the load: reserved before submit, released when the future settles
        self.dispatched = self.completed = self.failures = 0
        self.healthy, self.draining = True, False
        self.last_error: BaseException | None = None
        self.last_chosen = last_chosen  # the router's tick when it was last chosen


class _Ticket:
    """One request on its way through the router (it keeps its arrival number across retries)."""

    def __init__(self, seq: int, request: Request, future: Future):
        self.seq, self.request, self.future = seq, request, future
        self.causes: list[tuple[str, BaseException]] = []
        self.started = False  # the user can no longer cancel it


# ----------------------------------------------------------------------------- the router

class GeneratorRouter:
    """Routes requests over generators; syncs their weights.  See the module docstring.

    All book-keeping happens under one lock; generator calls and user-future callbacks run
    outside it.  Work found under the lock (dispatch a request, settle a user future) goes
    to a per-thread work list, so a generator that settles futures synchronously inside
    ``submit`` does not make the dispatch recurse.
    """

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
        # Initial ticks -n..-1: never-chosen generators count as chosen long ago, in list order.
        self._slots = [_Slot(i, g, i - n) for i, g in enumerate(generators)]
        self._by_name = {s.name: s for s in self._slots}
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)  # notified when a draining generator's load hits 0
        self._sync_lock = threading.Lock()                # serializes sync_weights
        self._queue: list[tuple[int, _Ticket]] = []      # min-heap on arrival number
        self._arrivals = itertools.count()
        self._tick = 0
        self._sessions: OrderedDict[Hashable, _Slot] = OrderedDict()  # LRU: oldest first
        self._rng = random.Random(seed)
        self._version = max(g.policy_version for g in generators)
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
            ticket = _Ticket(next(self._arrivals), request, future)
            heapq.heappush(self._queue, (ticket.seq, ticket))
            work = self._pump()
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

        ``hot_swap``: generators keep serving while they load (a completion may span two
        versions and says so).  ``drain``: each generator stops receiving requests, its
        in-flight requests finish, it loads, it returns to rotation (no completion spans two
        versions).  Concurrent calls run one after another; ``version`` must be larger than
        every version synced before.  A generator whose load fails (or that does not report
        ``version`` afterwards) leaves the rotation and this raises ``RouterError`` once the
        others are done; every generator left in rotation then serves ``version``.  A
        successful load brings an unhealthy generator back.
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
                if mode == "drain":  # all at once, so no request slips in between two generators
                    for s in self._slots:
                        s.draining = True
            errors: dict[str, BaseException] = {}
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
            slot.healthy = True
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
        for s in self._slots:  # read outside the lock: it may be a property behind the engine's own lock
            out[s.name]["policy_version"] = s.gen.policy_version
        return out

    # ------------------------------------------------------------------ choosing (under the lock)

    def _eligible(self, s: _Slot) -> bool:
        return s.healthy and not s.draining and (self.max_inflight is None or s.inflight < self.max_inflight)

    def _least_loaded(self) -> _Slot | None:
        return min((s for s in self._slots if self._eligible(s)),
                   key=lambda s: (s.inflight, s.last_chosen), default=None)

    def _choose(self, request: Request) -> _Slot | None:
        """The generator for this request now, or None when none is eligible (it waits)."""
        if self.policy == "round_robin":
            return min((s for s in self._slots if self._eligible(s)), key=lambda s: s.last_chosen, default=None)
        if self.policy == "least_loaded":
            return self._least_loaded()
        if self.policy == "power_of_two":
            n = len(self._slots)
            if n == 1:
                pair = self._slots
            else:
                i = self._rng.randrange(n)
                j = self._rng.randrange(n - 1)
                j += j >= i  # j uniform over the others
                pair = [self._slots[i], self._slots[j]]
            pair = [s for s in pair if self._eligible(s)]
            if not pair:
                return self._least_loaded()
            return min(pair, key=lambda s: (s.inflight, s.last_chosen))
        # sticky
        sid = request.session_id
        if sid is None:
            return self._least_loaded()
        pinned = self._sessions.get(sid)
        if pinned is not None and pinned.healthy and not pinned.draining:
            self._sessions.move_to_end(sid)
            return pinned if self._eligible(pinned) else self._least_loaded()  # full: elsewhere this once
        chosen = self._least_loaded()
        if chosen is not None:  # new session, or its generator is gone or draining: re-pin
            self._sessions[sid] = chosen
            self._sessions.move_to_end(sid)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return chosen

    def _pump(self) -> list:
        """Dispatch queued requests in arrival order while a generator is eligible.

        Returns the work to do outside the lock.  When no generator is healthy, every
        queued request fails (nothing could ever serve it)."""
        work = []
        while self._queue:
            ticket = self._queue[0][1]
            if not ticket.started:
                ticket.started = True
                if not ticket.future.set_running_or_notify_cancel():  # the user cancelled it
                    heapq.heappop(self._queue)
                    continue
            if not any(s.healthy for s in self._slots):
                causes = [(s.name, s.last_error) for s in self._slots if s.last_error is not None]
                while self._queue:
                    t = heapq.heappop(self._queue)[1]
                    if not t.started:
                        t.started = True
                        if not t.future.set_running_or_notify_cancel():
                            continue
                    work.append(("fail", t.future, RouterError(
                        f"request {t.request.request_id} failed: no healthy generator left",
                        t.causes + causes)))
                break
            slot = self._choose(ticket.request)
            if slot is None:
                break
            heapq.heappop(self._queue)
            slot.inflight += 1  # reserve before dispatch
            slot.dispatched += 1
            self._tick += 1
            slot.last_chosen = self._tick
            work.append(("dispatch", ticket, slot))
        return work

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
                    continue
                try:
                    if kind == "done":
                        args[0].set_result(args[1])
                    else:  # "fail"
                        args[0].set_exception(args[1])
                except InvalidStateError:  # someone else settled the user's future: theirs stands
                    pass
        finally:
            self._local.pending = None

    def _dispatch(self, ticket: _Ticket, slot: _Slot) -> None:
        try:
            fut = slot.gen.submit(ticket.request)
            if not isinstance(fut, Future):
                raise RuntimeError(f"{slot.name}.submit returned {type(fut).__name__}, not a Future")
        except (ValueError, TypeError) as exc:  # the request's fault: fail it, keep the generator
            with self._lock:
                self._release(slot)
                work = [("fail", ticket.future, exc)] + self._pump()
            self._run(work)
        except Exception as exc:
            self._settle(ticket, slot, None, exc)
        else:
            fut.add_done_callback(functools.partial(self._on_done, ticket, slot))

    def _on_done(self, ticket: _Ticket, slot: _Slot, fut: Future) -> None:
        if fut.cancelled():
            self._settle(ticket, slot, None, CancelledError(f"{slot.name} cancelled the request"))
        elif fut.exception() is not None:
            self._settle(ticket, slot, None, fut.exception())
        else:
            self._settle(ticket, slot, fut.result(), None)

    def _release(self, slot: _Slot) -> None:
        slot.inflight -= 1
        if slot.draining and slot.inflight == 0:
            self._drained.notify_all()

    def _settle(self, ticket: _Ticket, slot: _Slot, completion, exc) -> None:
        """One attempt ended: hand the completion on, or mark the generator and retry or fail."""
        with self._lock:
            self._release(slot)
            if exc is None:
                slot.completed += 1
                work = [("done", ticket.future, completion)]
            else:
                slot.failures += 1
                slot.healthy = False
                slot.last_error = exc
                ticket.causes.append((slot.name, exc))
                if len(ticket.causes) > self.max_retries:
                    work = [("fail", ticket.future, RouterError(
                        f"request {ticket.request.request_id} failed after {len(ticket.causes)} attempts",
                        ticket.causes))]
                else:
                    heapq.heappush(self._queue, (ticket.seq, ticket))  # back to its place in line
                    work = []
            work += self._pump()
        self._run(work)

    def _load_one(self, slot: _Slot, state_dict, version: int, mode: str, errors: dict) -> None:
        """One generator's part of a weight sync (runs in its own loader thread)."""
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
                slot.healthy = True
            else:
                errors[slot.name] = error
                slot.failures += 1
                slot.healthy = False
                slot.last_error = error
            work = self._pump()
        self._run(work)

    def _slot(self, name: str) -> _Slot:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise ValueError(f"name must be one of {', '.join(self._by_name)}; got {name!r}") from None
