"""Generator engine: the fast version.  A serving engine built like vLLM's: continuous batching over
a paged KV cache, fused projections, weights hot-swapped from a shadow copy, kernel plug-ins.

What it computes
    The same model, sampling rule and engine contract as ``ref/generator_engine.py``, the
    specification (read its docstring for the model, the sampling math and the data types): on
    the same weights both engines give the same tokens and logprobs (fp32: tokens equal, logprobs
    to fp32 rounding; parity/ compares them).  What this file changes is how the work is done.

The model: fused projections, one state dict
    q, k, v are one matmul (``qkv_proj`` [(H_q + 2 H_kv) D, hidden]) and gate, up another
    (``gate_up_proj`` [2 I, hidden]), as vLLM's QKVParallelLinear / MergedColumnParallelLinear:
    fewer, larger matmuls per layer.  The state dict still names q_proj / k_proj / v_proj /
    gate_proj / up_proj (views of the fused weights; loading fuses them), so a trainer's and a
    generator's state dicts are interchangeable with the reference's.  Rotary cos/sin come from
    a table computed once per device (the reference's values, bitwise).  The training forward
    runs ``scaled_dot_product_attention`` (causal, GQA; a block-diagonal mask for documents).

The engine (Generator): continuous batching over a paged KV cache
    thread       one engine thread runs the loop; ``submit`` validates and enqueues (never blocks);
                 futures are settled by the engine thread after each iteration, outside every lock.
    iteration    (1) give each decoding request the page its next token's KV goes to (allocate on
                 demand, evicting a cached page nobody holds; when none is left, preempt the newest
                 request: its pages are released and it goes back to the head of the queue, keeping
                 its tokens and its generator, to be recomputed by a later prefill, mostly from the
                 cache); (2) the prefill work within ``max_prefill_tokens``: prompts being prefilled
                 resume, then waiting requests are admitted in arrival order while a slot per sample,
                 their pages and the budget allow (a long prompt is cut at a page boundary and
                 continues next iteration); (3) one prefill pass over that work (K/V scattered into
                 the pages, then ``varlen_attn`` over the paged cache with a block table); (4) one
                 batched decode step over the requests that were decoding (``flash_decode`` with
                 k_new/v_new writes the new K/V into the pages and attends); (5) batched sampling,
                 finished requests release their pages and slots.
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

Groups and the prefix cache (ref/generator_engine.py states the semantics: outputs do not change)
    pages        a block allocator (``_Pages``): a page is free, held (refcounts: shared pages are
                 held by every request that reads them) or cached (nobody holds it, it keeps its key,
                 evicted least recently released first, a chain's tail before its start: before anyone
                 is preempted).  A full page's key is (parent node, its token ids, the weights'
                 version), with node ids never reused (exact keys, no hash collisions).
    hits         at admission, the longest cached run of a request's full pages from position 0 (never
                 the page of its last token, whose logits are needed) is held instead of computed; its
                 prefill starts after it.  Keys are registered at admission, pending until computed, so
                 a request that would hit a page being computed waits an iteration instead of
                 computing it twice: n ordinary requests with the same prompt share one prefill.  A
                 weight swap makes every older key unreachable; running requests keep their KV
                 (``kv_on_swap="keep"``; their later pages are not keyed) or re-prefill under the new
                 weights (``"recompute"``).
    groups       ``SamplingParams(n=k)``: the first sample prefills the prompt; the others then share
                 its full pages, copy its partial last page and its linear layers' state (a fork), and
                 sample their first token from the same logits with their own generators (seed + i).
    hybrid       "linear" layers (Gated DeltaNet) need their state at the hit's last token: a prefill
                 checkpoints it (fp32 recurrent state, conv state) at page boundaries, every
                 ``checkpoint_interval`` pages and at the pass's last full page, into
                 ``num_checkpoints`` slots (a decode step does when it fills such a page); interior
                 checkpoints cut those layers' call (the segments run in rounds, the state carried).
                 A page without its checkpoint cannot end a hit.  Memory per slot: per linear layer
                 HV K V 4 + conv_dim (W - 1) elt bytes, beside the KV pool's page_size H_kv D elt 2
                 per attention layer and page.
    chunks       a prompt longer than the iteration's budget is prefilled over several iterations from
                 its written pages and its slot's state; decoding requests step in each of them.

Batch-invariant mode: bitwise on-policy (``Generator(..., batch_invariant=True)``)
    A request's tokens and per-token logprobs then do not depend on which requests share its
    batch, when it joined, how its prompt was packed, or whether it was preempted and recomputed;
    and ``DecoderLM(batch_invariant=True, varlen_attn=...).token_logprobs(sequences, prompt_lengths)``,
    the trainer's one packed forward over prompt + completion, gives the engine's logprobs bit for
    bit (``torch.equal``).  The invariance contract: every phase (the trainer's packed forward, the
    engine's prefill, each decode step) computes a row's dots with the same tile shape, the same
    instruction and the row in the same slot of the tile, and reduces in the same order; whatever
    runs the dot (a CPU BLAS, mma.sync or wgmma on a GPU) then sees identical work for that row.
    What each piece computes with in the mode:
      matmuls     on a GPU a fixed-tile Triton matmul (no split-K, one config per GPU family and
                  element size, never autotuned: the same MMA at any row count, checked on the
                  sm_80/sm_90 builds by parity/invariant_sass.py; the MMA rounds every row of a tile
                  alike); on a CPU one [1, K] x [K, N] product per row (a batched matmul: the same
                  BLAS call, the row at slot 0, whatever the row count).
      per row     RMSNorm (its mean of squares a product with a ones vector), rotary, SwiGLU (SiLU
                  composed from exp: torch's CPU silu rounds a vector loop's tail otherwise) and the
                  final log-softmax (max exact in any order; the sum of exps a product) are the same
                  expressions in the trainer's packed forward and in the engine's prefill and decode.
      attention   ``varlen_attn(..., batch_invariant=True)`` for the prefill and the trainer, and the
                  decode through ``flash_decode(..., batch_invariant=True)`` (one split) or, without
                  one, ``varlen_attn`` with one query row per request: one tile shape for every phase,
                  tiles aligned to absolute positions (position p, head g at slot (p * G + g) mod
                  BLOCK_M), keys in BLOCK_N blocks from key 0 with the same online-softmax
                  arithmetic, whatever the page size and block table.
      GDN layers  a "linear" plug-in must have ``set_batch_invariant(linear)`` (ref/gated_deltanet.py's
                  layer has): its projections go through the invariant matmul and its recurrence runs
                  in the recurrent form in prefill, decode and the trainer alike (that form has a
                  backward), so hybrid models are on-policy too; its ``recurrent_fn`` must itself be
                  batch- and split-invariant (the reference recurrence and fast/gated_deltanet.py's
                  recurrent kernel are; parity/test_batch_invariant_engine.py runs both).
    Sampling is unchanged: each request draws from its own generator, so equal logits give equal
    tokens.  Gradients through ``token_logprobs`` are plain matmuls (they need not be invariant).
    What it costs is measured by bench/routed_generator.py (bench/README.md, its tables).  Tested
    bitwise under four CPU kernel families (OpenBLAS generic, Sandybridge, Haswell/Zen, SkylakeX;
    ATen and MKL at AVX2 and scalar: parity/test_bitwise_blas.py) and on the sm_80/sm_90 builds; a
    GPU run is owed (the GPU tier of parity/test_batch_invariant_engine.py).

Cost (what bench/routed_generator.py measures against)
    Per generated token, FLOPs ~ 2 * (non-embedding parameters + hidden * vocab) + 4 * L_ctx *
    H_q * D per attention layer (L_ctx = keys it attends to).  A decode step over B requests moves
    at least the weights once plus each request's KV: bytes >= weight bytes + sum_b 2 * L_b *
    H_kv * D * elt * attention layers; at small B it is weight-bound, which is why batching wins.

Tensors and types
    As the reference: SamplingParams, Request, Completion (repeated in routed_generator.py so each
    file works alone; ``submit`` reads a request by its fields, so either file's is served),
    ModelConfig, the linear_layer plug-in.  KV pool [attention layers, num_pages, page_size, H_kv,
    D] in the model's dtype; block table [max_batch_size, pages per sequence] int32.

Supported, and what raises
    As the reference (ValueError for an empty prompt, unknown token ids, a prompt of max_seq_len
    tokens or more, a state dict with missing, unexpected or mis-shaped tensors, rejected whole
    with the weights and version unchanged; TypeError for non-tensors; RuntimeError after
    ``close()``), plus ValueError for a request (or a group of n samples) that can never fit the
    KV pool, a group larger than ``max_batch_size``, engine knobs < 1, ``batch_invariant=True``
    without ``varlen_attn`` or with a plug-in layer that has no ``set_batch_invariant``, and
    ``token_logprobs`` inputs out of range.  Inference only in the engine.  Limits: preemption
    recomputes (no swapping to host; cached pages make most of it a hit); the plug-in layers'
    state is gathered per step (a kernel that reads the slot pools in place would not copy); a
    group's samples are admitted together (n free slots).

References
    vLLM (Kwon et al., PagedAttention, 2023) and its scheduler (continuous batching, recompute
    preemption, fused QKV / gate-up linears); Orca (Yu et al., 2022, iteration-level scheduling);
    PipelineRL (Piche et al., 2025) in-flight weight updates; gpt-fast.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import operator
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import Future
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

try:  # Triton runs the batch-invariant matmul on GPUs; the engine itself needs only torch
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

__all__ = ["SamplingParams", "Request", "Completion", "ModelConfig", "DecoderLM", "Generator", "LAYER_TYPES"]

LAYER_TYPES = ("attention", "linear")


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
    n: int = 1

    def __post_init__(self):
        try:
            stops = tuple(operator.index(t) for t in self.stop_token_ids)
        except TypeError:
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}") from None
        object.__setattr__(self, "stop_token_ids", stops)
        _check_sampling(self)


def _check_sampling(sp) -> None:
    """Every field a generator reads, whoever built the object (ValueError / TypeError)."""
    if not _is_int(sp.n) or sp.n < 1:
        raise ValueError(f"n (samples of the prompt) must be an int >= 1, got {sp.n!r}")
    if not _is_int(sp.max_new_tokens) or sp.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {sp.max_new_tokens!r}")
    if not isinstance(sp.temperature, (int, float)) or isinstance(sp.temperature, bool) or not sp.temperature >= 0:
        raise ValueError(f"temperature must be a float >= 0 (0 = greedy), got {sp.temperature!r}")
    if not _is_int(sp.top_k) or sp.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {sp.top_k!r}")
    if not isinstance(sp.top_p, (int, float)) or isinstance(sp.top_p, bool) or not 0.0 < sp.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {sp.top_p!r}")
    if not isinstance(sp.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in sp.stop_token_ids):
        raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {sp.stop_token_ids!r}")
    if sp.seed is not None:
        if not _is_int(sp.seed):
            raise TypeError(f"seed must be an int or None, got {type(sp.seed).__name__}")
        if not -2 ** 63 <= sp.seed <= 2 ** 64 - sp.n:     # sample i draws from seed + i: a 64-bit seed each
            raise ValueError(f"seed must be in [-2**63, 2**64 - n] (sample i is seeded with seed + i), got {sp.seed}")


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

# ----------------------------------------------------------------------------- batch-invariant numerics
# What the mode computes with (the module docstring's contract): every reduction over a row's features is
# a product through ``_invariant_linear``, whose per-row bits do not depend on the other rows; maxima
# are exact in any order; the rest is elementwise, in forms whose bits do not depend on where an element
# sits in its tensor.

def _invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, each row rounded independently of every
    other row: on a GPU a fixed-tile Triton matmul (no split-K, one config per GPU family and element
    size), on a CPU one [1, K] x [K, N] product per row (the same BLAS call whatever the row count).
    Differentiable (the backward is a plain matmul: gradients need not be invariant)."""
    y = torch.ops.twofold.invariant_linear(x.reshape(-1, x.shape[-1]), weight)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("twofold::invariant_linear", mutates_args=())
def _invariant_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return _triton_invariant_matmul(x, weight)
    return torch.bmm(x[:, None, :], weight.t().expand(x.shape[0], -1, -1))[:, 0]     # [M, 1, K] x [M, K, N]


@_invariant_linear_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


def _invariant_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _invariant_linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = grad.t() @ x if ctx.needs_input_grad[1] else None
    return grad_x, grad_weight


_invariant_linear_op.register_autograd(_invariant_linear_backward, setup_context=_invariant_linear_setup)


def _invariant_row_sum(x: torch.Tensor) -> torch.Tensor:
    """sum over the last dim [..., D] -> [..., 1]: a product with a ones vector through _invariant_linear."""
    return _invariant_linear(x, torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, fp32 inside."""
    xf = x.float()
    if invariant:
        mean_sq = _invariant_row_sum(xf * xf) / xf.shape[-1]
    else:
        mean_sq = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(mean_sq + eps)).to(x.dtype) * weight


def _log_softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """log_softmax over the last dim; invariant: x - max - log(sum exp(x - max)), the max exact in any
    order (and a constant for autograd: the softmax gradient exactly), the sum through _invariant_linear."""
    if not invariant:
        return torch.log_softmax(x, dim=-1)
    shifted = x - x.amax(-1, keepdim=True).detach()
    return shifted - _invariant_row_sum(shifted.exp()).log()


def _silu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """x * sigmoid(x).  invariant: composed from exp and IEEE arithmetic in fp32, because torch's CPU
    kernels for silu / sigmoid round the elements of a vector loop's tail (a position that depends on the
    tensor's size) through another formula; exp, log, log1p and rsqrt go through one vector formula for
    every element.  exp's argument is clamped at 80 so that neither the value nor its gradient overflows
    (sigmoid(-80) = 1.8e-35: below it the result stays there)."""
    if not invariant:
        return F.silu(x)
    xf = x.float()
    return (xf * (1 / (1 + torch.exp(-xf.clamp(min=-80))))).to(x.dtype)


# ----------------------------------------------------------------------------- the model, fused

class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, invariant: bool = False):
        return _rms_norm(x, self.weight, self.eps, invariant)


def _split_fused(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: a fused weight appears as its canonical parts, in the reference's order.
    The parts are views, so copying into them loads the fused weight."""
    own = [(n, state_dict.pop(prefix + n)) for n, _ in module.named_parameters()]   # the last entries in
    for name, t in own:
        parts = module.FUSED.get(name)
        pieces = zip(parts, t.split(module.sizes)) if parts else [(name, t)]
        for part, view in pieces:
            state_dict[prefix + part] = view


def _fuse_parts(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: canonical parts -> the fused weight."""
    for fused, parts in module.FUSED.items():
        keys = [prefix + p for p in parts]
        if all(k in state_dict for k in keys):
            state_dict[prefix + fused] = torch.cat([state_dict.pop(k) for k in keys])


class _Attention(nn.Module):
    FUSED = {"qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight")}

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        self.qkv_proj = nn.Linear(c.hidden_size, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.register_state_dict_post_hook(_split_fused)
        self.register_load_state_dict_pre_hook(_fuse_parts)


class _MLP(nn.Module):
    FUSED = {"gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight")}

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.sizes = (c.intermediate_size, c.intermediate_size)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.register_state_dict_post_hook(_split_fused)
        self.register_load_state_dict_pre_hook(_fuse_parts)

    def forward(self, x, invariant: bool = False):
        linear = _invariant_linear if invariant else F.linear
        gate, up = linear(x, self.gate_up_proj.weight).split(self.sizes, dim=-1)
        return linear(_silu(gate, invariant) * up, self.down_proj.weight)


class _Block(nn.Module):
    def __init__(self, c: ModelConfig, kind: str, linear_layer, index: int):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = _Attention(c) if kind == "attention" else None
        self.linear_attn = linear_layer(c, index) if kind == "linear" else None
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = _MLP(c)


class DecoderLM(nn.Module):
    """The reference's decoder-only LM with fused projections (module docstring); the same
    state dict, init, ``forward``, ``layers_forward``, ``logits`` and ``token_logprobs``.

    ``batch_invariant=True``: the module docstring's batch-invariant numerics (every "linear" plug-in
    must then have ``set_batch_invariant(linear)``); ``varlen_attn``: the attention of ``forward`` and
    ``token_logprobs`` (fast/paged_varlen_attention.varlen_attn's signature, called with
    ``batch_invariant``), required with ``batch_invariant=True`` (ValueError otherwise); None =
    ``scaled_dot_product_attention``.
    """

    def __init__(self, config: ModelConfig | None = None, *, seed: int = 0, linear_layer=None, device=None,
                 dtype=None, batch_invariant: bool = False, varlen_attn=None):
        super().__init__()
        config = ModelConfig() if config is None else config
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not _is_int(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        _check_mode(batch_invariant, varlen_attn)
        if "linear" in config.kinds and linear_layer is None:
            raise ValueError("config.layer_types has 'linear' layers: pass linear_layer, a (config, layer_index) "
                             "-> nn.Module factory (e.g. a Gated DeltaNet layer)")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        blocks = []
        for i, kind in enumerate(config.kinds):
            with torch.random.fork_rng(devices=[]):  # the plug-in's own init: the reference's seeds
                torch.manual_seed(seed * 1000003 + i)
                blocks.append(_Block(config, kind, linear_layer, i))
        self.layers = nn.ModuleList(blocks)
        self.norm = _RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope_tables: dict = {}  # device -> (cos, sin) [max_seq_len, 1, D/2] fp32
        with torch.no_grad():  # the reference's draws, in its order, into the fused weights' parts
            gen = torch.Generator().manual_seed(seed)
            for name, p in self.state_dict().items():
                std = _init_std(name, p, config)
                if std is not None:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        self.to(device=device, dtype=dtype)
        self.batch_invariant, self.varlen_attn = batch_invariant, varlen_attn
        if batch_invariant:
            for i, block in enumerate(self.layers):
                if block.linear_attn is not None:
                    if not callable(getattr(block.linear_attn, "set_batch_invariant", None)):
                        raise ValueError(f"batch_invariant=True: the linear_layer plug-in of layer {i} "
                                         f"({type(block.linear_attn).__name__}) has no set_batch_invariant(linear) "
                                         f"method, so its numerics cannot be made batch-invariant")
                    block.linear_attn.set_batch_invariant(_invariant_linear)

    def layers_forward(self, ids: torch.Tensor, positions: torch.Tensor, attend, mix) -> torch.Tensor:
        """The blocks on packed tokens, ids / positions [T] -> final-normed hidden [T, hidden];
        ``attend(layer, q, k, v)`` and ``mix(layer, module, h)`` as in the reference."""
        c, inv = self.config, self.batch_invariant
        linear = _invariant_linear if inv else F.linear
        t = ids.shape[0]
        cos, sin = self._rotary_at(positions)                              # [T, 1, D/2]
        x = self.embed_tokens(ids)                                          # [T, hidden]
        for i, block in enumerate(self.layers):
            h = block.input_layernorm(x, inv)
            if block.self_attn is not None:
                a = block.self_attn
                q, k, v = linear(h, a.qkv_proj.weight).split(a.sizes, dim=-1)
                q = _rotate(q.view(t, c.num_heads, c.head_dim), cos, sin)
                k = _rotate(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
                o = attend(i, q, k, v.view(t, c.num_kv_heads, c.head_dim)).reshape(t, -1)
                x = x + linear(o, a.o_proj.weight)
            else:
                x = x + mix(i, block.linear_attn, h)
            x = x + block.mlp(block.post_attention_layernorm(x, inv), inv)
        return self.norm(x, inv)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] -> logits [..., V] fp32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (_invariant_linear(h, w) if self.batch_invariant else h @ w.t()).float()

    def token_logprobs(self, sequences, prompt_lengths, *, temperature=1.0, share_prompts=True) -> list[torch.Tensor]:
        """What a trainer recomputes for sampled tokens: for each sequence (prompt + completion token
        ids) the logprobs of its completion tokens, log_softmax(logits * fp32(1 / T))[token] (T = 0:
        unscaled, as greedy sampling reports).  ``prompt_lengths``: one int per sequence, 1 <= p < len;
        ``temperature``: one float >= 0 or one per sequence.  Returns one fp32 tensor [len - p] per
        sequence; differentiable.

        ``share_prompts``: sequences with the same prompt (a GRPO group) run their prompt once: its
        tokens go through the model once, each completion attends to its K/V (the prompt's keys, then
        its own causal keys, the two states merged exactly) and the linear layers continue each
        completion from the prompt's final state; gradients reach the prompt once, summed over the
        group.  False: one packed forward over every sequence whole.  In batch-invariant mode (with
        ``varlen_attn``) every completion row reduces its keys in those two segments either way, each
        row alone over its prompt's keys as the engine's decode does, and the logprobs are bitwise the
        engine's (the gradients are the default kernels')."""
        seqs, prompts, temps = _check_logprob_inputs(sequences, prompt_lengths, temperature, self.config)
        if not isinstance(share_prompts, bool):
            raise TypeError(f"share_prompts must be a bool, got {type(share_prompts).__name__}")
        if not seqs:
            return []
        if share_prompts or self.batch_invariant:
            rows, h = self._prompt_shared_forward(seqs, prompts, share_prompts)
        else:
            rows, h = self._packed_forward(seqs, prompts)
        dev = h.device
        inv_t = torch.tensor([1.0 / t if t else 1.0 for t, s, p in zip(temps, seqs, prompts)
                              for _ in range(len(s) - p)], dtype=torch.float32, device=dev)
        logp = _log_softmax(self.logits(h[rows]) * inv_t[:, None], self.batch_invariant)   # [rows, V]
        targets = torch.tensor([t for s, p in zip(seqs, prompts) for t in s[p:]], device=dev)
        picked = logp.gather(1, targets[:, None])[:, 0]
        return list(picked.split([len(s) - p for s, p in zip(seqs, prompts)]))

    def _packed_forward(self, seqs: list, prompts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence but its last token, packed as documents: (the rows that predict each completion
        token, in order; the final hidden states)."""
        dev = self.embed_tokens.weight.device
        lengths = [len(s) - 1 for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s[:-1]], device=dev)
        bounds = [0, *itertools.accumulate(lengths)]
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        h = self.layers_forward(ids, positions, self._packed_attention(cu, max(lengths)),
                                lambda i, module, x: module(x[None], cu_seqlens=cu)[0])
        # Row p - 1 + j of a sequence predicts its completion token j.
        rows = torch.cat([torch.arange(start + p - 1, start + n, device=dev)
                          for start, p, n in zip(bounds, prompts, lengths)])
        return rows, h

    def _prompt_shared_forward(self, seqs: list, prompts: list, share: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over each distinct prompt once, then every completion's fed tokens (positions
        p .. len - 2), the completions of a group side by side.  Returns (the rows predicting each
        completion token, in the sequences' order; the final hidden states)."""
        dev = self.embed_tokens.weight.device
        lay = _SharedPrompts(seqs, prompts, share, dev)
        h = self.layers_forward(lay.ids, lay.positions, self._shared_attention(lay), self._shared_mix(lay))
        return lay.rows, h

    def _shared_attention(self, lay: _SharedPrompts):
        """attend for ``_prompt_shared_forward``: prompt rows causal over their prompt; completion rows
        over their prompt's keys (every one visible) and over their own causal keys, merged."""
        scale, mode = self.config.head_dim ** -0.5, self.batch_invariant

        def attend(i, q, k, v):
            t_p = lay.prompt_rows
            qp, kp, vp, qc, kc, vc = q[:t_p], k[:t_p], v[:t_p], q[t_p:], k[t_p:], v[t_p:]
            out_p, _ = self._attention(qp, kp, vp, lay.cu_p, lay.cu_p, lay.max_p, lay.max_p, scale, causal=True)
            if qc.shape[0] == 0:
                return out_p
            # The prompt's keys: a group's completion rows packed as one query sequence read them once.
            o_a, lse_a = self._attention(qc, kp, vp, lay.cu_c_by_group, lay.cu_p, lay.max_c_group, lay.max_p,
                                         scale, causal=False)
            if mode:   # the engine's bits: each completion row alone over its prompt's keys (one-row tiles)
                o_a, lse_a = _value_with_gradient_of(self._rows_over_prompts(qc, kp, vp, lay, scale), (o_a, lse_a))
            o_b, lse_b = self._attention(qc, kc, vc, lay.cu_c, lay.cu_c, lay.max_c, lay.max_c, scale, causal=True)
            out_c, _ = _merge_states(o_a, lse_a, o_b, lse_b)
            return torch.cat([out_p, out_c.to(out_p.dtype)])
        return attend

    def _rows_over_prompts(self, qc, kp, vp, lay, scale):
        """Batch-invariant mode: each completion row as its own one-query sequence over its prompt's keys,
        as the engine's decode computes it (the prompt's K/V viewed as pages of one token, each row's
        block table its prompt's rows).  Inference kernels: no gradient here."""
        with torch.no_grad():
            table = lay.prompt_table                                           # [completion rows, max_p]
            out, lse = self.varlen_attn(qc, kp[:, None], vp[:, None], lay.cu_rows, None, 1, lay.max_p, scale=scale,
                                        window_size=(-1, -1), enable_gqa=True, seqused_k=lay.row_prompt_len,
                                        block_table=table, return_aux=_LSE, batch_invariant=True)
        return out, lse

    def _attention(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, *, causal):
        """(out [T_q, H, D], lse [H, T_q] fp32) of varlen attention, through ``varlen_attn`` or in plain
        PyTorch (per sequence) without one."""
        window = (-1, 0) if causal else (-1, -1)
        if self.varlen_attn is not None:
            mode = dict(batch_invariant=True) if self.batch_invariant else {}
            return self.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window,
                                    enable_gqa=True, return_aux=_LSE, **mode)
        return _torch_attention_lse(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, causal)

    def _shared_mix(self, lay: _SharedPrompts):
        """mix for ``_prompt_shared_forward``: the prompts as documents (their final state kept), then
        each completion continuing from its prompt's state."""
        def mix(i, module, h):
            t_p = lay.prompt_rows
            cache = module.new_cache()
            out_p = module(h[:t_p][None], cu_seqlens=lay.cu_p, cache=cache)[0]
            if h.shape[0] == t_p:
                return out_p
            forked = module.new_cache()
            for name, t in vars(cache).items():
                if isinstance(t, torch.Tensor):
                    setattr(forked, name, t[lay.group_of])          # each completion gets its prompt's state
            out_c = module(h[t_p:][None], cu_seqlens=lay.cu_c, cache=forked)[0]
            return torch.cat([out_p, out_c])
        return mix

    def _packed_attention(self, cu: torch.Tensor, longest: int):
        """``layers_forward``'s attend over documents packed along T (cu [N + 1] int32): through
        ``varlen_attn`` when the model has one, else SDPA with a block-diagonal causal mask."""
        scale = self.config.head_dim ** -0.5
        if self.varlen_attn is not None:
            # The keyword only in the mode: PyTorch's own varlen_attn, which has none, plugs in too.
            mode = dict(batch_invariant=True) if self.batch_invariant else {}

            def attend(i, q, k, v):
                return self.varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0),
                                        enable_gqa=True, **mode)
            return attend
        t = int(cu[-1])
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu.diff().long())
        index = torch.arange(t, device=cu.device)
        same_doc_causal = (doc[:, None] == doc[None, :]) & (index[None, :] <= index[:, None])   # [T, T]

        def attend(i, q, k, v):                                             # [T, H, D] -> SDPA's [1, H, T, D]
            q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc_causal, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        return attend

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Training: logits [B, T, V] fp32, causal per row (or per document of ``cu_seqlens``, B == 1)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise TypeError(f"input_ids must be an integer tensor [B, T], got "
                            f"{getattr(input_ids, 'shape', input_ids)!r}")
        b, t = input_ids.shape
        dev = input_ids.device
        if cu_seqlens is None:
            positions = torch.arange(t, device=dev).repeat(b)                # [B*T]
            cu = torch.arange(b + 1, dtype=torch.int32, device=dev) * t
            longest = t
        else:
            if b != 1:
                raise ValueError(f"cu_seqlens requires input_ids of shape [1, T], got {tuple(input_ids.shape)}")
            cu = cu_seqlens.to(device=dev, dtype=torch.int32)
            lengths = cu.diff()
            if int(cu[-1]) != t or int(cu[0]) != 0 or bool((lengths < 0).any()):
                raise ValueError(f"cu_seqlens must partition the {t} tokens, got {cu_seqlens.tolist()}")
            doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths.long())   # [T] its document
            positions = torch.arange(t, device=dev) - cu[doc]
            longest = int(lengths.max()) if len(lengths) else 0
        if longest > self.config.max_seq_len:
            raise ValueError(f"a sequence of {longest} tokens exceeds max_seq_len={self.config.max_seq_len}")

        if cu_seqlens is None and self.varlen_attn is None:
            def attend(i, q, k, v):                                         # [B*T, H, D] -> SDPA's [B, H, T, D]
                q, k, v = (x.view(b, t, x.shape[1], -1).transpose(1, 2) for x in (q, k, v))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return o.transpose(1, 2).reshape(b * t, o.shape[1], -1)
        else:
            attend = self._packed_attention(cu, longest)

        def mix(i, module, h):
            if cu_seqlens is None:                                          # b equal rows: [B, T, hidden]
                return module(h.view(b, t, -1)).reshape(h.shape)
            return module(h[None], cu_seqlens=cu)[0]

        h = self.layers_forward(input_ids.reshape(-1), positions, attend, mix)
        return self.logits(h).view(b, t, -1)

    def _rotary_at(self, positions: torch.Tensor):
        """cos, sin [T, 1, D/2] fp32 at the positions, from a table built once per device (the same
        fp32 products as the reference computes per call, so the same values)."""
        dev = positions.device
        if dev not in self._rope_tables:
            c = self.config
            half = c.head_dim // 2
            inv_freq = c.rope_theta ** (-torch.arange(half, device=dev, dtype=torch.float32) / half)
            angles = torch.arange(c.max_seq_len, device=dev, dtype=torch.float32)[:, None] * inv_freq[None]
            self._rope_tables[dev] = (angles.cos()[:, None], angles.sin()[:, None])
        cos, sin = self._rope_tables[dev]
        return cos[positions], sin[positions]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding, fp32 inside: x [T, H, D], cos / sin [T, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _SharedPrompts:
    """The packed layout of ``token_logprobs`` with shared prompts: every distinct prompt once (rows
    0 .. T_p - 1, the prompts one after another), then every sequence's fed completion tokens, ordered
    by prompt so that a group's completion rows are contiguous.  Index tensors for the calls below."""

    def __init__(self, seqs: list, prompts: list, share: bool, dev):
        heads, group_of = {}, []
        for s, p in zip(seqs, prompts):
            group_of.append(heads.setdefault(tuple(s[:p]) if share else len(heads), len(heads)))
        prompt_tokens = list(heads) if share else [s[:p] for s, p in zip(seqs, prompts)]
        order = sorted(range(len(seqs)), key=group_of.__getitem__)          # completions, grouped
        plen = [len(t) for t in prompt_tokens]
        clen = [len(seqs[n]) - 1 - prompts[n] for n in order]               # fed completion tokens
        p_bounds = [0, *itertools.accumulate(plen)]
        c_bounds = [0, *itertools.accumulate(clen)]
        self.prompt_rows = p_bounds[-1]
        self.ids = torch.tensor([t for ts in prompt_tokens for t in ts] +
                                [t for n in order for t in seqs[n][prompts[n]:-1]], device=dev)
        self.positions = torch.tensor([i for n in plen for i in range(n)] +
                                      [prompts[n] + i for n, c in zip(order, clen) for i in range(c)], device=dev)
        groups = [group_of[n] for n in order]
        per_group = [sum(c for g2, c in zip(groups, clen) if g2 == g) for g in range(len(plen))]

        def cu(lengths):
            return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)

        self.cu_p, self.cu_c, self.cu_c_by_group = cu(plen), cu(clen), cu(per_group)
        self.max_p, self.max_c, self.max_c_group = max(plen), max(clen, default=0), max(per_group, default=0)
        self.group_of = torch.tensor(groups, device=dev)                   # completion -> its prompt
        # Each completion row alone over its prompt's keys (the batch-invariant mode): prompt rows as pages.
        row_group = [g for g, c in zip(groups, clen) for _ in range(c)]
        self.cu_rows = cu([1] * len(row_group))
        self.row_prompt_len = torch.tensor([plen[g] for g in row_group], dtype=torch.int32, device=dev)
        table = torch.zeros(len(row_group), self.max_p, dtype=torch.int32)
        for r, g in enumerate(row_group):
            table[r, :plen[g]] = torch.arange(p_bounds[g], p_bounds[g + 1])
        self.prompt_table = table.to(dev)
        # Completion token 0 comes from its prompt's last row, token j > 0 from the completion's row j - 1.
        first = self.prompt_rows
        span = {n: range(first + c_bounds[k], first + c_bounds[k + 1]) for k, n in enumerate(order)}
        self.rows = torch.tensor([r for n in range(len(seqs)) for r in [p_bounds[group_of[n] + 1] - 1, *span[n]]],
                                 device=dev)


class _LseRequest(NamedTuple):
    """``return_aux`` for a varlen_attn plug-in (PyTorch's AuxRequest, duck-typed): ask for the lse."""
    lse: bool = True


_LSE = _LseRequest()


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


class _ValueOf(torch.autograd.Function):
    """Forward: ``exact``'s values; backward: the incoming gradient goes to ``plain`` (the same math in
    another tiling).  The batch-invariant mode's values with the default kernels' gradients."""

    @staticmethod
    def forward(ctx, plain, exact):
        return exact.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _value_with_gradient_of(exact: tuple, plain: tuple) -> tuple:
    if not torch.is_grad_enabled():
        return exact
    return tuple(_ValueOf.apply(p, e) for p, e in zip(plain, exact))


def _torch_attention_lse(q, k, v, cu_q: list, cu_k: list, scale: float, causal: bool):
    """Varlen attention with its lse in plain PyTorch, one sequence at a time: (out [T_q, H_q, D],
    lse [H_q, T_q] fp32).  Causal is bottom-right aligned; a row that sees no key gets 0 and -inf."""
    outs, lses = [], []
    h_q, d, h_kv = q.shape[1], q.shape[2], k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        l_q, l_k = qs.shape[0], ks.shape[0]
        s = torch.einsum("qhgd,khd->hgqk", qs.float().view(l_q, h_kv, h_q // h_kv, d), ks.float()) * scale
        if causal:
            hidden = torch.arange(l_k, device=q.device)[None] > torch.arange(l_q, device=q.device)[:, None] + l_k - l_q
            s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                                      # [H_kv, G, L_q]
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hgqk,khd->qhgd", p, vs.float()).reshape(l_q, h_q, d).to(q.dtype))
        lses.append(lse.reshape(h_q, l_q))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _init_std(name: str, p: torch.Tensor, c: ModelConfig) -> float | None:
    """The reference's init: std per canonical weight (None: norms and plug-in weights keep theirs)."""
    if name == "embed_tokens.weight":
        return 2.0 / math.sqrt(c.hidden_size)
    if name == "lm_head.weight":
        return 1.0 / math.sqrt(c.hidden_size)
    leaf = name.rsplit(".", 2)[-2]
    if ".linear_attn." in name or leaf.endswith("layernorm") or name == "norm.weight":
        return None
    out_scale = 1.0 / math.sqrt(2 * c.num_layers) if leaf in ("o_proj", "down_proj") else 1.0
    return out_scale / math.sqrt(p.shape[1])


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
        # SDPA wants [1, H, L, D]; causal bottom-right: query i of L_q sees keys j <= i + L_k - L_q
        l_q, l_k = q.shape[0], k.shape[0]
        visible = torch.arange(l_k, device=q.device)[None] <= torch.arange(l_q, device=q.device)[:, None] + (l_k - l_q)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=visible, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
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
    """The request's own random stream (a fresh random seed when None): the reference's draws."""
    rng = torch.Generator()
    if seed is None:
        rng.seed()
    else:
        rng.manual_seed(seed)
    return rng


def _sample_batch(logits: torch.Tensor, params: list, rngs: list, invariant: bool = False) -> tuple[list, list]:
    """The reference's per-row rule on a batch: fp32 logits [B, V] -> (tokens, logprobs) lists.

    Rows are grouped (greedy, plain temperature, top-k/top-p) and each group is one set of tensor
    ops; each sampled row draws its uniform from its own request's generator, so a request gets the
    same token alone or in any batch.  One device-to-host copy per group.  ``invariant``: the
    batch-invariant log-softmax (``DecoderLM.token_logprobs`` computes the same)."""
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
            lp = _log_softmax(lg, invariant).gather(1, tok[:, None])[:, 0]
        else:
            inv_t = torch.tensor([1.0 / params[i].temperature for i in rows], dtype=torch.float32, device=dev)
            logp = _log_softmax(lg * inv_t[:, None], invariant)
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
        for i, t, lp_i in zip(rows, tok.tolist(), lp.tolist()):
            tokens[i], logprobs[i] = t, lp_i
    return tokens, logprobs

# ----------------------------------------------------------------------------- the engine

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
        self.checkpoint_of: OrderedDict = OrderedDict()  # page -> checkpoint slot, least recently used first
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

    def checkpoint_slot(self, page: int) -> int | None:
        """A checkpoint slot for ``page`` (keyed, without one): a free one or the least recently used."""
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

    __slots__ = ("request", "future", "completions", "left", "failed")

    def __init__(self, request: Request, future: Future):
        self.request, self.future = request, future
        self.completions = [None] * request.sampling.n
        self.left = request.sampling.n
        self.failed = False

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
    ``node`` / ``keyed``: the prefix-cache chain through its first ``keyed`` full pages (None once a
    weight swap makes its KV unkeyable).  A group's first sample carries the others (``followers``)
    until its prompt is prefilled; then they fork from it."""

    __slots__ = ("group", "index", "tokens", "n_prompt", "logprobs", "rng", "limit", "pages", "slot",
                 "computed", "node", "keyed", "kv_version", "min_version", "followers", "spare", "admitted")

    def __init__(self, group: _Group, index: int, max_seq_len: int):
        sp = group.request.sampling
        self.group, self.index = group, index
        self.tokens = list(group.request.prompt_token_ids)
        self.n_prompt = len(self.tokens)
        self.limit = min(sp.max_new_tokens, max_seq_len - self.n_prompt)
        self.logprobs: list[float] = []
        self.rng = _request_rng(None if sp.seed is None else sp.seed + index)
        self.pages: list[int] = []
        self.slot = None
        self.computed, self.node, self.keyed, self.kv_version = 0, 0, 0, None
        self.min_version = None
        self.followers: list = []
        self.spare: list = []               # (slot, partial page or None) reserved for each follower
        self.admitted = 0                   # admission order (preemption takes the newest)


class Generator:
    """The fast engine (module docstring): continuous batching over a paged KV cache with prefix
    caching, groups, chunked prefill, hot-swapped weights.  Same contract as the reference's, plus
    the engine's knobs:

    ``varlen_attn`` / ``flash_decode``  prefill / decode attention with those functions' signatures
                                        (default: plain PyTorch in this file)
    ``page_size``, ``num_pages``        the KV pool (default: room for min(max_batch_size, 32)
                                        sequences of max_seq_len tokens)
    ``max_batch_size``                  requests decoding at once (rows of the block table)
    ``max_prefill_tokens``              prompt tokens computed per iteration: a longer prompt is
                                        prefilled over several iterations (cut at page boundaries)
                                        while the running requests keep decoding
    ``prefix_caching``                  reuse cached pages (and checkpoints) across requests; off: no
                                        page outlives its request (groups still share their prompt)
    ``checkpoint_interval``             hybrid models: a prefill checkpoints the linear layers' state
                                        every this many pages (and at its last full page); each
                                        interior checkpoint splits those layers' prefill call
    ``num_checkpoints``                 checkpoint slots (default: one per page with "linear" layers)
    ``kv_on_swap``                      "keep" (running requests keep the KV of the old weights) or
                                        "recompute" (they re-prefill under the new ones)
    ``batch_invariant``                 the module docstring's batch-invariant mode: a request's tokens
                                        and logprobs do not depend on the rest of the batch, and equal
                                        ``DecoderLM(batch_invariant=True, varlen_attn=...).token_logprobs``
                                        bit for bit.  Needs ``varlen_attn`` (and its ``batch_invariant``
                                        keyword); decodes through ``flash_decode`` when given, else
                                        through ``varlen_attn`` with one row per request
    """

    def __init__(self, config: ModelConfig | None = None, *, state_dict=None, seed: int = 0, name: str = "generator",
                 policy_version: int = 0, linear_layer=None, device=None, dtype=None, varlen_attn=None,
                 flash_decode=None, cascade_decode=None, page_size: int = 16, num_pages: int | None = None,
                 max_batch_size: int = 256,
                 max_prefill_tokens: int = 8192, prefix_caching: bool = True, checkpoint_interval: int = 1,
                 num_checkpoints: int | None = None, kv_on_swap: str = "keep", batch_invariant: bool = False):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if not _is_int(policy_version):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        for arg, value in (("page_size", page_size), ("max_batch_size", max_batch_size),
                           ("max_prefill_tokens", max_prefill_tokens), ("num_pages", num_pages),
                           ("checkpoint_interval", checkpoint_interval)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
        if num_checkpoints is not None and (not _is_int(num_checkpoints) or num_checkpoints < 0):
            raise ValueError(f"num_checkpoints must be an int >= 0, got {num_checkpoints!r}")
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
        if kv_on_swap not in ("keep", "recompute"):
            raise ValueError(f"kv_on_swap must be 'keep' or 'recompute', got {kv_on_swap!r}")
        _check_mode(batch_invariant, varlen_attn)
        if batch_invariant and flash_decode is None:
            raise ValueError("batch_invariant=True needs flash_decode (fast/flash_decoding.flash_decode): a decode "
                             "step reduces its keys in two segments, the prompt's and its own from cache_leftpad on, "
                             "as DecoderLM.token_logprobs does")
        for name_, fn in (("flash_decode", flash_decode), ("cascade_decode", cascade_decode)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name_} must be None or a function with that signature, got {type(fn).__name__}")
        self.name = name
        self.device = torch.device("cpu" if device is None else device)
        self.batch_invariant = batch_invariant
        self.model = DecoderLM(config, seed=seed, linear_layer=linear_layer, device=self.device, dtype=dtype,
                               batch_invariant=batch_invariant, varlen_attn=varlen_attn).eval()
        self.config = c = self.model.config
        self.dtype = self.model.embed_tokens.weight.dtype
        self._shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        if state_dict is not None:
            self._copy_into(self.model, self._checked(state_dict))
        self._shadow = None                 # the second weight set, allocated by the first load
        self._version = policy_version
        self._varlen_attn = varlen_attn or _torch_varlen_attn
        self._flash_decode = flash_decode or _torch_flash_decode
        self._cascade_decode = cascade_decode
        self._attn_kw = dict(batch_invariant=True) if batch_invariant else {}
        self.page_size, self.max_batch_size, self.max_prefill_tokens = page_size, max_batch_size, max_prefill_tokens
        self.prefix_caching, self.checkpoint_interval, self.kv_on_swap = prefix_caching, checkpoint_interval, kv_on_swap
        self._pages_per_seq = -(-c.max_seq_len // page_size)
        self.num_pages = num_pages or self._pages_per_seq * min(max_batch_size, 32)
        self._hybrid = "linear" in c.kinds
        self.num_checkpoints = (num_checkpoints if num_checkpoints is not None
                                else self.num_pages if self._hybrid and prefix_caching else 0)
        # The KV pool of every attention layer: [layers, num_pages, page_size, H_kv, D], zeros (finite).
        attn = [i for i, kind in enumerate(c.kinds) if kind == "attention"]
        self._pool_index = {layer: j for j, layer in enumerate(attn)}
        kv_shape = (len(attn), self.num_pages, page_size, c.num_kv_heads, c.head_dim)
        self._k = torch.zeros(kv_shape, device=self.device, dtype=self.dtype)
        self._v = torch.zeros(kv_shape, device=self.device, dtype=self.dtype)
        self._table = torch.zeros(max_batch_size, self._pages_per_seq, dtype=torch.int32, device=self.device)
        self._table_updates: list[tuple[int, int, int]] = []   # (slot, column, page) not yet in _table
        self._states: dict[int, dict[str, torch.Tensor]] = {}   # linear layer -> state pools [max_batch_size, ...]
        self._checkpoints: dict[int, dict[str, torch.Tensor]] = {}   # linear layer -> [num_checkpoints, ...]
        self._pages = _Pages(self.num_pages, self.num_checkpoints)
        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        self._waiting: deque[_Seq] = deque()  # under _cv; the rest of the engine state is the engine thread's
        self._prefilling: list[_Seq] = []     # admitted, prompt not all computed yet (chunked prefill)
        self._running: list[_Seq] = []        # decoding
        self._cv = threading.Condition()
        self._load_lock = threading.Lock()
        self._staged = None                 # (model, version, future): swapped in before the next step
        self._closed = False
        self._retired = None                # CUDA event after the last step on the weights now in the shadow
        self._copy_stream = None
        self._admissions = itertools.count()
        self._counts = dict(completed=0, steps=0, preemptions=0, generated_tokens=0, prompt_tokens=0,
                            computed_prompt_tokens=0, prefix_hit_tokens=0)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-engine", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request) -> Future:
        """Queue one request; the future resolves to its ``Completion`` (a list of n with
        ``sampling.n > 1``).  Never blocks."""
        self._check_servable(request)
        future = Future()
        group = _Group(request, future)
        leader = _Seq(group, 0, self.config.max_seq_len)
        leader.followers = [_Seq(group, i, self.config.max_seq_len) for i in range(1, request.sampling.n)]
        with self._cv:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed")
            self._waiting.append(leader)
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
            tensors = self._checked(state_dict)
            if self._shadow is None:  # allocated once, by the first load (a copy: no random init)
                self._shadow = copy.deepcopy(self.model)
            shadow = self._shadow
            self._copy_into(shadow, tensors)
            swapped = Future()
            with self._cv:
                if self._closed:
                    raise RuntimeError(f"generator {self.name} is closed")
                self._staged = (shadow, version, swapped)
                self._cv.notify()
            swapped.result()

    def stats(self) -> dict:
        """waiting, running (prefilling or decoding), completed, policy_version; free_pages (free or
        evictable), num_pages, page_size, steps, preemptions, generated_tokens, weights_staged;
        prompt_tokens (requested, per sample), computed_prompt_tokens (run through the model,
        recomputation after preemption included), prefix_hit_tokens (skipped: cached or a group's
        shared prompt), evictions, cached_pages (keyed pages, held or not), state_checkpoints; the
        memory the cache holds: kv_pool_bytes (the K and V pools of every attention layer) and
        checkpoint_bytes (the checkpoint slots of every linear layer, allocated at the first prefill
        that writes one: num_checkpoints x, per linear layer, the fp32 recurrent state and the conv
        state)."""
        # (list(...) copies a dict's values in one step: the engine thread may add a store meanwhile.)
        stores = [t for store in list(self._checkpoints.values()) for t in list(store.values())]
        with self._cv:
            pages = self._pages
            waiting = sum(1 + len(s.followers) for s in self._waiting)
            out = dict(waiting=waiting, running=len(self._running) + len(self._prefilling),
                       policy_version=self._version, free_pages=pages.available(), num_pages=self.num_pages,
                       page_size=self.page_size, weights_staged=self._staged is not None, **self._counts,
                       evictions=pages.evictions, cached_pages=len(pages.key_of),
                       state_checkpoints=len(pages.checkpoint_of),
                       kv_pool_bytes=self._k.nbytes + self._v.nbytes, checkpoint_bytes=sum(t.nbytes for t in stores))
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

    # ------------------------------------------------------------------ input checks

    def _check_servable(self, request) -> None:
        """ValueError / TypeError for a request this engine can never serve (a router then keeps it)."""
        prompt, sp = getattr(request, "prompt_token_ids", None), getattr(request, "sampling", None)
        if not isinstance(prompt, list) or not hasattr(sp, "max_new_tokens"):
            raise TypeError(f"request must be a Request (prompt_token_ids, sampling, request_id), "
                            f"got {type(request).__name__}")
        _check_sampling(sp)
        if not all(_is_int(t) for t in prompt):
            raise TypeError("prompt_token_ids must hold ints (token ids)")
        c, n = self.config, len(prompt)
        if not n:
            problem = "at least one token, got an empty prompt"
        elif max(prompt) >= c.vocab_size or min(prompt) < 0:
            problem = f"token ids in [0, {c.vocab_size}), got {max(prompt)}"
        elif n >= c.max_seq_len:
            problem = f"a prompt shorter than max_seq_len={c.max_seq_len}, got {n} tokens (no room to generate)"
        else:
            problem = None
        if problem:
            raise ValueError(f"prompt_token_ids must hold {problem}")
        if sp.n > self.max_batch_size:
            raise ValueError(f"request {request.request_id}: a group of n={sp.n} samples decodes at once, and "
                             f"max_batch_size is {self.max_batch_size}")
        kv_tokens = n + min(sp.max_new_tokens, c.max_seq_len - n) - 1   # the last token's K/V is never needed
        shared = n // self.page_size                                     # the prompt's full pages, shared
        need = shared + sp.n * (-(-kv_tokens // self.page_size) - shared)
        if need > self.num_pages:
            raise ValueError(f"request {request.request_id} needs {need} pages of {self.page_size} KV slots "
                             f"({sp.n} sample(s) of up to {kv_tokens} tokens); the pool has only {self.num_pages}: "
                             f"it can never fit")

    def _checked(self, state_dict) -> dict:
        """The whole state dict validated against the model's names and shapes, or an error that
        names every problem (then nothing was touched)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
        bad_type = next(((n, t) for n, t in state_dict.items()
                         if not isinstance(t, torch.Tensor) or not t.is_floating_point()), None)
        if bad_type is not None:
            n, t = bad_type
            raise TypeError(f"state_dict[{n!r}] must be a floating torch.Tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        problems = {"missing": sorted(self._shapes.keys() - state_dict.keys()),
                    "unexpected": sorted(state_dict.keys() - self._shapes.keys()),
                    "mis-shaped": [f"{n}: got {tuple(t.shape)}, expected {self._shapes[n]}"
                                   for n, t in state_dict.items() if n in self._shapes
                                   and tuple(t.shape) != self._shapes[n]]}
        if any(problems.values()):
            raise ValueError("state_dict rejected whole (weights and version unchanged): " + "; ".join(
                f"{kind} {items[:5]}{' ...' if len(items) > 5 else ''}" for kind, items in problems.items() if items))
        return dict(state_dict)

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

    def _swap(self, model: DecoderLM, version: int, swapped: Future) -> None:
        """Between two steps: the staged weights become the live ones, the old ones the shadow.  No
        page of an older version is hit again; with kv_on_swap="recompute" every admitted request
        goes back to the queue to be prefilled anew under the new weights."""
        self._shadow, self.model = self.model, model
        self._version = version
        self._pages.drop_older(version)
        if self.kv_on_swap == "recompute":
            for seq in sorted(self._prefilling + self._running, key=lambda s: s.admitted, reverse=True):
                self._preempt(seq, count=False)
            self._prefilling, self._running = [], []
        if self.device.type == "cuda":
            self._retired = torch.cuda.Event()
            self._retired.record()
        swapped.set_result(None)

    # ------------------------------------------------------------------ the engine loop

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._prefilling or self._staged or self._closed):
                    self._cv.wait()
                if self._closed:
                    break
                staged, self._staged = self._staged, None
            if staged is not None:
                self._swap(*staged)
            settle: list = []
            try:
                self._step(settle)
            except Exception as exc:  # fail the requests that hit it; the engine goes on
                for seq in self._prefilling + self._running:
                    if seq.slot is not None:      # (a sample that finished in this step keeps its result)
                        self._release(seq)
                        seq.group.fail(exc, settle)
                self._prefilling, self._running = [], []
            for fn, value in settle:  # outside every lock: callbacks may submit again
                fn(value)
        with self._cv:
            staged, self._staged = self._staged, None
            leftover = list(self._waiting) + self._prefilling + self._running
            self._waiting.clear()
            self._prefilling, self._running = [], []
        if staged is not None:
            staged[2].set_exception(RuntimeError(f"generator {self.name} closed before the weights were swapped in"))
        closed, settle = RuntimeError(f"generator {self.name} closed before finishing the request"), []
        for seq in leftover:
            group = seq.group
            if not group.failed and (group.future.running() or group.future.set_running_or_notify_cancel()):
                group.fail(closed, settle)
        for fn, value in settle:
            fn(value)

    @torch.no_grad()
    def _step(self, settle: list) -> None:
        """One iteration: pages for the decode step, the prefill work (resumed prompts, then admissions
        within the token budget), one packed prefill pass, one decode step."""
        old = self._grow_pages()
        with self._cv:
            work = self._schedule()
        model = self.model
        done = self._prefill(model, work, settle) if work else []
        self._running = old + done                      # (what an error fails)
        running = self._decode(model, old, settle) if old else []
        self._running = running + done
        self._counts["steps"] += 1

    def _grow_pages(self) -> list:
        """Give every decoding request the page its next token's KV goes to; when the pool has no free
        or evictable page, preempt the newest admitted request (prefilling ones first: they are
        newer), which frees its pages and goes back to the head of the queue."""
        running, ps, k = self._running, self.page_size, 0
        while k < len(running):
            seq = running[k]
            if len(seq.pages) >= -(-len(seq.tokens) // ps):
                k += 1
                continue
            if self._pages.available():
                page = self._pages.allocate()
                self._table_updates.append((seq.slot, len(seq.pages), page))
                seq.pages.append(page)
                continue
            victim = self._prefilling.pop() if self._prefilling else running.pop()
            self._preempt(victim)
        return running

    def _preempt(self, seq: _Seq, count: bool = True) -> None:
        """Free what ``seq`` holds and put it first in line; it keeps its tokens and generator (its
        followers, if its prompt was not prefilled yet, go back with it)."""
        for s in [seq, *seq.followers]:
            self._release(s)
        seq.computed, seq.node, seq.keyed, seq.kv_version = 0, 0, 0, None
        if count:
            self._counts["preemptions"] += 1
        with self._cv:
            self._waiting.appendleft(seq)

    def _schedule(self) -> list:
        """The iteration's prefill work, [(seq, start, end)] (under the lock): the prompts being
        prefilled resume first, then waiting requests are admitted in arrival order while a slot per
        sample, their pages and the token budget allow.  Cuts fall on page boundaries."""
        work, budget = [], self.max_prefill_tokens
        for seq in self._prefilling:
            if budget <= 0:
                break
            end = self._chunk_end(seq, budget)
            work.append((seq, seq.computed, end))
            budget -= end - seq.computed
        while self._waiting and budget > 0:
            seq = self._waiting[0]
            admitted = self._admit(seq)
            if admitted is None:            # the user cancelled it before it started
                self._waiting.popleft()
                continue
            if not admitted:
                break
            self._waiting.popleft()
            end = self._chunk_end(seq, budget)
            work.append((seq, seq.computed, end))
            budget -= end - seq.computed
        return work

    def _chunk_end(self, seq: _Seq, budget: int) -> int:
        end = len(seq.tokens)
        if end - seq.computed > budget:
            aligned = (seq.computed + budget) // self.page_size * self.page_size
            end = aligned if aligned > seq.computed else seq.computed + budget
        return end

    def _admit(self, seq: _Seq) -> bool:
        """Take a slot per sample and the pages ``seq``'s tokens need beyond its cached prefix (plus a
        page per follower for the prompt's partial last page); False (nothing taken) when they do not
        fit now or a page it would hit is still being computed; None when the request was cancelled."""
        ps, pages = self.page_size, self._pages
        n = 1 + len(seq.followers)
        if len(self._free_slots) < n:
            return False
        chunks = [tuple(seq.tokens[j * ps:(j + 1) * ps]) for j in range(len(seq.tokens) // ps)]
        hits = []
        if self.prefix_caching:
            # Never the page of the last token: its logits give the next sample.
            hits, blocked = pages.match(chunks[:(len(seq.tokens) - 1) // ps], self._version, self._hybrid)
            if blocked:
                return False
        partial = len(seq.tokens) % ps != 0
        need = -(-len(seq.tokens) // ps) - len(hits) + (n - 1) * partial
        if need > pages.available(hits):
            return False
        group = seq.group
        if group.failed:
            return None
        if not group.future.running():     # its first admission
            if not group.future.set_running_or_notify_cancel():
                return None
            self._counts["prompt_tokens"] += n * seq.n_prompt
        for page in hits:
            pages.hold(page)
        seq.pages = hits + [pages.allocate() for _ in range(-(-len(seq.tokens) // ps) - len(hits))]
        seq.slot = self._free_slots.pop()
        seq.spare = [(self._free_slots.pop(), pages.allocate() if partial else None) for _ in seq.followers]
        seq.admitted = next(self._admissions)
        seq.computed = len(hits) * ps
        seq.kv_version = self._version
        self._counts["prefix_hit_tokens"] += seq.computed
        self._table_updates += [(seq.slot, j, page) for j, page in enumerate(seq.pages)]
        if self.prefix_caching:   # key the pages it will compute now, so that nobody computes them twice
            seq.node, seq.keyed = 0, 0
            for j, chunk in enumerate(chunks):
                seq.node = pages.register(seq.pages[j], seq.node, chunk, self._version, pending=j >= len(hits))
            seq.keyed = len(chunks)
        if self._hybrid:
            self._start_states(seq, pages.checkpoint_of.get(hits[-1]) if hits else None)
        self._prefilling.append(seq)
        return True

    def _release(self, seq: _Seq) -> None:
        """Give back a sample's pages (cached ones stay cached), its slot and its followers' reservations."""
        self._pages.release(seq.pages)
        seq.pages = []
        for slot, page in seq.spare:
            self._free_slots.append(slot)
            if page is not None:
                self._pages.release([page])
        seq.spare = []
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

    # ------------------------------------------------------------------ linear layers' state

    def _store_states(self, layer: int, cache, slots: torch.Tensor) -> None:
        pools = self._states.setdefault(layer, {})
        for name, value in vars(cache).items():
            if isinstance(value, torch.Tensor):
                if name not in pools:
                    pools[name] = torch.zeros(self.max_batch_size, *value.shape[1:], dtype=value.dtype,
                                              device=value.device)
                pools[name][slots] = value

    def _start_states(self, seq: _Seq, checkpoint: int | None) -> None:
        """An admitted sample's linear-layer state: the checkpoint of its last cached page, or zeros
        (a fresh start) when it starts at position 0."""
        for layer, pools in self._states.items():
            for name, pool in pools.items():
                if checkpoint is None:
                    pool[seq.slot].zero_()
                else:
                    pool[seq.slot] = self._checkpoints[layer][name][checkpoint]

    def _checkpoint_store(self, layer: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s checkpoints of state ``name`` [num_checkpoints, *like.shape[1:]], allocated
        (zeros, like's dtype and device) on first use."""
        store = self._checkpoints.setdefault(layer, {})
        if name not in store:
            store[name] = torch.zeros(self.num_checkpoints, *like.shape[1:], dtype=like.dtype, device=like.device)
        return store[name]

    def _take_checkpoint(self, slot: int, seq_slot: int) -> None:
        """The linear layers' state of the sample in ``seq_slot`` into checkpoint ``slot``."""
        for layer, pools in self._states.items():
            for name, pool in pools.items():
                self._checkpoint_store(layer, name, pool)[slot] = pool[seq_slot]

    def _checkpoint_at(self, seq: _Seq, boundary: int) -> int | None:
        """A checkpoint slot for the page of ``seq`` that ends at token ``boundary`` (None: no checkpoint
        is wanted there, or the page is not keyed to this sample)."""
        ps = self.page_size
        if not (self._hybrid and self.prefix_caching and self.num_checkpoints) or boundary % ps:
            return None
        j = boundary // ps - 1
        if j >= seq.keyed or seq.node is None or j >= len(seq.pages):
            return None
        return self._pages.checkpoint_slot(seq.pages[j])

    # ------------------------------------------------------------------ prefill and decode

    def _prefill(self, model: DecoderLM, work: list, settle: list) -> list:
        """One pass over the packed prefill work [(seq, start, end)]: tokens start .. end - 1 of each,
        attending to their cached or earlier-computed pages.  A sample whose tokens are all computed
        samples its next token (a group's first sample for the whole group, which forks); the others
        stay in ``_prefilling``.  Returns the samples that now decode."""
        dev, ps, c = self.device, self.page_size, self.config
        seqs = [w[0] for w in work]
        lengths = [end - start for _, start, end in work]
        ids = torch.tensor([t for s, start, end in work for t in s.tokens[start:end]], device=dev)
        positions = torch.cat([torch.arange(start, end) for _, start, end in work]).to(dev)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
        # KV slot of every fed token in the pool viewed as [num_pages * page_size, H_kv, D].
        where = torch.tensor([s.pages[p // ps] * ps + p % ps for s, start, end in work for p in range(start, end)],
                             device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        self._flush_table()
        table = self._table[slots, :max(len(s.pages) for s in seqs)]
        used = torch.tensor([end for _, _, end in work], dtype=torch.int32, device=dev)
        longest, keys, scale = max(lengths), max(end for _, _, end in work), c.head_dim ** -0.5
        # Hybrid models: checkpoints at the page boundaries the pass crosses (every checkpoint_interval
        # pages, and its last full page); interior ones cut the linear layers' call there.
        stride = self.checkpoint_interval * ps
        cuts = []
        for s, start, end in work:
            marks = {b for b in range(start - start % stride + stride, end + 1, stride)} | {end - end % ps}
            cuts.append(sorted((b, slot) for b in marks if start < b <= end
                               for slot in [self._checkpoint_at(s, b)] if slot is not None))

        # The mode: rows at or after a prompt's end (a preempted request's completion, recomputed) reduce
        # their keys in the decode's two segments.
        completions = [(n, max(start, s.n_prompt), end) for n, (s, start, end) in enumerate(work)
                       if self.batch_invariant and end > s.n_prompt]

        def attend(i, q, k, v):
            kc, vc = self._k[self._pool_index[i]], self._v[self._pool_index[i]]
            kc.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, where, k)
            vc.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, where, v)
            out = self._varlen_attn(q, kc, vc, cu, None, longest, keys, scale=scale, window_size=(-1, 0),
                                    enable_gqa=True, seqused_k=used, block_table=table, **self._attn_kw)
            for n, first, _ in completions:
                rows = slice(int(cu[n]) + first - work[n][1], int(cu[n + 1]))
                out[rows] = self._two_segments(q[rows][None], kc, vc, used[n:n + 1], table[n:n + 1],
                                               used[n:n + 1] * 0 + work[n][0].n_prompt, dict(scale=scale))[0]
            return out

        def mix(i, module, h):
            return self._prefill_linear(i, module, h, work, cuts, slots)

        h = model.layers_forward(ids, positions, attend, mix)
        self._counts["computed_prompt_tokens"] += sum(lengths)
        finished, rows = [], []
        for n, (s, start, end) in enumerate(work):
            for page in s.pages[start // ps:end // ps]:
                self._pages.pending.discard(page)        # computed now: a hit from the next iteration on
            for boundary, checkpoint in cuts[n]:
                if boundary == end:                      # (interior ones were taken by the linear layers)
                    self._take_checkpoint(checkpoint, s.slot)
            s.computed = end
            if end == len(s.tokens):
                finished.append(s)
                rows.append(int(cu[n + 1]) - 1)
        self._prefilling = [s for s in self._prefilling if s not in finished]
        if not finished:
            return []
        logits = model.logits(h[torch.tensor(rows, device=dev)])                      # [N, V]
        samples, rows = [], []
        for n, s in enumerate(finished):
            if s.min_version is None:
                s.min_version = self._version
            samples += [s, *self._fork(s)]
            rows += [n] * (1 + len(s.followers))
            s.followers = []
        self._running = self._running + samples         # (what an error in sampling fails)
        return self._advance(samples, logits[torch.tensor(rows, device=dev)], settle)

    def _prefill_linear(self, i: int, module, h: torch.Tensor, work: list, cuts: list, slots) -> torch.Tensor:
        """A "linear" layer over the pass's tokens h [T, hidden]: each sample continues from its state
        (zeros from position 0, its slot's when resuming or after a cached prefix) and leaves its new
        state in its slot.  Where a checkpoint falls inside a sample's tokens the call is cut there:
        round r runs every sample's r-th segment (the state carried over), and the state after a
        segment that ends at a checkpoint is kept in its slot."""
        bounds = [0, *itertools.accumulate(end - start for _, start, end in work)]
        segments = []                                   # per sample: [(first row, last row + 1, checkpoint)]
        for n, (_, start, end) in enumerate(work):
            edges = [(b, cp) for b, cp in cuts[n] if b < end] + [(end, None)]
            rows, pieces = bounds[n], []
            for b, cp in edges:
                pieces.append((rows, bounds[n] + b - start, cp))
                rows = bounds[n] + b - start
            segments.append(pieces)
        cache = module.new_cache()
        if i in self._states:                           # resumed samples, cached prefixes: their slots' state
            for name, pool in self._states[i].items():
                setattr(cache, name, pool[slots])
        states = {name: t for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}
        out = h.new_empty(h.shape)
        for r in range(max(len(p) for p in segments)):
            members = [n for n, p in enumerate(segments) if len(p) > r]
            pieces = [segments[n][r] for n in members]
            rows = torch.cat([torch.arange(a, b) for a, b, _ in pieces]).to(h.device)
            cu = torch.tensor([0, *itertools.accumulate(b - a for a, b, _ in pieces)], dtype=torch.int32,
                              device=h.device)
            part = module.new_cache()
            index = torch.tensor(members, device=h.device)
            for name, t in states.items():
                setattr(part, name, t[index])
            out[rows] = module(h[rows][None], cu_seqlens=cu, cache=part)[0]
            for name, t in vars(part).items():
                if isinstance(t, torch.Tensor):
                    if name not in states:              # the first round of the first call: all samples
                        states[name] = t
                    else:
                        states[name][index] = t
            for n, (_, _, checkpoint) in zip(members, pieces):
                if checkpoint is not None:              # this layer's state at an interior page boundary
                    for name, t in states.items():
                        self._checkpoint_store(i, name, t)[checkpoint] = t[n]
        self._store_states(i, SimpleNamespace(**states), slots)
        return out

    def _fork(self, seq: _Seq) -> list:
        """A group's first sample finished its prompt: the others share its full prompt pages, take a
        copy of its partial last page and of its linear layers' state, and decode from there."""
        ps, n = self.page_size, len(seq.tokens)
        full = seq.pages[:n // ps]
        forks = []
        for follower, (slot, page) in zip(seq.followers, seq.spare):
            for p in full:
                self._pages.hold(p)
            follower.pages = full + ([page] if page is not None else [])
            if page is not None:                        # the prompt's partial last page: written per sample
                self._k[:, page] = self._k[:, seq.pages[n // ps]]
                self._v[:, page] = self._v[:, seq.pages[n // ps]]
            follower.slot = slot
            for pools in self._states.values():
                for pool in pools.values():
                    pool[slot] = pool[seq.slot]
            follower.computed, follower.node, follower.keyed = seq.computed, seq.node, seq.keyed
            follower.kv_version, follower.min_version = seq.kv_version, seq.min_version
            follower.admitted = next(self._admissions)
            self._table_updates += [(slot, j, p) for j, p in enumerate(follower.pages)]
            self._counts["prefix_hit_tokens"] += n
            forks.append(follower)
        seq.spare = []
        return forks

    def _decode(self, model: DecoderLM, seqs: list, settle: list) -> list:
        """One token for every decoding request: a batched forward over their last tokens.  A group's
        samples decode side by side through ``cascade_decode`` (their prompt's shared pages read once);
        the batch-invariant mode reduces every row's keys in two segments (``_two_segments``)."""
        dev, c = self.device, self.config
        if self._cascade_decode is not None and not self.batch_invariant:   # a group's samples side by side
            by_group: dict = {}
            for s in seqs:
                by_group.setdefault(id(s.group), []).append(s)
            seqs = [s for members in by_group.values() for s in members]
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=dev)
        positions = torch.tensor([len(s.tokens) - 1 for s in seqs], device=dev)
        used = (positions + 1).to(torch.int32)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        self._flush_table()
        table = self._table[slots, :max(len(s.pages) for s in seqs)]
        scale = c.head_dim ** -0.5
        groups = self._decode_groups(seqs) if self._cascade_decode is not None and not self.batch_invariant else None
        prompts = torch.tensor([s.n_prompt for s in seqs], dtype=torch.int32, device=dev)

        def attend(i, q, k, v):
            kc, vc = self._k[self._pool_index[i]], self._v[self._pool_index[i]]
            new = dict(k_new=k[:, None], v_new=v[:, None], scale=scale)
            if self.batch_invariant:
                return self._two_segments(q[:, None], kc, vc, used, table, prompts, new)[:, 0]
            if groups is not None:
                cu, prefix = groups
                return self._cascade_decode(q[:, None], kc, vc, used, block_table=table, cu_groups=cu,
                                            prefix_lens=prefix, **new)[:, 0]
            return self._flash_decode(q[:, None], kc, vc, used, block_table=table, **new)[:, 0]

        def mix(i, module, h):
            cache = module.new_cache()
            for name, pool in self._states[i].items():
                setattr(cache, name, pool[slots])
            out = module(h[:, None], cache=cache)[:, 0]
            self._store_states(i, cache, slots)
            return out

        h = model.layers_forward(ids, positions, attend, mix)
        for s in seqs:                                  # the fed token's KV is written: a page may be full
            s.computed = len(s.tokens)
            self._key_full_pages(s)
        return self._advance(seqs, model.logits(h), settle)

    def _decode_groups(self, seqs: list):
        """(cu_groups, prefix_lens) of a decode batch ordered by request: the samples of one request that
        still share its prompt's full pages form a group (prefix: those pages' keys); None when no
        group has two samples (plain flash_decode then)."""
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
        prefixes = [p if size > 1 else 0 for p, size in zip(prefixes, sizes)]
        dev = self.device
        return (torch.tensor(bounds, dtype=torch.int32, device=dev),
                torch.tensor(prefixes, dtype=torch.int32, device=dev))

    def _two_segments(self, q, kc, vc, used, table, prompts, new):
        """The batch-invariant mode's attention for completion rows q [B, S_q, H_q, D] (positions used - S_q
        .. used - 1, all at or after their prompt's end): over the prompt's keys, then over the
        sequence's own keys from the prompt's end on (``cache_leftpad``), merged as
        ``DecoderLM.token_logprobs`` merges them.  ``new``: k_new / v_new and scale for the second call."""
        b, s_q = q.shape[:2]
        rows = q.reshape(b * s_q, 1, *q.shape[2:])                          # each row alone over its prompt
        o_a, lse_a = self._flash_decode(
            rows, kc, vc, prompts.repeat_interleave(s_q), block_table=table.repeat_interleave(s_q, dim=0),
            scale=new["scale"], return_lse=True, batch_invariant=True)
        o_b, lse_b = self._flash_decode(q, kc, vc, used, block_table=table, cache_leftpad=prompts, return_lse=True,
                                        batch_invariant=True, **new)
        lse_b = lse_b.transpose(1, 2).flatten(0, 1).t()                     # [B, H, S_q] -> [H, B * S_q]
        out, _ = _merge_states(o_a[:, 0], lse_a[:, :, 0].t(), o_b.flatten(0, 1), lse_b)
        return out.to(q.dtype).unflatten(0, (b, s_q))

    def _key_full_pages(self, seq: _Seq) -> None:
        """Key the pages a decode step filled (prompt + generated tokens), with a checkpoint where one is due."""
        ps = self.page_size
        if not self.prefix_caching or seq.node is None:
            return
        if seq.kv_version != self._version:             # its KV mixes two weight versions: never a hit
            seq.node = None
            return
        while (seq.keyed + 1) * ps <= seq.computed:
            j = seq.keyed
            seq.node = self._pages.register(seq.pages[j], seq.node, tuple(seq.tokens[j * ps:(j + 1) * ps]),
                                            self._version, pending=False)
            seq.keyed += 1
            if (j + 1) % self.checkpoint_interval == 0:
                checkpoint = self._checkpoint_at(seq, (j + 1) * ps)
                if checkpoint is not None:
                    self._take_checkpoint(checkpoint, seq.slot)

    def _advance(self, seqs: list, logits: torch.Tensor, settle: list) -> list:
        """Sample one token per sample; finished ones free their pages.  Returns the rest."""
        tokens, logprobs = _sample_batch(logits, [s.group.request.sampling for s in seqs], [s.rng for s in seqs],
                                         self.batch_invariant)
        still = []
        for s, token, logprob in zip(seqs, tokens, logprobs):
            s.tokens.append(token)
            s.logprobs.append(logprob)
            generated = len(s.tokens) - s.n_prompt
            if token in s.group.request.sampling.stop_token_ids:
                reason = "stop"
            elif generated >= s.limit:
                reason = "length"
            else:
                still.append(s)
                continue
            self._release(s)
            r = s.group.request
            s.group.done(Completion(r.request_id, list(r.prompt_token_ids), s.tokens[s.n_prompt:], s.logprobs, reason,
                                    self.name, s.min_version, self._version, s.index), settle)
            self._counts["completed"] += 1
            self._counts["generated_tokens"] += generated
        return still



# ----------------------------------------------------------------------------- the batch-invariant matmul (GPU)
# y = x W^T with one program per [BLOCK_M, BLOCK_N] tile of y, K walked in BLOCK_K steps from 0, fp32
# accumulation, no split-K.  An element of y is the same chain of MMA k-steps whatever M is and wherever
# its row sits in the tile (the MMA treats every row alike; rows past M load as zeros and only feed rows
# that are never stored).  Its bits then depend on the tile shape, num_warps and the instruction they
# select: so one config per (GPU family, element size), never autotuned, never chosen by M.
# (GPU family, element size): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).  16-bit: 64-row tiles
# (sm_90's wgmma needs 64), 48 KB of operands per stage; fp32: IEEE dots on the FMA units (no tf32).
_INVARIANT_MATMUL_CONFIGS = {
    (90, 2): (64, 128, 64, 4, 3),
    (80, 2): (64, 128, 32, 4, 3),
    (90, 4): (32, 64, 32, 4, 2),
    (80, 4): (32, 64, 32, 4, 2),
}


def _invariant_matmul_config(dtype: torch.dtype, family: int) -> tuple[int, int, int, int, int]:
    """The launch config for family 80 (A100 and older: mma.sync) or 90 (H100 and newer: wgmma)."""
    return _INVARIANT_MATMUL_CONFIGS[(family, 4 if dtype == torch.float32 else 2)]


def _gpu_family(device: torch.device) -> int:
    if device.type != "cuda":
        return 80                                                       # the interpreter (CPU tensors)
    return 90 if torch.cuda.get_device_capability(device)[0] >= 9 else 80


def _triton_invariant_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype through the fixed-tile kernel (CUDA tensors, or
    CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("the batch-invariant matmul on a GPU needs Triton (pip install triton)")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x and weight must share a dtype in fp16 / bf16 / fp32, got {x.dtype} and {weight.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, block_k, warps, stages = _invariant_matmul_config(x.dtype, _gpu_family(x.device))
    # A GPU's MMA rounds every row of a tile alike: the rows fill the tile.  The interpreter's dot is a
    # BLAS call, whose micro-kernels round a tile's slots differently (OpenBLAS's Haswell sgemm: rows
    # 6-11 of 16 apart from the rest), so there each row gets its own tile, at slot 0.
    rows_per_tile = block_m if x.is_cuda else 1
    grid = (triton.cdiv(m, rows_per_tile), triton.cdiv(n, block_n))
    _invariant_matmul_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ROWS_PER_TILE=rows_per_tile,
                                   PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                   num_warps=warps, num_stages=stages)
    return y


if triton is not None:
    @triton.jit
    def _invariant_matmul_kernel(x, w, y, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
                                 PRECISION: tl.constexpr):
        i_m, i_n = tl.program_id(0), tl.program_id(1)
        o_slot = tl.arange(0, BLOCK_M)
        o_m = i_m * ROWS_PER_TILE + o_slot                                  # rows x in slots 0 .. ROWS_PER_TILE - 1
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_m, m_n = (o_slot < ROWS_PER_TILE) & (o_m < M), o_n < N
        p_x = x + o_m.to(tl.int64)[:, None] * stride_xm                     # [BLOCK_M, 1] row starts
        p_w = w + o_n.to(tl.int64)[None, :] * stride_wn                     # [1, BLOCK_N] W rows = y columns
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):                                     # from k = 0, in order, whatever M
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0)      # [BLOCK_M, BLOCK_K]
            b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0)      # [BLOCK_K, BLOCK_N]
            b_acc = tl.dot(b_x, b_w, b_acc, input_precision=PRECISION)
        p_y = y + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


# ----------------------------------------------------------------------------- input checks

def _check_mode(batch_invariant, varlen_attn) -> None:
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__} {batch_invariant!r}")
    if varlen_attn is not None and not callable(varlen_attn):
        raise TypeError(f"varlen_attn must be None or a function with varlen_attn's signature, got "
                        f"{type(varlen_attn).__name__}")
    if batch_invariant and varlen_attn is None:
        raise ValueError("batch_invariant=True needs varlen_attn (fast/paged_varlen_attention.varlen_attn, whose "
                         "batch_invariant=True rounds a row alike in a prefill, a decode step and a trainer's "
                         "packed forward); the in-file default attention is not batch-invariant")


def _check_logprob_inputs(sequences, prompt_lengths, temperature, config: ModelConfig):
    """token_logprobs' arguments as (lists of token ids, prompt lengths, temperatures), or a clear error."""
    if isinstance(sequences, (str, bytes, torch.Tensor)) or not isinstance(sequences, Iterable):
        raise TypeError(f"sequences must be a list of token-id sequences, got {type(sequences).__name__}")
    seqs = []
    for n, s in enumerate(sequences):
        if isinstance(s, torch.Tensor):
            if s.dim() != 1 or s.is_floating_point() or s.is_complex():
                raise TypeError(f"sequences[{n}] must be a 1-D integer tensor, got {s.dtype} of shape {tuple(s.shape)}")
            s = s.tolist()
        try:
            seqs.append([operator.index(t) for t in s])
        except TypeError:
            raise TypeError(f"sequences[{n}] must hold ints (token ids), got {type(s).__name__}") from None
    if isinstance(prompt_lengths, (str, bytes)) or not isinstance(prompt_lengths, Iterable):
        raise TypeError(f"prompt_lengths must be a list of ints, got {type(prompt_lengths).__name__}")
    prompts = list(prompt_lengths)
    if len(prompts) != len(seqs) or not all(_is_int(p) for p in prompts):
        raise ValueError(f"prompt_lengths must hold one int per sequence ({len(seqs)}), got {prompts!r}")
    temps = list(temperature) if isinstance(temperature, Iterable) else [temperature] * len(seqs)
    if len(temps) != len(seqs) or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0
                                          for t in temps):
        raise ValueError(f"temperature must be a float >= 0 or one per sequence ({len(seqs)}), got {temperature!r}")
    for n, (s, p) in enumerate(zip(seqs, prompts)):
        if not 1 <= p < len(s):
            raise ValueError(f"prompt_lengths[{n}] must be in [1, {len(s)}) (a prompt and at least one completion "
                             f"token), got {p}")
        if len(s) - 1 > config.max_seq_len:
            raise ValueError(f"sequences[{n}] has {len(s)} tokens: more than max_seq_len + 1 = "
                             f"{config.max_seq_len + 1}")
        if min(s) < 0 or max(s) >= config.vocab_size:
            raise ValueError(f"sequences[{n}] must hold token ids in [0, {config.vocab_size}), got "
                             f"{min(s) if min(s) < 0 else max(s)}")
    return seqs, prompts, [float(t) for t in temps]
