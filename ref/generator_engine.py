"""Generator engine: the reference (readable PyTorch, the specification for tokens and logprobs).

What it computes
    ``DecoderLM`` is a small decoder-only language model (Llama / Qwen blocks, optionally hybrid
    with "linear" layers such as Gated DeltaNet); ``Generator`` samples from it, one request at a
    time, the way gpt-fast's ``generate`` does: a prefill pass over the prompt fills a contiguous
    KV cache, then one forward pass per new token.  A ``Generator`` has the four members a router
    needs (``routed_generator.py``'s ``GeneratorProtocol``: name, policy_version, submit ->
    Future[Completion], load_weights), so it sits behind a ``GeneratorRouter`` as it is; neither
    file imports the other.

The model (pre-norm, no biases; x_0 = embed[token])
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
    T > 0           logp = log_softmax(logits * fp32(1 / T)), p = exp(logp).  With top_k / top_p:
                    sort p descending (stable), keep the first top_k and the prefix whose mass
                    before each token is < top_p, zero the rest.  cdf = cumsum(p) in fp64 (sorted
                    order when filtered, vocabulary order when not); u = one uniform draw from the
                    request's own ``torch.Generator`` (seeded with ``seed``; a random seed when
                    None); token = the first index with cdf > u * cdf[-1].
                    logprob = logp[token]: the temperature-scaled model distribution before
                    top-k / top-p truncation, what a trainer recomputes from the same weights.
    stop            after a token in stop_token_ids (it is kept, finish "stop"), after
                    max_new_tokens tokens, or when prompt + output reach max_seq_len (finish
                    "length").  Same seed, same weights: same tokens.

The engine (Generator)
    One worker thread takes requests in submission order and runs each to completion (prefill,
    then decode steps) on its own cache: K and V [capacity, H_kv, D] per attention layer and
    the linear layers' own caches.  ``submit`` only enqueues.  ``load_weights`` validates the
    whole state dict first (a missing, unexpected or mis-shaped tensor rejects it whole: weights
    and version stay), then the worker copies it in between two requests, so a completion never
    spans two versions here (min_policy_version == max_policy_version).

Groups and the prefix cache (the semantics the fast engine implements with its block allocator)
    group         ``SamplingParams(n=k)``: k samples of one prompt (GRPO's group); the future resolves
                  to k completions (``sample_index`` 0 .. k-1); sample i draws from seed + i, so it is
                  exactly the request alone with ``seed + i`` and n = 1.
    prefix cache  every full page of ``page_size`` tokens a request computes (prompt or generated) is
                  kept, keyed by the chain (parent page's id, its token ids, the weights' version), with
                  its K/V and, for "linear" layers, a checkpoint: their state after its last token.  A
                  later request restores the longest cached run of its prompt's full pages (ending on a
                  page with a checkpoint when the model has linear layers; never its last token, whose
                  logits give the first sample) and prefills only the rest.  A load makes every older
                  page unreachable.  Outputs are the same with the cache on or off (tokens; logprobs to
                  rounding: a page-by-page prefill sums in another order than one pass).

Tensors and types
    input_ids       [B, T] int64 (training forward; or [1, T] with cu_seqlens [N + 1] int32)
    logits          [B, T, vocab_size] fp32
    KV cache        [capacity, H_kv, head_dim] per attention layer, the model's dtype
    SamplingParams  max_new_tokens int >= 1 (16), temperature float >= 0 (0 = greedy), top_k
                    int >= 0 (0 = off), top_p in (0, 1] (1 = off), stop_token_ids, seed int or None,
                    n int >= 1 (samples of the prompt, 1)
    Request         prompt_token_ids list[int], sampling, request_id str, session_id
    Completion      request_id, prompt_token_ids, token_ids, logprobs (one per token),
                    finish_reason "stop" | "length", generator_id, min/max_policy_version,
                    sample_index (i of a group's n)
    (Repeated in routed_generator.py so that each file works alone; ``submit`` reads a request
    by its fields, so either file's ``Request`` is served.)
    ModelConfig     vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
                    num_kv_heads, head_dim (even), max_seq_len, rope_theta, rms_eps,
                    tie_embeddings, layer_types (None = all "attention", else "attention" /
                    "linear" per layer)
    linear_layer    plug-in ``(config, layer_index) -> nn.Module`` for "linear" layers, called as
                    ``m(x [1, T, hidden], cu_seqlens=cu [N+1] int32, cache=c)`` (prefill of N packed
                    sequences; training on documents with c None), ``m(x [B, T, hidden])`` (training
                    on B equal rows) and ``m(x [N, T, hidden], cache=c)`` (continue N sequences from the
                    state in ``c``: a decode step with T = 1, a prefill resumed after a cached prefix);
                    with ``cu_seqlens`` and a filled ``c``, each document continues from its state (a
                    zero state is a fresh start; a document may be empty);
                    ``m.new_cache()`` gives an empty cache whose tensor attributes hold the N
                    sequences on dim 0 once filled (ref/gated_deltanet.py's layer, with new_cache)

Supported, and what raises
    Any ModelConfig; fp32 / fp16 / bf16 weights on any device (sampling math in fp32/fp64).
    Inference only in the engine; ``DecoderLM.forward`` trains and ``DecoderLM.token_logprobs``
    recomputes a completion's logprobs the way a trainer does (the engine's numbers, to rounding).
    Many threads may call ``submit`` and ``load_weights``.  ValueError for bad config values, an empty prompt, a token
    id >= vocab_size, a prompt of max_seq_len tokens or more (no room to generate), a state dict
    with missing, unexpected or mis-shaped tensors, a version below the current one; TypeError
    for a request without the Request fields, non-tensor or non-floating state-dict values, a
    non-int version; RuntimeError after ``close()``.  ``token_logprobs``: ValueError for a prompt
    length outside [1, len), token ids out of range, a negative temperature.

References
    gpt-fast (PyTorch Labs, 2023): prefill + decode loop over a static KV cache; Llama / Qwen
    decoder blocks (RMSNorm, RoPE, GQA, SwiGLU); Holtzman et al., The Curious Case of Neural Text
    Degeneration (nucleus sampling, 2020).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import Future

import torch
import torch.nn.functional as F
from torch import nn

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


# ----------------------------------------------------------------------------- the model

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, rotate-half layout.  x [T, H, D]; positions [T] int -> [T, H, D]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None]          # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]                # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v with GQA, causal and bottom-right aligned, fp32 inside.

    q [L_q, H_q, D]; k, v [L_k, H_kv, D] -> [L_q, H_q, D] in q's dtype.  Query row i sees keys
    j <= i + L_k - L_q: the whole prompt in a prefill, every cached key in a decode step."""
    return attention_with_lse(q, k, v, scale, causal=True)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool):
    """``causal_attention`` (or every key visible, ``causal=False``) and its log-sum-exp: (out [L_q, H_q,
    D] in q's dtype, lse [H_q, L_q] fp32).  A row that sees no key gets out 0 and lse -inf."""
    l_q, h_q, d = q.shape
    l_k, h_kv = k.shape[0], k.shape[1]
    qf = q.float().view(l_q, h_kv, h_q // h_kv, d)                            # [L_q, H_kv, G, D]
    s = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale                 # [H_kv, G, L_q, L_k]
    if causal:
        future = torch.arange(l_k, device=q.device)[None] > torch.arange(l_q, device=q.device)[:, None] + (l_k - l_q)
        s = s.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                         # [H_kv, G, L_q]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("hgqk,khd->qhgd", p, v.float())                         # [L_q, H_kv, G, D]
    return o.reshape(l_q, h_q, d).to(q.dtype), lse.reshape(h_q, l_q)


def merge_states(out_a, lse_a, out_b, lse_b):
    """The attention state over two disjoint key sets from each one's (out [L, H, D], lse [H, L]):
    lse = log(e^lse_a + e^lse_b) and out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b (the larger lse
    subtracted first; a side with no key, lse = -inf, drops out).  Cascade attention is this merge of
    a query's attention over a shared prefix and over its own suffix."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)                    # [H, L]
    den = w_a + w_b
    lse = torch.where(den == 0, torch.full_like(m, float("-inf")), m + torch.log(den))
    w_a, w_b, den = (x.t()[..., None] for x in (w_a, w_b, torch.where(den == 0, torch.ones_like(den), den)))
    return (w_a * out_a.float() + w_b * out_b.float()) / den, lse


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, c: ModelConfig, kind: str, linear_layer, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = Attention(c) if kind == "attention" else None
        self.linear_attn = linear_layer(c, index) if kind == "linear" else None
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = FeedForward(c)


class DecoderLM(nn.Module):
    """The decoder-only LM of the module docstring.

    ``forward(input_ids [B, T], *, cu_seqlens=None) -> logits [B, T, V]`` fp32 trains it (causal
    per row, or per document of ``cu_seqlens`` with B == 1).  ``layers_forward`` runs the blocks
    on packed tokens with the caller's attention: that is how the engine plugs its KV cache in.
    """

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
                blocks.append(Block(config, kind, linear_layer, i))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(seed)
        self.to(device=device, dtype=dtype)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Unit-variance-preserving init drawn on the CPU in a fixed order (embedding; per block q, k,
        v, o, gate, up, down; lm_head): the same weights everywhere.  Embeddings have std
        2 / sqrt(hidden) so that logits spread over a few nats instead of a flat softmax."""
        gen = torch.Generator().manual_seed(seed)
        c = self.config

        def normal_(p, std):
            p.copy_(torch.randn(p.shape, generator=gen) * std)

        normal_(self.embed_tokens.weight, 2.0 / math.sqrt(c.hidden_size))
        out_scale = 1.0 / math.sqrt(2 * c.num_layers)  # the residual branches' outputs: o_proj, down_proj
        for block in self.layers:
            if block.self_attn is not None:
                a = block.self_attn
                for lin, scale in ((a.q_proj, 1.0), (a.k_proj, 1.0), (a.v_proj, 1.0), (a.o_proj, out_scale)):
                    normal_(lin.weight, scale / math.sqrt(lin.in_features))
            m = block.mlp
            for lin, scale in ((m.gate_proj, 1.0), (m.up_proj, 1.0), (m.down_proj, out_scale)):
                normal_(lin.weight, scale / math.sqrt(lin.in_features))
        if self.lm_head is not None:
            normal_(self.lm_head.weight, 1.0 / math.sqrt(c.hidden_size))

    def layers_forward(self, ids: torch.Tensor, positions: torch.Tensor, attend, mix) -> torch.Tensor:
        """The blocks on packed tokens.  ids, positions [T] -> final-normed hidden [T, hidden].

        ``attend(layer, q [T, H_q, D], k [T, H_kv, D], v) -> [T, H_q, D]`` (rotary applied) and
        ``mix(layer, module, h [T, hidden]) -> [T, hidden]`` (a "linear" layer) belong to the
        caller: they own the caches and the batch layout."""
        c = self.config
        x = self.embed_tokens(ids)                                          # [T, hidden]
        t = ids.shape[0]
        for i, block in enumerate(self.layers):
            h = block.input_layernorm(x)
            if block.self_attn is not None:
                a = block.self_attn
                q = rotary(a.q_proj(h).view(t, c.num_heads, c.head_dim), positions, c.rope_theta)
                k = rotary(a.k_proj(h).view(t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
                v = a.v_proj(h).view(t, c.num_kv_heads, c.head_dim)
                x = x + a.o_proj(attend(i, q, k, v).reshape(t, c.num_heads * c.head_dim))
            else:
                x = x + mix(i, block.linear_attn, h)
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] -> logits [..., V] fp32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (h @ w.t()).float()

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise TypeError(f"input_ids must be an integer tensor [B, T], got "
                            f"{getattr(input_ids, 'shape', input_ids)!r}")
        b, t = input_ids.shape
        if cu_seqlens is None:
            lengths = [t] * b
        else:
            if b != 1:
                raise ValueError(f"cu_seqlens requires input_ids of shape [1, T], got {tuple(input_ids.shape)}")
            lengths = cu_seqlens.diff().tolist()
            if sum(lengths) != t or min(lengths, default=0) < 0:
                raise ValueError(f"cu_seqlens must partition the {t} tokens, got {cu_seqlens.tolist()}")
        if max(lengths, default=0) > self.config.max_seq_len:
            raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_seq_len={self.config.max_seq_len}")
        dev = input_ids.device
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        bounds = [0, *itertools.accumulate(lengths)]
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        scale = self.config.head_dim ** -0.5

        def attend(i, q, k, v):                                             # each document alone
            return torch.cat([causal_attention(q[s:e], k[s:e], v[s:e], scale) for s, e in zip(bounds, bounds[1:])])

        def mix(i, module, h):
            if cu_seqlens is None:                                          # b equal rows: [B, T, hidden]
                return module(h.view(b, t, -1)).reshape(h.shape)
            return module(h[None], cu_seqlens=cu)[0]

        h = self.layers_forward(input_ids.reshape(-1), positions, attend, mix)
        return self.logits(h).view(b, t, -1)

    def token_logprobs(self, sequences, prompt_lengths, *, temperature=1.0, share_prompts=True) -> list[torch.Tensor]:
        """What a trainer recomputes for the tokens a generator sampled.

        ``sequences``: token ids, prompt + completion; ``prompt_lengths``: one int p per sequence,
        1 <= p < len; ``temperature``: one float >= 0 or one per sequence.  For completion token j
        (at position p + j) the logprob is log_softmax(logits * fp32(1 / T))[token] at position
        p + j - 1 (T = 0: unscaled, what greedy sampling reports).  Returns one fp32 tensor
        [len - p] per sequence; differentiable.

        ``share_prompts`` (a GRPO group: n completions of one prompt): each distinct prompt runs once.
        Its tokens go through the model once; a completion token attends to the prompt's keys and to
        its own earlier keys, two attention states merged exactly (``merge_states``: cascade
        attention), and "linear" layers continue each completion from the prompt's final state.  The
        prompt's gradients are then the sum over its completions.  False: one forward over the
        sequences packed whole as documents (the same numbers, to rounding)."""
        seqs, prompts, temps = _check_logprob_inputs(sequences, prompt_lengths, temperature, self.config)
        if not isinstance(share_prompts, bool):
            raise TypeError(f"share_prompts must be a bool, got {type(share_prompts).__name__}")
        if not seqs:
            return []
        dev = self.embed_tokens.weight.device
        if share_prompts:
            rows, logits = self._shared_prompt_logits(seqs, prompts)
        else:
            inputs = [s[:-1] for s in seqs]                                 # the last token is never fed
            bounds = [0, *itertools.accumulate(len(s) for s in inputs)]
            packed = torch.tensor([t for s in inputs for t in s], device=dev)[None]            # [1, T]
            logits = self.forward(packed, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=dev))[0]
            rows = [list(range(start + p - 1, start + len(seq) - 1)) for start, seq, p in zip(bounds, seqs, prompts)]
        out = []
        for r, seq, p, temp in zip(rows, seqs, prompts, temps):
            inv_t = torch.tensor(1.0 / temp if temp else 1.0, dtype=torch.float32, device=dev)
            logp = torch.log_softmax(logits[r] * inv_t, dim=-1)               # [len - p, V]: predict seq[p:]
            out.append(logp.gather(1, torch.tensor(seq[p:], device=dev)[:, None])[:, 0])
        return out

    def _shared_prompt_logits(self, seqs: list, prompts: list):
        """Logits of every distinct prompt's tokens, then of every completion's fed tokens (positions p
        .. len - 2), in one pass; per sequence, the rows that predict its completion tokens."""
        dev, c = self.embed_tokens.weight.device, self.config
        group_of, heads = [], {}
        for s, p in zip(seqs, prompts):
            group_of.append(heads.setdefault(tuple(s[:p]), len(heads)))
        prompt_ids = [list(t) for t in heads]
        p_bounds = [0, *itertools.accumulate(len(t) for t in prompt_ids)]
        fed = [s[p:-1] for s, p in zip(seqs, prompts)]                       # each completion's fed tokens
        c_bounds = [p_bounds[-1] + b for b in [0, *itertools.accumulate(len(f) for f in fed)]]
        ids = torch.tensor([t for ids_ in prompt_ids + fed for t in ids_], device=dev)
        positions = torch.tensor([i for t in prompt_ids for i in range(len(t))] +
                                 [p + i for p, f in zip(prompts, fed) for i in range(len(f))], device=dev)
        scale = c.head_dim ** -0.5

        def attend(i, q, k, v):
            outs = [causal_attention(q[a:b], k[a:b], v[a:b], scale) for a, b in zip(p_bounds, p_bounds[1:])]
            for g, a, b in zip(group_of, c_bounds, c_bounds[1:]):
                pa, pb = p_bounds[g], p_bounds[g + 1]
                # Cascade: over the prompt's keys (all visible), over its own keys (causal), merged.
                o_prefix, lse_prefix = attention_with_lse(q[a:b], k[pa:pb], v[pa:pb], scale, causal=False)
                o_own, lse_own = attention_with_lse(q[a:b], k[a:b], v[a:b], scale, causal=True)
                outs.append(merge_states(o_prefix, lse_prefix, o_own, lse_own)[0].to(q.dtype))
            return torch.cat(outs)

        def mix(i, module, h):
            cache = module.new_cache()
            cu = torch.tensor(p_bounds, dtype=torch.int32, device=dev)
            out_prompts = module(h[:p_bounds[-1]][None], cu_seqlens=cu, cache=cache)[0]
            if h.shape[0] == p_bounds[-1]:
                return out_prompts
            forked = module.new_cache()                                      # each completion: its prompt's state
            for name, t in vars(cache).items():
                if isinstance(t, torch.Tensor):
                    setattr(forked, name, t[torch.tensor(group_of, device=dev)])
            cu = torch.tensor([b - p_bounds[-1] for b in c_bounds], dtype=torch.int32, device=dev)
            return torch.cat([out_prompts, module(h[p_bounds[-1]:][None], cu_seqlens=cu, cache=forked)[0]])

        logits = self.logits(self.layers_forward(ids, positions, attend, mix))
        rows = [[p_bounds[g + 1] - 1, *range(a, b)] for g, a, b in zip(group_of, c_bounds, c_bounds[1:])]
        return rows, logits


# ----------------------------------------------------------------------------- sampling

def sample(logits: torch.Tensor, sp: SamplingParams, rng: torch.Generator) -> tuple[int, float]:
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
    index = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    # u * cdf[-1] may round up to cdf[-1]: stay on the last token that has probability.
    last = p.shape[-1] - 1 - int(torch.argmax((p.flip(-1) > 0).to(torch.int8)))
    index = min(index, last)
    token = index if order is None else int(order[index])
    return token, float(logp[token])


def request_rng(seed: int | None) -> torch.Generator:
    """The request's own random stream: seeded, or from a fresh random seed."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


# ----------------------------------------------------------------------------- the engine

class KVCache:
    """One request's caches: K and V [capacity, H_kv, D] per attention layer, the linear layers' own.

    ``attend`` / ``mix`` are ``DecoderLM.layers_forward``'s callbacks for the tokens at positions
    ``start .. length - 1`` (set by ``advance``)."""

    def __init__(self, model: DecoderLM, capacity: int):
        c = model.config
        w = model.embed_tokens.weight
        self.k, self.v, self.linear = {}, {}, {}
        for i, block in enumerate(model.layers):
            if block.self_attn is not None:
                self.k[i] = torch.zeros(capacity, c.num_kv_heads, c.head_dim, device=w.device, dtype=w.dtype)
                self.v[i] = torch.zeros_like(self.k[i])
            else:
                self.linear[i] = block.linear_attn.new_cache()
        self.scale, self.device = c.head_dim ** -0.5, w.device
        self.start = self.length = 0

    def advance(self, n: int) -> torch.Tensor:
        """The next forward pass feeds n tokens; returns their positions [n]."""
        self.start, self.length = self.length, self.length + n
        return torch.arange(self.start, self.length, device=self.device)

    def attend(self, i, q, k, v):
        self.k[i][self.start:self.length] = k
        self.v[i][self.start:self.length] = v
        return causal_attention(q, self.k[i][:self.length], self.v[i][:self.length], self.scale)

    def mix(self, i, module, h):
        if self.start == 0:  # the first tokens: one document
            cu = torch.tensor([0, h.shape[0]], dtype=torch.int32, device=h.device)
            return module(h[None], cu_seqlens=cu, cache=self.linear[i])[0]
        return module(h[None], cache=self.linear[i])[0]                   # continue from the state: [1, T, hidden]

    def linear_states(self) -> dict:
        """The linear layers' state now (copies): {layer: {name: tensor}}."""
        return {i: {n: t.clone() for n, t in vars(c).items() if isinstance(t, torch.Tensor)}
                for i, c in self.linear.items()}


class PrefixCache:
    """KV pages of earlier requests, reused by later ones (vLLM's automatic prefix caching, per page).

    A full page of ``page_size`` tokens is keyed by (its parent's id, its token ids, the weights'
    version): the same tokens from position 0 under the same weights.  Ids are never reused, so a key
    is exact and a chain whose parent was evicted is unreachable.  An entry holds the page's K and V
    per attention layer and, for models with "linear" layers, a checkpoint: each linear layer's state
    after the page's last token (a page without one cannot end a hit: the linear layers could not
    continue from there).  At most ``capacity`` pages, least recently used evicted first."""

    def __init__(self, page_size: int, capacity: int):
        self.page_size, self.capacity = page_size, capacity
        self.entries: OrderedDict = OrderedDict()   # key -> (id, {layer: (k, v)}, checkpoint or None)
        self.next_id = 1
        self.evictions = 0

    def chain(self, tokens: list, version: int, start_id: int = 0):
        """(key, page index) of the cached full pages of ``tokens``, from page 0 while they are cached."""
        parent, ps = start_id, self.page_size
        for j in range(len(tokens) // ps):
            key = (parent, tuple(tokens[j * ps:(j + 1) * ps]), version)
            if key not in self.entries:
                return
            yield key, j
            parent = self.entries[key][0]

    def match(self, tokens: list, version: int, max_pages: int, need_checkpoint: bool) -> list:
        """The longest run of cached pages, from page 0, ending on one with a checkpoint if needed."""
        keys = [key for key, j in self.chain(tokens, version) if j < max_pages]
        while keys and need_checkpoint and self.entries[keys[-1]][2] is None:
            keys.pop()
        for key in keys:
            self.entries.move_to_end(key)                   # used now
        return [self.entries[key] for key in keys]

    def put(self, parent_id: int, page_tokens: list, version: int, kv: dict, checkpoint) -> int:
        """Add a full page (or refresh it); returns its id, the parent id of the next page."""
        key = (parent_id, tuple(page_tokens), version)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][0]
        self.entries[key] = (self.next_id, kv, checkpoint)
        self.next_id += 1
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
            self.evictions += 1
        return self.next_id - 1

    def clear_older(self, version: int) -> None:
        """Weights changed: KV computed under an older version is never a hit."""
        for key in [k for k in self.entries if k[2] < version]:
            del self.entries[key]


@torch.no_grad()
def generate(model: DecoderLM, prompt: list[int], sp: SamplingParams, rng: torch.Generator,
             cache: PrefixCache | None = None, version: int = 0, counts: dict | None = None):
    """gpt-fast's loop: prefill the prompt, then one forward pass per token.  -> (tokens, logprobs, reason).

    With a prefix ``cache``: the longest cached run of the prompt's full pages is restored (its K/V,
    and the linear layers' checkpoint after it), the rest is prefilled a page at a time, and every
    page that fills (prompt or generated tokens) is added to the cache with the linear layers' state
    after it.  At least the prompt's last token is always computed: its logits give the first token.
    ``counts`` (prompt_tokens, computed_prompt_tokens, prefix_hit_tokens) is updated."""
    dev = model.embed_tokens.weight.device
    limit = min(sp.max_new_tokens, model.config.max_seq_len - len(prompt))
    kv = KVCache(model, len(prompt) + limit - 1)   # the last token's K/V is never needed
    tokens, generated, logprobs = list(prompt), [], []
    parent = 0                                      # the cache id of the last full page (0: none yet)
    if cache is not None:
        ps, hybrid = cache.page_size, bool(kv.linear)
        hits = cache.match(tokens, version, (len(tokens) - 1) // ps, need_checkpoint=hybrid)
        for j, (page_id, pages, _) in enumerate(hits):
            for i, (k, v) in pages.items():
                kv.k[i][j * ps:(j + 1) * ps], kv.v[i][j * ps:(j + 1) * ps] = k, v
            parent = page_id
        if hits and hybrid:                         # the linear layers continue from the last page's end
            for i, state in hits[-1][2].items():
                for name, t in state.items():
                    setattr(kv.linear[i], name, t.clone())
        kv.start = kv.length = len(hits) * ps
    counts = {} if counts is None else counts
    for name, n in (("prompt_tokens", len(prompt)), ("computed_prompt_tokens", len(prompt) - kv.length),
                    ("prefix_hit_tokens", kv.length)):
        counts[name] = counts.get(name, 0) + n
    feed = tokens[kv.length:]
    while True:
        if cache is None:
            pieces = [feed]
        else:  # up to each page boundary, so every full page is cached with the state after it
            room = cache.page_size - kv.length % cache.page_size
            pieces = [feed[:room]] + [feed[p:p + cache.page_size] for p in range(room, len(feed), cache.page_size)]
        for piece in pieces:
            positions = kv.advance(len(piece))
            h = model.layers_forward(torch.tensor(piece, device=dev), positions, kv.attend, kv.mix)
            if cache is not None and kv.length % cache.page_size == 0:
                j = kv.length // cache.page_size - 1
                pages = {i: (kv.k[i][j * ps:kv.length].clone(), kv.v[i][j * ps:kv.length].clone()) for i in kv.k}
                parent = cache.put(parent, tokens[j * ps:kv.length], version, pages,
                                   kv.linear_states() if kv.linear else None)
        token, logprob = sample(model.logits(h[-1]), sp, rng)
        generated.append(token)
        tokens.append(token)
        logprobs.append(logprob)
        if token in sp.stop_token_ids:
            return generated, logprobs, "stop"
        if len(generated) == limit:
            return generated, logprobs, "length"
        feed = [token]


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index`` of a request draws from its own stream: seed + index (None stays random)."""
    return None if seed is None else seed + index


class Generator:
    """The reference engine: requests one at a time, weights loaded between them.

    ``Generator(config=None, *, state_dict=None, seed=0, name="generator", policy_version=0,
    linear_layer=None, device=None, dtype=None, page_size=16, prefix_caching=True,
    cache_pages=1024, kv_on_swap="keep")``; ``close()`` (or ``with``) stops its thread and fails
    what is still queued.  ``prefix_caching``: reuse the KV pages (and linear-layer checkpoints) of
    earlier requests, at most ``cache_pages`` pages of ``page_size`` tokens (off: every prompt is
    prefilled whole).  ``kv_on_swap`` ("keep" or "recompute"): what the fast engine does with a
    running request's KV at a weight swap; here a request never spans a load, so it never applies.
    A request with ``sampling.n > 1`` is a group: its future resolves to n completions, sample i
    drawn from ``seed + i``, each equal to the request alone with that seed and n = 1.
    """

    def __init__(self, config: ModelConfig | None = None, *, state_dict=None, seed: int = 0, name: str = "generator",
                 policy_version: int = 0, linear_layer=None, device=None, dtype=None, page_size: int = 16,
                 prefix_caching: bool = True, cache_pages: int = 1024, kv_on_swap: str = "keep"):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if not _is_int(policy_version):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        _check_cache_options(prefix_caching, page_size, cache_pages, kv_on_swap)
        self.name = name
        self.device = torch.device("cpu" if device is None else device)
        self.model = DecoderLM(config, seed=seed, linear_layer=linear_layer, device=self.device, dtype=dtype).eval()
        self.config = self.model.config
        self._shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        if state_dict is not None:
            self._copy_in(_checked_state_dict(state_dict, self._shapes))
        self._version = policy_version
        self.page_size, self.kv_on_swap = page_size, kv_on_swap
        self._cache = PrefixCache(page_size, cache_pages) if prefix_caching else None
        self._counts = dict(prompt_tokens=0, computed_prompt_tokens=0, prefix_hit_tokens=0)
        self._cv = threading.Condition()
        self._load_lock = threading.Lock()  # one load_weights at a time
        self._queue: deque = deque()        # (request, future), or (None, (tensors, version, done future))
        self._closed = False
        self._running = self._completed = 0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-worker", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request) -> Future:
        """Queue one request; the future resolves to its ``Completion`` (a list of n with
        ``sampling.n > 1``).  Never blocks."""
        _check_request(request, self.config)
        future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed")
            self._queue.append((request, future))
            self._cv.notify()
        return future

    def generate(self, requests) -> list:
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
            done = Future()
            with self._cv:
                if self._closed:
                    raise RuntimeError(f"generator {self.name} is closed")
                self._queue.appendleft((None, (tensors, version, done)))  # before the waiting requests
                self._cv.notify()
            done.result()

    def stats(self) -> dict:
        """waiting, running, completed, policy_version; prompt_tokens (requested, per sample),
        computed_prompt_tokens (run through the model), prefix_hit_tokens, evictions, cached_pages,
        state_checkpoints (cached pages that carry the linear layers' state)."""
        with self._cv:
            waiting = sum(r is not None for r, _ in self._queue)
            cache = self._cache
            return dict(waiting=waiting, running=self._running, completed=self._completed,
                        policy_version=self._version, **self._counts,
                        evictions=cache.evictions if cache else 0, cached_pages=len(cache.entries) if cache else 0,
                        state_checkpoints=sum(e[2] is not None for e in cache.entries.values()) if cache else 0)

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

    def _serve(self, request) -> list:
        """The request's n samples, one after the other (sample i from seed + i)."""
        version, sp, out = self._version, request.sampling, []
        for index in range(sp.n):
            counts = {}
            rng = request_rng(sample_seed(sp.seed, index))
            tokens, logprobs, reason = generate(self.model, request.prompt_token_ids, sp, rng, self._cache,
                                                version, counts)
            with self._cv:
                for name, n in counts.items():
                    self._counts[name] += n
            out.append(Completion(request.request_id, list(request.prompt_token_ids), tokens, logprobs, reason,
                                  self.name, version, version, index))
        return out

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._closed):
                    self._cv.wait()
                if self._closed:
                    leftover, self._queue = list(self._queue), deque()
                    break
                request, job = self._queue.popleft()
                self._running = int(request is not None)
            if request is None:  # a weight load, between two requests
                tensors, version, done = job
                try:
                    self._copy_in(tensors)
                    self._version = version
                    if self._cache is not None:
                        self._cache.clear_older(version)
                    done.set_result(None)
                except Exception as exc:  # validated already; a device error lands here
                    done.set_exception(exc)
                continue
            future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                samples = self._serve(request)
                outcome = (future.set_result, samples if request.sampling.n > 1 else samples[0])
            except Exception as exc:
                outcome = (future.set_exception, exc)
            with self._cv:
                self._running = 0
                self._completed += 1
            outcome[0](outcome[1])  # outside every lock: callbacks may submit again
        closed = RuntimeError(f"generator {self.name} closed before serving the request")
        for request, job in leftover:
            if request is None:
                job[2].set_exception(closed)
            elif job.set_running_or_notify_cancel():
                job.set_exception(closed)


# ----------------------------------------------------------------------------- input checks

def _check_request(request, config: ModelConfig) -> None:
    """What makes a request unservable: ValueError / TypeError (a router keeps the generator)."""
    prompt = getattr(request, "prompt_token_ids", None)
    if not isinstance(prompt, list) or not hasattr(getattr(request, "sampling", None), "max_new_tokens"):
        raise TypeError(f"request must be a Request (prompt_token_ids, sampling, request_id), "
                        f"got {type(request).__name__}")
    _check_sampling(request.sampling)
    if not all(_is_int(t) for t in prompt):
        raise TypeError("prompt_token_ids must hold ints (token ids)")
    if not prompt:
        raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
    if max(prompt) >= config.vocab_size or min(prompt) < 0:
        raise ValueError(f"prompt_token_ids must be token ids in [0, {config.vocab_size}), got {max(prompt)}")
    if len(prompt) >= config.max_seq_len:
        raise ValueError(f"prompt_token_ids: a prompt of {len(prompt)} tokens leaves no room to generate "
                         f"in a context of max_seq_len={config.max_seq_len}")


def _check_cache_options(prefix_caching, page_size, cache_pages, kv_on_swap) -> None:
    if not isinstance(prefix_caching, bool):
        raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
    for name, value in (("page_size", page_size), ("cache_pages", cache_pages)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if kv_on_swap not in ("keep", "recompute"):
        raise ValueError(f"kv_on_swap must be 'keep' or 'recompute', got {kv_on_swap!r}")


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


if __name__ == "__main__":  # a short self-check: greedy decoding is deterministic and loads between requests
    with Generator(ModelConfig(vocab_size=64, max_seq_len=32), seed=0) as g:
        a = g.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=5))])[0]
        g.load_weights(DecoderLM(ModelConfig(vocab_size=64, max_seq_len=32), seed=0).state_dict(), 1)
        b = g.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=5))])[0]
    assert a.token_ids == b.token_ids and (b.min_policy_version, b.max_policy_version) == (1, 1)
    print("ok:", a.token_ids)
