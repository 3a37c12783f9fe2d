"""Bitwise on-policy: fast/generator_engine.py's batch-invariant mode.

``Generator(model)`` on a model in the mode (fast/decoder_lm.py's ``DecoderLM(batch_invariant=True,
varlen_attn=...)``) serves requests whose tokens and per-token logprobs do not depend on the rest of
the batch, on when they joined, on how their prompt was packed, or on a preemption that recomputed
them; ``token_logprobs`` of a model in the mode (the trainer's one packed forward over prompt +
completion) gives the same logprobs bit for bit (``torch.equal``).  Checked here for an
attention-only model, a hybrid one (attention + Gated DeltaNet layers) and a hybrid with Mixture-of-Experts
MLPs on fast/moe.py's kernels (Qwen3.5-MoE's layout: routed experts and the shared expert; equal bits mean
the engine's tokens went to the trainer's experts) under continuous batching
with a KV pool small enough to preempt, in fp32 on the CPU with the repo's attention kernels under
the Triton interpreter.  The negative control runs the same workload with the mode off and records
how far apart the two sides are there (the README quotes it).  The hybrid runs once with the
reference chunk form and once with fast/gated_deltanet.py's chunk kernels (the mode runs the chunk
form in every phase, chunks at absolute positions; a row's bits in a partial chunk:
parity/test_gated_deltanet.py), and sequences long enough to cross chunk boundaries run with prefill
cuts, prefix-cache hits and preemptions mid-chunk.  The GPU tier runs the contract in bf16 with the
Triton matmul, attention-only and hybrid with the fast chunk kernels.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import random

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.gated_deltanet as fast_gdn
import fast.generator_engine as fast_ge
import fast.moe as fast_moe
from conftest import DEVICE, requires_gpu
import ref.decoder_lm as ref_lm
import ref.gated_deltanet as ref_gdn
import ref.generator_engine as ref_ge
from fast.flash_decoding import flash_decode
from fast.paged_varlen_attention import varlen_attn

TIMEOUT = 120.0
N_REQUESTS = 32


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# The hybrid's "linear" layers: ref/gated_deltanet.py's layer, sized by the config's linear_* fields (the mode
# runs its chunk form in every phase, so the engine relies on a chunk row's invariance in chunk_fn), and the
# same layer with fast/gated_deltanet.py's kernels (Triton; the interpreter on a CPU).
gdn_layer = functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=ref_gdn.chunk_gated_delta_rule)
fast_gdn_layer = functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=fast_gdn.chunk_gated_delta_rule,
                                   recurrent_fn=fast_gdn.fused_recurrent_gated_delta_rule)


MODELS = {
    "attention": dict(layer_types=None, linear_layer=None),
    "hybrid": dict(layer_types=("linear", "attention"), linear_layer=gdn_layer),
    "hybrid-fast_gdn": dict(layer_types=("linear", "attention"), linear_layer=fast_gdn_layer),
    # Qwen3.5-MoE's layout: every MLP routed (5 experts, top 2) beside a shared expert, on the Triton kernels
    "hybrid-moe": dict(layer_types=("linear", "attention"), linear_layer=gdn_layer, moe_layer=fast_moe.MoE,
                       fields=dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=16)),
    # gpt-oss's layout: attention sinks on every layer, layer 0 within a 5-key window (the requests' prompts
    # and completions cross it: rows whose window holds part of the prompt, or none), q/k/v/o biases, the
    # clamped-SwiGLU experts with biases and a biased router (the random init draws every bias and sink)
    "gpt-oss": dict(layer_types=None, linear_layer=None, moe_layer=fast_moe.MoE,
                    fields=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, moe_style="gpt_oss",
                                swiglu_limit=1.5, qkv_bias=True, o_proj_bias=True, attention_sinks=True,
                                sliding_window=5, sliding_layers=(0,))),
}


def config(kind):
    return fast_lm.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                               num_kv_heads=1, head_dim=16, max_seq_len=48, tie_embeddings=False,
                               layer_types=MODELS[kind]["layer_types"], linear_num_k_heads=2, linear_num_v_heads=4,
                               linear_head_k_dim=8, linear_head_v_dim=8, **MODELS[kind].get("fields", {}))


def make_model(kind, invariant=True):
    """The model (seed 3) with the repo's varlen_attn, in the batch-invariant mode or not: what an engine
    serves and what the trainer recomputes with."""
    return fast_lm.DecoderLM(config(kind), seed=3, linear_layer=MODELS[kind]["linear_layer"],
                             moe_layer=MODELS[kind].get("moe_layer"), batch_invariant=invariant,
                             varlen_attn=varlen_attn, device=DEVICE)


def requests(seed, n=N_REQUESTS):
    """Random prompt lengths and budgets; greedy, temperature and top-k/top-p rows, each seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 3
        sp = fast_ge.SamplingParams(max_new_tokens=rng.randint(1, 9), temperature=(0.0, 0.9, 1.2)[kind],
                                    top_k=(0, 0, 20)[kind], top_p=(1.0, 1.0, 0.9)[kind], seed=500 + i)
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 20))]
        out.append(fast_ge.Request(prompt, sp, request_id=f"r{i}"))
    return out


def generator(kind, invariant, *, page_size=4):
    """A busy engine: 8 slots and a pool of 56-57 KV slots (a request holds up to 28: preemptions); its
    prefill attention is the model's varlen_attn, its decode flash_decode."""
    return fast_ge.Generator(make_model(kind, invariant), page_size=page_size, num_pages=-(-56 // page_size),
                             max_batch_size=8, flash_decode=flash_decode)


def serve_busy(gen, reqs, seed):
    """Random arrival order, in two waves: the second arrives while the first is decoding."""
    order = list(range(len(reqs)))
    random.Random(seed).shuffle(order)
    futures = {}
    for j, i in enumerate(order):
        futures[i] = gen.submit(reqs[i])
        if j == len(order) // 2:
            futures[order[0]].result(TIMEOUT)
    return [futures[i].result(TIMEOUT) for i in range(len(reqs))]


def trainer_logprobs(trainer, reqs, completions, groups=3):
    """The trainer's recompute: packed forwards over prompt + completion, the completions dealt into
    ``groups`` packs in another order than they were served."""
    temperature = {r.request_id: r.sampling.temperature for r in reqs}
    out = {}
    for g in range(groups):
        batch = completions[g::groups][::-1]
        lps = trainer.token_logprobs([c.prompt_token_ids + c.token_ids for c in batch],
                                     [len(c.prompt_token_ids) for c in batch],
                                     temperature=[temperature[c.request_id] for c in batch])
        out.update({c.request_id: lp for c, lp in zip(batch, lps)})
    return out


def largest_mismatch(completions, recomputed):
    return max(float((torch.tensor(c.logprobs, dtype=torch.float32) - recomputed[c.request_id].cpu()).abs().max())
               for c in completions)


# (The fast Gated DeltaNet kernels, slow in the interpreter, are held to the trainer's bits by
# test_bitwise_across_gated_deltanet_chunks: a preempting engine, cuts and prefix hits mid-chunk.)
@pytest.mark.parametrize("kind,page_size,n", [("attention", 4, N_REQUESTS), ("hybrid", 3, 14), ("hybrid-moe", 5, 16),
                                              ("gpt-oss", 3, 16)],
                         ids=["attention-page4", "hybrid-page3", "hybrid-moe-page5", "gpt-oss-page3"])
def test_engine_logprobs_equal_the_trainers_bitwise(kind, page_size, n):
    reqs = requests(seed=11, n=n)
    with generator(kind, True, page_size=page_size) as gen:
        busy = serve_busy(gen, reqs, seed=12)
        stats = gen.stats()
        assert stats["preemptions"] >= 1, stats
        # Alone: the same requests, each the only one in flight, give the same tokens and logprobs.
        for i in (0, 5, n - 1):
            alone = gen.generate([reqs[i]])[0]
            assert alone.token_ids == busy[i].token_ids and alone.logprobs == busy[i].logprobs, reqs[i].request_id
    trainer = make_model(kind)
    trainer.load_state_dict(gen.model.state_dict())
    with torch.no_grad():
        recomputed = trainer_logprobs(trainer, reqs, busy)
    for c in busy:
        assert len(c.token_ids) >= 1
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), recomputed[c.request_id].cpu()), (
            f"{c.request_id}: engine {c.logprobs} vs trainer {recomputed[c.request_id].tolist()}")
    # The trainer's logprobs are differentiable: a policy-gradient step can run on them.
    lp = trainer.token_logprobs([busy[0].prompt_token_ids + busy[0].token_ids], [len(busy[0].prompt_token_ids)])
    lp[0].sum().backward()
    assert trainer.lm_head.weight.grad is not None and torch.isfinite(trainer.lm_head.weight.grad).all()


@pytest.mark.parametrize("kind", ["attention", "hybrid", "hybrid-moe"])
def test_negative_control_mode_off_mismatches(kind):
    """The same workload with the mode off (default kernels: autotuned prefill, split-KV decode, the
    chunk form for the GDN prefill, BLAS matmuls): the engine's logprobs and the trainer's default
    packed forward differ.  The largest difference is printed for the README."""
    reqs = requests(seed=11)
    with generator(kind, False) as gen:
        busy = serve_busy(gen, reqs, seed=12)
        assert gen.stats()["preemptions"] >= 1
    trainer = make_model(kind, invariant=False)
    trainer.load_state_dict(gen.model.state_dict())
    with torch.no_grad():
        mismatch = largest_mismatch(busy, trainer_logprobs(trainer, reqs, busy))
    print(f"\n[negative control] {kind}: mode off, largest |engine - trainer| logprob = {mismatch:.3e}")
    assert mismatch > 0


def test_invariant_linear_rows_do_not_depend_on_the_row_count():
    """The CPU product and the fixed-tile Triton kernel (interpreter): a row's bits alike in M = 1, 7
    and 45, close to x @ W^T."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(45, 40, generator=gen).to(DEVICE)
    w = torch.randn(24, 40, generator=gen).to(DEVICE)
    for fn in (fast_lm._invariant_linear, fast_lm._triton_invariant_matmul):
        full = fn(x, w)
        torch.testing.assert_close(full, x @ w.t(), rtol=1e-5, atol=1e-5)
        for m in (1, 7):
            assert torch.equal(fn(x[3:3 + m], w), full[3:3 + m]), (fn.__name__, m)
    # A custom op with its fake and autograd (torch.compile traces it; gradients are x @ W^T's).
    torch.library.opcheck(torch.ops.twofold.invariant_linear, (x, w))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    fast_lm._invariant_linear(xg, wg).square().sum().backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    (x2 @ w2.t()).square().sum().backward()
    torch.testing.assert_close((xg.grad, wg.grad), (x2.grad, w2.grad), rtol=1e-5, atol=1e-4)


# Decode steps at positions 0 .. 65 (a chunk's first, middle and last rows, then the next chunk's) and 61 .. 130
# with the reference kernels; with the fast ones (slow in the interpreter) at 60 .. 65, 0 .. 5 and 29 .. 34.
@pytest.mark.parametrize("kernels,lengths,prefix", [("ref", [66, 131, 9, 40], [0, 61, 3, 40]),
                                                    ("fast", [66, 6, 35], [60, 0, 29])], ids=["ref", "fast"])
def test_gated_deltanet_layer_is_batch_and_split_invariant(kernels, lengths, prefix):
    """ref/gated_deltanet.py's layer after set_batch_invariant (the chunk form in every call, chunks at
    absolute positions, the cache holding the current chunk's start state and tokens): documents packed
    in one call, each alone, and a prefill of their first tokens (cut mid-chunk, at none, at all)
    followed by batched one-token decode steps give every token's output bit for bit alike; so does a
    second prefill continuing from the first cut (the cache of a prefill continued by a prefill)."""
    torch.manual_seed(0)
    layer = (gdn_layer if kernels == "ref" else fast_gdn_layer)(**config("hybrid").linear_layer_sizes()).to(DEVICE)
    layer.set_batch_invariant(fast_lm._invariant_linear)
    docs = [torch.randn(1, n, 32).to(DEVICE) for n in lengths]

    def cu(ns):
        return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)

    with torch.no_grad():
        packed = layer(torch.cat(docs, 1), cu_seqlens=cu(lengths))[0].split(lengths)
        alone = [layer(d, cu_seqlens=cu([d.shape[1]]))[0] for d in docs]
        cache = layer.new_cache()
        first = layer(torch.cat([d[:, :p] for d, p in zip(docs, prefix)], 1), cu_seqlens=cu(prefix), cache=cache)
        rest = layer(torch.cat([d[:, p:] for d, p in zip(docs, prefix)], 1), cu_seqlens=cu([n - p for n, p in
                                                                                             zip(lengths, prefix)]),
                     cache=copy.deepcopy(cache))
        steps = [[] for _ in docs]
        for t in range(max(n - p for n, p in zip(lengths, prefix))):  # every document steps until the longest
            x = torch.cat([d[:, min(p + t, n - 1)][:, None] for d, p, n in zip(docs, prefix, lengths)])   # [3, 1, 32]
            out = layer(x, cache=cache)
            for i, (p, n) in enumerate(zip(prefix, lengths)):
                if p + t < n:
                    steps[i].append(out[i, 0])
    first, rest = first[0].split(prefix), rest[0].split([n - p for n, p in zip(lengths, prefix)])
    for i, (a, b) in enumerate(zip(packed, alone)):
        decoded = torch.cat([first[i], torch.stack(steps[i])]) if steps[i] else first[i]
        assert torch.equal(a, b), f"document {i}: packed vs alone"
        assert torch.equal(a, decoded), (f"document {i}: decode steps differ at positions "
                                         f"{[j for j in range(len(a)) if not torch.equal(a[j], decoded[j])]}")
        assert torch.equal(a, torch.cat([first[i], rest[i]])), f"document {i}: prefill continued by a prefill"


def test_gated_deltanet_cache_from_outside_the_mode_raises():
    layer = gdn_layer(**config("hybrid").linear_layer_sizes())
    cache = layer.new_cache()
    with torch.no_grad():
        layer(torch.randn(1, 5, 32), cache=cache)                       # the default mode: no chunk buffer
        layer.set_batch_invariant(fast_lm._invariant_linear)
        with pytest.raises(ValueError, match="outside the batch-invariant mode"):
            layer(torch.randn(1, 1, 32), cache=cache)


def test_ref_token_logprobs_are_its_engines_logprobs():
    """ref/decoder_lm.py's token_logprobs (one packed forward) against the reference engine's
    logprobs, and fast's in the mode against ref's: the same numbers to fp32 rounding."""
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, max_seq_len=48, tie_embeddings=False)
    reqs = [ref_ge.Request(r.prompt_token_ids, ref_ge.SamplingParams(**vars(r.sampling)), request_id=r.request_id)
            for r in requests(seed=21, n=6)]
    with ref_ge.Generator(ref_lm.DecoderLM(ref_lm.ModelConfig(**kw), seed=3)) as gen:
        done = gen.generate(reqs)
    seqs = [c.prompt_token_ids + c.token_ids for c in done]
    prompts = [len(c.prompt_token_ids) for c in done]
    temps = [r.sampling.temperature for r in reqs]
    with torch.no_grad():
        ref_lps = ref_lm.DecoderLM(ref_lm.ModelConfig(**kw), seed=3).token_logprobs(seqs, prompts, temperature=temps)
        fast_lps = fast_lm.DecoderLM(fast_lm.ModelConfig(**kw), seed=3, batch_invariant=True, varlen_attn=varlen_attn,
                                     device=DEVICE).token_logprobs(seqs, prompts, temperature=temps)
    for c, r, f in zip(done, ref_lps, fast_lps):
        engine = torch.tensor(c.logprobs, dtype=torch.float32)
        torch.testing.assert_close(r, engine, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f.cpu(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lm", [ref_lm, fast_lm], ids=["ref", "fast"])
def test_token_logprobs_bad_inputs_raise(lm):
    model = lm.DecoderLM(lm.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                                        num_heads=2, num_kv_heads=1, head_dim=8, max_seq_len=8))
    with pytest.raises(ValueError, match=r"prompt_lengths\[0\] must be in \[1, 3\)"):
        model.token_logprobs([[1, 2, 3]], [3])
    with pytest.raises(ValueError, match="token ids in"):
        model.token_logprobs([[1, 64, 3]], [1])
    with pytest.raises(ValueError, match="one int per sequence"):
        model.token_logprobs([[1, 2, 3]], [1, 1])
    with pytest.raises(ValueError, match="temperature must be"):
        model.token_logprobs([[1, 2, 3]], [1], temperature=-1.0)
    with pytest.raises(ValueError, match="more than max_seq_len"):
        model.token_logprobs([list(range(10))], [1])
    with pytest.raises(TypeError, match="sequences must be a list"):
        model.token_logprobs(torch.tensor([1, 2, 3]), [1])
    assert model.token_logprobs([], []) == []


def test_bad_inputs_raise():
    c = config("attention")
    with pytest.raises(ValueError, match="batch_invariant=True needs varlen_attn"):
        fast_lm.DecoderLM(c, batch_invariant=True)
    with pytest.raises(ValueError, match="batch-invariant model needs varlen_attn .* and flash_decode"):
        fast_ge.Generator(fast_lm.DecoderLM(c, batch_invariant=True, varlen_attn=varlen_attn))
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        fast_lm.DecoderLM(c, batch_invariant=1, varlen_attn=varlen_attn)
    with pytest.raises(TypeError, match="varlen_attn must be None or a function"):
        fast_lm.DecoderLM(c, varlen_attn="flash")
    with pytest.raises(TypeError, match="varlen_attn must be None or a function"):
        fast_ge.Generator(fast_lm.DecoderLM(c), varlen_attn="flash")

    class NoMode(torch.nn.Module):                       # a linear-layer plug-in that cannot be made invariant
        def __init__(self, **sizes):
            super().__init__()

    with pytest.raises(ValueError, match="set_batch_invariant"):
        fast_lm.DecoderLM(config("hybrid"), linear_layer=NoMode, batch_invariant=True, varlen_attn=varlen_attn)


# ----------------------------------------------------------------------------- GPU tier (bf16)

# A Qwen3.5-like Gated DeltaNet layer (head dims 128: the GPU config's linear_* fields) on fast/gated_deltanet.py's
# recurrent kernel.
gpu_gdn_layer = fast_gdn_layer


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("layer_types", [None, ("linear", "attention") * 2], ids=["attention", "hybrid"])
def test_gpu_bf16_engine_logprobs_equal_the_trainers_bitwise(layer_types, cuda_graphs):
    """The same contract in bf16 on a GPU, where every matmul is the fixed-tile Triton kernel: a 0.1B
    model (attention-only, or hybrid with fast Gated DeltaNet layers), 64 requests through a pool that
    preempts, flash_decode(batch_invariant=True); and with cuda_graphs=True, where every decode step replays a
    graph of the same kernels (the hybrid's Gated DeltaNet step: one dense chunk-form call)."""
    cfg = fast_lm.ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8,
                              num_kv_heads=2, head_dim=64, max_seq_len=512, tie_embeddings=False,
                              layer_types=layer_types, linear_num_k_heads=4, linear_num_v_heads=8,
                              linear_head_k_dim=128, linear_head_v_dim=128)
    linear_layer = gpu_gdn_layer if layer_types else None
    rng = random.Random(5)
    reqs = [fast_ge.Request([rng.randrange(4096) for _ in range(rng.randint(1, 300))],
                            fast_ge.SamplingParams(max_new_tokens=rng.randint(1, 64), temperature=(0.0, 1.0)[i % 2],
                                                   seed=i), request_id=f"g{i}") for i in range(64)]
    kw = dict(device=DEVICE, dtype=torch.bfloat16, linear_layer=linear_layer)
    model = fast_lm.DecoderLM(cfg, seed=0, batch_invariant=True, varlen_attn=varlen_attn, **kw)
    with fast_ge.Generator(model, page_size=16, num_pages=160, max_batch_size=32, flash_decode=flash_decode,
                           cuda_graphs=cuda_graphs) as gen:
        busy = serve_busy(gen, reqs, seed=6)
        stats = gen.stats()
        assert stats["preemptions"] >= 1
        if cuda_graphs:                                          # (a failed capture warns and steps eagerly)
            assert stats["cuda_graph_sizes"] and stats["static_decode_steps"] == stats["decode_steps"], stats
        alone = gen.generate([reqs[7]])[0]
    assert alone.token_ids == busy[7].token_ids and alone.logprobs == busy[7].logprobs
    trainer = fast_lm.DecoderLM(cfg, seed=0, batch_invariant=True, varlen_attn=varlen_attn, **kw)
    with torch.no_grad():
        recomputed = trainer_logprobs(trainer, reqs, busy)
    for c in busy:
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), recomputed[c.request_id].cpu()), c.request_id


# ----------------------------------------------------------------------------- groups, prefix cache, chunks

def grpo_requests(seed):
    """Three groups of n = 3 samples behind a shared 7-token system prompt, and two single requests;
    greedy and tempered."""
    rng = random.Random(seed)
    system = [rng.randrange(64) for _ in range(7)]
    out = []
    for i in range(5):
        sp = fast_ge.SamplingParams(max_new_tokens=rng.randint(2, 6), temperature=(0.0, 1.1)[i % 2],
                                    seed=50 + 10 * i, n=3 if i < 3 else 1)
        out.append(fast_ge.Request(system + [rng.randrange(64) for _ in range(rng.randint(1, 9))], sp,
                                   request_id=f"p{i}"))
    return out


def by_sample(results) -> dict:
    flat = [c for r in results for c in (r if isinstance(r, list) else [r])]
    return {(c.request_id, c.sample_index): (c.token_ids, c.logprobs) for c in flat}


@pytest.mark.parametrize("kind", ["attention", "hybrid", "gpt-oss"])
def test_bitwise_with_groups_prefix_cache_and_chunks(kind):
    """The mode's bits do not depend on how a sample is served: cache off with room to spare; cache
    on, cold, prefill chunks of 5 tokens and a pool that preempts; the same requests again on that
    engine (warm: hits); each of four samples alone (n = 1, seed + i).  All equal, and equal to the
    trainer's token_logprobs."""
    reqs = grpo_requests(seed=21)
    runs, stats = {}, {}
    kw = dict(page_size=3, max_batch_size=8, flash_decode=flash_decode)
    with fast_ge.Generator(make_model(kind), prefix_caching=False, num_pages=128, **kw) as gen:   # room to spare
        runs["cache off"] = by_sample(gen.generate(reqs))
    with fast_ge.Generator(make_model(kind), num_pages=12, max_prefill_tokens=5, **kw) as gen:
        runs["cold, chunks of 5, preempting"] = by_sample(gen.generate(reqs))
        stats["cold"] = gen.stats()
        runs["warm"] = by_sample(gen.generate(reqs))
        stats["warm"] = gen.stats()
        alone = {}
        for i, j in ((0, 0), (0, 2), (1, 1), (3, 0)):
            r = reqs[i]
            sp = dataclasses.replace(r.sampling, n=1, seed=r.sampling.seed + j)
            c = gen.generate([fast_ge.Request(r.prompt_token_ids, sp, request_id=r.request_id)])[0]
            alone[(r.request_id, j)] = (c.token_ids, c.logprobs)
    assert stats["cold"]["preemptions"] >= 1 and stats["cold"]["prefix_hit_tokens"] > 0, stats
    warm_hits = stats["warm"]["prefix_hit_tokens"] - stats["cold"]["prefix_hit_tokens"]
    assert warm_hits > 0.7 * (stats["warm"]["prompt_tokens"] - stats["cold"]["prompt_tokens"]), stats
    base = runs["cache off"]
    assert len(base) == 11
    for name, run in runs.items():
        assert run == base, f"{name}: {[k for k in base if run.get(k) != base[k]]}"
    assert all(alone[k] == base[k] for k in alone), [k for k in alone if alone[k] != base[k]]
    trainer = make_model(kind)
    with torch.no_grad():
        keys = list(base)
        prompts = {r.request_id: r for r in reqs}
        lps = trainer.token_logprobs([prompts[k[0]].prompt_token_ids + base[k][0] for k in keys],
                                     [len(prompts[k[0]].prompt_token_ids) for k in keys],
                                     temperature=[prompts[k[0]].sampling.temperature for k in keys])
    for k, lp in zip(keys, lps):
        assert torch.equal(torch.tensor(base[k][1], dtype=torch.float32), lp.cpu()), k


# ----------------------------------------------------------------------------- across Gated DeltaNet chunks

def long_config(kind):
    """config(kind) with room for sequences past two Gated DeltaNet chunks (64 tokens each)."""
    return dataclasses.replace(config(kind), max_seq_len=200)


def long_requests(seed):
    """Prompts of 40 .. 125 tokens (a 62-token system prompt shared by most: hits that end mid-chunk),
    completions of 8 .. 24 tokens that cross positions 64 and 128; one group of n = 2; greedy and
    tempered."""
    rng = random.Random(seed)
    system = [rng.randrange(64) for _ in range(62)]
    out = []
    for i, (extra, new) in enumerate([(0, 9), (5, 24), (40, 8), (63, 12), (-22, 24), (2, 16)]):
        prompt = system[:62 + extra] if extra <= 0 else system + [rng.randrange(64) for _ in range(extra)]
        sp = fast_ge.SamplingParams(max_new_tokens=new, temperature=(0.0, 1.1)[i % 2], seed=70 + 10 * i,
                                    n=2 if i == 1 else 1)
        out.append(fast_ge.Request(prompt, sp, request_id=f"L{i}"))
    return out


@pytest.fixture
def wide_interpreter_segments(monkeypatch):
    """The interpreter's attention segments at 32 keys (not 8) in varlen_attn and flash_decode alike: the
    sequences here are 150 tokens long, and the 8-key segments (there so that the short tests' sequences
    cross several, each 16-key block straddling two) would merge ~19 states per row in the interpreter.
    Any segment size gives engine == trainer bits as long as both kernels share it."""
    import fast.flash_decoding as fast_fd
    import fast.paged_varlen_attention as fast_pva
    for module in (fast_fd, fast_pva):
        block_n, _, *rest = module._INTERPRET_INVARIANT_CONFIG
        monkeypatch.setattr(module, "_INTERPRET_INVARIANT_CONFIG", (block_n, 32, *rest))


# (The preempting run against the trainer for each kind; every run with the reference layer: make parity-all.)
@pytest.mark.parametrize("kind,full", [("hybrid", False), ("hybrid", True), ("hybrid-fast_gdn", False)],
                         ids=["hybrid", "hybrid-every-run", "hybrid-fast_gdn"])
def test_bitwise_across_gated_deltanet_chunks(kind, full, wide_interpreter_segments):
    """Sequences of up to 149 tokens, so the linear layers' chunks (64 tokens from each sequence's start)
    end inside prompts, inside completions and at prefill cuts: the engine's bits are the same with the
    prefix cache off and a roomy pool (pages of 16, a budget of 64: cuts at multiples of 16, chunk
    boundaries among them), with pages of 5 and a budget of 23 tokens (cuts at odd page boundaries,
    mid-chunk) in a pool that preempts (a recompute resumes from a checkpoint mid-chunk), warm on that
    engine (prefix-cache hits: with pages of 5, every page boundary below 320 is mid-chunk), and alone;
    and they equal the trainer's token_logprobs.  The engine's checkpoint slots hold the chunk buffer:
    their bytes are the README's per-slot formula."""
    reqs = long_requests(seed=31)
    runs, stats = {}, {}
    long_model = fast_lm.DecoderLM(long_config(kind), seed=3, linear_layer=MODELS[kind]["linear_layer"],
                                   batch_invariant=True, varlen_attn=varlen_attn, device=DEVICE)
    kw = dict(max_batch_size=8, flash_decode=flash_decode)
    if full:
        with fast_ge.Generator(long_model, page_size=16, num_pages=96, max_prefill_tokens=64, prefix_caching=False,
                               **kw) as gen:
            runs["cache off, cuts at chunk boundaries"] = by_sample(gen.generate(reqs))
    with fast_ge.Generator(long_model, page_size=5, num_pages=32, max_prefill_tokens=23, **kw) as gen:
        runs["cold, pages of 5, cuts of 23, preempting"] = by_sample(gen.generate(reqs))
        stats["cold"] = gen.stats()
        if full:
            runs["warm"] = by_sample(gen.generate(reqs))
            stats["warm"] = gen.stats()
            alone = gen.generate([fast_ge.Request(reqs[3].prompt_token_ids, reqs[3].sampling, request_id="L3")])[0]
        layer = next(b.linear_attn for b in long_model.layers if getattr(b, "linear_attn", None) is not None)
    last = stats["warm" if full else "cold"]
    assert stats["cold"]["preemptions"] >= 1 and stats["cold"]["prefix_hit_tokens"] > 0, stats["cold"]
    base = next(iter(runs.values()))
    assert len(base) == 7 and max(len(reqs[i].prompt_token_ids) + len(base[(f"L{i}", 0)][0]) for i in range(6)) > 130
    for name, run in runs.items():
        assert run == base, f"{name}: {[k for k in base if run.get(k) != base[k]]}"
    if full:
        assert last["prefix_hit_tokens"] > stats["cold"]["prefix_hit_tokens"]
        assert (alone.token_ids, alone.logprobs) == base[("L3", 0)]
    # checkpoint slots: per linear layer the fp32 state, the conv state and the chunk buffer (63 rows of the
    # conv output, fp32 g and beta, and the row count)
    elt = 4
    per_slot = (layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * 4
                + layer.conv_dim * (layer.conv_kernel_size - 1) * elt
                + (ref_gdn.CHUNK - 1) * (layer.conv_dim * elt + layer.num_v_heads * (4 + elt)) + 8)
    n_linear = sum(t == "linear" for t in long_model.config.layer_types)
    assert last["checkpoint_bytes"] == gen.num_checkpoints * n_linear * per_slot, last
    assert_trainer_bits(long_model, reqs, base)


def assert_trainer_bits(model, reqs, samples: dict) -> None:
    """Each sample's logprobs (``by_sample``'s dict) are the trainer's token_logprobs bit for bit."""
    keys = list(samples)
    prompts = {r.request_id: r for r in reqs}
    with torch.no_grad():
        lps = model.token_logprobs([prompts[k[0]].prompt_token_ids + samples[k][0] for k in keys],
                                   [len(prompts[k[0]].prompt_token_ids) for k in keys],
                                   temperature=[prompts[k[0]].sampling.temperature for k in keys])
    for k, lp in zip(keys, lps):
        assert torch.equal(torch.tensor(samples[k][1], dtype=torch.float32), lp.cpu()), k


# ----------------------------------------------------------------------------- the static step in the mode

@pytest.mark.parametrize("kind", ["gpt-oss", "hybrid"])
def test_the_static_step_keeps_the_modes_bits(kind, wide_interpreter_segments, monkeypatch):
    """What ``cuda_graphs=True`` replays in the mode, run on the CPU: the static decode step (the batch padded
    to ``capture_sizes``, inputs in buffers, every state write at the step's end; Gated DeltaNet's step one dense
    chunk-form call over the N current chunks, nothing on the host), left uncompiled as a graph replays it
    (``torch.compile`` is made the identity here: compiled, inductor would change the rounding).  Every decode
    step runs it (padded to 2 or 8), and the logprobs are the trainer's bit for bit (so the eager step's): gpt-oss's
    layout (a windowed layer with sinks, a full one, experts; groups, a shared system prompt) and the hybrid over
    sequences that cross Gated DeltaNet chunks (prefill cuts, prefix hits and preemptions mid-chunk)."""
    reqs = long_requests(seed=31) if kind == "hybrid" else grpo_requests(seed=21)
    cfg = long_config(kind) if kind == "hybrid" else config(kind)
    model = fast_lm.DecoderLM(cfg, seed=3, linear_layer=MODELS[kind]["linear_layer"],
                              moe_layer=MODELS[kind].get("moe_layer"), batch_invariant=True, varlen_attn=varlen_attn,
                              device=DEVICE)
    kw = dict(page_size=5, num_pages=32 if kind == "hybrid" else 8, max_prefill_tokens=23, max_batch_size=8,
              flash_decode=flash_decode)
    monkeypatch.setattr(fast_ge, "COMPILE_THE_MODE", True)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    with fast_ge.Generator(model, compile=True, capture_sizes=(2, 8), **kw) as gen:
        static = by_sample(gen.generate(reqs))
        stats = gen.stats()
    assert stats["static_decode_steps"] == stats["decode_steps"] > 10, stats
    assert {size for size, _ in stats["static_decode_shapes"]} == {2, 8}, stats["static_decode_shapes"]
    assert stats["preemptions"] >= 1 and stats["prefix_hit_tokens"] > 0, stats
    assert_trainer_bits(model, reqs, static)
