"""Routed generator: the fast version.  A cheap router, and a serving engine built like vLLM's.

What it computes
    The same router, data types, protocol, model, sampling rule and distributed weight sync as
    ``ref/routed_generator.py``, the specification (read its docstring for the rules, the model
    and the sampling math): on the same sequence of events both routers make the same
    decisions, and on the same weights both engines give the same tokens and logprobs (fp32:
    tokens equal, logprobs to fp32 rounding; parity/ compares them).  What this file changes is
    how the work is done.

The router: what makes it cheap (costs per request, n generators)
    - No thread per request, none at rest: dispatch runs in the submitting thread and in the
      thread that settles a generator's future.
    - O(log n) choice: one binary heap of (load, last_chosen, index) (``(last_chosen, index)``
      for round_robin) with lazy invalidation: an entry is pushed whenever a generator's key
      changes or it becomes eligible again, and a popped entry whose key is stale or whose
      generator is not eligible is dropped.  The heap is rebuilt from the eligible generators
      when it holds more than 2n + 64 entries, so memory stays O(n).  power_of_two is O(1) plus
      the same heap as fallback; the reference scans all n generators per request.
    - The queue is a deque of fresh arrivals plus a small heap of retried requests; the common
      path with an empty queue touches neither.  The sticky map is an LRU bounded by
      ``max_sessions``.  ``__slots__`` records, one lock acquisition on submit and one on completion.

The engine (Generator): continuous batching over a paged KV cache
    thread       one engine thread runs the loop; ``submit`` validates and enqueues (never blocks);
                 futures are settled by the engine thread after each iteration, outside every lock.
    iteration    (1) give each running request the page its next token's KV goes to (allocate on
                 demand; when the pool is empty, preempt the newest request: its pages are freed
                 and it goes back to the head of the queue, keeping its tokens and its generator,
                 to be recomputed by a later prefill); (2) admit waiting requests in arrival order
                 while a slot, their prompt's pages and the prefill budget allow; (3) one prefill
                 pass over the packed new prompts (their K/V scattered into their pages, then
                 ``varlen_attn`` over the paged cache with a block table); (4) one batched decode
                 step over the requests that were running (``flash_decode`` with k_new/v_new
                 writes the new K/V into the pages and attends); (5) batched sampling, finished
                 requests free their pages and slots.
    pool         K and V [attention layers, num_pages, page_size, H_kv, D]; a block table
                 [max_batch_size, ceil(max_seq_len / page_size)] int32 with one row per running
                 request (a slot); "linear" plug-in layers keep their cache tensors in per-slot
                 pools [max_batch_size, ...] (gathered and scattered around each decode step).
                 A request that could never fit the pool alone raises ValueError at submit.
    attention    ``varlen_attn`` and ``flash_decode`` are constructor arguments with the
                 signatures of fast/paged_varlen_attention.varlen_attn and
                 fast/flash_decoding.flash_decode (drop those in); the defaults are plain
                 PyTorch in this file (causal only: no lse, softcap, sinks).
    sampling     one set of tensor ops per group of rows (greedy, temperature, top-k/top-p); each
                 sampled row draws its uniform from its request's own generator, so a request
                 gets the same token alone or in any batch.  One device-to-host copy per group.
    weights      ``load_weights`` validates the whole state dict, copies it into a second set of
                 weights (the shadow; on a side CUDA stream that first waits for the last step
                 that read those buffers), then hands it to the engine thread, which swaps the
                 two sets between two iterations: decoding never stops for the copy, and a
                 request running across the swap continues on the new weights (its
                 max_policy_version says so; the KV cache it built keeps the old weights' keys,
                 as in PipelineRL's in-flight updates).  Memory: two weight sets.
    transfer     across processes as in the reference, but the weights travel in flat buckets of
                 ``bucket_bytes`` per dtype (a few large broadcasts instead of one per tensor).

Cost (what bench/routed_generator.py measures against)
    Per generated token, FLOPs ~ 2 * (non-embedding parameters + hidden * vocab) + 4 * L_ctx *
    H_q * D per attention layer (L_ctx = keys it attends to).  A decode step over B requests moves
    at least the weights once plus each request's KV: bytes >= weight bytes + sum_b 2 * L_b *
    H_kv * D * elt * attention layers; at small B it is weight-bound, which is why batching wins.

Data types (the same in ref and fast)
    SamplingParams, Request, Completion, state_dict, ModelConfig, the linear_layer plug-in: as
    in the reference.

Supported, and what raises
    As the reference (router: the same errors; engine: ValueError for an empty prompt, unknown
    token ids, a prompt of max_seq_len tokens or more, a state dict with missing, unexpected or
    mis-shaped tensors, which is rejected whole with the weights and version unchanged; TypeError
    for non-tensors; RuntimeError after ``close()``), plus ValueError for a request that can never
    fit the KV pool and for engine knobs < 1.  Inference only.  Limits: preemption recomputes
    (no swapping to host); the plug-in layers' state is gathered per step (a kernel that reads the
    slot pools in place would not copy); no prefix caching, no chunked prefill of one long
    prompt across iterations; the router's limits (no timeouts; a done-callback must not block
    on another router future or call ``sync_weights``) and the distributed ones (the group is
    the trainer plus the generator ranks; a dead generator process makes the next transfer time
    out) hold here too.

References
    vLLM (Kwon et al., PagedAttention, 2023) and its scheduler (continuous batching, recompute
    preemption); Orca (Yu et al., 2022, iteration-level scheduling); PipelineRL (Piche et al.,
    2025) in-flight weight updates; AReaL / slime / verl weight sync; Mitzenmacher, The Power of
    Two Choices (2001); vLLM router / SGLang model-gateway policies.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import heapq
import itertools
import math
import operator
import os
import queue
import random
import socket
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError
from multiprocessing.connection import Client, Listener
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["SamplingParams", "Request", "Completion", "GeneratorProtocol", "RouterError", "GeneratorRouter",
           "POLICIES", "SYNC_MODES", "ModelConfig", "DecoderLM", "Generator", "serve_generator",
           "DistributedWeightSync", "RemoteGenerator"]

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


# ============================================================================= part 2: the generator
# ----------------------------------------------------------------------------- the model

LAYER_TYPES = ("attention", "linear")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder-only LM a ``Generator`` serves and a trainer trains (see the module docstring)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding rotates pairs), got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError(f"rope_theta and rms_eps must be > 0, got {self.rope_theta!r} and {self.rms_eps!r}")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
                raise ValueError(f"layer_types must be None or {self.num_layers} entries from {LAYER_TYPES}, "
                                 f"got {self.layer_types!r}")
            object.__setattr__(self, "layer_types", types)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_types or ("attention",) * self.num_layers


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, c: ModelConfig, kind: str, linear_layer, index: int):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = _Attention(c) if kind == "attention" else None
        self.linear_attn = linear_layer(c, index) if kind == "linear" else None
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = _MLP(c)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, rotate-half layout.  x [T, H, D]; positions [T] int -> [T, H, D]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None]          # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]                # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal (bottom-right aligned) softmax attention with GQA, fp32 inside.

    q [B, L_q, H_q, D]; k, v [B, L_k, H_kv, D] -> [B, L_q, H_q, D] in q's dtype.  Row i sees
    keys j <= i + L_k - L_q (with L_q = 1: every key)."""
    b, l_q, h_q, d = q.shape
    l_k, h_kv = k.shape[1], k.shape[2]
    qf = q.float().view(b, l_q, h_kv, h_q // h_kv, d)                        # [B, L_q, H_kv, G, D]
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale            # [B, H_kv, G, L_q, L_k]
    hidden = torch.arange(l_k, device=q.device)[None] > torch.arange(l_q, device=q.device)[:, None] + (l_k - l_q)
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v.float())                     # [B, L_q, H_kv, G, D]
    return o.reshape(b, l_q, h_q, d).to(q.dtype)


class DecoderLM(nn.Module):
    """The decoder-only LM of the module docstring.  ``forward(input_ids [B, T], *, cu_seqlens=None)
    -> logits [B, T, V] fp32`` (causal per row, or per document of ``cu_seqlens`` with B == 1)
    trains it; the engines run ``_hidden`` with their own KV-cache attention."""

    def __init__(self, config: ModelConfig | None = None, *, seed: int = 0, linear_layer=None, device=None,
                 dtype=None):
        super().__init__()
        config = ModelConfig() if config is None else config
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not _is_int(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if "linear" in config.kinds and linear_layer is None:
            raise ValueError("config.layer_types has 'linear' layers: pass linear_layer, a (config, layer_index) "
                             "-> nn.Module factory (e.g. a Gated DeltaNet layer)")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        blocks = []
        for i, kind in enumerate(config.kinds):
            with torch.random.fork_rng(devices=[]):  # the plug-in's own init, reproducible from the seed
                torch.manual_seed(seed * 1000003 + i)
                blocks.append(_Block(config, kind, linear_layer, i))
        self.layers = nn.ModuleList(blocks)
        self.norm = _RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(seed)
        self.to(device=device, dtype=dtype)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Unit-variance-preserving init drawn on the CPU in a fixed order: the same weights everywhere.
        Embeddings have std 2 / sqrt(hidden) so that logits spread (a few nats), not a flat softmax."""
        gen = torch.Generator().manual_seed(seed)
        c = self.config

        def normal_(p, std):
            p.copy_(torch.randn(p.shape, generator=gen) * std)

        normal_(self.embed_tokens.weight, 2.0 / math.sqrt(c.hidden_size))
        out_scale = 1.0 / math.sqrt(2 * c.num_layers)
        for block in self.layers:
            linears = list(block.mlp.children())
            if block.self_attn is not None:
                linears = list(block.self_attn.children()) + linears
            for lin in linears:
                scale = out_scale if lin in (block.mlp.down_proj, getattr(block.self_attn, "o_proj", None)) else 1.0
                normal_(lin.weight, scale / math.sqrt(lin.in_features))
        if self.lm_head is not None:
            normal_(self.lm_head.weight, 1.0 / math.sqrt(c.hidden_size))

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend, mix) -> torch.Tensor:
        """The transformer on packed tokens.  ids, positions [T] -> final-normed hidden [T, hidden].

        ``attend(layer, q [T, H_q, D], k [T, H_kv, D], v) -> [T, H_q, D]`` (rotary already applied)
        and ``mix(layer, module, h [T, hidden]) -> [T, hidden]`` are the engine's: they own the
        caches and the batch layout."""
        c = self.config
        x = self.embed_tokens(ids)                                          # [T, hidden]
        t = ids.shape[0]
        for i, block in enumerate(self.layers):
            h = block.input_layernorm(x)
            if block.self_attn is not None:
                a = block.self_attn
                q = _rope(a.q_proj(h).view(t, c.num_heads, c.head_dim), positions, c.rope_theta)
                k = _rope(a.k_proj(h).view(t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
                v = a.v_proj(h).view(t, c.num_kv_heads, c.head_dim)
                x = x + a.o_proj(attend(i, q, k, v).reshape(t, c.num_heads * c.head_dim))
            else:
                x = x + mix(i, block.linear_attn, h)
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.norm(x)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (h @ w.t()).float()                                          # [..., V]

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise TypeError(f"input_ids must be an integer tensor [B, T], got {getattr(input_ids, 'shape', input_ids)!r}")
        b, t = input_ids.shape
        c = self.config
        if cu_seqlens is None:
            lengths = [t] * b
        else:
            if b != 1:
                raise ValueError(f"cu_seqlens requires input_ids of shape [1, T], got {tuple(input_ids.shape)}")
            lengths = cu_seqlens.diff().tolist()
            if sum(lengths) != t or min(lengths, default=0) < 0:
                raise ValueError(f"cu_seqlens must partition the {t} tokens, got {cu_seqlens.tolist()}")
        if max(lengths, default=0) > c.max_seq_len:
            raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_seq_len={c.max_seq_len}")
        dev = input_ids.device
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=dev)
        scale = c.head_dim ** -0.5

        def attend(i, q, k, v):
            if cu_seqlens is None:                                          # b equal rows: one batched call
                return _attention(q.view(b, t, *q.shape[1:]), k.view(b, t, *k.shape[1:]),
                                  v.view(b, t, *v.shape[1:]), scale).reshape(q.shape)
            bounds = cu.tolist()
            return torch.cat([_attention(q[s:e][None], k[s:e][None], v[s:e][None], scale)[0]
                              for s, e in zip(bounds[:-1], bounds[1:])])

        def mix(i, module, h):
            if cu_seqlens is None:                                          # b equal rows: [B, T, hidden]
                return module(h.view(b, t, -1)).reshape(h.shape)
            return module(h[None], cu_seqlens=cu)[0]

        h = self._hidden(input_ids.reshape(-1), positions, attend, mix)
        return self._logits(h).view(b, t, c.vocab_size)


def _checked_state_dict(state_dict, shapes: dict) -> dict:
    """Validate a whole state dict against the model's names and shapes before touching anything."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"state_dict[{name!r}] must be a floating tensor, got {t.dtype}")
    missing = [n for n in shapes if n not in state_dict]
    unexpected = [n for n in state_dict if n not in shapes]
    misshaped = [f"{n}: got {tuple(state_dict[n].shape)}, expected {shapes[n]}"
                 for n in shapes if n in state_dict and tuple(state_dict[n].shape) != shapes[n]]
    if missing or unexpected or misshaped:
        parts = [f"{label} {items[:5]}{' ...' if len(items) > 5 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                 if items]
        raise ValueError("state_dict rejected whole (weights and version unchanged): " + "; ".join(parts))
    return {n: state_dict[n] for n in shapes}


def _check_request(request, vocab_size: int, max_seq_len: int) -> None:
    """What makes a request unservable: ValueError / TypeError (the router keeps the generator)."""
    if not isinstance(request, Request):
        raise TypeError(f"request must be a Request, got {type(request).__name__}")
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
    if max(prompt) >= vocab_size or min(prompt) < 0:
        raise ValueError(f"prompt_token_ids must be token ids in [0, {vocab_size}), got {max(prompt)}")
    if len(prompt) >= max_seq_len:
        raise ValueError(f"prompt_token_ids: a prompt of {len(prompt)} tokens leaves no room to generate "
                         f"in a context of max_seq_len={max_seq_len}")


# ----------------------------------------------------------------------------- default attention plug-ins

def _torch_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                       softcap=0.0, sinks=None):
    """The default prefill attention: ``varlen_attn``'s signature in plain PyTorch, one sequence at
    a time.  It supports what the engine asks for (causal window (-1, 0), packed or paged keys, GQA)
    and raises NotImplementedError for the rest (plug in fast/paged_varlen_attention.varlen_attn)."""
    if (return_aux is not None and return_aux.lse) or softcap or sinks is not None or tuple(window_size) != (-1, 0):
        raise NotImplementedError("the in-file default varlen_attn does causal attention only (window (-1, 0), "
                                  "no lse, softcap or sinks); plug in fast/paged_varlen_attention.varlen_attn")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q_bounds = cu_seq_q.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    k_bounds = None if cu_seq_k is None else cu_seq_k.tolist()
    outs = []
    for b in range(len(q_bounds) - 1):
        q = query[q_bounds[b]:q_bounds[b + 1]]
        if block_table is not None:
            n, page_size = used[b], key.shape[1]
            pages = block_table[b, :-(-n // page_size)].long()
            k, v = key[pages].flatten(0, 1)[:n], value[pages].flatten(0, 1)[:n]   # [n, H_kv, D]
        else:
            start = k_bounds[b]
            n = used[b] if used is not None else k_bounds[b + 1] - start
            k, v = key[start:start + n], value[start:start + n]
        outs.append(_attention(q[None], k[None], v[None], scale)[0])
    return torch.cat(outs) if outs else query.new_zeros(query.shape)


def _torch_flash_decode(q, k_cache, v_cache, seqused_k, *, block_table=None, k_new=None, v_new=None, scale=None,
                        num_splits=None, softcap=0.0, sinks=None, return_lse=False, out=None):
    """The default decode attention: ``flash_decode``'s signature in plain PyTorch, the whole batch at
    once (keys gathered from the pages, padded to the longest sequence, masked).  k_new / v_new are
    written into the cache first.  No lse, softcap or sinks (NotImplementedError)."""
    if return_lse or softcap or sinks is not None:
        raise NotImplementedError("the in-file default flash_decode has no lse, softcap or sinks; plug in "
                                  "fast/flash_decoding.flash_decode")
    b, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[-2]
    scale = d ** -0.5 if scale is None else scale
    lengths = seqused_k.long()
    pos = lengths[:, None] - s_q + torch.arange(s_q, device=q.device)            # [B, S_q] new keys' positions
    if k_new is not None:
        rows = lengths >= s_q                                                    # empty rows write nothing
        if block_table is not None:
            page_size = k_cache.shape[1]
            page = block_table.long().gather(1, pos.clamp(min=0) // page_size)
            flat = (page * page_size + pos % page_size)[rows].reshape(-1)       # slots in [pages * page_size]
            k_cache.view(-1, h_kv, d).index_copy_(0, flat, k_new[rows].reshape(-1, h_kv, d))
            v_cache.view(-1, h_kv, d).index_copy_(0, flat, v_new[rows].reshape(-1, h_kv, d))
        else:
            k_cache[rows.nonzero()[:, 0, None], pos[rows]] = k_new[rows]
            v_cache[rows.nonzero()[:, 0, None], pos[rows]] = v_new[rows]
    longest = int(lengths.max()) if b else 0
    if block_table is not None:
        n_pages = -(-longest // k_cache.shape[1])
        pages = block_table[:, :n_pages].long()
        k = k_cache[pages].flatten(1, 2)[:, :longest]                            # [B, L, H_kv, D]
        v = v_cache[pages].flatten(1, 2)[:, :longest]
    else:
        k, v = k_cache[:, :longest], v_cache[:, :longest]
    qf = q.float().view(b, s_q, h_kv, h_q // h_kv, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale                # [B, H_kv, G, S_q, L]
    hidden = torch.arange(longest, device=q.device)[None, None] > pos[:, :, None]   # [B, S_q, L]
    p = torch.softmax(s.masked_fill(hidden[:, None, None], float("-inf")), dim=-1).nan_to_num(0.0)
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v.float()).reshape(b, s_q, h_q, d).to(q.dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o


# ----------------------------------------------------------------------------- batched sampling

def _request_rng(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _sample_batch(logits: torch.Tensor, params: list, rngs: list) -> tuple[list, list]:
    """The reference's per-row rule on a batch: fp32 logits [B, V] -> (tokens, logprobs) lists.

    Rows are grouped (greedy, plain temperature, top-k/top-p) and each group is one set of tensor
    ops; each sampled row draws its uniform from its own request's generator, so a request gets the
    same token alone or in any batch.  One device-to-host copy per group."""
    b, vocab = logits.shape
    tokens, logprobs = [0] * b, [0.0] * b
    groups = ([], [], [])
    for i, sp in enumerate(params):
        groups[0 if sp.temperature == 0 else (2 if sp.top_k or sp.top_p < 1.0 else 1)].append(i)
    dev = logits.device
    for kind, rows in enumerate(groups):
        if not rows:
            continue
        lg = logits if len(rows) == b else logits[torch.tensor(rows, device=dev)]
        if kind == 0:
            tok = torch.argmax(lg, dim=-1)
            lp = torch.log_softmax(lg, dim=-1).gather(1, tok[:, None])[:, 0]
        else:
            inv_t = torch.tensor([1.0 / params[i].temperature for i in rows], dtype=torch.float32, device=dev)
            logp = torch.log_softmax(lg * inv_t[:, None], dim=-1)
            p = logp.exp()
            if kind == 2:
                p, order = torch.sort(p, dim=-1, descending=True, stable=True)
                top_k = torch.tensor([params[i].top_k or vocab for i in rows], device=dev)
                top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=dev)
                keep = torch.arange(vocab, device=dev)[None] < top_k[:, None]
                keep &= (torch.cumsum(p, dim=-1) - p) < top_p[:, None]
                p = torch.where(keep, p, torch.zeros_like(p))
            cdf = torch.cumsum(p.double(), dim=-1)
            u = torch.stack([torch.rand((), generator=rngs[i], dtype=torch.float64) for i in rows]).to(dev)
            index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            last = vocab - 1 - torch.argmax((p.flip(-1) > 0).to(torch.int8), dim=-1)
            index = torch.minimum(index, last)
            tok = index if kind == 1 else order.gather(1, index[:, None])[:, 0]
            lp = logp.gather(1, tok[:, None])[:, 0]
        for i, t, l in zip(rows, tok.tolist(), lp.tolist()):
            tokens[i], logprobs[i] = t, l
    return tokens, logprobs


# ----------------------------------------------------------------------------- the engine

class _Waiter:
    """A one-shot hand-off: the loader waits, the engine sets the outcome."""

    def __init__(self):
        self.event, self.error = threading.Event(), None

    def set(self, error=None):
        self.error = error
        self.event.set()

    def wait(self, timeout=None):
        if not self.event.wait(timeout):
            raise TimeoutError(f"gave up after {timeout} s")
        if self.error is not None:
            raise self.error


class _Seq:
    """One request inside the engine.  ``tokens`` = prompt + generated; pages hold the KV of every
    token but the last (fed by the next step)."""

    __slots__ = ("request", "future", "tokens", "n_prompt", "logprobs", "rng", "limit", "pages", "slot",
                 "started", "min_version")

    def __init__(self, request: Request, future: Future, max_seq_len: int):
        self.request, self.future = request, future
        self.tokens = list(request.prompt_token_ids)
        self.n_prompt = len(self.tokens)
        self.limit = min(request.sampling.max_new_tokens, max_seq_len - self.n_prompt)
        self.logprobs: list[float] = []
        self.rng = _request_rng(request.sampling.seed)
        self.pages: list[int] = []
        self.slot = None
        self.started = False
        self.min_version = None


class Generator:
    """The fast engine (module docstring): continuous batching over a paged KV cache, hot-swapped
    weights.  Same contract as the reference's, plus the engine's knobs:

    ``varlen_attn`` / ``flash_decode``  prefill / decode attention with those functions' signatures
                                        (default: plain PyTorch in this file)
    ``page_size``, ``num_pages``        the KV pool (default: room for min(max_batch_size, 32)
                                        sequences of max_seq_len tokens)
    ``max_batch_size``                  requests decoding at once (rows of the block table)
    ``max_prefill_tokens``              prompt tokens admitted per iteration (one longer prompt
                                        is still admitted alone)
    """

    def __init__(self, config: ModelConfig | None = None, *, state_dict=None, seed: int = 0, name: str = "generator",
                 policy_version: int = 0, linear_layer=None, device=None, dtype=None, varlen_attn=None,
                 flash_decode=None, page_size: int = 16, num_pages: int | None = None, max_batch_size: int = 256,
                 max_prefill_tokens: int = 8192):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if not _is_int(policy_version):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        for arg, value in (("page_size", page_size), ("max_batch_size", max_batch_size),
                           ("max_prefill_tokens", max_prefill_tokens), ("num_pages", num_pages)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
        self.name = name
        self.device = torch.device("cpu" if device is None else device)
        self.model = DecoderLM(config, seed=seed, linear_layer=linear_layer, device=self.device, dtype=dtype).eval()
        self.config = c = self.model.config
        self.dtype = self.model.embed_tokens.weight.dtype
        self._shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        if state_dict is not None:
            self._copy_into(self.model, _checked_state_dict(state_dict, self._shapes))
        self._shadow = None                 # the second weight set, allocated by the first load
        self._version = policy_version
        self._varlen_attn = varlen_attn or _torch_varlen_attn
        self._flash_decode = flash_decode or _torch_flash_decode
        self.page_size, self.max_batch_size, self.max_prefill_tokens = page_size, max_batch_size, max_prefill_tokens
        self._pages_per_seq = -(-c.max_seq_len // page_size)
        self.num_pages = num_pages or self._pages_per_seq * min(max_batch_size, 32)
        # The KV pool of every attention layer: [layers, num_pages, page_size, H_kv, D], zeros (finite).
        attn = [i for i, kind in enumerate(c.kinds) if kind == "attention"]
        self._pool_index = {layer: j for j, layer in enumerate(attn)}
        kv_shape = (len(attn), self.num_pages, page_size, c.num_kv_heads, c.head_dim)
        self._k = torch.zeros(kv_shape, device=self.device, dtype=self.dtype)
        self._v = torch.zeros(kv_shape, device=self.device, dtype=self.dtype)
        self._table = torch.zeros(max_batch_size, self._pages_per_seq, dtype=torch.int32, device=self.device)
        self._table_updates: list[tuple[int, int, int]] = []   # (slot, column, page) not yet in _table
        self._states: dict[int, dict[str, torch.Tensor]] = {}   # linear layer -> state pools [max_batch_size, ...]
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        self._waiting: deque[_Seq] = deque()  # under _cv; the rest of the engine state is the engine thread's
        self._running: list[_Seq] = []
        self._cv = threading.Condition()
        self._load_lock = threading.Lock()
        self._staged = None                 # (model, version, waiter): swapped in before the next step
        self._closed = False
        self._retired = None                # CUDA event after the last step on the weights now in the shadow
        self._copy_stream = None
        self._counts = dict(completed=0, steps=0, preemptions=0, generated_tokens=0)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-engine", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request: Request) -> Future:
        """Queue one request; the future resolves to its ``Completion``.  Never blocks."""
        c = self.config
        _check_request(request, c.vocab_size, c.max_seq_len)
        n = len(request.prompt_token_ids)
        kv_tokens = n + min(request.sampling.max_new_tokens, c.max_seq_len - n) - 1
        if -(-kv_tokens // self.page_size) > self.num_pages:
            raise ValueError(f"request {request.request_id} needs {kv_tokens} KV slots; the pool has only "
                             f"{self.num_pages} pages of {self.page_size}: it can never fit")
        future = Future()
        seq = _Seq(request, future, c.max_seq_len)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed")
            self._waiting.append(seq)
            self._cv.notify()
        return future

    def generate(self, requests) -> list[Completion]:
        """Submit every request, wait, return the completions in order (raises the first failure)."""
        futures = [self.submit(r) for r in list(requests)]
        return [f.result() for f in futures]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Validate, copy into the shadow weights while decoding goes on, swap between two steps."""
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        with self._load_lock:
            if version < self._version:
                raise ValueError(f"version must not decrease: got {version}, serving {self._version}")
            tensors = _checked_state_dict(state_dict, self._shapes)
            if self._shadow is None:  # allocated once, by the first load (a copy: no random init)
                self._shadow = copy.deepcopy(self.model)
            shadow = self._shadow
            self._copy_into(shadow, tensors)
            waiter = _Waiter()
            with self._cv:
                if self._closed:
                    raise RuntimeError(f"generator {self.name} is closed")
                self._staged = (shadow, version, waiter)
                self._cv.notify()
            waiter.wait()

    def stats(self) -> dict:
        """waiting, running, completed, policy_version, plus free_pages, num_pages, page_size, steps,
        preemptions, generated_tokens, weights_staged."""
        with self._cv:
            out = dict(waiting=len(self._waiting), running=len(self._running), policy_version=self._version,
                       free_pages=len(self._free_pages), num_pages=self.num_pages, page_size=self.page_size,
                       weights_staged=self._staged is not None, **self._counts)
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def _copy_into(self, model: DecoderLM, tensors: dict) -> None:
        params = model.state_dict()
        if self.device.type != "cuda":
            for n, t in tensors.items():
                params[n].copy_(t)
            return
        # On a side stream, so decoding on the compute stream goes on.  It first waits for the
        # caller's stream (whatever produced the new tensors: an optimizer step, a broadcast) and
        # for the last step that read these buffers (they held the previous weights).
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._retired is not None:
            self._copy_stream.wait_event(self._retired)
        with torch.cuda.stream(self._copy_stream):
            for n, t in tensors.items():
                params[n].copy_(t, non_blocking=True)
        self._copy_stream.synchronize()  # the loader waits, not the engine

    def _swap(self, model: DecoderLM, version: int, waiter: _Waiter) -> None:
        """Between two steps: the staged weights become the live ones, the old ones the shadow."""
        self._shadow, self.model = self.model, model
        self._version = version
        if self.device.type == "cuda":
            self._retired = torch.cuda.Event()
            self._retired.record()
        waiter.set()

    # ------------------------------------------------------------------ the engine loop

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._staged or self._closed):
                    self._cv.wait()
                if self._closed:
                    break
                staged, self._staged = self._staged, None
            if staged is not None:
                self._swap(*staged)
            settle: list = []
            try:
                self._step(settle)
            except Exception as exc:  # fail the batch that hit it; the engine goes on
                for seq in self._running:
                    if seq.slot is not None:  # (a request that finished in this step keeps its result)
                        self._release(seq)
                        settle.append((seq.future.set_exception, exc))
                self._running = []
            for fn, value in settle:  # outside every lock: callbacks may submit again
                fn(value)
        with self._cv:
            staged, self._staged = self._staged, None
            leftover = list(self._waiting) + self._running
            self._waiting.clear()
            self._running = []
        if staged is not None:
            staged[2].set(RuntimeError(f"generator {self.name} closed before the weights were swapped in"))
        for seq in leftover:
            if seq.started or seq.future.set_running_or_notify_cancel():
                seq.future.set_exception(RuntimeError(f"generator {self.name} closed before finishing the request"))

    @torch.no_grad()
    def _step(self, settle: list) -> None:
        """One iteration: pages for the decode step, admission, one packed prefill, one decode step."""
        old = self._grow_pages()
        with self._cv:
            new = self._admit(len(old))
        self._running = old + new  # (what an error fails)
        model = self.model
        running = self._prefill(model, new, settle) if new else []
        if old:
            running = self._decode(model, old, settle) + running
        self._running = running
        self._counts["steps"] += 1

    def _grow_pages(self) -> list:
        """Give every running request the page its next decode step writes into; when the pool is
        empty, preempt the newest request (its pages are freed and it is recomputed later)."""
        running, ps, k = self._running, self.page_size, 0
        while k < len(running):
            seq = running[k]
            while len(seq.pages) < -(-len(seq.tokens) // ps):
                if self._free_pages:
                    page = self._free_pages.pop()
                    self._table_updates.append((seq.slot, len(seq.pages), page))
                    seq.pages.append(page)
                    continue
                victim = running.pop()
                self._release(victim)
                self._counts["preemptions"] += 1
                with self._cv:
                    self._waiting.appendleft(victim)  # first in line; it keeps its tokens and generator
                if victim is seq:
                    break
            else:
                k += 1
        return running

    def _admit(self, n_running: int) -> list:
        """Waiting requests in arrival order while their prompt's pages, a slot and the prefill budget
        allow (under the lock)."""
        new, budget, ps = [], self.max_prefill_tokens, self.page_size
        while self._waiting and n_running + len(new) < self.max_batch_size:
            seq = self._waiting[0]
            n = len(seq.tokens)
            need = -(-n // ps)
            if need > len(self._free_pages) or (new and n > budget):
                break
            self._waiting.popleft()
            if not seq.started:
                if not seq.future.set_running_or_notify_cancel():  # the user cancelled it
                    continue
                seq.started = True
            seq.slot = self._free_slots.pop()
            seq.pages = [self._free_pages.pop() for _ in range(need)]
            self._table_updates += [(seq.slot, j, page) for j, page in enumerate(seq.pages)]
            budget -= n
            new.append(seq)
        return new

    def _release(self, seq: _Seq) -> None:
        self._free_pages += seq.pages
        seq.pages = []
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            seq.slot = None

    def _flush_table(self) -> None:
        if self._table_updates:
            # Last write wins: a preempted request's slot may be reused in the same iteration, and
            # index_put_ with repeated indices is undefined on a GPU.
            latest = {(row, col): page for row, col, page in self._table_updates}
            self._table_updates = []
            rows, cols = zip(*latest)
            pages = tuple(latest.values())
            index = torch.tensor([rows, cols], dtype=torch.long).to(self.device)
            self._table.index_put_((index[0], index[1]),
                                   torch.tensor(pages, dtype=torch.int32).to(self.device))

    def _store_states(self, layer: int, cache, slots: torch.Tensor) -> None:
        pools = self._states.setdefault(layer, {})
        for name, value in vars(cache).items():
            if isinstance(value, torch.Tensor):
                if name not in pools:
                    pools[name] = torch.zeros(self.max_batch_size, *value.shape[1:], dtype=value.dtype,
                                              device=value.device)
                pools[name][slots] = value

    def _prefill(self, model: DecoderLM, seqs: list, settle: list) -> list:
        """One pass over the packed prompts of the admitted requests (a preempted one: all its tokens)."""
        dev, ps, c = self.device, self.page_size, self.config
        lengths = [len(s.tokens) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.tokens], device=dev)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
        # KV slot of every prompt token in the pool viewed as [num_pages * page_size, H_kv, D].
        offsets = torch.arange(ps)
        where = torch.cat([(torch.tensor(s.pages)[:, None] * ps + offsets).flatten()[:n]
                           for s, n in zip(seqs, lengths)]).to(dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        self._flush_table()
        table = self._table[slots, :max(len(s.pages) for s in seqs)]
        used = torch.tensor(lengths, dtype=torch.int32, device=dev)
        longest, scale = max(lengths), c.head_dim ** -0.5

        def attend(i, q, k, v):
            kc, vc = self._k[self._pool_index[i]], self._v[self._pool_index[i]]
            kc.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, where, k)
            vc.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, where, v)
            return self._varlen_attn(q, kc, vc, cu, None, longest, longest, scale=scale, window_size=(-1, 0),
                                     enable_gqa=True, seqused_k=used, block_table=table)

        def mix(i, module, h):
            cache = module.new_cache()
            out = module(h[None], cu_seqlens=cu, cache=cache)[0]
            self._store_states(i, cache, slots)
            return out

        h = model._hidden(ids, positions, attend, mix)
        logits = model._logits(h[cu[1:].long() - 1])                                  # [N, V]
        for s in seqs:
            if s.min_version is None:
                s.min_version = self._version
        return self._advance(seqs, logits, settle)

    def _decode(self, model: DecoderLM, seqs: list, settle: list) -> list:
        """One token for every running request: a batched forward over their last tokens."""
        dev, c = self.device, self.config
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=dev)
        positions = torch.tensor([len(s.tokens) - 1 for s in seqs], device=dev)
        used = (positions + 1).to(torch.int32)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        self._flush_table()
        table = self._table[slots, :max(len(s.pages) for s in seqs)]
        scale = c.head_dim ** -0.5

        def attend(i, q, k, v):
            kc, vc = self._k[self._pool_index[i]], self._v[self._pool_index[i]]
            return self._flash_decode(q[:, None], kc, vc, used, block_table=table, k_new=k[:, None],
                                      v_new=v[:, None], scale=scale)[:, 0]

        def mix(i, module, h):
            cache = module.new_cache()
            for name, pool in self._states[i].items():
                setattr(cache, name, pool[slots])
            out = module(h[:, None], cache=cache)[:, 0]
            self._store_states(i, cache, slots)
            return out

        h = model._hidden(ids, positions, attend, mix)
        return self._advance(seqs, model._logits(h), settle)

    def _advance(self, seqs: list, logits: torch.Tensor, settle: list) -> list:
        """Sample one token per request; finished requests free their pages.  Returns the rest."""
        tokens, logprobs = _sample_batch(logits, [s.request.sampling for s in seqs], [s.rng for s in seqs])
        still = []
        for s, token, logprob in zip(seqs, tokens, logprobs):
            s.tokens.append(token)
            s.logprobs.append(logprob)
            generated = len(s.tokens) - s.n_prompt
            if token in s.request.sampling.stop_token_ids:
                reason = "stop"
            elif generated >= s.limit:
                reason = "length"
            else:
                still.append(s)
                continue
            self._release(s)
            r = s.request
            settle.append((s.future.set_result, Completion(
                r.request_id, list(r.prompt_token_ids), s.tokens[s.n_prompt:], s.logprobs, reason, self.name,
                s.min_version, self._version)))
            self._counts["completed"] += 1
            self._counts["generated_tokens"] += generated
        return still


# ----------------------------------------------------------------------------- across processes

def _init_group(backend, init_method, rank, world_size, timeout_s) -> bool:
    """Join the default process group unless the caller already did; True when this call made it."""
    if dist.is_initialized():
        return False
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    return True


def _wire_device() -> torch.device:
    """Where broadcast tensors live: NCCL moves CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _error_to_wire(exc: BaseException) -> tuple:
    return (type(exc).__name__, str(exc))


def _error_from_wire(wire, where: str) -> Exception:
    kind, message = wire
    cls = {"ValueError": ValueError, "TypeError": TypeError, "TimeoutError": TimeoutError}.get(kind, RuntimeError)
    return cls(f"{where}: {kind}: {message}")


class _Link:
    """A message pipe to a peer process (``multiprocessing.connection`` over TCP, pickled tuples).

    ``send`` only queues (a sender thread writes), so it never blocks; a reader thread hands
    every message to ``on_message`` and calls ``on_close`` once when the peer is gone.  A
    message for which ``on_message`` returns True is the last one read."""

    def __init__(self, conn, on_message, on_close, name: str):
        self._conn, self._on_message, self._on_close = conn, on_message, on_close
        self._out = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._reader = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._sender.start()
        self._reader.start()

    def send(self, message: tuple) -> None:
        self._out.put(message)

    def _send_loop(self) -> None:
        while True:
            message = self._out.get()
            if message is None:
                return
            try:
                self._conn.send(message)
            except (OSError, EOFError, ValueError):  # the peer is gone; the reader reports it
                return

    def _recv_loop(self) -> None:
        try:
            while True:
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    break
                if self._on_message(message):
                    break
        finally:
            self._on_close()

    def close(self, timeout: float) -> None:
        """Flush what is queued, then close (after the reader saw the peer's last message)."""
        self._out.put(None)
        self._sender.join(timeout)
        self._reader.join(timeout)
        self._conn.close()


def _request_to_wire(r: Request) -> tuple:
    return (r.prompt_token_ids, dataclasses.astuple(r.sampling), r.request_id, r.session_id)


def _request_from_wire(w: tuple) -> Request:
    prompt, sampling, request_id, session_id = w
    return Request(prompt, SamplingParams(*sampling), request_id, session_id)


def _bucket_plan(meta: list, bucket_bytes: int) -> list:
    """Consecutive tensors of one dtype grouped into flat buckets of about ``bucket_bytes``: a few
    large broadcasts instead of one per tensor (both ends derive the same plan from the header)."""
    buckets, size = [], 0
    for i, (_, shape, dtype) in enumerate(meta):
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if not buckets or meta[buckets[-1][0]][2] != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _send_weights(tensors: list, meta: list, bucket_bytes: int, src: int, device) -> None:
    """The collective transfer, trainer side: one broadcast per bucket."""
    for bucket in _bucket_plan(meta, bucket_bytes):
        flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in bucket])
        dist.broadcast(flat, src)


def _recv_weights(meta: list, bucket_bytes: int, src: int, device) -> dict:
    """The collective transfer, generator side: receive each bucket, hand out views of it."""
    out = {}
    for bucket in _bucket_plan(meta, bucket_bytes):
        sizes = [math.prod(meta[i][1]) for i in bucket]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, meta[bucket[0]][2]), device=device)
        dist.broadcast(flat, src)
        for i, part in zip(bucket, flat.split(sizes)):
            out[meta[i][0]] = part.view(meta[i][1])
    return out


class _GeneratorServer:
    """The generator process's end of one link: submits, staged weight sets, loads."""

    def __init__(self, generator, conn, src: int, timeout_s: float):
        self.gen, self.src, self.timeout_s = generator, src, timeout_s
        self.device = _wire_device()
        self.cv = threading.Condition()
        self.staged = None                       # (version, tensors): the latest complete transfer
        self.transfers = queue.SimpleQueue()
        self.done = threading.Event()
        threading.Thread(target=self._receive_loop, name="weights-recv", daemon=True).start()
        self.link = _Link(conn, self._on_message, self.done.set, f"serve-{generator.name}")
        c = generator.config
        self.link.send(("hello", dist.get_rank(), generator.name, generator.policy_version,
                        (c.vocab_size, c.max_seq_len)))

    def _on_message(self, message) -> bool:
        kind = message[0]
        if kind == "submit":
            _, key, wire = message
            try:
                future = self.gen.submit(_request_from_wire(wire))
            except Exception as exc:
                self.link.send(("result", key, None, _error_to_wire(exc)))
            else:
                future.add_done_callback(functools.partial(self._reply, key))
        elif kind == "weights":
            self.transfers.put(message[1:])      # (version, meta, bucket_bytes): for the weights thread
        elif kind == "load":
            threading.Thread(target=self._load, args=(message[1],), name="load", daemon=True).start()
        elif kind == "close":
            self.link.send(("bye",))
            return True
        return False

    def _reply(self, key, future: Future) -> None:
        try:
            c = future.result()
        except BaseException as exc:  # noqa: BLE001 - a cancelled future too: the trainer must hear of it
            self.link.send(("result", key, None, _error_to_wire(exc)))
        else:
            self.link.send(("result", key, dataclasses.astuple(c), None))

    def _receive_loop(self) -> None:
        while True:
            version, meta, bucket_bytes = self.transfers.get()
            tensors = _recv_weights(meta, bucket_bytes, self.src, self.device)
            with self.cv:
                self.staged = (version, tensors)
                self.cv.notify_all()

    def _load(self, version: int) -> None:
        error = None
        try:
            with self.cv:
                if not self.cv.wait_for(lambda: self.staged is not None and self.staged[0] == version,
                                        self.timeout_s):
                    raise TimeoutError(f"weights of version {version} never arrived")
                _, tensors = self.staged
                self.staged = None               # one load per transfer: a retry transfers again
            self.gen.load_weights(tensors, version)
        except Exception as exc:
            error = _error_to_wire(exc)
        self.link.send(("loaded", version, error))

    def serve(self) -> None:
        self.done.wait()
        self.link.close(self.timeout_s)


def serve_generator(generator, *, src: int = 0, backend: str | None = None, init_method: str | None = None,
                    rank: int | None = None, world_size: int | None = None, timeout_s: float = 300.0) -> None:
    """Serve ``generator`` (any object with the protocol and a ``config``) to the trainer rank ``src``.

    Runs on every rank but ``src``; joins the process group unless it exists (``init_method``
    None: env:// with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; ``backend`` None: NCCL when CUDA
    is available, else gloo; with NCCL call ``torch.cuda.set_device`` first, the weights arrive on
    that device).  Returns when the trainer closes its ``DistributedWeightSync``; the caller then
    closes the generator.
    """
    owned = _init_group(backend, init_method, rank, world_size, timeout_s)
    try:
        if dist.get_rank() == src:
            raise ValueError(f"serve_generator runs on the generator ranks, not on the trainer's src={src}")
        box = [None]
        dist.broadcast_object_list(box, src)     # the trainer's address and the link's key
        address, authkey = box[0]
        server = _GeneratorServer(generator, Client(address, authkey=authkey), src, timeout_s)
        server.serve()
    finally:
        if owned:
            dist.destroy_process_group()


class RemoteGenerator:
    """A generator in another process, behind ``GeneratorProtocol``; made by ``DistributedWeightSync``."""

    def __init__(self, sync, conn, hello: tuple, timeout_s: float):
        _, self.rank, self.name, self._version, (self._vocab, self._max_seq_len) = hello
        self._sync, self._timeout_s = sync, timeout_s
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._loads: dict[int, _Waiter] = {}
        self._keys = itertools.count()
        self._closed = False
        self._bye = threading.Event()
        self._link = _Link(conn, self._on_message, self._on_close, f"proxy-{self.name}")

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request: Request) -> Future:
        _check_request(request, self._vocab, self._max_seq_len)  # the remote engine's rules, raised here
        future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"generator {self.name}: its process is gone")
            key = next(self._keys)
            self._pending[key] = future
        self._link.send(("submit", key, _request_to_wire(request)))
        return future

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Transfer ``version`` to every generator (once), then make this one load it."""
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        self._sync.broadcast(state_dict, version)
        waiter = _Waiter()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"generator {self.name}: its process is gone")
            self._loads[version] = waiter
        self._link.send(("load", version))
        waiter.wait(self._timeout_s)
        self._version = version

    def _on_message(self, message) -> bool:
        kind = message[0]
        if kind == "result":
            _, key, fields, error = message
            with self._lock:
                future = self._pending.pop(key)
            if error is None:
                future.set_result(Completion(*fields))
            else:
                future.set_exception(_error_from_wire(error, f"generator {self.name}"))
        elif kind == "loaded":
            _, version, error = message
            with self._lock:
                waiter = self._loads.pop(version)
            waiter.set(None if error is None else _error_from_wire(error, f"generator {self.name}"))
        elif kind == "bye":
            self._bye.set()
            return True
        return False

    def _on_close(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
            loads, self._loads = list(self._loads.values()), {}
        gone = RuntimeError(f"generator {self.name}: its process is gone")
        for future in pending:
            future.set_exception(gone)
        for waiter in loads:
            waiter.set(gone)

    def _close(self) -> None:
        self._link.send(("close",))
        self._bye.wait(self._timeout_s)
        self._link.close(self._timeout_s)


def _local_host(init_method: str | None) -> str:
    """The address generators use to reach the trainer: the rendezvous host when known."""
    if init_method and init_method.startswith("tcp://"):
        return init_method[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


class DistributedWeightSync:
    """The trainer's end (rank ``src``): ``generators`` (one ``RemoteGenerator`` per other rank) and
    ``broadcast(state_dict, version)``, the collective weight transfer their ``load_weights`` uses.

    Joins the process group unless it exists (see ``serve_generator``); ``host`` is the address
    the generators connect to (default: the rendezvous host); ``bucket_bytes`` the size of the
    flat buffers the transfer broadcasts.  ``close()`` (or ``with``) ends the generators'
    ``serve_generator`` and leaves the group it joined.
    """

    def __init__(self, *, src: int = 0, backend: str | None = None, init_method: str | None = None,
                 rank: int | None = None, world_size: int | None = None, host: str | None = None,
                 timeout_s: float = 300.0, bucket_bytes: int = 256 << 20):
        self._owned = _init_group(backend, init_method, rank, world_size, timeout_s)
        self.src, self.timeout_s, self.bucket_bytes = src, timeout_s, bucket_bytes
        self._lock = threading.Lock()
        self._sent = (None, None)  # (version, state dict object) of the last transfer
        try:
            if dist.get_rank() != src:
                raise ValueError(f"DistributedWeightSync runs on the trainer rank src={src}, "
                                 f"this is rank {dist.get_rank()}")
            self.device = _wire_device()
            host = host or _local_host(init_method)
            authkey = os.urandom(32)
            n = dist.get_world_size() - 1
            with Listener((host, 0), authkey=authkey) as listener:
                dist.broadcast_object_list([(listener.address, authkey)], src)
                hellos = []
                accepter = threading.Thread(target=lambda: hellos.extend(
                    (conn, conn.recv()) for conn in (listener.accept() for _ in range(n))), daemon=True)
                accepter.start()
                accepter.join(timeout_s)
                if len(hellos) < n:
                    raise TimeoutError(f"{len(hellos)} of {n} generators connected within {timeout_s} s")
            hellos.sort(key=lambda ch: ch[1][1])                              # by rank
            names = [hello[2] for _, hello in hellos]
            if len(set(names)) != len(names):
                raise ValueError(f"generator names must be unique, got {names}")
            self.generators = [RemoteGenerator(self, conn, hello, timeout_s) for conn, hello in hellos]
        except BaseException:
            if self._owned:
                dist.destroy_process_group()
            raise

    def broadcast(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Transfer ``version`` to every generator (staged there, not loaded); a no-op when this
        very state dict was the last one sent as ``version``."""
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
        with self._lock:
            if self._sent[0] == version and self._sent[1] is state_dict:
                return
            for name, t in state_dict.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
            meta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state_dict.items()]
            for g in self.generators:
                g._link.send(("weights", version, meta, self.bucket_bytes))
            _send_weights(list(state_dict.values()), meta, self.bucket_bytes, self.src, self.device)
            self._sent = (version, state_dict)

    def close(self) -> None:
        for g in self.generators:
            g._close()
        if self._owned:
            dist.destroy_process_group()
            self._owned = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
