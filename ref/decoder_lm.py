"""Decoder LM: the reference (readable PyTorch, the specification of the model trainer and generator share).

Example::

    # decoder_lm.py, copied next to this script
    import torch
    from decoder_lm import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig(vocab_size=128, max_seq_len=64), seed=0)   # or DecoderLM.from_pretrained(path)
    ids = torch.randint(0, 128, (1, 12))
    logits = model(ids)                                                       # [1, 12, 128] fp32
    logps = model.token_logprobs([ids[0].tolist()], [4])                      # the 8 completion tokens' logprobs
    print(logits.shape, logps[0].shape)

What it computes
    ``DecoderLM`` is the decoder-only language model of Llama 3, Qwen2 / Qwen2.5, Qwen3, Qwen3.5 (hybrid:
    Gated DeltaNet "linear" layers beside gated full attention), Qwen3-MoE, Qwen3.5-MoE and gpt-oss
    (Mixture-of-Experts MLPs; gpt-oss with attention sinks and sliding-window layers), one model whose architecture
    differences are config flags.  It is the contract between an RL
    trainer and its generators: the trainer runs ``forward`` / ``token_logprobs``, the engines of
    ``generator_engine.py`` run ``layers_forward`` with their KV caches plugged in, and both load the same
    Hugging Face checkpoint (``from_pretrained``) under the checkpoint's own parameter names, so a trainer's
    HF state dict loads into a generator as it is.  A trainer copies this file alone.

The model (pre-norm; x = embed[token]; every norm an RMSNorm computed in fp32)
    norm(x)       x / sqrt(mean(x^2) + eps) * w;  zero_centered_norm (Qwen3.5): * (1 + w) instead
    attention     q = h W_q (+ b_q), k = h W_k (+ b_k), v = h W_v (+ b_v)       qkv_bias: Qwen2 / 2.5
                  attn_output_gate (Qwen3.5): h W_q is [T, H_q, 2 D], per head (query, gate)
                  qk_norm (Qwen3, Qwen3.5): q, k = norm(q), norm(k) over each head's D, before rotary
                  rotary (rotate-half) on each head's first R = D * partial_rotary_factor dims at the
                  token's position p: angle_i = p * inv_freq_i, inv_freq_i = theta^(-2i / R) (llama3
                  scaling: long wavelengths divided by ``rope_factor``, a smooth blend in between)
                  (yarn, gpt-oss: a per-dim ramp between theta^(-2i/R) and that / rope_factor, and cos, sin
                  times 0.1 ln(rope_factor) + 1)
                  o = softmax(q k^T / sqrt(D)) v, causal, GQA (query head j reads KV head j // (H_q / H_kv));
                  the ``sliding_layers`` see their last ``sliding_window`` keys only (gpt-oss); attention
                  sinks (gpt-oss): one more key per head, logit s_h and value 0: o * sigmoid(lse - s_h)
                  gated: o = o * sigmoid(gate);  x += o W_o (+ b_o: gpt-oss)
    linear        x += linear_layer(h): a Gated DeltaNet layer (gated_deltanet.py's ``GatedDeltaNet``)
    mlp           x += W_down(silu(W_gate h) * W_up h),  h = norm(x)
    moe           (the layers of ``ModelConfig.moe_layers``) x += moe_layer(h): a Mixture-of-Experts block
                  (moe.py's ``MoE``: each token through its top-k experts, weighted; Qwen3.5-MoE adds a
                  shared expert scaled by sigmoid(w . h))
    logits        norm(x) W_head^T in fp32 (W_head = the embedding when tied)

Checkpoints (``ModelConfig.from_hf``, ``DecoderLM.from_pretrained``)
    model_type    llama (rope default / llama3), qwen2, qwen3, qwen3_5_text, qwen3_5 (the text model of
                  the multimodal checkpoint: ``model.language_model.*``; the vision tower ``model.visual.*``
                  is skipped, and so is the multi-token-prediction head ``mtp.*`` unless the model is built
                  with ``mtp=True`` (``MTPHead``, ``mtp_forward``, ``mtp_loss``); text positions only, where
                  Qwen3.5's multimodal rotary equals the plain one), qwen3_moe (mlp_only_layers,
                  decoder_sparse_step and norm_topk_prob as transformers reads them), qwen3_5_moe_text and
                  qwen3_5_moe (Qwen3.5's layers with MoE MLPs and the shared expert), gpt_oss (sinks,
                  alternating sliding / full layers, yarn rope, q/k/v/o biases, the clamped SwiGLU experts
                  with biases and a router with a bias; its MXFP4 experts dequantized at load; the engines
                  serve it, except in the batch-invariant mode).  Anything else raises ValueError: other
                  sliding-window layers, other rope types and quantizations, biases other than Qwen2's q/k/v
                  and gpt-oss's.  MoE experts load from per-expert tensors (``experts.{i}.gate_proj.weight``)
                  or transformers' fused ones (``experts.gate_up_proj``); the state dict has the fused names.
    weights       config.json + safetensors, one file or sharded (model.safetensors.index.json), read by
                  the reader in this file: memory-mapped, every header field checked before any tensor
                  is viewed (a checkpoint is untrusted input), copied straight into the parameters.
                  Nothing is unpickled.  dtype from the config's ``dtype`` / ``torch_dtype`` unless given.
    names         ``state_dict()`` uses the checkpoint's names (``model.layers.0.self_attn.q_proj.weight``,
                  ``lm_head.weight``; a tied head is the embedding under both names, as in transformers).

Batch-invariant numerics (``batch_invariant=True``)
    A row's result does not depend on the other rows of the call: every matmul is one [1, K] x [K, N]
    product per row, every reduction over a row's features (norms, the log-softmax's sum) a product with
    a ones vector through it, SiLU / sigmoid composed from exp, and attention through the caller's
    ``varlen_attn(..., batch_invariant=True)``.  fast/decoder_lm.py implements the bitwise on-policy
    contract on these numerics (its docstring states it); this file states them plainly.

Tensor parallelism (``DecoderLM(config, tp_group=group)``, ``from_pretrained(path, tp_group=group)``)
    Megatron's layout by heads, Gated DeltaNet by value heads with their key heads; KV / key heads replicated
    past their count; embedding and lm_head replicated.  ``shard_spec`` states which slice of which tensor a
    rank holds (the section "tensor parallelism" below), ``LocalGroup`` runs ranks as threads of one process:
    this file is the specification; fast/decoder_lm.py runs it over torch.distributed.  Used SPMD: every rank
    returns the full logits and keeps its shards' gradients.  In the batch-invariant mode every row-parallel
    sum is a fixed tree of segments whose subtrees are the ranks' shards: the same bits at tp = 1, 2, 4.
    Mixture-of-Experts blocks are expert-parallel over the same ranks (moe.py's ``expert_group``): E / tp
    whole experts a rank, the router and a shared expert replicated, each rank routing a slice of the
    (replicated) tokens and exchanging the (token, slot) pairs with all-to-all, so the mode's bits hold at
    any tp there too.  gpt-oss's sinks shard with their heads; o_proj's bias is added once, after the sum.

Tensors and types
    input_ids       [B, T] int64, or [1, T] with cu_seqlens [N + 1] int32 (documents packed along T)
    logits          [B, T, vocab_size] fp32
    ModelConfig     sizes (vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
                    head_dim, max_seq_len), rope_theta, rms_eps, tie_embeddings, layer_types (None = all
                    "attention", else "attention" / "linear" per layer), the flags above, rope_type and
                    its llama3 parameters, the linear layers' sizes (linear_num_k_heads, linear_num_v_heads,
                    linear_head_k_dim, linear_head_v_dim, linear_conv_kernel_size), the MoE sizes
                    (num_experts: 0 = dense, num_experts_per_tok, moe_intermediate_size,
                    shared_expert_intermediate_size, norm_topk_prob, mlp_only_layers, decoder_sparse_step,
                    moe_style "qwen" / "gpt_oss", swiglu_limit), gpt-oss's attention (o_proj_bias,
                    attention_sinks, sliding_window, sliding_layers, yarn's rope_beta_fast / _slow /
                    _truncate) and weight_prefix
    linear_layer    a class or factory called with keywords ``hidden_size``, ``num_k_heads``,
                    ``num_v_heads``, ``head_k_dim``, ``head_v_dim``, ``conv_kernel_size``, ``norm_eps``
                    (gated_deltanet.py's ``GatedDeltaNet``, or a ``functools.partial`` of it with the
                    fast kernels), giving a module called as ``m(x [1, T, hidden], cu_seqlens=cu,
                    cache=c)``, ``m(x [B, T, hidden])`` and ``m(x [N, T, hidden], cache=c)``, with
                    ``m.new_cache()`` (the generator engines' contract; gated_deltanet.py's layer has it)
    moe_layer       a class or factory called with keywords ``hidden_size``, ``num_experts``, ``top_k``,
                    ``intermediate_size``, ``norm_topk_prob``, ``shared_intermediate_size`` (and for
                    gpt-oss ``scoring``, ``router_bias``, ``expert_bias``, ``activation``,
                    ``swiglu_limit``, ``layout``) (moe.py's
                    ``MoE``; ref's or fast's), giving a module called as ``m(h [T, hidden]) -> [T, hidden]``,
                    with ``set_batch_invariant(linear)`` for the mode and ``convert_checkpoint(tensors,
                    prefix)`` for a checkpoint's per-expert tensors

Supported, and what raises
    fp32 / fp16 / bf16 weights on any device.  ValueError for bad config values, an unsupported
    checkpoint (naming what is supported), a hybrid model without ``linear_layer``, an MoE model without
    ``moe_layer`` (or at a tp that does not divide its experts), a checkpoint with
    missing, unexpected or mis-shaped tensors (one error listing them), a corrupted or truncated
    safetensors file (naming the file and tensor), ``token_logprobs`` inputs out of range.

References
    Llama 3 (Meta, 2024), Qwen2.5 / Qwen3 / Qwen3.5 (Alibaba, 2024-2026) and Hugging Face transformers'
    modeling files for each (the oracle in parity/test_checkpoints.py); the safetensors format
    (Hugging Face); gpt-fast and nanoGPT (the model in one screen).
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
import zlib
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

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


# ----------------------------------------------------------------------------- the math

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             linear=None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w (zero-centred: * (1 + w), in fp32 as Qwen3.5), fp32 inside.
    ``linear`` (batch-invariant mode): the mean of squares as a product with a ones vector through it."""
    xf = x.float()
    if linear is None:
        mean_sq = xf.pow(2).mean(-1, keepdim=True)
    else:
        mean_sq = linear(xf * xf, torch.ones(1, xf.shape[-1], device=x.device)) / xf.shape[-1]
    normed = xf * torch.rsqrt(mean_sq + eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return normed.to(x.dtype) * weight


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


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """Rotate-half rotary embedding on the first R = 2 * len(inv_freq) dims of each head, fp32 inside, cos and
    sin times ``factor`` (yarn's attention factor).  x [T, H, D]; positions [T] int -> [T, H, D]."""
    r = 2 * inv_freq.shape[0]
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None]     # [T, R/2]
    cos, sin = angles.cos()[:, None] * factor, angles.sin()[:, None] * factor       # [T, 1, R/2]
    xf = x.float()
    x1, x2, rest = xf[..., :r // 2], xf[..., r // 2:r], xf[..., r:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool,
                       window: int = 0, q_offset: int | None = None):
    """softmax(q k^T * scale) v with GQA, fp32 inside, and its log-sum-exp: (out [L_q, H_q, D] in q's
    dtype, lse [H_q, L_q] fp32).  q [L_q, H_q, D]; k, v [L_k, H_kv, D].  Query row i sits at key position
    i + q_offset (default L_k - L_q: bottom-right aligned); causal: it sees keys j <= i + q_offset, and with
    a ``window`` only the last ``window`` of them (j > i + q_offset - window); a row that sees no key gets
    out 0 and lse -inf."""
    l_q, h_q, d = q.shape
    l_k, group = k.shape[0], h_q // k.shape[1]
    kf, vf = (x.float().repeat_interleave(group, dim=1) for x in (k, v))     # [L_k, H_q, D]: head j reads j // G
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale                   # [H_q, L_q, L_k], each head alone
    if causal:
        at = torch.arange(l_q, device=q.device)[:, None] + (l_k - l_q if q_offset is None else q_offset)
        key = torch.arange(l_k, device=q.device)[None]
        hidden = (key > at) | ((key <= at - window) if window else False)
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                         # [H_q, L_q]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", p, vf)                                  # [L_q, H_q, D]
    return o.to(q.dtype), lse


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Attention with a sink per head (gpt-oss): one more key, whose logit is sinks[h] and whose value is 0.
    It adds e^s to the softmax's denominator and nothing to its numerator, so the output over the real keys
    is scaled by e^lse / (e^lse + e^s) = sigmoid(lse - s).  out [L, H, D], lse [H, L], sinks [H].
    invariant: the batch-invariant mode's sigmoid (``_sigmoid``)."""
    scaling = _sigmoid(lse - sinks.float()[:, None], invariant)
    return (out.float() * scaling.t()[..., None]).to(out.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``attention_with_lse``'s output, causal: a prefill over its own keys, or a decode step over the cache."""
    return attention_with_lse(q, k, v, scale, causal=True)[0]


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


# Batch-invariant numerics: a row's bits never depend on the other rows of the call.

INVARIANT_COLUMN_BLOCK = 8


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N], one [1, K] x [K, 8] product per row and block of 8 output
    columns (the last block zero-padded): every BLAS call has one shape, so an element's bits depend on its
    row and column alone, not on how many rows or columns share the call (a CPU BLAS rounds an N-tail
    through other kernels: columns 40..47 of N = 48 round unlike the same columns of a 24-column call).
    Batch-invariant in rows, and in columns across tensor-parallel shards.  Differentiable."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    pad = (-n) % INVARIANT_COLUMN_BLOCK
    w = F.pad(weight, (0, 0, 0, pad)).to(x.dtype) if pad else weight.to(x.dtype)       # [N + pad, K]
    blocks = [torch.bmm(rows[:, None, :], w[j:j + INVARIANT_COLUMN_BLOCK].t().expand(rows.shape[0], -1, -1))[:, 0]
              for j in range(0, n + pad, INVARIANT_COLUMN_BLOCK)]                         # each [M, 8]
    return torch.cat(blocks, dim=-1)[:, :n].reshape(*x.shape[:-1], n)


def _sigmoid(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """sigmoid; invariant: 1 / (1 + exp(-x)) in fp32 (torch's CPU sigmoid rounds a vector loop's tail
    through another formula; exp takes one formula for every element)."""
    if not invariant:
        return torch.sigmoid(x)
    return (1 / (1 + torch.exp(-x.float().clamp(min=-80)))).to(x.dtype)


def _silu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    return F.silu(x) if not invariant else (x.float() * _sigmoid(x.float(), True)).to(x.dtype)


def _log_softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """log_softmax over the last dim; invariant: x - max - log(sum exp(x - max)), the sum a product."""
    if not invariant:
        return torch.log_softmax(x, dim=-1)
    shifted = x - x.amax(-1, keepdim=True).detach()
    return shifted - invariant_linear(shifted.exp(), torch.ones(1, x.shape[-1], device=x.device)).log()


# ----------------------------------------------------------------------------- the modules

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x, linear=None):
        return rms_norm(x, self.weight, self.eps, self.zero_centered, linear)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        q_out = c.num_heads * c.head_dim * (2 if c.attn_output_gate else 1)
        self.q_proj = nn.Linear(c.hidden_size, q_out, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_eps, c.zero_centered_norm)
            self.k_norm = RMSNorm(c.head_dim, c.rms_eps, c.zero_centered_norm)
        if c.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(c.num_heads))


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class Block(nn.Module):
    def __init__(self, c: ModelConfig, kind: str, linear_layer, moe_layer=None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        if kind == "attention":
            self.self_attn = Attention(c)
        else:
            self.linear_attn = linear_layer(**c.linear_layer_sizes())
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        self.mlp = FeedForward(c) if moe_layer is None else moe_layer(**c.moe_layer_sizes())


class TextModel(nn.Module):
    """The body under the checkpoint's prefix: embed_tokens, layers, norm."""

    def __init__(self, c: ModelConfig, linear_layer, moe_layer, seed: int):
        super().__init__()
        # (initialised by DecoderLM; nn.Embedding's own normal_ takes seconds at a real vocab under a meta device)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size))
        blocks = []
        for i, kind in enumerate(c.kinds):
            with torch.random.fork_rng(devices=[]):  # a plug-in's own init, reproducible from the seed
                torch.manual_seed(seed * 1000003 + i)
                blocks.append(Block(c, kind, linear_layer, moe_layer if i in c.moe_layers else None))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)


class MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction head (the checkpoint's ``mtp.*``; vLLM's qwen3_5_mtp.py): row t
    combines the main model's final-normed hidden state at position t with the embedding of the token at
    t + 1 and predicts the token at t + 2,
        x = fc([pre_fc_norm_embedding(embed(x_(t+1))), pre_fc_norm_hidden(h_t)])    (fc: 2 hidden -> hidden)
        y = norm(Block(x))      one full-attention decoder block (its own keys: rows 0 .. t), the model's
                                MLP kind (MoE in an MoE model); logits through the shared lm_head.
    Depth d > 0 (drafting d + 1 tokens ahead) feeds the head's own output y in place of h, through
    ``layers[d % mtp_layers]``."""

    def __init__(self, c: ModelConfig, moe_layer):
        super().__init__()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)
        self.layers = nn.ModuleList(Block(c, "attention", None, moe_layer) for _ in range(c.mtp_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps, c.zero_centered_norm)


class DecoderLM(nn.Module):
    """The decoder-only LM of the module docstring.

    ``DecoderLM(config=None, *, seed=0, linear_layer=None, device=None, dtype=None, batch_invariant=False,
    varlen_attn=None)``: random weights from ``seed`` (drawn on the CPU per tensor name: the same weights
    on every device; not drawn on the "meta" device), or ``DecoderLM.from_pretrained(path, ...)``.
    ``forward(input_ids [B, T], *, cu_seqlens=None) -> logits [B, T, V]`` fp32 trains it (causal per row,
    or per document of ``cu_seqlens`` with B == 1); ``token_logprobs`` is a trainer's recompute of sampled
    tokens; ``layers_forward`` runs the blocks on packed tokens with the caller's attention and linear
    layers' state: the generator engines' entry point.  ``varlen_attn``: the attention of ``forward`` and
    ``token_logprobs`` (fast/paged_varlen_attention.varlen_attn's signature); None = plain PyTorch.
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
        meta = torch.device(device).type == "meta" if device is not None else False
        with torch.device("meta") if meta else _no_context():
            body = TextModel(self.local_config, linear_layer, moe_layer, seed)
            if config.weight_prefix == "model.language_model.":   # the multimodal checkpoint's layout
                self.model = nn.Module()
                self.model.language_model = body
            else:
                self.model = body
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if mtp:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed * 1000003 + config.num_layers)
                    self.mtp = MTPHead(self.local_config, moe_layer if config.moe_layers else None)
                self.ignored_weight_prefixes = ("model.visual.",)
        if config.tie_embeddings:                                # one tensor under both names, as transformers
            self.lm_head.weight = body.embed_tokens.weight
        if not meta and self.tp_size == 1:
            self._init_weights(seed)
        elif not meta:                                           # a shard of the tp = 1 model's weights
            with torch.no_grad():
                full = DecoderLM(config, seed=seed, linear_layer=linear_layer,
                                 moe_layer=self.init_kwargs["moe_layer"]).state_dict()
                for name, p in self.state_dict().items():
                    p.copy_(self.shard_tensor(name, full[name]))
        self.to(device=device, dtype=dtype)
        self.batch_invariant, self.varlen_attn = batch_invariant, varlen_attn
        self.segments = tp_segments(config) if batch_invariant else None
        for i, block in enumerate(self.layers):
            if hasattr(block, "linear_attn") and batch_invariant:
                out_linear = functools.partial(_local_tree, segments=self.segments["out_proj"] // self.tp_size)
                _set_invariant(block.linear_attn, i, invariant_linear, out_linear)
            if i in config.moe_layers and batch_invariant:
                _set_invariant(block.mlp, i, invariant_linear, None, plugin="moe_layer")
        if self.tp_size > 1:
            _register_shared_grad_hooks(self)

    @property
    def body(self) -> TextModel:
        return self.model.language_model if self.config.weight_prefix == "model.language_model." else self.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.body.layers

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Each weight from its own CPU stream (seed, crc32 of its name): the same weights on every device
        and in every layout (fast/decoder_lm.py's fused weights draw their parts alike).  Embeddings get
        std 2 / sqrt(hidden) (logits spread over a few nats), projections 1 / sqrt(fan_in) (o_proj and
        down_proj also / sqrt(2 layers)), biases and norm weights small values around their neutral one
        (a zero or one would hide a missing term), plug-in layers keep their own init."""
        for name, p in self.state_dict().items():
            std = _init_std(name, self.config)
            if std is not None:
                gen = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
                norm = name.endswith("norm.weight") or ".pre_fc_norm_" in name
                base = 1.0 if norm and not self.config.zero_centered_norm else 0.0
                p.copy_(base + torch.randn(p.shape, generator=gen) * std)

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
        """The blocks on packed tokens.  ids, positions [T] -> final-normed hidden [T, hidden].

        ``attend(layer, q [T, H_q, D], k [T, H_kv, D], v) -> [T, H_q, D]`` (norms and rotary applied) and
        ``mix(layer, module, h [T, hidden]) -> [T, hidden]`` (a "linear" layer) belong to the caller:
        they own the caches and the batch layout."""
        lin = invariant_linear if self.batch_invariant else None
        x = self.body.embed_tokens(ids)                                     # [T, hidden], every rank
        for i, block in enumerate(self.layers):
            x = self._block(i, block, x, positions, attend, mix)
        return self.body.norm(x, lin)

    def _block(self, i: int, block: Block, x: torch.Tensor, positions: torch.Tensor, attend, mix) -> torch.Tensor:
        """Decoder block ``i`` on the residual stream x [T, hidden] (``layers_forward``'s callbacks)."""
        c, t = self.local_config, x.shape[0]
        lin = invariant_linear if self.batch_invariant else None
        h = self._to_ranks(block.input_layernorm(x, lin))
        if hasattr(block, "self_attn"):
            a = block.self_attn
            inv_freq, factor = rope_inv_freq(c), rope_attention_factor(c)
            q = self._linear(h, a.q_proj).view(t, c.num_heads, -1)         # [T, H_q, D] or [T, H_q, 2 D]
            q, gate = (q.chunk(2, dim=-1) if c.attn_output_gate else (q, None))
            k = self._linear(h, a.k_proj).view(t, c.num_kv_heads, c.head_dim)
            v = self._linear(h, a.v_proj).view(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = a.q_norm(q, lin), a.k_norm(k, lin)
            q, k = rotary(q, positions, inv_freq, factor), rotary(k, positions, inv_freq, factor)
            o = self._attend(attend, i, q, k, v).reshape(t, c.num_heads * c.head_dim)
            if gate is not None:
                o = o * _sigmoid(gate.reshape(t, -1), self.batch_invariant)
            x = x + self._row_parallel(o, a.o_proj.weight, "o_proj")
            x = x if a.o_proj.bias is None else x + a.o_proj.bias
        else:
            x = x + self._reduce(mix(i, block.linear_attn, h))            # out_proj: row-parallel inside
        m, hm = block.mlp, self._to_ranks(block.post_attention_layernorm(x, lin))
        if not isinstance(m, FeedForward):                                 # a Mixture-of-Experts block
            return x + m(hm)
        act = _silu(self._linear(hm, m.gate_proj), self.batch_invariant) * self._linear(hm, m.up_proj)
        return x + self._row_parallel(act, m.down_proj.weight, "down_proj")

    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend,
                    depth: int = 0) -> torch.Tensor:
        """The MTP head (``MTPHead``; ``DecoderLM(mtp=True)``) on packed rows: next_ids [T] (the token after each
        row's position), positions [T], hidden [T, hidden] (``layers_forward``'s output at those positions, or
        the head's own output one depth up) -> the head's final-normed hidden [T, hidden]; ``logits`` gives
        its distribution over the token two ahead.  ``attend`` is called with layer index num_layers + depth
        % mtp_layers: the head's keys are its own."""
        if getattr(self, "mtp", None) is None:
            raise ValueError("this model has no MTP head: build it with DecoderLM(..., mtp=True)")
        m, lin = self.mtp, invariant_linear if self.batch_invariant else None
        e = m.pre_fc_norm_embedding(self.body.embed_tokens(next_ids), lin)
        x = self._linear(torch.cat([e, m.pre_fc_norm_hidden(hidden, lin)], dim=-1), m.fc)
        layer = depth % len(m.layers)
        x = self._block(len(self.layers) + layer, m.layers[layer], x, positions, attend, None)
        return m.norm(x, lin)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, which: str) -> torch.Tensor:
        """x [T, K_rank] @ weight [N, K_rank]^T summed over the ranks (this rank holds K_rank of K): an
        all-reduce; batch-invariant: the segment tree of ``tp_segments`` (the module docstring)."""
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
        """A row-parallel output summed over the ranks: identity at tp = 1; all-reduce (backward: identity);
        batch-invariant: every rank's subtree root gathered, the tree's upper levels summed on every rank."""
        if self.tp_size == 1:
            return partial
        return _ReduceFromRanks.apply(partial, self.tp_group, self.batch_invariant, self.tp_traffic)

    def _to_ranks(self, h: torch.Tensor) -> torch.Tensor:
        """The replicated input of column-parallel projections: identity forward; backward the ranks'
        partial gradients all-reduced (Megatron's f)."""
        return h if self.tp_size == 1 else _CopyToRanks.apply(h, self.tp_group)

    def _linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        if not self.batch_invariant:
            return layer(x)
        y = invariant_linear(x, layer.weight)
        return y if layer.bias is None else y + layer.bias

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] -> logits [..., V] fp32."""
        w = self.lm_head.weight
        return (invariant_linear(h, w) if self.batch_invariant else h @ w.t()).float()

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """log_softmax over the last dim with the model's numerics (batch-invariant in that mode): what
        ``token_logprobs`` applies to the logits, and what a generator samples with."""
        return _log_softmax(logits, self.batch_invariant)

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        h, _ = self._hidden(input_ids, cu_seqlens)
        return self.logits(h).view(*input_ids.shape, -1)

    def mtp_loss(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Qwen3.5's multi-token-prediction objective, for training the MTP head beside the policy (as slime
        does online, so that drafting keeps up with the moving policy): the mean over every position t whose
        document holds tokens t + 1 and t + 2 of -log p_mtp(x_(t+2) | h_t, x_(t+1)), with h the model's own
        final-normed hidden states (their gradient flows into the trunk too; detach them for the head
        alone).  input_ids / cu_seqlens as ``forward``'s.  fp32 scalar (0 when no position qualifies)."""
        h, lengths = self._hidden(input_ids, cu_seqlens)
        ids = input_ids.reshape(-1)
        starts = list(itertools.accumulate([0, *lengths[:-1]]))
        rows = [(s, n - 1) for s, n in zip(starts, lengths) if n >= 2]  # (first token, MTP rows: t = 0 .. n - 2)
        if not rows:
            return h.sum() * 0.0
        index = torch.cat([torch.arange(s, s + r) for s, r in rows]).to(ids.device)
        positions = torch.cat([torch.arange(r) for _, r in rows]).to(ids.device)
        bounds = [0, *itertools.accumulate(r for _, r in rows)]
        y = self.mtp_forward(ids[index + 1], positions, h[index], self._documents_attention(bounds))
        scored = torch.cat([torch.arange(b, b + r - 1) for b, (_, r) in zip(bounds, rows)]).to(ids.device)
        if scored.numel() == 0:
            return y.sum() * 0.0
        logp = self.log_softmax(self.logits(y[scored]))
        return -logp.gather(1, ids[index[scored] + 2][:, None]).mean()

    def _hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, list]:
        """``forward``'s checks and pass -> (final-normed hidden [B T, hidden], the documents' lengths)."""
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

        def mix(i, module, h):
            if cu_seqlens is None:                                          # b equal rows: [B, T, hidden]
                return module(h.view(b, t, -1)).reshape(h.shape)
            return module(h[None], cu_seqlens=cu)[0]

        h = self.layers_forward(input_ids.reshape(-1), positions, self._documents_attention(bounds), mix)
        return h, lengths

    def _documents_attention(self, bounds: list):
        """attend over documents packed along T (bounds: their starts and the end): each document alone,
        causal; through ``varlen_attn`` when the model has one."""
        scale = self.config.head_dim ** -0.5
        if self.varlen_attn is not None:
            mode = dict(batch_invariant=True) if self.batch_invariant else {}
            cu = torch.tensor(bounds, dtype=torch.int32, device=self.lm_head.weight.device)
            longest = max((e - s for s, e in zip(bounds, bounds[1:])), default=0)

            def attend(i, q, k, v):
                window, sinks = self.attention_window(i), self.attention_sinks(i)
                extra = dict(mode, **({} if sinks is None else dict(sinks=sinks)))
                return self.varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale,
                                        window_size=(window - 1 if window else -1, 0), enable_gqa=True, **extra)
            return attend

        def attend(i, q, k, v):
            window, sinks, outs = self.attention_window(i), self.attention_sinks(i), []
            for s, e in zip(bounds, bounds[1:]):
                o, lse = attention_with_lse(q[s:e], k[s:e], v[s:e], scale, causal=True, window=window)
                outs.append(o if sinks is None else with_sinks(o, lse, sinks, self.batch_invariant))
            return torch.cat(outs)
        return attend

    def attention_window(self, i: int) -> int:
        """Layer i's attention window in keys (0: every earlier key; the MTP head's layers, i >= num_layers)."""
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

    # ------------------------------------------------------------------ what a trainer recomputes

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
        dev = self.lm_head.weight.device
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
            logp = _log_softmax(logits[r] * inv_t, self.batch_invariant)  # [len - p, V]: predict seq[p:]
            out.append(logp.gather(1, torch.tensor(seq[p:], device=dev)[:, None])[:, 0])
        return out

    def _shared_prompt_logits(self, seqs: list, prompts: list):
        """Logits of every distinct prompt's tokens, then of every completion's fed tokens (positions p
        .. len - 2), in one pass; per sequence, the rows that predict its completion tokens."""
        dev, c = self.lm_head.weight.device, self.config
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
        prompts_attention = self._documents_attention(p_bounds)

        def attend(i, q, k, v):
            t_p, window, sinks = p_bounds[-1], self.attention_window(i), self.attention_sinks(i)
            outs = [prompts_attention(i, q[:t_p], k[:t_p], v[:t_p])]
            for g, a, b in zip(group_of, c_bounds, c_bounds[1:]):
                pa, pb = p_bounds[g], p_bounds[g + 1]
                # Cascade: over the prompt's keys (every one, or those in the window: the completion's rows
                # sit at positions pb - pa ...), over its own keys (causal), merged; a sink counts once.
                o_prefix, lse_prefix = attention_with_lse(q[a:b], k[pa:pb], v[pa:pb], scale, causal=True,
                                                          window=window, q_offset=pb - pa)
                o_own, lse_own = attention_with_lse(q[a:b], k[a:b], v[a:b], scale, causal=True, window=window)
                o, lse = merge_states(o_prefix, lse_prefix, o_own, lse_own)
                outs.append((o if sinks is None else with_sinks(o, lse, sinks, self.batch_invariant)).to(q.dtype))
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

    # ------------------------------------------------------------------ checkpoints

    @classmethod
    def from_pretrained(cls, path, *, linear_layer=None, moe_layer=None, dtype=None, device=None,
                        batch_invariant: bool = False, varlen_attn=None, max_seq_len: int | None = None,
                        tp_group=None, mtp: bool = False) -> DecoderLM:
        """The model of a Hugging Face checkpoint directory (config.json + safetensors, one file or
        sharded): weights memory-mapped and copied straight into the parameters, in ``dtype`` (default:
        the checkpoint's) on ``device``.  ``linear_layer``: required for hybrid (Qwen3.5) checkpoints,
        ``moe_layer``: for MoE (Qwen3-MoE, Qwen3.5-MoE) ones, each called with the checkpoint's sizes as
        keywords.  ``max_seq_len`` caps the context.  ``tp_group``:
        this rank reads only its shard's bytes.  ``mtp``: load Qwen3.5's multi-token-prediction head (``mtp.*``)
        too (``mtp_forward``, ``mtp_loss``, the engines' ``speculative="mtp"``)."""
        raw = _read_json_config(path)
        config = ModelConfig(**_hf_fields(raw, max_seq_len))
        dtype = _checkpoint_dtype(raw) if dtype is None else dtype
        model = cls(config, linear_layer=linear_layer, moe_layer=moe_layer, device="meta", dtype=dtype,
                    batch_invariant=batch_invariant, varlen_attn=varlen_attn,
                    tp_group=tp_group, mtp=mtp)   # no memory, no init: the checkpoint fills it
        model.to_empty(device=torch.device("cpu") if device is None else device)
        load_checkpoint(model, path)
        return model


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
    c, tp, rank, group = model.config, model.tp_size, model.tp_rank, model.tp_group
    for name, p in model.named_parameters():
        if not _shared_grad(name, c, tp):
            continue
        spec, full = shard_spec(name, c, tp, rank), model.full_shape(name, p.shape)

        def hook(grad, spec=spec, full=full):
            if spec[0] is None:                                  # replicated: every rank holds all of it
                return _all_reduce(grad.clone(), group)
            whole = grad.new_zeros(full)                         # each rank's rows at their place, summed
            offset = 0
            for a, b in spec[1]:
                whole.narrow(spec[0], a, b - a).copy_(grad.narrow(spec[0], offset, b - a))
                offset += b - a
            return shard(_all_reduce(whole, group), spec)
        p.register_hook(hook)


def _tree_sum(parts: list) -> torch.Tensor:
    """((p0 + p1) + (p2 + p3)) + ...: a fixed binary tree over a power-of-two count of partials."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _local_tree(x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    """The rank's subtree of the batch-invariant reduction: x [.., K_rank] @ weight [N, K_rank]^T as
    ``segments`` invariant matmuls over consecutive K slices, summed as a tree."""
    return _tree_sum([invariant_linear(xs, ws) for xs, ws in zip(x.chunk(segments, -1), weight.chunk(segments, -1))])


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


# ----------------------------------------------------------------------------- input checks

def _check_mode(batch_invariant, varlen_attn) -> None:
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__} {batch_invariant!r}")
    if varlen_attn is not None and not callable(varlen_attn):
        raise TypeError(f"varlen_attn must be None or a function with varlen_attn's signature, got "
                        f"{type(varlen_attn).__name__}")


def _set_invariant(module, index: int, linear, out_linear, plugin: str = "linear_layer") -> None:
    """A plug-in layer's batch-invariant mode: ``linear`` for its projections, ``out_linear`` for its
    row-parallel output projection (the reduction tree's leaves on this rank)."""
    if not callable(getattr(module, "set_batch_invariant", None)):
        raise ValueError(f"batch_invariant=True: the {plugin} plug-in of layer {index} ({type(module).__name__}) "
                         f"has no set_batch_invariant(linear) method, so its numerics cannot be made batch-invariant")
    module.set_batch_invariant(linear, out_linear=out_linear)


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


if __name__ == "__main__":  # a short self-check: packed documents equal each document alone
    m = DecoderLM(ModelConfig(vocab_size=64, max_seq_len=32), seed=0)
    ids = torch.randint(0, 64, (1, 12))
    packed = m(ids, cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32))
    alone = torch.cat([m(ids[:, :5]), m(ids[:, 5:])], dim=1)
    assert (packed - alone).abs().max() < 1e-5
    print("ok:", tuple(packed.shape))
