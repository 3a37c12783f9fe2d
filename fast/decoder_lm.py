"""Decoder LM: the fast version.  The reference's model (ref/decoder_lm.py, the specification: read its
docstring for the math, the families and the checkpoint format) with fused projections, a rotary
table, SDPA / varlen attention for training, and the batch-invariant numerics that make generator and
trainer logprobs equal bit for bit.

Example::

    # decoder_lm.py, copied next to this script
    import torch
    from decoder_lm import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig(vocab_size=128, max_seq_len=64), seed=0)   # or DecoderLM.from_pretrained(path)
    ids = torch.randint(0, 128, (1, 12))
    logits = model(ids)                                                       # [1, 12, 128] fp32
    logps = model.token_logprobs([ids[0].tolist()], [4])                      # the 8 completion tokens' logprobs
    print(logits.shape, logps[0].shape)

What it changes
    fused         q, k, v (with Qwen3.5's gate and Qwen2's biases) are one matmul (``qkv_proj``
                  [(H_q (2 if gated) + 2 H_kv) D, hidden]) and gate, up another (``gate_up_proj``
                  [2 I, hidden]), as vLLM's QKVParallelLinear / MergedColumnParallelLinear.  The state
                  dict still names the checkpoint's q_proj / k_proj / v_proj / gate_proj / up_proj
                  (views of the fused weights; loading fuses them): a checkpoint, a trainer's state dict
                  and the reference's all load as they are.
    rotary        cos / sin from a table built once per device (the reference's fp32 products: the
                  same values, bitwise).
    elementwise   on a GPU without gradients, in the default mode, outside torch.compile: the residual add
                  and RMSNorm, a q/k head's norm and rotary, and SwiGLU are one Triton kernel each
                  (``fused_add_rms_norm``, ``fused_norm_rope``, ``fused_swiglu``; the section "fused
                  elementwise kernels"), the torch expressions' values but for the sum of squares' order.
    attention     training and ``token_logprobs`` run ``scaled_dot_product_attention`` (causal, GQA; a
                  block-diagonal mask for documents), or the ``varlen_attn`` plug-in when given
                  (fast/paged_varlen_attention.varlen_attn: packed documents without a mask).  gpt-oss's
                  sliding windows and sinks: the varlen plug-in's window (or PyTorch per document) and its
                  lse, each row scaled by sigmoid(lse - sink); ``token_logprobs``' shared-prompt path runs a
                  sliding layer's completions as one causal sequence each over its prompt's keys then its
                  own, within the window (the mode: below).

Batch-invariant mode: bitwise on-policy (``DecoderLM(..., batch_invariant=True, varlen_attn=...)``)
    ``token_logprobs`` then equals the logprobs the fast engine (generator_engine.py's
    ``Generator(model, ...)`` on a model in this mode) samples with, bit for bit (``torch.equal``),
    whatever shared the engine's batch, when a request joined, how its prompt was packed, chunked or
    cached, or whether it was preempted.  The invariance contract: every phase (the trainer's packed
    forward, the engine's prefill, each decode step) computes a row's dots with the same tile shape, the
    same instruction and the row in the same slot of the tile, and reduces in the same order; whatever
    runs the dot (a CPU BLAS, mma.sync or wgmma on a GPU) then sees identical work for that row.
    What each piece computes with in the mode:
      matmuls     on a GPU a fixed-tile Triton matmul (no split-K, one config per GPU family and
                  element size, never autotuned: the same MMA at any row count, checked on the
                  sm_80/sm_90 builds by parity/invariant_sass.py; the MMA rounds every row of a tile
                  alike); on a CPU one [1, K] x [K, N] product per row (a batched matmul: the same
                  BLAS call, the row at slot 0, whatever the row count).  Biases are added after.
      per row     RMSNorm (decoder, q/k and zero-centred alike: the mean of squares a product with a ones
                  vector), rotary (full or partial, any rope scaling: a table lookup and IEEE
                  arithmetic), SwiGLU and the attention gate (SiLU and sigmoid composed from exp:
                  torch's CPU silu / sigmoid round a vector loop's tail otherwise) and the final
                  log-softmax (max exact in any order; the sum of exps a product) are the same
                  expressions in the trainer's packed forward and in the engine's prefill and decode.
      attention   ``varlen_attn(..., batch_invariant=True)`` for the prefill and the trainer, and the
                  decode through ``flash_decode(..., batch_invariant=True)``: rows in 16-row groups at
                  slot (p G + g) mod 16, a row's keys reduced in segments of a fixed size (120 keys on a
                  GPU) from the call's first key, each in 16-key blocks, the segments folded in index
                  order (the decode splits them over programs), whatever the page size, block table,
                  split count or merging program.  A completion row
                  reduces its keys in two segments, its prompt's and its own, merged: the engine's
                  decode (prompt pages shared by a group) and this file's ``token_logprobs`` alike.
                  gpt-oss: the sinks join inside the kernels (after a row's last segment: in a completion
                  row's second call), and a sliding layer's completion row t reduces the keys of its
                  window only, its two segments starting where the window does (a0 = max(0, t - W + 1)
                  in the prompt, b0 = max(p, t - W + 1) in its own keys; a prompt segment the window
                  has left is empty): the engine's ``flash_decode(cache_leftpad=...)`` per row, each
                  row alone here (its keys as one-token pages).
      GDN layers  a "linear" plug-in must have ``set_batch_invariant(linear)`` (gated_deltanet.py's
                  layer has): its projections go through the invariant matmul and its recurrence runs
                  in the chunk form in the trainer's forward and backward, the prefill and each decode
                  step alike, chunks of 64 at absolute positions (multiples of 64 from the sequence's
                  start, wherever a call starts): the layer's cache holds the state at the current
                  chunk's start and that chunk's tokens so far, a call runs the chunk form over them and
                  its new tokens, and a decode step's token is its row of its chunk so far (the rows of a
                  partial chunk are the whole chunk's, bit for bit: ref/gated_deltanet.py's "A row inside
                  a partial chunk"), so hybrid models are on-policy too; its ``chunk_fn`` must compute a
                  chunk's row alike in any call (the reference chunk form does, and
                  fast/gated_deltanet.py's with the ``batch_invariant=True`` the layer passes).  A
                  completion in ``token_logprobs`` continues from its prompt's cache (that chunk start
                  state and buffer), as a decode step does.
      MoE layers  a ``moe_layer`` plug-in must have ``set_batch_invariant(linear)`` (moe.py's ``MoE``
                  has): its router logits and shared expert go through the invariant matmul, its experts
                  run fixed tiles without split-K and combine a token's k outputs in expert-index order,
                  so a token picks the same experts and gets the same bits in the trainer and the engine.
    Gradients through ``token_logprobs`` are the default kernels' (they need not be invariant).  Tested
    bitwise under four CPU kernel families (OpenBLAS generic, Sandybridge, Haswell/Zen, SkylakeX; ATen
    and MKL at AVX2 and scalar: parity/test_bitwise_blas.py), on Llama-style, Qwen3, Qwen3.5, Qwen3-MoE
    and Qwen3.5-MoE checkpoints, and on the sm_80/sm_90 builds; a GPU run is owed.

Tensor parallelism (``DecoderLM(config, tp_group=group)``: any torch.distributed ProcessGroup)
    The reference's layout (``shard_spec``), collectives (Megatron's f and g: one all-reduce per row-parallel
    output, two per layer; backward all-reduces the column-parallel inputs' gradients and sums a replicated
    weight's partial gradients over the ranks that hold it) and batch-invariant reduction (every rank's
    subtree root all-gathered, the tree's upper levels summed on every rank: bitwise the same at tp = 1, 2,
    4).  Under it the invariant matmul on a CPU runs in blocks of 8 columns, so a column-parallel shard rounds
    as the whole matrix does; with a replicated KV head the rank's query heads are padded to the GQA group, so
    an attention kernel lays rows out as at tp = 1.  Fused weights are sharded part by part (q, k, v; gate,
    up), under the checkpoint's names.  Mixture-of-Experts blocks are expert-parallel over the same ranks
    (the reference's layout: E / tp whole experts a rank, tokens dispatched and combined with all-to-all over
    the group, gloo on CPUs and NCCL on GPUs; a rank reads only its experts' bytes of a checkpoint, per-expert
    tensors included).  fast/generator_engine.py's ``Generator(model, tensor_parallel_size=N)`` builds the
    shards itself.

Compiled (``torch.compile(model, fullgraph=True)``: parity/test_compiled_trainer.py)
    The trainer's packed call ``model(input_ids, cu_seqlens=cu)`` compiles, forward and backward, with 0 graph
    breaks on the SDPA path, with the ``varlen_attn`` plug-in and with MoE blocks (their kernels are custom ops).
    Nothing is read on the host in the graph: cu_seqlens is checked on the device, the kernels get max_seq_len
    as max_q / max_k, rotary cos / sin are computed in the graph; values are eager's to fp32 rounding.
    ``model.compile(...)`` (in place) also runs ``token_logprobs(..., share_prompts=False)`` through it, T and N
    marked dynamic (one graph for every batch); direct calls follow PyTorch's rules (``dynamic=True`` or
    ``torch._dynamo.mark_dynamic`` for one graph from the start).  Hybrid models and gpt-oss's sinks and windows
    without the varlen plug-in break the graph; the varlen plug-in specializes T and N (README's limits).
    The batch-invariant mode runs eagerly: inductor does not keep its bits (19 of 20 rows of a packed forward
    differ, by up to 2e-6, on a CPU; aot_eager keeps them), so under torch.compile its forward leaves the graph
    (``fullgraph=True`` raises saying so; otherwise it runs eagerly, with a warning).

Cost
    Per token, FLOPs ~ 2 * (non-embedding parameters + hidden * vocab) + 4 * L_ctx * H_q * D per
    attention layer (L_ctx = keys it attends to); under tensor parallelism 2 all-reduces of T x hidden per
    layer (the batch-invariant mode: all-gathers, N - 1 partials received per rank; the same bytes at N = 2).

Tensors and types
    As the reference (ModelConfig, the linear_layer plug-in, input_ids / cu_seqlens, logits fp32).

Supported, and what raises
    As the reference, plus ValueError for ``batch_invariant=True`` without ``varlen_attn`` or with a
    plug-in layer that has no ``set_batch_invariant``.

References
    vLLM (fused QKV / gate-up linears); Thinking Machines, "Defeating Nondeterminism in LLM Inference"
    (2025: batch-invariant kernels); the reference's references.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import operator
import os
import threading
import warnings
import zlib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

try:  # Triton runs the batch-invariant matmul on GPUs; the model itself needs only torch
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

__all__ = ["ModelConfig", "DecoderLM", "LAYER_TYPES", "SUPPORTED_MODEL_TYPES", "read_safetensors"]

LAYER_TYPES = ("attention", "linear")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5_text", "qwen3_5", "qwen3_moe", "qwen3_5_moe_text",
                         "qwen3_5_moe", "gpt_oss")
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")       # Gated DeltaNet + gated attention
MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "gpt_oss")
MOE_STYLES = ("qwen", "gpt_oss")
ROPE_TYPES = ("default", "llama3", "yarn")
WEIGHT_PREFIXES = ("model.", "model.language_model.")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- the config

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model's sizes and architecture flags (module docstring).  ``ModelConfig.from_hf`` reads
    them from a checkpoint's config.json."""

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
    qkv_bias: bool = False                  # Qwen2 / Qwen2.5
    qk_norm: bool = False                   # Qwen3, Qwen3.5
    attn_output_gate: bool = False          # Qwen3.5
    zero_centered_norm: bool = False        # Qwen3.5 (not the Gated DeltaNet output norm)
    partial_rotary_factor: float = 1.0      # Qwen3.5: 0.25
    rope_type: str = "default"              # or "llama3" (Llama 3.1+), with the four parameters below
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_beta_fast: float = 32.0            # yarn (gpt-oss): the ramp between extrapolated and interpolated
    rope_beta_slow: float = 1.0             # frequencies, in rotations over rope_original_max_position
    rope_truncate: bool = True              # yarn: the ramp's ends rounded to whole dims (gpt-oss: False)
    o_proj_bias: bool = False               # gpt-oss (with qkv_bias: its attention_bias)
    attention_sinks: bool = False           # gpt-oss: a learned logit per query head, a key with value 0
    sliding_window: int = 0                 # gpt-oss: the sliding layers' window, in keys (0: none)
    sliding_layers: tuple[int, ...] = ()    # the layers that attend within sliding_window
    linear_num_k_heads: int = 2             # the "linear" (Gated DeltaNet) layers' sizes
    linear_num_v_heads: int = 4
    linear_head_k_dim: int = 16
    linear_head_v_dim: int = 16
    linear_conv_kernel_size: int = 4
    num_experts: int = 0                    # Mixture-of-Experts MLPs (Qwen3-MoE, Qwen3.5-MoE); 0: dense
    num_experts_per_tok: int = 2            # k: the experts each token goes through
    moe_intermediate_size: int = 32         # each expert's FFN size
    shared_expert_intermediate_size: int = 0   # Qwen3.5-MoE's shared expert (0: none)
    norm_topk_prob: bool = True             # the k chosen probabilities renormalised (Qwen3-MoE's flag)
    mlp_only_layers: tuple[int, ...] = ()   # an MoE model's dense layers (Qwen3-MoE)
    decoder_sparse_step: int = 1            # every step-th layer is MoE (Qwen3-MoE)
    moe_style: str = "qwen"                 # "qwen" or "gpt_oss": router scoring, activation, biases, layout
    swiglu_limit: float = 7.0               # gpt-oss's clamped SwiGLU
    weight_prefix: str = "model."           # where the text model's weights live in the checkpoint
    mtp_layers: int = 0                     # Qwen3.5's multi-token-prediction head's layers (mtp.*; 0: none)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_seq_len", "linear_num_k_heads", "linear_num_v_heads", "linear_head_k_dim",
                     "linear_head_v_dim", "linear_conv_kernel_size", "rope_original_max_position",
                     "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("num_experts", "shared_expert_intermediate_size", "mtp_layers"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                             f"({self.num_experts})")
        self._layer_indices("mlp_only_layers")
        if self.rope_type == "yarn" and not (self.rope_factor > 0 and self.rope_beta_fast > self.rope_beta_slow > 0):
            raise ValueError(f"yarn rope scaling needs rope_factor > 0 and rope_beta_fast > rope_beta_slow > 0, got "
                             f"{self.rope_factor}, {self.rope_beta_fast}, {self.rope_beta_slow}")
        if not _is_int(self.sliding_window) or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be an int >= 0, got {self.sliding_window!r}")
        if self._layer_indices("sliding_layers") and self.sliding_window < 1:
            raise ValueError(f"sliding_layers {self.sliding_layers!r} need a sliding_window >= 1, got "
                             f"{self.sliding_window!r}")
        if self.moe_style not in MOE_STYLES:
            raise ValueError(f"moe_style must be one of {MOE_STYLES}, got {self.moe_style!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.linear_num_v_heads % self.linear_num_k_heads:
            raise ValueError(f"linear_num_v_heads ({self.linear_num_v_heads}) must be a multiple of "
                             f"linear_num_k_heads ({self.linear_num_k_heads})")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError(f"rope_theta and rms_eps must be > 0, got {self.rope_theta!r} and {self.rms_eps!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor must be in (0, 1] and give an even rotary width >= 2 of "
                             f"head_dim={self.head_dim}, got {self.partial_rotary_factor!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "llama3" and not (self.rope_factor > 0 and
                                               0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError("llama3 rope scaling needs rope_factor > 0 and 0 < rope_low_freq_factor < "
                             f"rope_high_freq_factor, got {self.rope_factor}, {self.rope_low_freq_factor}, "
                             f"{self.rope_high_freq_factor}")
        if self.weight_prefix not in WEIGHT_PREFIXES:
            raise ValueError(f"weight_prefix must be one of {WEIGHT_PREFIXES}, got {self.weight_prefix!r}")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
                raise ValueError(f"layer_types must be None or {self.num_layers} entries from {LAYER_TYPES}, "
                                 f"got {self.layer_types!r}")
            object.__setattr__(self, "layer_types", types)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_types or ("attention",) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        """R: the rotated dims at the start of each head (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _layer_indices(self, name: str) -> tuple[int, ...]:
        """Field ``name`` as a tuple of layer indices, checked."""
        indices = tuple(getattr(self, name))
        if any(not _is_int(i) or not 0 <= i < self.num_layers for i in indices):
            raise ValueError(f"{name} must be layer indices in [0, {self.num_layers}), got {getattr(self, name)!r}")
        object.__setattr__(self, name, indices)
        return indices

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a Mixture-of-Experts block (transformers' Qwen3-MoE rule: not in
        mlp_only_layers, and layer + 1 a multiple of decoder_sparse_step)."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    def moe_layer_sizes(self) -> dict:
        """The keywords a ``moe_layer`` is called with (moe.py's MoE's names)."""
        sizes = dict(hidden_size=self.hidden_size, num_experts=self.num_experts, top_k=self.num_experts_per_tok,
                     intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     shared_intermediate_size=self.shared_expert_intermediate_size)
        if self.moe_style == "gpt_oss":   # top-k of the logits then softmax; biases; the clamped SwiGLU; its layout
            sizes.update(scoring="topk_softmax", router_bias=True, expert_bias=True, activation="gpt_oss",
                         swiglu_limit=self.swiglu_limit, layout="gpt_oss")
        return sizes

    def linear_layer_sizes(self) -> dict:
        """The keywords a ``linear_layer`` is called with (gated_deltanet.py's GatedDeltaNet's names)."""
        return dict(hidden_size=self.hidden_size, num_k_heads=self.linear_num_k_heads,
                    num_v_heads=self.linear_num_v_heads, head_k_dim=self.linear_head_k_dim,
                    head_v_dim=self.linear_head_v_dim, conv_kernel_size=self.linear_conv_kernel_size,
                    norm_eps=self.rms_eps)

    @classmethod
    def from_hf(cls, config, *, max_seq_len: int | None = None) -> ModelConfig:
        """The config of a Hugging Face checkpoint: ``config`` is a config.json path, a checkpoint
        directory or the parsed dict.  ``max_seq_len`` caps the context (default: the checkpoint's
        max_position_embeddings).  ValueError for a model type or feature this model does not have."""
        raw = _read_json_config(config)
        return cls(**_hf_fields(raw, max_seq_len))


def _hf_fields(raw: dict, max_seq_len) -> dict:
    """ModelConfig's fields from a transformers config dict (the research: each family's modeling file)."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported: this model reads {SUPPORTED_MODEL_TYPES} "
                         f"(Llama 3 / Qwen2 / Qwen2.5 / Qwen3 / Qwen3.5 text, Qwen3-MoE / Qwen3.5-MoE, gpt-oss)")
    if isinstance(max_seq_len, bool) or not (max_seq_len is None or _is_int(max_seq_len) and max_seq_len >= 1):
        raise ValueError(f"max_seq_len must be None or an int >= 1, got {max_seq_len!r}")
    prefix, tie = "model.", raw.get("tie_word_embeddings", False)
    if model_type in ("qwen3_5", "qwen3_5_moe"):      # the multimodal checkpoint: its text model (tied at the top)
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"a {model_type} config needs its text_config")
        prefix, raw, model_type = "model.language_model.", text, model_type + "_text"

    def get(key, default=None, required=False):
        if key not in raw or raw[key] is None:
            if required:
                raise ValueError(f"the {model_type} config has no {key!r}")
            return default
        return raw[key]

    gpt_oss = model_type == "gpt_oss"
    quantized = (get("quantization_config") or {}).get("quant_method")
    if quantized is not None and not (gpt_oss and quantized == "mxfp4"):
        raise ValueError(f"quantization_config quant_method={quantized!r} is not read ({model_type}): only gpt-oss's "
                         f"mxfp4 experts are dequantized at load")
    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported (silu only)")
    hidden, heads = get("hidden_size", required=True), get("num_attention_heads", required=True)
    hybrid, moe = model_type in HYBRID_MODEL_TYPES, model_type in MOE_MODEL_TYPES
    qwen3_family = model_type in ("qwen3", "qwen3_moe") or hybrid
    default_head_dim = 256 if hybrid else 128 if qwen3_family else hidden // heads
    layers = get("num_hidden_layers", required=True)
    hf_types = get("layer_types") or (["full_attention"] * layers if not hybrid else
                                      ["full_attention" if (i + 1) % get("full_attention_interval", 4) == 0
                                       else "linear_attention" for i in range(layers)])
    unknown = sorted({t for t in hf_types} - {"full_attention", "linear_attention"} -
                     ({"sliding_attention"} if gpt_oss else set()))
    if unknown or (not hybrid and "linear_attention" in hf_types):
        raise ValueError(f"layer types {unknown or ['linear_attention']} are not supported for {model_type} "
                         f"(sliding-window layers are gpt-oss's only)")
    if get("use_sliding_window", False):
        raise ValueError(f"use_sliding_window=True is not supported ({model_type}): full attention only")
    if get("attention_bias", False) and not gpt_oss:
        raise ValueError(f"attention_bias=True is not supported ({model_type}): q/k/v biases exist only as Qwen2's "
                         f"and gpt-oss's")
    if get("mlp_bias", False):
        raise ValueError(f"mlp_bias=True is not supported ({model_type})")
    # rope: transformers >= 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported: {ROPE_TYPES}")
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25 if hybrid else 1.0))
    experts = get("num_experts", get("num_local_experts", 0)) if moe else 0   # (transformers 5 writes the latter)
    fields = dict(
        vocab_size=get("vocab_size", required=True), hidden_size=hidden,
        intermediate_size=get("intermediate_size", get("moe_intermediate_size") if moe else None,
                              required=model_type != "qwen3_5_moe_text"), num_layers=layers, num_heads=heads,
        num_kv_heads=get("num_key_value_heads", heads), head_dim=get("head_dim", default_head_dim),
        max_seq_len=min(get("max_position_embeddings", 2048), max_seq_len or math.inf),
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))), rms_eps=float(get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(tie), qkv_bias=model_type == "qwen2" or gpt_oss and bool(get("attention_bias", True)),
        qk_norm=qwen3_family,
        attn_output_gate=hybrid, zero_centered_norm=hybrid,
        partial_rotary_factor=float(partial), rope_type=rope_type, weight_prefix=prefix,
        layer_types=None if "linear_attention" not in hf_types else
        tuple("linear" if t == "linear_attention" else "attention" for t in hf_types))
    def scaling(key):
        if rope.get(key) is None:
            raise ValueError(f"{rope_type} rope scaling needs {key!r} in the config's rope parameters")
        return rope[key]
    if rope_type == "llama3":
        fields.update(rope_factor=float(scaling("factor")), rope_low_freq_factor=float(scaling("low_freq_factor")),
                      rope_high_freq_factor=float(scaling("high_freq_factor")),
                      rope_original_max_position=int(scaling("original_max_position_embeddings")))
    if rope_type == "yarn":
        if any(rope.get(k) is not None for k in ("attention_factor", "mscale", "mscale_all_dim")):
            raise ValueError("yarn rope with attention_factor / mscale / mscale_all_dim is not supported (gpt-oss's: "
                             "factor, beta_fast, beta_slow, truncate, original_max_position_embeddings)")
        fields.update(rope_factor=float(scaling("factor")), rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                      rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                      rope_truncate=bool(rope.get("truncate", True)),
                      rope_original_max_position=int(scaling("original_max_position_embeddings")))
    if gpt_oss:   # attention sinks, every "sliding_attention" layer windowed, biases, the gpt-oss experts
        fields.update(o_proj_bias=fields["qkv_bias"], attention_sinks=True,
                      sliding_window=get("sliding_window", 128) if "sliding_attention" in hf_types else 0,
                      sliding_layers=tuple(i for i, t in enumerate(hf_types) if t == "sliding_attention"),
                      moe_style="gpt_oss", swiglu_limit=float(get("swiglu_limit", 7.0)))
        if float(get("swiglu_alpha", 1.702)) != 1.702:
            raise ValueError(f"swiglu_alpha={get('swiglu_alpha')} is not supported (gpt-oss: 1.702)")
    if moe:
        if not _is_int(experts) or experts < 1:
            raise ValueError(f"the {model_type} config needs num_experts >= 1, got {experts!r}")
        fields.update(num_experts=experts, num_experts_per_tok=get("num_experts_per_tok", required=True),
                      moe_intermediate_size=get("moe_intermediate_size" if not gpt_oss else "intermediate_size",
                                                required=True),
                      # Qwen3.5-MoE always renormalises the k probabilities and has the shared expert
                      norm_topk_prob=bool(get("norm_topk_prob", False)) if not hybrid else True,
                      shared_expert_intermediate_size=get("shared_expert_intermediate_size", required=True)
                      if hybrid else 0,
                      mlp_only_layers=tuple(get("mlp_only_layers", ())) if not hybrid else (),
                      decoder_sparse_step=get("decoder_sparse_step", 1) if not hybrid else 1)
    if hybrid:
        fields.update(mtp_layers=get("mtp_num_hidden_layers", get("num_nextn_predict_layers", 0)) or 0)
        fields.update(linear_num_k_heads=get("linear_num_key_heads", 16),
                      linear_num_v_heads=get("linear_num_value_heads", 32),
                      linear_head_k_dim=get("linear_key_head_dim", 128),
                      linear_head_v_dim=get("linear_value_head_dim", 128),
                      linear_conv_kernel_size=get("linear_conv_kernel_dim", 4))
    return fields


# ----------------------------------------------------------------------------- batch-invariant numerics
# What the mode computes with (the module docstring's contract): every reduction over a row's features is
# a product through ``_invariant_linear``, whose per-row bits do not depend on the other rows; maxima
# are exact in any order; the rest is elementwise, in forms whose bits do not depend on where an element
# sits in its tensor.

def _invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, each row rounded independently of every
    other row: on a GPU a fixed-tile Triton matmul (no split-K, one config per GPU family and element
    size), on a CPU one [1, K] x [K, 8] product per row and block of 8 columns (the same BLAS call whatever
    the row and column counts: tensor-parallel shards round alike).
    Differentiable (the backward is a plain matmul: gradients need not be invariant)."""
    y = torch.ops.twofold.invariant_linear(x.reshape(-1, x.shape[-1]), weight)
    return y.reshape(*x.shape[:-1], weight.shape[0])


INVARIANT_COLUMN_BLOCK = 8


@torch.library.custom_op("twofold::invariant_linear", mutates_args=())
def _invariant_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return _triton_invariant_matmul(x, weight)
    # One [1, K] x [K, 8] product per row and block of 8 columns (the last zero-padded): one BLAS call shape,
    # so an element's bits depend on its row and column alone (the reference's invariant_linear).
    n = weight.shape[0]
    pad = (-n) % INVARIANT_COLUMN_BLOCK
    w = F.pad(weight, (0, 0, 0, pad)) if pad else weight                              # [N + pad, K]
    blocks = [torch.bmm(x[:, None, :], w[j:j + INVARIANT_COLUMN_BLOCK].t().expand(x.shape[0], -1, -1))[:, 0]
              for j in range(0, n + pad, INVARIANT_COLUMN_BLOCK)]                     # each [M, 8]
    return torch.cat(blocks, dim=-1)[:, :n].contiguous()


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


def _linear(x: torch.Tensor, weight: torch.Tensor, bias, invariant: bool) -> torch.Tensor:
    """x W^T (+ b): F.linear, or the invariant product with the bias added after it."""
    if not invariant:
        return F.linear(x, weight, bias)
    y = _invariant_linear(x, weight)
    return y if bias is None else y + bias


def _invariant_row_sum(x: torch.Tensor) -> torch.Tensor:
    """sum over the last dim [..., D] -> [..., 1]: a product with a ones vector through _invariant_linear."""
    return _invariant_linear(x, torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool,
              zero_centered: bool = False) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight (zero-centred: * (1 + weight) in fp32), fp32 inside."""
    xf = x.float()
    if invariant:
        mean_sq = _invariant_row_sum(xf * xf) / xf.shape[-1]
    else:
        mean_sq = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(mean_sq + eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return normed.to(x.dtype) * weight


def _log_softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """log_softmax over the last dim; invariant: x - max - log(sum exp(x - max)), the max exact in any
    order (and a constant for autograd: the softmax gradient exactly), the sum through _invariant_linear."""
    if not invariant:
        return torch.log_softmax(x, dim=-1)
    shifted = x - x.amax(-1, keepdim=True).detach()
    return shifted - _invariant_row_sum(shifted.exp()).log()


def _sigmoid(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """sigmoid.  invariant: 1 / (1 + exp(-x)) in fp32, because torch's CPU kernels for silu / sigmoid round
    the elements of a vector loop's tail (a position that depends on the tensor's size) through another
    formula; exp, log, log1p and rsqrt go through one vector formula for every element.  exp's argument
    is clamped at 80 so that neither the value nor its gradient overflows (sigmoid(-80) = 1.8e-35)."""
    if not invariant:
        return torch.sigmoid(x)
    return (1 / (1 + torch.exp(-x.float().clamp(min=-80)))).to(x.dtype)


def _silu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """x * sigmoid(x); invariant: composed from exp in fp32 (see _sigmoid)."""
    if not invariant:
        return F.silu(x)
    xf = x.float()
    return (xf * _sigmoid(xf, True)).to(x.dtype)


def rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    """inv_freq [R/2] fp32 on the CPU, as transformers computes it: theta^(-2i/R); llama3 scaling divides
    the frequencies whose wavelength exceeds original_max / low_freq_factor by ``rope_factor``, keeps
    those below original_max / high_freq_factor, and blends linearly (in original_max / wavelength) between."""
    r = c.rotary_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    if c.rope_type == "llama3":
        low_wavelen = c.rope_original_max_position / c.rope_low_freq_factor
        high_wavelen = c.rope_original_max_position / c.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / c.rope_factor, inv_freq)
        smooth = (c.rope_original_max_position / wavelen - c.rope_low_freq_factor) / (
            c.rope_high_freq_factor - c.rope_low_freq_factor)
        blended = (1 - smooth) * scaled / c.rope_factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    if c.rope_type == "yarn":   # per dim pair, a linear ramp from extrapolated (theta^-2i/R) to interpolated (/ factor)
        def dim_of(rotations):
            return r * math.log(c.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(c.rope_theta))
        low, high = dim_of(c.rope_beta_fast), dim_of(c.rope_beta_slow)
        if c.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, r - 1)
        ramp = ((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
        extrapolated = 1 - ramp
        interpolated = 1.0 / (c.rope_factor * c.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
        inv_freq = interpolated * (1 - extrapolated) + inv_freq * extrapolated
    return inv_freq


def rope_attention_factor(c: ModelConfig) -> float:
    """What cos and sin are multiplied by: yarn's 0.1 ln(factor) + 1 (1 otherwise), as transformers."""
    return 0.1 * math.log(c.rope_factor) + 1.0 if c.rope_type == "yarn" and c.rope_factor > 1 else 1.0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding on each head's first R = 2 * cos.shape[-1] dims, fp32 inside:
    x [T, H, D], cos / sin [T, 1, R/2]."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)


def _add_norm(x: torch.Tensor, delta, bias, norm: _RMSNorm, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta (+ bias), its RMSNorm); x itself and its norm when delta is None: one kernel on a GPU
    (``fused_add_rms_norm``), else torch's ops in the reference's order."""
    if bias is None and _fused(x, invariant):
        return fused_add_rms_norm(x, delta, norm.weight, norm.eps, norm.zero_centered)
    if delta is not None:
        x = x + delta
        x = x if bias is None else x + bias
    return x, norm(x, invariant)


def _norm_rotate(x: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor, invariant: bool) -> torch.Tensor:
    """The rotary embedding of x [T, H, D] after its head norm (q_norm / k_norm; None: none): one kernel on a
    GPU (``fused_norm_rope``)."""
    if _fused(x, invariant):
        return fused_norm_rope(x, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps, cos,
                               sin, norm is not None and norm.zero_centered)
    return _rotate(x if norm is None else norm(x, invariant), cos, sin)


def _side_by_side(q: torch.Tensor, k: torch.Tensor, attention) -> bool:
    """Whether q [T, H_q, D] and k [T, H_kv, D] are views of one tensor with k's heads right after q's (the qkv
    product without an attention gate), so that one kernel can take both; with head norms (``attention``'s
    q_norm and k_norm), only if they share eps and centring (the kernel takes one of each)."""
    if attention is not None and (attention.q_norm.eps != attention.k_norm.eps
                                  or attention.q_norm.zero_centered != attention.k_norm.zero_centered):
        return False
    t, d = q.shape[0], q.shape[2]

    def stride(x, dim, wanted):             # (a dimension of size 1 may carry any stride)
        return x.shape[dim] == 1 or x.stride(dim) == wanted

    return (q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() and k.shape[0] == t
            and k.shape[2] == d and all(stride(x, 2, 1) and stride(x, 1, d) for x in (q, k))
            and (t == 1 or q.stride(0) == k.stride(0)) and k.storage_offset() == q.storage_offset() + q.shape[1] * d)


def _norm_rotate_qk(q: torch.Tensor, k: torch.Tensor, attention, cos: torch.Tensor, sin: torch.Tensor,
                    v: torch.Tensor | None = None,
                    cache: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_norm_rotate`` of q and k side by side (``_side_by_side``) in one kernel (``fused_qk_norm_rope``);
    ``attention`` holds q_norm and k_norm (None: no head norms).  With ``cache`` (``_kv_destination``'s
    (K rows, V rows, slots)) k's rows and v's go there instead, in the same launch, and k comes back None."""
    t, h_q, d = q.shape
    heads = h_q + k.shape[1]
    qk = q.as_strided((t, heads, d), (q.stride(0) if t > 1 else heads * d, d, 1))   # q's heads, then k's
    into = {} if cache is None else dict(v=v, k_cache=cache[0], v_cache=cache[1], slots=cache[2])
    if attention is None:
        return fused_qk_norm_rope(qk, h_q, None, None, 0.0, cos, sin, **into)
    qn, kn = attention.q_norm, attention.k_norm
    return fused_qk_norm_rope(qk, h_q, qn.weight, kn.weight, qn.eps, cos, sin, qn.zero_centered, **into)


def _kv_destination(attend, i: int, k: torch.Tensor) -> tuple | None:
    """Where layer i's new K and V rows go when ``attend`` (an engine's) takes them written already: its
    ``kv_slots(i)`` -> (K rows [S, H_kv, D], V rows, slots [T] int64), or None (no such attribute, it declines
    the layer, or its pool holds another dtype than k: the append would round there; attend then gets k
    and v)."""
    kv_slots = getattr(attend, "kv_slots", None)
    cache = kv_slots(i) if kv_slots is not None else None
    return cache if cache is not None and cache[0].dtype == k.dtype else None


# ----------------------------------------------------------------------------- the model, fused

class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x, invariant: bool = False):
        return _rms_norm(x, self.weight, self.eps, invariant, self.zero_centered)


def _split_fused(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: a fused tensor appears as its canonical parts (the checkpoint's names).
    The parts are views, so copying into them loads the fused tensor."""
    own = [(n, state_dict.pop(prefix + n)) for n, _ in module.named_parameters()]   # the last entries in
    for name, t in own:
        parts = module.fused.get(name)
        pieces = zip(parts, t.split(module.sizes)) if parts else [(name, t)]
        for part, view in pieces:
            state_dict[prefix + part] = view


def _fuse_parts(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: canonical parts -> the fused tensor."""
    for fused, parts in module.fused.items():
        keys = [prefix + p for p in parts]
        if all(k in state_dict for k in keys):
            state_dict[prefix + fused] = torch.cat([state_dict.pop(k) for k in keys])


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        q_out = c.num_heads * c.head_dim * (2 if c.attn_output_gate else 1)   # Qwen3.5: (query, gate) per head
        self.sizes = (q_out, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        self.fused = {"qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
        if c.qkv_bias:
            self.fused["qkv_proj.bias"] = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
        self.qkv_proj = nn.Linear(c.hidden_size, sum(self.sizes), bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        if c.qk_norm:
            self.q_norm = _RMSNorm(c.head_dim, c.rms_eps, c.zero_centered_norm)
            self.k_norm = _RMSNorm(c.head_dim, c.rms_eps, c.zero_centered_norm)
        if c.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(c.num_heads))
        self.register_state_dict_post_hook(_split_fused)
        self.register_load_state_dict_pre_hook(_fuse_parts)


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.sizes = (c.intermediate_size, c.intermediate_size)
        self.fused = {"gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight")}
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.register_state_dict_post_hook(_split_fused)
        self.register_load_state_dict_pre_hook(_fuse_parts)


class _Block(nn.Module):
    def __init__(self, c: ModelConfig, kind: str, linear_layer, moe_layer=None):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        if kind == "attention":
            self.self_attn = _Attention(c)
        else:
            self.linear_attn = linear_layer(**c.linear_layer_sizes())
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        self.mlp = _MLP(c) if moe_layer is None else moe_layer(**c.moe_layer_sizes())


class _TextModel(nn.Module):
    """The body under the checkpoint's prefix: embed_tokens, layers, norm."""

    def __init__(self, c: ModelConfig, linear_layer, moe_layer, seed: int):
        super().__init__()
        # (initialised by DecoderLM; nn.Embedding's own normal_ takes seconds at a real vocab under a meta device)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size))
        blocks = []
        for i, kind in enumerate(c.kinds):
            with torch.random.fork_rng(devices=[]):  # a plug-in's own init: the reference's seeds
                torch.manual_seed(seed * 1000003 + i)
                blocks.append(_Block(c, kind, linear_layer, moe_layer if i in c.moe_layers else None))
        self.layers = nn.ModuleList(blocks)
        self.norm = _RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)


class _MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction head (``mtp.*``): ref/decoder_lm.py's ``MTPHead`` (its docstring has
    the math), with this file's fused blocks."""

    def __init__(self, c: ModelConfig, moe_layer):
        super().__init__()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.pre_fc_norm_embedding = _RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        self.pre_fc_norm_hidden = _RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        self.layers = nn.ModuleList(_Block(c, "attention", None, moe_layer) for _ in range(c.mtp_layers))
        self.norm = _RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)


class DecoderLM(nn.Module):
    """The reference's decoder-only LM with fused projections (module docstring); the same
    constructor, state dict names, init, ``from_pretrained``, ``forward``, ``layers_forward``,
    ``logits`` and ``token_logprobs``, and with ``mtp=True`` Qwen3.5's multi-token-prediction head
    (``mtp_forward``, ``mtp_loss``).

    ``batch_invariant=True``: the module docstring's batch-invariant numerics (every "linear" plug-in
    must then have ``set_batch_invariant(linear)``); ``varlen_attn``: the attention of ``forward`` and
    ``token_logprobs`` (fast/paged_varlen_attention.varlen_attn's signature, called with
    ``batch_invariant``), required with ``batch_invariant=True`` (ValueError otherwise); None =
    ``scaled_dot_product_attention``.
    """

    # What a Qwen3.5 checkpoint (and a trainer's state dict of it) holds beside the text model: the vision
    # tower and the multi-token-prediction head.  Loading skips them (the head too unless mtp=True); so do the
    # generator engines.
    ignored_weight_prefixes = ("model.visual.", "mtp.")

    def __init__(self, config: ModelConfig | None = None, *, seed: int = 0, linear_layer=None, moe_layer=None,
                 device=None, dtype=None, batch_invariant: bool = False, varlen_attn=None, tp_group=None,
                 mtp: bool = False):
        super().__init__()
        config = ModelConfig() if config is None else config
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not _is_int(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        _check_mode(batch_invariant, varlen_attn)
        if "linear" in config.kinds and linear_layer is None:
            raise ValueError("this model has 'linear' layers: pass linear_layer=GatedDeltaNet (gated_deltanet.py's "
                             "class, or a functools.partial of it with the fast kernels)")
        if config.moe_layers and moe_layer is None:
            raise ValueError("this model has Mixture-of-Experts layers: pass moe_layer=MoE (moe.py's class)")
        if not isinstance(mtp, bool):
            raise TypeError(f"mtp must be a bool, got {type(mtp).__name__}")
        if mtp and not config.mtp_layers:
            raise ValueError("mtp=True needs a config with mtp_layers >= 1 (Qwen3.5's mtp_num_hidden_layers)")
        if mtp and tp_group is not None:
            raise ValueError("the MTP head is not built for tensor parallelism yet")
        self.config = config
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
        self.local_config = local_config(config, self.tp_size, batch_invariant)   # this rank's sizes
        self.init_kwargs = dict(linear_layer=linear_layer, moe_layer=moe_layer, batch_invariant=batch_invariant,
                                varlen_attn=varlen_attn, mtp=mtp)
        self.tp_traffic = dict(reductions=0, payload_bytes=0)   # row-parallel sums so far (forward)
        if moe_layer is not None and self.tp_size > 1:          # expert parallelism over the same ranks
            moe_layer = functools.partial(moe_layer, expert_group=tp_group)
        meta = device is not None and torch.device(device).type == "meta"
        with torch.device("meta") if meta else _no_context():
            body = _TextModel(self.local_config, linear_layer, moe_layer, seed)
            if config.weight_prefix == "model.language_model.":   # the multimodal checkpoint's layout
                self.model = nn.Module()
                self.model.language_model = body
            else:
                self.model = body
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if mtp:
                with torch.random.fork_rng(devices=[]):     # (a plug-in's own init: the reference's seed)
                    torch.manual_seed(seed * 1000003 + config.num_layers)
                    self.mtp = _MTPHead(self.local_config, moe_layer if config.moe_layers else None)
                self.ignored_weight_prefixes = ("model.visual.",)
        if config.tie_embeddings:                                # one tensor under both names, as transformers
            self.lm_head.weight = body.embed_tokens.weight
        self._rope_tables: dict = {}  # device -> (cos, sin) [max_seq_len, 1, R/2] fp32
        if not meta:
            with torch.no_grad():     # the reference's draws (per canonical name), or this rank's shard of them
                full = self.state_dict() if self.tp_size == 1 else DecoderLM(
                    config, seed=seed, linear_layer=linear_layer, moe_layer=self.init_kwargs["moe_layer"]).state_dict()
                for name, p in self.state_dict().items():
                    std = _init_std(name, config) if self.tp_size == 1 else None
                    if std is not None:
                        gen = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
                        norm = name.endswith("norm.weight") or ".pre_fc_norm_" in name
                        base = 1.0 if norm and not config.zero_centered_norm else 0.0
                        p.copy_(base + torch.randn(p.shape, generator=gen) * std)
                    elif self.tp_size > 1:
                        p.copy_(self.shard_tensor(name, full[name]))
        self.to(device=device, dtype=dtype)
        self.batch_invariant, self.varlen_attn = batch_invariant, varlen_attn
        self.segments = tp_segments(config) if batch_invariant else None
        for i, block in enumerate(self.layers):
            if hasattr(block, "linear_attn") and batch_invariant:
                out_linear = functools.partial(_local_tree, segments=self.segments["out_proj"] // self.tp_size)
                _set_invariant(block.linear_attn, i, _invariant_linear, out_linear)
            if i in config.moe_layers and batch_invariant:
                _set_invariant(block.mlp, i, _invariant_linear, None, plugin="moe_layer")
        if self.tp_size > 1:
            _register_shared_grad_hooks(self)

    @property
    def body(self) -> _TextModel:
        return self.model.language_model if self.config.weight_prefix == "model.language_model." else self.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.body.layers

    # ------------------------------------------------------------------ tensor-parallel shards

    def full_shape(self, name: str, local_shape) -> tuple:
        """The tp = 1 shape of parameter ``name`` (this rank holds a shard of it)."""
        if self.tp_size == 1:
            return tuple(local_shape)
        if not hasattr(self, "_full_shapes"):
            full = DecoderLM(self.config, linear_layer=self.init_kwargs["linear_layer"],
                             moe_layer=self.init_kwargs["moe_layer"], device="meta")
            self._full_shapes = {n: tuple(t.shape) for n, t in full.state_dict().items()}
        return self._full_shapes[name]

    def shard_tensor(self, name: str, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s slice (this rank's by default) of the full tensor ``name`` (``shard_spec``)."""
        return shard(full, shard_spec(name, self.config, self.tp_size, self.tp_rank if rank is None else rank))

    def shard_state_dict(self, state_dict: Mapping, rank: int | None = None) -> dict:
        """Rank ``rank``'s slices (this rank's by default) of a full (tp = 1) state dict, under the same
        names; names this model does not have (a vision tower) pass through for the caller's checks; tensors the
        rank holds none of (another rank's per-expert tensors) are left out."""
        shards = {n: self.shard_tensor(n, t, rank) for n, t in state_dict.items()}
        return {n: t for n, t in shards.items() if t is not None}

    def to_empty(self, *, device, recurse: bool = True):
        """nn.Module.to_empty, keeping a tied lm_head the embedding (to_empty gives every name a tensor)."""
        super().to_empty(device=device, recurse=recurse)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.body.embed_tokens.weight
        return self

    # ------------------------------------------------------------------ the forward pass

    def layers_forward(self, ids: torch.Tensor, positions: torch.Tensor, attend, mix) -> torch.Tensor:
        """The blocks on packed tokens, ids / positions [T] -> final-normed hidden [T, hidden];
        ``attend(layer, q, k, v)`` and ``mix(layer, module, h)`` as in the reference (this rank's heads).
        An engine's attend may carry ``kv_slots(layer)`` -> (K rows [S, H_kv, D], V rows, slots [T] int64: its
        KV pool's slots, the new tokens' slots) or None: where the fused q + k kernel runs, it then writes
        the new K and V rows there itself (the KV append without a launch of its own) and calls attend with
        k = v = None (the new keys are in the cache: a plug-in reads them there)."""
        rotary = self._rotary_at(positions)                                # cos, sin [T, 1, R/2]
        x, out = self.body.embed_tokens(ids), None                          # [T, hidden], every rank
        for i, block in enumerate(self.layers):
            x, out = self._block(i, block, x, rotary, attend, mix, out)
        return _add_norm(x, out, None, self.body.norm, self.batch_invariant)[1]

    def _block(self, i: int, block: _Block, x: torch.Tensor, rotary, attend, mix,
               before: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder block ``i`` on the residual stream x + before [T, hidden] (``before``: the previous block's
        output, or None; ``layers_forward``'s callbacks; rotary: cos, sin at the rows' positions) -> (the stream
        before this block's MLP output, that output).  Each block adds the one before it where its input norm
        reads the sum (the final norm adds the last): the same adds in the same order as adding it at the
        block's end, and on a GPU the add joins the norm's kernel (``fused_add_rms_norm``) instead of a
        launch of its own."""
        c, inv, t = self.local_config, self.batch_invariant, x.shape[0]
        cos, sin = rotary
        x, h = _add_norm(x, before, None, block.input_layernorm, inv)
        h = self._to_ranks(h)
        if hasattr(block, "self_attn"):
            a = block.self_attn
            q, k, v = _linear(h, a.qkv_proj.weight, a.qkv_proj.bias, inv).split(a.sizes, dim=-1)
            q = q.view(t, c.num_heads, -1)                                  # [T, H_q, D] or [T, H_q, 2 D]
            q, gate = q.chunk(2, dim=-1) if c.attn_output_gate else (q, None)
            k, v = k.view(t, c.num_kv_heads, c.head_dim), v.view(t, c.num_kv_heads, c.head_dim)
            norms = a if c.qk_norm else None
            if gate is None and _fused(k, inv) and _side_by_side(q, k, norms):     # one kernel for both
                cache = _kv_destination(attend, i, k)              # (and the KV append, in an engine's step)
                q, k = _norm_rotate_qk(q, k, norms, cos, sin, v, cache)
                v = v if cache is None else None
            else:
                q = _norm_rotate(q, a.q_norm if c.qk_norm else None, cos, sin, inv)
                k = _norm_rotate(k, a.k_norm if c.qk_norm else None, cos, sin, inv)
            o = self._attend(attend, i, q, k, v).reshape(t, -1)
            if gate is not None:
                o = o * _sigmoid(gate.reshape(t, -1), inv)
            delta, bias = self._row_parallel(o, a.o_proj.weight, "o_proj"), a.o_proj.bias
        else:
            delta, bias = self._reduce(mix(i, block.linear_attn, h)), None  # out_proj: row-parallel inside
        x, hm = _add_norm(x, delta, bias, block.post_attention_layernorm, inv)
        m, hm = block.mlp, self._to_ranks(hm)
        if not isinstance(m, _MLP):                                         # a Mixture-of-Experts block
            return x, m(hm)
        gate_up, up = _linear(hm, m.gate_up_proj.weight, None, inv).split(m.sizes, dim=-1)
        act = fused_swiglu(gate_up, up) if _fused(gate_up, inv) else _silu(gate_up, inv) * up
        return x, self._row_parallel(act, m.down_proj.weight, "down_proj")

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, which: str) -> torch.Tensor:
        """x [T, K_rank] @ weight [N, K_rank]^T summed over the ranks: an all-reduce; batch-invariant: the
        reference's segment tree (``tp_segments``)."""
        if not self.batch_invariant:
            return self._reduce(x @ weight.t())
        return self._reduce(_local_tree(x, weight, segments=self.segments[which] // self.tp_size))

    def _attend(self, attend, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """attend over this rank's heads.  Batch-invariant with a replicated KV head (tp > H_kv), the rank's
        H_q / tp query heads sit in a query tensor padded to the whole GQA group G = H_q / H_kv, at their
        places in it: an attention kernel then lays each row out in its tile as at tp = 1 (row (p, g) at
        the slot of p G + g), so it rounds alike; the padding rows are zeros and their outputs dropped."""
        padding = self._query_head_padding()
        if padding is None:
            return attend(i, q, k, v)
        group, first, heads = padding
        padded = q.new_zeros(q.shape[0], group, q.shape[2])    # [T, G, D]
        padded[:, first:first + heads] = q
        return attend(i, padded, k, v)[:, first:first + heads]

    def _query_head_padding(self) -> tuple[int, int, int] | None:
        """(G, this rank's first query head within its GQA group, its query heads) when ``_attend`` pads the
        query heads (the batch-invariant mode with a replicated KV head), else None."""
        c = self.config
        if not (self.batch_invariant and self.tp_size > c.num_kv_heads):
            return None
        heads = self.local_config.num_heads
        return c.num_heads // c.num_kv_heads, self.tp_rank * heads % (c.num_heads // c.num_kv_heads), heads

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return partial
        return _ReduceFromRanks.apply(partial, self.tp_group, self.batch_invariant, self.tp_traffic)

    def _to_ranks(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.tp_size == 1 else _CopyToRanks.apply(h, self.tp_group)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] -> logits [..., V] fp32."""
        w = self.lm_head.weight
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
            logits = self.logits(h[rows])                                           # [rows, V]
        else:
            logits = self._packed_logits(seqs, prompts)
        dev = logits.device
        inv_t = torch.tensor([1.0 / t if t else 1.0 for t, s, p in zip(temps, seqs, prompts)
                              for _ in range(len(s) - p)], dtype=torch.float32, device=dev)
        logp = _log_softmax(logits * inv_t[:, None], self.batch_invariant)          # [rows, V]
        targets = torch.tensor([t for s, p in zip(seqs, prompts) for t in s[p:]], device=dev)
        picked = logp.gather(1, targets[:, None])[:, 0]
        return list(picked.split([len(s) - p for s, p in zip(seqs, prompts)]))

    def _packed_logits(self, seqs: list, prompts: list) -> torch.Tensor:
        """Every sequence but its last token, packed as documents: the logits [rows, V] of the rows that
        predict each completion token, in order.  A model compiled in place (``model.compile(...)``:
        nn.Module.compile) runs its compiled ``forward`` on the pack, T and N marked dynamic (one graph for
        every batch; the vocabulary projection on every row); else ``layers_forward`` eagerly, the projection
        on those rows only."""
        dev = self.lm_head.weight.device
        lengths = [len(s) - 1 for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s[:-1]], device=dev)
        bounds = [0, *itertools.accumulate(lengths)]
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        # Row p - 1 + j of a sequence predicts its completion token j.
        rows = torch.cat([torch.arange(start + p - 1, start + n, device=dev)
                          for start, p, n in zip(bounds, prompts, lengths)])
        if getattr(self, "_compiled_call_impl", None) is not None:
            ids = ids[None]                                                    # [1, T]
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            torch._dynamo.maybe_mark_dynamic(cu, 0)
            return self(ids, cu_seqlens=cu)[0, rows]
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        h = self.layers_forward(ids, positions, self._packed_attention(cu, max(lengths), bounds[-1]),
                                lambda i, module, x: module(x[None], cu_seqlens=cu)[0])
        return self.logits(h[rows])

    def _prompt_shared_forward(self, seqs: list, prompts: list, share: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over each distinct prompt once, then every completion's fed tokens (positions
        p .. len - 2), the completions of a group side by side.  Returns (the rows predicting each
        completion token, in the sequences' order; the final hidden states)."""
        dev = self.lm_head.weight.device
        lay = _SharedPrompts(seqs, prompts, share, dev)
        h = self.layers_forward(lay.ids, lay.positions, self._shared_attention(lay), self._shared_mix(lay))
        return lay.rows, h

    def _shared_attention(self, lay: _SharedPrompts):
        """attend for ``_prompt_shared_forward``: prompt rows causal over their prompt; completion rows
        over their prompt's keys (every one visible) and over their own causal keys, merged (a sliding
        layer: ``_windowed_completions``).  Sinks: joined after the merge (a sink counts once); in the
        batch-invariant mode inside the kernels, as the engine's prefill and decode join them."""
        scale, mode = self.config.head_dim ** -0.5, self.batch_invariant

        def attend(i, q, k, v):
            t_p, window, sinks = lay.prompt_rows, self.attention_window(i), self.attention_sinks(i)
            in_kernel = dict(sinks=sinks) if mode and sinks is not None else {}
            qp, kp, vp, qc, kc, vc = q[:t_p], k[:t_p], v[:t_p], q[t_p:], k[t_p:], v[t_p:]
            out_p, lse_p = self._attention(qp, kp, vp, lay.cu_p, lay.cu_p, lay.max_p, lay.max_p, scale, causal=True,
                                           window=window, **in_kernel)
            out_p = out_p if sinks is None or in_kernel else with_sinks(out_p, lse_p, sinks)
            if qc.shape[0] == 0:
                return out_p
            if window:
                return torch.cat([out_p, self._windowed_completions(q, k, v, lay, scale, window, sinks)])
            # The prompt's keys: a group's completion rows packed as one query sequence read them once.
            o_a, lse_a = self._attention(qc, kp, vp, lay.cu_c_by_group, lay.cu_p, lay.max_c_group, lay.max_p,
                                         scale, causal=False)
            if mode:   # the engine's bits: each completion row alone over its prompt's keys (one-row tiles)
                o_a, lse_a = _value_with_gradient_of(self._rows_over_prompts(qc, kp, vp, lay, scale), (o_a, lse_a))
            o_b, lse_b = self._attention(qc, kc, vc, lay.cu_c, lay.cu_c, lay.max_c, lay.max_c, scale, causal=True,
                                         **in_kernel)
            out_c, lse_c = _merge_states(o_a, lse_a, o_b, lse_b)
            out_c = out_c if sinks is None or in_kernel else with_sinks(out_c, lse_c, sinks)
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

    def _windowed_completions(self, q, k, v, lay: _SharedPrompts, scale, window: int, sinks):
        """A sliding layer's completion rows: row t (of a completion with prompt length p) sees keys
        max(0, t - window + 1) .. t.  Computed as each completion's one causal sequence over its prompt's keys
        then its own (``lay.cat_index``: bottom-right aligned, so row j sits at key p + j), within the window.
        Batch-invariant mode: the values are the engine's, each row in two segments that start where its
        window does, a0 = max(0, t - w + 1) in the prompt and b0 = max(p, t - w + 1) in its own keys (each
        row alone, its keys as one-token pages; a prompt segment the window has left is empty: out 0, lse
        -inf), merged, the sink inside the second; the gradients are the first computation's."""
        t_p, mode = lay.prompt_rows, self.batch_invariant
        in_kernel = dict(sinks=sinks) if mode and sinks is not None else {}
        qc, index = q[t_p:], lay.cat_index
        out, lse = self._attention(qc, k[index], v[index], lay.cu_c, lay.cu_cat, lay.max_c, lay.max_cat, scale,
                                   causal=True, window=window, **in_kernel)
        out = out if sinks is None or in_kernel else with_sinks(out, lse, sinks)
        if not mode:
            return out
        with torch.no_grad():
            w = lay.window_tables(window)
            kw = dict(scale=scale, window_size=(-1, -1), enable_gqa=True, return_aux=_LSE, batch_invariant=True)
            o_a, lse_a = self.varlen_attn(qc, k[:t_p, None], v[:t_p, None], lay.cu_rows, None, 1, w.width_a,
                                          seqused_k=w.len_a, block_table=w.table_a, **kw)
            o_a = o_a.masked_fill(w.empty_a[:, None, None], 0.0)
            lse_a = lse_a.masked_fill(w.empty_a[None], float("-inf"))
            o_b, lse_b = self.varlen_attn(qc, k[t_p:, None], v[t_p:, None], lay.cu_rows, None, 1, w.width_b,
                                          seqused_k=w.len_b, block_table=w.table_b, **kw, **in_kernel)
            exact, _ = _merge_states(o_a, lse_a, o_b, lse_b)
        return _value_with_gradient_of((exact.to(out.dtype),), (out,))[0]

    def _attention(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, *, causal, window=0, sinks=None):
        """(out [T_q, H, D], lse [H, T_q] fp32) of varlen attention (causal: within the last ``window`` keys
        when given), through ``varlen_attn`` or in plain PyTorch (per sequence) without one.  ``sinks``: joined
        inside the kernel (the plug-in's keyword; the batch-invariant mode's use)."""
        window_size = ((window - 1 if window else -1), 0) if causal else (-1, -1)
        if self.varlen_attn is not None:
            mode = dict(batch_invariant=True) if self.batch_invariant else {}
            mode.update(dict(sinks=sinks) if sinks is not None else {})
            return self.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                    enable_gqa=True, return_aux=_LSE, **mode)
        return _torch_attention_lse(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, causal, window)

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

    def _packed_attention(self, cu: torch.Tensor, longest: int, t: int):
        """``layers_forward``'s attend over documents packed along T (cu [N + 1] int32, T = cu[-1]): through
        ``varlen_attn`` when the model has one, else SDPA with a block-diagonal causal mask."""
        scale = self.config.head_dim ** -0.5
        if self.config.attention_sinks or self.config.sliding_layers:   # gpt-oss: windows, sinks (and their lse)
            def attend(i, q, k, v):
                window, sinks = self.attention_window(i), self.attention_sinks(i)
                o, lse = self._attention(q, k, v, cu, cu, longest, longest, scale, causal=True, window=window)
                return o if sinks is None else with_sinks(o, lse, sinks, self.batch_invariant)
            return attend
        if self.varlen_attn is not None:
            # The keyword only in the mode: PyTorch's own varlen_attn, which has none, plugs in too.
            mode = dict(batch_invariant=True) if self.batch_invariant else {}

            def attend(i, q, k, v):
                return self.varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0),
                                        enable_gqa=True, **mode)
            return attend
        doc = _document_of(cu, t)                                           # [T] each token's document
        index = torch.arange(t, device=cu.device)
        same_doc_causal = (doc[:, None] == doc[None, :]) & (index[None, :] <= index[:, None])   # [T, T]

        def attend(i, q, k, v):                                             # [T, H, D] -> SDPA's [1, H, T, D]
            q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc_causal, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        return attend

    def attention_window(self, i: int) -> int:
        """Layer i's attention window in keys (0: every earlier key)."""
        return self.config.sliding_window if i in self.config.sliding_layers else 0

    def attention_sinks(self, i: int) -> torch.Tensor | None:
        """Layer i's attention sinks (gpt-oss), or None: one per query head ``attend`` sees ([H_q] of this
        rank; padded with zeros where ``_attend`` pads the query heads, whose rows are dropped)."""
        block = self.layers[i] if i < len(self.layers) else self.mtp.layers[i - len(self.layers)]
        sinks, padding = getattr(block.self_attn, "sinks", None), self._query_head_padding()
        if sinks is None or padding is None:
            return sinks
        group, first, heads = padding
        return torch.cat([sinks.new_zeros(first), sinks, sinks.new_zeros(group - first - heads)])

    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend,
                    depth: int = 0) -> torch.Tensor:
        """The MTP head (``_MTPHead``; ``DecoderLM(mtp=True)``) on packed rows: next_ids [T] (the token after each
        row's position), positions [T], hidden [T, hidden] (``layers_forward``'s output at those positions, or
        the head's own output one depth up) -> the head's final-normed hidden [T, hidden]; ``logits`` gives
        its distribution over the token two ahead.  ``attend`` is called with layer index num_layers + depth
        % mtp_layers: the head's keys are its own."""
        if getattr(self, "mtp", None) is None:
            raise _no_mtp_head()
        m, inv = self.mtp, self.batch_invariant
        e = m.pre_fc_norm_embedding(self.body.embed_tokens(next_ids), inv)
        x = _linear(torch.cat([e, m.pre_fc_norm_hidden(hidden, inv)], dim=-1), m.fc.weight, None, inv)
        layer = depth % len(m.layers)
        x, out = self._block(len(self.layers) + layer, m.layers[layer], x, self._rotary_at(positions), attend, None)
        return _add_norm(x, out, None, m.norm, inv)[1]

    def mtp_loss(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Qwen3.5's multi-token-prediction objective (ref/decoder_lm.py's ``mtp_loss``): the mean over every
        position t whose document holds tokens t + 1 and t + 2 of -log p_mtp(x_(t+2) | h_t, x_(t+1)), h the
        model's own final-normed hidden states (their gradient flows into the trunk too).  fp32 scalar (0 when
        no position qualifies)."""
        if getattr(self, "mtp", None) is None:
            raise _no_mtp_head()
        h, cu = self._hidden(input_ids, cu_seqlens)
        ids, lengths = input_ids.reshape(-1), cu.diff().tolist()
        rows = [(s, n - 1) for s, n in zip(cu.tolist(), lengths) if n >= 2]  # (first token, MTP rows t = 0 .. n - 2)
        if not rows:
            return h.sum() * 0.0
        dev = ids.device
        index = torch.cat([torch.arange(s, s + r) for s, r in rows]).to(dev)
        positions = torch.cat([torch.arange(r) for _, r in rows]).to(dev)
        bounds = [0, *itertools.accumulate(r for _, r in rows)]
        attend = self._packed_attention(torch.tensor(bounds, dtype=torch.int32, device=dev),
                                        max(r for _, r in rows), bounds[-1])
        y = self.mtp_forward(ids[index + 1], positions, h[index], attend)
        scored = torch.cat([torch.arange(b, b + r - 1) for b, (_, r) in zip(bounds, rows)]).to(dev)
        if scored.numel() == 0:
            return y.sum() * 0.0
        logp = self.log_softmax(self.logits(y[scored]))
        return -logp.gather(1, ids[index[scored] + 2][:, None]).mean()

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """log_softmax over the last dim with the model's numerics (batch-invariant in that mode): what
        ``token_logprobs`` applies to the logits, and what a generator samples with."""
        return _log_softmax(logits, self.batch_invariant)

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Training: logits [B, T, V] fp32, causal per row (or per document of ``cu_seqlens``, B == 1).
        Compiles with no graph break (module docstring, "Compiled"), but in the batch-invariant mode, which
        runs eagerly."""
        if self.batch_invariant and torch.compiler.is_compiling():
            return _eager_forward(self, input_ids, cu_seqlens)
        h, _ = self._hidden(input_ids, cu_seqlens)
        return self.logits(h).view(*input_ids.shape, -1)

    def _hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s checks and pass -> (final-normed hidden [B T, hidden], the documents' bounds cu [N + 1]
        int32: B rows of T without cu_seqlens)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise TypeError(f"input_ids must be an integer tensor [B, T], got "
                            f"{getattr(input_ids, 'shape', input_ids)!r}")
        b, t = input_ids.shape
        dev = input_ids.device
        if cu_seqlens is None:
            positions = torch.arange(t, device=dev).repeat(b)                # [B*T]
            cu = torch.arange(b + 1, dtype=torch.int32, device=dev) * t
            longest = t
            if longest > self.config.max_seq_len:
                raise ValueError(f"a sequence of {longest} tokens exceeds max_seq_len={self.config.max_seq_len}")
        else:
            if b != 1:
                raise ValueError(f"cu_seqlens requires input_ids of shape [1, T], got {tuple(input_ids.shape)}")
            cu = cu_seqlens.to(device=dev, dtype=torch.int32)
            longest = self._check_documents(cu, t)
            positions = torch.arange(t, device=dev) - cu[_document_of(cu, t)]

        if cu_seqlens is None and self.varlen_attn is None:
            def attend(i, q, k, v):                                         # [B*T, H, D] -> SDPA's [B, H, T, D]
                q, k, v = (x.view(b, t, x.shape[1], -1).transpose(1, 2) for x in (q, k, v))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return o.transpose(1, 2).reshape(b * t, o.shape[1], -1)
        else:
            attend = self._packed_attention(cu, longest, b * t)

        def mix(i, module, h):
            if cu_seqlens is None:                                          # b equal rows: [B, T, hidden]
                return module(h.view(b, t, -1)).reshape(h.shape)
            return module(h[None], cu_seqlens=cu)[0]

        return self.layers_forward(input_ids.reshape(-1), positions, attend, mix), cu

    def _check_documents(self, cu: torch.Tensor, t: int) -> int:
        """cu_seqlens (int32 [N + 1]) must partition the T tokens into documents of at most max_seq_len tokens;
        returns the longest document's length (the attention kernels' max_q / max_k), read on the host.  In a
        compiled graph nothing is read on the host (a read is a graph break): the same checks run on the device
        (torch._assert_async: a RuntimeError when the graph runs), and max_seq_len, which bounds every document,
        stands for the longest (a kernel's programs past a document's end return at once: the same values; a
        constant, where T would be a size the plug-in's int argument specializes)."""
        lengths = cu.diff()
        if torch.compiler.is_compiling():
            torch._assert_async((cu[0] == 0) & (cu[-1] == t) & (lengths >= 0).all()
                                & (lengths <= self.config.max_seq_len).all(),
                                "cu_seqlens must partition the T tokens into documents of at most max_seq_len tokens")
            return self.config.max_seq_len
        if int(cu[-1]) != t or int(cu[0]) != 0 or bool((lengths < 0).any()):
            raise ValueError(f"cu_seqlens must partition the {t} tokens, got {cu.tolist()}")
        longest = int(lengths.max()) if len(lengths) else 0
        if longest > self.config.max_seq_len:
            raise ValueError(f"a sequence of {longest} tokens exceeds max_seq_len={self.config.max_seq_len}")
        return longest

    def _rotary_at(self, positions: torch.Tensor):
        """cos, sin [T, 1, R/2] fp32 at the positions, from a table built once per device (the same
        fp32 products as the reference computes per call, so the same values).  A compiled graph computes
        its rows itself (the same products; inductor's cos / sin may round differently): a table read from
        this dict would be a graph input whose guards (the dict's keys, its sizes) cost recompiles.  The
        batch-invariant mode keeps the table's bits."""
        if torch.compiler.is_compiling() and not self.batch_invariant:
            return self._rotary_rows(positions.float())
        dev = positions.device
        if dev not in self._rope_tables:
            self._rope_tables[dev] = self._rotary_rows(torch.arange(self.config.max_seq_len, device=dev,
                                                                    dtype=torch.float32))
        cos, sin = self._rope_tables[dev]
        return cos[positions], sin[positions]

    def _rotary_rows(self, positions: torch.Tensor):
        """cos, sin [P, 1, R/2] fp32 at positions [P] fp32."""
        inv_freq, factor = rope_inv_freq(self.config).to(positions.device), rope_attention_factor(self.config)
        angles = positions[:, None] * inv_freq[None]                      # [P, R/2]
        return angles.cos()[:, None] * factor, angles.sin()[:, None] * factor

    @classmethod
    def from_pretrained(cls, path, *, linear_layer=None, moe_layer=None, dtype=None, device=None,
                        batch_invariant: bool = False, varlen_attn=None, max_seq_len: int | None = None,
                        tp_group=None, mtp: bool = False) -> DecoderLM:
        """The model of a Hugging Face checkpoint directory (config.json + safetensors, one file or
        sharded): weights memory-mapped and copied straight into the parameters, in ``dtype`` (default:
        the checkpoint's) on ``device``.  ``linear_layer``: required for hybrid (Qwen3.5) checkpoints,
        ``moe_layer``: for MoE (Qwen3-MoE, Qwen3.5-MoE) ones, each called with the checkpoint's sizes as
        keywords.  ``max_seq_len`` caps the context.  ``tp_group``:
        this rank reads only its shard's bytes."""
        raw = _read_json_config(path)
        config = ModelConfig(**_hf_fields(raw, max_seq_len))
        dtype = _checkpoint_dtype(raw) if dtype is None else dtype
        model = cls(config, linear_layer=linear_layer, moe_layer=moe_layer, device="meta", dtype=dtype,
                    batch_invariant=batch_invariant, varlen_attn=varlen_attn,
                    tp_group=tp_group, mtp=mtp)   # no memory, no init: the checkpoint fills it
        model.to_empty(device=torch.device("cpu") if device is None else device)
        load_checkpoint(model, path)
        return model


@torch.compiler.disable(reason="DecoderLM's batch-invariant mode runs eagerly: inductor's fused elementwise code does "
                               "not keep the mode's bits (fast/decoder_lm.py's docstring, \"Compiled\")")
def _eager_forward(model: DecoderLM, input_ids: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """The batch-invariant mode's forward under torch.compile: outside the graph, eagerly (a graph break:
    fullgraph=True raises with the reason above), so the logits keep the mode's bits."""
    warnings.warn("DecoderLM(batch_invariant=True) runs its forward eagerly under torch.compile (inductor does not "
                  "keep the mode's bits)", stacklevel=2)
    return model.forward(input_ids, cu_seqlens=cu_seqlens)


def _document_of(cu: torch.Tensor, t: int) -> torch.Tensor:
    """[T] each token's document, from cu [N + 1] that partitions the T tokens (T given: a shape known without
    reading cu, so a compiled graph has no data-dependent size)."""
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu.diff().long(), output_size=t)


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
        # A sliding layer's completion rows: each completion as one sequence over its prompt's keys then its
        # own (indices into the packed K/V), and per row the starts of its keys in either.
        first = self.prompt_rows
        self.completion_rows = c_bounds[-1]
        self.cat_index = torch.tensor([r for k, g in enumerate(groups)
                                       for r in [*range(p_bounds[g], p_bounds[g + 1]),
                                                 *range(first + c_bounds[k], first + c_bounds[k + 1])]], device=dev)
        cat = [plen[g] + c for g, c in zip(groups, clen)]
        self.cu_cat, self.max_cat = cu(cat), max(cat, default=0)
        self.row_position = self.positions[first:]
        self.row_prompt_start = torch.tensor([p_bounds[g] for g in row_group], device=dev)
        self.row_own_start = torch.tensor([c_bounds[k] for k, c in enumerate(clen) for _ in range(c)], device=dev)
        # Completion token 0 comes from its prompt's last row, token j > 0 from the completion's row j - 1.
        span = {n: range(first + c_bounds[k], first + c_bounds[k + 1]) for k, n in enumerate(order)}
        self.rows = torch.tensor([r for n in range(len(seqs)) for r in [p_bounds[group_of[n] + 1] - 1, *span[n]]],
                                 device=dev)

    def window_tables(self, window: int) -> _WindowTables:
        """Each completion row's keys within ``window`` (row t sees t - window + 1 .. t) as one-token pages,
        in two segments: its prompt's keys from a0 = max(0, t - window + 1) (a row whose window has left
        the prompt is marked empty; its table then holds the prompt's last key) and its own keys from
        b0 = max(p, t - window + 1)."""
        t, p = self.row_position, self.row_prompt_len.long()
        start = (t - window + 1).clamp(min=0)
        empty = start >= p
        a0, b0 = torch.minimum(start, p - 1), torch.maximum(start, p)
        len_a, len_b = (p - a0).int(), (t + 1 - b0).int()
        width_a, width_b = max(int(len_a.max()), 1), max(int(len_b.max()), 1)
        table_a = self.row_prompt_start[:, None] + a0[:, None] + torch.arange(width_a, device=t.device)
        table_b = self.row_own_start[:, None] + (b0 - p)[:, None] + torch.arange(width_b, device=t.device)
        # Entries past a row's length are never read; clamped so every entry is a row of its K/V.
        return _WindowTables(table_a.clamp(max=self.prompt_rows - 1).int(), len_a, empty, width_a,
                             table_b.clamp(max=self.completion_rows - 1).int(), len_b, width_b)


class _WindowTables(NamedTuple):
    table_a: torch.Tensor       # [rows, width_a] int32: prompt rows
    len_a: torch.Tensor         # [rows] int32
    empty_a: torch.Tensor       # [rows] bool: the window has left the prompt
    width_a: int
    table_b: torch.Tensor       # [rows, width_b] int32: completion rows
    len_b: torch.Tensor         # [rows] int32
    width_b: int


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


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Attention with a sink per head (gpt-oss): one more key, whose logit is sinks[h] and whose value is 0.
    It adds e^s to the softmax's denominator and nothing to its numerator, so the output over the real keys
    is scaled by e^lse / (e^lse + e^s) = sigmoid(lse - s).  out [L, H, D], lse [H, L], sinks [H].
    invariant: the batch-invariant mode's sigmoid (``_sigmoid``)."""
    scaling = _sigmoid(lse - sinks.float()[:, None], invariant)
    return (out.float() * scaling.t()[..., None]).to(out.dtype)


def _torch_attention_lse(q, k, v, cu_q: list, cu_k: list, scale: float, causal: bool, window: int = 0):
    """Varlen attention with its lse in plain PyTorch, one sequence at a time: (out [T_q, H_q, D],
    lse [H_q, T_q] fp32).  Causal is bottom-right aligned, within the last ``window`` keys when given; a
    row that sees no key gets 0 and -inf."""
    outs, lses = [], []
    h_q, d, h_kv = q.shape[1], q.shape[2], k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        l_q, l_k = qs.shape[0], ks.shape[0]
        s = torch.einsum("qhgd,khd->hgqk", qs.float().view(l_q, h_kv, h_q // h_kv, d), ks.float()) * scale
        if causal:
            at, key = torch.arange(l_q, device=q.device)[:, None] + l_k - l_q, torch.arange(l_k, device=q.device)[None]
            s = s.masked_fill((key > at) | ((key <= at - window) if window else False), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                                      # [H_kv, G, L_q]
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hgqk,khd->qhgd", p, vs.float()).reshape(l_q, h_q, d).to(q.dtype))
        lses.append(lse.reshape(h_q, l_q))
    return torch.cat(outs), torch.cat(lses, dim=1)


# ----------------------------------------------------------------------------- tensor parallelism
# The layout (Megatron's, by heads; ``shard_spec`` is the specification: which slice of which tensor a rank
# holds).  With tp ranks:
#   attention  q_proj (with Qwen3.5's gate: per head (query, gate)) and its bias: the rows of the rank's H_q / tp
#              query heads (column-parallel); k_proj, v_proj: the rows of its H_kv / tp KV heads, or, when
#              tp > H_kv, of one KV head replicated on tp / H_kv consecutive ranks (vLLM's rule); o_proj: the
#              columns of its query heads (row-parallel: a partial sum, reduced across the ranks); q_norm,
#              k_norm (over head_dim) replicated
#   mlp        gate_proj, up_proj: rows [r I/tp, (r+1) I/tp); down_proj: those columns (row-parallel)
#   linear     Gated DeltaNet by value heads with their key heads: Hv / tp value heads per rank with their
#              key heads (Hk / tp, or one replicated when tp > Hk); the fused in_proj_qkv and conv1d are
#              split into their q, k, v sections first (rows of the rank's key heads in q and k, of its value
#              heads in v: three pieces); in_proj_z (rows of its value heads), in_proj_b, in_proj_a, A_log,
#              dt_bias (its value heads); out_proj: the columns of its value heads (row-parallel); norm
#              (over head_v_dim) replicated
#   replicated embed_tokens, lm_head, every decoder RMSNorm: each rank computes the full logits (no
#              vocab-parallel gather before sampling; the cost is V x hidden weights per rank)
# The forward: the hidden state x is replicated; each column-parallel projection reads it (Megatron's f:
# identity forward, the ranks' partial input gradients all-reduced backward), each row-parallel output is
# summed over the ranks (g: all-reduce forward, identity backward).  A replicated weight that only sees the
# rank's heads (q_norm, k_norm, the Gated DeltaNet norm, a replicated KV or key head's rows) gets its
# partial gradients summed across the ranks that hold it, so backward leaves each rank exactly the
# matching slices of the tp = 1 gradients.
#
# Batch-invariant reduction across ranks (the contract of ``batch_invariant=True`` at any tp): the K dim of
# each row-parallel matmul is cut into S segments (``tp_segments``: S = the largest power of two, at most
# MAX_TP_SEGMENTS, dividing its units: query heads for o_proj, value heads for out_proj, the intermediate
# size for down_proj).  Segment s's partial P_s = x[:, K_s] W[:, K_s]^T (the invariant matmul), and the
# partials are summed as a fixed binary tree: ((P_0 + P_1) + (P_2 + P_3)) + ...  A rank holds S / tp
# consecutive segments, an aligned subtree: it sums its subtree, the ranks' roots are all-gathered, and
# every rank sums the tree's upper levels.  Every node of the tree has the same operands at any tp that
# divides S, so the result has the same bits at tp = 1, 2, 4 ... (tp must divide every S; other degrees
# raise in the mode).  Communication per row-parallel output of T x hidden: an all-gather, each rank
# receiving (tp - 1) T hidden values, against a ring all-reduce's 2 (tp - 1) / tp T hidden: the same at
# tp = 2, twice at tp = 4.

MAX_TP_SEGMENTS = 8


def _largest_pow2_divisor(n: int, cap: int = MAX_TP_SEGMENTS) -> int:
    return min(n & -n, cap)


def tp_segments(c: ModelConfig) -> dict:
    """S per row-parallel matmul (the batch-invariant reduction tree's leaves; see above)."""
    return dict(o_proj=_largest_pow2_divisor(c.num_heads), down_proj=_largest_pow2_divisor(c.intermediate_size),
                out_proj=_largest_pow2_divisor(c.linear_num_v_heads))


def local_config(c: ModelConfig, tp: int, batch_invariant: bool = False) -> ModelConfig:
    """The sizes one of tp ranks holds, or ValueError naming tp and the counts it does not fit."""
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"the tensor-parallel size must be an int >= 1, got {tp!r}")
    if tp == 1:
        return c
    hybrid = "linear" in c.kinds
    problems = [f"{name}={n}" for name, n in (("num_heads", c.num_heads), ("intermediate_size", c.intermediate_size),
                                              ("num_experts", c.num_experts)) if n % tp]
    problems += [f"num_kv_heads={c.num_kv_heads}"] if c.num_kv_heads % tp and tp % c.num_kv_heads else []
    if hybrid:
        problems += [f"linear_num_v_heads={c.linear_num_v_heads}"] if c.linear_num_v_heads % tp else []
        k = c.linear_num_k_heads
        problems += [f"linear_num_k_heads={k}"] if k % tp and tp % k else []
    if problems:
        raise ValueError(f"tensor parallelism over tp={tp} ranks needs tp to divide {', '.join(problems)} (KV and "
                         f"key heads may also be a divisor of tp: they are then replicated)")
    if batch_invariant:
        bad = {name: s for name, s in tp_segments(c).items() if s % tp and (name != "out_proj" or hybrid)}
        if bad:
            raise ValueError(f"batch_invariant=True at tp={tp}: the reduction tree's segments {bad} must be a "
                             f"multiple of tp (tp a power of two dividing the heads), so that every tp sums alike")
    return dataclasses.replace(c, num_heads=c.num_heads // tp, num_kv_heads=max(c.num_kv_heads // tp, 1),
                               intermediate_size=c.intermediate_size // tp,
                               linear_num_v_heads=c.linear_num_v_heads // tp if hybrid else c.linear_num_v_heads,
                               linear_num_k_heads=max(c.linear_num_k_heads // tp, 1) if hybrid
                               else c.linear_num_k_heads)


def _heads_of(n: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of n heads on a rank: n / tp each, or one replicated on tp / n ranks when tp > n."""
    return (rank * (n // tp), n // tp) if n >= tp else (rank // (tp // n), 1)


def shard_spec(name: str, c: ModelConfig, tp: int, rank: int):
    """(dim, ((start, stop), ...)): the rows (dim 0) or columns (dim 1) of the full tensor ``name`` that rank
    holds, the pieces concatenated in order; (None, ()) = the whole tensor (replicated)."""
    if tp == 1:
        return None, ()

    def span(unit, first, count):
        return (first * unit, (first + count) * unit)

    d = c.head_dim
    heads = c.num_heads // tp
    if ".self_attn." in name:
        rest = name.split(".self_attn.", 1)[1]
        if rest.startswith("q_proj."):
            return 0, (span(d * (2 if c.attn_output_gate else 1), rank * heads, heads),)
        if rest.startswith(("k_proj.", "v_proj.")):
            return 0, (span(d, *_heads_of(c.num_kv_heads, tp, rank)),)
        if rest == "o_proj.bias":                   # added once, after the sum over the ranks
            return None, ()
        if rest.startswith("o_proj."):
            return 1, (span(d, rank * heads, heads),)
        if rest == "sinks":                         # gpt-oss: one per query head
            return 0, (span(1, rank * heads, heads),)
        return None, ()
    if ".mlp.experts." in name:                   # expert parallelism: E / tp experts whole on each rank
        local = c.num_experts // tp
        index = name.split(".mlp.experts.", 1)[1].split(".")[0]
        if index.isdigit():                         # a per-expert tensor: on its expert's rank only
            return (None, ()) if int(index) // local == rank else (0, ())
        return 0, (span(local, rank, 1),)
    if _moe_replicated(name):
        return None, ()
    if ".mlp." in name:
        i = c.intermediate_size // tp
        return (1 if ".down_proj." in name else 0), (span(i, rank, 1),)
    if ".linear_attn." in name:
        rest = name.split(".linear_attn.", 1)[1]
        hv, dk, dv = c.linear_num_v_heads // tp, c.linear_head_k_dim, c.linear_head_v_dim
        first_k, count_k = _heads_of(c.linear_num_k_heads, tp, rank)
        key_dim, v0 = c.linear_num_k_heads * dk, rank * hv
        if rest in ("in_proj_qkv.weight", "conv1d.weight"):        # the q, k, v sections, sliced apart
            q = span(dk, first_k, count_k)
            return 0, (q, (key_dim + q[0], key_dim + q[1]), tuple(2 * key_dim + x for x in span(dv, v0, hv)))
        if rest == "in_proj_z.weight":
            return 0, (span(dv, v0, hv),)
        if rest in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            return 0, (span(1, v0, hv),)
        if rest == "out_proj.weight":
            return 1, (span(dv, v0, hv),)
        if rest == "norm.weight":
            return None, ()
        raise ValueError(f"tensor parallelism: no layout for the linear layer's parameter {rest!r} (the layout "
                         f"follows Qwen3.5's Gated DeltaNet names: gated_deltanet.py's GatedDeltaNet)")
    return None, ()



def _moe_replicated(name: str) -> bool:
    """An MoE block's router or shared expert: whole on every rank under expert parallelism."""
    return any(f".mlp.{part}" in name for part in ("gate.", "router.", "shared_expert"))

def shard(t: torch.Tensor, spec) -> torch.Tensor | None:
    """The pieces of ``t`` a shard spec names, concatenated (``t`` itself when replicated; None when the
    rank holds none of it: another rank's expert)."""
    dim, ranges = spec
    if dim is None:
        return t
    if not ranges:
        return None
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def _shared_grad(name: str, c: ModelConfig, tp: int) -> bool:
    """Whether a parameter's rows are held by several ranks that each see only their heads, so that its
    gradient must be summed across them: q_norm, k_norm and the Gated DeltaNet norm (replicated), a
    replicated KV head's k_proj / v_proj rows, a replicated key head's q / k rows of in_proj_qkv and conv1d,
    and an MoE block's router and shared expert (expert parallelism: each rank routes a slice of the tokens)."""
    if name.endswith(("q_norm.weight", "k_norm.weight", "linear_attn.norm.weight")):
        return True
    if _moe_replicated(name):
        return True                     # each rank routes its slice of the tokens through them
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return tp > c.num_kv_heads
    return name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")) and tp > c.linear_num_k_heads


def _register_shared_grad_hooks(model) -> None:
    """Sum across the ranks the gradients of the parameters (or of the parts of a fused one) that
    ``_shared_grad`` names; a fused weight's gradient is split into its canonical parts for it."""
    c, tp, rank, group = model.config, model.tp_size, model.tp_rank, model.tp_group
    fused_parts = {}                                            # fused parameter name -> [(part name, rows)]
    for prefix, module in model.named_modules():
        for fused, parts in getattr(module, "fused", {}).items():
            fused_parts[f"{prefix}.{fused}"] = [(f"{prefix}.{part}", size) for part, size in zip(parts, module.sizes)]
    for name, p in model.named_parameters():
        parts = fused_parts.get(name, [(name, p.shape[0])])
        if not any(_shared_grad(part, c, tp) for part, _ in parts):
            continue
        plan = [(part, rows, _shared_grad(part, c, tp), shard_spec(part, c, tp, rank),
                 model.full_shape(part, (rows, *p.shape[1:]))) for part, rows in parts]

        def hook(grad, plan=plan):
            pieces = grad.split([rows for _, rows, *_ in plan])
            return torch.cat([_summed_over_holders(g, spec, full, group) if shared else g
                              for g, (_, _, shared, spec, full) in zip(pieces, plan)])
        p.register_hook(hook)


def _summed_over_holders(grad: torch.Tensor, spec, full_shape, group) -> torch.Tensor:
    """A shard's gradient summed over the ranks that hold the same rows: each rank's rows placed in a zero
    tensor of the full shape, all-reduced, this rank's rows taken back (a replicated tensor: all-reduced)."""
    if spec[0] is None:
        return _all_reduce(grad.clone(), group)
    whole, offset = grad.new_zeros(full_shape), 0
    for a, b in spec[1]:
        whole.narrow(spec[0], a, b - a).copy_(grad.narrow(spec[0], offset, b - a))
        offset += b - a
    return shard(_all_reduce(whole, group), spec)


def _tree_sum(parts: list) -> torch.Tensor:
    """((p0 + p1) + (p2 + p3)) + ...: a fixed binary tree over a power-of-two count of partials."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _local_tree(x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    """The rank's subtree of the batch-invariant reduction: x [.., K_rank] @ weight [N, K_rank]^T as
    ``segments`` invariant matmuls over consecutive K slices, summed as a tree."""
    return _tree_sum([_invariant_linear(xs, ws) for xs, ws in zip(x.chunk(segments, -1), weight.chunk(segments, -1))])


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    group.allreduce([t]).wait()
    return t


def _all_gather(t: torch.Tensor, group) -> list:
    outs = [torch.empty_like(t) for _ in range(group.size())]
    group.allgather([outs], [t.contiguous()]).wait()
    return outs


class _ReduceFromRanks(torch.autograd.Function):
    """g: a row-parallel partial summed over the ranks (all-reduce, or the invariant tree's upper levels
    over the gathered subtree roots); backward: the gradient of a sum, identity."""

    @staticmethod
    def forward(ctx, partial, group, invariant, traffic):
        traffic["reductions"] += 1                 # the payload each rank contributes
        traffic["payload_bytes"] += partial.numel() * partial.element_size()
        if invariant:
            return _tree_sum(_all_gather(partial, group))
        return _all_reduce(partial.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _CopyToRanks(torch.autograd.Function):
    """f: the replicated input of the column-parallel projections; backward: the partial gradients summed."""

    @staticmethod
    def forward(ctx, h, group):
        ctx.group = group
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class LocalGroup:
    """tp ranks as threads of one process: the single-process specification of tensor parallelism (and its
    test).  ``LocalGroup(tp).ranks()`` gives one handle per rank with ``rank()``, ``size()`` and the
    collectives the model calls, ``allreduce`` (sum in rank order), ``allgather`` and ``alltoall_base``
    (moe.py's expert parallelism), with a torch.distributed ProcessGroup's method names; the threads meet
    at a barrier."""

    def __init__(self, size: int):
        self._size, self._barrier, self._slots = size, threading.Barrier(size), [None] * size

    def ranks(self) -> list:
        return [_LocalRank(self, r) for r in range(self._size)]


class _LocalRank:
    def __init__(self, group: LocalGroup, rank: int):
        self._group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._group._size

    def _exchange(self, t) -> list:
        g = self._group
        g._slots[self._rank] = t.clone() if isinstance(t, torch.Tensor) else [p.clone() for p in t]
        g._barrier.wait()
        out = list(g._slots)
        g._barrier.wait()                      # nobody overwrites a slot before everyone has read it
        return out

    def allgather(self, outs, tensors):
        for o, t in zip(outs[0], self._exchange(tensors[0])):
            o.copy_(t)
        return self

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes):
        pieces = self._exchange(input.split(list(input_split_sizes)))      # every rank's pieces, one per rank
        mine = [theirs[self._rank] for theirs in pieces]
        if [p.shape[0] for p in mine] != list(output_split_sizes):
            raise ValueError(f"alltoall_base: rank {self._rank} expected {list(output_split_sizes)} rows from the "
                             f"ranks, they sent {[p.shape[0] for p in mine]}")
        output.copy_(torch.cat(mine))
        return self

    def allreduce(self, tensors):
        parts = self._exchange(tensors[0])
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        tensors[0].copy_(total)
        return self

    def wait(self):
        return True


# ----------------------------------------------------------------------------- safetensors, read as untrusted input

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}
_MAX_HEADER_BYTES = 100 << 20          # safetensors' own limit


def read_safetensors(path) -> dict[str, torch.Tensor]:
    """name -> tensor viewing a memory-mapped safetensors file (read-only use; no copy, except of a tensor
    whose offset is not a multiple of its element size).  The format: an 8-byte little-endian header
    length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}} (offsets into the data
    after the header), then the data.  Every field is checked against the file before anything is
    viewed: ValueError naming the file and tensor for a header past the end, bad JSON, an unknown dtype,
    a bad shape, offsets out of range or overlapping, a shape that disagrees with its byte count."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 8:
        raise ValueError(f"{path}: {size} bytes, shorter than the 8-byte safetensors header length")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} runs past the file ({size} bytes) or over "
                             f"{_MAX_HEADER_BYTES} bytes: truncated or not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header must be a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    spans = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        spans.append((*_checked_entry(path, name, meta, data_len), name))
    spans.sort(key=lambda span: span[:2])
    for (_, e0, *_, n0), (b1, _, *_, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {n0!r} and {n1!r} overlap (bytes {b1} < {e0})")
    tensors = {}
    if spans:
        data = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)    # mmap, copy-on-write
        for begin, end, dtype, shape, name in spans:
            raw = data[data_start + begin:data_start + end]
            if (data_start + begin) % dtype.itemsize:
                raw = raw.clone()                                       # unaligned: view(dtype) needs alignment
            tensors[name] = raw.view(dtype).view(shape)
    return tensors


def _checked_entry(path, name, meta, data_len: int):
    """(begin, end, dtype, shape) of one header entry, each checked (ValueError otherwise)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
        raise ValueError(f"{where}: a header entry needs dtype, shape and data_offsets, got {meta!r}")
    dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
    if dtype is None:
        raise ValueError(f"{where}: unknown dtype {meta['dtype']!r} (known: {sorted(_SAFETENSORS_DTYPES)})")
    shape, offsets = meta["shape"], meta["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(s) and 0 <= s < 2 ** 48 for s in shape):
        raise ValueError(f"{where}: shape must be a list of ints >= 0, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        raise ValueError(f"{where}: data_offsets {offsets!r} out of the data's range [0, {data_len}]")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(f"{where}: shape {shape} of {meta['dtype']} is {nbytes} bytes, data_offsets give "
                         f"{offsets[1] - offsets[0]}")
    return offsets[0], offsets[1], dtype, tuple(shape)


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, memory-mapped: model.safetensors, or the shards that
    model.safetensors.index.json names (each a file inside the directory)."""
    path = os.fspath(path)
    index, single = os.path.join(path, "model.safetensors.index.json"), os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f).get("weight_map")
            except (json.JSONDecodeError, AttributeError):
                weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: needs a weight_map of tensor names to shard file names")
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            if os.path.basename(shard) != shard or shard in (".", ".."):
                raise ValueError(f"{index}: shard {shard!r} is not a file name inside the checkpoint directory")
            found = read_safetensors(os.path.join(path, shard))
            listed = [n for n, s in weight_map.items() if s == shard]
            absent = [n for n in listed if n not in found]
            if absent:
                raise ValueError(f"{os.path.join(path, shard)}: the index lists {absent[:5]} there, the file "
                                 f"does not hold them")
            tensors.update({n: found[n] for n in listed})
        return tensors
    if os.path.isfile(single):
        return read_safetensors(single)
    found = sorted(os.listdir(path)) if os.path.isdir(path) else []
    raise ValueError(f"{path} is not a checkpoint directory this model reads: it looked for config.json with "
                     f"model.safetensors or model.safetensors.index.json (found {found[:8]}); .bin / .pt "
                     f"weights are not read (nothing is unpickled): convert them to safetensors")


@torch.no_grad()
def load_checkpoint(model: nn.Module, path) -> None:
    """Copy a checkpoint's tensors into ``model``'s parameters by name (cast to each parameter's dtype).
    Skipped: the names under the model's ``ignored_weight_prefixes`` (a Qwen3.5 checkpoint's vision tower, and
    its multi-token-prediction head unless the model has one).  Missing, unexpected and mis-shaped tensors
    are named in one ValueError before anything is copied.  A tied ``lm_head.weight`` may be absent (it is the
    embedding)."""
    tensors = {n: t for n, t in checkpoint_tensors(path).items()
               if not n.startswith(getattr(model, "ignored_weight_prefixes", ()))}
    if getattr(model, "tp_size", 1) > 1:                    # this rank's slices (views: only their bytes are read)
        tensors = model.shard_state_dict(tensors)
    for name, module in model.named_modules():     # a plug-in's own checkpoint layouts (moe.py's per-expert tensors)
        if callable(getattr(module, "convert_checkpoint", None)):
            module.convert_checkpoint(tensors, name + ".")
    params = model.state_dict()
    tied = _tied_aliases(model)
    problems = {"missing": sorted(n for n in params.keys() - tensors.keys() if n not in tied),
                "unexpected": sorted(tensors.keys() - params.keys()),
                "mis-shaped": [f"{n}: checkpoint {tuple(t.shape)}, model {tuple(params[n].shape)}"
                               for n, t in tensors.items() if n in params and t.shape != params[n].shape],
                "not floating": [n for n, t in tensors.items() if n in params and not t.is_floating_point()]}
    if any(problems.values()):
        raise ValueError(f"checkpoint {os.fspath(path)} does not fit the model: " + "; ".join(
            f"{kind} {items[:8]}{' ...' if len(items) > 8 else ''}" for kind, items in problems.items() if items))
    for name, t in tensors.items():
        params[name].copy_(t)


def _tied_aliases(model: nn.Module) -> set:
    """State-dict names whose tensor is an earlier name's (a tied lm_head): optional when loading."""
    seen, aliases = set(), set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases.add(name)
        seen.add(id(t))
    return aliases


def _read_json_config(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{os.fspath(config)} is not a checkpoint: no config.json there")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config must be a JSON object")
    return raw


def _checkpoint_dtype(raw: dict) -> torch.dtype:
    """The config's ``dtype`` (``torch_dtype`` before transformers 5); fp32 when it names none."""
    text = raw.get("text_config") if raw.get("model_type") == "qwen3_5" else None
    name = raw.get("dtype") or raw.get("torch_dtype") or (text or {}).get("dtype") or (text or {}).get("torch_dtype")
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name is not None and name not in table:
        raise ValueError(f"checkpoint dtype {name!r} is not supported: {sorted(table)}")
    return table.get(name, torch.float32)


def _init_std(name: str, c: ModelConfig) -> float | None:
    """The random init's std per canonical weight name (None: plug-in layers keep their own init, and a
    tied lm_head is the embedding)."""
    leaf = name.rsplit(".", 2)
    if ".linear_attn." in name or (name == "lm_head.weight" and c.tie_embeddings):
        return None
    if name.endswith(".sinks"):
        return 1.0
    if name.endswith("embed_tokens.weight"):
        return 2.0 / math.sqrt(c.hidden_size)
    if name == "lm_head.weight":
        return 1.0 / math.sqrt(c.hidden_size)
    if name.endswith("norm.weight") or ".pre_fc_norm_" in name:
        return 0.1
    if name.endswith((".bias", "_bias")):
        return 0.1
    part = leaf[-1] if leaf[-2] == "experts" else leaf[-2]         # (an MoE layer's fused expert tensors)
    ffn = (c.moe_intermediate_size if leaf[-2] == "experts" else
           c.shared_expert_intermediate_size if ".shared_expert." in name else c.intermediate_size)
    fan_in = {"o_proj": c.num_heads * c.head_dim, "down_proj": ffn, "fc": 2 * c.hidden_size}.get(part, c.hidden_size)
    out_scale = 1.0 / math.sqrt(2 * c.num_layers) if part in ("o_proj", "down_proj") else 1.0
    return out_scale / math.sqrt(fan_in)


class _no_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- fused elementwise kernels (GPU)
# A decode step at a small model is launch-bound: eagerly (or replayed from a CUDA graph of the eager step) a
# Qwen3 layer runs ~68 kernels, two dozen of them the four RMSNorms' pow / mean / add / rsqrt / mul / mul,
# a dozen the rotary's slices, products and cat (bench/README's modeled step).  On a GPU, in the default mode,
# without gradients (the kernels have no backward) and outside torch.compile (whose inductor fuses them
# itself), three Triton kernels do that work instead:
#   _norm_kernel      the residual add and the RMSNorm after it (rows of [M, N]): one kernel for x + delta
#                     and norm(x + delta), each element read once (a block's MLP output is added where the
#                     next block's input norm, or the final norm, reads the sum: ``_block``'s ``before``)
#   _norm_rope_kernel a q or k head's RMSNorm (q_norm / k_norm) and the rotary embedding: one program per
#                     (token, head) row, each element and its rotary partner read once; q's and k's heads in
#                     one launch where they sit side by side in the qkv product (no attention gate); in an
#                     engine's step, k's rows written straight into the KV pool and v's copied there beside
#                     them (the KV append, no launch of its own: ``layers_forward``'s ``kv_slots``)
#   _swiglu_kernel    silu(gate) * up from the fused gate_up product
# Each rounds where the torch expression it replaces rounds (the add and the norm's output to the model's
# dtype, the rotary in fp32); only the sum of squares is summed in another order (the default mode's
# tolerance; the batch-invariant mode never takes these kernels).  ``FUSED_KERNELS``: True (on CUDA tensors),
# False (never), "always" (CPU tensors too, under TRITON_INTERPRET=1: the tests and the kernel observatory).

FUSED_KERNELS = True


def _fused(x: torch.Tensor, invariant: bool) -> bool:
    """Whether the fused kernels run for x: a CUDA tensor (any, with "always"), Triton present, the default
    mode, no gradient recorded (they have no backward: an engine's steps, token_logprobs under no_grad), not
    compiling."""
    return (bool(FUSED_KERNELS) and triton is not None and (x.is_cuda or FUSED_KERNELS == "always")
            and not invariant and not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x [T, N] or [T, H, N] with unit stride in N -> (rows T H, heads H, token stride, head stride)."""
    if x.stride(-1) != 1:
        raise ValueError("the fused kernels read rows of unit stride")
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def fused_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)) with h = x + delta (x itself when delta is None), x / delta [T, N], one kernel (CUDA, or
    CPU tensors under TRITON_INTERPRET=1): ``_rms_norm``'s values, the sum of squares in the kernel's order."""
    m, n = x.shape
    h = torch.empty_like(x) if delta is not None else x
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        res = delta if delta is not None else x
        _norm_kernel[(m,)](x, res, h, y, weight, n, x.stride(0), res.stride(0), h.stride(0), eps,
                           HAS_RES=delta is not None, ZERO_CENTERED=zero_centered,
                           BLOCK_N=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8)
    return h, y


def fused_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, zero_centered: bool = False) -> torch.Tensor:
    """``_rotate(_rms_norm(x, weight, eps))`` (no norm when weight is None) in one kernel: x [T, H, D] (a view
    of the qkv product is fine: unit stride in D), cos / sin [T, 1, R/2] fp32 -> [T, H, D] contiguous."""
    t, heads, d = x.shape
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t * heads:
        rows, _, stride_t, stride_h = _rows(x)
        cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
        w = weight if weight is not None else x
        _norm_rope_kernel[(rows,)](x, w, w, cos, sin, out, out, x, x, cos, heads, heads, stride_t, stride_h, 0, 0, d,
                                   cos.shape[1], eps, HAS_NORM=weight is not None, ZERO_CENTERED=zero_centered,
                                   TO_CACHE=False, BLOCK_D=triton.next_power_of_2(d))
    return out


def fused_qk_norm_rope(qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, zero_centered: bool = False, *,
                       v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                       v_cache: torch.Tensor | None = None,
                       slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fused_norm_rope`` of q and of k in one launch: qk [T, H_q + H_kv, D] (the qkv product's first columns,
    q's heads then k's: a view, unit stride in D), the first ``q_heads`` heads with q_weight, the rest with
    k_weight (None: no norm) -> (q [T, H_q, D], k [T, H_kv, D]), each contiguous and equal, bit for bit, to its
    own ``fused_norm_rope``.

    With ``k_cache`` / ``v_cache`` [S, H_kv, D] (a KV pool's slots: a paged cache's [pages, page_size, H_kv,
    D] flattened; qk's dtype, contiguous), ``slots`` [T] int64 and ``v`` [T, H_kv, D] (unit stride in D), the
    same launch is a decode step's KV append: token t's k rows go to k_cache[slots[t]] (the values k would
    hold) and its v rows are copied to v_cache[slots[t]]; returns (q, None)."""
    t, heads, d = qk.shape
    h_kv = heads - q_heads
    q = torch.empty(t, q_heads, d, dtype=qk.dtype, device=qk.device)
    to_cache = k_cache is not None
    if to_cache:
        _check_kv_destination(qk, v, k_cache, v_cache, slots, h_kv)
        k = None
    else:
        k = torch.empty(t, h_kv, d, dtype=qk.dtype, device=qk.device)
    if t * heads:
        rows, _, stride_t, stride_h = _rows(qk)
        cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
        v_in, v_out, k_out = (v, v_cache, k_cache) if to_cache else (qk, qk, k)
        _norm_rope_kernel[(rows,)](qk, q_weight if q_weight is not None else qk,
                                   k_weight if k_weight is not None else qk, cos, sin, q, k_out, v_in, v_out,
                                   slots if to_cache else cos, heads, q_heads, stride_t, stride_h,
                                   v_in.stride(0), v_in.stride(1), d, cos.shape[1], eps,
                                   HAS_NORM=q_weight is not None, ZERO_CENTERED=zero_centered, TO_CACHE=to_cache,
                                   BLOCK_D=triton.next_power_of_2(d))
    return q, k


def _check_kv_destination(qk: torch.Tensor, v, k_cache: torch.Tensor, v_cache, slots, h_kv: int) -> None:
    """``fused_qk_norm_rope``'s KV-append arguments: their presence, shapes, dtypes and layouts (the slots'
    values are the caller's: a slot out of range is an out-of-bounds write, as in any KV append)."""
    t, _, d = qk.shape
    if v is None or v_cache is None or slots is None:
        raise ValueError("fused_qk_norm_rope writes the KV cache with k_cache, v_cache, slots and v together")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or tuple(cache.shape[1:]) != (h_kv, d) or cache.dtype != qk.dtype:
            raise ValueError(f"{name} must be [S, {h_kv}, {d}] {qk.dtype}, got {tuple(cache.shape)} {cache.dtype}")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if tuple(v.shape) != (t, h_kv, d) or v.dtype != qk.dtype or v.stride(-1) != 1:
        raise ValueError(f"v must be [{t}, {h_kv}, {d}] {qk.dtype} with unit stride in D, got {tuple(v.shape)} "
                         f"{v.dtype}")
    if tuple(slots.shape) != (t,) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be [{t}] int64, got {tuple(slots.shape)} {slots.dtype}")


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (gate and up [T, I], views of the gate_up product) in one kernel -> [T, I]."""
    m, n = gate.shape
    out = torch.empty(m, n, dtype=gate.dtype, device=gate.device)
    if m and n:
        block = min(1024, triton.next_power_of_2(n))
        _swiglu_kernel[(m, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=block)
    return out


if triton is not None:
    @triton.jit
    def _norm_kernel(x, res, h, y, w, N, stride_x, stride_r, stride_h, eps, HAS_RES: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        o = tl.arange(0, BLOCK_N)
        m = o < N
        b_x = tl.load(x + row * stride_x + o, mask=m, other=0)
        if HAS_RES:                         # x + delta, rounded to the model's dtype as torch's add rounds it
            b_x = (b_x.to(tl.float32) + tl.load(res + row * stride_r + o, mask=m, other=0).to(tl.float32)
                   ).to(b_x.dtype)
            tl.store(h + row * stride_h + o, b_x, mask=m)
        b_f = b_x.to(tl.float32)
        b_n = b_f * tl.rsqrt(tl.sum(b_f * b_f, axis=0) / N + eps)
        b_w = tl.load(w + o, mask=m, other=0).to(tl.float32)
        if ZERO_CENTERED:
            b_y = b_n * (1.0 + b_w)
        else:                               # the normed row in the model's dtype, times the weight
            b_y = b_n.to(b_x.dtype).to(tl.float32) * b_w
        tl.store(y + row * N + o, b_y.to(y.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_kernel(x, w, w2, cos, sin, out, out2, v, v_out, slots, H, H1, stride_t, stride_h, stride_vt,
                          stride_vh, D, HALF, eps, HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                          TO_CACHE: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)                                 # (token, head) = (row // H, row % H)
        t = row // H
        head = row % H
        src = x + t * stride_t + head * stride_h
        o = tl.arange(0, BLOCK_D)
        m = o < D
        if head < H1:                       # heads 0 .. H1 - 1: weight w, into out [T, H1, D] (q, or all)
            dst = out + (t * H1 + head) * D
        else:                               # the rest: weight w2, into out2 [T, H - H1, D] (k) at row t, or
            w = w2                          # into the KV pool [S, H - H1, D] at token t's slot, v's row beside
            at = t
            if TO_CACHE:
                at = tl.load(slots + t)
                b_v = tl.load(v + t * stride_vt + (head - H1) * stride_vh + o, mask=m)
                tl.store(v_out + (at * (H - H1) + head - H1) * D + o, b_v, mask=m)
            dst = out2 + (at * (H - H1) + head - H1) * D
        rotary = o < 2 * HALF
        partner = tl.where(o < HALF, o + HALF, tl.where(rotary, o - HALF, o))   # the other half of its pair
        b_x = tl.load(src + o, mask=m, other=0)
        b_p = tl.load(src + partner, mask=m, other=0)
        b_f, b_pf = b_x.to(tl.float32), b_p.to(tl.float32)
        if HAS_NORM:                        # the head's RMSNorm, each value rounded as q_norm / k_norm round it
            r = tl.rsqrt(tl.sum(b_f * b_f, axis=0) / D + eps)
            b_w = tl.load(w + o, mask=m, other=0).to(tl.float32)
            b_wp = tl.load(w + partner, mask=m, other=0).to(tl.float32)
            if ZERO_CENTERED:
                b_f = (b_f * r * (1.0 + b_w)).to(b_x.dtype).to(tl.float32)
                b_pf = (b_pf * r * (1.0 + b_wp)).to(b_x.dtype).to(tl.float32)
            else:
                b_f = ((b_f * r).to(b_x.dtype).to(tl.float32) * b_w).to(b_x.dtype).to(tl.float32)
                b_pf = ((b_pf * r).to(b_x.dtype).to(tl.float32) * b_wp).to(b_x.dtype).to(tl.float32)
        j = tl.where(rotary, o % HALF, 0)
        b_c = tl.load(cos + t * HALF + j, mask=m & rotary, other=1.0)
        b_s = tl.load(sin + t * HALF + j, mask=m & rotary, other=0.0)
        b_s = tl.where(o < HALF, -b_s, b_s)          # x1 cos - x2 sin, x2 cos + x1 sin; the rest as it is
        b_y = tl.where(rotary, b_f * b_c + b_pf * b_s, b_f)
        tl.store(dst + o, b_y.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_kernel(gate, up, out, N, stride_g, stride_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        b_g = tl.load(gate + row * stride_g + o, mask=m, other=0)
        b_gf = b_g.to(tl.float32)
        b_act = (b_gf / (1.0 + tl.exp(-b_gf))).to(b_g.dtype).to(tl.float32)   # silu, rounded as F.silu's
        b_u = tl.load(up + row * stride_u + o, mask=m, other=0).to(tl.float32)
        tl.store(out + row * N + o, (b_act * b_u).to(out.dtype.element_ty), mask=m)


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

def _set_invariant(module, index: int, linear, out_linear, plugin: str = "linear_layer") -> None:
    """A plug-in layer's batch-invariant mode: ``linear`` for its projections, ``out_linear`` for its
    row-parallel output projection (the reduction tree's leaves on this rank)."""
    if not callable(getattr(module, "set_batch_invariant", None)):
        raise ValueError(f"batch_invariant=True: the {plugin} plug-in of layer {index} ({type(module).__name__}) "
                         f"has no set_batch_invariant(linear) method, so its numerics cannot be made batch-invariant")
    module.set_batch_invariant(linear, out_linear=out_linear)


def _no_mtp_head() -> ValueError:
    return ValueError("this model has no MTP head: build it with DecoderLM(..., mtp=True)")


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
