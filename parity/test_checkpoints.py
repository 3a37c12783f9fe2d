"""Real checkpoints: decoder_lm.py (ref and fast) and the generator engines on Hugging Face checkpoints of
Llama 3, Qwen2 / Qwen2.5, Qwen3, Qwen3.5 (text, and the text model of the multimodal checkpoint), Qwen3-MoE,
Qwen3.5-MoE (text and multimodal: Gated DeltaNet + MoE with the shared expert) and gpt-oss (sinks, sliding
windows, biases, clamped experts).

The oracle is transformers itself, on tiny random models every parameter of which is perturbed
(parity/hf_models.py), written with ``save_pretrained`` (one file, and sharded) and read back by this repo's
own safetensors reader.  In fp32 on a CPU: ``token_logprobs`` and every engine logprob within 1e-4 of
transformers' per-sequence forward (measured: ~1e-6), greedy generation token for token equal to
``generate(do_sample=False)``, for every family, both files, the fast engine with its default attention and
with this repo's kernels plugged in (Triton interpreter).  With ``batch_invariant=True`` the fast engine's
logprobs equal the model's ``token_logprobs`` bit for bit on Qwen3, Qwen3.5, Qwen3-MoE, Qwen3.5-MoE and
gpt-oss checkpoints (and stay within 1e-4 of transformers) through the prefix cache, groups, chunked prefill
and preemption (so the engine's experts are the trainer's: no routing mismatch).  MoE routers are sharp: the
tests measure the smallest top-k margin.  In bf16 on a GPU (the GPU tier): the fast model on this repo's
kernels within the repo's tolerance rule against transformers' fp64 forward, with transformers' own bf16 run
on the same GPU as the yardstick.  A checkpoint is untrusted input: truncated or corrupted safetensors files
raise ValueError naming the file and tensor.
"""
from __future__ import annotations

import copy
import functools
import json
import struct

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.flash_decoding as fast_fd
import fast.gated_deltanet as fast_gdn
import fast.generator_engine as fast_ge
import fast.moe as fast_moe
import fast.paged_varlen_attention as fast_pva
import ref.decoder_lm as ref_lm
import ref.gated_deltanet as ref_gdn
import ref.generator_engine as ref_ge
import ref.moe as ref_moe
from conftest import DEVICE, check_close, requires_gpu
from hf_models import FAMILIES, MOE_FAMILIES, VOCAB, hf_greedy, hf_logprobs, hf_model, hf_router_margin

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TOL = 1e-4
IMPLS = [pytest.param((ref_lm, ref_ge), id="ref"), pytest.param((fast_lm, fast_ge), id="fast")]
FAST_GDN = functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=fast_gdn.chunk_gated_delta_rule,
                             recurrent_fn=fast_gdn.fused_recurrent_gated_delta_rule)
PLUGINS = dict(linear_layer=ref_gdn.GatedDeltaNet, moe_layer=ref_moe.MoE)        # (used where a family has them)
MIN_ROUTER_MARGIN = 1e-4    # the top-k's smallest logit gap must dwarf fp32 rounding (~1e-6 here)


def _prompts(seed: int, lengths=(5, 17, 33)) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _greedy_error(hf, prompts: list, completions: list, n: int, family: str) -> float:
    """Every sample's n tokens equal transformers' greedy ``generate``; returns the largest |logprob -
    transformers' logprob| (teacher-forced on the sample)."""
    worst = 0.0
    for p, c in zip(prompts, completions):
        for sample in c if isinstance(c, list) else [c]:
            assert sample.token_ids == hf_greedy(hf, p, n), f"{family}: tokens differ from transformers' generate"
            hf_lp = hf_logprobs(hf, p + sample.token_ids, len(p))
            worst = max(worst, (torch.tensor(sample.logprobs) - hf_lp).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its checkpoint directory); the odd families sharded."""
    out = {}
    for n, family in enumerate(FAMILIES):
        model = hf_model(family, seed=n)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path, max_shard_size="40KB" if n % 2 else "1GB")
        out[family] = (model, path)
    return out


# ----------------------------------------------------------------------------- equal to transformers

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_token_logprobs_equal_transformers(checkpoints, family, impl):
    lm, _ = impl
    hf, path = checkpoints[family]
    model = lm.DecoderLM.from_pretrained(path, **PLUGINS)
    assert model.config.weight_prefix == ("model.language_model." if family in ("qwen3_5", "qwen3_5_moe") else "model.")
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, VOCAB, (21,), generator=gen).tolist()
    seqs = [prompt + torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 70)]   # a group
    seqs.append(torch.randint(1, VOCAB, (40,), generator=gen).tolist())                         # and another
    prompts = [21, 21, 21, 13]
    want = [hf_logprobs(hf, s, p) for s, p in zip(seqs, prompts)]
    if family in MOE_FAMILIES:
        margin = hf_router_margin(hf, seqs)
        print(f"{family}: smallest router top-k margin {margin:.2e}")
        assert margin > MIN_ROUTER_MARGIN
    worst = 0.0
    for share in (True, False):
        got = model.token_logprobs(seqs, prompts, temperature=0.0, share_prompts=share)
        worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want)))
    print(f"{family} {lm.__name__}: max |token_logprobs - transformers| = {worst:.2e}")
    assert worst <= TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_transformers_generate(checkpoints, family, impl):
    """Greedy tokens equal generate(do_sample=False); each logprob within TOL of transformers' forward.  (gpt-oss:
    prompts and outputs run past its window of 5 keys.)"""
    lm, ge = impl
    hf, path = checkpoints[family]
    prompts = _prompts(7)
    with ge.Generator.from_pretrained(path, model_class=lm.DecoderLM, **PLUGINS) as g:
        got = g.generate([ge.Request(p, ge.SamplingParams(max_new_tokens=12)) for p in prompts])
    worst = _greedy_error(hf, prompts, got, 12, family)
    print(f"{family} {ge.__name__}: max |engine logprob - transformers| = {worst:.2e}")
    assert worst <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_engine_on_this_repos_kernels_equals_transformers(checkpoints, family):
    """The fast engine with fast/paged_varlen_attention, fast/flash_decoding and fast/gated_deltanet plugged
    in (Triton interpreter): greedy tokens equal transformers', logprobs within TOL, with a group and a
    prefix-cache hit in the mix (gpt-oss: every prompt longer than its window, the hit's prefill too)."""
    hf, path = checkpoints[family]
    prompts = _prompts(11, lengths=(6, 19))
    prompts.append(prompts[1][:16] + [5, 6, 7])             # shares the second prompt's first page
    with fast_ge.Generator.from_pretrained(path, model_class=fast_lm.DecoderLM, linear_layer=FAST_GDN,
                                           moe_layer=fast_moe.MoE, varlen_attn=fast_pva.varlen_attn,
                                           flash_decode=fast_fd.flash_decode, page_size=8) as g:
        got = [g.generate([fast_ge.Request(p, fast_ge.SamplingParams(max_new_tokens=6, n=2 if i == 0 else 1))])[0]
               for i, p in enumerate(prompts)]
        assert g.stats()["prefix_hit_tokens"] >= 16
    worst = _greedy_error(hf, prompts, got, 6, family)
    print(f"{family} fast engine + kernels: max |logprob - transformers| = {worst:.2e}")
    assert worst <= TOL


def test_gpt_oss_trainer_on_this_repos_kernels_equals_transformers(checkpoints):
    """The trainer on the kernels: gpt-oss's windows and sinks through varlen_attn (its lse), its experts on
    fast/moe.py."""
    hf, path = checkpoints["gpt_oss"]
    model = fast_lm.DecoderLM.from_pretrained(path, moe_layer=fast_moe.MoE, varlen_attn=fast_pva.varlen_attn)
    seqs = _prompts(11, lengths=(19, 30))
    got = model.token_logprobs(seqs, [6, 6], temperature=0.0)
    worst = max((g - hf_logprobs(hf, q, 6)).abs().max().item() for g, q in zip(got, seqs))
    print(f"gpt_oss trainer + kernels: max |logprob - transformers| = {worst:.2e}")
    assert worst <= TOL


@pytest.mark.parametrize("attention", ["torch", "kernels"])
def test_gpt_oss_engine_through_chunks_groups_and_preemption(checkpoints, attention):
    """gpt-oss in the fast engine where a window could slip: prompts prefilled in chunks of at most 10 tokens
    (past the window of 5, across pages of 4), prefix-cache hits, a group of two (kernels: cascade_decode on
    the full layers, flash_decode from the window's first key on the sliding ones) and a pool too small for
    the batch (preemption, then recomputation).  Greedy tokens equal transformers' generate, logprobs within
    TOL.  torch: the engine's in-file default attention; kernels: this repo's (Triton interpreter)."""
    hf, path = checkpoints["gpt_oss"]
    calls = {"cascade": 0, "window": 0}

    def cascade(*args, **kw):
        calls["cascade"] += 1
        return fast_fd.cascade_decode(*args, **kw)

    def decode(*args, **kw):
        calls["window"] += kw.get("cache_leftpad") is not None
        return fast_fd.flash_decode(*args, **kw)
    plug = (dict(moe_layer=fast_moe.MoE, varlen_attn=fast_pva.varlen_attn, flash_decode=decode, cascade_decode=cascade)
            if attention == "kernels" else PLUGINS)
    base = _prompts(13, lengths=(11, 26))
    prompts = [base[0], base[1], base[1][:12] + [3, 4], base[0][:8] + [9] * 9]
    reqs = [fast_ge.Request(p, fast_ge.SamplingParams(max_new_tokens=6, n=2 if i == 1 else 1))
            for i, p in enumerate(prompts)]
    with fast_ge.Generator.from_pretrained(path, model_class=fast_lm.DecoderLM, page_size=4, num_pages=14,
                                           max_prefill_tokens=10, **plug) as g:
        got = g.generate(reqs)
        stats = g.stats()
    assert stats["preemptions"] >= 1 and stats["prefix_hit_tokens"] > 0, stats
    if attention == "kernels":
        assert calls["cascade"] and calls["window"], calls
    worst = _greedy_error(hf, prompts, got, 6, "gpt_oss")
    print(f"gpt_oss fast engine ({attention}), chunks, group, preemption: max |logprob - transformers| = {worst:.2e}")
    assert worst <= TOL


# ----------------------------------------------------------------------------- names, state dicts, dtypes

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_uses_the_checkpoints_names(checkpoints, family, impl):
    """state_dict() round-trips to transformers' names; a trainer's HF state dict loads into a generator as
    it is (the vision tower of the multimodal model is skipped) and changes what it serves."""
    lm, ge = impl
    hf, path = checkpoints[family]
    model = lm.DecoderLM.from_pretrained(path, **PLUGINS)
    hf_sd = hf.state_dict()
    text = {n for n in hf_sd if not n.startswith(model.ignored_weight_prefixes)}
    assert set(model.state_dict()) == text
    assert all(torch.equal(model.state_dict()[n], hf_sd[n]) for n in text)
    trained = hf_model(family, seed=99)
    prompt = _prompts(5, lengths=(9,))[0]
    with ge.Generator(model) as g:
        g.load_weights(trained.state_dict(), 1)
        c = g.generate([ge.Request(prompt, ge.SamplingParams(max_new_tokens=5))])[0]
    assert c.token_ids == hf_greedy(trained, prompt, 5) and c.max_policy_version == 1


def test_dtype_from_the_config_unless_given(tmp_path):
    hf = hf_model("qwen3", dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    for lm in (ref_lm, fast_lm):
        assert lm.DecoderLM.from_pretrained(tmp_path).lm_head.weight.dtype == torch.bfloat16
        model = lm.DecoderLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert model.lm_head.weight.dtype == torch.float32
        assert torch.equal(model.state_dict()["model.norm.weight"], hf.state_dict()["model.norm.weight"].float())


def test_tied_embeddings_one_tensor(checkpoints):
    hf, path = checkpoints["qwen2"]                         # tied
    assert "lm_head.weight" not in fast_lm.checkpoint_tensors(path)     # save_pretrained drops the alias
    for lm in (ref_lm, fast_lm):
        model = lm.DecoderLM.from_pretrained(path)
        assert model.config.tie_embeddings
        assert model.lm_head.weight is model.body.embed_tokens.weight


def test_max_seq_len_caps_the_context(checkpoints):
    _, path = checkpoints["qwen3"]
    model = fast_lm.DecoderLM.from_pretrained(path, max_seq_len=40)
    assert model.config.max_seq_len == 40
    with fast_ge.Generator(model) as g, pytest.raises(ValueError, match="max_seq_len=40"):
        g.submit(fast_ge.Request(list(range(1, 41))))


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bf16_token_logprobs_within_the_tolerance_rule(checkpoints, family):
    """bf16 on a GPU: the fast model with this repo's kernels against transformers' fp64 forward, within twice
    transformers' own bf16 error on the same GPU (the repo's tolerance rule), every family."""
    hf, path = checkpoints[family]
    model = fast_lm.DecoderLM.from_pretrained(path, linear_layer=FAST_GDN, moe_layer=fast_moe.MoE,
                                              dtype=torch.bfloat16, device=DEVICE, varlen_attn=fast_pva.varlen_attn)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, VOCAB, (37,), generator=gen).tolist()
    seqs = [prompt + torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 40, 150)]
    prompts = [37, 37, 37]
    with torch.no_grad():
        got = torch.cat(model.token_logprobs(seqs, prompts, temperature=0.0))
    hf64 = copy.deepcopy(hf).double()
    hf_bf16 = copy.deepcopy(hf).to(device=DEVICE, dtype=torch.bfloat16)
    ref64 = torch.cat([hf_logprobs(hf64, s, p) for s, p in zip(seqs, prompts)])
    lowp = torch.cat([hf_logprobs(hf_bf16, s, p) for s, p in zip(seqs, prompts)])
    check_close(f"{family} bf16 token_logprobs", got, ref64, lowp)


# ----------------------------------------------------------------------------- bitwise on real architectures

@pytest.fixture(scope="module")
def gpt_oss_two_layers(tmp_path_factory):
    """gpt-oss at two layers, one sliding and one full: what the four of ``checkpoints`` hold, at half the
    interpreted kernel launches (its bitwise test below launched about 1,000 at four layers, the most of this file)."""
    model = hf_model("gpt_oss", seed=7, layers=2)
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    path = tmp_path_factory.mktemp("gpt_oss_two_layers")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text", "qwen3_moe", "qwen3_5_moe_text", "gpt_oss"])
def test_batch_invariant_engine_equals_trainer_bitwise(checkpoints, gpt_oss_two_layers, family):
    """batch_invariant=True on a checkpoint with q/k norms (and Qwen3.5's gate, partial rotary, zero-centred
    norms, Gated DeltaNet; MoE layers on fast/moe.py's kernels; gpt-oss's sinks, 5-key sliding windows, biases
    and clamped experts, at two layers: one of each kind): every engine logprob equals token_logprobs bit for
    bit, with groups, prefix-cache hits, chunked prefill and preemption (a pool too small for the batch) in the
    run, and is within TOL of transformers' forward (the mode computes the model, not only the same bits on both
    sides).  With MoE: the engine's tokens go to the trainer's experts, by construction."""
    hf, path = gpt_oss_two_layers if family == "gpt_oss" else checkpoints[family]
    # (ref's chunk form as the linear layer's kernel: the fast Gated DeltaNet kernels' bits in the mode, slow
    # in the interpreter, are test_batch_invariant_engine.py's; this test is about the attention and MoE blocks.)
    kw = dict(linear_layer=ref_gdn.GatedDeltaNet, moe_layer=fast_moe.MoE, batch_invariant=True,
              varlen_attn=fast_pva.varlen_attn)
    trainer = fast_lm.DecoderLM.from_pretrained(path, **kw)
    base = _prompts(13, lengths=(11, 26))
    prompts = [base[0], base[1], base[1][:12] + [3, 4], base[0][:8] + [9] * 9]
    new = 8 if family == "gpt_oss" else 6          # gpt-oss: the last rows' windows (5 keys) leave the prompt
    reqs = [fast_ge.Request(p, fast_ge.SamplingParams(max_new_tokens=new, temperature=1.0, seed=i,
                                                      n=2 if i == 1 else 1)) for i, p in enumerate(prompts)]
    with fast_ge.Generator.from_pretrained(path, model_class=fast_lm.DecoderLM, flash_decode=fast_fd.flash_decode,
                                           page_size=4, num_pages=14, max_prefill_tokens=10, **kw) as g:
        got = g.generate(reqs)
        stats = g.stats()
    assert stats["preemptions"] >= 1 and stats["prefix_hit_tokens"] > 0, stats
    samples = [s for c in got for s in (c if isinstance(c, list) else [c])]
    seqs = [s.prompt_token_ids + s.token_ids for s in samples]
    lens = [len(s.prompt_token_ids) for s in samples]
    with torch.no_grad():
        want = trainer.token_logprobs(seqs, lens, temperature=1.0)
    worst = 0.0
    for s, w in zip(samples, want):
        assert torch.equal(torch.tensor(s.logprobs, dtype=torch.float32), w), (family, s.request_id)
        worst = max(worst, (w - hf_logprobs(hf, s.prompt_token_ids + s.token_ids, len(s.prompt_token_ids))).abs().max())
    print(f"{family} batch-invariant engine == trainer; max |logprob - transformers| = {float(worst):.2e}")
    assert worst <= TOL


# ----------------------------------------------------------------------------- what raises

@pytest.mark.parametrize("lm", [ref_lm, fast_lm], ids=["ref", "fast"])
def test_unsupported_configs_raise(lm):
    base = dict(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    cases = [(dict(model_type="deepseek_v3"), "deepseek_v3.*not supported"),
             (dict(quantization_config=dict(quant_method="fp8")), "quant_method='fp8'"),
             (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, swiglu_alpha=1.5), "swiglu_alpha"),
             (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "original_max_position"),
             (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, mscale=1.0,
                                        original_max_position_embeddings=64)), "mscale"),
             (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8),
              "num_experts_per_tok"),
             (dict(model_type="qwen3_moe", num_experts_per_tok=2, moe_intermediate_size=8), "num_experts"),
             (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                   mlp_only_layers=[3]), "mlp_only_layers"),
             (dict(model_type="mistral"), "mistral"),
             (dict(use_sliding_window=True), "sliding"),
             (dict(layer_types=["sliding_attention"]), "sliding"),
             (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=4.0)), "dynamic"),
             (dict(attention_bias=True), "attention_bias"),
             (dict(hidden_act="gelu"), "gelu"),
             (dict(model_type="qwen3_5"), "text_config"),
             (dict(vocab_size=None), "vocab_size")]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            lm.ModelConfig.from_hf({**base, **change})
    with pytest.raises(ValueError, match="linear_layer"):
        lm.DecoderLM(lm.ModelConfig(layer_types=("linear", "attention")))
    with pytest.raises(ValueError, match="moe_layer=MoE"):
        lm.DecoderLM(lm.ModelConfig(num_experts=4))
    with pytest.raises(ValueError, match="divide num_experts=6"):     # experts shard whole over the ranks
        lm.DecoderLM(lm.ModelConfig(num_experts=6), moe_layer=ref_moe.MoE, tp_group=lm.LocalGroup(4).ranks()[0])
    assert lm.ModelConfig.from_hf(base).qk_norm


@pytest.mark.parametrize("lm", [ref_lm, fast_lm], ids=["ref", "fast"])
def test_hybrid_checkpoint_needs_linear_layer(checkpoints, lm):
    _, path = checkpoints["qwen3_5_text"]
    with pytest.raises(ValueError, match="linear_layer=GatedDeltaNet"):
        lm.DecoderLM.from_pretrained(path)


@pytest.mark.parametrize("lm", [ref_lm, fast_lm], ids=["ref", "fast"])
def test_not_a_checkpoint_says_what_it_looked_for(tmp_path, lm):
    with pytest.raises(ValueError, match="no config.json"):
        lm.DecoderLM.from_pretrained(tmp_path)
    hf_model("qwen3").config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not read")
    with pytest.raises(ValueError, match="model.safetensors.*nothing is unpickled"):
        lm.DecoderLM.from_pretrained(tmp_path)


def test_mismatched_checkpoint_names_every_problem(tmp_path):
    hf = hf_model("qwen3")
    sd = {n: t.contiguous() for n, t in hf.state_dict().items()}
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.0.extra.weight"] = torch.zeros(3)
    sd["model.norm.weight"] = torch.zeros(47)
    _write_checkpoint(tmp_path, hf, sd)
    for lm in (ref_lm, fast_lm):
        with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*unexpected "
                                             r"\['model.layers.0.extra.weight'\].*mis-shaped \['model.norm.weight"):
            lm.DecoderLM.from_pretrained(tmp_path)


def _write_checkpoint(path, hf, tensors: dict) -> None:
    from safetensors.torch import save_file
    hf.config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("lm", [ref_lm, fast_lm], ids=["ref", "fast"])
def test_gpt_oss_mxfp4_experts_are_dequantized_at_load(tmp_path, lm):
    """gpt-oss as released: its experts in MXFP4 (``experts.gate_up_proj_blocks`` [E, 2I, H / 32, 16] uint8, two
    e2m1 codes a byte, and ``_scales`` [E, 2I, H / 32], E8M0; ``down_proj_*`` alike; ``quantization_config``
    mxfp4).  Loaded, the blocks are dequantized in the file: token_logprobs equal transformers' model holding
    the same dequantized experts; a blocks tensor without its scales names both."""
    gen = torch.Generator().manual_seed(6)
    hf = hf_model("gpt_oss", seed=6, layers=2, hidden_size=64, intermediate_size=32)
    e, h, i = 6, 64, 32
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        for proj, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(118, 123, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)  # 2^-9 .. 2^-5
            with torch.no_grad():
                getattr(hf.model.layers[layer].mlp.experts, proj).copy_(
                    ref_moe.dequantize_mxfp4(blocks, scales, dtype=torch.float32))
            del tensors[p + proj]
            tensors[p + proj + "_blocks"], tensors[p + proj + "_scales"] = blocks, scales
    hf.config.quantization_config = {"quant_method": "mxfp4"}
    _write_checkpoint(tmp_path, hf, tensors)
    model = lm.DecoderLM.from_pretrained(tmp_path, moe_layer=ref_moe.MoE)
    seqs = _prompts(8, lengths=(23, 31))
    got = model.token_logprobs(seqs, [7, 9], temperature=0.0)
    worst = max((g - hf_logprobs(hf, q, p)).abs().max().item() for g, q, p in zip(got, seqs, [7, 9]))
    print(f"gpt-oss MXFP4 checkpoint ({lm.__name__}): max |logprob - transformers| = {worst:.2e}")
    assert worst <= TOL
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    _write_checkpoint(tmp_path, hf, tensors)
    with pytest.raises(ValueError, match="down_proj_blocks and .*down_proj_scales"):
        lm.DecoderLM.from_pretrained(tmp_path, moe_layer=ref_moe.MoE)


def _safetensors_bytes(header: dict, data: bytes, header_len: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


CORRUPT = {   # name -> (file bytes, what the error must name)
    "shorter than the length": (b"\x01\x02", "shorter than the 8-byte"),
    "header past the end": (_safetensors_bytes({}, b"", header_len=1 << 40), "runs past the file"),
    "not JSON": (struct.pack("<Q", 5) + b"{oops", "not valid JSON"),
    "not an object": (_safetensors_bytes([1, 2], b""), "JSON object"),
    "unknown dtype": (_safetensors_bytes({"w": dict(dtype="F12", shape=[2], data_offsets=[0, 8])}, bytes(8)),
                      "tensor 'w'.*unknown dtype"),
    "offsets past the data": (_safetensors_bytes({"w": dict(dtype="F32", shape=[4], data_offsets=[0, 16])}, bytes(8)),
                              "tensor 'w'.*out of the data's range"),
    "shape disagrees with bytes": (_safetensors_bytes({"w": dict(dtype="F32", shape=[3], data_offsets=[0, 8])},
                                                      bytes(8)), "tensor 'w'.*12 bytes"),
    "overlap": (_safetensors_bytes({"a": dict(dtype="F32", shape=[2], data_offsets=[0, 8]),
                                    "b": dict(dtype="F32", shape=[2], data_offsets=[4, 12])}, bytes(12)), "overlap"),
    "negative shape": (_safetensors_bytes({"w": dict(dtype="F32", shape=[-1], data_offsets=[0, 0])}, b""),
                       "shape must be"),
    "huge shape": (_safetensors_bytes({"w": dict(dtype="F32", shape=[1 << 40, 1 << 40], data_offsets=[0, 8])},
                                      bytes(8)), "tensor 'w'"),
    "missing field": (_safetensors_bytes({"w": dict(dtype="F32", shape=[2])}, bytes(8)), "data_offsets"),
}


@pytest.mark.parametrize("lm", [ref_lm, fast_lm], ids=["ref", "fast"])
@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupted_safetensors_raise_naming_file_and_tensor(tmp_path, lm, case):
    content, match = CORRUPT[case]
    f = tmp_path / "model.safetensors"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=match) as info:
        lm.read_safetensors(f)
    assert str(f) in str(info.value)


@pytest.mark.parametrize("lm", [ref_lm, fast_lm], ids=["ref", "fast"])
def test_truncated_and_traversing_checkpoints(checkpoints, tmp_path, lm):
    hf, path = checkpoints["qwen3"]
    data = (path / "model.safetensors").read_bytes()
    hf.config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data[:len(data) - 100])             # the last tensor cut short
    with pytest.raises(ValueError, match="model.safetensors.*out of the data's range"):
        lm.DecoderLM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(ValueError, match="not a file name inside the checkpoint directory"):
        lm.DecoderLM.from_pretrained(tmp_path)


def test_reading_maps_the_file_instead_of_copying_it(checkpoints):
    """read_safetensors' tensors view one memory-mapped buffer (no copy per tensor, nothing read eagerly)."""
    _, path = checkpoints["llama"]
    tensors = fast_lm.read_safetensors(path / "model.safetensors")
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1 and len(tensors) > 10
    assert all(torch.equal(tensors[n], t) for n, t in ref_lm.read_safetensors(path / "model.safetensors").items())


# ----------------------------------------------------------------------------- this repo's kernels inside transformers

def test_this_repos_kernels_inside_transformers():
    """A transformers Qwen3.5 model on this repo's kernels: varlen_attn registered through AttentionInterface
    for a packed batch (cu_seq_lens), fast/gated_deltanet.py's functions in fla's place (and a per-document
    conv, which transformers' PyTorch fallback lacks).  Its logits equal the stock model's, run one document
    at a time, within the tolerance rule: at most twice the stock fp32 run's distance from fp64, plus a floor."""
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        cu, longest = kw["cu_seq_lens_q"].to(torch.int32), int(kw["max_length_q"])
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))            # [1, H, T, D] -> [T, H, D]
        out = fast_pva.varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0),
                                   enable_gqa=True)
        return out[None], None

    def conv_per_document(x, weight, bias=None, activation=None, cu_seq_lens_q=None, **kw):   # x [1, C, T]
        width = weight.shape[-1]
        docs = [F.conv1d(F.pad(d, (width - 1, 0)), weight[:, None], bias, groups=x.shape[1])
                for d in x.split(cu_seq_lens_q.diff().tolist(), dim=-1)]
        return F.silu(torch.cat(docs, dim=-1))

    hf = hf_model("qwen3_5_text", seed=8)
    hf64 = copy.deepcopy(hf).double()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (7, 30, 12)]
    with torch.no_grad():
        stock = torch.cat([hf(d[None]).logits[0] for d in docs])
        exact = torch.cat([hf64(d[None]).logits[0] for d in docs])
        saved = {n: getattr(m, n) for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                                            "causal_conv1d_fn")}
        AttentionInterface.register("twofold_varlen", packed_attention)
        try:
            m.torch_chunk_gated_delta_rule = fast_gdn.chunk_gated_delta_rule
            m.torch_recurrent_gated_delta_rule = fast_gdn.fused_recurrent_gated_delta_rule
            m.causal_conv1d_fn = conv_per_document
            hf.set_attn_implementation("twofold_varlen")
            cu = torch.tensor([0, 7, 37, 49])
            ours = hf(torch.cat(docs)[None], position_ids=torch.cat([torch.arange(len(d)) for d in docs])[None],
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30).logits[0]
        finally:
            for n, fn in saved.items():
                setattr(m, n, fn)
    err, stock_err = (ours.double() - exact).abs().max().item(), (stock.double() - exact).abs().max().item()
    print(f"max |ours - fp64| = {err:.2e}, stock fp32: {stock_err:.2e}")
    assert err <= 2 * stock_err + torch.finfo(torch.float32).eps * exact.abs().max().item()
