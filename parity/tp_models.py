"""The tiny models of the tensor-parallel and weight-sync tests (parity/test_tensor_parallel.py,
parity/tp_probe.py, parity/ws_probe.py): every head count small enough for tp = 4 to replicate KV heads and
Gated DeltaNet key heads, with Qwen3.5's numerics switched on (q/k norms, the attention output gate,
zero-centred norms, partial rotary) so a shard cut at the wrong boundary changes the result.  The "moe" kind
is the hybrid with Qwen3.5-MoE's blocks (8 experts, top 3, a shared expert) for expert parallelism; "gpt_oss" the
attention-only model with gpt-oss's sinks, sliding window, biases and experts (4, top 2)."""
from __future__ import annotations


def config(kind: str, mod):
    """``mod.ModelConfig`` (mod: ref/ or fast/ decoder_lm) of the attention-only model (4 query heads, 2 KV
    heads) or, for kind "hybrid", a Gated DeltaNet layer (Hk = 2, Hv = 4) then a gated attention layer; "moe": the
    hybrid with Mixture-of-Experts MLPs (8 experts of FFN 12, top 3, a shared expert of 20: tp = 4 holds 2 each)."""
    kw = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, max_seq_len=64, tie_embeddings=False, qk_norm=True, attn_output_gate=True,
              zero_centered_norm=True, partial_rotary_factor=0.5)
    if kind in ("hybrid", "moe"):
        kw.update(layer_types=("linear", "attention"), linear_num_k_heads=2, linear_num_v_heads=4,
                  linear_head_k_dim=8, linear_head_v_dim=8)
    if kind == "moe":
        kw.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=12, shared_expert_intermediate_size=20)
    if kind == "gpt_oss":       # gpt-oss's flags instead of Qwen3.5's: sinks, a 3-key window on layer 0, biases
        kw.update(qk_norm=False, attn_output_gate=False, zero_centered_norm=False, partial_rotary_factor=1.0,
                  qkv_bias=True, o_proj_bias=True, attention_sinks=True, sliding_window=3, sliding_layers=(0,),
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, moe_style="gpt_oss",
                  swiglu_limit=1.5)
    return mod.ModelConfig(**kw)
