"""Generator engine: the fast version.  A serving engine built like vLLM's: continuous batching over
a paged KV cache, weights hot-swapped from a shadow copy, kernel plug-ins.

Example::

    # generator_engine.py and decoder_lm.py, copied next to this script
    from decoder_lm import DecoderLM, ModelConfig
    from generator_engine import Generator, Request, SamplingParams

    model = DecoderLM(ModelConfig(vocab_size=128, max_seq_len=64), seed=0)
    with Generator(model, kv_cache_memory=2 ** 24) as gen:                   # a 16 MiB cache
        group = gen.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=1.0, seed=0, n=2))])[0]
        print([c.token_ids for c in group], gen.stats()["max_seq_len"])

What it computes
    The same sampling rule and engine contract as ``ref/generator_engine.py``, the specification (read
    its docstring for the sampling math, the data types and the model protocol): ``Generator(model,
    ...)`` serves the caller's model (decoder_lm.py's ``DecoderLM``; ``Generator.from_pretrained(path,
    model_class=DecoderLM)`` a Hugging Face checkpoint).  On the same weights both engines give the same
    tokens and logprobs (fp32: tokens equal, logprobs to fp32 rounding; parity/ compares them).  What
    this file changes is how the work is done.

One iteration, and the method that does each phase (the engine thread's ``Generator._step``)
    1. pages          every decoding sample gets the page its next token's KV goes to; when no page is
                      free or evictable the newest admitted sample is preempted (its pages freed, back to
                      the head of the queue, recomputed later, mostly from the prefix cache)
                                                                      Scheduler.schedule, _grow_pages
    2. admission      prompts being prefilled resume, then waiting requests are admitted in arrival order
                      while a row per sample, their pages and ``max_prefill_tokens`` allow (a long prompt
                      is cut at a page boundary and goes on next iteration)     Scheduler._admit, _chunk
       drafts         speculative decoding: each decoding sample's drafter proposes up to k tokens; its
                      verification (its last token and the drafts) joins the prefill work (alone, with
                      ``compile=True`` / ``cuda_graphs=True``: the static step, k + 1 rows a sample)
                                                                      Scheduler.speculate, StaticDecode.verify
    3. prefill        one packed pass over that work: K/V scattered into the pages, ``varlen_attn`` over
                      the paged cache, the linear layers continued from their state rows
                                                                      ModelRunner.prefill
       verification   every verification row draws its token; drafts are accepted while they equal the
                      token drawn before them (the section "speculative decoding")
                                                                      Generator._verify, Scheduler.verified
       prompts done   a group's first sample forks its followers; the finished prompts sample their first
                      token                                           Scheduler.prompts_done, ModelRunner.sample
    4. decode         one batched step over the other decoding samples (``flash_decode`` writes the
                      new K/V into the pages and attends), inputs in buffers filled in place; with
                      ``compile=True`` the static step, padded and compiled     ModelRunner.decode,
                                                                      StaticDecode.run, Scheduler.decoded
    5. advance        each sample takes its token; finished ones settle their futures (outside every
                      lock) and free their pages and rows             ModelRunner.sample, Scheduler.advance

The parts
    Generator     the front: the engine thread, submit / generate, weights (load, receive, swap), tensor
                  parallelism, stats
    Scheduler     decides: queues, admission, pages (``_Pages``: the block allocator and prefix cache),
                  preemption, groups, prefix keys
    StatePools    holds: the KV pools, the block table, the linear layers' state rows and checkpoints,
                  sized by the memory plan (``plan_pools``)
    ModelRunner   computes: each pass's inputs, the forward with ``attend`` / ``mix`` over the pools,
                  sampling
    Indices: a sample's ``row`` (block table and state pools), a ``page``, a ``checkpoint``, a token's
    ``kv_index`` in the pool.  Options are one frozen ``EngineOptions``; what rank 0 tells its workers is
    typed records (``_Iteration``, ``_LoadShard``, ...).

Groups and the prefix cache (ref/generator_engine.py states the semantics: outputs do not change)
    pages        a page is free, held (refcounts: shared pages are held by every sample that reads them)
                 or cached (nobody holds it, it keeps its key, evicted least recently released first, a
                 chain's tail before its start: before anyone is preempted).  A full page's key is (parent
                 node, its token ids, the weights' version), with node ids never reused (exact keys).
    hits         at admission, the longest cached run of a request's full pages from position 0 (never the
                 page of its last token, whose logits are needed) is held instead of computed.  Keys are
                 registered at admission, pending until computed, so a request that would hit a page being
                 computed waits an iteration instead of computing it twice.  A weight swap makes every
                 older key unreachable; running requests keep their KV (``kv_on_swap="keep"``; their later
                 pages are not keyed) or re-prefill under the new weights (``"recompute"``).
    groups       ``SamplingParams(n=k)``: the first sample prefills the prompt; the others then share its
                 full pages, copy its partial last page and its linear layers' state (a fork), and sample
                 their first token from the same logits with their own seeds (seed + i).
    hybrid       "linear" layers (Gated DeltaNet) need their state at the hit's last token: a prefill
                 checkpoints it (every tensor of the layer's cache) at page boundaries, every
                 ``checkpoint_interval`` pages and at the pass's last full page (a decode step does when
                 it fills such a page); interior checkpoints cut those layers' call (the segments run in
                 rounds, the state carried).  A page without its checkpoint cannot end a hit.
    chunks       a prompt longer than the iteration's budget is prefilled over several iterations from its
                 written pages and its row's state; decoding requests step in each of them.

Weights
    ``load_weights`` validates the whole state dict, copies it into a second set of weights (the shadow; on
    a side CUDA stream that first waits for the last step that read those buffers), then hands it to the
    engine thread, which swaps the two sets between two iterations: decoding never stops for the copy,
    and a request running across the swap continues on the new weights (its max_policy_version says so;
    its KV keeps the old weights' keys, as in PipelineRL's in-flight updates).  ``connect_weights(receiver)``
    (or ``weight_receiver=``) connects a transport on every rank (fast/weight_sync.py's ``WeightReceiver``,
    or any object with ``receiver.connect(rank, size, tensors) -> endpoint``, ``endpoint.receive(version,
    header, tensors)`` raising on any failure, ``endpoint.timeout_s``, ``endpoint.close()``);
    ``receive_weights(version, header=...)`` then runs every rank's receive while decoding goes on and swaps
    only when every rank received everything: a refused or failed receive leaves every rank on the old
    weights and version.

Speculative decoding (``speculative="ngram"``, ``"mtp"`` or a drafter function; ref/generator_engine.py's
``generate`` states the rule and is the oracle)
    draft         ``drafter(tokens, k) -> up to k token ids`` per decoding sample and step (``ngram_draft``:
                  prompt lookup), or Qwen3.5's MTP head for every decoding sample at once (``MTPDrafter``:
                  its K/V in the page pool, one more attention layer per head layer; every depth in one
                  static call with compile / cuda_graphs: ``StaticDecode.draft``); cut to the
                  completion's room less one and to the free pages (a draft never preempts); a hybrid model
                  with checkpoints stops a draft at the next checkpointed page boundary (and drafts nothing
                  from one), so ``decoded`` checkpoints the right state
    verify        the sample's last token and its m drafts ride in the step's prefill pass (m + 1 rows at
                  their positions, their K/V into the pages; decode work: not counted against
                  ``max_prefill_tokens``); row r draws token j = generated + r with
                  ``keyed_uniform(seed, j)``, as plain decoding's step for it would; a draft is accepted
                  while it equals the token drawn before it, the first token that differs (or the one after
                  the last draft) is emitted too: plain decoding's tokens, the target's logprobs
    roll back     rejected rows' K/V lie past the sample's length (overwritten as it grows; their pages stay
                  with it); the linear layers ran over every row, so where a draft was rejected their state
                  rows go back to the state after the accepted rows from those layers' inputs in the pass
                  alone (``ModelRunner.roll_back``: a row before the first rejection saw accepted tokens
                  only): in the batch-invariant mode the layer drops the rejected rows from its chunk buffer
                  and rebuilds its conv state (``GatedDeltaNet.rewind``), else the rows go back to before
                  the pass (``StatePools.save_rows``) and the layer runs again over the accepted rows (vLLM
                  keeps k + 1 state slots instead); each emitted token then goes in as a decode step's
                  (``Scheduler.verified``): the prefix cache keys the same pages
    the mode      a verification row is computed as its decode step would be (a row's bits do not depend on
                  how many rows share the call), so rollouts stay bitwise on-policy (parity/test_speculative.py)
    tensor        every rank drafts for itself (the same tokens: the same drafts; a drafter function must be
    parallelism   picklable), verifies its shard, and takes rank 0's drawn tokens (``share_tokens``); the MTP
                  head is not sharded (speculative="mtp" raises)

Batch-invariant mode: bitwise on-policy (a model with ``batch_invariant=True``)
    Given a model in fast/decoder_lm.py's batch-invariant mode (its docstring states the contract), a
    request's tokens and per-token logprobs do not depend on which requests share its batch, when it
    joined, how its prompt was packed or chunked, whether it hit the prefix cache or was preempted; and
    the model's ``token_logprobs`` gives them bit for bit (``torch.equal``).  The engine's side: the prefill
    attends through ``varlen_attn(..., batch_invariant=True)``, a completion row (a decode step, or a
    recomputed one) reduces its keys in two segments, its prompt's and its own (``flash_decode(...,
    batch_invariant=True)`` twice, ``cache_leftpad``), merged as the trainer merges them; sampling takes the
    model's ``log_softmax``.  Tested bitwise under four CPU kernel families (parity/test_bitwise_blas.py)
    and on the sm_80/sm_90 builds; a GPU run is owed.

Memory, cost
    The pools share a budget (the section "memory budget"; ``stats()`` reports it).  Per generated token,
    FLOPs ~ 2 * (non-embedding parameters + hidden * vocab) + 4 * L_ctx * H_q * D per attention layer; a
    decode step over B requests moves at least the weights once plus each request's KV (bytes >= weight
    bytes + sum_b 2 L_b H_kv D elt per attention layer): weight-bound at small B, which is why batching wins.

Tensors and types
    As the reference: SamplingParams, Request, Completion (repeated in routed_generator.py so each file
    works alone; parity/test_copies.py keeps the copies equal), the model protocol (plus
    ``model.batch_invariant``, ``model.varlen_attn`` and ``model.log_softmax`` when the model has them).

Supported, and what raises
    As the reference (ValueError for an empty prompt, unknown token ids, a prompt of max_seq_len tokens or
    more, a state dict with missing, unexpected or mis-shaped tensors, rejected whole; TypeError for
    non-tensors; RuntimeError after ``close()``), plus RuntimeError from ``receive_weights`` when any rank's
    receive failed (weights and version unchanged), ValueError for a request (or a group of n samples) that
    can never fit the KV pool, a group larger than ``max_batch_size``, a memory budget too small for one
    sequence, engine knobs out of range, a batch-invariant model without ``varlen_attn`` or
    ``flash_decode``.  gpt-oss: a sliding layer's prefill attends within ``window_size=(W - 1, 0)``, its
    decode from ``cache_leftpad = used - W``, a static verification's rows each within theirs
    (``window_size=(W - 1, 0)``) (never through ``cascade_decode``: the window may not reach a group's
    prompt; the batch-invariant mode: each row's two segments from where its window starts,
    ``_two_segments``), sinks on every layer (inside the kernels).
    Inference only.  Limits: preemption recomputes (no swapping to host); a group's samples are admitted
    together (n free rows); the pages before a sliding layer's window stay allocated (the full layers
    share them).  ``compile=True``: the batch-invariant mode keeps its eager step (measured: compiled, 8 of
    15 decode logprobs of a tiny model moved by up to 6.6e-7: inductor fuses the norms and activations
    its own way), as do batches past the largest capture size, a group's cascade through a plug-in
    without a ``capturable`` keyword, and a verification beside a prompt's prefill (in the pass that
    iteration runs anyway), in the mode, or with sliding layers through a plug-in without a ``window_size``
    keyword (the eager pass); tensor-parallel engines compile each rank's step (the collectives between the
    compiled pieces).
    ``cuda_graphs=True`` (replaying the static step on a GPU) is written and in the GPU tier of the tests,
    not yet run on a GPU: off by default until it is; tensor-parallel engines do not replay graphs.

References
    vLLM (Kwon et al., PagedAttention, 2023) and its scheduler (continuous batching, recompute
    preemption); nano-vllm (scheduler / block manager / model runner); Orca (Yu et al., 2022,
    iteration-level scheduling); PipelineRL (Piche et al., 2025) in-flight weight updates; gpt-fast.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import inspect
import itertools
import math
import operator
import os
import pickle
import random
import sys
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import Future
from typing import NamedTuple
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SamplingParams", "Request", "Completion", "Generator"]


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



# ----------------------------------------------------------------------------- options

@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Every knob of a ``Generator`` (its docstring says what each does), checked once here; a
    tensor-parallel worker is sent this record as it is."""

    name: str = "generator"
    policy_version: int = 0
    varlen_attn: object = None
    flash_decode: object = None
    cascade_decode: object = None
    page_size: int = 16
    num_pages: int | None = None
    max_batch_size: int | None = None
    max_prefill_tokens: int = 8192
    prefix_caching: bool = True
    checkpoint_interval: int = 1
    num_checkpoints: int | None = None
    kv_on_swap: str = "keep"
    kv_cache_memory: int | None = None
    memory_utilization: float = 0.9
    max_seq_len: int | None = None
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0
    tp_address: str = "127.0.0.1"
    compile: bool = False
    cuda_graphs: bool = False
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    speculative: object = None
    num_speculative_tokens: int = 3

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        if not _is_int(self.policy_version):
            raise TypeError(f"policy_version must be an int, got {type(self.policy_version).__name__}")
        for field, least, optional in _COUNT_OPTIONS:
            value = getattr(self, field)
            if not (optional and value is None) and (not _is_int(value) or value < least):
                raise ValueError(f"{field} must be an int >= {least}, got {value!r}")
        for field in ("varlen_attn", "flash_decode", "cascade_decode"):
            fn = getattr(self, field)
            if fn is not None and not callable(fn):
                raise TypeError(f"{field} must be None or a function with that signature, got {type(fn).__name__}")
        for field in ("prefix_caching", "compile", "cuda_graphs"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool, got {type(getattr(self, field)).__name__}")
        sizes = self.capture_sizes
        if (not isinstance(sizes, tuple) or not sizes or not all(_is_int(n) and n >= 1 for n in sizes)
                or list(sizes) != sorted(set(sizes))):
            raise ValueError(f"capture_sizes must be a non-empty tuple of increasing ints >= 1, got {sizes!r}")
        if self.kv_on_swap not in ("keep", "recompute"):
            raise ValueError(f"kv_on_swap must be 'keep' or 'recompute', got {self.kv_on_swap!r}")
        if not _is_number(self.memory_utilization) or not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be a fraction in (0, 1], got {self.memory_utilization!r}")
        if not _is_number(self.tp_timeout_s) or not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be a number of seconds > 0, got {self.tp_timeout_s!r}")
        drafter = _drafter(self.speculative, self.num_speculative_tokens)
        if self.tensor_parallel_size > 1 and self.speculative == "mtp":
            raise ValueError("speculative='mtp' is not built for tensor-parallel engines (the MTP head is not "
                             "sharded): take 'ngram' or a drafter function")
        if self.tensor_parallel_size > 1 and drafter is not None:
            try:                                  # every rank drafts for itself: the workers get the function
                pickle.dumps(drafter)
            except Exception as exc:              # noqa: BLE001 (any pickling failure: the same advice)
                raise ValueError(f"a tensor-parallel engine's drafter must be picklable (a module-level function: "
                                 f"every rank runs it on the same tokens), got {drafter!r}: {exc}") from exc


# (field, least value, None allowed): the integer knobs
_COUNT_OPTIONS = (("page_size", 1, False), ("max_prefill_tokens", 1, False), ("checkpoint_interval", 1, False),
                  ("tensor_parallel_size", 1, False), ("num_pages", 1, True), ("max_batch_size", 1, True),
                  ("num_checkpoints", 0, True), ("kv_cache_memory", 1, True), ("max_seq_len", 1, True))


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- the engine's front

class Generator:
    """The fast engine (module docstring): continuous batching over a paged KV cache with prefix
    caching, groups, chunked prefill, hot-swapped weights.  Same contract as the reference's, plus
    the engine's knobs (``EngineOptions``):

    ``varlen_attn`` / ``flash_decode``  prefill / decode attention with those functions' signatures
                                        (default: plain PyTorch in this file); ``cascade_decode``: a
                                        group's samples decode side by side, their prompt read once
    ``kv_cache_memory``,                the memory budget of the KV pages, the linear layers' state rows
    ``memory_utilization``              and checkpoints: ``kv_cache_memory`` bytes, else (CUDA) that
                                        fraction of the GPU less the weights, the shadow weights and a
                                        measured activation peak, or (CPU) that fraction of half the
                                        available memory less the shadow weights (the section "memory
                                        budget"); ``stats()`` reports how it is spent
    ``page_size``, ``num_pages``        the KV pool (default: what the budget leaves, see above)
    ``max_batch_size``                  requests decoding at once (rows of the block table and of the
                                        state pools; default 256, fewer for a hybrid model whose states
                                        would take more than a quarter of the budget)
    ``max_seq_len``                     the longest sequence (default: the model's, capped by what the
                                        pool holds; one that does not fit raises ValueError before
                                        anything is allocated).  A pool too small for the load is not an
                                        error: admission waits and running requests are preempted
                                        (recomputed later, mostly from the prefix cache).  Measured: 32
                                        requests of 64 + 64 tokens on a pool of 8 sequences' pages made
                                        20 preemptions, recomputed 1317 tokens and took 2.5x the time
                                        of a pool for all 32 (bench/decoder_lm.py --part pool)
    ``max_prefill_tokens``              prompt tokens computed per iteration: a longer prompt is
                                        prefilled over several iterations (cut at page boundaries)
                                        while the running requests keep decoding
    ``prefix_caching``                  reuse cached pages (and checkpoints) across requests; off: no
                                        page outlives its request (groups still share their prompt)
    ``checkpoint_interval``             hybrid models: a prefill checkpoints the linear layers' state
                                        every this many pages (and at its last full page); each
                                        interior checkpoint splits those layers' prefill call
    ``num_checkpoints``                 checkpoint slots (default: a quarter of the budget, at most one
                                        per page, for a hybrid model with prefix caching)
    ``kv_on_swap``                      "keep" (running requests keep the KV of the old weights) or
                                        "recompute" (they re-prefill under the new ones)
    ``tensor_parallel_size``,           N processes, one shard each (the section "tensor parallelism");
    ``tp_timeout_s``, ``tp_address``    a worker dead or silent for tp_timeout_s fails the generator
    ``weight_receiver``                 a weight transport connected on every rank (``connect_weights``)
    ``compile``, ``cuda_graphs``,       decode through the static step (the section "the static decode
    ``capture_sizes``                   step"): a batch padded to the next of ``capture_sizes`` (larger
                                        ones run eagerly; a step with a group's cascade takes it through
                                        ``cascade_decode(..., capturable=True)``, eagerly with a plug-in
                                        that has no such keyword), compiled by
                                        ``torch.compile`` (one compile per padded size and kind of step,
                                        whatever the weights: seconds to minutes on a CPU) and / or, on
                                        CUDA, replayed from a graph captured per padded size and weight
                                        set (its inputs copied into the graph's buffers; sampling stays
                                        outside: it reads the logits a replay leaves).  Tokens equal the
                                        eager step's, logprobs to rounding.  Measured on the 2-core CPU
                                        (bench/decoder_lm.py --part engine-compiled): the README's table.
                                        The batch-invariant mode keeps the eager step under compile
                                        (graphs replay its kernels, hybrid models' too); tensor-parallel
                                        engines compile each rank's step but replay no graphs; a warning
                                        says which.
                                        ``cuda_graphs`` is off by default until a GPU run has tested it.
    ``speculative``,                    None, ``"ngram"`` (prompt lookup), ``"mtp"`` (Qwen3.5's MTP head:
    ``num_speculative_tokens``          the model built with ``mtp=True``) or a drafter function ``(tokens,
                                        k) -> up to k token ids``: verify up to k drafts per decoding
                                        sample and step (the section "speculative decoding"); the same
                                        tokens as plain decoding; with ``compile`` / ``cuda_graphs`` a
                                        verification alone in its iteration runs the static step too, as
                                        do the MTP head's drafts (every depth in one call)
    A model in the batch-invariant mode (``model.batch_invariant``) makes the engine batch-invariant (the
    module docstring): it then needs ``varlen_attn`` (default: the model's) and ``flash_decode``.
    ``Generator.from_pretrained(path, model_class=DecoderLM, ...)`` serves a checkpoint.
    """

    def __init__(self, model: nn.Module, *, name: str = "generator", policy_version: int = 0, varlen_attn=None,
                 flash_decode=None, cascade_decode=None, page_size: int = 16, num_pages: int | None = None,
                 max_batch_size: int | None = None, max_prefill_tokens: int = 8192, prefix_caching: bool = True,
                 checkpoint_interval: int = 1, num_checkpoints: int | None = None, kv_on_swap: str = "keep",
                 kv_cache_memory: int | None = None, memory_utilization: float = 0.9, max_seq_len: int | None = None,
                 tensor_parallel_size: int = 1, tp_timeout_s: float = 60.0, tp_address: str = "127.0.0.1",
                 compile: bool = False, cuda_graphs: bool = False, capture_sizes: tuple = EngineOptions.capture_sizes,
                 speculative=None, num_speculative_tokens: int = 3, weight_receiver=None, _tp_worker=None):
        opts = EngineOptions(
            name=name, policy_version=policy_version, varlen_attn=varlen_attn, flash_decode=flash_decode,
            cascade_decode=cascade_decode, page_size=page_size, num_pages=num_pages, max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens, prefix_caching=prefix_caching,
            checkpoint_interval=checkpoint_interval, num_checkpoints=num_checkpoints, kv_on_swap=kv_on_swap,
            kv_cache_memory=kv_cache_memory, memory_utilization=memory_utilization, max_seq_len=max_seq_len,
            tensor_parallel_size=tensor_parallel_size, tp_timeout_s=tp_timeout_s, tp_address=tp_address,
            compile=compile, cuda_graphs=cuda_graphs, capture_sizes=capture_sizes, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens)
        self.options, self.name, self._tp, self._broken = opts, opts.name, _tp_worker, None
        if opts.tensor_parallel_size > 1 and _tp_worker is None:   # rank 0: starts the workers, keeps its shard
            self._tp = _TensorParallel(opts)
            model = self._tp.start(model)
        try:
            self._build(model, opts)
        except BaseException:                            # (tensor-parallel: the workers end too)
            if isinstance(self._tp, _TensorParallel):
                self._tp.kill()
            raise
        self._thread = None
        if _tp_worker is None:                           # a worker runs its loop in its main thread
            self._thread = threading.Thread(target=self._loop, name=f"{self.name}-engine", daemon=True)
            self._thread.start()
        if isinstance(self._tp, _TensorParallel):
            self._tp.watch(self._tp_failed)
        self._endpoint = None                            # this rank's weight receiver (connect_weights)
        if weight_receiver is not None:
            try:
                self.connect_weights(weight_receiver)
            except BaseException:
                self.close()
                raise

    def _build(self, model: nn.Module, opts: EngineOptions) -> None:
        """The model's checks, the memory plan, the three parts, the weights' bookkeeping."""
        _check_model(model)
        self.batch_invariant = bool(getattr(model, "batch_invariant", False))
        varlen_attn = opts.varlen_attn if opts.varlen_attn is not None else getattr(model, "varlen_attn", None)
        if self.batch_invariant and (varlen_attn is None or opts.flash_decode is None):
            raise ValueError("a batch-invariant model needs varlen_attn (fast/paged_varlen_attention.varlen_attn) and "
                             "flash_decode (fast/flash_decoding.flash_decode): a prefill and a decode step then round "
                             "a row as the trainer's token_logprobs does; the in-file default attention does not")
        self.model, self.config = model.eval(), model.config
        self.device, self.dtype = next(model.parameters()).device, next(model.parameters()).dtype
        full_shape = getattr(model, "full_shape", lambda name, shape: tuple(shape))
        self._shapes = {n: tuple(full_shape(n, t.shape)) for n, t in model.state_dict().items()}   # what loads take
        self._optional = _tied_aliases(model)
        self._ignored = tuple(getattr(model, "ignored_weight_prefixes", ()))
        self._version = opts.policy_version
        attention = _AttentionFns(varlen_attn or _torch_varlen_attn, opts.flash_decode or _torch_flash_decode,
                               opts.cascade_decode, dict(batch_invariant=True) if self.batch_invariant else {})
        self.memory, state_shapes = plan_pools(model, opts, attention, self._tp)
        self.max_seq_len, self.num_pages = self.memory.max_seq_len, self.memory.num_pages
        self.max_batch_size, self.num_checkpoints = self.memory.max_batch_size, self.memory.num_checkpoints
        self.page_size, self.max_prefill_tokens = opts.page_size, opts.max_prefill_tokens
        self.prefix_caching, self.checkpoint_interval, self.kv_on_swap = (opts.prefix_caching, opts.checkpoint_interval,
                                                                          opts.kv_on_swap)
        self._cv = threading.Condition()
        # the static decode step: compiled (not in the mode: inductor changes its rounding; tensor-parallel too,
        # each rank its own, the collectives between its compiled pieces) and / or replayed from CUDA graphs (the
        # mode too: the same kernels, its Gated DeltaNet step a dense chunk-form call with nothing on the host;
        # not tensor-parallel: collectives inside a captured graph have not run on a multi-GPU machine here)
        graphs = opts.cuda_graphs and self.device.type == "cuda"
        compiled = opts.compile and (COMPILE_THE_MODE or not self.batch_invariant)
        if graphs and opts.tensor_parallel_size > 1:
            graphs = False
            warnings.warn("Generator(cuda_graphs=True): tensor-parallel engines do not replay CUDA graphs (collectives "
                          "inside a captured graph are untested across GPUs); each rank decodes " +
                          ("through its compiled static step" if compiled else "eagerly"), stacklevel=3)
        if opts.compile and not compiled:
            warnings.warn("Generator(compile=True): the batch-invariant mode keeps its eager decode step (compiled, "
                          "inductor changes its rounding: engine logprobs would no longer equal token_logprobs bit "
                          "for bit; cuda_graphs=True replays its own kernels)", stacklevel=3)
        static = graphs or compiled
        mtp = opts.speculative == "mtp"
        if mtp and getattr(model, "mtp", None) is None:
            raise ValueError("speculative='mtp' needs a model with Qwen3.5's MTP head: decoder_lm.py's "
                             "DecoderLM(..., mtp=True) or DecoderLM.from_pretrained(path, mtp=True)")
        self.pools = StatePools(model, self.memory, state_shapes, padding=static, mtp=mtp)
        self.scheduler = Scheduler(opts, self.memory, self.pools, hybrid="linear" in self.config.kinds, lock=self._cv,
                                   group_decode=opts.cascade_decode is not None and not self.batch_invariant,
                                   version=self._version)
        self.runner = ModelRunner(model, self.pools, attention, self.memory, self.batch_invariant, self._tp)
        if mtp:                                         # (the drafter runs the head through the runner)
            self.scheduler.drafter = MTPDrafter(self.runner, lambda: self.model)
        if static:
            self.runner.static = StaticDecode(self.runner, opts.capture_sizes, self.max_batch_size, compile=compiled,
                                              cuda_graphs=graphs, rows=1 + opts.num_speculative_tokens
                                              if opts.speculative is not None else 1)
        if isinstance(self._tp, _TensorParallel):
            self._tp.ready()                              # every worker sized its pools alike
        self._load_lock = threading.Lock()
        self._staged = None                 # (version, future): the shadow weights, swapped in before the next step
        self._closed = False
        self._weights = _ShadowWeights(self.device)
        self._incoming: list[_Seq] = []     # submitted (under _cv), taken by the engine at its next iteration

    @classmethod
    def from_pretrained(cls, path, *, model_class, linear_layer=None, **kwargs) -> Generator:
        """A generator serving the Hugging Face checkpoint at ``path``: ``model_class.from_pretrained(path,
        linear_layer=..., moe_layer=..., dtype=..., device=..., max_seq_len=..., batch_invariant=..., varlen_attn=...)``
        (fast/decoder_lm.py's ``DecoderLM``; those keywords go to it when given, ``varlen_attn`` and
        ``max_seq_len`` to both: an explicit max_seq_len must fit the memory budget; ``mtp=True``, the MTP
        head, is implied by ``speculative="mtp"``), the other keywords to ``Generator``."""
        if not callable(getattr(model_class, "from_pretrained", None)):
            raise TypeError(f"model_class must have a from_pretrained(path, ...) classmethod (decoder_lm.py's "
                            f"DecoderLM), got {model_class!r}")
        model_kw = {k: kwargs.pop(k) for k in _MODEL_KEYWORDS if k in kwargs}
        if kwargs.get("speculative") == "mtp":          # the head drafts: load it (mtp.*) with the model
            model_kw.setdefault("mtp", True)
        for shared in ("varlen_attn", "max_seq_len"):  # the model's and the engine's
            if shared in model_kw or shared in kwargs:
                model_kw[shared] = kwargs[shared] = model_kw.get(shared, kwargs.get(shared))
        if kwargs.get("tensor_parallel_size", 1) != 1:   # each rank reads its own shard of the checkpoint
            return cls(_Checkpoint(model_class, path, dict(model_kw, linear_layer=linear_layer)), **kwargs)
        return cls(model_class.from_pretrained(path, linear_layer=linear_layer, **model_kw), **kwargs)

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request) -> Future:
        """Queue one request; the future resolves to its ``Completion`` (a list of n with
        ``sampling.n > 1``).  Never blocks."""
        self.scheduler.check_servable(request, self.config)
        if self._tp is not None:   # every rank must draw alike: a random seed is drawn once, here
            request = self._tp.with_seed(request)
        future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed"
                                   + (f" ({self._broken})" if self._broken is not None else ""))
            if self._tp is not None and not future.set_running_or_notify_cancel():
                return future
            self._incoming.append(_Seq.leader(request, future, self.max_seq_len))
            self._cv.notify()
        return future

    def generate(self, requests) -> list:
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
            tensors = _checked_state_dict(state_dict, self._shapes, self._optional, self._ignored)
            if self._tp is not None:  # each worker copies its shard into its shadow meanwhile
                self._tp.send_weights(self.model, tensors)
                tensors = self.model.shard_state_dict(tensors)
            self._weights.copy(self.model, tensors)
            if self._tp is not None:
                self._tp.wait_weights()
            self._stage_and_wait(version)

    def connect_weights(self, receiver) -> None:
        """Connect a weight transport's receiver on every rank (module docstring, "receiving"): later
        versions come through ``receive_weights``.  Raises what a rank's connect raised (rank 0's own
        error as it is, a worker's as RuntimeError); no receiver is connected then, until a connect
        succeeds."""
        if not callable(getattr(receiver, "connect", None)):
            raise TypeError(f"receiver must have connect(rank, size, tensors) (fast/weight_sync.py's WeightReceiver), "
                            f"got {type(receiver).__name__}")
        with self._load_lock:
            if self._tp is not None:
                self._tp.tell_workers(_Connect(receiver))
            try:
                endpoint, error = self._connect_endpoint(receiver), None
            except Exception as exc:  # noqa: BLE001 - raised below, once the workers answered
                endpoint, error = None, exc
            bound = self.options.tp_timeout_s + float(getattr(receiver, "timeout_s", 0.0))
            errors = self._tp_answers(bound) if self._tp is not None else []
            if error is None and not errors:
                return
            self._endpoint = None         # receive_weights refuses until a connect succeeds on every rank
            if endpoint is not None:
                endpoint.close()
            if error is not None:
                raise error
            raise RuntimeError(f"generator {self.name}: connect_weights failed on " + "; ".join(errors))

    def receive_weights(self, version: int | None, *, header=None) -> None:
        """Take weights ``version`` from the connected receiver on every rank, into the shadow weights
        while decoding goes on, and swap between two steps once every rank received all of it; raises
        RuntimeError when any rank's receive failed (a bucket refused, a timeout, a dead trainer): every
        rank then keeps the weights and version it serves.  ``header`` is the sender's control message
        for this sync (fast/weight_sync.py's ``WeightSender.header``).  ``version`` None: only (re)form
        the transport's channels."""
        if self._endpoint is None:
            raise RuntimeError(f"generator {self.name} has no weight receiver: connect_weights(receiver) first")
        if version is not None and not _is_int(version):
            raise TypeError(f"version must be an int or None, got {type(version).__name__}")
        with self._load_lock:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed")
            if version is not None and version < self._version:
                raise ValueError(f"version must not decrease: got {version}, serving {self._version}")
            if self._tp is not None:  # every worker receives its own shard meanwhile
                self._tp.tell_workers(_Receive(version, header))
            errors = []
            try:
                self._receive_shard(version, header)
            except Exception as exc:  # noqa: BLE001 - the sync is refused below, once the workers answered
                errors.append(f"rank 0: {type(exc).__name__}: {exc}")
            if self._tp is not None:
                errors += self._tp_answers(self.options.tp_timeout_s + float(getattr(self._endpoint, "timeout_s", 0)))
            if errors:
                raise RuntimeError(f"generator {self.name}: weights version {version} refused whole (still serving "
                                   f"version {self._version}): " + "; ".join(errors))
            if version is not None:
                self._stage_and_wait(version)

    def stats(self) -> dict:
        """waiting, running (prefilling or decoding), completed, policy_version; free_pages (free or
        evictable), num_pages, page_size, steps, preemptions, generated_tokens, weights_staged;
        prompt_tokens (requested, per sample), computed_prompt_tokens (run through the model,
        recomputation after preemption included), prefix_hit_tokens (skipped: cached or a group's
        shared prompt), evictions, cached_pages (keyed pages, held or not), state_checkpoints; the
        memory (``MemoryPlan.report``): memory_budget_bytes and memory_budget_source, kv_pool_bytes (the K
        and V pools of every attention layer), kv_tokens (the tokens they hold), kv_bytes_per_token,
        state_slot_bytes (the linear layers' state rows), checkpoint_capacity_bytes (what the checkpoints
        may take) and checkpoint_bytes (what they hold: allocated at the first prefill that writes one;
        num_checkpoints x, per linear layer, every tensor of its cache: the fp32 recurrent state and the
        conv state, and in the batch-invariant mode the chunk buffer), max_seq_len; decode_steps,
        static_decode_steps (those through the static step, compiled or replayed) and static_decode_shapes
        (the (padded batch, table width in pages) it ran at), static_cascade_steps (those of them with a
        group's cascade), static_verify_steps (speculative verifications through it: not decode steps),
        static_draft_steps (the MTP head's drafts through it); cuda_graph_sizes (the padded batches captured)
        and cuda_graph_bytes (what their memory pool reserved); draft_tokens and accepted_draft_tokens
        (speculative decoding: proposed, and accepted by verification) and acceptance_lengths (how many
        verifications accepted 0, 1, ..., num_speculative_tokens drafts)."""
        with self._cv:
            sched = self.scheduler
            return dict(waiting=sched.waiting_samples(self._incoming), running=sched.running_samples(),
                        policy_version=self._version, num_pages=self.num_pages, page_size=self.page_size,
                        weights_staged=self._staged is not None, **copy.deepcopy(sched.counts), **sched.pages.report(),
                        **self.memory.report(), checkpoint_bytes=self.pools.checkpoint_bytes(),
                        tensor_parallel_size=1 if self._tp is None else self._tp.size,
                        **self._static_report())

    def _static_report(self) -> dict:
        static, steps = self.runner.static, self.runner.decode_steps
        if static is None:
            return dict(decode_steps=steps, static_decode_steps=0, static_decode_shapes=[], static_cascade_steps=0,
                        static_verify_steps=0, static_draft_steps=0, cuda_graph_sizes=[], cuda_graph_bytes=0)
        return dict(decode_steps=steps, static_decode_steps=static.steps, static_decode_shapes=sorted(static.shapes),
                    static_cascade_steps=static.cascade_steps, static_verify_steps=static.verify_steps,
                    static_draft_steps=static.draft_steps, cuda_graph_bytes=static.graph_bytes,
                    cuda_graph_sizes=sorted({size for _, size, _ in static.graphs}))

    def close(self) -> None:
        """Stop the engine (what is queued or running fails) and, tensor-parallel, every worker process."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._tp is not None:
            self._tp.close()
        if getattr(self, "_endpoint", None) is not None:
            self._endpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the loop

    @torch.no_grad()
    def _step(self, settle: list) -> None:
        """One iteration (the module docstring's table): schedule, run, advance."""
        plan = self.scheduler.schedule()                   # pages for the decoders (or preemption), admission
        verify = self.scheduler.speculate(plan.decode, self.config.vocab_size)   # drafts, to verify in the pass
        verifying = {id(c.seq) for c in verify}
        decode = [s for s in plan.decode if id(s) not in verifying]
        mtp = self.scheduler.drafter if isinstance(self.scheduler.drafter, MTPDrafter) else None
        if plan.prefill or verify:                         # one packed pass; prompts done fork and sample
            saved = self.pools.save_rows([c.seq.row for c in verify]) if verify and self.scheduler.hybrid else None
            static = self.runner.static if verify and not plan.prefill else None    # verification alone: static
            static_verified, logits = static.verify(self.model, verify) if static is not None else (False, None)
            if not static_verified:
                logits = self.runner.prefill(self.model, plan.prefill + verify)
            if mtp is not None:                            # the head's rows of the prompts (before they fork)
                mtp.prefilled(self.model, plan.prefill, self.runner.hidden)
            started, rows = self.scheduler.prompts_done(plan.prefill)
            if started:
                self.scheduler.advance(started, *self.runner.sample(self.model, started, logits, rows), settle)
            if verify:
                rows = sum(len(c.drafts) + 1 for c in verify)
                self._verify(verify, None if logits is None else logits[logits.shape[0] - rows:],
                             self.runner.hidden[-rows:], saved, settle,
                             padded=self.runner.static.rows_per_seq if static_verified else 0)
        if decode:                                         # one token for every other decoding sample
            logits = self.runner.decode(self.model, decode)
            if mtp is not None:
                mtp.observe([(s, len(s.tokens) - 1, self.runner.hidden[n:n + 1]) for n, s in enumerate(decode)])
            self.scheduler.decoded(decode)
            self.scheduler.advance(decode, *self.runner.sample(self.model, decode, logits), settle)
        self.scheduler.counts["steps"] += 1

    def _verify(self, chunks: list, logits: torch.Tensor, hidden: torch.Tensor, saved: dict | None,
                settle: list, padded: int = 0) -> None:
        """Speculative verification (ref/generator_engine.py's ``generate`` states the rule): every row of
        each chunk draws its token with its own keyed draw; the drafts are accepted while each equals the
        token drawn before it, and the first token that differs (or the one after the last draft) is emitted
        too: plain decoding's tokens.  Rejected rows' KV lies past the sample's length (overwritten later);
        a hybrid model's linear layers, which ran over every row, go back to their state before the pass
        (``ModelRunner.roll_back``: those layers only, their rejected rows dropped where the layer can, else
        rerun over the accepted rows; in the batch-invariant mode bit for bit what the decode steps would have
        left; after the static verification, whose linear layers ran over ``padded`` rows a chunk, every chunk
        that kept fewer).  The MTP drafter keeps the accepted rows' hidden states (``hidden``: the chunks' rows
        of the pass)."""
        tokens, logprobs = self.runner.sample_verification(self.model, chunks, logits)
        outcomes, redo, at = [], [], 0
        for n, c in enumerate(chunks):
            drawn = tokens[at:at + len(c.drafts) + 1]
            accepted = 0
            while accepted < len(c.drafts) and drawn[accepted] == c.drafts[accepted]:
                accepted += 1
            outcomes.append((drawn[:accepted + 1], logprobs[at:at + accepted + 1]))
            if accepted < len(c.drafts) or accepted + 1 < padded:
                redo.append(n)
            at += len(c.drafts) + 1
        if isinstance(self.scheduler.drafter, MTPDrafter):     # the accepted rows' hidden states
            starts = [0, *itertools.accumulate(len(c.drafts) + 1 for c in chunks)]
            self.scheduler.drafter.observe([(c.seq, c.start, hidden[a:a + len(drawn)])
                                            for c, a, (drawn, _) in zip(chunks, starts, outcomes)])
        if saved is not None and redo:
            self.runner.roll_back(chunks, [len(outcomes[n][0]) if n in redo else 0 for n in range(len(chunks))],
                                  saved)
        for c, (drawn, lps) in zip(chunks, outcomes):
            self.scheduler.verified(c, drawn, lps, settle)

    def _loop(self) -> None:
        """The engine thread: take what was submitted and any staged weights, run an iteration, settle the
        futures outside every lock; a failed iteration fails the requests it held (tensor-parallel: the
        generator stops, its ranks may no longer agree)."""
        while True:
            with self._cv:
                while not (self._incoming or self.scheduler.busy() or self._staged or self._closed):
                    self._cv.wait()
                if self._closed:
                    break
                incoming, self._incoming = self._incoming, []
                staged, self._staged = self._staged, None
            settle: list = []
            try:
                if self._tp is not None:      # the workers take the same iteration: its requests and swap
                    self._tp.send_iteration(incoming, None if staged is None else staged[0])
                self.scheduler.enqueue(incoming)
                if staged is not None:
                    self._swap(*staged)
                self._step(settle)
            except Exception as exc:  # fail the requests that hit it; the engine goes on (tensor-parallel: it stops)
                if self._tp is not None:
                    self._break(exc)
                self.scheduler.fail_admitted(exc if self._broken is None else
                                             RuntimeError(f"generator {self.name} failed: {exc}"), settle)
            for fn, value in settle:  # outside every lock: callbacks may submit again
                fn(value)
            if self._broken is not None:
                break
        self._shutdown()

    def _shutdown(self) -> None:
        """After the loop: what is staged, queued or running fails (closed, or broken)."""
        with self._cv:
            staged, self._staged = self._staged, None
            leftover = self._incoming + self.scheduler.drain()
            self._incoming = []
        if staged is not None:
            staged[1].set_exception(RuntimeError(f"generator {self.name} closed before the weights were swapped in"))
        closed, settle = RuntimeError(f"generator {self.name} closed before finishing the request"
                                      + (f": {self._broken}" if self._broken is not None else "")), []
        for seq in leftover:
            group = seq.group
            if not group.failed and (group.future.running() or group.future.set_running_or_notify_cancel()):
                group.fail(closed, settle)
        for fn, value in settle:
            fn(value)

    # ------------------------------------------------------------------ weights

    def _stage_and_wait(self, version: int) -> None:
        """Hand the shadow weights to the engine thread, which swaps them in between two iterations."""
        swapped = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed")
            self._staged = (version, swapped)
            self._cv.notify()
        swapped.result()

    def _swap(self, version: int, swapped: Future) -> None:
        """Between two steps: the shadow weights become the live ones, the old ones the shadow (the scheduler
        makes older pages unreachable, or recomputes every request with kv_on_swap="recompute")."""
        self.model = self._weights.swap(self.model)
        self._version = version
        self.scheduler.swap(version, recompute=self.kv_on_swap == "recompute")
        swapped.set_result(None)

    def _connect_endpoint(self, receiver):
        """This rank's side of connect_weights."""
        rank, size = (0, 1) if self._tp is None else (self._tp.rank, self._tp.size)
        endpoint = receiver.connect(rank, size, self.model.state_dict())
        old, self._endpoint = self._endpoint, endpoint
        if old is not None:
            old.close()
        return endpoint

    @torch.no_grad()
    def _receive_shard(self, version, header) -> None:
        """This rank's side of receive_weights: its shard into its shadow weights (version None: connect)."""
        if version is None:
            self._endpoint.receive(None, header, None)
            return
        shadow = self._weights.of(self.model)
        with self._weights.writes():
            self._endpoint.receive(version, header, shadow.state_dict())

    # ------------------------------------------------------------------ tensor parallelism, faults

    def _tp_answers(self, bound_s: float) -> list:
        """The workers' answers to a weights message (errors, [] when all went well).  A worker silent
        for bound_s after rank 0's part ended breaks the generator: its ranks may no longer agree."""
        try:
            return self._tp.answers(bound_s)
        except RuntimeError as exc:
            self._tp_failed(exc)
            raise

    def _break(self, exc: BaseException) -> None:
        """Tensor-parallel: a step failed on some rank (a worker died, hung past tp_timeout_s, or raised), so
        the ranks may no longer agree: the generator stops for good (a router's fault policy takes over)
        and its workers are ended."""
        self._broken = exc
        with self._cv:
            self._closed = True
        self._tp.kill()

    def _tp_failed(self, exc: BaseException) -> None:
        """The workers' watchdog: a worker died while the engine waited (no collective to notice it)."""
        with self._cv:
            if self._closed:
                return
            self._broken, self._closed = exc, True
            self._cv.notify()

    def _serve_as_worker(self) -> None:
        """A tensor-parallel worker's loop: rank 0's iterations, one by one (its requests, its swap), each
        run with this rank's shard; rank 0 samples, this rank takes its tokens."""
        while True:
            message = self._tp.control.recv()
            if isinstance(message, _Close):
                return
            self.scheduler.enqueue([_Seq.leader(Request(prompt, SamplingParams(**sampling), request_id), Future(),
                                                self.max_seq_len) for request_id, prompt, sampling in message.requests])
            if message.swap_version is not None:
                self._swap(message.swap_version, Future())
            self._step([])

    def _load_shard(self, tensors: dict) -> None:
        """A worker's share of a weight load: its shard into its shadow weights (swapped at rank 0's word)."""
        self._weights.copy(self.model, tensors)

class _ShadowWeights:
    """The second weight set a load fills while decoding goes on (module docstring, "Weights").  On CUDA its
    writes run on a side stream that first waits for the caller's stream (whatever produced the new tensors)
    and for the last step that read these buffers (they held the previous weights)."""

    def __init__(self, device: torch.device):
        self.device, self.model, self.retired, self.stream = device, None, None, None

    def of(self, live: nn.Module) -> nn.Module:
        if self.model is None:                         # allocated once, by the first load (no random init)
            self.model = _shadow_of(live)
        return self.model

    @torch.no_grad()
    def copy(self, live: nn.Module, tensors: dict) -> None:
        params = self.of(live).state_dict()
        with self.writes():
            for n, t in tensors.items():
                params[n].copy_(t, non_blocking=self.device.type == "cuda")

    @contextlib.contextmanager
    def writes(self):
        if self.device.type != "cuda":
            yield
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.retired is not None:
            self.stream.wait_event(self.retired)
        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()

    def swap(self, live: nn.Module) -> nn.Module:
        """The shadow becomes the live weights; the live ones become the shadow, retired after the last step
        that read them.  Returns the new live model."""
        self.model, live = live, self.model
        if self.device.type == "cuda":
            self.retired = torch.cuda.Event()
            self.retired.record()
        return live


# ----------------------------------------------------------------------------- the scheduler: decides

class _Pages:
    """The KV pool's block allocator, with prefix caching (module docstring: "Groups and the prefix cache").

    A physical page is free, held (refcount > 0: in running requests' block tables) or cached
    (refcount 0 but keyed: evictable, least recently released first, and released tail first so a
    chain loses its end before its start).  A full page's key is (its parent's node id, its token
    ids, the weights' version); node ids are never reused, so a key is exact and a chain whose parent
    was evicted is unreachable.  A key registered before its page is computed is pending: a request
    that would hit it waits an iteration.  Checkpoints (models with "linear" layers): slots holding
    those layers' state after a page's last token, attached to the page, the least recently used
    given up when none is free."""

    def __init__(self, num_pages: int, num_checkpoints: int):
        self.free = list(range(num_pages - 1, -1, -1))
        self.refs = [0] * num_pages
        self.cached: OrderedDict = OrderedDict()        # page -> None: nobody holds it, it keeps its key
        self.page_of: dict = {}                         # key -> page
        self.key_of: dict = {}                          # page -> (key, node id)
        self.pending: set = set()                       # keyed pages whose KV is not computed yet
        self.checkpoint_of: OrderedDict = OrderedDict()  # page -> checkpoint, least recently used first
        self.free_checkpoints = list(range(num_checkpoints - 1, -1, -1))
        self.next_node = 1
        self.evictions = 0

    def available(self, hits=()) -> int:
        """Pages an allocation can take (free or evictable), leaving ``hits`` (about to be held) alone."""
        return len(self.free) + len(self.cached) - sum(p in self.cached for p in hits)

    def allocate(self) -> int:
        if self.free:
            page = self.free.pop()
        else:
            page, _ = self.cached.popitem(last=False)
            self._forget(page)
            self.evictions += 1
        self.refs[page] = 1
        return page

    def hold(self, page: int) -> None:
        self.cached.pop(page, None)
        self.refs[page] += 1

    def release(self, pages: list) -> None:
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of and page not in self.pending:
                    self.cached[page] = None
                else:
                    self._forget(page)
                    self.free.append(page)

    def match(self, chunks: list, version: int, need_checkpoint: bool) -> tuple[list, bool]:
        """(the pages of the longest cached run of these full-page token chunks from position 0, whether
        a pending page cut it).  With ``need_checkpoint`` the run ends on a page that has one."""
        node, pages, blocked = 0, [], False
        for chunk in chunks:
            page = self.page_of.get((node, chunk, version))
            if page is None:
                break
            if page in self.pending:
                blocked = True
                break
            pages.append(page)
            node = self.key_of[page][1]
        while need_checkpoint and pages and pages[-1] not in self.checkpoint_of:
            pages.pop()
        if pages and need_checkpoint:
            self.checkpoint_of.move_to_end(pages[-1])
        return pages, blocked

    def register(self, page: int, node: int, chunk: tuple, version: int, pending: bool) -> int:
        """Key ``page`` as the full page ``chunk`` after chain node ``node``; returns its node id.  When
        that key is registered already (the same tokens computed twice), this page stays unkeyed and
        the chain goes on through the other one."""
        key = (node, chunk, version)
        if key in self.page_of:
            return self.key_of[self.page_of[key]][1]
        self.page_of[key] = page
        self.key_of[page] = (key, self.next_node)
        if pending:
            self.pending.add(page)
        self.next_node += 1
        return self.next_node - 1

    def checkpoint_for(self, page: int) -> int | None:
        """A checkpoint for ``page`` (keyed, without one): a free one or the least recently used."""
        if page not in self.key_of or page in self.checkpoint_of:
            return None
        if self.free_checkpoints:
            slot = self.free_checkpoints.pop()
        elif self.checkpoint_of:
            _, slot = self.checkpoint_of.popitem(last=False)
        else:
            return None
        self.checkpoint_of[page] = slot
        return slot

    def drop_older(self, version: int) -> None:
        """New weights: pages keyed under an older version are never hit again (cached ones are freed)."""
        for page in [p for p, (key, _) in self.key_of.items() if key[2] < version]:
            self._forget(page)
            if page in self.cached:                     # nobody holds it: free now (held ones when released)
                del self.cached[page]
                self.free.append(page)

    def report(self) -> dict:
        return dict(free_pages=self.available(), evictions=self.evictions, cached_pages=len(self.key_of),
                    state_checkpoints=len(self.checkpoint_of))

    def _forget(self, page: int) -> None:
        entry = self.key_of.pop(page, None)
        if entry is not None:
            del self.page_of[entry[0]]
        self.pending.discard(page)
        slot = self.checkpoint_of.pop(page, None)
        if slot is not None:
            self.free_checkpoints.append(slot)


class _Group:
    """The n samples of one submitted request: one future, settled when the last sample is done."""

    __slots__ = ("request", "future", "completions", "left", "failed", "admitted")

    def __init__(self, request: Request, future: Future):
        self.request, self.future = request, future
        self.completions = [None] * request.sampling.n
        self.left = request.sampling.n
        self.failed = self.admitted = False

    def done(self, completion: Completion, settle: list) -> None:
        self.completions[completion.sample_index] = completion
        self.left -= 1
        if self.left == 0 and not self.failed:
            result = self.completions if self.request.sampling.n > 1 else completion
            settle.append((self.future.set_result, result))

    def fail(self, exc: BaseException, settle: list) -> None:
        if not self.failed and self.left > 0:
            self.failed = True
            settle.append((self.future.set_exception, exc))


class _Seq:
    """One sample inside the engine.  ``tokens`` = prompt + generated; ``pages`` hold the KV of the
    first ``computed`` tokens (every token but the last, once decoding: the next step feeds it).
    ``row``: its row of the block table and of the linear layers' state pools while admitted.
    ``node`` / ``keyed``: the prefix-cache chain through its first ``keyed`` full pages (None once a
    weight swap makes its KV unkeyable).  A group's first sample carries the others (``followers``)
    until its prompt is prefilled; then they fork from it."""

    __slots__ = ("group", "index", "tokens", "n_prompt", "logprobs", "seed", "limit", "pages", "row",
                 "computed", "node", "keyed", "kv_version", "min_version", "followers", "spare", "admitted", "mtp")

    def __init__(self, group: _Group, index: int, max_seq_len: int):
        sp = group.request.sampling
        self.group, self.index = group, index
        self.tokens = list(group.request.prompt_token_ids)
        self.n_prompt = len(self.tokens)
        self.limit = min(sp.max_new_tokens, max_seq_len - self.n_prompt)
        self.logprobs: list[float] = []
        self.seed = request_seed(None if sp.seed is None else sp.seed + index)   # token j draws keyed_uniform(seed, j)
        self.pages: list[int] = []
        self.row = None
        self.computed, self.node, self.keyed, self.kv_version = 0, 0, 0, None
        self.min_version = None
        self.followers: list = []
        self.spare: list = []               # (row, partial page or None) reserved for each follower
        self.admitted = 0                   # admission order (preemption takes the newest)
        self.mtp = None                     # speculative="mtp": its head's rows (_MTPRows), None until computed

    @classmethod
    def leader(cls, request, future: Future, max_seq_len: int) -> _Seq:
        """A request's first sample, carrying the others of its group."""
        group = _Group(request, future)
        seq = cls(group, 0, max_seq_len)
        seq.followers = [cls(group, i, max_seq_len) for i in range(1, request.sampling.n)]
        return seq


class PrefillChunk(NamedTuple):
    """A sample's prefill work in one iteration: its tokens start .. end - 1, and the checkpoints of its
    linear layers' state taken in the pass, [(boundary token, checkpoint)] (interior ones cut those layers'
    call there).  A speculative verification is a chunk too: the sample's last token, then ``drafts``
    (positions len(tokens) - 1 .. end - 1), every row's logits wanted."""
    seq: _Seq
    start: int
    end: int
    cuts: tuple
    drafts: tuple = ()

    def tokens(self) -> list:
        return self.seq.tokens[self.start:self.end - len(self.drafts)] + list(self.drafts)


class StepPlan(NamedTuple):
    """What an iteration runs: one decode step for ``decode`` (each has the page its next KV goes to), one
    packed prefill pass over ``prefill``."""
    decode: list
    prefill: list


class Admission(enum.Enum):
    ADMITTED = "admitted"
    WAIT = "wait"               # its row, pages or a page being computed: next iteration
    CANCELLED = "cancelled"     # the caller cancelled the future before it started


class Scheduler:
    """Decides (the module docstring's table, phases 1, 2 and 5): which requests run, their pages and rows,
    preemption, groups, the prefix cache's keys.  ``waiting`` (arrival order; preempted samples go back to
    its head) is shared with ``stats()`` under ``lock``; the rest is the engine thread's."""

    def __init__(self, opts: EngineOptions, plan: MemoryPlan, pools: StatePools, *, hybrid: bool, group_decode: bool,
                 lock, version: int):
        self.name, self.page_size, self.budget = opts.name, opts.page_size, opts.max_prefill_tokens
        self.group_decode, self.max_seq_len, self.max_batch_size = group_decode, plan.max_seq_len, plan.max_batch_size
        self.num_pages = plan.num_pages
        self.prefix_caching, self.checkpoint_interval = opts.prefix_caching, opts.checkpoint_interval
        self.hybrid, self.lock, self.version, self.pools = hybrid, lock, version, pools
        self.drafter, self.num_speculative_tokens = _drafter(opts.speculative, opts.num_speculative_tokens), \
            opts.num_speculative_tokens
        self.checkpointing = hybrid and opts.prefix_caching and plan.num_checkpoints > 0
        self.pages = _Pages(plan.num_pages, plan.num_checkpoints)
        self.free_rows = list(range(plan.max_batch_size - 1, -1, -1))
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []    # admitted, prompt not all computed yet (chunked prefill)
        self.running: list[_Seq] = []       # decoding
        self.admissions = itertools.count()
        self.counts = dict(completed=0, steps=0, preemptions=0, generated_tokens=0, prompt_tokens=0,
                           computed_prompt_tokens=0, prefix_hit_tokens=0, draft_tokens=0, accepted_draft_tokens=0,
                           acceptance_lengths=[0] * (opts.num_speculative_tokens + 1))

    # ------------------------------------------------------------------ phases 1 and 2: the plan

    def schedule(self) -> StepPlan:
        """Pages for the decoders' next tokens (preempting the newest request when none is left), then the
        prefill work: prompts being prefilled resume, waiting requests are admitted in arrival order while
        a row per sample, their pages and the token budget allow.  Cuts fall on page boundaries."""
        decode = self._grow_pages()
        with self.lock:
            work, budget = [], self.budget
            for seq in self.prefilling:
                if budget <= 0:
                    break
                work.append(self._chunk(seq, budget))
                budget -= work[-1].end - work[-1].start
            while self.waiting and budget > 0:
                admission = self._admit(self.waiting[0])
                if admission is Admission.WAIT:
                    break
                seq = self.waiting.popleft()
                if admission is Admission.ADMITTED:
                    work.append(self._chunk(seq, budget))
                    budget -= work[-1].end - work[-1].start
        return StepPlan(decode, work)

    def _grow_pages(self) -> list:
        """Give every decoding sample the page its next token's KV goes to; when the pool has no free or
        evictable page, preempt the newest admitted sample (prefilling ones first: they are newer)."""
        running, ps, k = self.running, self.page_size, 0
        while k < len(running):
            seq = running[k]
            if len(seq.pages) >= -(-len(seq.tokens) // ps):
                k += 1
            elif self.pages.available():
                page = self.pages.allocate()
                self.pools.set_pages(seq.row, len(seq.pages), [page])
                seq.pages.append(page)
            else:
                self.preempt(self.prefilling.pop() if self.prefilling else running.pop())
        if self.group_decode:       # a group's samples side by side (cascade decode reads their prompt once)
            by_group: dict = {}
            for s in running:
                by_group.setdefault(id(s.group), []).append(s)
            self.running = running = [s for members in by_group.values() for s in members]
        return list(running)

    def speculate(self, decode: list, vocab_size: int) -> list:
        """Speculative decoding: for each decoding sample the drafter proposes up to num_speculative_tokens
        (fewer where the completion has less room, less one: a verification emits drafts + 1 tokens) and the
        sample's verification chunk takes pages for them from the free ones (no preemption for a draft: it
        is cut to the pages there are; the MTP head's draft rows write K/V ahead, so it takes them first).
        A hybrid model with checkpoints never verifies past the next checkpointed page boundary, nor from
        one: ``verified`` checkpoints with the state after the last verified row, which is the boundary's
        only there.  Returns the verification chunks."""
        if self.drafter is None:
            return []
        rooms, batched = [], isinstance(self.drafter, MTPDrafter)
        for seq in decode:
            length = len(seq.tokens)
            room = min(self.num_speculative_tokens, seq.limit - (length - seq.n_prompt) - 1)
            if self.checkpointing and self.prefix_caching:
                stride = self.checkpoint_interval * self.page_size
                room = 0 if length % stride == 0 else min(room, stride - length % stride)
            if room > 0 and batched:
                room = min(room, self._take_pages(seq, length + room) - length)
            rooms.append(max(room, 0))
        if batched:
            drafts = self.drafter.propose(decode, rooms)
        else:
            drafts = [list(self.drafter(list(s.tokens), r))[:r] if r > 0 else [] for s, r in zip(decode, rooms)]
        chunks = []
        for seq, draft in zip(decode, drafts):
            if not all(_is_int(t) and 0 <= t < vocab_size for t in draft):
                raise ValueError(f"the drafter proposed {draft}: token ids must be ints in [0, {vocab_size})")
            length = len(seq.tokens)
            draft = draft[:self._take_pages(seq, length + len(draft)) - length]
            if draft:
                chunks.append(PrefillChunk(seq, length - 1, length + len(draft), (), tuple(draft)))
                self.counts["draft_tokens"] += len(draft)
        return chunks

    def _take_pages(self, seq: _Seq, tokens: int) -> int:
        """Free pages for ``seq`` until its pages hold ``tokens`` tokens or none is left; returns what they
        hold."""
        ps = self.page_size
        while len(seq.pages) * ps < tokens and self.pages.available():
            page = self.pages.allocate()
            self.pools.set_pages(seq.row, len(seq.pages), [page])
            seq.pages.append(page)
        return len(seq.pages) * ps

    def verified(self, chunk: PrefillChunk, tokens: list, logprobs: list, settle: list) -> None:
        """A verification's outcome: ``tokens`` are the accepted drafts and the token after them.  Each goes
        in as a decode step's would (the KV of the token before it is written: ``decoded``, then ``advance``),
        so pages are keyed and checkpointed exactly as plain decoding keys them."""
        self.counts["accepted_draft_tokens"] += len(tokens) - 1
        self.counts["acceptance_lengths"][len(tokens) - 1] += 1
        for token, logprob in zip(tokens, logprobs):
            self.decoded([chunk.seq])
            self.advance([chunk.seq], [token], [logprob], settle)
            if chunk.seq.row is None:                   # finished (a stop token, its length): released
                return

    def _chunk(self, seq: _Seq, budget: int) -> PrefillChunk:
        """The next piece of ``seq``'s prompt within ``budget`` tokens, cut at a page boundary when it can be,
        with its checkpoints: every checkpoint_interval pages and at the pass's last full page."""
        start, end, ps = seq.computed, len(seq.tokens), self.page_size
        if end - start > budget:
            aligned = (start + budget) // ps * ps
            end = aligned if aligned > start else start + budget
        stride = self.checkpoint_interval * ps
        marks = set(range(start - start % stride + stride, end + 1, stride)) | {end - end % ps}
        cuts = tuple(sorted((b, cp) for b in marks if start < b <= end for cp in [self.checkpoint_for(seq, b)]
                            if cp is not None))
        return PrefillChunk(seq, start, end, cuts)

    def _admit(self, seq: _Seq) -> Admission:
        """Take a row per sample and the pages ``seq``'s tokens need beyond its cached prefix (plus a page
        per follower for the prompt's partial last page); nothing is taken unless all of it is."""
        ps, pages, n = self.page_size, self.pages, 1 + len(seq.followers)
        if len(self.free_rows) < n:
            return Admission.WAIT
        chunks = [tuple(seq.tokens[j * ps:(j + 1) * ps]) for j in range(len(seq.tokens) // ps)]
        hits = []
        if self.prefix_caching:       # never the page of the last token: its logits give the next sample
            hits, blocked = pages.match(chunks[:(len(seq.tokens) - 1) // ps], self.version, self.hybrid)
            if blocked:
                return Admission.WAIT
        partial = len(seq.tokens) % ps != 0
        if -(-len(seq.tokens) // ps) - len(hits) + (n - 1) * partial > pages.available(hits):
            return Admission.WAIT
        group = seq.group
        if group.failed:
            return Admission.CANCELLED
        if not group.admitted:             # its first admission (a cancelled request leaves here)
            if not (group.future.running() or group.future.set_running_or_notify_cancel()):
                return Admission.CANCELLED
            group.admitted = True
            self.counts["prompt_tokens"] += n * seq.n_prompt
        for page in hits:
            pages.hold(page)
        seq.pages = hits + [pages.allocate() for _ in range(-(-len(seq.tokens) // ps) - len(hits))]
        seq.row = self.free_rows.pop()
        seq.spare = [(self.free_rows.pop(), pages.allocate() if partial else None) for _ in seq.followers]
        seq.admitted, seq.computed, seq.kv_version = next(self.admissions), len(hits) * ps, self.version
        self.counts["prefix_hit_tokens"] += seq.computed
        self.pools.set_pages(seq.row, 0, seq.pages)
        if self.prefix_caching:   # key the pages it will compute now, so that nobody computes them twice
            seq.node = 0
            for j, chunk in enumerate(chunks):
                seq.node = pages.register(seq.pages[j], seq.node, chunk, self.version, pending=j >= len(hits))
            seq.keyed = len(chunks)
        if self.hybrid:
            self.pools.start_row(seq.row, pages.checkpoint_of.get(hits[-1]) if hits else None)
        self.prefilling.append(seq)
        return Admission.ADMITTED

    def checkpoint_for(self, seq: _Seq, boundary: int) -> int | None:
        """A checkpoint for the page of ``seq`` that ends at token ``boundary`` (None: no checkpoint is
        wanted there, or the page is not keyed to this sample)."""
        if not self.checkpointing or boundary % self.page_size:
            return None
        j = boundary // self.page_size - 1
        if j >= seq.keyed or seq.node is None or j >= len(seq.pages):
            return None
        return self.pages.checkpoint_for(seq.pages[j])

    # ------------------------------------------------------------------ phase 5: after the passes

    def prompts_done(self, work: list) -> tuple[list, list]:
        """After a prefill pass over ``work``: its pages are computed (hits from the next iteration on), the
        state at each pass's end is checkpointed where wanted; a sample whose prompt is done starts
        decoding, a group's first one with its followers (forked).  Returns (the samples that sample their
        first token now, the pass's finished-prompt row each samples from)."""
        ps, started, rows = self.page_size, [], []
        self.counts["computed_prompt_tokens"] += sum(c.end - c.start for c in work)
        for chunk in work:
            s = chunk.seq
            for page in s.pages[chunk.start // ps:chunk.end // ps]:
                self.pages.pending.discard(page)
            for boundary, checkpoint in chunk.cuts:
                if boundary == chunk.end:                # (interior ones were taken by the linear layers)
                    self.pools.save_checkpoint(checkpoint, s.row)
            s.computed = chunk.end
        done = [c.seq for c in work if c.end == len(c.seq.tokens)]
        self.prefilling = [s for s in self.prefilling if s not in done]
        for n, s in enumerate(done):
            if s.min_version is None:
                s.min_version = self.version
            started += [s, *self._fork(s)]
            rows += [n] * (1 + len(s.followers))
            s.followers = []
        self.running = self.running + started           # (what an error in sampling fails)
        return started, rows

    def _fork(self, seq: _Seq) -> list:
        """A group's first sample finished its prompt: the others share its full prompt pages, take a
        copy of its partial last page and of its linear layers' state, and decode from there."""
        ps, n = self.page_size, len(seq.tokens)
        full = seq.pages[:n // ps]
        forks = []
        for follower, (row, page) in zip(seq.followers, seq.spare):
            for p in full:
                self.pages.hold(p)
            follower.pages = full + ([page] if page is not None else [])
            if page is not None:                        # the prompt's partial last page: written per sample
                self.pools.copy_page(seq.pages[n // ps], page)
            follower.row = row
            self.pools.copy_row(seq.row, row)
            follower.computed, follower.node, follower.keyed = seq.computed, seq.node, seq.keyed
            follower.kv_version, follower.min_version = seq.kv_version, seq.min_version
            follower.mtp = seq.mtp                      # (the head's prompt rows: in the pages just shared)
            follower.admitted = next(self.admissions)
            self.pools.set_pages(row, 0, follower.pages)
            self.counts["prefix_hit_tokens"] += n
            forks.append(follower)
        seq.spare = []
        return forks

    def decoded(self, seqs: list) -> None:
        """After a decode step: each fed token's KV is written, so a page may be full: key it (with a
        checkpoint where one is due)."""
        ps = self.page_size
        for seq in seqs:
            seq.computed = len(seq.tokens)
            if not self.prefix_caching or seq.node is None:
                continue
            if seq.kv_version != self.version:          # its KV mixes two weight versions: never a hit
                seq.node = None
                continue
            while (seq.keyed + 1) * ps <= seq.computed:
                j = seq.keyed
                seq.node = self.pages.register(seq.pages[j], seq.node, tuple(seq.tokens[j * ps:(j + 1) * ps]),
                                               self.version, pending=False)
                seq.keyed += 1
                if (j + 1) % self.checkpoint_interval == 0:
                    checkpoint = self.checkpoint_for(seq, (j + 1) * ps)
                    if checkpoint is not None:
                        self.pools.save_checkpoint(checkpoint, seq.row)

    def advance(self, seqs: list, tokens: list, logprobs: list, settle: list) -> None:
        """Each sample takes its token; one that stops (a stop token, its length) settles its completion and
        frees its pages and row."""
        finished = set()
        for s, token, logprob in zip(seqs, tokens, logprobs):
            s.tokens.append(token)
            s.logprobs.append(logprob)
            generated = len(s.tokens) - s.n_prompt
            if token in s.group.request.sampling.stop_token_ids:
                reason = "stop"
            elif generated >= s.limit:
                reason = "length"
            else:
                continue
            self.release(s)
            finished.add(id(s))
            r = s.group.request
            s.group.done(Completion(r.request_id, list(r.prompt_token_ids), s.tokens[s.n_prompt:], s.logprobs, reason,
                                    self.name, s.min_version, self.version, s.index), settle)
            self.counts["completed"] += 1
            self.counts["generated_tokens"] += generated
        self.running = [s for s in self.running if id(s) not in finished]

    # ------------------------------------------------------------------ what can never be served

    def check_servable(self, request, config) -> None:
        """ValueError / TypeError for a request this engine can never serve (a router then keeps it): bad
        fields, a prompt without room to generate, a group larger than the rows, one that can never fit the
        pool."""
        prompt, sp = getattr(request, "prompt_token_ids", None), getattr(request, "sampling", None)
        if not isinstance(prompt, list) or not hasattr(sp, "max_new_tokens"):
            raise TypeError(f"request must be a Request (prompt_token_ids, sampling, request_id), "
                            f"got {type(request).__name__}")
        _check_sampling(sp)
        if not all(_is_int(t) for t in prompt):
            raise TypeError("prompt_token_ids must hold ints (token ids)")
        c, n = config, len(prompt)
        if not n:
            problem = "at least one token, got an empty prompt"
        elif max(prompt) >= c.vocab_size or min(prompt) < 0:
            problem = f"token ids in [0, {c.vocab_size}), got {max(prompt)}"
        elif n >= self.max_seq_len:
            problem = f"a prompt shorter than max_seq_len={self.max_seq_len}, got {n} tokens (no room to generate)"
        else:
            problem = None
        if problem:
            raise ValueError(f"prompt_token_ids must hold {problem}")
        if sp.n > self.max_batch_size:
            raise ValueError(f"request {request.request_id}: a group of n={sp.n} samples decodes at once, and "
                             f"max_batch_size is {self.max_batch_size}")
        kv_tokens = n + min(sp.max_new_tokens, self.max_seq_len - n) - 1   # the last token's K/V is never needed
        shared = n // self.page_size                                     # the prompt's full pages, shared
        need = shared + sp.n * (-(-kv_tokens // self.page_size) - shared)
        if need > self.num_pages:
            raise ValueError(f"request {request.request_id} needs {need} pages of {self.page_size} KV slots "
                             f"({sp.n} sample(s) of up to {kv_tokens} tokens); the pool has only {self.num_pages}: "
                             f"it can never fit")


    # ------------------------------------------------------------------ preemption, swaps, failures

    def enqueue(self, leaders: list) -> None:
        with self.lock:
            self.waiting.extend(leaders)

    def preempt(self, seq: _Seq, count: bool = True) -> None:
        """Free what ``seq`` holds and put it first in line; it keeps its tokens and generator (its
        followers, if its prompt was not prefilled yet, go back with it)."""
        for s in [seq, *seq.followers]:
            self.release(s)
        seq.computed, seq.node, seq.keyed, seq.kv_version = 0, 0, 0, None
        if count:
            self.counts["preemptions"] += 1
        with self.lock:
            self.waiting.appendleft(seq)

    def release(self, seq: _Seq) -> None:
        """Give back a sample's pages (cached ones stay cached), its row and its followers' reservations."""
        self.pages.release(seq.pages)
        seq.pages, seq.mtp = [], None
        for row, page in seq.spare:
            self.free_rows.append(row)
            if page is not None:
                self.pages.release([page])
        seq.spare = []
        if seq.row is not None:
            self.free_rows.append(seq.row)
            seq.row = None

    def swap(self, version: int, recompute: bool) -> None:
        """New weights: no page of an older version is hit again; ``recompute``: every admitted sample goes
        back to the queue to be prefilled anew under the new weights."""
        self.version = version
        self.pages.drop_older(version)
        if recompute:
            for seq in sorted(self.prefilling + self.running, key=lambda s: s.admitted, reverse=True):
                self.preempt(seq, count=False)
            self.prefilling, self.running = [], []

    def fail_admitted(self, exc: BaseException, settle: list) -> None:
        """A failed iteration: every admitted sample fails (one that finished in it keeps its result)."""
        for seq in self.prefilling + self.running:
            if seq.row is not None:
                self.release(seq)
                seq.group.fail(exc, settle)
        self.prefilling, self.running = [], []

    def drain(self) -> list:
        """Everything not finished, taken out (under the lock): the engine is stopping."""
        out = list(self.waiting) + self.prefilling + self.running
        self.waiting.clear()
        self.prefilling, self.running = [], []
        return out

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def waiting_samples(self, incoming: list) -> int:
        return sum(1 + len(s.followers) for s in [*incoming, *self.waiting])

    def running_samples(self) -> int:
        return len(self.running) + len(self.prefilling)


# ----------------------------------------------------------------------------- the state pools: hold

class StatePools:
    """Holds the engine's state, sized by the memory plan: the K and V pools of every attention layer
    [layers, num_pages, page_size, H_kv, D] (zeros: finite), the block table [max_batch_size, pages per
    sequence] int32 (a row per admitted sample), the linear layers' state rows {layer: {name: [max_batch_size,
    ...]}} (zeros: a fresh row is a sequence at position 0) and their checkpoints {layer: {name:
    [num_checkpoints, ...]}} (allocated at the first one taken).  Four indices, four names: a sample's
    ``row`` (block table and state pools), a ``page`` of the KV pool, a ``checkpoint``, and a token's
    ``kv_index`` (page * page_size + offset: its place in the pool seen as [pages * page_size, H_kv, D]).
    ``padding``: one more page and one more state row past the plan's (``pad_page``, ``pad_row``), never
    handed out: the static decode step's padding rows write there.  ``mtp``: the MTP head's layers
    (num_layers + d) get pools too (``ModelRunner.mtp_rows``)."""

    def __init__(self, model: nn.Module, plan: MemoryPlan, state_shapes: dict, padding: bool = False,
                 mtp: bool = False):
        c = model.config
        local = getattr(model, "local_config", c)       # this rank's heads under tensor parallelism
        p = next(model.parameters())
        self.device, self.page_size, self.num_checkpoints = p.device, plan.page_size, plan.num_checkpoints
        attention = _attention_layers(c, mtp)
        self.pool_index = {layer: j for j, layer in enumerate(attention)}
        self.pages_per_seq = -(-plan.max_seq_len // plan.page_size)
        self.pad_page, self.pad_row = plan.num_pages, plan.max_batch_size
        kv_shape = (len(attention), plan.num_pages + padding, plan.page_size, local.num_kv_heads, local.head_dim)
        self.k, self.v = _zeros(kv_shape, p.dtype, p.device), _zeros(kv_shape, p.dtype, p.device)
        self.table = torch.zeros(plan.max_batch_size, self.pages_per_seq, dtype=torch.int32, device=p.device)
        self.states = {layer: {name: _zeros((plan.max_batch_size + padding, *shape), dtype, p.device)
                               for name, (shape, dtype) in shapes.items()} for layer, shapes in state_shapes.items()}
        self.checkpoints: dict[int, dict[str, torch.Tensor]] = {}
        self._table_updates: dict = {}                  # (row, column) -> page, not yet in the table
        self._staging = _Staging(p.device)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One attention layer's K and V pools [num_pages, page_size, H_kv, D]."""
        j = self.pool_index[layer]
        return self.k[j], self.v[j]

    def set_pages(self, row: int, first: int, pages: list) -> None:
        """Block-table entries (row, first + j) = pages[j], written at the next flush (last write wins: a
        preempted sample's row may be reused in the same iteration)."""
        for j, page in enumerate(pages):
            self._table_updates[(row, first + j)] = page

    def flush_table(self) -> None:
        if self._table_updates:
            keys, pages = list(self._table_updates), list(self._table_updates.values())
            self._table_updates = {}
            index = self._staging.put("table_index", [[r for r, _ in keys], [c for _, c in keys]], torch.int64)
            self.table.index_put_((index[0], index[1]), self._staging.put("table_pages", pages, torch.int32))

    def start_row(self, row: int, checkpoint: int | None) -> None:
        """An admitted sample's linear-layer state: the checkpoint of its last cached page, or zeros (a
        fresh start) when it starts at position 0."""
        for layer, pools in self.states.items():
            for name, pool in pools.items():
                if checkpoint is None:
                    pool[row].zero_()
                else:
                    pool[row] = self.checkpoints[layer][name][checkpoint]

    def save_checkpoint(self, checkpoint: int, row: int) -> None:
        """The linear layers' state of the sample in ``row`` into ``checkpoint``."""
        for layer, pools in self.states.items():
            for name, pool in pools.items():
                self.checkpoint_store(layer, name, pool)[checkpoint] = pool[row]

    def checkpoint_store(self, layer: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s checkpoints of state ``name`` [num_checkpoints, *like.shape[1:]] (allocated on
        first use)."""
        store = self.checkpoints.setdefault(layer, {})
        if name not in store:
            store[name] = torch.zeros(self.num_checkpoints, *like.shape[1:], dtype=like.dtype, device=like.device)
        return store[name]

    def copy_row(self, src: int, dst: int) -> None:
        """A forked sample's linear-layer state: its group's first sample's."""
        for pools in self.states.values():
            for pool in pools.values():
                pool[dst] = pool[src]

    def copy_page(self, src: int, dst: int) -> None:
        """Every attention layer's K and V of page ``src`` into page ``dst`` (a prompt's partial last page)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def save_rows(self, rows: list) -> dict:
        """Every linear layer's state of ``rows`` (copies): a speculative verification's restore point."""
        index = torch.tensor(rows, device=self.device)
        return {layer: {name: pool[index] for name, pool in pools.items()} for layer, pools in self.states.items()}

    def restore_rows(self, saved: dict, rows: list, which: list, layers=None) -> None:
        """Rows ``rows[n]`` for n in ``which`` back to ``saved`` (``save_rows(rows)``), in ``layers`` (all)."""
        index, pick = (torch.tensor(x, device=self.device) for x in ([rows[n] for n in which], which))
        for layer, pools in self.states.items():
            if layers is not None and layer not in layers:
                continue
            for name, pool in pools.items():
                pool[index] = saved[layer][name][pick]

    def gather(self, layer: int, rows: torch.Tensor, cache) -> None:
        """Layer ``layer``'s state of ``rows`` into the plug-in's ``cache`` (its fields by name)."""
        for name, pool in self.states.get(layer, {}).items():
            setattr(cache, name, pool[rows])

    def scatter(self, layer: int, cache, rows: torch.Tensor) -> None:
        """The plug-in's ``cache`` (rows in the order of ``rows``) back into layer ``layer``'s state rows."""
        pools = self.states[layer]
        for name, value in vars(cache).items():
            if isinstance(value, torch.Tensor):
                pools[name][rows] = value

    def checkpoint_bytes(self) -> int:
        # (list(...): the engine thread may add a store while stats() reads)
        return sum(t.nbytes for store in list(self.checkpoints.values()) for t in list(store.values()))


class _Staging:
    """Tensors allocated once (grown when a larger one is asked for) and filled in place from Python values:
    a host buffer (pinned on CUDA) written through its numpy view, copied to its device twin.  Nothing in a
    step builds a new device tensor from a Python list, so a captured step could replay over the twins.  On
    CUDA a buffer's next write first waits for its last copy (an event), which the device may not have run."""

    def __init__(self, device: torch.device):
        self.device, self.host, self.dev, self.copied = device, {}, {}, {}

    def put(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        """``values`` (a list, or a list of equal lists) in the device buffer ``name``: a view of its prefix."""
        shape = (len(values), len(values[0])) if values and isinstance(values[0], list) else (len(values),)
        host = self.host.get(name)
        if host is None or host.dtype != dtype or host.shape[:-1] != shape[:-1] or host.shape[-1] < shape[-1]:
            size = (*shape[:-1], max(16, 2 * shape[-1]))
            host = torch.zeros(size, dtype=dtype, pin_memory=self.device.type == "cuda")
            self.host[name] = host
            self.dev[name] = host if self.device.type == "cpu" else torch.zeros(size, dtype=dtype, device=self.device)
        n, dev = shape[-1], self.dev[name]
        if name in self.copied:
            self.copied.pop(name).synchronize()
        host.numpy()[..., :n] = values
        if dev is not host:
            dev[..., :n].copy_(host[..., :n], non_blocking=True)
            self.copied[name] = torch.cuda.Event()
            self.copied[name].record()
        return dev[..., :n]


# ----------------------------------------------------------------------------- the model runner: computes

class _AttentionFns(NamedTuple):
    """The attention plug-ins: prefill (varlen_attn's signature), decode (flash_decode's), a group's
    decode (cascade_decode's, or None), and the keywords every call takes (the mode's batch_invariant)."""
    varlen: object
    decode: object
    cascade: object
    kw: dict


class ModelRunner:
    """Computes (the module docstring's table, phases 3 and 4, and sampling): fills a pass's inputs (the
    decode step's in buffers allocated once, ``_Staging``), runs the model with ``attend`` / ``mix``
    callbacks over the state pools, and samples.  Tensor-parallel: every rank runs its shard; rank 0 samples
    and broadcasts the tokens."""

    def __init__(self, model: nn.Module, pools: StatePools, attention: _AttentionFns, plan: MemoryPlan,
                 batch_invariant: bool, tp):
        self.pools, self.attention, self.batch_invariant, self.tp = pools, attention, batch_invariant, tp
        self.config, self.device, self.page_size = model.config, pools.device, plan.page_size
        self.scale = model.config.head_dim ** -0.5
        # Layer i's attention window in keys (gpt-oss's sliding layers; 0 = full): the config's, fixed.  Its
        # sinks are weights, read each pass from the model that pass runs (a hot swap brings another one).
        window = getattr(model, "attention_window", lambda i: 0)
        self.windows = [window(i) if kind == "attention" else 0 for i, kind in enumerate(model.config.kinds)]
        self.samples = tp is None or tp.rank == 0
        self.staging = _Staging(pools.device)
        self.table = torch.zeros(plan.max_batch_size, pools.pages_per_seq, dtype=torch.int32, device=pools.device)
        self.static: StaticDecode | None = None          # compile=True: the decode step over padded buffers
        self.decode_steps = 0
        self.hidden: torch.Tensor | None = None          # the last pass's final-normed hidden states (its rows)
        self.linear_inputs: dict = {}                    # linear layer -> (module, its verification rows' inputs)

    # ------------------------------------------------------------------ phase 3: the prefill pass

    def prefill(self, model: nn.Module, work: list) -> torch.Tensor | None:
        """One pass over the packed prefill work (``PrefillChunk``s): tokens start .. end - 1 of each,
        attending to their cached or earlier-computed pages.  Returns the logits [N, V] of the chunks that
        end their prompt, in work order, then those of every row of the verification chunks (the ones with
        drafts), in work order (None on a worker)."""
        dev, ps, pools = self.device, self.page_size, self.pools
        lengths = [c.end - c.start for c in work]
        ids = torch.tensor([t for c in work for t in c.tokens()], device=dev)
        positions = torch.cat([torch.arange(c.start, c.end) for c in work]).to(dev)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
        kv_index = torch.tensor([c.seq.pages[p // ps] * ps + p % ps for c in work for p in range(c.start, c.end)],
                                device=dev)
        rows = torch.tensor([c.seq.row for c in work], device=dev)
        pools.flush_table()
        table = pools.table[rows, :max(len(c.seq.pages) for c in work)]
        used = torch.tensor([c.end for c in work], dtype=torch.int32, device=dev)
        longest, keys = max(lengths), max(c.end for c in work)
        # The mode: rows at or after a prompt's end (a preempted request's completion, recomputed) reduce
        # their keys in the decode's two segments.
        completions = [(n, max(c.start, c.seq.n_prompt)) for n, c in enumerate(work)
                       if self.batch_invariant and c.end > c.seq.n_prompt]
        sinks = _sinks(model)

        def attend(i, q, k, v):
            kc, vc = pools.kv(i)
            kc.view(-1, *kc.shape[-2:]).index_copy_(0, kv_index, k)
            vc.view(-1, *vc.shape[-2:]).index_copy_(0, kv_index, v)
            w = self.windows[i]     # a sliding layer: position p sees keys p - w + 1 .. p (varlen's left = w - 1)
            out = self.attention.varlen(q, kc, vc, cu, None, longest, keys, scale=self.scale,
                                        window_size=(w - 1 if w else -1, 0), enable_gqa=True, seqused_k=used,
                                        block_table=table, **sinks[i], **self.attention.kw)
            for n, first in completions:
                span = slice(int(cu[n]) + first - work[n].start, int(cu[n + 1]))
                out[span] = self._two_segments(q[span][None], kc, vc, used[n:n + 1], table[n:n + 1],
                                               used[n:n + 1] * 0 + work[n].seq.n_prompt,
                                               dict(scale=self.scale, **sinks[i]), w)[0]
            return out

        verification = [r for n, c in enumerate(work) if c.drafts for r in range(int(cu[n]), int(cu[n + 1]))]
        verification = torch.tensor(verification, device=dev) if verification else None
        self.linear_inputs = {}

        def mix(i, module, h):
            if verification is not None:       # (a rejected draft's rollback runs this layer again over them)
                self.linear_inputs[i] = (module, h[verification])
            return self._prefill_linear(i, module, h, work, rows)

        h = self.hidden = model.layers_forward(ids, positions, attend, mix)
        bounds = [0, *itertools.accumulate(lengths)]
        wanted = ([bounds[n + 1] - 1 for n, c in enumerate(work) if c.end == len(c.seq.tokens) and not c.drafts]
                  + [r for n, c in enumerate(work) if c.drafts for r in range(bounds[n], bounds[n + 1])])
        if not wanted or not self.samples:
            return None
        return model.logits(h[torch.tensor(wanted, device=dev)])                      # [N, V]

    def _prefill_linear(self, i: int, module, h: torch.Tensor, work: list, rows: torch.Tensor) -> torch.Tensor:
        """A "linear" layer over the pass's tokens h [T, hidden]: each sample continues from its row's state
        (zeros from position 0, the row's when resuming or after a cached prefix) and leaves its new state
        there.  Where a checkpoint falls inside a sample's tokens the call is cut: round r runs every
        sample's r-th segment (the state carried over), and the state after a segment that ends at a
        checkpoint is kept in it."""
        bounds = [0, *itertools.accumulate(c.end - c.start for c in work)]
        segments = []                                   # per sample: [(first row, last row + 1, checkpoint)]
        for n, c in enumerate(work):
            edges = [(b, cp) for b, cp in c.cuts if b < c.end] + [(c.end, None)]
            first, pieces = bounds[n], []
            for b, cp in edges:
                pieces.append((first, bounds[n] + b - c.start, cp))
                first = bounds[n] + b - c.start
            segments.append(pieces)
        cache = module.new_cache()
        self.pools.gather(i, rows, cache)
        states = {name: t for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}
        out = h.new_empty(h.shape)
        for r in range(max(len(p) for p in segments)):
            members = [n for n, p in enumerate(segments) if len(p) > r]
            pieces = [segments[n][r] for n in members]
            span = torch.cat([torch.arange(a, b) for a, b, _ in pieces]).to(h.device)
            cu = torch.tensor([0, *itertools.accumulate(b - a for a, b, _ in pieces)], dtype=torch.int32,
                              device=h.device)
            part, index = module.new_cache(), torch.tensor(members, device=h.device)
            for name, t in states.items():
                setattr(part, name, t[index])
            out[span] = module(h[span][None], cu_seqlens=cu, cache=part)[0]
            for name, t in vars(part).items():
                if isinstance(t, torch.Tensor):
                    states[name][index] = t
            for n, (_, _, checkpoint) in zip(members, pieces):
                if checkpoint is not None:              # this layer's state at an interior page boundary
                    for name, t in states.items():
                        self.pools.checkpoint_store(i, name, t)[checkpoint] = t[n]
        self.pools.scatter(i, SimpleNamespace(**states), rows)
        return out

    def roll_back(self, chunks: list, kept: list, saved: dict) -> None:
        """A speculative rollback: the linear layers' state rows of the verification ``chunks`` whose drafts
        were rejected (kept[n] of chunk n's rows accepted; 0: nothing to undo) go back to the state after
        their kept rows.  A row before the first rejection saw accepted tokens only (causal), so its inputs
        to each layer (``linear_inputs``, from the pass) are the ones a plain step would give, and the layer
        needs no other: its own ``rewind`` does it where it can (the batch-invariant mode, no chunk completed:
        the rejected rows dropped from its chunk buffer, the conv state rebuilt), else the rows go back to
        ``saved`` (before the pass) and the layer alone runs again over the kept rows.  Either way the state
        is what the decode steps would have left (in the batch-invariant mode bit for bit)."""
        starts = [0, *itertools.accumulate(len(c.drafts) + 1 for c in chunks)]
        redo = [n for n, k in enumerate(kept) if k]
        rows = [c.seq.row for c in chunks]
        for i, (module, h) in self.linear_inputs.items():
            again = redo
            if self.batch_invariant and hasattr(module, "rewind"):   # (only the mode's cache can be rewound)
                index = torch.tensor([rows[n] for n in redo], device=self.device)
                after, before = module.new_cache(), module.new_cache()
                self.pools.gather(i, index, after)
                pick = torch.tensor(redo, device=self.device)
                for name, t in saved[i].items():
                    setattr(before, name, t[pick])
                done = module.rewind(after, before, [h[starts[n]:starts[n + 1]] for n in redo],
                                     [kept[n] for n in redo])
                self.pools.scatter(i, after, index)
                again = [n for n, d in zip(redo, done) if not d]
            if again:
                self.pools.restore_rows(saved, rows, again, layers=[i])
                index = torch.tensor([starts[n] + r for n in again for r in range(kept[n])], device=self.device)
                work = [PrefillChunk(chunks[n].seq, chunks[n].start, chunks[n].start + kept[n], ()) for n in again]
                self._prefill_linear(i, module, h[index], work,
                                     torch.tensor([rows[n] for n in again], device=self.device))
        self.linear_inputs = {}

    # ------------------------------------------------------------------ phase 4: the decode step

    def decode(self, model: nn.Module, seqs: list) -> torch.Tensor | None:
        """One token for every decoding sample: a batched forward over their last tokens, its inputs filled
        into persistent buffers.  A group's samples (side by side) decode through ``cascade_decode`` (their
        prompt's shared pages read once); the batch-invariant mode reduces every row's keys in two
        segments (``_two_segments``).  Returns the logits [B, V] (None on a worker)."""
        b, put, at = len(seqs), self.staging.put, self.attention
        self.decode_steps += 1
        groups = self._decode_groups(seqs) if at.cascade is not None and not self.batch_invariant else None
        if self.static is not None:
            ran, logits = self.static.run(model, seqs, groups)
            if ran:
                return logits
        if groups is not None:
            groups = put("cu_groups", groups[0], torch.int32), put("prefix_lens", groups[1], torch.int32)
        ids = put("ids", [s.tokens[-1] for s in seqs], torch.int64)
        positions = put("positions", [len(s.tokens) - 1 for s in seqs], torch.int64)
        used = put("used", [len(s.tokens) for s in seqs], torch.int32)
        rows = put("rows", [s.row for s in seqs], torch.int64)
        prompts = put("prompts", [s.n_prompt for s in seqs], torch.int32)
        self.pools.flush_table()
        torch.index_select(self.pools.table, 0, rows, out=self.table[:b])
        table = self.table[:b, :max(len(s.pages) for s in seqs)]
        sinks = _sinks(model)
        # A sliding layer's keys start w before the new token's end (the pages before stay allocated, unread).
        first_key = {w: (used - w).clamp(min=0) for w in set(self.windows) if w}

        def attend(i, q, k, v):
            kc, vc = self.pools.kv(i)
            new = dict(scale=self.scale, **sinks[i])
            if k is not None:         # (else the model wrote them: kv_slots; k[:, None]: one torch call, eagerly)
                new.update(k_new=k[:, None], v_new=v[:, None])
            if self.batch_invariant:
                return self._two_segments(q[:, None], kc, vc, used, table, prompts, new, self.windows[i])[:, 0]
            if self.windows[i]:     # (no cascade: a group's shared prompt may lie outside the window)
                return at.decode(q[:, None], kc, vc, used, block_table=table, cache_leftpad=first_key[self.windows[i]],
                                 **new)[:, 0]
            if groups is not None:
                return at.cascade(q[:, None], kc, vc, used, block_table=table, cu_groups=groups[0],
                                  prefix_lens=groups[1], **new)[:, 0]
            return at.decode(q[:, None], kc, vc, used, block_table=table, **new)[:, 0]

        if not self.batch_invariant:       # the fast model's q + k kernel may write the new K / V itself
            attend.kv_slots = _kv_slots(self.pools, lambda: _slots_of(table, positions, self.page_size))

        def mix(i, module, h):
            cache = module.new_cache()
            self.pools.gather(i, rows, cache)
            out = module(h[:, None], cache=cache)[:, 0]
            self.pools.scatter(i, cache, rows)
            return out

        h = self.hidden = model.layers_forward(ids, positions, attend, mix)
        return model.logits(h) if self.samples else None

    def _decode_groups(self, seqs: list):
        """(cu_groups, prefix_lens), as lists, of a decode batch ordered by request: the samples of one
        request that still share its prompt's full pages form a group (prefix: those pages' keys); None
        when no group has two samples (plain flash_decode then)."""
        ps, bounds, prefixes = self.page_size, [0], []
        for n, s in enumerate(seqs):
            shared = s.n_prompt // ps
            head = seqs[bounds[-1]]
            if n and s.group is head.group and s.pages[:shared] == head.pages[:shared]:
                continue
            if n:
                bounds.append(n)
            prefixes.append(shared * ps)
        bounds.append(len(seqs))
        if len(prefixes) == len(seqs):
            return None
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        return bounds, [p if size > 1 else 0 for p, size in zip(prefixes, sizes)]

    def _two_segments(self, q, kc, vc, used, table, prompts, new, window: int = 0):
        """The batch-invariant mode's attention for completion rows q [B, S_q, H_q, D] (positions used - S_q
        .. used - 1, all at or after their prompt's end): over the prompt's keys, then over the
        sequence's own keys from the prompt's end on (``cache_leftpad``), merged as
        ``DecoderLM.token_logprobs`` merges them.  ``new``: k_new / v_new, scale and sinks for the second call
        (a sink joins once, in the last segment).  A sliding layer (``window`` keys: row t sees t - window + 1
        .. t): each row alone, its two segments starting where its window does, a0 = max(0, t - window + 1)
        in the prompt and b0 = max(p, t - window + 1) in its own keys; a prompt segment the window has left
        is empty (out 0, lse -inf; the call reads the prompt's last key, dropped)."""
        b, s_q = q.shape[:2]
        decode, mode = self.attention.decode, dict(return_lse=True, batch_invariant=True)
        rows = q.reshape(b * s_q, 1, *q.shape[2:])                          # each row alone over its prompt
        row_prompts, row_table = prompts.repeat_interleave(s_q), table.repeat_interleave(s_q, 0)
        if window:
            ends = (used[:, None] - s_q + 1 + torch.arange(s_q, device=used.device)).flatten().int()   # t + 1
            start = (ends - window).clamp(min=0)
            empty = start >= row_prompts
            o_a, lse_a = decode(rows, kc, vc, row_prompts, block_table=row_table, scale=new["scale"],
                                cache_leftpad=torch.minimum(start, row_prompts - 1), **mode)
            o_b, lse_b = decode(rows, kc, vc, ends, block_table=row_table,
                                cache_leftpad=torch.maximum(start, row_prompts), **mode, **new)
            o_a = o_a[:, 0].masked_fill(empty[:, None, None], 0.0)
            lse_a = lse_a[:, :, 0].t().masked_fill(empty, -math.inf)
            o_b, lse_b = o_b[:, 0], lse_b[:, :, 0].t()
        else:
            o_a, lse_a = decode(rows, kc, vc, row_prompts, block_table=row_table, scale=new["scale"], **mode)
            o_b, lse_b = decode(q, kc, vc, used, block_table=table, cache_leftpad=prompts, **mode, **new)
            o_a, lse_a = o_a[:, 0], lse_a[:, :, 0].t()
            o_b, lse_b = o_b.flatten(0, 1), lse_b.transpose(1, 2).flatten(0, 1).t()   # [B, H, S_q] -> [H, B * S_q]
        out, _ = _merge_states(o_a, lse_a, o_b, lse_b)
        return out.to(q.dtype).unflatten(0, (b, s_q))

    # ------------------------------------------------------------------ the MTP head's rows

    def mtp_rows(self, model: nn.Module, rows: list, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """The MTP head (decoder_lm.py's ``mtp_forward``) over ``rows`` [(sample, position t, the token at t + 1,
        the sample's first head row)] with hidden [R, hidden] (the main model's at t, or the head's own one
        depth up) -> the head's hidden [R, hidden].  Row t's K/V go to the head layer's pool at the slot of
        position t + 1: that slot's content then depends on tokens 0 .. t + 1, as the main layers' slot does,
        so the pages a group shares hold the same head rows for every sample of it and no sample writes a
        page it shares.  Each row attends to its sample's head rows first .. t (slots first + 1 .. t + 1:
        ``cache_leftpad``), written in this call before any is read."""
        put, ps, pools = self.staging.put, self.page_size, self.pools
        ids = put("mtp_ids", [token for _, _, token, _ in rows], torch.int64)
        positions = put("mtp_positions", [t for _, t, _, _ in rows], torch.int64)
        slots = put("mtp_slots", [s.pages[(t + 1) // ps] * ps + (t + 1) % ps for s, t, _, _ in rows], torch.int64)
        used = put("mtp_used", [t + 2 for _, t, _, _ in rows], torch.int32)
        first = put("mtp_first", [f + 1 for _, _, _, f in rows], torch.int32)
        pools.flush_table()
        table = pools.table[put("mtp_rows", [s.row for s, _, _, _ in rows], torch.int64)]
        sinks = getattr(model, "attention_sinks", lambda i: None)

        def attend(i, q, k, v):
            kc, vc = pools.kv(i)
            if k is not None:                                   # (None: the model wrote them: kv_slots)
                kc.view(-1, *kc.shape[-2:]).index_copy_(0, slots, k)
                vc.view(-1, *vc.shape[-2:]).index_copy_(0, slots, v)
            extra = {} if sinks(i) is None else dict(sinks=sinks(i))
            return self.attention.decode(q[:, None], kc, vc, used, block_table=table, cache_leftpad=first,
                                         scale=self.scale, **extra, **self.attention.kw)[:, 0]

        attend.kv_slots = _kv_slots(pools, lambda: slots)
        return model.mtp_forward(ids, positions, hidden, attend, depth)

    # ------------------------------------------------------------------ sampling

    def sample(self, model: nn.Module, seqs: list, logits: torch.Tensor | None,
               rows: list | None = None) -> tuple[list, list]:
        """(tokens, logprobs) of ``seqs`` from ``logits`` (row ``rows[n]`` for sample n; every row in order
        when None), token j of a sample drawn with ``keyed_uniform(seed, j)`` (the reference's rule:
        ``sample_rows``, with the model's log_softmax: its batch-invariant one in that mode).
        Tensor-parallel: rank 0 samples and the workers take its tokens, so every rank schedules alike."""
        tokens, logprobs = [0] * len(seqs), [0.0] * len(seqs)
        if logits is not None:
            if rows is not None:
                logits = logits[self.staging.put("sample_rows", rows, torch.int64)]
            tokens, logprobs = sample_rows(logits, [s.group.request.sampling for s in seqs],
                                           [(s.seed, len(s.tokens) - s.n_prompt) for s in seqs], self.staging,
                                           getattr(model, "log_softmax", None))
        if self.tp is not None:
            tokens = self.tp.share_tokens(self.staging.put("tokens", tokens, torch.int64))
        return tokens, logprobs

    def sample_verification(self, model: nn.Module, chunks: list, logits: torch.Tensor) -> tuple[list, list]:
        """Every row of the verification ``chunks`` (``logits`` [rows, V], in order): row r of a sample's chunk
        draws its completion's token j = (tokens generated so far) + r with ``keyed_uniform(seed, j)``, as
        plain decoding's step for that token draws it.  Tensor-parallel: rank 0 draws (``logits`` is None on a
        worker), every rank takes its tokens."""
        params = [c.seq.group.request.sampling for c in chunks for _ in range(len(c.drafts) + 1)]
        keys = [(c.seq.seed, len(c.seq.tokens) - c.seq.n_prompt + r) for c in chunks for r in range(len(c.drafts) + 1)]
        tokens, logprobs = [0] * len(keys), [0.0] * len(keys)
        if logits is not None:
            tokens, logprobs = sample_rows(logits, params, keys, self.staging, getattr(model, "log_softmax", None))
        if self.tp is not None:                      # (rank 0 draws; every rank accepts alike)
            tokens = self.tp.share_tokens(self.staging.put("tokens", tokens, torch.int64))
        return tokens, logprobs


# ----------------------------------------------------------------------------- the static decode step
# A decode step whose shapes are fixed, so a compiler can trace it once and replay it: the batch padded to
# the next of ``capture_sizes`` (B -> P), the block table cut to a power-of-two number of pages (W, at least
# two: Dynamo specializes a dimension of size one, so one-page tables would compile a second graph), every
# input in a buffer allocated once.  Padding rows decode token 0 at position 0 into the pools' spare page
# and state row (``StatePools(padding=True)``); their logits are dropped.  Nothing in the step reads a value
# back to the host.  ``Generator(compile=True)`` runs it through ``torch.compile`` (inductor), one graph per
# P (W is dynamic; a hot swap's other module, of the same structure, goes through the same graph: its
# parameters are the graph's inputs); ``cuda_graphs=True`` captures it (compiled or not) per P and weight set
# at the table's full width (a capture holds the addresses it read), and replays it.
#
# A step with a group's cascade (``cascade_decode``, a GRPO group's samples side by side) takes it too, when
# the plug-in has a ``capturable`` keyword (fast/flash_decoding.py's: its launch sized from shapes, nothing
# read back): the groups in two more buffers, cu_groups [P + 1] and prefix_lens [P], a padding row a group of
# its own with no prefix, the groups past them empty; one more graph (or compiled variant) per P and weight
# set, for the steps that have groups.  A plug-in without the keyword keeps those steps eager.
#
# A speculative verification alone in its iteration (no prompt prefilling beside it: the steady state) takes
# it too (``StaticDecode.verify``): S = k + 1 rows a sequence, a chunk with fewer drafts padded with token 0
# at the next positions, whose keys go to the spare page (the block table's columns past a sequence's pages
# point there) and which the real rows never see (causal).  A linear layer runs over all S rows, so a
# sequence that keeps fewer is rolled back as a rejection is (its inputs are returned for that).  Not in the
# batch-invariant mode (its verification rows reduce as the trainer's prefill does: the eager pass).  A
# sliding layer's rows each see their own window: the plug-in's ``window_size=(W - 1, 0)`` (fast/
# flash_decoding.py's; a plug-in without the keyword keeps such a model's verification eager: cache_leftpad
# starts a sequence's keys, not each row's window), or the in-file attention's per-row mask.
#
# The MTP head's drafts (speculative="mtp") take it too (``StaticDecode.draft``, its own compiled function
# and graph per P): depth 0 the head's rows whose next token is now known, k + 1 a sample (the real ones
# first, then padding the real ones never see: causal), then depths 1 .. k - 1 one row a sample, each fed the
# argmax of the depth before, on the device; every depth for every sample (rows past a sample's room write
# scratch slots past its tokens, as the eager drafter's deeper rows do; its block-table columns past its pages,
# and all of a sample with nothing to draft, point at the spare page), the [P, k] drafts read back once.  The
# keys a depth writes are in the pool before the next depth reads them (``_write_rows`` between the depths).
# A batch with a sample whose head lags (rows to catch up that do not end at its newest position) drafts
# eagerly, a call per depth.
#
# The state writes are deferred to the step's end, one op for all of them (``_write_rows``): the attention
# of layer i sees the cached keys 0 .. L - 2 from the pool and the new key from the step itself, which is
# what flash_decode computes after writing it.  (An index_put_ into a pool the graph was given is
# functionalized by the compiler into a copy of the whole pool; a custom op that mutates its argument is
# called in place, and one call instead of two per layer saves ~40 us of dispatch each.)

@torch.library.custom_op("twofold::engine_write_rows", mutates_args=("dst",))
def _write_rows(dst: list[torch.Tensor], index: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[n][index[n]] = src[n] (along dim 0) for every n, in place."""
    for d, i, v in zip(dst, index, src):
        d.index_copy_(0, i, v)


@_write_rows.register_fake
def _(dst, index, src):
    return None


def _replay(graph: tuple):
    """Replay a captured step (CUDAGraph, its outputs); returns the outputs, refilled."""
    graph[0].replay()
    return graph[1]


def _paged_decode_attention(q, k, v, k_pages, v_pages, table, used, first, scale, sinks, window: int = 0,
                            hidden=None):
    """S new rows per sequence over its cached keys and its new keys: q [P, S, H_q, D], k / v [P, S, H_kv, D]
    (the new tokens', at positions used - S .. used - 1, not yet in the pool), k_pages / v_pages [pages,
    page_size, H_kv, D], table [P, W] int32, used [P] (keys after this step), first [P] (the first visible
    cached key: a sliding window at S = 1, the MTP head's first row) or None, ``window`` (a sliding layer's
    keys: row r, at position t = used - S + r, sees t - window + 1 .. t; 0 = all).  Row r sees the cached
    keys 0 .. used - S - 1 and the new keys 0 .. r (causal); sinks as ``_masked_attention``.  Static
    shapes: W page_size + S keys a row, the rest masked (``hidden``: ``_hidden_keys``' mask of those, when
    the caller holds it already: one serves every layer of a step with the same window).  Written as
    products and sums, not matmuls, so the compiler fuses the page gather into them (no [P, keys, H_kv, D]
    copy; with D small, a matmul per row and head would not pay)."""
    b, s_q, h_q, d = q.shape
    h_kv = k.shape[2]
    keys = torch.cat([k_pages[table].flatten(1, 2), k], 1).float()[:, None, :, :, None]   # [P, 1, L, H_kv, 1, D]
    values = torch.cat([v_pages[table].flatten(1, 2), v], 1).float()[:, None, :, :, None]
    n_keys = keys.shape[2]
    if hidden is None:
        hidden = _hidden_keys(used, first, s_q, n_keys - s_q, window)
    s = (q.float().view(b, s_q, 1, h_kv, h_q // h_kv, d) * keys).sum(-1) * scale      # [P, S, L, H_kv, G]
    s = s.masked_fill(hidden[..., None, None], float("-inf"))
    if sinks is not None:                                                   # one more key per head, value 0
        s = torch.cat([s, sinks.float().view(1, 1, 1, h_kv, -1).expand(b, s_q, 1, -1, -1)], dim=2)
    p = torch.softmax(s, dim=2)[:, :, :n_keys]
    values = values.masked_fill(hidden[..., None, None, None], 0.0)       # (0 * a stale NaN would be NaN)
    return (p[..., None] * values).sum(2).reshape(b, s_q, h_q, d).to(q.dtype)


def _hidden_keys(used, first, s_q: int, n_cached: int, window: int = 0) -> torch.Tensor:
    """``_paged_decode_attention``'s mask: [P, S, L] bool, True where row r of sequence p does not see key j of
    its L = n_cached + S (the cached keys' slots, then the S new keys); used [P], first [P] or None, window as
    there."""
    j, r = torch.arange(n_cached + s_q, device=used.device), torch.arange(s_q, device=used.device)
    visible = j < (used[:, None].long() - s_q)                                       # [P, L]: cached keys
    if first is not None:
        visible = visible & (j >= first[:, None])
    visible = visible[:, None] | ((j >= n_cached) & (j - n_cached <= r[:, None]))    # [P, S, L]: + the new ones
    if window:                  # key j's position: j (cached) or used - S + j - n_cached (new); row r's: used - S + r
        pos = torch.where(j >= n_cached, used[:, None].long() - s_q + j - n_cached, j)              # [P, L]
        visible = visible & (pos[:, None, :] > (used[:, None, None].long() - s_q + r[:, None] - window))
    return ~visible


COMPILE_THE_MODE = False   # the batch-invariant mode's step compiled: measured not bitwise (Generator's note)


class StaticDecode:
    """The decode step over persistent padded buffers (the section above), compiled (``compile=True``) and /
    or replayed from a CUDA graph per padded size, kind and weight set (``cuda_graphs=True``: the block table
    at its full width, captured on first use over padding-only inputs, so its warm-up runs write the spare
    page and row only).  Kinds: "decode" (one row a sequence), "cascade" (the same with a group's cascade),
    "verify" (``rows`` rows a sequence: speculative verification, ``verify``).  ``run`` / ``verify`` say when
    a step cannot take it (a batch larger than the largest size; a capture that failed, after a warning) and
    the runner steps eagerly."""

    def __init__(self, runner: ModelRunner, sizes: tuple, max_batch_size: int, *, compile: bool = True,
                 cuda_graphs: bool = False, rows: int = 1):
        self.runner, self.pools = runner, runner.pools
        # the sizes up to the first that holds max_batch_size (larger ones would never be used)
        self.sizes = tuple(n for n in sizes if n < max_batch_size) + tuple(n for n in sizes if n >= max_batch_size)[:1]
        largest, dev = self.sizes[-1], runner.device
        self.rows_per_seq = rows                   # a verification's rows a sequence: 1 + the most drafts
        self.ids = torch.zeros(largest * rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(largest * rows, dtype=torch.int64, device=dev)
        self.used = torch.ones(largest, dtype=torch.int32, device=dev)
        self.rows = torch.zeros(largest, dtype=torch.int64, device=dev)
        self.prompts = torch.ones(largest, dtype=torch.int32, device=dev)
        self.table = torch.zeros(largest, self.pools.pages_per_seq, dtype=torch.int32, device=dev)
        self.n_pages = torch.zeros(largest, dtype=torch.int32, device=dev)
        self.cu_groups = torch.zeros(largest + 1, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(largest, dtype=torch.int32, device=dev)
        cascade = runner.attention.cascade
        self.cascade = (cascade is not None and not runner.batch_invariant
                        and "capturable" in inspect.signature(cascade).parameters)
        # verification: outside the mode (its rows reduce as the trainer's prefill does: the eager pass); with
        # sliding layers, through a plug-in that bounds each row's window (window_size) or the in-file attention
        decode = runner.attention.decode
        per_row_windows = decode is _torch_flash_decode or "window_size" in inspect.signature(decode).parameters
        self.verifies = (rows > 1 and not runner.batch_invariant and (per_row_windows or not any(runner.windows)))
        # the MTP head's drafts (speculative="mtp"; outside the mode, as verification): ``draft``
        self.drafts = rows > 1 and not runner.batch_invariant and runner.config.num_layers in self.pools.pool_index
        self.draft_hidden = (torch.zeros(largest * rows, runner.config.hidden_size, dtype=self.pools.k.dtype,
                                         device=dev) if self.drafts else None)
        self.draft_meta = torch.zeros(4, largest, dtype=torch.int64, device=dev)   # n, start, first, length
        self.max_positions = min(self.pools.pages_per_seq * self.pools.page_size, runner.config.max_seq_len)
        self.linear_layers = [i for i, kind in enumerate(runner.config.kinds) if kind == "linear"]
        self.shapes: set = set()                   # the (P, W) the step ran at
        self.steps = self.cascade_steps = self.verify_steps = self.draft_steps = 0
        # (Dynamo's guards on the model's modules are skipped: ~0.5 ms a step at 28 layers.  The engine owns its
        # model and never changes a module's attributes; a weight load copies into tensors, a swap passes the
        # other module, of the same structure, whose parameters the graph reads as inputs: the hot-swap test.)
        options = {"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._compiled = torch.compile(self._forward, dynamic=False, options=options) if compile else self._forward
        self._compiled_draft = (torch.compile(self._draft_forward, dynamic=False, options=options) if compile
                                else self._draft_forward)
        self.cuda_graphs = cuda_graphs
        self.graphs: dict = {}        # (id(model), P, kind) -> (CUDAGraph, its outputs)
        self.graph_bytes = 0                       # what the graphs' memory pool reserved
        self._pool = None

    def run(self, model: nn.Module, seqs: list, groups=None) -> tuple[bool, torch.Tensor | None]:
        """A decode step: (ran, logits [B, V] or None on a worker).  ``groups``: the batch's (cu_groups,
        prefix_lens) lists, or None (no group to cascade)."""
        b = len(seqs)
        kind = "decode" if groups is None else "cascade"
        if b > self.sizes[-1] or (groups is not None and not self.cascade):
            return False, None
        size, width, graph = self._shape(model, b, max(len(s.pages) for s in seqs), kind)
        if size is None:
            return False, None
        pad, put = size - b, self.runner.staging.put
        self.ids[:size].copy_(put("ids", [s.tokens[-1] for s in seqs] + [0] * pad, torch.int64))
        self.positions[:size].copy_(put("positions", [len(s.tokens) - 1 for s in seqs] + [0] * pad, torch.int64))
        self.used[:size].copy_(put("used", [len(s.tokens) for s in seqs] + [1] * pad, torch.int32))
        # (a padding row is a one-token sequence that is all prompt: the mode's windowed attention needs a
        # prompt of at least one key, as every request has)
        self._fill_rows(seqs, size)
        if groups is not None:       # then each padding row a group of its own, no prefix; the groups after them empty
            bounds, prefixes = groups
            self.cu_groups[:size + 1].copy_(put("cu_groups", bounds + list(range(b + 1, size + 1))
                                                + [size] * (size + 1 - len(bounds) - pad), torch.int32))
            self.prefix_lens[:size].copy_(put("prefix_lens", prefixes + [0] * (size - len(prefixes)), torch.int32))
        logits, hidden = _replay(graph) if graph is not None else self._call(model, size, width, kind)
        self.runner.hidden = hidden[:b]
        self.shapes.add((size, width))
        self.steps += 1
        self.cascade_steps += groups is not None
        return True, None if logits is None else logits[:b]

    def verify(self, model: nn.Module, chunks: list) -> tuple[bool, torch.Tensor | None]:
        """A verification pass over the chunks (``Scheduler.speculate``'s: a sample's last token and its
        drafts, positions start .. end - 1), each padded to ``rows_per_seq`` rows (token 0 at the next
        positions; the block table's columns past a sample's pages point at the spare page, where the
        padding rows' keys go; the real rows never see them: causal), the batch to the next size.  Returns
        (ran, the logits of every real row [R, V], in chunk order, or None on a worker); leaves the real
        rows' hidden states in ``runner.hidden`` and each linear layer's inputs for a rollback in
        ``runner.linear_inputs`` (its state is left after all the padded rows: ``Generator._verify`` rolls
        back every chunk with fewer rows than that)."""
        b, pools, s_q = len(chunks), self.pools, self.rows_per_seq
        if (not self.verifies or b > self.sizes[-1]
                or any(len(c.drafts) >= s_q or c.start + s_q > self.max_positions for c in chunks)):
            return False, None
        ps = pools.page_size                   # (the table's width covers the padding rows' positions too)
        size, width, graph = self._shape(model, b, max(-(-(c.start + s_q) // ps) for c in chunks), "verify")
        if size is None:
            return False, None
        pad, put = size - b, self.runner.staging.put
        self.ids[:size * s_q].copy_(put("ids", [t for c in chunks for t in c.tokens() + [0] * (s_q - len(c.tokens()))]
                                        + [0] * (pad * s_q), torch.int64))
        self.positions[:size * s_q].copy_(put("positions", [c.start + r for c in chunks for r in range(s_q)]
                                              + list(range(s_q)) * pad, torch.int64))
        self.used[:size].copy_(put("used", [c.start + s_q for c in chunks] + [s_q] * pad, torch.int32))
        self.n_pages[:size].copy_(put("n_pages", [len(c.seq.pages) for c in chunks] + [pools.pages_per_seq] * pad,
                                      torch.int32))
        self._fill_rows([c.seq for c in chunks], size)
        outputs = _replay(graph) if graph is not None else self._call(model, size, width, "verify")
        (logits, hidden), inputs = outputs[:2], outputs[2:]
        real = put("verify_rows", [n * s_q + r for n, c in enumerate(chunks) for r in range(len(c.tokens()))],
                   torch.int64)
        self.runner.hidden = hidden.index_select(0, real)
        self.runner.linear_inputs = {i: (model.layers[i].linear_attn, h.index_select(0, real))
                                     for i, h in zip(self.linear_layers, inputs)}
        self.shapes.add((size, width))
        self.verify_steps += 1
        return True, None if logits is None else logits.index_select(0, real)

    def draft(self, model: nn.Module, seqs: list, rooms: list) -> list | None:
        """``MTPDrafter.propose`` over the static step: up to rooms[n] drafts for each of ``seqs``, or None
        (nothing changed) when it cannot take them: more drafting samples than the largest size, a sample
        whose head lags (rows to catch up that do not end at its newest position, or more than k + 1 of
        them), drafts that would pass the pages.  Depth 0 computes each sample's catch-up rows (the
        positions whose next token is now known), padded to k + 1 rows after its real ones; depths 1 .. k - 1
        feed the head its own output and argmax one row a sample, every depth for every sample (rows past
        a sample's room write scratch slots past its tokens; its block-table columns past its pages, and
        every column of a sample with nothing to draft, point at the spare page); one read-back of the
        [P, k] drafts at the end."""
        s_q, ps = self.rows_per_seq, self.pools.page_size
        drafting = [(at, s, room) for at, (s, room) in enumerate(zip(seqs, rooms)) if room > 0]
        if not self.drafts or not drafting or len(drafting) > self.sizes[-1]:
            return None
        catch_up = []                          # each drafting sample's rows to compute at depth 0
        for _, s, _ in drafting:
            r, length = s.mtp, len(s.tokens)
            n = 0 if r is None else min(r.pending.shape[0], length - 1 - r.next)
            if n > s_q or (n > 0 and r.next + n != length - 1) or length + s_q - 1 > self.max_positions:
                return None
            catch_up.append(n)
        b = len(drafting)
        pages = max(-(-(len(s.tokens) + s_q - 1) // ps) for _, s, _ in drafting)   # (the padding rows' keys too)
        size, width, graph = self._shape(model, b, pages, "draft")
        if size is None:
            return None
        pad, put = size - b, self.runner.staging.put
        ids, hidden, dest, meta = [], [], [], [[] for _ in range(4)]
        for j, ((_, s, _), n) in enumerate(zip(drafting, catch_up)):
            r = s.mtp
            start = r.next if n else 0
            ids += [s.tokens[start + i + 1] if i < n else 0 for i in range(s_q)]
            if n:
                hidden.append(r.pending[:n])
                dest += range(j * s_q, j * s_q + n)
                s.mtp = _MTPRows(r.first, r.next + n, r.pending[n:])
            # (n, start, first head row + 1, tokens so far); a sample with none: its rows at 0 .. S - 1
            for field, value in zip(meta, (n, start, r.first + 1, len(s.tokens)) if n else (0, 0, 0, 2)):
                field.append(value)
        self.ids[:size * s_q].copy_(put("ids", ids + [0] * (pad * s_q), torch.int64))
        if hidden:
            self.draft_hidden.index_copy_(0, put("draft_rows", dest, torch.int64), torch.cat(hidden))
        self.draft_meta[:, :size].copy_(put("draft_meta", [m + [2 if i == 3 else 0] * pad for i, m in enumerate(meta)],
                                            torch.int64))
        self.n_pages[:size].copy_(put("n_pages", [len(s.pages) if n else 0 for (_, s, _), n in zip(drafting, catch_up)]
                                      + [0] * pad, torch.int32))
        self._fill_rows([s for _, s, _ in drafting], size)
        drafts = (_replay(graph) if graph is not None else self._call(model, size, width, "draft"))[:b].tolist()
        self.draft_steps += 1
        out = [[] for _ in seqs]
        for (at, _, room), tokens, n in zip(drafting, drafts, catch_up):
            out[at] = tokens[:room] if n else []
        return out

    def _shape(self, model: nn.Module, b: int, pages: int, kind: str):
        """(padded size, table width, its graph or None) of a step over b sequences of up to ``pages`` pages;
        (None, ...) when its graph failed to capture."""
        size = next(n for n in self.sizes if n >= b)
        width = (self.pools.pages_per_seq if self.cuda_graphs
                 else min(max(2, 1 << (pages - 1).bit_length()), self.pools.pages_per_seq))
        graph = self._graph(model, size, kind) if self.cuda_graphs else None
        return (None if self.cuda_graphs and graph is None else size), width, graph

    def _fill_rows(self, seqs: list, size: int) -> None:
        """The state rows, prompt lengths and block-table rows of the sequences, then padding to ``size``."""
        b, pools, put = len(seqs), self.pools, self.runner.staging.put
        self.rows[:size].copy_(put("rows", [s.row for s in seqs] + [pools.pad_row] * (size - b), torch.int64))
        self.prompts[:size].copy_(put("prompts", [s.n_prompt for s in seqs] + [1] * (size - b), torch.int32))
        pools.flush_table()
        torch.index_select(pools.table, 0, self.rows[:b], out=self.table[:b])
        self.table[b:size].fill_(pools.pad_page)

    def _call(self, model: nn.Module, size: int, width: int, kind: str):
        table = self.table[:size, :width]
        if not self.cuda_graphs:      # (a graph's table is full width: a symbolic width would read sizes back)
            torch._dynamo.maybe_mark_dynamic(table, 1)
        s_q = self.rows_per_seq if kind in ("verify", "draft") else 1
        extra = ((self.cu_groups[:size + 1], self.prefix_lens[:size]) if kind == "cascade"
                 else (None, None, self.n_pages[:size]) if kind == "verify" else ())
        with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=4096):
            if kind == "draft":
                return self._compiled_draft(model, self.ids[:size * s_q], self.draft_hidden[:size * s_q],
                                            self.draft_meta[:, :size], self.n_pages[:size], table)
            return self._compiled(model, self.ids[:size * s_q], self.positions[:size * s_q], self.used[:size],
                                  self.rows[:size], self.prompts[:size], table, *extra)

    def _graph(self, model: nn.Module, size: int, kind: str):
        """The CUDA graph of a step of ``kind`` at padded size ``size`` for this weight set: captured on first
        use (two warm-up runs on a side stream first: Triton compiles and autotunes there), over inputs that
        are padding only; None (and a warning, once) when the capture fails: the engine then steps eagerly."""
        key = (id(model), size, kind)
        if key not in self.graphs:
            pools, s_q = self.pools, self.rows_per_seq if kind in ("verify", "draft") else 1
            self.ids[:size * s_q].zero_(), self.used[:size].fill_(s_q), self.n_pages[:size].fill_(pools.pages_per_seq)
            if kind == "draft":            # (samples with nothing to draft: every row to the spare page)
                self.n_pages[:size].zero_(), self.draft_meta[:, :size].zero_(), self.draft_meta[3, :size].fill_(2)
            self.positions[:size * s_q].copy_(torch.arange(s_q, device=self.positions.device).repeat(size))
            self.rows[:size].fill_(pools.pad_row), self.prompts[:size].fill_(1), self.table[:size].fill_(pools.pad_page)
            torch.arange(size + 1, out=self.cu_groups[:size + 1]), self.prefix_lens[:size].zero_()
            before = torch.cuda.memory_reserved(self.runner.device)
            try:
                side = torch.cuda.Stream(self.runner.device)
                side.wait_stream(torch.cuda.current_stream(self.runner.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._call(model, size, pools.pages_per_seq, kind)
                torch.cuda.current_stream(self.runner.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    outputs = self._call(model, size, pools.pages_per_seq, kind)
            except Exception as exc:                    # (a plug-in that syncs with the host, say)
                warnings.warn(f"Generator(cuda_graphs=True): capturing the {kind} step at batch {size} failed "
                              f"({type(exc).__name__}: {exc}); this engine decodes eagerly", stacklevel=2)
                self.cuda_graphs, self.graphs = False, {}
                return None
            self._pool = graph.pool()
            self.graph_bytes += torch.cuda.memory_reserved(self.runner.device) - before
            self.graphs[key] = (graph, outputs)
        return self.graphs[key]

    def _forward(self, model, ids, positions, used, rows, prompts, table, cu_groups=None, prefix_lens=None,
                 n_pages=None):
        """The step over P sequences of S = len(ids) / P rows each (S > 1: a verification, ``n_pages`` each
        sequence's pages, the table's columns past them the spare page).  Returns (logits, hidden) and, in a
        verification, each linear layer's inputs [P S, hidden]."""
        runner, pools, ps = self.runner, self.pools, self.pools.page_size
        p_seqs = used.shape[0]
        s_q = ids.shape[0] // p_seqs
        if n_pages is not None:
            cols = torch.arange(table.shape[1], device=table.device)
            table = torch.where(cols[None, :] < n_pages[:, None], table, pools.pad_page)
        kv_index = _slots_of(table, positions, ps)                           # [P S] the new rows' slots
        sinks = _sinks(model)
        dst, index, src, inputs = [], [], [], []
        new_kv, hidden = [], {}                          # (layer's pool index, k, v); window -> _hidden_keys

        def attend(i, q, k, v):
            kc, vc = pools.kv(i)
            w = runner.windows[i]
            # a sliding layer: decoding, the sequence's keys from used - W on; verifying, each row its own W keys
            first = (used - w).clamp(min=0) if w and s_q == 1 else None
            window = dict(window_size=(w - 1, 0)) if w and s_q > 1 else dict(cache_leftpad=first)
            q = q.unflatten(0, (p_seqs, s_q))                                  # [P, S, H, D]
            new = dict(scale=runner.scale, **sinks[i], **_new_kv(k, v, s_q))
            k, v = new.get("k_new"), new.get("v_new")
            if runner.batch_invariant:                                  # (measured, not used: Generator's note)
                return runner._two_segments(q, kc, vc, used, table, prompts, new, w).flatten(0, 1)
            if cu_groups is not None and not w:    # a plug-in (writes the new K/V); its launch sized from shapes
                return runner.attention.cascade(q, kc, vc, used, block_table=table, cu_groups=cu_groups,
                                                prefix_lens=prefix_lens, capturable=True, **new).flatten(0, 1)
            if runner.attention.decode is not _torch_flash_decode:     # a plug-in: it writes the new K/V itself
                return runner.attention.decode(q, kc, vc, used, block_table=table, **window, **new).flatten(0, 1)
            new_kv.append((pools.pool_index[i], k.flatten(0, 1), v.flatten(0, 1)))
            if w not in hidden:             # (one mask for every layer with this window: ~15 ops a layer fewer)
                hidden[w] = _hidden_keys(used, first, s_q, table.shape[1] * ps, w if s_q > 1 else 0)
            return _paged_decode_attention(q, k, v, kc, vc, table.long(), used, first, runner.scale,
                                           sinks[i].get("sinks"), hidden=hidden[w]).flatten(0, 1)

        if not runner.batch_invariant and runner.attention.decode is not _torch_flash_decode:    # a plug-in's
            attend.kv_slots = _kv_slots(pools, lambda: kv_index)      # new K / V: the model's q + k kernel may write

        def mix(i, module, h):
            cache = module.new_cache()
            pools.gather(i, rows, cache)
            if s_q > 1:                              # (a rollback runs the layer again over the accepted rows)
                inputs.append(h)
            out = module(h.unflatten(0, (p_seqs, s_q)), cache=cache).flatten(0, 1)
            for name, value in vars(cache).items():
                if isinstance(value, torch.Tensor):
                    dst.append(pools.states[i][name])
                    index.append(rows)
                    src.append(value)
            return out

        h = model.layers_forward(ids, positions, attend, mix)
        dst, index, src = _kv_writes(pools, new_kv, kv_index, dst, index, src)
        if dst:
            _write_rows(dst, index, src)
        return ((model.logits(h) if runner.samples else None), h, *inputs)

    def _draft_forward(self, model, ids, hidden, meta, n_pages, table):
        """The MTP head's drafts of P samples (``draft``): ids [P S] and hidden [P S, hidden] depth 0's rows
        (sample p's real ones first, n of them, at positions start ..), meta [4, P] (n, start, first head row
        + 1, tokens so far), n_pages [P] (the sample's pages; 0: its rows all to the spare page), table [P, W].
        -> the drafts [P, k] (greedy: argmax of the head's logits at each depth).  Rows past a sample's room
        write slots past its tokens, in its own pages (scratch, as the eager drafter's deeper rows) or the
        spare page."""
        pools = self.pools
        p_seqs = table.shape[0]
        s_q = ids.shape[0] // p_seqs
        n, start, first, length = meta.unbind(0)
        cols = torch.arange(table.shape[1], device=table.device)
        table = torch.where(cols[None, :] < n_pages[:, None], table, pools.pad_page)
        rows = torch.arange(s_q, device=ids.device)
        # depth 0: the rows start .. start + n - 1 (the padding after them, never seen by them: causal)
        y = self._head(model, 0, ids, (start[:, None] + rows).flatten(), hidden, start + 1 + s_q, first, table)
        y = y.view(p_seqs, s_q, -1)[torch.arange(p_seqs, device=ids.device), (n - 1).clamp(min=0)]
        drafts = []
        for depth in range(1, s_q):
            drafts.append(torch.argmax(model.logits(y), dim=-1))
            if depth < s_q - 1:              # the head on its own output: the row at length - 2 + depth
                y = self._head(model, depth, drafts[-1], length - 2 + depth, y, length + depth, first, table)
        return torch.stack(drafts, 1)

    def _head(self, model, depth, ids, positions, hidden, used, first, table):
        """The MTP head's layer for depth ``depth`` over S = len(ids) / P rows a sample (positions t, their
        keys at t + 1, seeing the head's keys from ``first``: ``ModelRunner.mtp_rows``'s rows) -> its hidden
        states; the new keys are in the pool when it returns."""
        runner, pools, ps = self.runner, self.pools, self.pools.page_size
        p_seqs, used, first = used.shape[0], used.int(), first.int()      # (flash_decode's dtypes)
        s_q = ids.shape[0] // p_seqs
        kv_index = _slots_of(table, positions + 1, ps)
        sinks, new_kv = getattr(model, "attention_sinks", lambda i: None), []

        def attend(i, q, k, v):
            kc, vc = pools.kv(i)
            q = q.unflatten(0, (p_seqs, s_q))
            extra = {} if sinks(i) is None else dict(sinks=sinks(i))
            new = _new_kv(k, v, s_q)
            if runner.attention.decode is not _torch_flash_decode:     # a plug-in: it writes the new K/V itself
                return runner.attention.decode(q, kc, vc, used, block_table=table, cache_leftpad=first,
                                               scale=runner.scale, **new, **extra).flatten(0, 1)
            new_kv.append((pools.pool_index[i], k, v))
            return _paged_decode_attention(q, new["k_new"], new["v_new"], kc, vc, table.long(), used, first,
                                           runner.scale, extra.get("sinks")).flatten(0, 1)

        if runner.attention.decode is not _torch_flash_decode:        # (outside the mode: ``draft``)
            attend.kv_slots = _kv_slots(pools, lambda: kv_index)
        y = model.mtp_forward(ids, positions, hidden, attend, depth)
        if new_kv:                      # (before the next depth reads them)
            _write_rows(*_kv_writes(pools, new_kv, kv_index))
        return y


def _slots_of(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pool slots of P sequences' rows at ``positions`` [P S] (S a sequence, in order) through their
    block table [P, W] -> [P S] int64."""
    pos = positions.view(table.shape[0], -1)
    return (table.long().gather(1, pos // page_size) * page_size + pos % page_size).flatten()


def _new_kv(k, v, s_q: int) -> dict:
    """A plug-in's keywords for the new rows' K and V, k / v [P S, H_kv, D] -> k_new / v_new [P, S, H_kv, D];
    none when the model has written them into the pool already (k = v = None: ``_kv_slots``)."""
    return {} if k is None else dict(k_new=k.unflatten(0, (-1, s_q)), v_new=v.unflatten(0, (-1, s_q)))


def _kv_slots(pools, slots):
    """An attend callback's ``kv_slots`` (``DecoderLM.layers_forward``): layer i's K and V pools as rows [S,
    H_kv, D] and the new rows' slots (``slots()``, computed once a step, when a layer first asks).  The fast
    model's fused q + k kernel then writes the new K and V there itself: the step's KV append without a
    launch of its own (and on the host, without a call), the plug-in reading the keys from the cache."""
    memo = []

    def kv_slots(i):
        if not memo:
            memo.append(slots())
        kc, vc = pools.kv(i)
        return kc.view(-1, *kc.shape[-2:]), vc.view(-1, *vc.shape[-2:]), memo[0]
    return kv_slots


def _kv_writes(pools, new_kv: list, kv_index, dst=(), index=(), src=()) -> tuple[list, list, list]:
    """``_write_rows``' arguments for the new K and V of the layers in ``new_kv`` [(pool index, k, v)] at the
    slots ``kv_index`` (one copy into each pool), after the writes dst / index / src."""
    dst, index, src = list(dst), list(index), list(src)
    if new_kv:
        slots = pools.k.shape[1] * pools.page_size                    # slots per layer's pool
        at = torch.cat([j * slots + kv_index for j, _, _ in new_kv])
        dst += [pools.k.view(-1, *pools.k.shape[-2:]), pools.v.view(-1, *pools.v.shape[-2:])]
        index += [at, at]
        src += [torch.cat([k for _, k, _ in new_kv]), torch.cat([v for _, _, v in new_kv])]
    return dst, index, src


def _sinks(model) -> list:
    """Per layer, the attention plug-ins' sinks keyword: {"sinks": [H_q]} on gpt-oss's layers, else {} (no
    keyword: a plug-in without one, PyTorch's own varlen_attn, still serves other models)."""
    sinks, out = getattr(model, "attention_sinks", lambda i: None), []
    for i, kind in enumerate(model.config.kinds):       # (a loop, no walrus: the compiler traces it)
        s = sinks(i) if kind == "attention" else None
        out.append({} if s is None else dict(sinks=s))
    return out


# ----------------------------------------------------------------------------- speculative decoding
# (the same rule and code as ref/generator_engine.py's)

def ngram_draft(tokens: list, k: int, max_n: int = 4, min_n: int = 2) -> list:
    """Prompt-lookup drafting (n-gram speculation): for n = max_n down to min_n, find the latest earlier
    occurrence of the sequence's last n tokens that k tokens follow and propose those (else the latest
    occurrence's shorter continuation: in a repeating run the latest match sits just before the suffix);
    [] when none recurs.  Weight-free, for any model: it pays where outputs repeat their context (code
    edits, quoting, reasoning that restates, a model caught in a loop)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix, latest = tokens[-n:], None
        for start in range(len(tokens) - n - 1, -1, -1):             # latest first, the suffix itself excluded
            if tokens[start:start + n] == suffix:
                if len(tokens) - start - n >= k:
                    return tokens[start + n:start + n + k]
                latest = tokens[start + n:start + n + k] if latest is None else latest
        if latest is not None:
            return latest
    return []


def _drafter(speculative, k):
    """The drafter function ``Generator(speculative=...)`` names, or None; checks ``num_speculative_tokens``."""
    if not _is_int(k) or not 1 <= k <= 64:
        raise ValueError(f"num_speculative_tokens must be an int in [1, 64], got {k!r}")
    if speculative is None or callable(speculative):
        return speculative
    if speculative == "ngram":
        return ngram_draft
    if speculative == "mtp":
        return MTPDrafter
    raise ValueError(f"speculative must be None, 'ngram', 'mtp' or a drafter function (tokens, k) -> token ids, "
                     f"got {speculative!r}")


class _MTPRows(NamedTuple):
    """A sample's MTP head rows: computed for positions first .. next - 1 (their K/V in its pages), and the
    main model's hidden states of positions next, next + 1, ... waiting for theirs (``pending`` [n, hidden])."""
    first: int
    next: int
    pending: torch.Tensor


class MTPDrafter:
    """``speculative="mtp"``: Qwen3.5's multi-token-prediction head drafts (decoder_lm.py's ``mtp_forward``;
    the model built with ``mtp=True``), greedily, batched over the decoding samples: ref/generator_engine.py's
    ``MTPDrafter`` computes the same rows, one sample at a time.  Row t of the head combines the main model's
    hidden state at t with the token at t + 1 and predicts the token at t + 2; its K/V live in the page pool
    (``ModelRunner.mtp_rows``).  The engine hands over the hidden states of every position it computes
    (``prefilled``: the prompt pieces, whose rows are computed at once where the next token is known, so a
    group's samples share them; ``observe``: a decode step's rows and a verification's accepted ones).  A
    draft first computes every sample's rows whose next token is now known (the last of them, position
    len - 2, proposes the token at len), then feeds the head its own output with each draft, k - 1 more
    times (rows at positions len - 1 ..., scratch: the next rows computed overwrite their slots).  A sample's
    head rows start at its first computed position (after a prefix-cache hit drafts may be worse there; the
    tokens never change: verification decides them)."""

    def __init__(self, runner: ModelRunner, model_of):
        self.runner, self.model_of = runner, model_of     # (model_of: the live weights, a hot swap changes them)

    def observe(self, runs: list) -> None:
        """The main model's hidden states of ``runs`` [(sample, first position, hidden [n, hidden])], each
        continuing its sample's positions from where its head rows stand (copied: a pass's tensor is not kept)."""
        for s, position, hidden in runs:
            r = s.mtp
            if r is None:                                 # its first computed position: the head starts there
                s.mtp = _MTPRows(position, position, hidden.clone())
                continue
            if r.next + r.pending.shape[0] != position:
                raise RuntimeError(f"MTPDrafter: position {position} follows {r.next + r.pending.shape[0] - 1}")
            s.mtp = r._replace(pending=torch.cat([r.pending, hidden]))

    @torch.no_grad()
    def prefilled(self, model: nn.Module, work: list, hidden: torch.Tensor) -> None:
        """After a prefill pass over ``work`` (hidden: the pass's rows, in work order): its rows are observed
        and the head's computed wherever the next token is known (every row but a prompt's last)."""
        bounds = [0, *itertools.accumulate(c.end - c.start for c in work)]
        if work:
            self.observe([(c.seq, c.start, hidden[a:b]) for c, a, b in zip(work, bounds, bounds[1:])])
            self._catch_up(model, list({id(c.seq): c.seq for c in work}.values()))

    def _catch_up(self, model: nn.Module, seqs: list) -> list:
        """The head's rows of ``seqs``' pending positions whose next token is known, in one call; returns each
        sample's last new row's output (None where it had none)."""
        rows, hidden, last = [], [], []
        for s in seqs:
            r = s.mtp
            n = 0 if r is None else min(r.pending.shape[0], len(s.tokens) - 1 - r.next)
            if n > 0:
                rows += [(s, r.next + j, s.tokens[r.next + j + 1], r.first) for j in range(n)]
                hidden.append(r.pending[:n])
                s.mtp = _MTPRows(r.first, r.next + n, r.pending[n:])
            last.append(len(rows) - 1 if n > 0 else None)
        if not rows:
            return [None] * len(seqs)
        y = self.runner.mtp_rows(model, rows, torch.cat(hidden), 0)
        return [None if i is None else y[i] for i in last]

    @torch.no_grad()
    def propose(self, seqs: list, rooms: list) -> list:
        """Up to rooms[n] drafts for each of ``seqs`` (their pages hold the draft rows' slots): through the
        static step where the engine has one (``StaticDecode.draft``: compiled or replayed, one read-back),
        else here, a call per depth."""
        model = self.model_of()
        static = self.runner.static
        drafts = static.draft(model, seqs, rooms) if static is not None else None
        if drafts is not None:
            return drafts
        drafting = [(s, r) for s, r in zip(seqs, rooms) if r > 0]
        ys = self._catch_up(model, [s for s, _ in drafting])
        live = [(s, room, y) for (s, room), y in zip(drafting, ys)
                if y is not None and s.mtp.next == len(s.tokens) - 1]   # its row at len - 2 is the newest
        drafts = {id(s): [] for s in seqs}
        depth = 0
        while live:
            y = torch.stack([y for _, _, y in live])
            for (s, _, _), token in zip(live, torch.argmax(model.logits(y), dim=-1).tolist()):
                drafts[id(s)].append(token)
            depth += 1
            live = [(s, room, y[n]) for n, (s, room, _) in enumerate(live) if room > depth]
            if live:                                      # the head on its own output, one position on
                rows = [(s, len(s.tokens) - 2 + depth, drafts[id(s)][-1], s.mtp.first) for s, _, _ in live]
                y = self.runner.mtp_rows(model, rows, torch.stack([y for _, _, y in live]), depth)
                live = [(s, room, y[n]) for n, (s, room, _) in enumerate(live)]
        return [drafts[id(s)] for s in seqs]


# ----------------------------------------------------------------------------- batched sampling

# SplitMix64 (Steele, Lea and Flood, 2014): the stream seeded s outputs mix(s + i * gamma) for i = 1, 2, ...,
# so its i-th output is a function of (s, i) alone, computed without the i - 1 before it.
_GAMMA, _MASK64 = 0x9E3779B97F4A7C15, (1 << 64) - 1


def keyed_uniform(seed: int, index: int) -> float:
    """The draw for token ``index`` of a sample whose seed is ``seed``: SplitMix64's output ``index + 1`` of
    the stream ``seed``, its top 53 bits as a float64 in [0, 1)."""
    z = (seed + (index + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53


def request_seed(seed: int | None) -> int:
    """A sample's seed: its own, or a fresh random 64-bit one."""
    return random.SystemRandom().getrandbits(64) if seed is None else seed


def sample_rows(logits: torch.Tensor, params: list, keys: list, staging, log_softmax=None) -> tuple[list, list]:
    """The reference's per-row rule on a batch: fp32 logits [B, V] -> (tokens, logprobs) lists.

    Rows are grouped (greedy, plain temperature, top-k/top-p) and each group is one set of tensor
    ops, its rows' indices, temperatures, top-k and top-p filled into ``staging``'s buffers; each sampled
    row's uniform is ``keyed_uniform(*keys[i])`` (its sample's seed, the token's index in the completion),
    so a request gets the same token alone or in any batch.  One device-to-host copy per group.
    ``log_softmax``: the model's (its batch-invariant one in that mode: what its ``token_logprobs``
    computes); None = torch's."""
    log_softmax = log_softmax or (lambda x: torch.log_softmax(x, dim=-1))
    b, vocab = logits.shape
    tokens, logprobs = [0] * b, [0.0] * b
    groups = ([], [], [])
    for i, sp in enumerate(params):
        groups[0 if sp.temperature == 0 else (2 if sp.top_k or sp.top_p < 1.0 else 1)].append(i)
    for kind, rows in enumerate(groups):
        if not rows:
            continue
        lg = logits if len(rows) == b else logits[staging.put(f"group{kind}", rows, torch.int64)]
        if kind == 0:
            tok = torch.argmax(lg, dim=-1)
            lp = log_softmax(lg).gather(1, tok[:, None])[:, 0]
        else:
            inv_t = staging.put("inv_t", [1.0 / params[i].temperature for i in rows], torch.float32)
            logp = log_softmax(lg * inv_t[:, None])
            p = logp.exp()
            if kind == 2:
                p, order = torch.sort(p, dim=-1, descending=True, stable=True)
                top_k = staging.put("top_k", [params[i].top_k or vocab for i in rows], torch.int64)
                top_p = staging.put("top_p", [params[i].top_p for i in rows], torch.float32)
                keep = torch.arange(vocab, device=logits.device)[None] < top_k[:, None]
                keep &= (torch.cumsum(p, dim=-1) - p) < top_p[:, None]
                p = torch.where(keep, p, torch.zeros_like(p))
            cdf = torch.cumsum(p.double(), dim=-1)
            u = staging.put("uniform", [keyed_uniform(*keys[i]) for i in rows], torch.float64)
            index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            last = vocab - 1 - torch.argmax((p.flip(-1) > 0).to(torch.int8), dim=-1)
            index = torch.minimum(index, last)
            tok = index if kind == 1 else order.gather(1, index[:, None])[:, 0]
            lp = logp.gather(1, tok[:, None])[:, 0]
        for i, t, lp_i in zip(rows, tok.tolist(), lp.tolist()):
            tokens[i], logprobs[i] = t, lp_i
    return tokens, logprobs


# ----------------------------------------------------------------------------- attention state merge

def _merge_states(out_a, lse_a, out_b, lse_b):
    """Two attention states over disjoint key sets -> the state over their union: with m = max(lse_a, lse_b),
    w = exp(lse - m), lse = m + log(w_a + w_b), out = (w_a out_a + w_b out_b) / (w_a + w_b).  out [T, H, D],
    lse [H, T] fp32; a side with lse = -inf (no keys) drops out.  Elementwise (exp, log and IEEE
    arithmetic): a row's bits do not depend on its neighbours.  Differentiable."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)                    # [H, T]
    den = w_a + w_b
    lse = torch.where(den == 0, torch.full_like(m, float("-inf")), m + torch.log(den))
    w_a, w_b, den = (x.t()[..., None] for x in (w_a, w_b, torch.where(den == 0, torch.ones_like(den), den)))
    out = (w_a * out_a.float() + w_b * out_b.float()) / den                  # [T, H, D]
    return out, lse


# ----------------------------------------------------------------------------- default attention plug-ins

def _torch_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                       softcap=0.0, sinks=None):
    """The default prefill attention: ``varlen_attn``'s signature in plain PyTorch, one sequence at
    a time.  It supports what the engine asks for (causal, within a left window (left, 0) or not, packed or
    paged keys, GQA, sinks) and raises NotImplementedError for the rest (plug in
    fast/paged_varlen_attention.varlen_attn)."""
    left, right = window_size
    if (return_aux is not None and return_aux.lse) or softcap or right != 0 or left < -1:
        raise NotImplementedError("the in-file default varlen_attn does causal attention only (window (left, 0), "
                                  "no lse or softcap); plug in fast/paged_varlen_attention.varlen_attn")
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
        # Bottom-right: query i of L_q sits at key position p = i + L_k - L_q and sees keys p - left .. p
        l_q, l_k = q.shape[0], k.shape[0]
        p = torch.arange(l_q, device=q.device)[:, None] + (l_k - l_q)
        j = torch.arange(l_k, device=q.device)[None]
        visible = (j <= p) & ((j >= p - left) if left >= 0 else True)                 # [L_q, L_k]
        if sinks is None:   # SDPA wants [1, H, L, D]; its fused kernels keep no [L_q, L_k] scores
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=visible, scale=scale, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))
        else:
            outs.append(_masked_attention(q[None], k[None], v[None], visible[None], scale, sinks)[0])
    return torch.cat(outs) if outs else query.new_zeros(query.shape)


def _torch_flash_decode(q, k_cache, v_cache, seqused_k, *, block_table=None, k_new=None, v_new=None, scale=None,
                        num_splits=None, softcap=0.0, sinks=None, return_lse=False, out=None, cache_leftpad=None,
                        window_size=(-1, -1)):
    """The default decode attention: ``flash_decode``'s signature in plain PyTorch, the whole batch at
    once (keys gathered from the pages, padded to the longest sequence, masked).  k_new / v_new are
    written into the cache first; ``cache_leftpad [B]``: sequence b's keys start there (a sliding
    window); ``window_size=(left, 0)``: row i (position L - S_q + i) sees from L - S_q + i - left on;
    sinks as varlen_attn's.  No lse or softcap (NotImplementedError)."""
    if return_lse or softcap:
        raise NotImplementedError("the in-file default flash_decode has no lse or softcap; plug in "
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
    j = torch.arange(longest, device=q.device)[None, None]
    first = cache_leftpad.long()[:, None, None] if cache_leftpad is not None else 0
    if window_size[0] >= 0:
        first = torch.maximum(torch.as_tensor(first, device=q.device), pos[:, :, None] - window_size[0])
    o = _masked_attention(q, k, v, (j <= pos[:, :, None]) & (j >= first), scale, sinks)   # visible [B, S_q, L]
    if out is not None:
        out.copy_(o)
        return out
    return o


def _masked_attention(q, k, v, visible, scale, sinks):
    """softmax(q k^T * scale) v over the visible keys, GQA, fp32 inside: q [B, L_q, H_q, D]; k, v [B, L_k, H_kv, D];
    visible [B, L_q, L_k] bool -> [B, L_q, H_q, D] in q's dtype; a row that sees no key gets 0.  sinks [H_q]
    (gpt-oss): one more key per head, of logit sinks[h] and value 0 (it takes its share of the mass, adds
    nothing)."""
    b, l_q, h_q, d = q.shape
    h_kv, l_k = k.shape[2], k.shape[1]
    qf = q.float().view(b, l_q, h_kv, h_q // h_kv, d)                            # head h reads kv head h // G
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale                # [B, H_kv, G, L_q, L_k]
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is not None:                                                       # the sinks' column
        s = torch.cat([s, sinks.float().view(1, h_kv, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :l_k]                     # the sink's value is 0: dropped
    return torch.einsum("bhgqk,bkhd->bqhgd", p, v.float()).reshape(b, l_q, h_q, d).to(q.dtype)


# ----------------------------------------------------------------------------- memory budget
# The KV pages, the linear layers' state slots and their checkpoints share one budget (vLLM's
# gpu_memory_utilization / kv_cache_memory_bytes, SGLang's mem_fraction_static):
#   kv_cache_memory given            that many bytes;
#   CUDA                             memory_utilization x the device's memory, less what this process holds
#                                    already (the weights), the shadow weights of a hot swap, and the
#                                    activation peak of a profiling step at the largest prefill;
#   CPU                              memory_utilization x CPU_SHARE of the memory available when the engine
#                                    starts (/proc/meminfo's MemAvailable, a cgroup limit or RLIMIT_AS,
#                                    whichever is least), less the shadow weights: the other half is left
#                                    for activations, the OS and other processes.
# Within the budget: the state slots (one per decoding sequence, max_batch_size of them) and, for a hybrid
# model with prefix caching, the checkpoints take at most a quarter each (fewer slots than the default 256
# when the state is large); the KV pages take the rest, up to what max_batch_size sequences of the model's
# max_seq_len can hold (a pool beyond that would only cache prefixes).  One sequence of max_seq_len must fit:
# max_seq_len defaults to the model's, capped by the pages; an explicit one that does not fit is a
# ValueError before anything is allocated.  A pool too small for the load preempts (recomputation).

CPU_SHARE = 0.5
DEFAULT_MAX_BATCH_SIZE = 256


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How the budget is spent (bytes for this rank's shard).  ``stats()`` reports it."""

    budget: int                     # what the KV pages, state slots and checkpoints may take together
    source: str                     # where the budget comes from
    kv_bytes_per_token: int         # K and V of one token in every attention layer
    state_bytes_per_sequence: int   # every linear layer's cache of one sequence (0: attention only)
    page_size: int
    num_pages: int
    max_batch_size: int             # state slots = block-table rows = sequences decoding at once
    num_checkpoints: int
    max_seq_len: int

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_size * self.kv_bytes_per_token

    @property
    def state_bytes(self) -> int:
        return self.max_batch_size * self.state_bytes_per_sequence

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoints * self.state_bytes_per_sequence

    def report(self) -> dict:
        return dict(memory_budget_bytes=self.budget, memory_budget_source=self.source,
                    kv_pool_bytes=self.kv_bytes, state_slot_bytes=self.state_bytes,
                    checkpoint_capacity_bytes=self.checkpoint_bytes, kv_tokens=self.num_pages * self.page_size,
                    kv_bytes_per_token=self.kv_bytes_per_token, max_seq_len=self.max_seq_len)


def _size(n: float) -> str:
    """Bytes for a message: '1.50 GiB', '25.0 KiB'."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def _available_host_memory() -> tuple[int, str]:
    """(bytes this process may still allocate on the host, what bounds it): the least of MemAvailable, the
    cgroup's memory.max - memory.current and RLIMIT_AS - the address space in use."""
    import resource
    found = []

    def read(path):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    meminfo = read("/proc/meminfo")
    if meminfo:
        fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
        if "MemAvailable" in fields:
            found.append((int(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable"))
    limit, current = read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")
    if limit and current and limit.strip() != "max":
        found.append((int(limit) - int(current), "the cgroup's memory.max"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    status = read("/proc/self/status")
    if soft != resource.RLIM_INFINITY and status:
        vm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:")), 0)
        found.append((soft - vm, "RLIMIT_AS"))
    if not found:
        raise ValueError("cannot tell how much host memory is available (no /proc/meminfo): pass kv_cache_memory")
    return min(found)


def _memory_budget(device: torch.device, *, kv_cache_memory, memory_utilization: float, weight_bytes: int,
                   activation_bytes: int, device_memory=None) -> tuple[int, str]:
    """(bytes for the pools, where they come from): the section above.  ``device_memory``: a CUDA device's
    (free, total, bytes this process holds: torch's reserved memory, the weights in it), or a CPU's
    (available, what bounds it); measured when None (a parameter so that the arithmetic can be checked for
    a GPU on any machine)."""
    gib = 2 ** 30
    if kv_cache_memory is not None:
        return int(kv_cache_memory), f"kv_cache_memory={int(kv_cache_memory)}"
    if device.type == "cuda":
        free, total, held = device_memory if device_memory is not None else (
            *torch.cuda.mem_get_info(device), torch.cuda.memory_reserved(device))
        asked = memory_utilization * total
        if asked > free + held:
            raise ValueError(f"memory_utilization={memory_utilization} asks for {asked / gib:.2f} GiB of the GPU's "
                             f"{total / gib:.2f} GiB, but only {(free + held) / gib:.2f} GiB are free or held by this "
                             f"process (other processes hold the rest): lower memory_utilization or pass "
                             f"kv_cache_memory")
        budget = asked - held - weight_bytes - activation_bytes
        source = (f"{memory_utilization} x {total / gib:.2f} GiB ({device}) - {held / gib:.2f} GiB held "
                  f"(weights) - {weight_bytes / gib:.2f} GiB shadow weights - {activation_bytes / gib:.2f} GiB "
                  f"activation peak")
    else:
        available, bound = device_memory[:2] if device_memory is not None else _available_host_memory()
        budget = memory_utilization * CPU_SHARE * available - weight_bytes
        source = (f"{memory_utilization} x {CPU_SHARE} x {available / gib:.2f} GiB available ({bound}) - "
                  f"{weight_bytes / gib:.2f} GiB shadow weights")
    if budget <= 0:
        raise ValueError(f"no memory is left for the KV cache ({source} = {_size(budget)}): raise "
                         f"memory_utilization or pass kv_cache_memory")
    return int(budget), source


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A pool of zeros.  On a CPU, a large one lives in an anonymous memory map: the OS hands out zeroed pages
    as they are first written, so a pool sized for the budget costs neither time nor resident memory
    until the engine fills it (torch.zeros writes every byte: 25 s for Qwen3-0.6B's 8 GiB on two cores)."""
    import mmap
    count = math.prod(shape)
    if device.type != "cpu" or count * dtype.itemsize < 2 ** 20:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).view(shape)


@torch.no_grad()
def _linear_state_shapes(model) -> dict:
    """Each "linear" layer's cache of one sequence, {layer: {name: (shape, dtype)}}: the layer run as a prefill
    runs it, on one token of zeros with a fresh cache (the plug-in's cache is opaque to the engine; this
    rank's shard of it)."""
    shapes, probed = {}, {}
    for i, kind in enumerate(model.config.kinds):
        if kind == "linear":
            module = model.layers[i].linear_attn
            same = (type(module), tuple((n, t.shape, t.dtype) for n, t in module.state_dict().items()))
            if same not in probed:                      # (layers of one class and sizes are probed once)
                p = next(module.parameters())
                cache = module.new_cache()
                module(torch.zeros(1, 1, model.config.hidden_size, dtype=p.dtype, device=p.device),
                       cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=p.device), cache=cache)
                probed[same] = {name: (tuple(t.shape[1:]), t.dtype) for name, t in vars(cache).items()
                                if isinstance(t, torch.Tensor)}
            shapes[i] = probed[same]
    return shapes


def plan_memory(budget: int, source: str, *, kv_bytes_per_token: int, state_bytes_per_sequence: int,
                page_size: int, model_max_seq_len: int, max_seq_len=None, max_batch_size=None, num_pages=None,
                num_checkpoints=None, checkpoints_wanted: bool = False) -> MemoryPlan:
    """Split ``budget`` between the state slots, the checkpoints and the KV pages (the section above), or
    raise ValueError (naming the budget, the bytes per token and the largest context that fits) when one
    sequence of ``max_seq_len`` tokens cannot fit.  Explicit counts are taken as given, and must fit."""
    per_seq, page_bytes = state_bytes_per_sequence, page_size * kv_bytes_per_token
    if max_batch_size is not None:
        slots = max_batch_size
    else:                                        # the default 256, fewer when their state passes a quarter
        slots = DEFAULT_MAX_BATCH_SIZE if not per_seq else max(1, min(DEFAULT_MAX_BATCH_SIZE, budget // 4 // per_seq))
    left = budget - slots * per_seq
    if num_checkpoints is not None or not checkpoints_wanted:
        checkpoints = num_checkpoints or 0
        left -= checkpoints * per_seq
        pages = num_pages if num_pages is not None else (
            max(0, left // page_bytes) if page_bytes else slots * -(-model_max_seq_len // page_size))
    elif num_pages is not None:                  # checkpoints: a quarter of the budget, at most one per page
        pages = num_pages
        checkpoints = min(pages, max(0, min(budget // 4, left - pages * page_bytes) // per_seq))
    else:
        checkpoints = budget // 4 // per_seq
        pages = max(0, (left - checkpoints * per_seq) // page_bytes) if page_bytes else checkpoints
        if checkpoints > pages:                  # more than one per page: share the rest alike
            pages = checkpoints = max(0, left // (page_bytes + per_seq))
    if num_pages is None:                        # more pages than the slots' sequences can hold only cache
        pages = min(pages, slots * -(-model_max_seq_len // page_size))
        checkpoints = min(checkpoints, pages) if num_checkpoints is None else checkpoints
    pages, checkpoints = int(pages), int(checkpoints)
    needed = (slots + checkpoints) * per_seq + pages * page_bytes
    context = pages * page_size
    largest = min(context, model_max_seq_len)
    what = (f"the KV cache budget of {_size(budget)} ({source}) holds {context} tokens at "
            f"{kv_bytes_per_token} bytes per token"
            + (f", beside {slots} state slots and {checkpoints} checkpoints of {per_seq} bytes each"
               if per_seq else ""))
    if needed > budget:
        raise ValueError(f"{what}: the explicit num_pages / max_batch_size / num_checkpoints need {needed} bytes, "
                         f"more than the budget; pass smaller ones or a larger kv_cache_memory / memory_utilization")
    if max_seq_len is not None:
        if max_seq_len > model_max_seq_len:
            raise ValueError(f"max_seq_len={max_seq_len} is longer than the model's ({model_max_seq_len}: its rotary "
                             f"tables); load the model with a longer max_seq_len")
        if max_seq_len > context:
            raise ValueError(f"{what}: fewer than max_seq_len={max_seq_len} tokens of one sequence; the largest "
                             f"context that fits is {largest}: pass max_seq_len <= {largest}, or a larger "
                             f"kv_cache_memory / memory_utilization")
        length = max_seq_len
    else:
        length = largest
    if length < 2:
        raise ValueError(f"{what}: not even one sequence of 2 tokens fits; pass a larger kv_cache_memory or "
                         f"memory_utilization (or fewer state slots: max_batch_size)")
    return MemoryPlan(budget=int(budget), source=source, kv_bytes_per_token=kv_bytes_per_token,
                      state_bytes_per_sequence=per_seq, page_size=page_size, num_pages=pages, max_batch_size=slots,
                      num_checkpoints=checkpoints, max_seq_len=length)


def plan_pools(model: nn.Module, opts: EngineOptions, attention: _AttentionFns, tp) -> tuple[MemoryPlan, dict]:
    """The memory plan of a Generator's pools (the section above) and the linear layers' per-sequence state
    shapes.  Tensor-parallel: every rank plans from the least budget of all ranks (an all-reduce), so every
    rank has the same pages, rows and checkpoints (the scheduler is the same on every rank)."""
    c, p = model.config, next(model.parameters())
    local = getattr(model, "local_config", c)          # this rank's heads under tensor parallelism
    attention = _attention_layers(c, opts.speculative == "mtp")
    state_shapes = _linear_state_shapes(model)         # linear layer -> {name: (shape of one sequence, dtype)}
    weight_bytes = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))   # (tied: once)
    budget, source = _memory_budget(p.device, kv_cache_memory=opts.kv_cache_memory,
                                    memory_utilization=opts.memory_utilization, weight_bytes=weight_bytes,
                                    activation_bytes=_activation_peak(model, opts.max_prefill_tokens, attention))
    if tp is not None:
        budget = tp.least(budget)
    plan = plan_memory(
        budget, source, page_size=opts.page_size, model_max_seq_len=c.max_seq_len, max_seq_len=opts.max_seq_len,
        kv_bytes_per_token=2 * len(attention) * local.num_kv_heads * local.head_dim * p.dtype.itemsize,
        state_bytes_per_sequence=sum(math.prod(shape) * dtype.itemsize for shapes in state_shapes.values()
                                     for shape, dtype in shapes.values()),
        max_batch_size=opts.max_batch_size, num_pages=opts.num_pages, num_checkpoints=opts.num_checkpoints,
        checkpoints_wanted="linear" in c.kinds and opts.prefix_caching)
    return plan, state_shapes


def _attention_layers(c, mtp: bool) -> list:
    """The layers with K/V pools: the attention layers, then (``mtp``: speculative="mtp") the MTP head's."""
    return [i for i, kind in enumerate(c.kinds) if kind == "attention"] + (
        [c.num_layers + d for d in range(c.mtp_layers)] if mtp else [])


@torch.no_grad()
def _activation_peak(model: nn.Module, tokens: int, attention: _AttentionFns) -> int:
    """CUDA: the memory a prefill of ``tokens`` tokens (one sequence, the largest step) allocates beyond the
    weights, measured by running it once (vLLM's profiling run); 0 on a CPU (the budget leaves room)."""
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return 0
    c = model.config
    tokens = min(tokens, c.max_seq_len)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    window, sinks = getattr(model, "attention_window", lambda i: 0), _sinks(model)    # (gpt-oss: the real path)

    def attend(i, q, k, v):
        w = window(i)
        return attention.varlen(q, k, v, cu, cu, tokens, tokens, scale=c.head_dim ** -0.5,
                                window_size=(w - 1 if w else -1, 0), enable_gqa=True, **sinks[i], **attention.kw)

    def mix(i, module, h):
        return module(h[None], cu_seqlens=cu, cache=module.new_cache())[0]

    h = model.layers_forward(torch.zeros(tokens, dtype=torch.long, device=dev), torch.arange(tokens, device=dev),
                             attend, mix)
    model.logits(h[-min(tokens, 256):])
    del h
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()                    # what the step cached is not held: the budget counts its peak
    return peak


# ----------------------------------------------------------------------------- tensor parallelism
# Generator(model, tensor_parallel_size=N): the object the caller holds is rank 0.  It starts N - 1 worker
# processes (multiprocessing spawn), each of which builds its shard of the model (decoder_lm.py's
# DecoderLM(config, tp_group=...): heads split Megatron-style, MoE experts E / N whole a rank, its docstring has
# the layout) and an engine like this one.  Every rank runs the same scheduler on the same events: rank 0
# sends each iteration's new requests (a random seed drawn once, on rank 0) and weight swap over a pipe, every
# rank runs the step with its shard (the row-parallel sums and the experts' all-to-alls are the model's
# collectives over the ranks' process group: gloo on CPUs, NCCL on GPUs, on tp_address, loopback by default),
# rank 0 samples and broadcasts the tokens.  So the prefix
# cache's keys and decisions, the pages and the preemptions are the same on every rank, and every rank's
# KV pages, Gated DeltaNet states and checkpoints hold its heads.  Weights: a full state dict to
# load_weights is validated on rank 0, each worker is sent its shard (into its shadow weights), and the swap
# happens at the same iteration on every rank.  Faults: a worker that dies (its process sentinel, or a
# collective that fails) or hangs (a collective past tp_timeout_s) stops the generator for good: what it held
# fails, later submits raise, the workers are ended; close() ends them too, within tp_timeout_s.
# Messages are typed records: rank 0 -> a worker, over its control pipe _Iteration / _Close, over its weights pipe
# _LoadShard / _Connect / _Receive / _Close; a worker's answers are _Reply(_Ack, detail).  Start-up: each worker
# says JOINING (then joins the process group), BUILT (its shard), READY (its engine, pools sized with rank 0's).

# How long a worker may take to start, join the group and build its shard (a loaded machine imports torch and
# reads a checkpoint slowly); tp_timeout_s bounds every later wait.
TP_STARTUP_TIMEOUT_S = 180.0


class _Ack(enum.Enum):
    JOINING = "joining"
    BUILT = "built"
    READY = "ready"
    LOADED = "loaded"         # a weight shard is in the worker's shadow weights
    DONE = "done"             # a transport's connect / receive succeeded
    ERROR = "error"


class _Reply(NamedTuple):
    kind: _Ack
    detail: str | None = None


class _Iteration(NamedTuple):
    """Rank 0's iteration for the workers: its new requests [(request_id, prompt, sampling fields)] and the
    weights version swapped in before it (or None)."""
    requests: list
    swap_version: int | None


class _Close(NamedTuple):
    pass


class _LoadShard(NamedTuple):
    tensors: dict             # this worker's shard of a state dict, on the host


class _Connect(NamedTuple):
    receiver: object          # a weight transport's receiver (connect_weights)


class _Receive(NamedTuple):
    version: int | None
    header: object


class _Checkpoint(NamedTuple):
    """What each rank loads its shard from: ``model_class.from_pretrained(path, tp_group=..., **kwargs)``."""
    model_class: type
    path: str
    kwargs: dict


class _Instance(NamedTuple):
    """What each worker builds its (empty) shard as: ``model_class(config, tp_group=..., **init_kwargs)``; rank 0
    then sends it its slice of the caller's model."""
    model_class: type
    config: object
    init_kwargs: dict
    dtype: torch.dtype
    device: torch.device


def _process_group(store, rank: int, size: int, address: str, device: torch.device, timeout_s: float):
    import datetime

    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(rank 0's index + r) on GPUs, the CPU otherwise."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def _build_shard(recipe, group, device: torch.device, initial_weights=None) -> nn.Module:
    if isinstance(recipe, _Checkpoint):
        kw = dict(recipe.kwargs, device=device)
        return recipe.model_class.from_pretrained(recipe.path, tp_group=group, **kw)
    model = recipe.model_class(recipe.config, tp_group=group, device="meta", dtype=recipe.dtype,
                               **recipe.init_kwargs).to_empty(device=device)
    model.load_state_dict(initial_weights)
    return model


class _Ranks:
    """What both sides of a tensor-parallel generator share: the rank, the group, the token broadcast."""

    def __init__(self, rank: int, size: int, group, device: torch.device):
        self.rank, self.size, self.group, self.device = rank, size, group, device

    def least(self, value: int) -> int:
        """The least of every rank's ``value`` (an all-reduce with MIN): the ranks' memory budgets."""
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return int(t.item())

    def share_tokens(self, tokens: torch.Tensor) -> list:
        """Rank 0's sampled tokens (int64 [B], filled on every rank: rank 0's are the real ones), on every rank."""
        if tokens.numel():
            self.group.broadcast(tokens, 0).wait()
        return tokens.tolist()


class _TensorParallel(_Ranks):
    """Rank 0's side: the worker processes, their pipes (iterations, weights), the watchdog."""

    def __init__(self, opts: EngineOptions):
        super().__init__(0, opts.tensor_parallel_size, None, torch.device("cpu"))
        self.opts, self.timeout_s, self.address = opts, float(opts.tp_timeout_s), opts.tp_address
        self.procs, self.control, self.weights = [], [], []
        self._stop = threading.Event()
        self._watchdog = None

    def start(self, model) -> nn.Module:
        """Start the workers; returns rank 0's shard (the caller's model is only read)."""
        import datetime
        import multiprocessing as mp

        import torch.distributed as dist
        if isinstance(model, _Checkpoint):
            recipe = model
            self.device = torch.device(model.kwargs.get("device") or "cpu")
        else:
            _check_model(model)
            if getattr(model, "tp_size", 1) != 1 or not hasattr(model, "init_kwargs"):
                raise ValueError("tensor_parallel_size > 1 takes the whole (tp = 1) model of a class with a tp_group "
                                 "keyword (decoder_lm.py's DecoderLM); its shards are built here")
            p = next(model.parameters())
            self.device = p.device
            recipe = _Instance(type(model), model.config, dict(model.init_kwargs), p.dtype, p.device)
        store = dist.TCPStore(self.address, 0, self.size, True,
                              datetime.timedelta(seconds=max(self.timeout_s, TP_STARTUP_TIMEOUT_S)),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, self.size):
                control, control_child = ctx.Pipe()
                weights, weights_child = ctx.Pipe()
                proc = ctx.Process(target=_tp_worker_main, name=f"{self.opts.name}-tp{rank}", daemon=True,
                                   args=(rank, store.port, recipe, _rank_device(self.device, rank), self.opts,
                                         control_child, weights_child))
                proc.start()
                control_child.close()
                weights_child.close()
                self.procs.append(proc)
                self.control.append(control)
                self.weights.append(weights)
            for rank, pipe in enumerate(self.control, start=1):       # a busy machine starts them slowly: the
                self._expect(pipe, rank, _Ack.JOINING, TP_STARTUP_TIMEOUT_S)   # group's timeout is for steps
            self.group = _process_group(store, 0, self.size, self.address, self.device, self.timeout_s)
            if isinstance(recipe, _Checkpoint):
                shard = _build_shard(recipe, self.group, self.device)
            else:
                empty = recipe.model_class(recipe.config, tp_group=self.group, device="meta", dtype=recipe.dtype,
                                           **recipe.init_kwargs)
                full = model.state_dict()
                for rank, pipe in enumerate(self.weights, start=1):
                    pipe.send(_LoadShard(_to_host(empty.shard_state_dict(full, rank=rank))))
                shard = _build_shard(recipe, self.group, self.device, empty.shard_state_dict(full))
            for rank, pipe in enumerate(self.control, start=1):
                self._expect(pipe, rank, _Ack.BUILT, TP_STARTUP_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        self._store = store
        return shard

    def ready(self) -> None:
        """Wait for every worker's engine (each sized its pools with rank 0: ``least``)."""
        for rank, pipe in enumerate(self.control, start=1):
            self._expect(pipe, rank, _Ack.READY, TP_STARTUP_TIMEOUT_S)

    def least(self, value: int) -> int:
        """_Ranks.least, naming a worker that failed before it (its build, its engine) instead of timing out."""
        try:
            return super().least(value)
        except Exception as exc:
            errors = [pipe.recv().detail for pipe in self.control if pipe.poll(0)]
            raise RuntimeError(f"tensor-parallel workers failed before sizing their pools: {errors or exc}") from exc

    def _expect(self, pipe, rank: int, what: _Ack, timeout_s: float | None = None) -> None:
        """The worker's next reply must be ``what``, within ``timeout_s`` (tp_timeout_s by default) and while
        it lives."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline, proc = time.monotonic() + timeout_s, self.procs[rank - 1]
        while not pipe.poll(0.2):
            if not proc.is_alive() and not pipe.poll(0):
                raise RuntimeError(f"tensor-parallel worker {rank} died (exit code {proc.exitcode}) before "
                                   f"{what.value!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker {rank} sent no {what.value!r} within {timeout_s:g} s")
        reply = pipe.recv()
        if reply.kind is not what:
            raise RuntimeError(f"tensor-parallel worker {rank} failed: {reply.detail}")

    def watch(self, on_death) -> None:
        """A daemon thread that calls on_death(exc) when a worker process ends while the generator runs."""
        from multiprocessing.connection import wait

        def run():
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
            while sentinels and not self._stop.is_set():
                for ready in wait(list(sentinels), timeout=0.5):
                    rank = sentinels.pop(ready)
                    if not self._stop.is_set():
                        code = self.procs[rank - 1].exitcode
                        on_death(RuntimeError(f"tensor-parallel worker {rank} died (exit code {code})"))
        self._watchdog = threading.Thread(target=run, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def with_seed(self, request):
        """The request with a seed drawn here when it has none, so that every rank's samples draw alike."""
        if request.sampling.seed is not None:
            return request
        import random
        out = copy.copy(request)
        out.sampling = dataclasses.replace(request.sampling,
                                           seed=random.SystemRandom().randrange(2 ** 63 - request.sampling.n))
        return out

    def send_iteration(self, incoming: list, swap_version) -> None:
        requests = [(s.group.request.request_id, list(s.group.request.prompt_token_ids),
                     {f.name: getattr(s.group.request.sampling, f.name) for f in dataclasses.fields(SamplingParams)})
                    for s in incoming]
        for pipe in self.control:
            pipe.send(_Iteration(requests, swap_version))

    def send_weights(self, model, tensors: dict) -> None:
        for rank, pipe in enumerate(self.weights, start=1):
            pipe.send(_LoadShard(_to_host(model.shard_state_dict(tensors, rank=rank))))

    def wait_weights(self) -> None:
        for rank, pipe in enumerate(self.weights, start=1):
            self._expect(pipe, rank, _Ack.LOADED)

    def tell_workers(self, message: _Connect | _Receive) -> None:
        """A weight transport's message (connect, receive) to every worker, over its weights pipe."""
        for pipe in self.weights:
            pipe.send(message)

    def answers(self, bound_s: float) -> list:
        """Each worker's answer to tell_workers: its error, or nothing when it is "done".  A worker that
        died is an error; one silent past bound_s raises RuntimeError."""
        errors, deadline = [], time.monotonic() + bound_s
        for rank, (pipe, proc) in enumerate(zip(self.weights, self.procs), start=1):
            while not pipe.poll(0.2):
                if not proc.is_alive():
                    errors.append(f"rank {rank}: the worker died (exit code {proc.exitcode})")
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel worker {rank} did not answer a weight transfer within "
                                       f"{bound_s:g} s")
            else:
                reply = pipe.recv()
                if reply.kind is not _Ack.DONE:
                    errors.append(f"rank {rank}: {reply.detail}")
        return errors

    def close(self) -> None:
        """Tell every worker to stop, wait up to tp_timeout_s, then end what is left; and wait for the
        watchdog thread to end.  (Its closure holds the generator, so the model and rank 0's process group:
        left running, it could drop the last reference to them during the interpreter's shutdown, and the
        group's destructor, which releases the GIL to join its threads, would then end that thread inside a
        C++ destructor: "terminate called without an active exception".)"""
        self._stop.set()
        for pipe in self.control + self.weights:
            try:
                pipe.send(_Close())
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(self.timeout_s)
        self.kill()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()                  # (it polls _stop every 0.5 s)

    def kill(self) -> None:
        self._stop.set()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _shadow_of(model: nn.Module) -> nn.Module:
    """A second weight set like ``model``'s: a deep copy, or, for a tensor-parallel shard (its process group
    cannot be copied), an empty shard of the same class on the same group and device."""
    if getattr(model, "tp_size", 1) == 1:
        return copy.deepcopy(model)
    p = next(model.parameters())
    return type(model)(model.config, tp_group=model.tp_group, device="meta", dtype=p.dtype,
                       **model.init_kwargs).to_empty(device=p.device)


def _to_host(tensors: dict) -> dict:
    return {n: t.detach().to("cpu", copy=False).contiguous() for n, t in tensors.items()}


def _tp_worker_main(rank: int, port: int, recipe, device: torch.device, opts: EngineOptions, control,
                    weights) -> None:
    """A worker process: join the group, build the shard and an engine, follow rank 0 until told to stop."""
    import datetime

    import torch.distributed as dist
    size, timeout_s = opts.tensor_parallel_size, opts.tp_timeout_s
    try:
        store = dist.TCPStore(opts.tp_address, port, size, False,
                              datetime.timedelta(seconds=max(timeout_s, TP_STARTUP_TIMEOUT_S)))
        control.send(_Reply(_Ack.JOINING))
        group = _process_group(store, rank, size, opts.tp_address, device, timeout_s)
        initial = None if isinstance(recipe, _Checkpoint) else weights.recv().tensors
        model = _build_shard(recipe, group, device, initial)
        control.send(_Reply(_Ack.BUILT))
        ranks = _Ranks(rank, size, group, device)
        ranks.control = control
        gen = Generator(model, **{f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}, _tp_worker=ranks)
    except BaseException as exc:
        control.send(_Reply(_Ack.ERROR, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None

    def serve_weights():
        while True:
            message = weights.recv()
            try:
                if isinstance(message, _Close):
                    return
                if isinstance(message, _LoadShard):
                    gen._load_shard(message.tensors)
                    weights.send(_Reply(_Ack.LOADED))
                elif isinstance(message, _Connect):
                    gen._connect_endpoint(message.receiver)
                    weights.send(_Reply(_Ack.DONE))
                else:
                    gen._receive_shard(message.version, message.header)
                    weights.send(_Reply(_Ack.DONE))
            except Exception as exc:
                weights.send(_Reply(_Ack.ERROR, f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=serve_weights, daemon=True).start()
    control.send(_Reply(_Ack.READY))
    try:
        gen._serve_as_worker()
        code = 0
    except (EOFError, OSError):    # rank 0 is gone
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                 # without tearing the process group's threads down from under it


# ----------------------------------------------------------------------------- input checks

def _checked_state_dict(state_dict, shapes: dict, optional: set = frozenset(), ignored: tuple = ()) -> dict:
    """Validate a whole state dict against the model's names and shapes before touching anything (names
    under the model's ``ignored_weight_prefixes``, such as a multimodal checkpoint's vision tower, are
    dropped; a tied alias may be absent)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    state_dict = {n: t for n, t in state_dict.items() if not (ignored and n.startswith(ignored))}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"state_dict[{name!r}] must be a floating tensor, got {t.dtype}")
    missing = [n for n in shapes if n not in state_dict and n not in optional]
    unexpected = [n for n in state_dict if n not in shapes]
    misshaped = [f"{n}: got {tuple(state_dict[n].shape)}, expected {shapes[n]}"
                 for n in shapes if n in state_dict and tuple(state_dict[n].shape) != shapes[n]]
    if missing or unexpected or misshaped:
        parts = [f"{label} {items[:5]}{' ...' if len(items) > 5 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                 if items]
        raise ValueError("state_dict rejected whole (weights and version unchanged): " + "; ".join(parts))
    return {n: state_dict[n] for n in shapes if n in state_dict}



_MODEL_KEYWORDS = ("moe_layer", "dtype", "device", "max_seq_len", "batch_invariant", "mtp")


def _check_model(model) -> None:
    """The model protocol (ref/generator_engine.py's docstring states it), or a TypeError naming what is missing."""
    missing = [name for name in ("config", "layers_forward", "logits", "state_dict", "layers")
               if not hasattr(model, name)]
    missing += [f"config.{name}" for name in ("vocab_size", "max_seq_len", "num_kv_heads", "head_dim", "kinds")
                if hasattr(model, "config") and not hasattr(model.config, name)]
    if not isinstance(model, nn.Module) or missing:
        raise TypeError(f"model must be an nn.Module with the engine's protocol (decoder_lm.py's DecoderLM); "
                        f"{type(model).__name__} lacks {missing or ['nn.Module']}")


def _tied_aliases(model: nn.Module) -> set:
    """State-dict names whose tensor is an earlier name's (a tied lm_head): optional when loading."""
    seen, aliases = set(), set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases.add(name)
        seen.add(id(t))
    return aliases
