"""Tiny random Hugging Face models of every family decoder_lm.py reads, for the tests (nothing is downloaded).

Every parameter is perturbed away from its init: a zero-initialised norm (Qwen3.5's zero-centred ones),
a bias of zeros or a default gate would hide a missing ``1 + w``, a dropped bias or a swapped gate.
transformers' Qwen3.5 runs its own PyTorch delta rule and conv (``use_torch_delta_rule``), never fla's
kernels, so it stays an independent oracle even where fla is installed (``make roofline`` installs it).
"""
from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_5_text", "qwen3_5", "qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe",
            "gpt_oss")
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe", "gpt_oss")
# Router weights are scaled up by this much after the perturbation: logits spread over a few units, so the
# top-k has no near-ties a 1e-6 rounding difference could flip (the tests measure the smallest margin).
ROUTER_SCALE = 30.0
VOCAB = 97


# The released configs' sizes (vocab and head layout as released, max_position_embeddings too): real-size
# checkpoints with random weights, for the memory-budget tests and bench/decoder_lm.py.
REAL_SIZES = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_theta=1000000.0, torch_dtype="bfloat16"),
    "qwen3.5-0.8b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                         num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="bfloat16",
                         rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
}
def write_real_size_checkpoint(shape: str, path, *, max_position_embeddings: int | None = None) -> None:
    """config.json and model.safetensors (bf16, as released) of a random model of REAL_SIZES[shape], the config
    as released unless ``max_position_embeddings`` overrides it.  The weights are small (std 0.02) and cheap:
    each tensor a stretch of one bank of 10^6 + 3 random numbers repeated (drawing 0.6B numbers takes half
    a minute on two cores; what the tests and benches measure here does not depend on the values)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    import fast.decoder_lm as lm
    import ref.gated_deltanet as gdn
    raw = dict(REAL_SIZES[shape])
    if max_position_embeddings is not None:
        raw["max_position_embeddings"] = max_position_embeddings
    config = lm.ModelConfig.from_hf(raw, max_seq_len=64)
    model = lm.DecoderLM(config, linear_layer=gdn.GatedDeltaNet, device="meta", dtype=torch.bfloat16)
    bank = (torch.randn(10 ** 6 + 3, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    tensors, offset = {}, 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        n = t.numel()
        tensors[name] = bank.roll(-offset % bank.numel()).repeat(n // bank.numel() + 1)[:n].view(t.shape).clone()
        offset += n
        if name.endswith("norm.weight"):
            tensors[name] += 1 if not config.zero_centered_norm else 0
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))


def hf_config(family: str, *, tie: bool | None = None, layers: int = 4, max_positions: int = 256, **overrides):
    """A transformers config of ``family`` at test size (odd sizes; GQA 4/2; llama3 rope scaling for
    llama; Qwen3.5: 3 Gated DeltaNet layers + 1 gated attention layer, GVA 2/4, partial rotary; MoE: 6
    experts, top 2, Qwen3-MoE with a dense layer (mlp_only_layers) and unnormalised top-k probabilities,
    Qwen3.5-MoE with its shared expert)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
    if overrides and family != "gpt_oss":
        raise ValueError(f"size overrides are gpt_oss's only here, got {sorted(overrides)} for {family}")
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    qwen35 = dict(common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_conv_kernel_dim=4)
    if family == "llama":
        return LlamaConfig(**common, head_dim=12, tie_word_embeddings=bool(tie), rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True if tie is None else tie,
                           rope_parameters=dict(rope_type="default", rope_theta=1e6))
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=bool(tie))
    if family == "qwen3_5_text":
        return Qwen3_5TextConfig(**qwen35, tie_word_embeddings=bool(tie))
    if family == "qwen3_5":
        return Qwen3_5Config(text_config=qwen35, tie_word_embeddings=bool(tie), vision_config=VISION)
    experts = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, **experts, head_dim=16, tie_word_embeddings=bool(tie), norm_topk_prob=False,
                              mlp_only_layers=[layers - 2])
    qwen35_moe = dict({k: v for k, v in qwen35.items() if k != "intermediate_size"}, **experts,
                      shared_expert_intermediate_size=40)
    if family == "qwen3_5_moe_text":
        return Qwen3_5MoeTextConfig(**qwen35_moe, tie_word_embeddings=bool(tie))
    if family == "qwen3_5_moe":
        return Qwen3_5MoeConfig(text_config=qwen35_moe, tie_word_embeddings=bool(tie), vision_config=VISION)
    if family == "gpt_oss":    # sliding / full layers (window 5: the tests' sequences cross it), sinks, yarn, biases
        from transformers import GptOssConfig
        sizes = dict({k: v for k, v in common.items() if k != "intermediate_size"}, head_dim=12, intermediate_size=24)
        return GptOssConfig(**dict(sizes, **overrides), num_local_experts=6, num_experts_per_tok=2, sliding_window=5,
                            tie_word_embeddings=bool(tie), rope_parameters=dict(
                                rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                truncate=False, original_max_position_embeddings=8))
    raise ValueError(family)


VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=48)


def hf_model(family: str, *, seed: int = 0, dtype=torch.float32, **config_kw):
    """A transformers model of ``family`` (``AutoModelForCausalLM``, or ``Qwen3_5ForConditionalGeneration``
    for the multimodal qwen3_5), random, every parameter perturbed, in eval mode."""
    import transformers
    use_torch_delta_rule()
    cfg = hf_config(family, **config_kw)
    torch.manual_seed(seed)
    if family in ("qwen3_5", "qwen3_5_moe"):
        model = (transformers.Qwen3_5ForConditionalGeneration if family == "qwen3_5" else
                 transformers.Qwen3_5MoeForConditionalGeneration)(cfg).to(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            neutral = any(k in name for k in ("norm", "bias", "A_log", "dt_bias"))
            p.add_((torch.randn(p.shape, generator=gen) * (0.2 if neutral else 0.02)).to(p.dtype))
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):   # an MoE router: sharp (ROUTER_SCALE)
                p.mul_(ROUTER_SCALE)
    model.generation_config.eos_token_id = None          # greedy runs to max_new_tokens, as the engines do
    return model.eval()


def use_torch_delta_rule() -> None:
    """Make transformers' Qwen3.5 (and Qwen3.5-MoE) run its own PyTorch delta rule and causal conv, not fla's
    kernels."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    for m in (modeling_qwen3_5, modeling_qwen3_5_moe):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):
            fn = getattr(m, name)
            setattr(m, name, getattr(fn, "__wrapped__", fn))


def hf_router_margin(model, sequences: list) -> float:
    """The smallest gap, over every token of ``sequences`` (each run alone) and every MoE layer, between the
    k-th and the (k+1)-th largest router logit of transformers' model: how far the top-k is from a tie."""
    routers = [m for n, m in model.named_modules() if n.endswith(("mlp.gate", "mlp.router")) and hasattr(m, "top_k")]
    margins = []

    def hook(module, args, out):
        top = out[0].float().topk(module.top_k + 1, dim=-1).values           # router_logits [T, E]
        margins.append((top[:, -2] - top[:, -1]).min().item())
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        for s in sequences:
            with torch.no_grad():
                model(torch.tensor([s], device=next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    assert routers and margins, "not an MoE model"
    return min(margins)


def hf_logprobs(model, sequence: list, prompt_len: int) -> torch.Tensor:
    """transformers' logprobs of a sequence's completion tokens, one forward over the sequence alone (on the
    model's device; returned on the CPU)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([sequence], device=device)).logits[0].float().cpu()
    logp = torch.log_softmax(logits[prompt_len - 1:-1], dim=-1)
    return logp.gather(1, torch.tensor(sequence[prompt_len:])[:, None])[:, 0]


def hf_greedy(model, prompt: list, n: int) -> list:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
