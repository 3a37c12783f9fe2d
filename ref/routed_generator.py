"""Routed generator: the reference (readable Python, the specification).  Router and engine.

What it computes
    The serving side of RL rollouts.  Part 1, the router: several generators (inference
    engines) behind one router that spreads requests over them, retries a request elsewhere
    when a generator fails, and pushes trainer weights to every generator between or during
    generation.  Every completion says which weights produced it: the policy versions in
    force when the request was admitted and when it finished.  The router talks to a
    generator only through ``GeneratorProtocol`` (four members), so any engine (this file's
    own, or a vLLM or SGLang engine wrapped in a few lines) can sit behind it.
    Part 2, the generator: ``Generator`` serves ``DecoderLM``, a small decoder-only language
    model defined here (``ModelConfig``), one request at a time; ``serve_generator`` /
    ``DistributedWeightSync`` / ``RemoteGenerator`` put generators in other processes (other
    machines) behind the same protocol and broadcast trainer weights to them with
    torch.distributed.

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

The model (DecoderLM, pre-norm, no biases; x_0 = embed[token])
    per layer l   h = RMSNorm(x);  attention: q, k, v = h W_q, h W_k, h W_v (GQA: H_q heads read
                  KV head h // (H_q / H_kv)), rotary embedding (rotate-half, base rope_theta) on
                  q and k at each token's position, causal softmax(q k^T / sqrt(D)) v, then W_o;
                  or a "linear" layer from the ``linear_layer`` plug-in (e.g. Gated DeltaNet);
                  x += that;  x += W_down(silu(W_gate RMSNorm(x)) * W_up RMSNorm(x))
    output        logits = RMSNorm(x) E^T (tied) or RMSNorm(x) W_head^T, in fp32
    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w, computed in fp32.  Random init from ``seed``
    (drawn on the CPU, so every device gets the same weights), or ``load_state_dict``.

Sampling (per request; ``logits`` fp32 [V] at the last position)
    greedy (T = 0)  token = argmax (first index on ties); logprob = log_softmax(logits)[token]
    T > 0           logp = log_softmax(logits / T), p = exp(logp).  With top_k / top_p: sort p
                    descending (stable), keep the first top_k and the prefix whose mass before
                    each token is < top_p, zero the rest.  cdf = cumsum(p) in fp64 (sorted order
                    when filtered, vocabulary order when not); u = one uniform draw from the
                    request's own ``torch.Generator`` (seeded with ``seed``; a random seed when
                    None); token = the first index with cdf > u * cdf[-1].
                    logprob = logp[token]: the temperature-scaled model distribution before
                    top-k / top-p truncation, what a trainer recomputes from the same weights.
    stop            after a token in stop_token_ids (it is kept, finish "stop"), after
                    max_new_tokens tokens, or when prompt + output reach max_seq_len (finish
                    "length").  Same seed, same weights: same tokens.

The reference engine (Generator)
    One worker thread takes requests in submission order and runs each to completion: a
    prefill pass over the prompt that fills a contiguous per-request KV cache [capacity, H_kv, D]
    per attention layer (and the linear layers' own caches), then one forward pass per new
    token.  ``submit`` only enqueues.  ``load_weights`` validates the whole state dict first
    (a missing, unexpected or mis-shaped tensor rejects it whole: weights and version stay),
    then the worker copies it in between two requests, so a completion never spans two
    versions here (min == max).  It is the spec for tokens and logprobs.

Across processes (torch.distributed; gloo on CPU, NCCL on GPU; MASTER_ADDR/MASTER_PORT)
    trainer rank src: ``sync = DistributedWeightSync()``; ``sync.generators`` are
    ``RemoteGenerator`` proxies (GeneratorProtocol), one per other rank, to hand to a
    ``GeneratorRouter``.  Every other rank: ``serve_generator(Generator(...))``.
    requests      ride a ``multiprocessing.connection`` TCP link per generator (authenticated with
                  a key the trainer broadcasts over the process group); the proxy queues sends
                  on a sender thread, so ``submit`` never blocks
    weights       ``load_weights(sd, v)`` on any proxy first transfers version v to every
                  generator once (a header on each link, then one ``dist.broadcast`` per tensor
                  from src); the generator stages the complete set, and then each proxy's
                  ``load("v")`` message makes its generator load it.  Transfer and activation are
                  separate so the router's drain mode can activate each generator when it is
                  drained.  The version fence: a generator only ever loads a complete staged
                  set, through its own ``load_weights``, which switches between steps.

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
    ModelConfig     vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
                    num_kv_heads, head_dim (even), max_seq_len, rope_theta, rms_eps,
                    tie_embeddings, layer_types (None = all "attention", else one of
                    "attention" / "linear" per layer)
    linear_layer    plug-in ``(config, layer_index) -> nn.Module`` for "linear" layers, called as
                    ``m(x [1, T, hidden], cu_seqlens=cu [N+1] int32, cache=c)`` (prefill of N packed
                    sequences; training on documents with c None), ``m(x [B, T, hidden])`` (training
                    on B equal rows) and ``m(x [N, 1, hidden], cache=c)`` (a decode step);
                    ``m.new_cache()`` gives an empty cache whose tensor attributes hold the N
                    sequences on dim 0 once filled (ref/gated_deltanet.py's layer, with new_cache)

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
    Generator: ``submit`` raises ValueError for an empty prompt, a token id >= vocab_size, a
    prompt of max_seq_len tokens or more (no room to generate); ``load_weights`` raises
    TypeError / ValueError for a non-mapping, non-tensor or non-floating values, missing,
    unexpected or mis-shaped tensors, a version below the current one; RuntimeError after
    ``close()``.  Inference only (no autograd through the engine); ``DecoderLM.forward``
    trains.
    Limits: a generator whose futures never settle (neither result nor error) is not detected
    (there are no timeouts) and stalls a drain; the request at the head of the queue can no
    longer be cancelled; a done-callback of a router future runs in the thread that settled
    it and must not block on another router future or call ``sync_weights``.  Distributed: the
    process group is the trainer rank plus the generator ranks; a generator process that
    dies fails its proxy's requests (the router retries them elsewhere), but a weight
    transfer then times out after ``timeout_s`` (collectives need every rank): restart the
    group.  The link trusts its peers once authenticated (pickle), as torch.distributed does.

References
    vLLM router / SGLang model-gateway policies (round robin, least-loaded, cache-aware
    stickiness, power of two); Mitzenmacher, The Power of Two Choices in Randomized Load
    Balancing (2001); PipelineRL (Piche et al., 2025) in-flight weight updates; AReaL / slime /
    verl weight sync between trainer and rollout engines; Llama / Qwen decoder blocks (RMSNorm,
    RoPE, GQA, SwiGLU); Holtzman et al., nucleus sampling (2020).
"""
from __future__ import annotations

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
import threading
from collections import OrderedDict, deque
from concurrent.futures import CancelledError, Future, InvalidStateError
from collections.abc import Hashable, Iterable, Mapping
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


# ----------------------------------------------------------------------------- sampling

def _request_rng(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # a fresh random seed
    else:
        gen.manual_seed(seed)
    return gen


def _sample_row(logits: torch.Tensor, sp: SamplingParams, rng: torch.Generator) -> tuple[int, float]:
    """One token from fp32 logits [V] (the module docstring's rule) and its logprob."""
    if sp.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    inv_t = torch.tensor(1.0 / sp.temperature, dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits * inv_t, dim=-1)      # times an fp32 1/T: what a batched engine computes
    p = logp.exp()
    order = None
    if sp.top_k or sp.top_p < 1.0:
        p, order = torch.sort(p, descending=True, stable=True)
        keep = torch.ones_like(p, dtype=torch.bool)
        if sp.top_k:
            keep[sp.top_k:] = False
        if sp.top_p < 1.0:
            keep &= (torch.cumsum(p, dim=-1) - p) < sp.top_p              # mass before the token < top_p
        p = torch.where(keep, p, torch.zeros_like(p))
    cdf = torch.cumsum(p.double(), dim=-1)
    u = torch.rand((), generator=rng, dtype=torch.float64).to(cdf.device)
    index = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)
    # u * cdf[-1] may round up to cdf[-1]: stay on the last token that has probability.
    last = p.shape[-1] - 1 - int(torch.argmax((p.flip(-1) > 0).to(torch.int8)))
    index = min(int(index), last)
    token = index if order is None else int(order[index])
    return token, float(logp[token])


# ----------------------------------------------------------------------------- the reference engine

class _ContiguousCache:
    """One request's caches: K and V [capacity, H_kv, D] per attention layer, the linear layers' own."""

    def __init__(self, model: DecoderLM, capacity: int, device, dtype):
        c = model.config
        self.k, self.v, self.linear = {}, {}, {}
        for i, block in enumerate(model.layers):
            if block.self_attn is not None:
                self.k[i] = torch.zeros(capacity, c.num_kv_heads, c.head_dim, device=device, dtype=dtype)
                self.v[i] = torch.zeros_like(self.k[i])
            else:
                self.linear[i] = block.linear_attn.new_cache()
        self.scale = c.head_dim ** -0.5
        self.start = self.length = 0

    def advance(self, n: int) -> None:
        """The next forward pass feeds n tokens at positions length .. length + n - 1."""
        self.start, self.length = self.length, self.length + n

    def attend(self, i, q, k, v):
        end = self.length
        self.k[i][self.start:end] = k
        self.v[i][self.start:end] = v
        return _attention(q[None], self.k[i][None, :end], self.v[i][None, :end], self.scale)[0]

    def mix(self, i, module, h):
        if self.start == 0:  # prefill: one document
            cu = torch.tensor([0, h.shape[0]], dtype=torch.int32, device=h.device)
            return module(h[None], cu_seqlens=cu, cache=self.linear[i])[0]
        return module(h[None], cache=self.linear[i])[0]                   # decode: [1, 1, hidden]


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


class Generator:
    """The reference engine (module docstring): requests one at a time, weights loaded between them.

    ``Generator(config=None, *, state_dict=None, seed=0, name="generator", policy_version=0,
    linear_layer=None, device=None, dtype=None)``; ``close()`` (or ``with``) stops its thread and
    fails what is still queued.
    """

    def __init__(self, config: ModelConfig | None = None, *, state_dict=None, seed: int = 0, name: str = "generator",
                 policy_version: int = 0, linear_layer=None, device=None, dtype=None):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if not _is_int(policy_version):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        self.name = name
        self.device = torch.device("cpu" if device is None else device)
        self.model = DecoderLM(config, seed=seed, linear_layer=linear_layer, device=self.device, dtype=dtype).eval()
        self.config = self.model.config
        self.dtype = self.model.embed_tokens.weight.dtype
        self._shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        if state_dict is not None:
            self._copy_in(_checked_state_dict(state_dict, self._shapes))
        self._version = policy_version
        self._cv = threading.Condition()
        self._load_lock = threading.Lock()  # one load_weights at a time
        self._queue: deque = deque()
        self._load = None                   # (tensors, version, waiter) for the worker
        self._closed = False
        self._running = 0
        self._completed = 0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-worker", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request: Request) -> Future:
        """Queue one request; the future resolves to its ``Completion``.  Never blocks."""
        _check_request(request, self.config.vocab_size, self.config.max_seq_len)
        future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed")
            self._queue.append((request, future))
            self._cv.notify()
        return future

    def generate(self, requests) -> list[Completion]:
        """Submit every request, wait, return the completions in order (raises the first failure)."""
        futures = [self.submit(r) for r in list(requests)]
        return [f.result() for f in futures]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Validate, then load between two requests; returns when ``policy_version == version``."""
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        with self._load_lock:
            if version < self._version:
                raise ValueError(f"version must not decrease: got {version}, serving {self._version}")
            tensors = _checked_state_dict(state_dict, self._shapes)
            waiter = _Waiter()
            with self._cv:
                if self._closed:
                    raise RuntimeError(f"generator {self.name} is closed")
                self._load = (tensors, version, waiter)
                self._cv.notify()
            waiter.wait()

    def stats(self) -> dict:
        """waiting, running, completed, policy_version."""
        with self._cv:
            return dict(waiting=len(self._queue), running=self._running, completed=self._completed,
                        policy_version=self._version)

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

    # ------------------------------------------------------------------ the worker

    @torch.no_grad()
    def _copy_in(self, tensors: dict) -> None:
        params = self.model.state_dict()
        for n, t in tensors.items():
            params[n].copy_(t)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._load or self._closed):
                    self._cv.wait()
                load, self._load = self._load, None
                if load is None and self._closed:
                    leftover, self._queue = list(self._queue), deque()
                    break
                job = None if load is not None else self._queue.popleft()
                self._running = int(job is not None)
            if load is not None:  # between two requests
                tensors, version, waiter = load
                try:
                    self._copy_in(tensors)
                    self._version = version
                except Exception as exc:  # validated already; a device error lands here
                    waiter.set(exc)
                else:
                    waiter.set()
                continue
            request, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                completion = self._run_one(request)
            except Exception as exc:
                outcome = (future.set_exception, exc)
            else:
                outcome = (future.set_result, completion)
            with self._cv:
                self._running = 0
                self._completed += 1
            outcome[0](outcome[1])  # outside every lock: callbacks may submit again
        for _, future in leftover:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(f"generator {self.name} closed before serving the request"))

    @torch.no_grad()
    def _run_one(self, request: Request) -> Completion:
        """Prefill, then one forward pass per token, on a contiguous per-request cache."""
        sp, model, version = request.sampling, self.model, self._version
        prompt = request.prompt_token_ids
        n = len(prompt)
        limit = min(sp.max_new_tokens, self.config.max_seq_len - n)
        rng = _request_rng(sp.seed)
        cache = _ContiguousCache(model, n + limit - 1, self.device, self.dtype)
        cache.advance(n)
        h = model._hidden(torch.tensor(prompt, device=self.device), torch.arange(n, device=self.device),
                          cache.attend, cache.mix)
        tokens, logprobs = [], []
        while True:
            token, logprob = _sample_row(model._logits(h[-1]), sp, rng)
            tokens.append(token)
            logprobs.append(logprob)
            if token in sp.stop_token_ids:
                reason = "stop"
                break
            if len(tokens) == limit:
                reason = "length"
                break
            cache.advance(1)
            h = model._hidden(torch.tensor([token], device=self.device),
                              torch.tensor([cache.start], device=self.device), cache.attend, cache.mix)
        return Completion(request.request_id, list(prompt), tokens, logprobs, reason, self.name, version, version)


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


def _send_weights(tensors: dict, src: int, device) -> None:
    """The collective transfer, trainer side: one broadcast per tensor, in the header's order."""
    for t in tensors.values():
        dist.broadcast(t.detach().to(device).contiguous(), src)


def _recv_weights(meta: list, src: int, device) -> dict:
    """The collective transfer, generator side: receive every tensor the header announced."""
    out = {}
    for name, shape, dtype in meta:
        out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(out[name], src)
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
            self.transfers.put(message[1:])      # (version, meta): received by the weights thread
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
            version, meta = self.transfers.get()
            tensors = _recv_weights(meta, self.src, self.device)
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
    the generators connect to (default: the rendezvous host).  ``close()`` (or ``with``) ends the
    generators' ``serve_generator`` and leaves the group it joined.
    """

    def __init__(self, *, src: int = 0, backend: str | None = None, init_method: str | None = None,
                 rank: int | None = None, world_size: int | None = None, host: str | None = None,
                 timeout_s: float = 300.0):
        self._owned = _init_group(backend, init_method, rank, world_size, timeout_s)
        self.src, self.timeout_s = src, timeout_s
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
                g._link.send(("weights", version, meta))
            _send_weights(dict(state_dict), self.src, self.device)
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
