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

import functools

import pytest
import torch

import ref.decoder_lm as ref_lm
import ref.gated_deltanet as ref_gdn
import ref.generator_engine as ref_ge
from test_generator_engine import assert_same

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

K = 4
VOCAB = 96
GDN = functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=ref_gdn.chunk_gated_delta_rule)


def config(kind: str) -> ref_lm.ModelConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, max_seq_len=96, tie_embeddings=False)
    if kind == "hybrid":
        kw.update(layer_types=("linear", "attention"), linear_num_k_heads=2, linear_num_v_heads=4,
                  linear_head_k_dim=8, linear_head_v_dim=8)
    return ref_lm.ModelConfig(**kw)


def model(kind: str) -> ref_lm.DecoderLM:
    m = ref_lm.DecoderLM(config(kind), seed=5, linear_layer=GDN if kind == "hybrid" else None)
    with torch.no_grad():                  # every parameter away from its init (zeros / ones hide formulas)
        gen = torch.Generator().manual_seed(9)
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return m


def requests() -> list:
    """Greedy, tempered, top-k / top-p, a stop token, a group of 2 (sample i keyed by seed + i), a negative seed;
    prompts long enough to fill prefix-cache pages of 8, two sharing their first 16 tokens (hits)."""
    shared = [(7 * i + 3) % VOCAB for i in range(16)]
    sp = ref_ge.SamplingParams
    return [ref_ge.Request(shared + [1, 2], sp(max_new_tokens=30), request_id="greedy"),
            ref_ge.Request(shared + [5], sp(max_new_tokens=30, temperature=0.9, seed=3), request_id="tempered"),
            ref_ge.Request([9, 8, 7], sp(max_new_tokens=25, temperature=1.2, top_k=12, top_p=0.9, seed=-4),
                           request_id="top-k-p"),
            ref_ge.Request([4] * 5, sp(max_new_tokens=25, temperature=1.0, seed=11, n=2), request_id="group"),
            ref_ge.Request([2, 71, 33], sp(max_new_tokens=30, stop_token_ids=(17, 40, 63)), request_id="stops")]


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


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_speculative_tokens_are_plain_decodings(kind):
    """Every acceptance length 0 .. K at every kind of row: the completions equal plain decoding's (tokens
    exactly, logprobs to fp32 rounding), with the prefix cache on (hits, pages filled by accepted tokens only:
    a second pass over the same requests hits the same pages as plain decoding's second pass)."""
    reqs = requests()
    with ref_ge.Generator(model(kind), page_size=8) as gen:
        plain = flat(gen.generate(reqs))
        plain_again = flat(gen.generate(reqs))
        plain_stats = gen.stats()
    drafter = PlantedDrafter(plain, reqs)
    with ref_ge.Generator(model(kind), page_size=8, speculative=drafter, num_speculative_tokens=K) as gen:
        got = flat(gen.generate(reqs))
        got_again = flat(gen.generate(reqs))
        stats = gen.stats()
    worst = max(assert_same(e, g, model=None) for e, g in zip(plain + plain_again, got + got_again, strict=True))
    print(f"\n[speculative, {kind}] largest |logprob - plain| = {worst:.2e}; {stats['accepted_draft_tokens']} of "
          f"{stats['draft_tokens']} drafts accepted")
    for name in ("prefix_hit_tokens", "computed_prompt_tokens", "cached_pages", "state_checkpoints"):
        assert stats[name] == plain_stats[name], (name, stats[name], plain_stats[name])
    assert {error for n, error in drafter.proposals if n == K} >= set(range(K + 1))   # every acceptance length
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"] and plain_stats["draft_tokens"] == 0


def test_ngram_drafting_accepts_repeats_and_keeps_plain_tokens():
    """Prompt lookup on prompts that repeat a phrase (what it is for): drafts are proposed and some accepted,
    and the tokens stay plain decoding's, greedy and sampled."""
    phrase = [11, 23, 35, 47, 59, 71]
    sp = ref_ge.SamplingParams
    reqs = [ref_ge.Request(phrase * 4, sp(max_new_tokens=24), request_id="greedy"),
            ref_ge.Request(phrase * 3 + [5], sp(max_new_tokens=24, temperature=0.7, seed=1), request_id="sampled")]
    with ref_ge.Generator(model("attention")) as gen:
        plain = flat(gen.generate(reqs))
    with ref_ge.Generator(model("attention"), speculative="ngram", num_speculative_tokens=3) as gen:
        got = flat(gen.generate(reqs))
        stats = gen.stats()
    for e, g in zip(plain, got, strict=True):
        assert_same(e, g)
    assert stats["draft_tokens"] > 0, stats


def test_ngram_draft_proposes_the_latest_longest_match():
    draft = ref_ge.ngram_draft
    assert draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]        # the latest occurrence of [1, 2, 3]
    assert draft([5, 1, 2, 8, 2, 6, 1, 2], 3) == [8, 2, 6]              # the 2-gram [1, 2] (no 3-gram recurs)
    assert draft([4, 5, 6, 4, 5], 4) == [6, 4, 5]                       # up to the end of the sequence
    assert draft([1, 2, 3, 4], 3) == [] and draft([7], 3) == [] and draft([], 3) == []
    assert draft([3, 3, 3, 3], 2) == [3]                                # the match just before the suffix
    assert draft([1, 2, 1, 2, 1, 2], 2, max_n=2, min_n=2) == [1, 2]


def test_bad_speculative_knobs_raise():
    m = model("attention")
    with pytest.raises(ValueError, match="'mtp', is not built yet"):
        ref_ge.Generator(m, speculative="mtp")
    with pytest.raises(ValueError, match="speculative must be None, 'ngram' or a drafter"):
        ref_ge.Generator(m, speculative=3)
    for k in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            ref_ge.Generator(m, speculative="ngram", num_speculative_tokens=k)
