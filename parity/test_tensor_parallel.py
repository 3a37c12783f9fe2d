"""Tensor parallelism: the layout, the model's collectives, the engine over real processes, bitwise at any tp.

ref/decoder_lm.py is the specification: ``shard_spec`` says which slice of which tensor a rank holds, and
``LocalGroup`` runs tp ranks as threads of one process, so the reference's tensor-parallel forward and
backward are checked here without a network: logits to fp32 rounding at tp = 2 and 4 (bitwise in the
batch-invariant mode), each rank's gradients the matching slices of the tp = 1 gradients.  The fast files
run as real processes over gloo (parity/tp_probe.py, inside a private network namespace the test creates:
loopback only, bounded in time): fast/decoder_lm.py used SPMD as a torchrun trainer would, and
fast/generator_engine.py's ``Generator(..., tensor_parallel_size=N)`` through groups, prefix-cache hits,
chunked prefill, preemption and a weight load, bitwise against tp = 1 and against the trainer in the mode;
a worker killed or hung mid-step fails its generator within ``tp_timeout_s``.  tp = 4 on models with 2 KV
heads (and 2 Gated DeltaNet key heads) replicates them on two ranks each.  Mixture-of-Experts blocks shard
their experts (expert parallelism: E / tp whole experts a rank, tokens dispatched and combined with
all-to-all): the "moe" kind (the hybrid with Qwen3.5-MoE blocks) in the reference, the trainer and the engine,
Qwen3-MoE's per-expert checkpoint tensors read by their experts' ranks only, and gpt-oss (sinks, windows, biases).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest
import torch

import ref.decoder_lm as ref_lm
import ref.gated_deltanet as ref_gdn
import ref.moe as ref_moe
import tp_models
from conftest import on_threads
from netns import run_isolated, unavailable

ROOT = Path(__file__).resolve().parents[1]


def _config(kind: str) -> ref_lm.ModelConfig:
    return tp_models.config(kind, ref_lm)


# ----------------------------------------------------------------------------- the layout (the specification)

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["attention", "hybrid", "moe"])
def test_shards_tile_the_full_tensors(kind, tp):
    """Every rank's slices, put back at the places shard_spec names, rebuild each full tensor: sharded ones
    exactly once, replicated ones (norms, embeddings, replicated KV / key heads, an MoE block's router and
    shared expert) whole on their ranks; experts by the expert dim, E / tp whole experts a rank."""
    c = _config(kind)
    full = ref_lm.DecoderLM(c, seed=3, linear_layer=ref_gdn.GatedDeltaNet, moe_layer=ref_moe.MoE).state_dict()
    for name, t in full.items():
        seen = torch.zeros(t.shape, dtype=torch.int64)
        for rank in range(tp):
            dim, ranges = ref_lm.shard_spec(name, c, tp, rank)
            piece = ref_lm.shard(t, (dim, ranges))
            if dim is None:
                assert torch.equal(piece, t)
                seen += 1
                continue
            offset = 0
            for a, b in ranges:
                assert torch.equal(piece.narrow(dim, offset, b - a), t.narrow(dim, a, b - a))
                seen.narrow(dim, a, b - a).add_(1)
                offset += b - a
            assert offset == piece.shape[dim]
        holders = seen.unique().tolist()
        replicated_kv = (".k_proj." in name or ".v_proj." in name) and tp > c.num_kv_heads
        assert holders == [1] or ref_lm.shard_spec(name, c, tp, 0)[0] is None or replicated_kv or \
            ("in_proj_qkv" in name or "conv1d" in name) and tp > c.linear_num_k_heads, (name, holders)


def test_fused_gdn_projection_is_split_by_section_before_slicing():
    """Rank r's in_proj_qkv rows: its key heads' rows of the q section, of the k section, then its value
    heads' rows of the v section (slicing the fused tensor by position would mix q, k and v: the bug behind
    most tensor-parallel GDN reports)."""
    c = _config("hybrid")                      # Hk = 2, Hv = 4, dk = dv = 8: sections [0, 16), [16, 32), [32, 64)
    assert ref_lm.shard_spec("model.layers.0.linear_attn.in_proj_qkv.weight", c, 2, 1) == \
        (0, ((8, 16), (24, 32), (48, 64)))
    assert ref_lm.shard_spec("model.layers.0.linear_attn.in_proj_qkv.weight", c, 4, 3) == \
        (0, ((8, 16), (24, 32), (56, 64)))    # value head 3 and its key head 1 (replicated on ranks 2 and 3)
    assert ref_lm.shard_spec("model.layers.0.linear_attn.out_proj.weight", c, 4, 3) == (1, ((24, 32),))
    assert ref_lm.shard_spec("model.layers.1.self_attn.q_proj.weight", c, 2, 1) == (0, ((32, 64),))  # (q, gate)
    assert ref_lm.shard_spec("model.layers.1.self_attn.k_proj.weight", c, 4, 3) == (0, ((8, 16),))


def test_experts_shard_whole_by_the_expert_dim():
    """Fused expert tensors (and gpt-oss's MXFP4 blocks and scales) by dim 0, E / tp experts a rank; a checkpoint's
    per-expert tensor on its expert's rank only; the router and the shared expert replicated; a dense layer's
    MLP of an MoE model by its FFN dim as before."""
    c = _config("moe")                                   # 8 experts
    spec = functools.partial(ref_lm.shard_spec, c=c)
    assert spec("model.layers.1.mlp.experts.gate_up_proj", tp=4, rank=3) == (0, ((6, 8),))
    assert spec("model.layers.1.mlp.experts.down_proj_bias", tp=2, rank=1) == (0, ((4, 8),))
    assert spec("model.layers.1.mlp.experts.gate_up_proj_blocks", tp=2, rank=0) == (0, ((0, 4),))
    assert spec("model.layers.1.mlp.experts.5.up_proj.weight", tp=4, rank=2) == (None, ())
    assert spec("model.layers.1.mlp.experts.5.up_proj.weight", tp=4, rank=1) == (0, ())
    assert ref_lm.shard(torch.zeros(3), (0, ())) is None
    for name in ("mlp.gate.weight", "mlp.router.bias", "mlp.shared_expert.down_proj.weight",
                 "mlp.shared_expert_gate.weight"):
        assert spec(f"model.layers.0.{name}", tp=4, rank=1) == (None, ())
    assert spec("model.layers.0.mlp.gate_proj.weight", tp=4, rank=1) == (0, ((12, 24),))   # dense: I / tp rows
    model = ref_lm.DecoderLM(c, device="meta", linear_layer=ref_gdn.GatedDeltaNet, moe_layer=ref_moe.MoE)
    per_expert = {f"model.layers.1.mlp.experts.{n}.gate_proj.weight": torch.zeros(12, 32) for n in range(8)}
    assert sorted(model.shard_state_dict(per_expert, rank=1)) == [
        f"model.layers.1.mlp.experts.{n}.gate_proj.weight" for n in range(8)]       # tp = 1: everything
    shard = ref_lm.DecoderLM(c, device="meta", linear_layer=ref_gdn.GatedDeltaNet, moe_layer=ref_moe.MoE,
                             tp_group=ref_lm.LocalGroup(4).ranks()[1])
    assert sorted(shard.shard_state_dict(per_expert)) == [f"model.layers.1.mlp.experts.{n}.gate_proj.weight"
                                                          for n in (2, 3)]
    assert shard.layers[1].mlp.experts.gate_up_proj.shape == (2, 24, 32)            # experts 2 and 3
    assert (shard.layers[1].mlp.first_expert, shard.layers[1].mlp.num_local_experts) == (2, 2)


@pytest.mark.parametrize("lm", ["ref", "fast"])
def test_degrees_that_do_not_fit_raise(lm):
    import fast.decoder_lm as fast_lm
    mod = ref_lm if lm == "ref" else fast_lm
    c = mod.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, layer_types=("linear", "attention"), linear_num_k_heads=2, linear_num_v_heads=4)
    with pytest.raises(ValueError, match=r"tp=3 .*num_heads=4, num_kv_heads=2, linear_num_v_heads=4"):
        mod.local_config(c, 3)
    with pytest.raises(ValueError, match="tp=8.*num_heads=4"):
        mod.local_config(c, 8)
    odd = mod.ModelConfig(num_heads=12, num_kv_heads=3, intermediate_size=96, head_dim=8, hidden_size=48)
    assert mod.local_config(odd, 3).num_heads == 4                     # the default mode: any divisor
    with pytest.raises(ValueError, match=r"batch_invariant=True at tp=3.*o_proj"):
        mod.local_config(odd, 3, batch_invariant=True)                  # 12 heads: a tree of 4 segments
    with pytest.raises(ValueError, match=r"tp=4 .*num_experts=6"):       # experts shard whole
        mod.local_config(mod.ModelConfig(num_experts=6, intermediate_size=64), 4)


# ----------------------------------------------------------------------------- the reference, one process

@pytest.mark.parametrize("kind,invariant", [(kind, invariant) for kind in ("attention", "hybrid", "moe")
                                            for invariant in (False, True)] + [("gpt_oss", False), ("gpt_oss", True)])
def test_reference_tensor_parallel_equals_tp1(kind, invariant):
    """ref/decoder_lm.py at tp = 2 and 4 (LocalGroup threads) against tp = 1: logits and token_logprobs to fp32
    rounding (bitwise in the batch-invariant mode: the segment tree, and a token's experts computed and
    combined alike on whichever rank), gradients equal the tp = 1 gradients' slices (the shared ones summed
    across the ranks that hold them: an MoE block's router and shared expert see each rank's tokens).
    gpt-oss (sinks and windows, both modes): sinks by head, o_proj's bias once, biased router."""
    c = _gpt_oss_config() if kind == "gpt_oss" else _config(kind)
    ids, cu = torch.randint(0, 61, (1, 23), generator=torch.Generator().manual_seed(0)), \
        torch.tensor([0, 9, 23], dtype=torch.int32)
    seqs, prompts = [list(range(3, 20)), list(range(3, 12)) + [5, 6, 7]], [9, 9]
    kw = dict(seed=1, linear_layer=ref_gdn.GatedDeltaNet, moe_layer=ref_moe.MoE, batch_invariant=invariant)

    def run(model):
        logits = model(ids, cu_seqlens=cu)
        logps = model.token_logprobs(seqs, prompts)
        (logits.sum() + sum(lp.sum() for lp in logps)).backward()
        return logits.detach(), [lp.detach() for lp in logps], {n: p.grad for n, p in model.named_parameters()}

    want_logits, want_lps, want_grads = run(ref_lm.DecoderLM(c, **kw))
    exact = run(ref_lm.DecoderLM(c, dtype=torch.float64, **kw))[2]          # fp64: how far fp32 rounding goes
    for tp in (2, 4):
        shards = [ref_lm.DecoderLM(c, tp_group=g, **kw) for g in ref_lm.LocalGroup(tp).ranks()]
        results = on_threads([functools.partial(run, m) for m in shards])
        for m, (logits, lps, grads) in zip(shards, results):
            if invariant:
                assert torch.equal(logits, want_logits) and all(torch.equal(a, b) for a, b in zip(lps, want_lps))
            else:
                assert (logits - want_logits).abs().max() < 1e-5
            for n, g in grads.items():       # the tolerance rule: at most 3x tp = 1's fp32 error, plus a floor
                want, want64 = m.shard_tensor(n, want_grads[n]), m.shard_tensor(n, exact[n])
                bound = 3 * (want - want64).abs().max() + 1e-6 * want64.abs().max()
                assert (g - want64).abs().max() <= bound, (tp, n, (g - want64).abs().max().item(), bound.item())


def _gpt_oss_config() -> ref_lm.ModelConfig:
    """gpt-oss at test size: a sliding layer (window 5) then a full one, sinks, q/k/v/o biases, 4 experts (top 2,
    the clamped SwiGLU with a small limit so that clamps bite)."""
    return ref_lm.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8, max_seq_len=64, tie_embeddings=False, qkv_bias=True,
                              o_proj_bias=True, attention_sinks=True, sliding_window=5, sliding_layers=(0,),
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, moe_style="gpt_oss",
                              swiglu_limit=1.5)


def test_reference_tensor_parallel_invariant_across_gdn_chunks():
    """The batch-invariant mode at tp = 2 and 4 with sequences past two Gated DeltaNet chunks (the chunk form
    with chunks at absolute positions; each rank holds half or a quarter of the value heads): logits of a
    packed forward and token_logprobs (a completion continuing its prompt's chunk mid-way) bitwise tp = 1's."""
    c = dataclasses.replace(_config("hybrid"), max_seq_len=160)
    gen = torch.Generator().manual_seed(1)
    ids, cu = torch.randint(0, 61, (1, 200), generator=gen), torch.tensor([0, 130, 200], dtype=torch.int32)
    seqs = [torch.randint(0, 61, (n,), generator=gen).tolist() for n in (140, 75)]
    prompts = [100, 70]
    kw = dict(seed=1, linear_layer=ref_gdn.GatedDeltaNet, batch_invariant=True)

    def run(model):
        with torch.no_grad():
            return model(ids, cu_seqlens=cu), model.token_logprobs(seqs, prompts)

    want_logits, want_lps = run(ref_lm.DecoderLM(c, **kw))
    for tp in (2, 4):
        shards = [ref_lm.DecoderLM(c, tp_group=g, **kw) for g in ref_lm.LocalGroup(tp).ranks()]
        for logits, lps in on_threads([functools.partial(run, m) for m in shards]):
            assert torch.equal(logits, want_logits), tp
            assert all(torch.equal(a, b) for a, b in zip(lps, want_lps)), tp


# ----------------------------------------------------------------------------- the fast files, real processes

def _probe(*args, timeout: float = 600) -> dict:
    if unavailable():
        pytest.skip(unavailable())
    proc = run_isolated([sys.executable, str(ROOT / "parity" / "tp_probe.py"), *map(str, args)], timeout=timeout,
                        cwd=ROOT, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, f"tp_probe {' '.join(map(str, args))} failed:\n{proc.stdout[-6000:]}"
    facts = json.loads(lines[-1][6:])
    print(json.dumps(facts, indent=1))
    return facts


@pytest.mark.parametrize("kind,mode", [("moe", "invariant"), ("attention", "default")])
def test_fast_trainer_spmd(kind, mode):
    """DecoderLM(tp_group=...) on 2 and 4 gloo processes: every rank returns the full logits and logprobs
    (bitwise the tp = 1 ones in the batch-invariant mode, to fp32 rounding otherwise) and holds its shards'
    gradients (the tp = 1 gradients' slices).  The "moe" kind: Gated DeltaNet, gated attention and
    fast/moe.py's experts (all-to-all over gloo, the kernels in the interpreter)."""
    facts = _probe("trainer", kind, mode, 2, 4)
    for tp in ("2", "4"):
        f = facts[tp]
        assert f["ranks_agree"]
        if mode == "invariant":
            assert f["logits_bitwise"] and f["logprobs_bitwise"], f
        else:
            assert f["logits_max_diff"] < 1e-5 and f["logprobs_max_diff"] < 1e-5, f
        assert f["grad_max_rel_err"] < 1e-4, f


@pytest.mark.parametrize("kind,mode,tps", [("moe", "invariant", (2,)), ("moe", "invariant", (4,)),
                                           ("attention", "invariant", (4,)), ("moe", "default", (2,)),
                                           ("gpt_oss", "invariant", (2, 4))],
                         ids=["moe-invariant-tp2", "moe-invariant-tp4", "attention-invariant-tp4",
                              "moe-default-tp2", "gpt_oss-invariant-tp2-tp4"])
def test_fast_engine_tensor_parallel(kind, mode, tps):
    """Generator(model, tensor_parallel_size=tp) serves the request mix (a group of 3, a prefix-cache hit, a
    prompt in chunks, preemption in a small pool, then a weight load) with the tp = 1 engine's tokens; in the
    batch-invariant mode its logprobs are bitwise the tp = 1 engine's and the trainer's token_logprobs.  The
    "moe" kind's experts: ref/moe.py's layer (its expert-parallel code is fast/moe.py's, test_copies.py).
    gpt_oss: sinks (padded with the query heads at tp = 4, where KV heads replicate) and a 3-key window."""
    facts = _probe("engine", kind, mode, *tps)
    assert facts["1"]["preemptions"] >= 1 and facts["1"]["prefix_hit_tokens"] > 0, facts["1"]
    for tp in map(str, tps):
        f = facts[tp]
        assert f["tensor_parallel_size"] == int(tp) and f["versions"] == [1] * len(f["versions"])
        assert f["tokens_equal_tp1"], f
        if mode == "invariant":
            assert f["logprobs_bitwise_tp1"] and f["logprobs_bitwise_trainer"], f
        else:
            assert f["logprobs_max_diff_tp1"] < 1e-5, f


def test_fast_engine_tensor_parallel_compiled():
    """Generator(model, tensor_parallel_size=2, compile=True): every rank decodes through its own compiled static
    step (the collectives between its compiled pieces), on the hybrid (Gated DeltaNet state rows, a gated
    attention layer) through the same mix and weight load: every decode step static, the tp = 1 eager engine's
    tokens, its logprobs to fp32 rounding.  (The MoE hybrid, all-to-all included, measured the same by hand:
    logprobs within 1.4e-6; left out here for make parity's time.)"""
    facts = _probe("engine-compiled", "hybrid", "default", 2)
    f = facts["2"]
    assert f["static_decode_steps"] == f["decode_steps"] > 0 and facts["1"]["static_decode_steps"] == 0, facts
    assert f["preemptions"] >= 1 and f["prefix_hit_tokens"] > 0 and f["versions"] == [1] * len(f["versions"]), f
    assert f["tokens_equal_tp1"] and f["logprobs_max_diff_tp1"] < 1e-5, f


def test_fast_engine_tensor_parallel_speculative():
    """Generator(model, tensor_parallel_size=2, speculative=drafter) on the hybrid (a picklable drafter of the tp = 1
    engine's continuations, one token wrong in most drafts; compile=True): every rank drafts from the same tokens,
    verifies with its shard (a verification alone through its compiled static step) and takes rank 0's drawn
    tokens; a rejection reruns each rank's linear layers.
    The tp = 1 plain engine's tokens (greedy and sampled, a group, a prefix hit, chunks, preemption, a weight
    load), its logprobs to fp32 rounding, with drafts accepted and rejected."""
    facts = _probe("engine-speculative", "hybrid", "default", 2)
    f = facts["2"]
    assert 0 < f["accepted_draft_tokens"] < f["draft_tokens"] and facts["1"]["draft_tokens"] == 0, facts
    assert f["static_verify_steps"] > 0 and f["static_decode_steps"] > 0, f
    assert f["preemptions"] >= 1 and f["prefix_hit_tokens"] > 0 and f["versions"] == [1] * len(f["versions"]), f
    assert f["tokens_equal_tp1"] and f["logprobs_max_diff_tp1"] < 1e-5, f


def test_a_dead_or_hung_worker_fails_its_generator():
    """A worker killed (SIGKILL) or hung (SIGSTOP) mid-decode: every request the generator held fails with a
    RuntimeError naming the cause, within tp_timeout_s (plus slack for a loaded machine) for the hang; later
    submits raise; close() returns within tp_timeout_s and leaves no worker running."""
    facts = _probe("faults")
    for how, f in facts.items():
        bound = f["timeout_s"] * 2 + 10                  # the collective's timeout, then the failure's path
        assert f["in_flight"] == 3, (how, f)             # the fault landed mid-decode (54 tokens each to go)
        assert all(e is not None and e.startswith("RuntimeError") for e in f["errors"]), (how, f)
        assert f["failed_after_s"] <= bound, (how, f)
        assert f["later_submit"].startswith("RuntimeError") and "failed" in f["later_submit"] or \
            "closed" in f["later_submit"], (how, f)
        assert f["close_s"] <= f["timeout_s"] + 10 and not f["worker_alive_after_close"], (how, f)
        assert f["threads_after_close"] == [], (how, f)
    assert facts["kill"]["failed_after_s"] < facts["kill"]["timeout_s"], facts["kill"]   # death: no timeout waited


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_moe", "gpt_oss"])
def test_sharded_loading_from_a_checkpoint(tmp_path, family):
    """Generator.from_pretrained(path, tensor_parallel_size=2) on a Qwen3.5, a Qwen3-MoE (per-expert tensors on
    disk: each rank reads its experts' only) and a gpt-oss checkpoint (sinks, a sliding window, biases, fused
    experts): greedy tokens equal the tp = 1 generator's and transformers' generate."""
    from hf_models import hf_greedy, hf_model
    hf = hf_model(family, seed=4)
    hf.save_pretrained(tmp_path)
    facts = _probe("checkpoint", tmp_path, 2)
    prompts = [[5, 17, 3, 44, 2, 9], list(range(20, 41))]
    assert facts["2"]["tokens"] == facts["1"]["tokens"] == [hf_greedy(hf, p, 8) for p in prompts]
    assert facts["1"]["threads_after_close"] == facts["2"]["threads_after_close"] == []   # (close() joins them)
    assert max(abs(a - b) for x, y in zip(facts["2"]["logprobs"], facts["1"]["logprobs"]) for a, b in zip(x, y)) < 1e-5
