"""Mixture-of-Experts: Triton kernels for the router, the grouped expert GEMMs, the combine and their
backward, and gpt-oss's MXFP4 dequantization, with ref/moe.py's functions and signatures.

Example (runs as written next to this file; TRITON_INTERPRET=1 runs the kernels on a CPU)::

    # moe.py, copied next to this script
    import torch
    from moe import moe_experts, route

    dev = "cuda" if torch.cuda.is_available() else "cpu"     # on a CPU: TRITON_INTERPRET=1 first
    T, H, E, I, k = 6, 32, 4, 16, 2
    x = torch.randn(T, H, device=dev, requires_grad=True)
    weights, ids = route(torch.randn(T, E, device=dev), k)   # softmax over E, the top 2, renormalised
    w1 = (0.1 * torch.randn(E, 2 * I, H, device=dev)).requires_grad_()   # gate rows, then up rows
    w2 = (0.1 * torch.randn(E, H, I, device=dev)).requires_grad_()
    out = moe_experts(x, weights, ids, w1, w2)               # [6, 32]
    out.sum().backward()                                     # gradients for x, w1 and w2
    print(out.shape, w1.grad.shape)

What it computes
    ref/moe.py's functions (the specification; its docstring has the math, the tensors and the layer):
    ``route`` (softmax_topk / topk_softmax scoring, top-k with ties to the lower index, rows in
    expert-index order), ``moe_experts`` (each token through its k experts, weighted, summed) and
    ``dequantize_mxfp4``.  The layer is ref/moe.py's ``MoE``, which takes these as its plug-ins.
    ``moe_experts`` as kernels, in call order (vLLM's fused_moe decomposition, written anew):
        1. count     pairs (token, slot) per expert, per chunk of pairs; a cumsum over the chunks
        2. align     each pair's row in the expert-sorted order, every expert's run padded to whole
                     tiles of R rows (vLLM's moe_align_block_size): pos [T k], sorted_pairs [rows]
        3. gate_up   a [rows, I] = act(x W1_e^T + b1_e) per tile of one expert, the activation (SwiGLU or
                     gpt-oss's clamped one) in the epilogue, gate and up from one [BK, 2 BN] weight tile
        4. down      y [rows, H] = w (a W2_e^T + b2_e), the routing weight in the epilogue
        5. combine   out [T, H] = sum over a token's k rows in slot order (ids ascend: expert-index
                     order), fp32, no atomics: deterministic
    The backward (every gradient: x, the routing weights, W1, W2, b1, b2): recompute the plan, then
        a. act_bwd   per tile, h = x W1^T + b1 and u = dout W2 (two dots over H); a (stored for dW2),
                     dh = act'(h) (w u) (stored), and the routing weight's partial d w = a . u (+ dout . b2)
        b. down      dx rows = dh W1 (step 4's kernel), then combine (step 5's)
        c. wgrad     dW1_e = sum over e's rows dh^T x, db1 = sum dh; dW2_e = sum (w dout)^T a, db2 = sum w dout:
                     a program per (expert, N tile, K tile) looping over the expert's rows in order
    The router's backward (d logits from d weights through the scoring function) is a few torch ops.

Batch invariance (``moe_experts(..., batch_invariant=True)``; ref/moe.py's ``MoE.set_batch_invariant``)
    A token's output has the same bits whichever tokens share the call: every GEMM runs one fixed tile
    shape per (GPU family, element size) with no split-K, K walked from 0 in order; on a GPU the rows of
    an expert fill its tiles (an MMA rounds every row of a tile alike); under the interpreter each (token,
    expert) row sits at slot 0 of its own tile (R = 1: the interpreter's dot is a BLAS call whose micro-
    kernels round a tile's slots differently: fast/decoder_lm.py's precedent).  The router kernel and the
    combine are per token; the layer's router logits go through the caller's invariant matmul.

Tensors: ref/moe.py's (x, logits, weights, ids, gate_up_proj, down_proj, biases, blocks, scales), with x
and the expert weights in fp16 / bf16 / fp32 (one dtype; fp64 raises TypeError); weights are fp32.

Expert parallelism (ref/moe.py's section: the same code; ``MoE(..., expert_group=group)``)
    N ranks, E / N whole experts each (rank r: experts r E / N .. (r + 1) E / N - 1, under the same names; a
    whole layer's state dict, fused or per-expert, loads with the other ranks' experts dropped).  The input
    x [T, H] is the same on every rank (tensor parallelism's replicated activations), so:
        1. rank r takes tokens [r T / N, (r + 1) T / N) (the first T mod N ranks one more), routes them
           (the router is replicated) and sorts its (token, slot) pairs by the rank holding their expert
        2. dispatch   all-to-all of the pairs' rows of x, their weights and local expert ids (the counts
                      first: an all-to-all of N integers, read on the host to size the buffers)
        3. experts    ``experts_fn`` over the pairs received, each a one-slot token of a local expert
        4. return     all-to-all back; each token's k rows summed in slot order (expert-index order), in
                      fp32 (fp64 for fp64), as the combine kernel sums them; the shared expert added
        5. gather     all-gather of the ranks' token slices: every rank holds the whole [T, H] again
    A token's row is computed by the same arithmetic on whichever rank (the mode's kernels round a row alike
    whatever shares its tile), so the mode's bits are the one-rank layer's at any N.  Per token and layer the
    wire carries k rows of H out and back, plus H in the gather.  Backward: the exchanges run in reverse (one
    autograd node per exchange, so every rank's backward joins them in one order; a rank that received no pair
    still takes part).  x's gradient holds this rank's tokens' part and the router's and shared expert's
    gradients this rank's tokens' part: the caller sums them over the group (decoder_lm.py does, as for its
    other replicated weights).  The group is any object with torch.distributed ProcessGroup's ``size``,
    ``rank``, ``allgather`` and ``alltoall_base`` (gloo on CPUs, NCCL on GPUs, decoder_lm.py's LocalGroup).
    A limit: the pair counts are read on the host each layer (a sync per layer, not CUDA-graph capturable).

Supported, and what raises
    CUDA tensors (CPU tensors only under TRITON_INTERPRET=1), E <= 1024, any T, H, I, k (k <= E for the
    router); the reference's errors for bad shapes, dtypes, sizes and options; ids outside [0, E) raise
    ValueError (checked on the host, except while a CUDA graph is captured or torch.compile traces: there such
    a pair is dropped, it adds nothing).  Double backward raises.

References
    vLLM fused_moe (moe_align_block_size, fused_moe_kernel); SGLang's Triton MoE; transformers 5's MoE
    blocks and integrations/mxfp4.py; the Triton matmul tutorial.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
import triton
import triton.language as tl

__all__ = ["route", "moe_experts", "dequantize_mxfp4", "MoE"]

SCORINGS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("silu", "gpt_oss")
LAYOUTS = ("qwen", "gpt_oss")
MAX_EXPERTS = 1024
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- public API

def route(logits, top_k, *, scoring="softmax_topk", norm_topk_prob=True):
    """logits [T, E] -> (weights [T, k] fp32, ids [T, k] int64), each row in expert-index order; one kernel."""
    _check_route(logits, top_k, scoring, norm_topk_prob)
    _check_dtype("logits", logits)
    _check_runnable(logits)
    return _route_op(logits, top_k, scoring, norm_topk_prob)


def moe_experts(x, weights, ids, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None, *, layout="qwen",
                activation="silu", swiglu_limit=7.0, swiglu_alpha=1.702, batch_invariant=False):
    """sum_s weights[t, s] * expert_{ids[t, s]}(x[t]) -> [T, H] in x's dtype (ref/moe.py's math), in the
    kernels of the module docstring; differentiable in x, weights and every expert tensor."""
    _check_experts(x, weights, ids, gate_up_proj, down_proj, gate_up_bias, down_bias, layout=layout,
                   activation=activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                   batch_invariant=batch_invariant,
                   check_ids=not (_capturing(x.device) or torch.compiler.is_compiling()))
    _check_dtype("x", x)
    _check_runnable(x)
    down_bias = None if down_bias is None else down_bias.contiguous()      # the kernels step along H by 1
    return _experts_op(x.contiguous(), weights.to(torch.float32).contiguous(), ids.contiguous(), gate_up_proj,
                       down_proj, gate_up_bias, down_bias, layout, activation, float(swiglu_limit),
                       float(swiglu_alpha), batch_invariant)


def dequantize_mxfp4(blocks, scales, *, dtype=torch.bfloat16):
    """gpt-oss MXFP4 -> float, as ref/moe.py's: blocks [E, R, G, 16] uint8, scales [E, R, G] uint8 ->
    [E, 32 G, R] in ``dtype``; one kernel."""
    _check_mxfp4(blocks, scales, dtype)
    _check_runnable(blocks)
    e, r, g, _ = blocks.shape
    out = torch.empty(e, 32 * g, r, dtype=dtype, device=blocks.device)
    if out.numel():
        grid = (e, triton.cdiv(r, 32), triton.cdiv(g, 4))
        _mxfp4_kernel[grid](blocks.contiguous(), scales.contiguous(), out, r, g, BLOCK_R=32, BLOCK_G=4)
    return out


# ----------------------------------------------------------------------------- the layer (ref/moe.py's)

class _Experts(nn.Module):
    """The fused expert tensors, under transformers' names and in the layout's shapes."""

    def __init__(self, e: int, h: int, i: int, layout: str, bias: bool, kw: dict):
        super().__init__()
        shapes = _expert_shapes(layout, e, h, i)
        self.gate_up_proj = nn.Parameter(torch.randn(shapes["gate_up_proj"], **kw) * h ** -0.5)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i, **kw))
        self.down_proj = nn.Parameter(torch.randn(shapes["down_proj"], **kw) * i ** -0.5)
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(e, h, **kw))


class _SharedExpert(nn.Module):
    def __init__(self, h: int, i: int, kw: dict):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False, **kw)
        self.up_proj = nn.Linear(h, i, bias=False, **kw)
        self.down_proj = nn.Linear(i, h, bias=False, **kw)


class MoE(nn.Module):
    """The sparse MoE block: ``forward(x [..., H]) -> [..., H]`` (the module docstring's math and names).

    Keywords: ``num_experts`` E, ``top_k`` k, ``intermediate_size`` I (each expert's FFN), ``scoring``
    ("softmax_topk" / "topk_softmax"), ``norm_topk_prob``, ``router_bias``, ``expert_bias`` (biases on
    gate_up and down), ``activation`` ("silu" / "gpt_oss", with ``swiglu_limit`` and ``swiglu_alpha``),
    ``shared_intermediate_size`` (0: no shared expert), ``layout`` ("qwen": router ``gate``, experts
    [E, 2I, H] / [E, H, I]; "gpt_oss": router ``router``, experts [E, H, 2I] interleaved / [E, I, H]).
    ``route_fn`` / ``experts_fn`` have this file's ``route`` / ``moe_experts`` signatures.
    ``expert_group``: a process group (torch.distributed's, or decoder_lm.py's ``LocalGroup`` rank) to shard
    the experts over: expert parallelism (the module docstring's section); this rank holds experts
    ``first_expert`` .. ``first_expert + num_local_experts - 1`` under the same names."""

    def __init__(self, hidden_size, *, num_experts=128, top_k=8, intermediate_size=768, scoring="softmax_topk",
                 norm_topk_prob=True, router_bias=False, expert_bias=False, activation="silu", swiglu_limit=7.0,
                 swiglu_alpha=1.702, shared_intermediate_size=0, layout="qwen", route_fn=route,
                 experts_fn=moe_experts, expert_group=None, device=None, dtype=None):
        super().__init__()
        _check_sizes(hidden_size=hidden_size, num_experts=num_experts, top_k=top_k,
                     intermediate_size=intermediate_size, shared_intermediate_size=shared_intermediate_size)
        _check_options(scoring=scoring, layout=layout, activation=activation, swiglu_limit=swiglu_limit,
                       swiglu_alpha=swiglu_alpha, norm_topk_prob=norm_topk_prob, router_bias=router_bias,
                       expert_bias=expert_bias)
        if not callable(route_fn) or not callable(experts_fn):
            raise TypeError("route_fn and experts_fn must be functions with route's / moe_experts' signatures")
        self.hidden_size, self.num_experts, self.top_k, self.intermediate_size = (hidden_size, num_experts, top_k,
                                                                                  intermediate_size)
        self.scoring, self.norm_topk_prob, self.layout, self.activation = scoring, norm_topk_prob, layout, activation
        self.swiglu_limit, self.swiglu_alpha = float(swiglu_limit), float(swiglu_alpha)
        self.route_fn, self.experts_fn = route_fn, experts_fn
        ranks, rank = _group_shape(expert_group)
        if num_experts % ranks:
            raise ValueError(f"expert parallelism over {ranks} ranks needs the rank count to divide num_experts="
                             f"{num_experts}")
        self.expert_group = expert_group if ranks > 1 else None
        self.num_local_experts = num_experts // ranks
        self.first_expert = rank * self.num_local_experts
        kw = dict(device=device, dtype=dtype)
        router = nn.Linear(hidden_size, num_experts, bias=router_bias, **kw)
        setattr(self, "router" if layout == "gpt_oss" else "gate", router)       # transformers' names
        self.experts = _Experts(self.num_local_experts, hidden_size, intermediate_size, layout, expert_bias, kw)
        if shared_intermediate_size:
            self.shared_expert = _SharedExpert(hidden_size, shared_intermediate_size, kw)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **kw)
        self.invariant_linear = self.invariant_out_linear = None         # set_batch_invariant's products
        self.register_load_state_dict_pre_hook(_load_checkpoint_tensors)

    @property
    def router_linear(self) -> nn.Linear:
        return self.router if self.layout == "gpt_oss" else self.gate

    def convert_checkpoint(self, state_dict, prefix: str = "") -> None:
        """A checkpoint's tensors under ``prefix`` into this layer's layout, in ``state_dict`` in place:
        per-expert tensors (experts.{i}.gate_proj.weight, ...) and gpt-oss's MXFP4 blocks and scales become
        the fused tensors, checked as untrusted input.  ``load_state_dict`` does it itself; a loader that
        copies tensors by name (decoder_lm.py's) calls it first."""
        _load_checkpoint_tensors(self, state_dict, prefix)

    def set_batch_invariant(self, linear, out_linear=None) -> None:
        """Batch-invariant mode (fast/decoder_lm.py's ``DecoderLM(batch_invariant=True)`` calls it): from
        then on a token's output (and the experts it picks) is bit for bit the same whichever tokens share
        the call, provided ``linear(x [..., K], weight [N, K]) -> [..., N]`` rounds each row independently
        of the other rows.  What changes: the router logits and the shared expert's products go through
        ``linear`` (its down_proj through ``out_linear`` when given), ``experts_fn`` runs with
        ``batch_invariant=True`` (fixed tiles, a token's combine in expert-index order), and SiLU and
        sigmoid are composed from exp."""
        if not callable(linear) or not (out_linear is None or callable(out_linear)):
            raise TypeError(f"linear and out_linear must be functions (x, weight) -> x @ weight.T, got "
                            f"{type(linear).__name__} and {type(out_linear).__name__}")
        self.invariant_linear, self.invariant_out_linear = linear, out_linear or linear

    def _project(self, x, layer: nn.Linear, out: bool = False):
        if self.invariant_linear is None:
            return layer(x)
        y = (self.invariant_out_linear if out else self.invariant_linear)(x, layer.weight)
        return y if layer.bias is None else y + layer.bias

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., hidden_size={self.hidden_size}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        shape, x = x.shape, x.reshape(-1, self.hidden_size)                     # [T, H]
        if self.expert_group is None:
            return self._tokens_forward(x).reshape(shape)
        group = self.expert_group                   # every rank holds the same x: each routes a slice of it
        lo, hi = _token_slice(x.shape[0], group.size(), group.rank())
        return _GatherTokens.apply(self._tokens_forward(x[lo:hi]), group, x.shape[0]).reshape(shape)

    def _tokens_forward(self, x):
        """The block on tokens x [T, H] (all of them, or this rank's slice under expert parallelism)."""
        invariant = self.invariant_linear is not None
        logits = self._project(x, self.router_linear)                            # [T, E]
        weights, ids = self.route_fn(logits, self.top_k, scoring=self.scoring, norm_topk_prob=self.norm_topk_prob)
        ex = self.experts
        experts = (ex.gate_up_proj, ex.down_proj, getattr(ex, "gate_up_proj_bias", None),
                   getattr(ex, "down_proj_bias", None))
        kw = dict(layout=self.layout, activation=self.activation, swiglu_limit=self.swiglu_limit,
                  swiglu_alpha=self.swiglu_alpha, batch_invariant=invariant)
        if self.expert_group is None:
            out = self.experts_fn(x, weights, ids, *experts, **kw)
        else:
            out = self._dispatch_and_combine(x, weights, ids, experts, kw)
        if hasattr(self, "shared_expert"):
            se = self.shared_expert
            a = _silu(self._project(x, se.gate_proj), invariant) * self._project(x, se.up_proj)
            out = out + _sigmoid(self._project(x, self.shared_expert_gate), invariant) * self._project(
                a, se.down_proj, out=True)
        return out

    def _dispatch_and_combine(self, x, weights, ids, experts, kw):
        """Expert parallelism: every (token, slot) pair goes to the rank that holds its expert (all-to-all),
        is computed there as a one-slot token of its local expert, comes back (all-to-all), and a token's k
        outputs are summed here in slot order (expert-index order), as ``experts_fn``'s combine sums them."""
        group, local = self.expert_group, self.num_local_experts
        t, k = ids.shape
        dest = ids.reshape(-1) // local                                         # [T k]: each pair's rank
        order = torch.sort(dest, stable=True).indices           # the pairs by rank, (token, slot) order within
        sent = torch.bincount(dest, minlength=group.size())
        received = _all_to_all(sent, group, [1] * group.size(), [1] * group.size()).tolist()   # pairs per source
        sent = sent.tolist()
        pair_x, pair_w = _AllToAll.apply(group, received, sent, x[order // k], weights.reshape(-1)[order, None])
        pair_ids = _all_to_all((ids.reshape(-1) - dest * local)[order, None], group, received, sent)   # local ids
        if pair_ids.shape[0]:
            y = self.experts_fn(pair_x, pair_w, pair_ids, *experts, **kw)                    # [P, H]: w y_e
        else:       # no pair came here: the empty product keeps this rank's backward in every exchange
            y = (pair_x * pair_w).to(x.dtype)
        back, = _AllToAll.apply(group, sent, received, y)                       # [T k, H], the pairs in `order`
        rows = back[torch.argsort(order)].view(t, k, x.shape[1])                # [T, k, H], slot order
        wide = torch.promote_types(x.dtype, torch.float32)
        out = rows[:, 0].to(wide)
        for s in range(1, k):
            out = out + rows[:, s].to(wide)
        return out.to(x.dtype)


# ----------------------------------------------------------------------------- expert parallelism's collectives
# A process group's own methods (torch.distributed's ProcessGroup, or decoder_lm.py's LocalGroup ranks): no
# default group is assumed, and a rank's tensors never leave its device.

def _group_shape(group) -> tuple[int, int]:
    """(size, rank) of an expert group; (1, 0) for None."""
    if group is None:
        return 1, 0
    if not all(callable(getattr(group, m, None)) for m in ("size", "rank", "allgather", "alltoall_base")):
        raise TypeError(f"expert_group must be a process group (size, rank, allgather, alltoall_base), got "
                        f"{type(group).__name__}")
    return group.size(), group.rank()


def _token_slice(t: int, ranks: int, rank: int) -> tuple[int, int]:
    """[lo, hi): the tokens rank ``rank`` routes, T / ranks each, the first T % ranks ranks one more."""
    base, extra = divmod(t, ranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def _all_to_all(t, group, out_splits, in_splits):
    """Rows in_splits[r] of ``t`` (in rank order) to rank r; out_splits[r] rows from rank r, in rank order."""
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    group.alltoall_base(out, t.contiguous(), list(out_splits), list(in_splits)).wait()
    return out


class _AllToAll(torch.autograd.Function):
    """The all-to-all of tensors with the same row splits, in argument order; backward: their gradients'
    rows sent back the way they came, in the same order.  One node for them all, so every rank's backward
    runs the exchanges in one order (autograd orders separate nodes by readiness, which differs by rank)."""

    @staticmethod
    def forward(ctx, group, out_splits, in_splits, *tensors):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        return tuple(_all_to_all(t, group, out_splits, in_splits) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        out_splits, in_splits = ctx.splits
        return (None, None, None, *(_all_to_all(g, ctx.group, in_splits, out_splits) for g in grads))


class _GatherTokens(torch.autograd.Function):
    """Each rank's token slice gathered: [T_rank, H] -> [T, H] on every rank (padded to equal parts for the
    all-gather); backward: this rank's rows of the gradient (every rank holds the whole gradient of the
    replicated output, so nothing is summed here; the rest of x's gradient comes from the other ranks)."""

    @staticmethod
    def forward(ctx, mine, group, t):
        bounds = [_token_slice(t, group.size(), r) for r in range(group.size())]
        ctx.rows = bounds[group.rank()]
        padded = mine.new_zeros(-(-t // group.size()), mine.shape[1])
        padded[:mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in bounds]
        group.allgather([parts], [padded]).wait()
        return torch.cat([p[:hi - lo] for p, (lo, hi) in zip(parts, bounds)])

    @staticmethod
    def backward(ctx, grad):
        lo, hi = ctx.rows
        return grad[lo:hi], None, None


def _load_checkpoint_tensors(module: MoE, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: a checkpoint's per-expert tensors (experts.{i}.gate_proj.weight, ...) or
    gpt-oss's MXFP4 blocks and scales become the fused tensors; everything checked as untrusted input."""
    ex, m = prefix + "experts.", module
    if any(k.startswith(ex) and k[len(ex):].split(".")[0].isdigit() for k in state_dict):
        _fuse_per_expert(m, state_dict, ex)
    if m.num_local_experts < m.num_experts:      # expert parallelism: this rank's experts of whole tensors
        for key in [k for k in state_dict if k.startswith(ex) and "." not in k[len(ex):]]:
            t = state_dict[key]
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == m.num_experts:
                state_dict[key] = t.narrow(0, m.first_expert, m.num_local_experts)
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = f"{ex}{proj}_blocks", f"{ex}{proj}_scales"
        if blocks not in state_dict and scales not in state_dict:
            continue
        if m.layout != "gpt_oss" or blocks not in state_dict or scales not in state_dict:
            raise ValueError(f"{blocks} and {scales} (MXFP4) load together, into the gpt_oss layout only")
        target = getattr(m.experts, proj)
        try:
            w = dequantize_mxfp4(state_dict.pop(blocks), state_dict.pop(scales), dtype=target.dtype)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{blocks} / {scales}: {err}") from None
        state_dict[ex + proj] = w
    for name, p in m.named_parameters():
        key = prefix + name
        if key in state_dict and tuple(state_dict[key].shape) != tuple(p.shape):
            raise ValueError(f"{key}: expected shape {tuple(p.shape)}, got {tuple(state_dict[key].shape)}")


def _fuse_per_expert(m: MoE, state_dict, ex: str) -> None:
    """experts.{n}.{gate,up,down}_proj.{weight,bias} for n < E (transformers' qwen2_moe conversion: stacked
    over n, gate and up concatenated) -> the layout's fused tensors, in place; under expert parallelism
    this rank's experts (another rank's tensors may be absent, and are dropped)."""
    e, i, h = m.num_experts, m.intermediate_size, m.hidden_size
    bias = hasattr(m.experts, "down_proj_bias")
    mine = range(m.first_expert, m.first_expert + m.num_local_experts)

    def tensors_of(n: int) -> dict:                                 # expert n's names and shapes
        names = {f"{ex}{n}.gate_proj.weight": (i, h), f"{ex}{n}.up_proj.weight": (i, h),
                 f"{ex}{n}.down_proj.weight": (h, i)}
        if bias:
            names.update({f"{ex}{n}.gate_proj.bias": (i,), f"{ex}{n}.up_proj.bias": (i,),
                          f"{ex}{n}.down_proj.bias": (h,)})
        return names
    want = {k: v for n in mine for k, v in tensors_of(n).items()}
    others = {k for n in range(e) if n not in mine for k in tensors_of(n)}
    have = {k for k in state_dict if k.startswith(ex) and k[len(ex):].split(".")[0].isdigit()}
    missing, extra = sorted(set(want) - have), sorted(have - set(want) - others)
    for key in have & others:
        del state_dict[key]                                         # another rank's expert
    if missing or extra:
        raise ValueError(f"per-expert tensors under {ex!r}: missing {missing[:4]}, unexpected {extra[:4]}")
    for key, shape in want.items():
        t = state_dict[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
            raise ValueError(f"{key}: expected a float tensor of shape {shape}, got "
                             f"{f'{t.dtype} {tuple(t.shape)}' if isinstance(t, torch.Tensor) else type(t).__name__}")
    for kind, suffix in (("weight", ""), ("bias", "_bias"))[:2 if bias else 1]:
        gate, up, down = (torch.stack([state_dict.pop(f"{ex}{n}.{p}_proj.{kind}") for n in mine])
                          for p in ("gate", "up", "down"))          # [E, I, (H)], [E, I, (H)], [E, H, (I)]
        if m.layout == "qwen":
            fused = torch.cat([gate, up], dim=1)                    # [E, 2I, (H)]: gate rows, then up rows
        else:
            fused = torch.stack([gate, up], dim=2).flatten(1, 2)    # [E, 2I, (H)]: gate j, up j at 2j, 2j + 1
            if kind == "weight":
                fused, down = fused.transpose(1, 2), down.transpose(1, 2)    # [E, H, 2I], [E, I, H]
        state_dict[f"{ex}gate_up_proj{suffix}"], state_dict[f"{ex}down_proj{suffix}"] = fused, down



# ----------------------------------------------------------------------------- the forward
# One call: route (1 kernel) in the layer; then count, cumsum, align, gate_up, down, combine (5 kernels and a
# torch cumsum).  Rows are (token, slot) pairs sorted by expert; an expert's rows fill ceil(n_e / R) tiles.

class _Plan(NamedTuple):
    counts: torch.Tensor         # [E] int32: pairs per expert
    first_row: torch.Tensor      # [E] int32: each expert's first row
    pos: torch.Tensor            # [T k] int32: each pair's row (expert-sorted, each expert's run padded to R rows)
    sorted_pairs: torch.Tensor   # [num_tiles R] int32: the pair at each row (padding rows are never read)
    tile_expert: torch.Tensor    # [num_tiles] int32: each tile's expert (tiles past used_tiles: never read)
    tile_rows: torch.Tensor      # [num_tiles] int32: its rows in use (<= R)
    used_tiles: torch.Tensor     # [1] int32: the tiles in use
    rows_per_tile: int           # R
    num_tiles: int               # an upper bound on the tiles in use (the grids; no host sync)


def _experts_forward(x, weights, ids, w1, w2, b1, b2, layout: str, activation: str, limit: float, alpha: float,
                     invariant: bool) -> torch.Tensor:
    t, k = ids.shape
    e, i, h = _sizes(w1, layout)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    cfg = _tiles(x, t * k, e, invariant)
    plan = _plan(ids, e, cfg.rows)
    a = torch.empty(plan.num_tiles * cfg.rows, i, dtype=x.dtype, device=x.device)      # [rows, I]
    _gate_up(x, w1, b1, a, plan, layout, activation, limit, alpha, cfg)
    y = torch.empty(plan.num_tiles * cfg.rows, h, dtype=x.dtype, device=x.device)      # [rows, H]
    _down(a, _down_view(w2, layout), b2, weights, y, plan, cfg)
    _combine(y, plan.pos, out, k)
    return out


def _experts_backward(x, weights, ids, w1, w2, b1, b2, dout, layout: str, activation: str, limit: float,
                      alpha: float, invariant: bool):
    """-> (dx, dweights [T, k] fp32, dW1, dW2, db1, db2); the module docstring's a. .. c."""
    t, k = ids.shape
    e, i, h = _sizes(w1, layout)
    dw1, dw2 = torch.empty_like(w1, memory_format=torch.contiguous_format), torch.empty_like(
        w2, memory_format=torch.contiguous_format)
    db1 = None if b1 is None else torch.empty(e, 2 * i, dtype=b1.dtype, device=x.device)
    db2 = None if b2 is None else torch.empty(e, h, dtype=b2.dtype, device=x.device)
    if t == 0:
        zeros = [None if p is None else torch.zeros_like(p) for p in (dw1, dw2, db1, db2)]
        return (torch.zeros_like(x), torch.zeros_like(weights), *zeros)
    cfg = _tiles(x, t * k, e, invariant)
    plan = _plan(ids, e, cfg.rows)
    rows = plan.num_tiles * cfg.rows
    a = torch.empty(rows, i, dtype=x.dtype, device=x.device)                      # act(h), as the forward rounded it
    dh = torch.empty(rows, 2 * i, dtype=x.dtype, device=x.device)                 # d(x W1^T), W1's column order
    dscale = torch.empty(rows, triton.cdiv(i, _act_bwd_tiles(cfg)[0]), dtype=torch.float32, device=x.device)
    _act_bwd(x, dout, w1, b1, _down_view(w2, layout), b2, weights, a, dh, dscale, plan, layout, activation,
             limit, alpha, cfg)
    dx_rows = torch.empty(rows, h, dtype=x.dtype, device=x.device)
    _down(dh, _gate_up_view(w1, layout).transpose(1, 2), None, None, dx_rows, plan, cfg)    # dh W1: [rows, H]
    dx = torch.empty_like(x)
    _combine(dx_rows, plan.pos, dx, k)
    _wgrad(dh, x, None, _gate_up_view(dw1, layout), db1, plan, left_by_token=False, cfg=cfg)
    _wgrad(dout, a, weights, _down_view(dw2, layout), db2, plan, left_by_token=True, cfg=cfg)
    pos = plan.pos.long()
    dweights = torch.where(pos >= 0, dscale[pos.clamp(min=0)].sum(-1), 0).view(t, k)
    return dx, dweights, dw1, dw2, db1, db2


def _gate_up_view(w1, layout: str):
    """W1 as [E, 2I, H] in gate_up_proj's own column order (a view): row c is column c of the layout."""
    return w1 if layout == "qwen" else w1.transpose(1, 2)


def _down_view(w2, layout: str):
    """W2 as [E, H, I] (a view)."""
    return w2 if layout == "qwen" else w2.transpose(1, 2)


# ----------------------------------------------------------------------------- the router
# FLOPs ~ T E (k + 8) (k passes of max / min over the row, one exp);  bytes >= T E e (logits) + T k 12 (weights
# fp32, ids int64).  A program holds BLOCK_T whole rows: k passes each take the largest free logit (NaN counts
# as +inf: a NaN row still picks k valid experts; its weights are NaN) and the lowest index among equals.
# The chosen experts are written in index order: slot = the number of chosen experts before it.

@triton.jit
def _route_kernel(logits, weights, ids, T, E, stride_t, TOPK: tl.constexpr, OVER_CHOSEN: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    i_t = tl.program_id(0)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = tl.arange(0, BLOCK_E)
    m_t, m_e = o_t < T, o_e < E
    m_te = m_t[:, None] & m_e[None, :]
    b_l = tl.load(logits + o_t.to(tl.int64)[:, None] * stride_t + o_e[None, :], mask=m_te, other=0).to(tl.float32)
    b_nan = b_l != b_l
    b_key = tl.where(b_nan, float("inf"), b_l)
    b_free = m_e[None, :] & (o_t >= 0)[:, None]                             # [BT, BE]: not chosen yet
    for _ in tl.static_range(TOPK):
        b_best = tl.max(tl.where(b_free, b_key, float("-inf")), axis=1)
        b_first = tl.min(tl.where(b_free & (b_key == b_best[:, None]), o_e[None, :], BLOCK_E), axis=1)
        b_free = b_free & (o_e[None, :] != b_first[:, None])
    b_chosen = (o_e[None, :] < E) & ~b_free
    b_max = tl.max(tl.where(m_e[None, :], b_key, float("-inf")), axis=1)
    b_p = tl.where(m_e[None, :], tl.exp(b_l - b_max[:, None]), 0.0)
    b_den = tl.sum(tl.where(b_chosen, b_p, 0.0), axis=1) if OVER_CHOSEN else tl.sum(b_p, axis=1)
    b_w = b_p / b_den[:, None]
    b_w = tl.where(tl.sum(b_nan.to(tl.int32), axis=1)[:, None] > 0, float("nan"), b_w)
    b_slot = tl.cumsum(b_chosen.to(tl.int32), axis=1) - 1
    o_out = o_t.to(tl.int64)[:, None] * TOPK + b_slot
    tl.store(weights + o_out, b_w, mask=b_chosen & m_t[:, None])
    tl.store(ids + o_out, tl.broadcast_to(o_e[None, :].to(tl.int64), [BLOCK_T, BLOCK_E]), mask=b_chosen & m_t[:, None])


def _route(logits, top_k: int, scoring: str, norm: bool):
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        block_e = _pow2(e)
        block_t = _route_rows(block_e)
        _route_kernel[(triton.cdiv(t, block_t),)](logits, weights, ids, t, e, logits.stride(0), TOPK=top_k,
                                                  OVER_CHOSEN=scoring == "topk_softmax" or norm, BLOCK_T=block_t,
                                                  BLOCK_E=block_e)
    return weights, ids


def _route_rows(block_e: int) -> int:
    """Tokens per router program: 1024 logits in registers (2048 spill at E = 512, k = 8 on sm_90, 4 warps)."""
    return max(1, min(32, 1024 // block_e))


def _route_backward(logits, weights, ids, dweights, scoring: str, norm: bool):
    """d logits [T, E]: over the chosen (topk_softmax, or norm_topk_prob) dl_S = w (dw - sum w dw), 0 elsewhere;
    softmax over all E: dl = p ([e chosen] dw_e - sum_S w dw)."""
    wdw = weights * dweights.float()                                        # [T, k]
    if scoring == "topk_softmax" or norm:
        chosen = wdw - weights * wdw.sum(-1, keepdim=True)
        dl = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter(1, ids, chosen)
    else:
        p = torch.softmax(logits.float(), dim=-1)
        dl = (-p * wdw.sum(-1, keepdim=True)).scatter_add(1, ids, wdw)
    return dl.to(logits.dtype)


# ----------------------------------------------------------------------------- the plan: count, align
# count: a program per chunk of BLOCK_P pairs counts each expert's pairs (a [BLOCK_P, E] one-hot, summed);
# bytes P 8 + chunks E 4.  torch.cumsum over the chunks gives each chunk the pairs of every expert before it.
# align: a program per chunk gives each pair its row = (tiles of the experts before its own) R + its rank among
# its expert's pairs (those in earlier chunks, then its rank in the chunk), and writes each tile's expert and
# rows in use at the tile's first pair; program 0 writes each expert's first row and the tiles in use.
# Bytes P (8 + 4 + 4) + chunks E 8 + tiles 8.  Pairs keep token order inside an expert.  No FLOPs.

@triton.jit
def _count_kernel(ids, chunk_counts, P, E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    i_c = tl.program_id(0)
    o_p = i_c * BLOCK_P + tl.arange(0, BLOCK_P)
    o_e = tl.arange(0, BLOCK_E)
    b_e = tl.load(ids + o_p, mask=o_p < P, other=-1).to(tl.int32)
    b_hot = (b_e[:, None] == o_e[None, :]).to(tl.int32)                      # [BP, BE]
    tl.store(chunk_counts + i_c * E + o_e, tl.sum(b_hot, axis=0), mask=o_e < E)


@triton.jit
def _align_kernel(ids, prefix, pos, sorted_pairs, tile_expert, tile_rows, first_row, used_tiles, P, E,
                  ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    i_c = tl.program_id(0)
    o_p = i_c * BLOCK_P + tl.arange(0, BLOCK_P)
    o_e = tl.arange(0, BLOCK_E)
    m_p, m_e = o_p < P, o_e < E
    b_total = tl.load(prefix + (tl.num_programs(0) - 1) * E + o_e, mask=m_e, other=0)      # [BE] pairs per expert
    b_before = tl.load(prefix + tl.maximum(i_c - 1, 0) * E + o_e, mask=m_e, other=0)    # in earlier chunks
    b_before = tl.where(i_c > 0, b_before, 0)
    b_tiles = (b_total + ROWS - 1) // ROWS
    b_first = (tl.cumsum(b_tiles, axis=0) - b_tiles) * ROWS                             # [BE]
    b_e = tl.load(ids + o_p, mask=m_p, other=-1).to(tl.int32)
    b_hot = b_e[:, None] == o_e[None, :]                                                # [BP, BE]
    b_rank = tl.sum(tl.where(b_hot, b_before[None, :] + tl.cumsum(b_hot.to(tl.int32), axis=0) - 1, 0), axis=1)
    b_row = tl.sum(tl.where(b_hot, b_first[None, :], 0), axis=1) + b_rank                # [BP]
    m_ok = m_p & (b_e >= 0) & (b_e < E)           # an id outside [0, E) (unchecked: graphs, compile) gets no row
    tl.store(pos + o_p, tl.where(m_ok, b_row, -1), mask=m_p)
    tl.store(sorted_pairs + b_row, o_p, mask=m_ok)
    m_head = m_ok & (b_rank % ROWS == 0)                                                # a tile's first pair
    tl.store(tile_expert + b_row // ROWS, b_e, mask=m_head)
    b_left = tl.sum(tl.where(b_hot, b_total[None, :], 0), axis=1) - b_rank
    tl.store(tile_rows + b_row // ROWS, tl.minimum(b_left, ROWS), mask=m_head)
    if i_c == 0:
        tl.store(first_row + o_e, b_first, mask=m_e)
        tl.store(used_tiles, tl.sum(b_tiles, axis=0))


def _plan(ids, num_experts: int, rows_per_tile: int) -> _Plan:
    p, r, e = ids.numel(), rows_per_tile, num_experts
    block_e = _pow2(e)
    block_p = max(16, 8192 // block_e)
    chunks = triton.cdiv(p, block_p)
    chunk_counts = torch.empty(chunks, e, dtype=torch.int32, device=ids.device)
    _count_kernel[(chunks,)](ids, chunk_counts, p, e, BLOCK_P=block_p, BLOCK_E=block_e)
    prefix = torch.cumsum(chunk_counts, dim=0, dtype=torch.int32)                       # [chunks, E]
    num_tiles = triton.cdiv(p + min(e, p) * (r - 1), r)             # sum_e ceil(n_e / R) at most
    ints = dict(dtype=torch.int32, device=ids.device)
    pos, sorted_pairs = torch.empty(p, **ints), torch.empty(num_tiles * r, **ints)
    tile_expert, tile_rows = torch.empty(num_tiles, **ints), torch.empty(num_tiles, **ints)
    first_row, used_tiles = torch.empty(e, **ints), torch.empty(1, **ints)
    _align_kernel[(chunks,)](ids, prefix, pos, sorted_pairs, tile_expert, tile_rows, first_row, used_tiles, p, e,
                             ROWS=r, BLOCK_P=block_p, BLOCK_E=block_e)
    return _Plan(prefix[-1], first_row, pos, sorted_pairs, tile_expert, tile_rows, used_tiles, r, num_tiles)


@triton.jit
def _activation(b_g, b_u, limit, alpha, ACT: tl.constexpr):
    if ACT == 0:                                                            # SwiGLU
        return b_g / (1 + tl.exp(-b_g)) * b_u
    b_g = tl.minimum(b_g, limit, propagate_nan=tl.PropagateNan.ALL)         # gpt-oss's clamped SwiGLU
    b_u = tl.maximum(tl.minimum(b_u, limit, propagate_nan=tl.PropagateNan.ALL), -limit,
                     propagate_nan=tl.PropagateNan.ALL)
    return (b_u + 1) * (b_g / (1 + tl.exp(-alpha * b_g)))


# ----------------------------------------------------------------------------- the grouped GEMMs
# gate_up: per pair 2 H 2I FLOPs (+ ~10 I for the activation); bytes >= the touched experts' W1 (2I H e each)
# + x (T H e) + a written (T k I e).  A program: one tile (one expert, <= R rows), 2 BLOCK_N columns (gate and
# up of BLOCK_N features), K = H walked from 0.  Rows past the expert's count load zeros and are not stored.

@triton.jit
def _gate_up_kernel(x, w1, b1, a, sorted_pairs, tile_expert, tile_rows, used_tiles, FFN, H, limit, alpha, stride_xt,
                    stride_we, stride_wc, stride_wk, stride_be, stride_bc, stride_at, TOPK: tl.constexpr,
                    ROWS: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    if i_m >= tl.load(used_tiles):
        return
    e = tl.load(tile_expert + i_m).to(tl.int64)
    o_slot = tl.arange(0, BLOCK_M)
    m_row = o_slot < tl.load(tile_rows + i_m)
    o_row = i_m.to(tl.int64) * ROWS + o_slot
    b_tok = (tl.load(sorted_pairs + o_row, mask=m_row, other=0) // TOPK).to(tl.int64)
    # the 2 BLOCK_N columns of gate_up_proj: gate j and up j side by side (j = i_n BN + c // 2), at column 2j (+ 1)
    # of the interleaved layout or j (+ FFN, the expert's FFN size I) of the concatenated one
    o_c = tl.arange(0, 2 * BLOCK_N)
    col = 2 * i_n * BLOCK_N + o_c if INTERLEAVED else (o_c % 2) * FFN + i_n * BLOCK_N + o_c // 2
    m_c = i_n * BLOCK_N + o_c // 2 < FFN
    p_x = x + b_tok[:, None] * stride_xt
    p_w = w1 + e * stride_we + col[None, :].to(tl.int64) * stride_wc
    b_acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(p_x + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0)              # [BM, BK]
        b_w = tl.load(p_w + o_k[:, None].to(tl.int64) * stride_wk, mask=m_k[:, None] & m_c[None, :], other=0)
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=PRECISION)                                # [BM, 2 BN]
    if HAS_BIAS:
        b_acc += tl.load(b1 + e * stride_be + col * stride_bc, mask=m_c, other=0).to(tl.float32)[None, :]
    b_g, b_u = tl.split(tl.reshape(b_acc, [BLOCK_M, BLOCK_N, 2]))                                 # [BM, BN] each
    o_j = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(a + o_row[:, None] * stride_at + o_j[None, :], _activation(b_g, b_u, limit, alpha, ACT).to(
        a.dtype.element_ty), mask=m_row[:, None] & (o_j < FFN)[None, :])


# down (and the backward's dx = dh W1): y [rows, N] = (rows [rows, K] W_e^T + b_e) * scale[pair]; per pair
# 2 K N FLOPs; bytes >= the touched experts' W (N K e each) + rows read (T k K e) + y written (T k N e).

@triton.jit
def _down_kernel(a, w, bias, scale, y, sorted_pairs, tile_expert, tile_rows, used_tiles, N, K, stride_at, stride_we,
                 stride_wn, stride_wk, stride_be, stride_yt, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    if i_m >= tl.load(used_tiles):
        return
    e = tl.load(tile_expert + i_m).to(tl.int64)
    o_slot = tl.arange(0, BLOCK_M)
    m_row = o_slot < tl.load(tile_rows + i_m)
    o_row = i_m.to(tl.int64) * ROWS + o_slot
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_a = a + o_row[:, None] * stride_at
    p_w = w + e * stride_we + o_n[None, :].to(tl.int64) * stride_wn
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_a = tl.load(p_a + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0)               # [BM, BK]
        b_w = tl.load(p_w + o_k[:, None].to(tl.int64) * stride_wk, mask=m_k[:, None] & m_n[None, :], other=0)
        b_acc = tl.dot(b_a, b_w, b_acc, input_precision=PRECISION)
    if HAS_BIAS:
        b_acc += tl.load(bias + e * stride_be + o_n, mask=m_n, other=0).to(tl.float32)[None, :]
    if HAS_SCALE:
        b_pair = tl.load(sorted_pairs + o_row, mask=m_row, other=0)
        b_acc *= tl.load(scale + b_pair, mask=m_row, other=0)[:, None]
    tl.store(y + o_row[:, None] * stride_yt + o_n[None, :], b_acc.to(y.dtype.element_ty),
             mask=m_row[:, None] & m_n[None, :])


# combine: out[t] = sum over s < k, in order, of y[pos[t k + s]]; (k - 1) T H FLOPs; bytes T k (H e + 4) + T H e.

@triton.jit
def _combine_kernel(y, pos, out, T, H, stride_yt, stride_ot, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (o_t < T)[:, None] & (o_h < H)[None, :]
    b_acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(TOPK):                                         # slot order: expert-index order
        b_row = tl.load(pos + o_t.to(tl.int64) * TOPK + s, mask=o_t < T, other=-1).to(tl.int64)
        b_acc += tl.load(y + b_row[:, None] * stride_yt + o_h[None, :], mask=m & (b_row >= 0)[:, None],
                         other=0).to(tl.float32)
    tl.store(out + o_t.to(tl.int64)[:, None] * stride_ot + o_h[None, :], b_acc.to(out.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- the backward kernels
# The backward's math, per pair (t, s) on expert e with weight w:  y = W2 a + b2, out_t += w y, so with g = dout_t
#     u = W2^T g [I];  d a = w u;  dh = act'(h) d a [2I];  d w = g . y = a . u + g . b2
#     dx_t += W1^T dh;  dW1 += dh x^T;  db1 += dh;  dW2 += (w g) a^T;  db2 += w g
# act_bwd: per pair 2 H 2I (recomputing h) + 2 H I (u) FLOPs; bytes >= the touched W1 and W2, x and dout
# (T H e each), a and dh written (T k 3I e), the partial d w (T k 4 per column tile).

@triton.jit
def _activation_bwd(b_g, b_u, b_da, limit, alpha, ACT: tl.constexpr):
    """(d gate, d up) of _activation at (b_g, b_u) for d a = b_da; clamps pass gradient where
    lo <= v <= hi, as torch.clamp's backward."""
    if ACT == 0:
        b_s = 1 / (1 + tl.exp(-b_g))
        return b_da * b_u * b_s * (1 + b_g * (1 - b_s)), b_da * b_g * b_s
    b_gc = tl.minimum(b_g, limit, propagate_nan=tl.PropagateNan.ALL)
    b_uc = tl.maximum(tl.minimum(b_u, limit, propagate_nan=tl.PropagateNan.ALL), -limit,
                      propagate_nan=tl.PropagateNan.ALL)
    b_s = 1 / (1 + tl.exp(-alpha * b_gc))
    b_dg = b_da * (b_uc + 1) * (b_s + alpha * b_gc * b_s * (1 - b_s))
    return (tl.where(b_g <= limit, b_dg, 0.0),
            tl.where((b_u >= -limit) & (b_u <= limit), b_da * (b_gc * b_s), 0.0))


@triton.jit
def _act_bwd_kernel(x, dout, w1, b1, w2, b2, scale, a, dh, dscale, sorted_pairs, tile_expert, tile_rows, used_tiles,
                    FFN, H, limit, alpha, stride_xt, stride_gt, stride_w1e, stride_w1c, stride_w1k, stride_b1e,
                    stride_b1c, stride_w2e, stride_w2n, stride_w2k, stride_b2e, stride_at, stride_dht, stride_dst,
                    TOPK: tl.constexpr, ROWS: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS1: tl.constexpr, HAS_BIAS2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    if i_m >= tl.load(used_tiles):
        return
    e64 = tl.load(tile_expert + i_m).to(tl.int64)
    o_slot = tl.arange(0, BLOCK_M)
    m_row = o_slot < tl.load(tile_rows + i_m)
    o_row = i_m.to(tl.int64) * ROWS + o_slot
    b_pair = tl.load(sorted_pairs + o_row, mask=m_row, other=0)
    b_tok = (b_pair // TOPK).to(tl.int64)
    o_c = tl.arange(0, 2 * BLOCK_N)                                         # gate_up's columns, as in _gate_up_kernel
    col = 2 * i_n * BLOCK_N + o_c if INTERLEAVED else (o_c % 2) * FFN + i_n * BLOCK_N + o_c // 2
    m_c = i_n * BLOCK_N + o_c // 2 < FFN
    o_j = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_j = o_j < FFN
    p_w1 = w1 + e64 * stride_w1e + col[None, :].to(tl.int64) * stride_w1c                   # [1, 2 BN]
    p_w2 = w2 + e64 * stride_w2e + o_j[None, :].to(tl.int64) * stride_w2k                    # [1, BN]: W2[h, j]
    b_h = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    b_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_gb = tl.zeros([BLOCK_M], dtype=tl.float32)                            # dout . b2
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        m_rk = m_row[:, None] & m_k[None, :]
        b_x = tl.load(x + b_tok[:, None] * stride_xt + o_k[None, :], mask=m_rk, other=0)
        b_dout = tl.load(dout + b_tok[:, None] * stride_gt + o_k[None, :], mask=m_rk, other=0)
        b_w1 = tl.load(p_w1 + o_k[:, None].to(tl.int64) * stride_w1k, mask=m_k[:, None] & m_c[None, :], other=0)
        b_w2 = tl.load(p_w2 + o_k[:, None].to(tl.int64) * stride_w2n, mask=m_k[:, None] & m_j[None, :], other=0)
        b_h = tl.dot(b_x, b_w1, b_h, input_precision=PRECISION)
        b_u = tl.dot(b_dout, b_w2, b_u, input_precision=PRECISION)
    if HAS_BIAS2:
        if i_n == 0:                                                        # once per row: + dout . b2
            for k0 in range(0, H, BLOCK_K):
                o_k = k0 + tl.arange(0, BLOCK_K)
                m_k = o_k < H
                b_dout = tl.load(dout + b_tok[:, None] * stride_gt + o_k[None, :], mask=m_row[:, None] & m_k[None, :],
                                 other=0).to(tl.float32)
                b_gb += tl.sum(b_dout * tl.load(b2 + e64 * stride_b2e + o_k, mask=m_k, other=0).to(tl.float32)[None, :],
                               axis=1)
    if HAS_BIAS1:
        b_h += tl.load(b1 + e64 * stride_b1e + col * stride_b1c, mask=m_c, other=0).to(tl.float32)[None, :]
    b_g, b_up = tl.split(tl.reshape(b_h, [BLOCK_M, BLOCK_N, 2]))
    b_a = _activation(b_g, b_up, limit, alpha, ACT).to(a.dtype.element_ty)      # the forward's rounded a
    m_rj = m_row[:, None] & m_j[None, :]
    tl.store(a + o_row[:, None] * stride_at + o_j[None, :], b_a, mask=m_rj)
    b_w = tl.load(scale + b_pair, mask=m_row, other=0)
    b_dg, b_du = _activation_bwd(b_g, b_up, b_u * b_w[:, None], limit, alpha, ACT)
    b_dh = tl.reshape(tl.join(b_dg, b_du), [BLOCK_M, 2 * BLOCK_N])              # gate j, up j side by side
    tl.store(dh + o_row[:, None] * stride_dht + col[None, :], b_dh.to(dh.dtype.element_ty),
             mask=m_row[:, None] & m_c[None, :])
    b_dw = tl.sum(tl.where(m_rj, b_a.to(tl.float32) * b_u, 0.0), axis=1) + b_gb
    tl.store(dscale + o_row * stride_dst + i_n, b_dw, mask=m_row)


# wgrad: dW_e [N, K] = sum over expert e's rows r of left[r]^T right[r] (left rows scaled by the routing weight
# for dW2), and db_e = sum left[r] (the i_k == 0 programs); per pair 2 N K FLOPs; bytes >= dW written (E N K e)
# + left and right read once per (N, K) tile pair: (T k) (N K / BLOCK_K + K N / BLOCK_N) e.
# Rows run in order from the expert's first: deterministic, no atomics.

@triton.jit
def _wgrad_kernel(left, right, scale, dw, db, sorted_pairs, counts, first_row, N, K, stride_lt, stride_rt, stride_we,
                  stride_wn, stride_wk, TOPK: tl.constexpr, LEFT_BY_TOKEN: tl.constexpr, HAS_SCALE: tl.constexpr,
                  HAS_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    i_e, i_n, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(first_row + i_e)
    count = tl.load(counts + i_e)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_n, m_k = o_n < N, o_k < K
    b_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, count, BLOCK_M):
        o_r = r0 + tl.arange(0, BLOCK_M)
        m_r = o_r < count
        o_row = (first + o_r).to(tl.int64)
        b_pair = tl.load(sorted_pairs + o_row, mask=m_r, other=0)
        b_tok = (b_pair // TOPK).to(tl.int64)
        l_row = b_tok if LEFT_BY_TOKEN else o_row
        r_row = o_row if LEFT_BY_TOKEN else b_tok
        b_l = tl.load(left + l_row[:, None] * stride_lt + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0)
        if HAS_SCALE:
            b_l = (b_l.to(tl.float32) * tl.load(scale + b_pair, mask=m_r, other=0)[:, None]).to(left.dtype.element_ty)
        b_r = tl.load(right + r_row[:, None] * stride_rt + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0)
        b_acc = tl.dot(tl.trans(b_l), b_r, b_acc, input_precision=PRECISION)                     # [BN, BK]
        if HAS_DB:
            b_db += tl.sum(b_l.to(tl.float32), axis=0)
    p_dw = (dw + i_e.to(tl.int64) * stride_we + o_n[:, None].to(tl.int64) * stride_wn
            + o_k[None, :].to(tl.int64) * stride_wk)
    tl.store(p_dw, b_acc.to(dw.dtype.element_ty), mask=m_n[:, None] & m_k[None, :])
    if HAS_DB:
        if i_k == 0:
            tl.store(db + i_e.to(tl.int64) * N + o_n, b_db.to(db.dtype.element_ty), mask=m_n)


# ----------------------------------------------------------------------------- MXFP4
# out[e, 32 g + 2 b + n, r] = e2m1(nibble n of blocks[e, r, g, b]) * 2^(scales[e, r, g] - 127): exact in fp32
# (values carry 2 significant bits; 6 * 2^127 overflows to inf as ref's), one rounding to dtype.  Bytes: blocks
# and scales read once (R G 17 per expert), out written (32 R G dtype bytes per expert); no FLOPs to speak of.

@triton.jit
def _mxfp4_kernel(blocks, scales, out, R, G, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    i_e, i_r, i_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_g = i_g * BLOCK_G + tl.arange(0, BLOCK_G)
    o_b = tl.arange(0, 16)
    m_rg = (o_r < R)[:, None] & (o_g < G)[None, :]
    o_rg = (i_e.to(tl.int64) * R + o_r[:, None]) * G + o_g[None, :]                          # [BR, BG]
    b_bytes = tl.load(blocks + o_rg[:, :, None] * 16 + o_b[None, None, :], mask=m_rg[:, :, None], other=0)
    b_codes = tl.reshape(tl.join(b_bytes & 15, b_bytes >> 4), [BLOCK_R, BLOCK_G * 32])      # low nibble first
    b_exp = (b_codes >> 1) & 3
    b_man = (b_codes & 1).to(tl.float32)
    b_mag = tl.where(b_exp == 0, 0.5 * b_man,
                     (1 + 0.5 * b_man) * tl.where(b_exp == 3, 4.0, tl.where(b_exp == 2, 2.0, 1.0)))
    b_val = tl.where((b_codes & 8) != 0, -b_mag, b_mag)
    b_s = tl.load(scales + o_rg, mask=m_rg, other=127).to(tl.int32)
    b_pow = tl.where(b_s == 0, 2.0 ** -127, (b_s << 23).to(tl.float32, bitcast=True))      # 2^(s - 127)
    b_pow = tl.reshape(tl.broadcast_to(b_pow[:, :, None], [BLOCK_R, BLOCK_G, 32]), [BLOCK_R, BLOCK_G * 32])
    o_c = i_g * BLOCK_G * 32 + tl.arange(0, BLOCK_G * 32)
    p_out = out + i_e.to(tl.int64) * (32 * G) * R + o_c[None, :].to(tl.int64) * R + o_r[:, None]
    tl.store(p_out, (b_val * b_pow).to(out.dtype.element_ty), mask=(o_r < R)[:, None] & (o_c < 32 * G)[None, :])


# ----------------------------------------------------------------------------- tiles and launchers
# One config per (GPU family, element size): BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages.  The gate_up
# tile reads 2 BLOCK_N weight columns (gate and up).  16-bit: tensor cores (wgmma on sm_90 needs 64 rows,
# so 16-row decode tiles run mma.sync there too); fp32: IEEE dots on the FMA units (no silent tf32).
# Default mode: 16-row tiles when the average expert hit gets at most 16 pairs (decode), else the prefill tile:
# 128 x 128 x 64 on sm_90 (vLLM's prefill default: each expert's W1 and W2 read by half as many row tiles as
# at 64 rows, and the down GEMM's input by half as many column tiles), 64 x 64 x 64 on sm_80.  The
# batch-invariant mode: one shape whatever the batch, the prefill tile (rows filling it on a GPU; one row a
# tile in the interpreter).
_TILES = {   # (family, element size, few rows per expert)
    (90, 2, True): (16, 64, 128, 4, 3), (90, 2, False): (128, 128, 64, 8, 3),
    (80, 2, True): (16, 64, 128, 4, 3), (80, 2, False): (64, 64, 64, 4, 3),
    (90, 4, True): (16, 32, 32, 4, 2), (90, 4, False): (32, 32, 32, 4, 2),
    (80, 4, True): (16, 32, 32, 4, 2), (80, 4, False): (32, 32, 32, 4, 2),
}
_INVARIANT_TILES = {(90, 2): (128, 128, 64, 8, 3), (80, 2): (64, 64, 64, 4, 3), (90, 4): (32, 32, 32, 4, 2),
                    (80, 4): (32, 32, 32, 4, 2)}
_WGRAD_TILES = {2: (32, 64, 64, 4, 3), 4: (32, 32, 32, 4, 2)}     # element size: rows per step, BN, BK, warps, stages


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    rows: int                    # R: rows per tile (BLOCK_M, or 1 in the interpreter's invariant mode)
    precision: str


def _family(device) -> int:
    """80 (A100 and older: mma.sync) or 90 (H100 and newer: wgmma); 90 under the interpreter (the sm_90 tiles)."""
    if torch.device(device).type != "cuda":
        return 90
    return 90 if torch.cuda.get_device_capability(device)[0] >= 9 else 80


def _rows_per_tile(device, block_m: int, invariant: bool) -> int:
    """A GPU's MMA rounds every row of a tile alike: rows fill tiles.  The interpreter's dot is a BLAS call whose
    micro-kernels round a tile's slots differently, so there the invariant mode gives each row its own tile."""
    return 1 if invariant and torch.device(device).type != "cuda" else block_m


def _tiles(x, pairs: int, num_experts: int, invariant: bool) -> _Config:
    elt = 4 if x.dtype == torch.float32 else 2
    if invariant:
        bm, bn, bk, warps, stages = _INVARIANT_TILES[(_family(x.device), elt)]
    else:
        bm, bn, bk, warps, stages = _TILES[(_family(x.device), elt, pairs <= 16 * min(num_experts, pairs))]
    return _Config(bm, bn, bk, warps, stages, _rows_per_tile(x.device, bm, invariant), _prec(x.dtype))


def _gate_up(x, w1, b1, a, plan: _Plan, layout: str, activation: str, limit: float, alpha: float, cfg: _Config):
    _, i, h = _sizes(w1, layout)
    v1 = _gate_up_view(w1, layout)                                          # [E, 2I (layout's order), H]
    grid = (plan.num_tiles, triton.cdiv(i, cfg.block_n))
    _gate_up_kernel[grid](x, w1, _or(b1, w1), a, *_tile_args(plan), i, h, limit, alpha, x.stride(0), *v1.stride(),
                          *_strides(b1), a.stride(0), TOPK=plan.pos.numel() // x.shape[0], ROWS=plan.rows_per_tile,
                          INTERLEAVED=layout == "gpt_oss", ACT=ACTIVATIONS.index(activation), HAS_BIAS=b1 is not None,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=cfg.precision,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _down(rows, w, bias, scale, y, plan: _Plan, cfg: _Config):
    """y [rows, N] = (rows [rows, K] W_e^T + b_e) * scale; w [E, N, K] (any strides)."""
    _, n, k = w.shape
    grid = (plan.num_tiles, triton.cdiv(n, cfg.block_n))
    _down_kernel[grid](rows, w, _or(bias, w), _or(scale, w), y, *_tile_args(plan), n, k, rows.stride(0), *w.stride(),
                       _strides(bias)[0], y.stride(0), ROWS=plan.rows_per_tile, HAS_BIAS=bias is not None,
                       HAS_SCALE=scale is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       PRECISION=cfg.precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _combine(y, pos, out, top_k: int):
    t, h = out.shape
    grid = (triton.cdiv(t, 16), triton.cdiv(h, 128))
    _combine_kernel[grid](y, pos, out, t, h, y.stride(0), out.stride(0), TOPK=top_k, BLOCK_T=16, BLOCK_H=128)


def _act_bwd(x, dout, w1, b1, w2, b2, scale, a, dh, dscale, plan: _Plan, layout: str, activation: str, limit: float,
             alpha: float, cfg: _Config):
    _, i, h = _sizes(w1, layout)
    v1 = _gate_up_view(w1, layout)
    block_n, warps = _act_bwd_tiles(cfg)
    grid = (plan.num_tiles, triton.cdiv(i, block_n))
    _act_bwd_kernel[grid](x, dout, w1, _or(b1, w1), w2, _or(b2, w2), scale, a, dh, dscale, *_tile_args(plan), i, h,
                          limit, alpha, x.stride(0), dout.stride(0), *v1.stride(), *_strides(b1), *w2.stride(),
                          _strides(b2)[0], a.stride(0), dh.stride(0), dscale.stride(0),
                          TOPK=plan.pos.numel() // x.shape[0], ROWS=plan.rows_per_tile,
                          INTERLEAVED=layout == "gpt_oss", ACT=ACTIVATIONS.index(activation),
                          HAS_BIAS1=b1 is not None, HAS_BIAS2=b2 is not None, BLOCK_M=cfg.block_m,
                          BLOCK_N=block_n, BLOCK_K=cfg.block_k, PRECISION=cfg.precision, num_warps=warps,
                          num_stages=cfg.num_stages)


def _act_bwd_tiles(cfg: _Config) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of act_bwd: it holds two accumulators ([BM, 2 BN] and [BM, BN]) and a longer
    epilogue, so big tiles take 8 warps, half the forward's columns and at most 4096 / BM of them: 32 for
    64 x 64 tiles (64 spill on sm_80) and for 128 x 128 ones (64 spill on sm_90)."""
    if cfg.block_m * cfg.block_n < 4096:
        return cfg.block_n, cfg.num_warps
    return min(cfg.block_n // 2, 4096 // cfg.block_m), 8


def _wgrad(left, right, scale, dw, db, plan: _Plan, *, left_by_token: bool, cfg: _Config):
    """dw [E, N, K] (a view of the gradient, any strides) = sum over each expert's rows of left^T right."""
    e, n, k = dw.shape
    bm, bn, bk, warps, stages = _WGRAD_TILES[4 if left.dtype == torch.float32 else 2]
    grid = (e, triton.cdiv(n, bn), triton.cdiv(k, bk))
    _wgrad_kernel[grid](left, right, _or(scale, left), dw, _or(db, dw), plan.sorted_pairs, plan.counts,
                        plan.first_row, n, k, left.stride(0), right.stride(0), *dw.stride(),
                        TOPK=plan.pos.numel() // (left.shape[0] if left_by_token else right.shape[0]),
                        LEFT_BY_TOKEN=left_by_token, HAS_SCALE=scale is not None, HAS_DB=db is not None,
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=cfg.precision, num_warps=warps,
                        num_stages=stages)


# ----------------------------------------------------------------------------- helpers and input checks

def _sizes(w1, layout: str) -> tuple[int, int, int]:
    """(E, I, H) from gate_up_proj."""
    e, a, b = w1.shape
    return (e, a // 2, b) if layout == "qwen" else (e, b // 2, a)


def _tile_args(plan: _Plan) -> tuple:
    return plan.sorted_pairs, plan.tile_expert, plan.tile_rows, plan.used_tiles


def _strides(t) -> tuple[int, int]:
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def _or(t, default):
    return default if t is None else t


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(x))


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # tf32 is moot for 16-bit operands


def _kernels_compiled() -> bool:
    """True when this file's kernels were built for a GPU, False under Triton's interpreter."""
    return isinstance(_route_kernel, triton.runtime.JITFunction)


def _capturing(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_runnable(x: torch.Tensor):
    """Kernels built for a GPU need CUDA tensors: say so on the host, before Triton looks for a driver."""
    if x.device.type != "cuda" and _kernels_compiled():
        raise ValueError(f"fast/moe.py runs Triton kernels on CUDA tensors, got tensors on {x.device}.  Ways out: "
                         f"move the tensors to a CUDA device; or set TRITON_INTERPRET=1 before triton is imported (the "
                         f"interpreter, on CPU tensors: for tests); or use ref/moe.py, the PyTorch reference")


def _check_dtype(name: str, t: torch.Tensor):
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be fp16, bf16 or fp32 for the kernels, got {t.dtype} (ref/moe.py takes fp64)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_sizes(**sizes) -> None:
    for name, v in sizes.items():
        low = 0 if name == "shared_intermediate_size" else 1
        if not _is_int(v) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if sizes["num_experts"] > MAX_EXPERTS:
        raise ValueError(f"num_experts must be <= {MAX_EXPERTS}, got {sizes['num_experts']}")
    if sizes["top_k"] > sizes["num_experts"]:
        raise ValueError(f"top_k={sizes['top_k']} must be <= num_experts={sizes['num_experts']}")


def _sigmoid(x, invariant: bool):
    return 1 / (1 + torch.exp(-x.clamp(min=-80))) if invariant else torch.sigmoid(x)


def _silu(x, invariant: bool):
    return x * _sigmoid(x, True) if invariant else F.silu(x)


# (the same checks and messages as ref/moe.py's; each file stands alone)

def _check_options(*, scoring=None, layout, activation, swiglu_limit, swiglu_alpha, norm_topk_prob=True,
                   router_bias=False, expert_bias=False, batch_invariant=False) -> None:
    for name, v, allowed in (("scoring", scoring, SCORINGS), ("layout", layout, LAYOUTS),
                             ("activation", activation, ACTIVATIONS)):
        if v not in allowed and not (name == "scoring" and v is None):
            raise ValueError(f"{name} must be one of {allowed}, got {v!r}")
    for name, v in (("norm_topk_prob", norm_topk_prob), ("router_bias", router_bias), ("expert_bias", expert_bias),
                    ("batch_invariant", batch_invariant)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
    for name, v in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and v < float("inf")):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _check_route(logits, top_k, scoring, norm_topk_prob) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise TypeError(f"logits must be a float tensor [T, E], got "
                        f"{f'{logits.dtype} {tuple(logits.shape)}' if isinstance(logits, torch.Tensor) else logits!r}")
    e = logits.shape[1]
    if not _is_int(top_k) or not 1 <= top_k <= e or e > MAX_EXPERTS:
        raise ValueError(f"top_k must be an int in [1, E={e}] (E <= {MAX_EXPERTS}), got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not isinstance(norm_topk_prob, bool):
        raise TypeError(f"norm_topk_prob must be a bool, got {type(norm_topk_prob).__name__}")


def _expert_shapes(layout: str, e: int, h: int, i: int) -> dict:
    """The expert tensors' shapes in ``layout``."""
    if layout == "qwen":
        return dict(gate_up_proj=(e, 2 * i, h), down_proj=(e, h, i), gate_up_bias=(e, 2 * i), down_bias=(e, h))
    return dict(gate_up_proj=(e, h, 2 * i), down_proj=(e, i, h), gate_up_bias=(e, 2 * i), down_bias=(e, h))


def _check_experts(x, weights, ids, gate_up_proj, down_proj, gate_up_bias, down_bias, *, layout, activation,
                   swiglu_limit, swiglu_alpha, batch_invariant, check_ids=True) -> tuple[int, int, int]:
    """The experts' inputs, or a clear error; returns (E, I, H)."""
    _check_options(layout=layout, activation=activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                   batch_invariant=batch_invariant)
    tensors = dict(x=x, weights=weights, ids=ids, gate_up_proj=gate_up_proj, down_proj=down_proj,
                   gate_up_bias=gate_up_bias, down_bias=down_bias)
    for name, t in tensors.items():
        if t is None and name.endswith("bias"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if (name == "ids") == t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be {'an integer' if name == 'ids' else 'a float'} tensor, got {t.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be 3-D ({'[E, 2I, H]' if layout == 'qwen' else '[E, H, 2I]'}), got "
                         f"{tuple(gate_up_proj.shape)}")
    e, two_i = gate_up_proj.shape[0], gate_up_proj.shape[1 if layout == "qwen" else 2]
    if two_i % 2 or two_i == 0:
        raise ValueError(f"gate_up_proj's gate | up dim must be 2I > 0, got {two_i}")
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be [T, k] with k >= 1, got {tuple(ids.shape)}")
    t, h, i, k = x.shape[0], x.shape[1], two_i // 2, ids.shape[1]
    shapes = dict(_expert_shapes(layout, e, h, i), x=(t, h), weights=(t, k), ids=(t, k))
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name} must be {shapes[name]} (layout {layout!r}, x {tuple(x.shape)}, E={e}, I={i}), "
                             f"got {tuple(tensor.shape)}")
    if gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        raise TypeError(f"gate_up_proj and down_proj must have x's dtype {x.dtype}, got {gate_up_proj.dtype} and "
                        f"{down_proj.dtype}")
    if len({tt.device for tt in tensors.values() if tt is not None}) > 1:
        raise ValueError(f"mixed devices: {sorted({str(tt.device) for tt in tensors.values() if tt is not None})}")
    if e > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, got E={e}")
    if check_ids and ids.numel():
        low, high = (int(v) for v in ids.aminmax())                # one small reduction, one host sync
        if low < 0 or high >= e:
            raise ValueError(f"ids must lie in [0, E={e}), got values in [{low}, {high}]")
    return e, i, h


def _check_mxfp4(blocks, scales, dtype) -> None:
    for name, t in (("blocks", blocks), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise TypeError(f"{name} must be a uint8 tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a float torch.dtype, got {dtype!r}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16:
        raise ValueError(f"blocks must be [E, R, G, 16] (16 bytes = 32 e2m1 values per scale), got "
                         f"{tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"scales must be [E, R, G] = {tuple(blocks.shape[:-1])} (one per 16 bytes of blocks), "
                         f"got {tuple(scales.shape)}")
    if blocks.device != scales.device:
        raise ValueError(f"blocks on {blocks.device} and scales on {scales.device}: mixed devices")
    if scales.numel() and bool((scales == 0xFF).any()):
        raise ValueError("scales holds 0xFF, E8M0's NaN code: not a valid MXFP4 tensor")


# ----------------------------------------------------------------------------- custom ops
# The forward ops save their inputs; the experts' backward recomputes the plan and the activations.

def _no_double_backward(ctx, *grads):
    raise NotImplementedError("fast moe: gradients of the gradients (double backward) are not supported; "
                              "use ref/moe.py")


def _no_context(ctx, inputs, output):
    pass


@torch.library.custom_op("twofold::moe_route", mutates_args=())
def _route_op(logits: torch.Tensor, top_k: int, scoring: str,
              norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _route(logits, top_k, scoring, norm_topk_prob)


@_route_op.register_fake
def _(logits, top_k, scoring, norm_topk_prob):
    t = logits.shape[0]
    return logits.new_empty(t, top_k, dtype=torch.float32), logits.new_empty(t, top_k, dtype=torch.int64)


def _route_setup(ctx, inputs, output):
    logits, _, ctx.scoring, ctx.norm = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, *output)


def _route_backward_fn(ctx, dweights, _dids):
    logits, weights, ids = ctx.saved_tensors
    if dweights is None:
        return None, None, None, None
    return _route_backward(logits, weights, ids, dweights, ctx.scoring, ctx.norm), None, None, None


@torch.library.custom_op("twofold::moe_experts_fwd", mutates_args=())
def _experts_op(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                layout: str, activation: str, swiglu_limit: float, swiglu_alpha: float,
                batch_invariant: bool) -> torch.Tensor:
    return _experts_forward(x, weights, ids, gate_up_proj, down_proj, gate_up_bias, down_bias, layout, activation,
                            swiglu_limit, swiglu_alpha, batch_invariant)


@_experts_op.register_fake
def _(x, weights, ids, gate_up_proj, down_proj, gate_up_bias, down_bias, layout, activation, swiglu_limit,
      swiglu_alpha, batch_invariant):
    return torch.empty_like(x)


@torch.library.custom_op("twofold::moe_experts_bwd", mutates_args=())
def _experts_bwd_op(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                    dout: torch.Tensor, layout: str, activation: str, swiglu_limit: float, swiglu_alpha: float,
                    batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, torch.Tensor]:
    """-> (dx, dweights, d gate_up_proj, d down_proj, d gate_up_bias, d down_bias; empty for absent biases)."""
    grads = _experts_backward(x, weights, ids, gate_up_proj, down_proj, gate_up_bias, down_bias, dout.contiguous(),
                              layout, activation, swiglu_limit, swiglu_alpha, batch_invariant)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@_experts_bwd_op.register_fake
def _(x, weights, ids, gate_up_proj, down_proj, gate_up_bias, down_bias, dout, layout, activation, swiglu_limit,
      swiglu_alpha, batch_invariant):
    def like(t):
        return x.new_empty(0) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
    return tuple(like(t) for t in (x, weights, gate_up_proj, down_proj, gate_up_bias, down_bias))


def _experts_setup(ctx, inputs, output):
    x, weights, ids, w1, w2, b1, b2, *options = inputs
    ctx.options = options
    ctx.save_for_backward(x, weights, ids, w1, w2, b1, b2)


def _experts_backward_fn(ctx, dout):
    x, weights, ids, w1, w2, b1, b2 = ctx.saved_tensors
    dx, dweights, dw1, dw2, db1, db2 = _experts_bwd_op(x, weights, ids, w1, w2, b1, b2, dout, *ctx.options)
    return (dx, dweights, None, dw1, dw2, None if b1 is None else db1, None if b2 is None else db2) + (None,) * 5


_route_op.register_autograd(_route_backward_fn, setup_context=_route_setup)
_experts_op.register_autograd(_experts_backward_fn, setup_context=_experts_setup)
_experts_bwd_op.register_autograd(_no_double_backward, setup_context=_no_context)
