"""Speculative decoding (issue 43): the reference engine's drafts and verification give plain decoding's tokens.

ref/generator_engine.py's ``Generator(speculative=...)``: each decode step proposes up to k drafts (``"ngram"``:
prompt lookup, or any drafter function) and verifies them in one forward; position by position the token is drawn
from the target's row with its own keyed draw (``keyed_uniform(seed, j)``), a draft accepted while it equals that
token.  The tokens must therefore be plain decoding's, greedy and sampled, and the logprobs the target's rows
(rounding apart: a verification computes several rows in one forward, a plain step one).  The look-ahead is
rolled back and the accepted tokens fed again, so the prefix cache and the Gated DeltaNet states hold accepted
tokens only.

A test-only drafter proposes plain decoding's own continuation with one planted error, its position cycling
through 0 .. k (k: no error), so every acceptance length 0 .. k occurs.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.generator_engine as fast_ge
import ref.decoder_lm as ref_lm
import ref.gated_deltanet as ref_gdn
import ref.generator_engine as ref_ge
from conftest import DEVICE, requires_gpu
from test_batch_invariant_engine import wide_interpreter_segments  # noqa: F401  (a fixture)
from test_generator_engine import LP_RTOL, assert_same

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

K = 4
VOCAB = 96
GDN = functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=ref_gdn.chunk_gated_delta_rule)


IMPLS = [pytest.param(ref_ge, id="ref"), pytest.param(fast_ge, id="fast")]
LM = {ref_ge: ref_lm, fast_ge: fast_lm}


def config(kind: str, lm=ref_lm):
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, max_seq_len=96, tie_embeddings=False)
    if kind == "hybrid":
        kw.update(layer_types=("linear", "attention"), linear_num_k_heads=2, linear_num_v_heads=4,
                  linear_head_k_dim=8, linear_head_v_dim=8)
    if kind == "windows":       # gpt-oss's layers: a window of 3 keys (fewer than a verification's K + 1 rows), sinks
        kw.update(sliding_window=3, sliding_layers=(0,), attention_sinks=True, qkv_bias=True)
    return lm.ModelConfig(**kw)


def model(kind: str, lm=ref_lm, **kw):
    m = lm.DecoderLM(config(kind, lm), seed=5, linear_layer=GDN if kind == "hybrid" else None, **kw)
    with torch.no_grad():                  # every parameter away from its init (zeros / ones hide formulas)
        gen = torch.Generator().manual_seed(9)
        for p in m.parameters():
            p.add_((0.05 * torch.randn(p.shape, generator=gen)).to(p.device))
    return m


def requests(ge=ref_ge) -> list:
    """Greedy, tempered, top-k / top-p, a stop token, a group of 2 (sample i keyed by seed + i), a negative seed;
    prompts long enough to fill prefix-cache pages of 8, two sharing their first 16 tokens (hits)."""
    shared = [(7 * i + 3) % VOCAB for i in range(16)]
    sp = ge.SamplingParams
    return [ge.Request(shared + [1, 2], sp(max_new_tokens=30), request_id="greedy"),
            ge.Request(shared + [5], sp(max_new_tokens=30, temperature=0.9, seed=3), request_id="tempered"),
            ge.Request([9, 8, 7], sp(max_new_tokens=25, temperature=1.2, top_k=12, top_p=0.9, seed=-4),
                       request_id="top-k-p"),
            ge.Request([4] * 5, sp(max_new_tokens=25, temperature=1.0, seed=11, n=2), request_id="group"),
            ge.Request([2, 71, 33], sp(max_new_tokens=30, stop_token_ids=(17, 40, 63)), request_id="stops")]


def flat(done) -> list:
    return [c for d in done for c in (d if isinstance(d, list) else [d])]


class PlantedDrafter:
    """Proposes plain decoding's continuation of the sequence so far (looked up by its prompt and sample), the
    token at a planted offset replaced; the offset cycles through 0 .. k - 1 and then none (full acceptance).
    Records every proposal's length and planted offset."""

    def __init__(self, plain: list, requests: list):
        self.plain = {}
        samples = [request for request in requests for _ in range(request.sampling.n)]
        for r, c in zip(samples, plain, strict=True):
            self.plain.setdefault(tuple(r.prompt_token_ids), []).append(c.token_ids)
        self.step, self.proposals = 0, []

    def __call__(self, tokens: list, k: int) -> list:
        for prompt, continuations in self.plain.items():
            if tuple(tokens[:len(prompt)]) != prompt:
                continue
            done = tokens[len(prompt):]
            for cont in continuations:                     # the sample whose continuation this is
                if cont[:len(done)] == done:
                    draft = list(cont[len(done):len(done) + k])
                    error = self.step % (K + 1)
                    self.step += 1
                    if error < len(draft):
                        draft[error] = (draft[error] + 1) % VOCAB
                    self.proposals.append((len(draft), error))
                    return draft
        raise AssertionError(f"no plain continuation for {tokens}")


@pytest.mark.parametrize("ge", IMPLS)
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_speculative_tokens_are_plain_decodings(ge, kind):
    """Every acceptance length 0 .. K at every kind of row: the completions equal plain decoding's (tokens
    exactly, logprobs to fp32 rounding), with the prefix cache on (hits; pages filled by accepted tokens only: a
    second pass over the same requests hits what plain decoding's second pass hits).  The fast engine's pool
    of 14 pages of 8 for 6 samples of up to 48 tokens preempts, and its prefill budget of 12 tokens cuts prompts:
    verifications ride in the same passes as prefill chunks, and a recomputed sample speculates again."""
    reqs = requests(ge)
    knobs = dict(page_size=8) if ge is ref_ge else dict(page_size=8, num_pages=14, max_prefill_tokens=12)
    with ge.Generator(model(kind, LM[ge]), **knobs) as gen:
        plain = flat(gen.generate(reqs))
        plain_again = flat(gen.generate(reqs))
        plain_stats = gen.stats()
    drafter = PlantedDrafter(plain, reqs)
    with ge.Generator(model(kind, LM[ge]), speculative=drafter, num_speculative_tokens=K, **knobs) as gen:
        got = flat(gen.generate(reqs))
        got_again = flat(gen.generate(reqs))
        stats = gen.stats()
    worst = max(assert_same(e, g, model=None) for e, g in zip(plain + plain_again, got + got_again, strict=True))
    print(f"\n[speculative, {ge.__name__}, {kind}] largest |logprob - plain| = {worst:.2e}; "
          f"{stats['accepted_draft_tokens']} of {stats['draft_tokens']} drafts accepted")
    if ge is ref_ge:
        for name in ("prefix_hit_tokens", "computed_prompt_tokens", "cached_pages", "state_checkpoints"):
            assert stats[name] == plain_stats[name], (name, stats[name], plain_stats[name])
    else:
        assert stats["preemptions"] >= 1 and stats["prefix_hit_tokens"] > 0, stats
    assert {error for n, error in drafter.proposals if n == K} >= set(range(K + 1))   # every acceptance length
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"] and plain_stats["draft_tokens"] == 0
    lengths = stats["acceptance_lengths"]                # verifications by drafts accepted: every length occurs
    assert len(lengths) == K + 1 and all(lengths) and sum(j * n for j, n in enumerate(lengths)) == \
        stats["accepted_draft_tokens"], lengths


@pytest.mark.parametrize("kind", ["hybrid"])          # (its attention layer takes the S-row attention too)
def test_speculation_through_the_compiled_static_step(kind):
    """Generator(compile=True, speculative=...): an iteration whose work is verification alone runs it through
    the compiled static step too (each chunk padded to k + 1 rows, the batch to 8); samples without drafts step
    through the compiled decode step beside it.  Every acceptance length 0 .. k occurs, drafts shorter than k
    too (a third of the samples propose none, the completions' ends cut the rest), and the completions stay
    plain decoding's; the hybrid's Gated DeltaNet layers, which ran over the padding rows too, are rolled back
    to the accepted rows."""
    reqs = requests(fast_ge)
    knobs = dict(page_size=8, num_pages=14, max_prefill_tokens=12)
    with fast_ge.Generator(model(kind, fast_lm), **knobs) as gen:
        plain = flat(gen.generate(reqs))
    drafter = PlantedDrafter(plain, reqs)
    sometimes = lambda tokens, k: drafter(tokens, k) if len(tokens) % 3 else []      # noqa: E731  (a third: none)
    with fast_ge.Generator(model(kind, fast_lm), compile=True, capture_sizes=(8,), speculative=sometimes,
                           num_speculative_tokens=K, **knobs) as gen:
        got = flat(gen.generate(reqs))
        stats = gen.stats()
    assert stats["static_decode_steps"] > 0 and stats["static_verify_steps"] > 5, stats
    assert {error for n, error in drafter.proposals if n == K} >= set(range(K + 1))
    assert any(0 < n < K for n, _ in drafter.proposals), drafter.proposals       # padded rows beside real ones
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"], stats
    for e, g in zip(plain, got, strict=True):
        assert_same(e, g, rtol=4 * LP_RTOL)                 # (the compiled step rounds its own way)


@pytest.mark.parametrize("attention", ["in-file", "flash_decode"])
def test_sliding_layers_verify_in_the_static_step(attention, monkeypatch):
    """A sliding layer's verification rows each see their own window (3 keys, fewer than the K + 1 = 5 rows: the
    last rows see new keys only) in the static step: through this repo's flash_decode (``window_size=(2, 0)``,
    the interpreter) and through the in-file attention's per-row mask; the static step uncompiled (torch.compile
    the identity: the same code without inductor's compile time).  Verifications alone run it, every
    acceptance length occurs, and the completions are plain decoding's (an eager engine's, the same attention)."""
    from fast.flash_decoding import flash_decode
    reqs = requests(fast_ge)
    knobs = dict(page_size=8, num_pages=14, max_prefill_tokens=12)
    if attention == "flash_decode":
        knobs["flash_decode"] = flash_decode
    with fast_ge.Generator(model("windows", fast_lm), **knobs) as gen:
        plain = flat(gen.generate(reqs))
    drafter = PlantedDrafter(plain, reqs)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    with fast_ge.Generator(model("windows", fast_lm), compile=True, capture_sizes=(8,), speculative=drafter,
                           num_speculative_tokens=K, **knobs) as gen:
        got = flat(gen.generate(reqs))
        stats = gen.stats()
    assert stats["static_verify_steps"] > 5, stats
    assert {error for n, error in drafter.proposals if n == K} >= set(range(K + 1))
    for e, g in zip(plain, got, strict=True):
        assert_same(e, g, rtol=4 * LP_RTOL)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["attention", "hybrid", "windows"])
def test_gpu_speculation_replays_cuda_graphs(kind):
    """On a GPU, fp32, this repo's flash_decode: a verification alone replays its own CUDA graph (k + 1 rows a
    sample, captured per padded size; a sliding layer's rows each within their window), decode steps theirs;
    the completions are plain decoding's (an eager engine's on the same GPU), every acceptance length occurs."""
    from fast.flash_decoding import flash_decode
    reqs = requests(fast_ge)
    knobs = dict(page_size=8, num_pages=14, max_prefill_tokens=12, flash_decode=flash_decode)
    with fast_ge.Generator(model(kind, fast_lm).to(DEVICE), **knobs) as gen:
        plain = flat(gen.generate(reqs))
    drafter = PlantedDrafter(plain, reqs)
    with fast_ge.Generator(model(kind, fast_lm).to(DEVICE), cuda_graphs=True, capture_sizes=(2, 8),
                           speculative=drafter, num_speculative_tokens=K, **knobs) as gen:
        got = flat(gen.generate(reqs))
        stats, keys = gen.stats(), set(gen.runner.static.graphs)
    assert stats["static_verify_steps"] > 0 and "verify" in {kind for _, _, kind in keys}, (stats, keys)
    assert {error for n, error in drafter.proposals if n == K} >= set(range(K + 1))
    for e, g in zip(plain, got, strict=True):
        assert_same(e, g, rtol=4 * LP_RTOL)


@pytest.mark.usefixtures("wide_interpreter_segments")
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_speculative_rollouts_stay_bitwise_in_the_mode(kind, monkeypatch):
    """The fast engine in the batch-invariant mode (the repo's attention kernels, interpreter): a verification's
    rows are computed as the decode steps would compute them (a row's bits do not depend on how many rows share
    the call), so with every acceptance length the completions' logprobs are plain decoding's bit for bit and
    the trainer's token_logprobs; the hybrid's Gated DeltaNet layers drop the rejected rows from their chunk
    buffers (``GatedDeltaNet.rewind``) or, where the pass completed a chunk, go back to their state before it
    and run again over the accepted rows."""
    rewound = []
    rewind = ref_gdn.GatedDeltaNet.rewind

    def counted(*args):
        rewound.extend(rewind(*args))
        return rewound[len(rewound) - len(args[3]):]
    monkeypatch.setattr(ref_gdn.GatedDeltaNet, "rewind", counted)
    from fast.flash_decoding import flash_decode
    from fast.paged_varlen_attention import varlen_attn
    reqs = [fast_ge.Request(r.prompt_token_ids, dataclasses.replace(r.sampling, max_new_tokens=14),
                            request_id=r.request_id) for r in requests(fast_ge)[1:4]]       # (the interpreter: few)
    kw = dict(page_size=8, num_pages=6, max_prefill_tokens=12, flash_decode=flash_decode)
    mode = functools.partial(model, kind, fast_lm, batch_invariant=True, varlen_attn=varlen_attn, device=DEVICE)
    with fast_ge.Generator(mode(), **kw) as gen:
        plain = flat(gen.generate(reqs))
    drafter = PlantedDrafter(plain, reqs)
    trainer = mode()
    with fast_ge.Generator(mode(), speculative=drafter, num_speculative_tokens=K, **kw) as gen:
        got = flat(gen.generate(reqs))
        stats = gen.stats()
    assert stats["preemptions"] >= 1 and 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"], stats
    assert {error for n, error in drafter.proposals if n == K} >= set(range(K + 1))
    assert kind == "attention" or rewound.count(True) > 0, rewound
    temps = {r.request_id: r.sampling.temperature for r in reqs}
    with torch.no_grad():
        lps = trainer.token_logprobs([c.prompt_token_ids + c.token_ids for c in got],
                                     [len(c.prompt_token_ids) for c in got],
                                     temperature=[temps[c.request_id] for c in got])
    for e, g, lp in zip(plain, got, lps, strict=True):
        assert (g.token_ids, g.logprobs, g.finish_reason) == (e.token_ids, e.logprobs, e.finish_reason), g.request_id
        assert torch.equal(torch.tensor(g.logprobs, dtype=torch.float32), lp.cpu()), g.request_id


@pytest.mark.parametrize("ge", IMPLS)
def test_ngram_drafting_accepts_repeats_and_keeps_plain_tokens(ge):
    """Prompt lookup on prompts that repeat a phrase (what it is for): drafts are proposed and some accepted,
    and the tokens stay plain decoding's, greedy and sampled."""
    phrase = [11, 23, 35, 47, 59, 71]
    sp = ge.SamplingParams
    reqs = [ge.Request(phrase * 4, sp(max_new_tokens=24), request_id="greedy"),
            ge.Request(phrase * 3 + [5], sp(max_new_tokens=24, temperature=0.7, seed=1), request_id="sampled")]
    with ge.Generator(model("attention", LM[ge])) as gen:
        plain = flat(gen.generate(reqs))
    with ge.Generator(model("attention", LM[ge]), speculative="ngram", num_speculative_tokens=3) as gen:
        got = flat(gen.generate(reqs))
        stats = gen.stats()
    for e, g in zip(plain, got, strict=True):
        assert_same(e, g)
    assert stats["accepted_draft_tokens"] > 0, stats


def test_ngram_draft_proposes_the_latest_longest_match():
    draft = ref_ge.ngram_draft
    assert draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]        # the latest occurrence of [1, 2, 3]
    assert draft([5, 1, 2, 8, 2, 6, 1, 2], 3) == [8, 2, 6]              # the 2-gram [1, 2] (no 3-gram recurs)
    assert draft([4, 5, 6, 4, 5], 4) == [6, 4, 5]                       # up to the end of the sequence
    assert draft([1, 2, 3, 4], 3) == [] and draft([7], 3) == [] and draft([], 3) == []
    assert draft([3, 3, 3, 3], 2) == [3]                                # the match just before the suffix
    assert draft([8, 8, 8, 8, 8, 8, 8], 3) == [8, 8, 8]                 # a run: the latest match with k after it
    assert draft([1, 2, 5, 6, 9, 1, 2, 7, 1, 2], 4) == [5, 6, 9, 1]     # the latest with 4 after it, not [7, 1, 2]
    assert draft([1, 2, 1, 2, 1, 2], 2, max_n=2, min_n=2) == [1, 2]


@pytest.mark.parametrize("ge", IMPLS)
def test_bad_speculative_knobs_raise(ge):
    m = model("attention", LM[ge])
    with pytest.raises(ValueError, match="needs a model with Qwen3.5's MTP head"):
        ge.Generator(m, speculative="mtp")
    with pytest.raises(ValueError, match="speculative must be None, 'ngram', 'mtp' or a drafter"):
        ge.Generator(m, speculative=3)
    for k in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            ge.Generator(m, speculative="ngram", num_speculative_tokens=k)
    if ge is fast_ge:
        with pytest.raises(ValueError, match="speculative='mtp' is not built for tensor-parallel engines"):
            ge.Generator(m, speculative="mtp", tensor_parallel_size=2)
        with pytest.raises(ValueError, match="drafter must be picklable"):
            ge.Generator(m, speculative=lambda tokens, k: [], tensor_parallel_size=2)
        with ge.Generator(m, speculative=lambda tokens, k: [VOCAB] * k) as gen:   # a drafter out of the vocabulary
            with pytest.raises(ValueError, match="the drafter proposed"):
                gen.generate([ge.Request([1, 2, 3], ge.SamplingParams(max_new_tokens=4))])


@pytest.mark.parametrize("count", [0, 9, 58, 60])
def test_the_layers_rewind_is_the_shorter_call(count):
    """GatedDeltaNet.rewind in the batch-invariant mode: two sequences whose current chunks hold ``count`` and
    count + 1 tokens, continued by 5 tokens each, then rewound to their first k (1 .. 5): every field of the
    cache (the chunk's start state, its buffered rows and their count, the conv state) is bit for bit the
    cache continued by those k tokens alone.  Where the 5 tokens complete a chunk (count + 5 >= 64) the start
    state moved: rewind declines (False) and leaves that sequence for the engine to rerun."""
    import copy

    torch.manual_seed(count)
    layer = ref_gdn.GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    layer.set_batch_invariant(ref_lm.invariant_linear)
    prompts = [torch.randn(1, count + n + 1, 32) for n in range(2)]       # (at least one token: a cache)
    new = torch.randn(2, 5, 32)
    with torch.no_grad():
        caches = []
        for x in prompts:
            cache = layer.new_cache()
            layer(x, cache=cache)
            caches.append(cache)
        start = ref_gdn.GatedDeltaNetCache(*[torch.cat([getattr(c, f) for c in caches]) for f in FIELDS])
        for k in range(1, 6):
            before, after = copy.deepcopy(start), copy.deepcopy(start)
            layer(new, cache=after)
            done = layer.rewind(after, before, list(new), [k, k])
            want = copy.deepcopy(start)
            layer(new[:, :k], cache=want)
            for n in range(2):
                completes = count + n + 1 + 5 >= 64
                assert done[n] is not completes, (count, n, k)
                if done[n]:
                    for field in FIELDS:
                        assert torch.equal(getattr(after, field)[n], getattr(want, field)[n]), (count, n, k, field)


FIELDS = ("conv_state", "recurrent_state", "chunk_qkv", "chunk_g", "chunk_beta", "chunk_len")
