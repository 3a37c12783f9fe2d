"""Routed generator, part 4: groups (n samples of one prompt), the prefix cache, hybrid checkpoints,
chunked prefill, in the reference engine (the semantics) and the fast one (the block allocator).

What is checked
  * Groups: ``SamplingParams(n=k)`` returns k completions; sample i is the request alone with seed + i
    (the samples differ); the fast engine prefills the prompt once and forks the rest (its full pages
    shared, the partial last page and the linear layers' state copied).
  * The prefix cache: a hit skips those tokens' prefill, outputs do not change (fp32: tokens equal,
    logprobs to rounding; in the batch-invariant mode bit for bit); KV computed under older weights
    is never a hit; cached pages are evicted (least recently released first) before anyone is
    preempted; a hybrid model's hit needs a checkpoint of its linear layers' state.
  * Chunked prefill: a long prompt is prefilled over several iterations while running requests keep
    decoding, with the same result.
  * kv_on_swap: "keep" decodes on with the old KV, "recompute" re-prefills under the new weights.
  * Bad input at submit; nothing leaks after 1,000 random requests (groups, shared system prompts,
    preemptions, weight swaps, cancellations).
  * The batch-invariant matrix: cache on or off, cold or warm, any chunk budget, in a group or alone,
    preempted or not: the same bits, equal to ``DecoderLM.token_logprobs``, attention-only and hybrid.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.generator_engine as fast_ge
import ref.gated_deltanet as ref_gdn
import ref.generator_engine as ref_ge
from fast.paged_varlen_attention import varlen_attn as fast_varlen_attn
from test_generator_engine import LM, ToyLinear, assert_same, engine, small_config

TIMEOUT = 120.0
IMPLS = [pytest.param(ref_ge, id="ref"), pytest.param(fast_ge, id="fast")]
STATS = ("prompt_tokens", "computed_prompt_tokens", "prefix_hit_tokens", "evictions", "cached_pages",
         "state_checkpoints")


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# The Gated DeltaNet layers' sizes (a linear_layer is built from the config's linear_* fields).
GDN_SIZES = dict(linear_num_k_heads=2, linear_num_v_heads=4, linear_head_k_dim=8, linear_head_v_dim=8)
gdn_layer = ref_gdn.GatedDeltaNet


def hybrid_config(rg, **kw):
    return small_config(rg, layer_types=("linear", "attention"), **GDN_SIZES, **kw)


def tokens(rng, n, vocab=96):
    return [rng.randrange(vocab) for _ in range(n)]


def grpo_requests(rg, seed, *, prompts=4, n=3, system=11, max_new=6, vocab=96):
    """A small GRPO-like batch: ``prompts`` groups of n samples behind a shared system prompt."""
    rng = random.Random(seed)
    head = tokens(rng, system, vocab)
    return [rg.Request(head + tokens(rng, rng.randint(1, 14), vocab),
                       rg.SamplingParams(max_new_tokens=rng.randint(1, max_new), temperature=(0.0, 0.9)[i % 2],
                                         top_k=(0, 20)[i % 2], seed=100 * i, n=n),
                       request_id=f"g{seed}-{i}") for i in range(prompts)]


def as_list(result):
    return result if isinstance(result, list) else [result]


# ----------------------------------------------------------------------------- groups

@pytest.mark.parametrize("kind", ["attention", "hybrid"])
@pytest.mark.parametrize("rg", IMPLS)
def test_a_group_is_its_samples_alone(rg, kind):
    """n = 4 samples of one prompt: four completions, sample i equal to the request alone with seed + i
    (the samples differ from each other); the fast engine prefills the prompt once."""
    cfg = (hybrid_config if kind == "hybrid" else small_config)(rg)
    kw = dict(linear_layer=gdn_layer) if kind == "hybrid" else {}
    prompt = tokens(random.Random(3), 10)
    group = rg.Request(prompt, rg.SamplingParams(max_new_tokens=8, temperature=1.0, seed=7, n=4), request_id="grp")
    with engine(rg, cfg, seed=1, page_size=4, prefix_caching=False, **kw) as gen:
        samples = gen.submit(group).result(TIMEOUT)
        stats = gen.stats()
        alone = [gen.submit(rg.Request(prompt, rg.SamplingParams(max_new_tokens=8, temperature=1.0, seed=7 + i),
                                       request_id="grp")).result(TIMEOUT) for i in range(4)]
        model = gen.model
    assert [c.sample_index for c in samples] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in samples}) > 1, "the samples of a group must differ"
    for a, s in zip(alone, samples):
        assert_same(a, s, model)
    if rg is fast_ge:   # one prefill for the group, three forks (with the cache off: nothing from before)
        assert stats["computed_prompt_tokens"] == len(prompt) and stats["prefix_hit_tokens"] == 3 * len(prompt)
        assert stats["prompt_tokens"] == 4 * len(prompt)


def test_fast_groups_and_cache_equal_the_reference():
    """The GRPO batch through both engines with the cache on (and the fast one with it off): the same
    tokens, logprobs to fp32 rounding; the fast engine computes a fraction of the prompt tokens."""
    reqs = grpo_requests(fast_ge, seed=5)
    with engine(ref_ge, small_config(ref_ge), seed=2, page_size=4) as gen:
        expect = [c for r in gen.generate(grpo_requests(ref_ge, seed=5)) for c in r]
        model = gen.model
    for caching in (True, False):
        with engine(fast_ge, small_config(fast_ge), seed=2, page_size=4, prefix_caching=caching) as gen:
            got = [c for r in gen.generate(reqs) for c in r]
            stats = gen.stats()
        for e, g in zip(expect, got):
            assert (e.request_id, e.sample_index) == (g.request_id, g.sample_index)
            assert_same(e, g, model)
        print(f"fast, cache {'on' if caching else 'off'}: {dict((k, stats[k]) for k in STATS)}")
        assert stats["prompt_tokens"] == sum(3 * len(r.prompt_token_ids) for r in reqs)
        assert stats["computed_prompt_tokens"] + stats["prefix_hit_tokens"] == stats["prompt_tokens"]
        forks = sum(2 * len(r.prompt_token_ids) for r in reqs)          # samples 1 and 2 of each group
        if caching:      # and the shared system prompt's two full pages, past the first group
            assert stats["prefix_hit_tokens"] >= forks + 8 * (len(reqs) - 1)
        else:
            assert stats["prefix_hit_tokens"] == forks


@pytest.mark.parametrize("rg", IMPLS)
def test_identical_prompts_share_their_prefill(rg):
    """n ordinary requests with one prompt: the first computes it, the others hit its full pages."""
    prompt = tokens(random.Random(4), 21)
    reqs = [rg.Request(prompt, rg.SamplingParams(max_new_tokens=3, seed=i, temperature=0.5), request_id=f"same{i}")
            for i in range(4)]
    with engine(rg, small_config(rg), seed=1, page_size=4) as gen:
        gen.generate(reqs)
        stats = gen.stats()
    # Each repeat recomputes only the partial last page: 21 - 20 tokens.
    assert stats["computed_prompt_tokens"] == 21 + 3 * 1, stats
    assert stats["prefix_hit_tokens"] == 3 * 20, stats


# ----------------------------------------------------------------------------- the prefix cache

@pytest.mark.parametrize("rg", IMPLS)
def test_hits_skip_prefill_and_never_cross_a_weight_version(rg):
    cfg = small_config(rg)
    rng = random.Random(9)
    prompt = tokens(rng, 17)
    sp = rg.SamplingParams(max_new_tokens=4)
    with engine(rg, cfg, seed=1, page_size=4) as gen:
        first = gen.generate([rg.Request(prompt, sp, request_id="a")])[0]
        longer = gen.generate([rg.Request(prompt + tokens(rng, 6), sp, request_id="b")])[0]
        after = gen.stats()
        assert after["prefix_hit_tokens"] == 16 and after["cached_pages"] >= 4
        gen.load_weights(LM[rg].DecoderLM(cfg, seed=2).state_dict(), 1)
        again = gen.generate([rg.Request(prompt, sp, request_id="c")])[0]
        swapped = gen.stats()
        assert swapped["prefix_hit_tokens"] == after["prefix_hit_tokens"], "a hit on KV of the old weights"
        assert swapped["computed_prompt_tokens"] == after["computed_prompt_tokens"] + 17
    with engine(rg, cfg, seed=2, page_size=4, prefix_caching=False) as fresh:
        assert fresh.generate([rg.Request(prompt, sp, request_id="c")])[0].token_ids == again.token_ids
    with engine(rg, cfg, seed=1, page_size=4, prefix_caching=False) as cold:
        assert cold.generate([rg.Request(prompt + longer.prompt_token_ids[17:], sp, request_id="b")])[0].token_ids \
            == longer.token_ids
    assert first.token_ids and set(STATS) <= set(swapped)


def test_cached_pages_are_evicted_before_anyone_is_preempted():
    """A pool that holds one request at a time: the finished ones' pages stay cached and are evicted
    (least recently released first) for the next; nobody is preempted."""
    cfg = small_config(fast_ge)
    rng = random.Random(11)
    with engine(fast_ge, cfg, seed=1, page_size=4, num_pages=8, max_batch_size=1) as gen:
        for i in range(6):
            gen.generate([fast_ge.Request(tokens(rng, 20), fast_ge.SamplingParams(max_new_tokens=8),
                                          request_id=f"e{i}")])
        stats = gen.stats()
    assert stats["evictions"] > 0 and stats["preemptions"] == 0, stats
    assert stats["free_pages"] == 8


# ----------------------------------------------------------------------------- hybrid models

@pytest.mark.parametrize("rg", IMPLS)
def test_hybrid_hits_restore_the_linear_state(rg):
    """A hybrid's hit needs the linear layers' state after the hit's last page: a short prompt (7
    tokens, pages of 3) hits 6 tokens, and the outputs equal a run without the cache."""
    cfg = hybrid_config(rg)
    prompt = tokens(random.Random(12), 7)
    reqs = [rg.Request(prompt + extra, rg.SamplingParams(max_new_tokens=5, temperature=0.8, seed=i),
                       request_id=f"h{i}") for i, extra in enumerate([[], [], [3, 4]])]
    out = {}
    for caching in (True, False):
        with engine(rg, cfg, seed=1, page_size=3, prefix_caching=caching, linear_layer=ToyLinear) as gen:
            out[caching] = [gen.generate([r])[0] for r in reqs]
            stats = gen.stats()
            model = gen.model
        if caching:
            assert stats["prefix_hit_tokens"] == 6 + 6, stats      # (the third: 9 cached, its last page is new)
            assert stats["state_checkpoints"] >= 2
    for a, b in zip(out[False], out[True]):
        assert_same(a, b, model)


def test_hybrid_page_without_checkpoint_is_not_a_hit():
    prompt = tokens(random.Random(13), 13)
    with engine(fast_ge, hybrid_config(fast_ge), seed=1, page_size=4, num_checkpoints=0,
                linear_layer=ToyLinear) as gen:
        for i in range(2):
            gen.generate([fast_ge.Request(prompt, fast_ge.SamplingParams(max_new_tokens=2), request_id=f"n{i}")])
        stats = gen.stats()
    assert stats["prefix_hit_tokens"] == 0 and stats["cached_pages"] > 0 and stats["state_checkpoints"] == 0


def test_stats_count_the_kv_pool_and_the_checkpoints():
    """stats() reports the memory the cache holds: the K and V pools (2 x attention layers x pages x
    page_size x H_kv x D x elt) and, once a prefill wrote a checkpoint, num_checkpoints slots of every
    linear layer's fp32 recurrent state (HV x K x V x 4) and conv state (conv_dim x (W - 1) x elt)."""
    cfg = small_config(fast_ge, num_layers=3, layer_types=("linear", "attention", "linear"), **GDN_SIZES)
    with engine(fast_ge, cfg, seed=1, page_size=4, num_pages=10, num_checkpoints=6, linear_layer=gdn_layer) as gen:
        before = gen.stats()
        gen.generate([fast_ge.Request(tokens(random.Random(14), 13), fast_ge.SamplingParams(max_new_tokens=2))])
        after = gen.stats()
        elt = gen.dtype.itemsize
        linear = [gen.model.layers[i] for i, kind in enumerate(cfg.kinds) if kind == "linear"]
    gdn = ref_gdn.GatedDeltaNet(cfg.hidden_size, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    per_slot = len(linear) * (gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim * 4
                              + gdn.conv_dim * (gdn.conv_kernel_size - 1) * elt)
    kv = 2 * 1 * 10 * 4 * cfg.num_kv_heads * cfg.head_dim * elt
    assert before["kv_pool_bytes"] == after["kv_pool_bytes"] == kv, (before, kv)
    assert before["checkpoint_bytes"] == 0 and after["state_checkpoints"] > 0, (before, after)
    assert after["checkpoint_bytes"] == 6 * per_slot, (after, per_slot)


# ----------------------------------------------------------------------------- chunked prefill

class Recording(fast_ge.Generator):
    """The fast engine, recording per iteration the prefill work and how many requests decoded (its model
    runner's two passes, watched)."""

    def __init__(self, *args, **kw):
        self.log = []
        super().__init__(*args, **kw)
        prefill, decode = self.runner.prefill, self.runner.decode

        def watched_prefill(model, work):
            self.log.append(("prefill", [(c.seq.group.request.request_id, c.start, c.end) for c in work]))
            return prefill(model, work)

        def watched_decode(model, seqs):
            self.log.append(("decode", [s.group.request.request_id for s in seqs]))
            return decode(model, seqs)
        self.runner.prefill, self.runner.decode = watched_prefill, watched_decode


def test_chunked_prefill_lets_running_requests_decode():
    """A 60-token prompt with a budget of 8 tokens per iteration: it is prefilled in page-aligned
    chunks over 8 iterations, a running request decodes in every one of them, and the result equals
    a run with a budget that takes the prompt whole."""
    cfg = small_config(fast_ge, max_seq_len=96)
    rng = random.Random(14)
    short = fast_ge.Request(tokens(rng, 5), fast_ge.SamplingParams(max_new_tokens=30), request_id="short")
    long = fast_ge.Request(tokens(rng, 60), fast_ge.SamplingParams(max_new_tokens=6, temperature=0.7, seed=3),
                           request_id="long")
    with Recording(fast_lm.DecoderLM(cfg, seed=1), page_size=4, max_prefill_tokens=8) as gen:
        f_short = gen.submit(short)
        while not any(kind == "decode" for kind, _ in gen.log):
            pass
        got = gen.submit(long).result(TIMEOUT)
        f_short.result(TIMEOUT)
        log = list(gen.log)
    chunks = [(a, b) for kind, work in log if kind == "prefill" for rid, a, b in work if rid == "long"]
    assert chunks == [(a, min(a + 8, 60)) for a in range(0, 60, 8)], chunks
    # Every iteration that prefilled a chunk of the long prompt also decoded the short request.
    for i, (kind, work) in enumerate(log):
        if kind == "prefill" and any(rid == "long" for rid, _, _ in work) and work[-1][2] < 60:
            assert log[i + 1] == ("decode", ["short"]), log[i:i + 2]
    with engine(fast_ge, cfg, seed=1, page_size=4) as whole:
        expect = whole.generate([long])[0]
    assert_same(expect, got, whole.model)


# ----------------------------------------------------------------------------- weight swaps

@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_kv_on_swap(policy):
    """A request running across a swap: with "recompute" every token after the swap is sampled from
    the new weights over KV recomputed by them (teacher-forced logprobs of the new model); with
    "keep" the old KV stays (the later logprobs match neither model alone)."""
    cfg = small_config(fast_ge)
    old, new = (fast_lm.DecoderLM(cfg, seed=s) for s in (1, 2))
    req = fast_ge.Request(tokens(random.Random(15), 12), fast_ge.SamplingParams(max_new_tokens=40), request_id="x")
    with Recording(fast_lm.DecoderLM(cfg, seed=1), page_size=4, kv_on_swap=policy) as gen:
        future = gen.submit(req)
        while sum(kind == "decode" for kind, _ in gen.log) < 3:
            pass
        gen.load_weights(new.state_dict(), 1)
        done = future.result(TIMEOUT)
    assert (done.min_policy_version, done.max_policy_version) == (0, 1)
    ids = torch.tensor([req.prompt_token_ids + done.token_ids[:-1]])
    with torch.no_grad():
        lps = [torch.log_softmax(m(ids)[0, len(req.prompt_token_ids) - 1:], -1) for m in (old, new)]
    picked = [lp.gather(1, torch.tensor(done.token_ids)[:, None])[:, 0] for lp in lps]
    got = torch.tensor(done.logprobs)
    on_old = (got - picked[0]).abs() <= 1e-5
    swap = int(on_old.logical_not().nonzero()[0]) if not on_old.all() else len(got)
    assert 3 <= swap < len(got) and on_old[:swap].all()
    on_new = (got[swap:] - picked[1][swap:]).abs() <= 1e-4
    if policy == "recompute":
        assert on_new.all(), (got[swap:], picked[1][swap:])
    else:
        assert not on_new[1:].all(), "with the old KV kept, the new weights alone should not explain the logprobs"


# ----------------------------------------------------------------------------- bad input, accounting

@pytest.mark.parametrize("rg", IMPLS)
def test_bad_group_and_sampling_inputs(rg):
    with pytest.raises(ValueError, match="n .samples of the prompt."):
        rg.SamplingParams(n=0)
    with pytest.raises(ValueError, match="seed"):
        rg.SamplingParams(seed=2 ** 64 - 2, n=3)
    sp = rg.SamplingParams(max_new_tokens=4)
    object.__setattr__(sp, "max_new_tokens", -3)          # changed after construction: submit checks again
    kw = dict(max_batch_size=4, num_pages=6, page_size=4) if rg is fast_ge else {}
    with engine(rg, small_config(rg), **kw) as gen:
        with pytest.raises(ValueError, match="max_new_tokens"):
            gen.submit(rg.Request([1, 2, 3], sp))
        if rg is fast_ge:
            with pytest.raises(ValueError, match="max_batch_size"):
                gen.submit(rg.Request([1, 2], rg.SamplingParams(n=5)))
            with pytest.raises(ValueError, match="can never fit"):
                gen.submit(rg.Request(list(range(9)), rg.SamplingParams(n=4, max_new_tokens=12)))
        assert len(gen.generate([rg.Request([1, 2], rg.SamplingParams(n=2, max_new_tokens=2))])[0]) == 2


def assert_no_leak(gen):
    """Idle: every page free or cached, every reference count zero, no key pending, every row free,
    every cached page keyed, checkpoints only on keyed pages."""
    pages = gen.scheduler.pages
    assert sum(pages.refs) == 0, [p for p, r in enumerate(pages.refs) if r]
    assert len(pages.free) + len(pages.cached) == gen.num_pages
    assert not set(pages.free) & set(pages.cached) and not pages.pending
    assert all(p in pages.key_of for p in pages.cached) and not any(p in pages.key_of for p in pages.free)
    assert set(pages.checkpoint_of) <= set(pages.key_of)
    assert len(pages.free_checkpoints) + len(pages.checkpoint_of) == gen.num_checkpoints
    sched = gen.scheduler
    assert sorted(sched.free_rows) == list(range(gen.max_batch_size))
    assert not sched.waiting and not sched.running and not sched.prefilling


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_nothing_leaks_after_random_traffic(policy):
    """1,000 random requests (groups of 1-4, three shared system prompts, a pool small enough to preempt
    and evict, weight swaps, cancellations) on a hybrid model: idle afterwards, nothing is held."""
    cfg = hybrid_config(fast_ge)
    rng = random.Random(16 + (policy == "recompute"))
    systems = [tokens(rng, n) for n in (5, 9, 13)]
    new_weights = fast_lm.DecoderLM(cfg, seed=3, linear_layer=ToyLinear).state_dict()
    with engine(fast_ge, cfg, seed=1, page_size=3, num_pages=48, max_batch_size=6, max_prefill_tokens=24,
                num_checkpoints=12, kv_on_swap=policy, linear_layer=ToyLinear) as gen:
        futures, cancelled, total = [], 0, 0
        for i in range(1000):
            n = rng.choice((1, 1, 2, 4))
            sp = fast_ge.SamplingParams(max_new_tokens=rng.randint(1, 24), temperature=rng.choice((0.0, 1.0)),
                                        seed=i * 8, n=n)
            f = gen.submit(fast_ge.Request(rng.choice(systems) + tokens(rng, rng.randint(0, 8)), sp))
            total += n
            if rng.random() < 0.05 and f.cancel():
                cancelled += 1
                continue
            futures.append((f, n))
            if i % 250 == 125:
                gen.load_weights(new_weights, i)
            if i % 50 == 49:
                futures[-1][0].result(TIMEOUT)          # let the engine catch up now and then
        served = sum(len(as_list(f.result(TIMEOUT))) for f, _ in futures)
        assert served == sum(n for _, n in futures)
        stats = gen.stats()
        assert_no_leak(gen)
    print(f"{served} samples, {cancelled} cancelled: {dict((k, stats[k]) for k in (*STATS, 'preemptions'))}")
    assert stats["preemptions"] > 0 and stats["evictions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["state_checkpoints"] > 0 and cancelled > 0


# ----------------------------------------------------------------------------- the trainer's shared prompts

def grpo_sequences(seed, *, prompts=3, n=3, vocab=96):
    """prompt + completion token lists: ``prompts`` prompts with n completions each, shuffled."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(prompts):
        p = tokens(rng, rng.randint(1, 11), vocab)
        seqs += [(p + tokens(rng, rng.randint(1, 7), vocab), len(p)) for _ in range(n)]
    rng.shuffle(seqs)
    return [s for s, _ in seqs], [p for _, p in seqs]


def loss_and_grads(model, seqs, prompts, **kw):
    model.zero_grad()
    lps = model.token_logprobs(seqs, prompts, temperature=0.8, **kw)
    torch.stack([lp.square().sum() for lp in lps]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(lps).detach(), grads


@pytest.mark.parametrize("rg,kind", [(ref_ge, "attention"), (ref_ge, "hybrid"), (fast_ge, "attention"),
                                     (fast_ge, "hybrid"), (fast_ge, "attention+varlen_attn"),
                                     (fast_ge, "windows+sinks")],
                         ids=["ref-attention", "ref-hybrid", "fast-attention", "fast-hybrid", "fast-varlen_attn",
                              "fast-windows+sinks"])
def test_shared_prompt_recompute_equals_separate_recomputes(rg, kind):
    """token_logprobs over GRPO groups with each prompt computed once (cascade attention, the linear
    layers continuing from the prompt's state; a sliding layer's completions over their prompt's keys and
    their own within the window) against the same sequences recomputed whole: values and every
    parameter's gradient within the tolerance rule (fp64 reference, fp32 separate recomputes as the
    low-precision baseline).  windows+sinks: gpt-oss's attention, layer 0 within 4 keys, perturbed sinks."""
    from conftest import check_close
    cfg = (hybrid_config if kind == "hybrid" else small_config)(rg)
    if kind == "windows+sinks":
        cfg = dataclasses.replace(cfg, attention_sinks=True, sliding_window=4, sliding_layers=(0,))
    kw = dict(linear_layer=gdn_layer) if kind == "hybrid" else {}
    seqs, prompts = grpo_sequences(seed=17)
    plug = dict(varlen_attn=fast_varlen_attn) if kind in ("attention+varlen_attn", "windows+sinks") else {}
    model = LM[rg].DecoderLM(cfg, seed=4, **kw, **plug)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():              # the sinks
                p.copy_(torch.linspace(-1.0, 1.5, p.numel()).view(p.shape))
    shared, g_shared = loss_and_grads(model, seqs, prompts, share_prompts=True)
    separate, g_separate = loss_and_grads(model, seqs, prompts, share_prompts=False)
    model64 = LM[rg].DecoderLM(cfg, seed=4, dtype=torch.float64, **kw)
    model64.load_state_dict(model.state_dict())
    exact, g_exact = loss_and_grads(model64, seqs, prompts, share_prompts=False)
    check_close("logprobs", shared, exact, separate)
    assert set(g_shared) == set(g_exact)
    for name in g_exact:
        check_close(f"grad {name}", g_shared[name], g_exact[name], g_separate[name], factor=3.0)


def test_groups_decode_through_cascade_decode():
    """The fast engine with this repo's kernels, cascade_decode plugged in: a group's samples decode side
    by side, their prompt's shared pages read once per step; tokens equal the reference's, logprobs to
    the kernels' fp32 rounding."""
    from fast.flash_decoding import cascade_decode, flash_decode
    reqs = grpo_requests(fast_ge, seed=19, prompts=2, n=3, max_new=5)
    calls = []

    def counted(*args, **kw):
        calls.append(kw["cu_groups"].numel() - 1)
        return cascade_decode(*args, **kw)

    with engine(ref_ge, small_config(ref_ge), seed=2, page_size=4) as gen:
        expect = [c for r in gen.generate(grpo_requests(ref_ge, seed=19, prompts=2, n=3, max_new=5)) for c in r]
        model = gen.model
    with engine(fast_ge, small_config(fast_ge), seed=2, page_size=4, varlen_attn=fast_varlen_attn,
                flash_decode=flash_decode, cascade_decode=counted) as gen:
        got = [c for r in gen.generate(reqs) for c in r]
    assert calls, "no decode step went through cascade_decode"
    for e, g in zip(expect, got):
        assert_same(e, g, model, rtol=1e-4)


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_loaded"])
def test_router_prefix_affinity_over_engines(policy):
    """Two fast engines behind a router, GRPO samples sent as n ordinary requests (and one group request):
    with prefix_affinity the samples of a prompt meet their prompt's pages on one engine, so most of
    the prompt tokens are hits; least_loaded spreads them.  Every sample is served once."""
    import fast.routed_generator as fast_rg
    gens = [engine(fast_ge, small_config(fast_ge), seed=2, page_size=4, name=f"e{i}", max_batch_size=16)
            for i in range(2)]
    router = fast_rg.GeneratorRouter(gens, policy=policy, affinity_block=4, affinity_slack=100)
    rng = random.Random(23)
    system = tokens(rng, 12)
    try:
        futures = []
        for p in range(6):
            prompt = system + tokens(rng, rng.randint(8, 16))
            futures += [router.submit(fast_rg.Request(prompt, fast_rg.SamplingParams(max_new_tokens=3, temperature=1.0,
                                                                                     seed=10 * p + i)))
                        for i in range(4)]
        group = router.submit(fast_rg.Request(system + [5, 6], fast_rg.SamplingParams(max_new_tokens=2, n=3, seed=1)))
        done = [f.result(TIMEOUT) for f in futures]
        samples = group.result(TIMEOUT)
        stats = [g.stats() for g in gens]
    finally:
        for g in gens:
            g.close()
    assert len(done) == 24 and len(samples) == 3 and len({c.generator_id for c in samples}) == 1
    hits = sum(s["prefix_hit_tokens"] for s in stats) / sum(s["prompt_tokens"] for s in stats)
    placements = [len({c.generator_id for c in done[4 * p:4 * p + 4]}) for p in range(6)]
    print(f"{policy}: hit rate {hits:.2f}, engines per prompt {placements}")
    if policy == "prefix_affinity":      # each prompt's samples on one engine
        assert placements == [1] * 6, placements
    else:                                # least_loaded alternates them
        assert max(placements) == 2, placements
