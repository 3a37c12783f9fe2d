"""Mixture-of-Experts: the reference (readable PyTorch, the specification).

Example (runs as written next to this file)::

    # moe.py, copied next to this script
    import torch
    from moe import MoE

    torch.manual_seed(0)
    layer = MoE(64, num_experts=8, top_k=2, intermediate_size=32, shared_intermediate_size=48)   # Qwen3.5-MoE
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)                          # (the experts are created empty, as a checkpoint fills them)
    x = torch.randn(5, 64)
    print(layer(x).shape)                              # [5, 64]: each token through its 2 best of 8 experts

What it computes
    The sparse MoE block of Qwen3-MoE, Qwen3.5-MoE and gpt-oss: a router scores each token against E
    experts, the token goes to its k best, each expert is a gated MLP, and the token's output is the
    routing-weighted sum of its k experts' outputs, plus (Qwen3.5-MoE) a shared expert that every token
    passes through, scaled by a sigmoid gate.  Also gpt-oss's MXFP4 expert tensors, dequantized.

The math (one token x [H]; E experts of FFN size I; k = top_k)
    logits   l = W_r x (+ b_r)                                               [E]
    choose   S = the k largest logits; a tie goes to the lower expert index (selection on the logits,
             so softmax's rounding cannot create ties the logits do not have)
    weights  "softmax_topk" (Qwen3-MoE, Qwen3.5-MoE): p = softmax(l) over all E, w_e = p_e (e in S);
                 with norm_topk_prob, w_e = p_e / sum_S p (Qwen3-MoE's flag; Qwen3.5-MoE always)
             "topk_softmax" (gpt-oss): w = softmax(l_S) over the k chosen logits
             (softmax_topk with norm_topk_prob is the same function: p_e / sum_S p = exp l_e / sum_S exp l)
    expert   [g; u] = W1_e x (+ b1_e),   g, u [I]
             "silu":     a = silu(g) * u
             "gpt_oss":  g = min(g, limit), u = clamp(u, -limit, limit), a = (u + 1) * g * sigmoid(alpha g)
             y_e = W2_e a (+ b2_e)                                             [H]
    combine  out = sum over e in S, in expert-index order, of w_e y_e
             + sigmoid(w_sg . x) * W2s (silu(W1s_g x) * W1s_u x)               (the shared expert, optional)
    Gradients reach x, every weight and bias, and the router: d w flows to d l through the scoring
    function (only the chosen logits get a gradient where the softmax runs over S alone).

Tensors (T tokens, H hidden, E experts, I expert FFN size, k = top_k)
    x               [T, H]            fp16 / bf16 / fp32 / fp64   the layer also takes [..., H]
    logits          [T, E]            float
    weights, ids    [T, k]            fp32 (fp64 for fp64 logits), int64     each row in expert-index order
    gate_up_proj    "qwen"     [E, 2I, H]   rows 0..I-1 gate, I..2I-1 up (concatenated)   x's dtype
                    "gpt_oss"  [E, H, 2I]   column 2j gate j, column 2j + 1 up j (interleaved)
    down_proj       "qwen" [E, H, I],  "gpt_oss" [E, I, H]                              x's dtype
    gate_up_bias    [E, 2I] in gate_up_proj's column order;  down_bias [E, H]           any float
    blocks, scales  [E, R, G, 16], [E, R, G] uint8: MXFP4, two e2m1 values a byte (low nibble first),
                    one E8M0 exponent 2^(s - 127) per 32 values; dequantized to [E, 32 G, R] (the
                    in-memory layout: a checkpoint's gate_up_proj_blocks [E, 2I, H/32, 16] -> [E, H, 2I])

The layer and its parameters (transformers 5's in-memory names: a trainer's state dict loads as is)
    ``MoE(hidden_size, **sizes)``; its keywords from each family's config:
    Qwen3-MoE    num_experts, top_k=num_experts_per_tok, intermediate_size=moe_intermediate_size,
                 norm_topk_prob                 gate.weight [E, H]; experts.gate_up_proj, experts.down_proj
    Qwen3.5-MoE  as Qwen3-MoE, norm_topk_prob=True, shared_intermediate_size=shared_expert_intermediate_size
                 + shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight [1, H]
    gpt-oss      num_experts=num_local_experts, top_k=num_experts_per_tok, intermediate_size,
                 scoring="topk_softmax", router_bias=True, expert_bias=True, activation="gpt_oss",
                 swiglu_limit, swiglu_alpha, layout="gpt_oss"
                 router.weight [E, H], router.bias [E]; experts.gate_up_proj, gate_up_proj_bias,
                 down_proj, down_proj_bias
    It also loads checkpoints' per-expert tensors (experts.{i}.{gate,up,down}_proj.weight, as transformers'
    qwen2_moe conversion merges them) and gpt-oss's experts.{gate_up,down}_proj_{blocks,scales}.

Expert parallelism (``MoE(..., expert_group=group)``; decoder_lm.py passes its tensor-parallel group)
    N ranks, E / N whole experts each (rank r: experts r E / N .. (r + 1) E / N - 1, under the same names; a
    whole layer's state dict, fused or per-expert, loads with the other ranks' experts dropped).  The input
    x [T, H] is the same on every rank (tensor parallelism's replicated activations), so:
        1. rank r takes tokens [r T / N, (r + 1) T / N) (the first T mod N ranks one more), routes them
           (the router is replicated) and sorts its (token, slot) pairs by the rank holding their expert
        2. dispatch   all-to-all of the pairs' rows of x, their weights and local expert ids (the counts
                      first: an all-to-all of N integers, read on the host to size the buffers)
        3. experts    ``experts_fn`` over the pairs received, each a one-slot token of a local expert
        4. return     all-to-all back; each token's k rows summed in slot order (expert-index order), in
                      fp32 (fp64 for fp64), as ``experts_fn``'s combine sums them; the shared expert added
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
    Any T (0 too), E <= 1024 and top_k <= E, both layouts with either activation, biases optional.
    ``route_fn`` / ``experts_fn`` are the kernel plug-ins (this file's functions by default; fast/moe.py's
    drop in).  ``set_batch_invariant(linear)``: a token's output bit for bit the same whichever tokens
    share the call.  ``upcast`` (functions only): True computes in fp32 (fp64 for fp64), False in the
    input dtype (the tolerance rule's low-precision baseline).  Bad shapes, dtypes, sizes and options
    raise ValueError / TypeError naming the argument; MXFP4 input is checked as untrusted (shapes, byte
    counts, the E8M0 NaN code 0xFF).

References
    transformers 5: Qwen3MoeSparseMoeBlock, Qwen3_5MoeSparseMoeBlock, GptOssMLP (modeling files), the
    qwen2_moe weight conversion (conversion_mapping.py), convert_moe_packed_tensors (integrations/mxfp4.py);
    OCP Microscaling Formats (MX) v1.0; vLLM fused_moe (moe_align_block_size).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["route", "moe_experts", "dequantize_mxfp4", "MoE"]

SCORINGS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("silu", "gpt_oss")
LAYOUTS = ("qwen", "gpt_oss")
MAX_EXPERTS = 1024
# e2m1 (FP4) codes 0..15: sign bit 3, two exponent bits, one mantissa bit (OCP MX v1.0, table 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ----------------------------------------------------------------------------- the math

def route(logits, top_k, *, scoring="softmax_topk", norm_topk_prob=True, upcast=True):
    """logits [T, E] -> (weights [T, k], ids [T, k] int64), each row in expert-index order."""
    _check_route(logits, top_k, scoring, norm_topk_prob)
    lf = logits.to(_wide(logits.dtype) if upcast else logits.dtype)
    # the k largest logits; a stable sort keeps equal logits in index order: the lower index wins a tie
    ids = torch.sort(lf, dim=-1, descending=True, stable=True).indices[:, :top_k]         # [T, k]
    if scoring == "softmax_topk":
        w = torch.softmax(lf, dim=-1).gather(-1, ids)
        if norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    else:
        w = torch.softmax(lf.gather(-1, ids), dim=-1)
    ids, order = ids.sort(dim=-1)                           # expert-index order: the combine's order
    return w.gather(-1, order), ids


def moe_experts(x, weights, ids, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None, *, layout="qwen",
                activation="silu", swiglu_limit=7.0, swiglu_alpha=1.702, batch_invariant=False, upcast=True):
    """sum_s weights[t, s] * expert_{ids[t, s]}(x[t]) -> [T, H] in x's dtype (the module docstring's math).
    ``batch_invariant``: every product one row at a time (the same BLAS call for each row, whatever T) and
    the activations composed from exp, so a token's result does not depend on the other tokens."""
    _check_experts(x, weights, ids, gate_up_proj, down_proj, gate_up_bias, down_bias, layout=layout,
                   activation=activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                   batch_invariant=batch_invariant)
    wide = _wide(x.dtype) if upcast else x.dtype
    t, k = ids.shape
    y = x.new_zeros(t, k, x.shape[1], dtype=wide)                     # [T, k, H]: each pair's weighted output
    for e in ids.unique().tolist():                                 # a loop over the experts hit, as HF's
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w1, w2, b1, b2 = (None if p is None else p.to(wide)
                          for p in _expert(e, gate_up_proj, down_proj, gate_up_bias, down_bias, layout))
        h = _linear(x[tok].to(wide), w1, b1, batch_invariant)       # [n, 2I]: gate | up
        a = _activation(h, activation, swiglu_limit, swiglu_alpha, batch_invariant)   # [n, I]
        y[tok, slot] = _linear(a, w2, b2, batch_invariant) * weights[tok, slot, None].to(wide)
    out = y[:, 0]
    for s in range(1, k):                                           # fixed order: ids ascend along a row
        out = out + y[:, s]
    return out.to(x.dtype)


def _expert(e: int, gate_up_proj, down_proj, gate_up_bias, down_bias, layout: str):
    """Expert e's tensors as the math writes them: W1 [2I, H] (gate rows, then up rows), W2 [H, I], b1 [2I], b2 [H]."""
    if layout == "qwen":
        w1, w2, b1 = gate_up_proj[e], down_proj[e], None if gate_up_bias is None else gate_up_bias[e]
    else:                                   # gpt-oss: [H, 2I] with gate j in column 2j and up j in 2j + 1
        w1 = torch.cat([gate_up_proj[e, :, 0::2], gate_up_proj[e, :, 1::2]], dim=1).t()
        w2 = down_proj[e].t()
        b1 = None if gate_up_bias is None else torch.cat([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]])
    return w1, w2, b1, None if down_bias is None else down_bias[e]


def _activation(h, activation: str, limit: float, alpha: float, invariant: bool):
    g, u = h.chunk(2, dim=-1)
    if activation == "silu":
        return _silu(g, invariant) * u
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)      # gpt-oss's clamped SwiGLU
    return (u + 1) * (g * _sigmoid(alpha * g, invariant))


def _linear(x, weight, bias, invariant: bool):
    """x W^T (+ b); invariant: one [1, K] x [K, N] product per row (a batched matmul: the same BLAS call,
    the row at slot 0, whatever the row count), the bias added after."""
    if not invariant:
        return F.linear(x, weight, bias)
    y = torch.bmm(x[:, None, :], weight.t().expand(x.shape[0], -1, -1))[:, 0]
    return y if bias is None else y + bias


# Batch-invariant mode's activations: composed from exp, because torch's CPU kernels for silu and sigmoid
# round the elements of a vector loop's tail (a position that depends on the tensor's size) through
# another formula; exp's argument is clamped so that neither a value nor a gradient overflows.

def _sigmoid(x, invariant: bool):
    return 1 / (1 + torch.exp(-x.clamp(min=-80))) if invariant else torch.sigmoid(x)


def _silu(x, invariant: bool):
    return x * _sigmoid(x, True) if invariant else F.silu(x)


def dequantize_mxfp4(blocks, scales, *, dtype=torch.bfloat16):
    """gpt-oss MXFP4 expert tensors -> float: blocks [E, R, G, 16] uint8 (two e2m1 codes a byte, low
    nibble first), scales [E, R, G] uint8 (E8M0) -> [E, 32 G, R] in ``dtype``, value * 2^(scale - 127),
    the last two dims swapped as transformers' convert_moe_packed_tensors swaps them (the checkpoint's
    [E, 2I, H / 32, 16] gate_up_proj_blocks become the in-memory [E, H, 2I])."""
    _check_mxfp4(blocks, scales, dtype)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]          # [E, R, G, 16] each
    values = torch.stack([low, high], dim=-1).flatten(-2)                       # [E, R, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)      # exact in fp32 (or inf)
    return values.flatten(-2).transpose(1, 2).to(dtype).contiguous()            # [E, 32 G, R]


# ----------------------------------------------------------------------------- the layer

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


# ----------------------------------------------------------------------------- input checks

def _wide(dtype):
    return torch.promote_types(dtype, torch.float32)


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
