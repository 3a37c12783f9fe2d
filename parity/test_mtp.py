"""Qwen3.5's multi-token-prediction head: decoder_lm.py's ``DecoderLM(mtp=True)`` (ref's ``MTPHead``, fast's
``_MTPHead``), its loss, its checkpoint tensors, and both engines' ``speculative="mtp"`` drafter (issue 43; the fast
engine's keeps the head's K/V in its page pool and drafts for every sample in one call per depth).

The head (vLLM's qwen3_5_mtp.py is the public statement of it): row t combines the main model's final-normed hidden
state at position t with the embedding of token t + 1, x = fc([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]),
runs one full-attention decoder block over its own keys, a final norm and the shared lm_head, and predicts token
t + 2.  transformers does not implement it (its Qwen3.5 drops ``mtp.*``), so the tests write the tensors into tiny
checkpoints themselves and check the head against its definition, the loss against per-document sums, the
engine's incremental drafter against the head run over the whole sequence, and the drafted completions against
plain decoding; training the head with ``mtp_loss`` on the model's own outputs must raise the acceptance rate.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.generator_engine as fast_ge
import ref.decoder_lm as ref_lm
import ref.gated_deltanet as ref_gdn
import ref.generator_engine as ref_ge
import ref.moe as ref_moe
from conftest import DEVICE, requires_gpu

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

GDN = functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=ref_gdn.chunk_gated_delta_rule)
CONFIG = ref_lm.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, max_seq_len=96, layer_types=("linear", "attention"),
                            linear_num_k_heads=2, linear_num_v_heads=4, linear_head_k_dim=8, linear_head_v_dim=8,
                            qk_norm=True, attn_output_gate=True, zero_centered_norm=True, partial_rotary_factor=0.5,
                            mtp_layers=1, tie_embeddings=False)


def model(config=CONFIG, seed=1, lm=ref_lm, **kw):
    if lm is fast_lm:
        config = fast_lm.ModelConfig(**dataclasses.asdict(config))
    return lm.DecoderLM(config, seed=seed, linear_layer=GDN, mtp=True, **kw)


ENGINES = [pytest.param(ref_ge, id="ref"), pytest.param(fast_ge, id="fast")]
LM = {ref_ge: ref_lm, fast_ge: fast_lm}


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe"])
def test_the_head_loads_from_a_qwen35_checkpoint(tmp_path, family):
    """A tiny Qwen3.5 checkpoint (transformers' save_pretrained) given ``mtp_num_hidden_layers: 1`` and random
    ``mtp.*`` tensors (15 for the dense model, as the released ones hold; the MoE model's with its experts and
    shared expert, per expert on disk): from_pretrained(mtp=True) holds exactly those tensors, mtp=False skips
    them, and the main model's logits are the same either way."""
    from safetensors.torch import load_file, save_file

    from hf_models import hf_model
    hf = hf_model(family, seed=2)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (raw["text_config"] if "text_config" in raw else raw)["mtp_num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ref_lm.ModelConfig.from_hf(tmp_path)
    assert config.mtp_layers == 1
    moe = dict(moe_layer=ref_moe.MoE) if config.num_experts else {}
    head = {n: t for n, t in ref_lm.DecoderLM(config, seed=5, linear_layer=GDN, mtp=True, **moe).state_dict().items()
            if n.startswith("mtp.")}
    if not config.num_experts:
        assert len(head) == 15, sorted(head)
    else:                           # as transformers 5 writes Qwen3-MoE experts: one tensor per expert
        for name in [n for n in head if ".mlp.experts." in n]:
            fused = head.pop(name)
            part = name.rsplit(".", 1)[-1]
            for e in range(fused.shape[0]):
                if part == "gate_up_proj":
                    gate, up = fused[e].chunk(2, dim=0)
                    head[name.replace("experts.gate_up_proj", f"experts.{e}.gate_proj.weight")] = gate.clone()
                    head[name.replace("experts.gate_up_proj", f"experts.{e}.up_proj.weight")] = up.clone()
                else:
                    head[name.replace(f"experts.{part}", f"experts.{e}.{part}.weight")] = fused[e].clone()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    save_file(dict(load_file(files[0]), **head), files[0])
    with_head = ref_lm.DecoderLM.from_pretrained(tmp_path, linear_layer=GDN, mtp=True, **moe)
    without = ref_lm.DecoderLM.from_pretrained(tmp_path, linear_layer=GDN, **moe)
    loaded = {n: t for n, t in with_head.state_dict().items() if n.startswith("mtp.")}
    assert not any(n.startswith("mtp.") for n in without.state_dict())
    reference = ref_lm.DecoderLM(config, seed=5, linear_layer=GDN, mtp=True, **moe).state_dict()
    assert loaded.keys() == {n for n in reference if n.startswith("mtp.")}
    for name, t in loaded.items():
        assert torch.equal(t, reference[name]), name
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(with_head(ids), without(ids))
    fast_moe = dict(moe_layer=__import__("fast.moe", fromlist=["MoE"]).MoE) if config.num_experts else {}
    fast_model = fast_lm.DecoderLM.from_pretrained(tmp_path, linear_layer=GDN, mtp=True, **fast_moe)
    for name, t in loaded.items():                            # fast/decoder_lm.py's head: the same tensors
        assert torch.equal(fast_model.state_dict()[name], t), name
    if config.num_experts:   # the engines below run the experts through ref/moe.py (fast/moe.py's kernels take
        fast_moe = dict(moe_layer=ref_moe.MoE)                # 30 s in the interpreter: test_moe.py's to test)
        fast_model = fast_lm.DecoderLM.from_pretrained(tmp_path, linear_layer=GDN, mtp=True, **fast_moe)
    reqs = [fast_ge.Request([5, 17, 3, 44, 2, 9] * 2, fast_ge.SamplingParams(max_new_tokens=10)),
            fast_ge.Request([1, 2, 3], fast_ge.SamplingParams(max_new_tokens=10, temperature=1.0, seed=4, n=2))]
    done = {}
    for spec in (None, "mtp"):                                # the fast engine drafting with the loaded head
        with fast_ge.Generator(fast_model, page_size=4, speculative=spec) as gen:
            done[spec] = [c for d in gen.generate(reqs) for c in (d if isinstance(d, list) else [d])]
            drafts = gen.stats()["draft_tokens"]
    assert drafts > 0 and [c.token_ids for c in done["mtp"]] == [c.token_ids for c in done[None]]
    for ge in (ref_ge, fast_ge):                              # speculative="mtp" loads the head with the model
        model_kw = dict(moe_layer=ref_moe.MoE) if config.num_experts else {}
        with ge.Generator.from_pretrained(tmp_path, model_class=LM[ge].DecoderLM, linear_layer=GDN, page_size=4,
                                          speculative="mtp", **model_kw) as gen:
            assert gen.model.mtp is not None
            got = gen.generate([ge.Request(r.prompt_token_ids, ge.SamplingParams(**vars(r.sampling))) for r in reqs])
            assert [c.token_ids for d in got for c in (d if isinstance(d, list) else [d])] == \
                [c.token_ids for c in done[None]], ge.__name__


def test_the_fast_head_is_the_references():
    """fast/decoder_lm.py's head (fused q/k/v and gate/up, its own _block) from the same seed: the same tensors
    under the same names, mtp_forward at depths 0 .. 2 over two layers, mtp_loss and its gradients within fp32
    rounding of the reference's."""
    config = dataclasses.replace(CONFIG, mtp_layers=2)
    r, f = model(config, seed=4), model(config, seed=4, lm=fast_lm)
    with torch.no_grad():                                     # every parameter away from its init
        gen = torch.Generator().manual_seed(2)
        for (name, p), (name_f, p_f) in zip(r.state_dict().items(), f.state_dict().items(), strict=True):
            assert name == name_f and torch.equal(p, p_f), name
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
            p_f.copy_(p)
    gen = torch.Generator().manual_seed(3)
    ids, hidden = torch.randint(0, 64, (7,), generator=gen), torch.randn(7, 32, generator=gen)
    with torch.no_grad():
        for depth in (0, 1, 2):
            want = r.mtp_forward(ids, torch.arange(3, 10), hidden, r._documents_attention([0, 7]), depth)
            got = f.mtp_forward(ids, torch.arange(3, 10), hidden,
                                f._packed_attention(torch.tensor([0, 7], dtype=torch.int32), 7, 7), depth)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lengths = [9, 1, 2, 13]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    loss_r, loss_f = r.mtp_loss(ids, cu_seqlens=cu), f.mtp_loss(ids, cu_seqlens=cu)
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-5, atol=1e-6)
    (loss_r + r.mtp_loss(ids[:, :12].view(2, 6))).backward()
    (loss_f + f.mtp_loss(ids[:, :12].view(2, 6))).backward()
    grads_r = {name: p.grad for name, p in r.named_parameters()}
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, p in f.named_parameters():
        *stem, fused, leaf = name.split(".")
        want = [grads_r[".".join([*stem, part, leaf])] for part in parts[fused]] if fused in parts else [grads_r[name]]
        if any(g is None for g in want):                           # (depth 0 runs the head's layer 0 only)
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, torch.cat(want), rtol=1e-4, atol=1e-6, msg=name)
    assert f.mtp.fc.weight.grad.abs().sum() > 0


def test_the_head_is_its_definition():
    """mtp_forward against the formula written out: the embedding and the hidden state normed apart and
    concatenated in that order, fc, the block (the trunk's own code: ``_block``), the final norm; depth d runs
    layer d % mtp_layers.  And every parameter of the head moves the output (none is left out)."""
    config = dataclasses.replace(CONFIG, mtp_layers=2)
    m = model(config)
    gen = torch.Generator().manual_seed(3)
    ids, hidden = torch.randint(0, 64, (7,), generator=gen), torch.randn(7, 32, generator=gen)
    positions = torch.arange(3, 10)
    scale = config.head_dim ** -0.5

    def attend(i, q, k, v):
        assert i in (config.num_layers, config.num_layers + 1)
        return ref_ge.causal_attention(q, k, v, scale)

    with torch.no_grad():
        for depth in (0, 1, 2):
            head = m.mtp
            e = head.pre_fc_norm_embedding(m.model.embed_tokens(ids))
            x = torch.cat([e, head.pre_fc_norm_hidden(hidden)], dim=-1) @ head.fc.weight.t()
            x = m._block(config.num_layers + depth % 2, head.layers[depth % 2], x, positions, attend, None)
            want = head.norm(x)
            got = m.mtp_forward(ids, positions, hidden, attend, depth)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        base = m.mtp_forward(ids, positions, hidden, attend)
        for name, p in m.mtp.named_parameters():
            if name.startswith("layers.1."):                     # depth 0 runs layer 0 only
                continue
            saved = p.clone()
            p.add_(0.5)
            assert not torch.equal(m.mtp_forward(ids, positions, hidden, attend), base), name
            p.copy_(saved)


def test_mtp_loss_is_the_mean_over_documents():
    """mtp_loss over packed documents (cu_seqlens) equals the per-document head's cross-entropy summed over
    every position with two tokens after it, divided by their count (a 1- and a 2-token document add none);
    its gradient reaches the head and the trunk."""
    m = model()
    gen = torch.Generator().manual_seed(4)
    lengths = [9, 1, 2, 13, 5]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    loss = m.mtp_loss(ids, cu_seqlens=cu)
    total, count, start = 0.0, 0, 0
    with torch.no_grad():
        for n in lengths:
            doc = ids[:, start:start + n]
            start += n
            if n < 3:
                continue
            h, _ = m._hidden(doc, None)
            y = m.mtp_forward(doc[0, 1:], torch.arange(n - 1), h[:-1], m._documents_attention([0, n - 1]))
            logp = torch.log_softmax(m.logits(y[:-1]), dim=-1)
            total -= logp.gather(1, doc[0, 2:, None]).sum()
            count += n - 2
    torch.testing.assert_close(loss.detach(), total / count, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert m.mtp.fc.weight.grad.abs().sum() > 0 and m.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert m.mtp_loss(torch.tensor([[5, 6]])).item() == 0.0


def one_document(m, n: int):
    """m's attend over one causal document of n rows (decoder_lm.py's own: the reference's or the fast file's)."""
    if isinstance(m, ref_lm.DecoderLM):
        return m._documents_attention([0, n])
    return m._packed_attention(torch.tensor([0, n], dtype=torch.int32), n, n)


def recording_drafter(ge, calls: list):
    """ge's MTPDrafter recording (tokens so far, its draft, the sample's first head row) for every draft."""
    if ge is ref_ge:
        class Recording(ref_ge.MTPDrafter):
            def __call__(self, tokens, k):
                draft = super().__call__(tokens, k)
                calls.append((list(tokens), draft, self.first))
                return draft
    else:
        class Recording(fast_ge.MTPDrafter):
            def propose(self, seqs, rooms):
                drafts = super().propose(seqs, rooms)
                calls.extend((list(s.tokens), d, s.mtp.first) for s, d in zip(seqs, drafts) if d)
                return drafts
    return Recording


def police_static_drafts(gen, writes: list):
    """The head's K/V pools poisoned (1e4: finite, so a masked slot stays harmless, but a row that read a slot
    nobody wrote would attend to it) and every ``StaticDecode.draft`` call's writes checked: a changed slot
    lies in the spare page, or in a page of the samples that hold it at a position past the head rows each
    had computed (never a row already computed, a shared prompt page or another sample's page).  ``writes``
    gets (slots changed, the most rows a sample caught up) of each call the static step took."""
    static, pools, ps = gen.runner.static, gen.pools, gen.page_size
    head = [j for layer, j in pools.pool_index.items() if layer >= gen.config.num_layers]
    for j in head:
        pools.k[j].fill_(1e4), pools.v[j].fill_(1e4)
    draft = static.draft

    def watched(model, seqs, rooms):
        before = pools.k[head].clone()
        computed = {id(s): -1 if s.mtp is None else s.mtp.next for s in seqs}
        rows = [0 if s.mtp is None else min(s.mtp.pending.shape[0], len(s.tokens) - 1 - s.mtp.next)
                for s, room in zip(seqs, rooms) if room]
        out = draft(model, seqs, rooms)
        changed = (pools.k[head] != before).flatten(3).any(-1).any(0).nonzero().tolist()     # [(page, offset)]
        for page, offset in changed:
            holders = [(s, s.pages.index(page)) for s in seqs if page in s.pages]
            assert page == pools.pad_page or holders and all(
                c * ps + offset > computed[id(s)] for s, c in holders), (page, offset, holders)
        if out is not None:                         # (None: it left them to the eager drafter)
            writes.append((len(changed), max(rows)))
        return out
    static.draft = watched


GROUP_PROMPT = [4, 1, 4, 1, 5, 9, 2]
ENGINE_CASES = [pytest.param(ref_ge, {}, id="ref"),
                pytest.param(fast_ge, dict(num_pages=18, max_prefill_tokens=8), id="fast"),   # chunks, preemption
                pytest.param(fast_ge, dict(compile=True, capture_sizes=(4,)), id="fast-compiled")]


@pytest.mark.parametrize("ge,knobs", ENGINE_CASES)
def test_the_engines_drafts_are_the_head_over_the_sequence(ge, knobs, monkeypatch):
    """The engines' MTPDrafter keeps the head's keys across steps (rows with the main model's hidden states as
    they are computed; draft rows scratch; the fast engine's in its page pool, every sample's rows in one call):
    at every step its first draft is the argmax of the head run at once over the whole sequence so far (the
    trainer's computation), and the completions with speculative='mtp' are plain decoding's (greedy and
    sampled; prefix-cache hits: the head's rows start there; the fast engine also with a group, whose samples
    share the head's prompt rows, chunked prefill, preemption, and decode steps through the compiled static
    step).  Each deeper draft is the head run again with its own output as the hidden state of one more row."""
    calls = []
    if ge is ref_ge:
        drafter = recording_drafter(ge, calls)
    else:
        monkeypatch.setattr(fast_ge, "MTPDrafter", recording_drafter(ge, calls))
        drafter = "mtp"
    sp = ge.SamplingParams
    shared = [(5 * i + 1) % 64 for i in range(12)]
    reqs = [ge.Request(shared + [3], sp(max_new_tokens=14)), ge.Request(shared + [9], sp(max_new_tokens=14)),
            ge.Request([7, 2], sp(max_new_tokens=12, temperature=1.0, seed=8))]
    if ge is fast_ge:
        reqs.append(ge.Request(GROUP_PROMPT, sp(max_new_tokens=12, temperature=1.0, seed=3, n=3)))
    lm, m = LM[ge], model(lm=LM[ge])
    with ge.Generator(model(lm=lm), page_size=4, **knobs) as gen:
        plain = [c for d in gen.generate(reqs) for c in (d if isinstance(d, list) else [d])]
    if knobs.get("compile"):     # a head trained on these: drafts accepted, rows to catch up 1 .. k + 1
        shortest = min(len(c.prompt_token_ids) + len(c.token_ids) for c in plain)
        train_head(m, [(c.prompt_token_ids + c.token_ids)[:shortest] for c in plain], steps=60, lr=2e-2)
    writes = []
    with ge.Generator(m, page_size=4, speculative=drafter, num_speculative_tokens=3, **knobs) as gen:
        if knobs.get("compile"):
            police_static_drafts(gen, writes)
        got = [c for d in gen.generate(reqs) for c in (d if isinstance(d, list) else [d])]
        stats = gen.stats()
    for a, b in zip(plain, got, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)
    assert stats["draft_tokens"] > 0 and stats["prefix_hit_tokens"] > 0
    if "num_pages" in knobs:
        assert stats["preemptions"] > 0, stats
    if knobs.get("compile"):        # decode steps, verifications alone and the head's drafts through the static step
        assert stats["static_decode_steps"] > 0 and stats["static_verify_steps"] > 0, stats
        assert stats["static_draft_steps"] > 0 and stats["accepted_draft_tokens"] > 0, stats
        assert len(writes) == stats["static_draft_steps"] and min(writes)[0] > 0, writes
        assert max(rows for _, rows in writes) > 1, writes                 # a static draft after an acceptance
    assert any(first > 0 for _, _, first in calls)          # after a prefix hit
    if ge is fast_ge:       # the group's samples share the prompt's head rows: each starts at 0 (or a cache hit)
        group = [first for tokens, _, first in calls if tokens[:7] == GROUP_PROMPT]
        assert len(group) >= 3 and 0 in group and all(first % 4 == 0 for first in group), group
    with torch.no_grad():
        for tokens, draft, first in calls:
            hidden = m._hidden(torch.tensor([tokens[:-1]]), None)[0][first:]     # positions first .. N - 2
            ids = tokens[first + 1:]
            for depth, proposed in enumerate(draft):                   # depth d: the head fed its own output
                rows = torch.arange(first, first + len(ids))
                y = m.mtp_forward(torch.tensor(ids), rows, hidden, one_document(m, len(ids)), depth)
                assert int(torch.argmax(m.logits(y[-1]))) == proposed, (tokens, draft, depth)
                hidden, ids = torch.cat([hidden, y[-1:]]), ids + [proposed]


def drafts_static_and_eager(static: dict, device="cpu", uncompiled: bool = False):
    """A head trained to be accepted, this repo's flash_decode: (plain decoding's completions, then for the
    eager engine and for one with ``static`` knobs: completions, every draft recorded, stats, the static
    step's graph keys)."""
    from fast.flash_decoding import flash_decode
    sp = fast_ge.SamplingParams
    shared = [(5 * i + 1) % 64 for i in range(12)]              # (the second request hits the prefix cache)
    reqs = [fast_ge.Request(shared + [3], sp(max_new_tokens=14)), fast_ge.Request(shared + [9], sp(max_new_tokens=14)),
            fast_ge.Request([7, 2], sp(max_new_tokens=12, temperature=1.0, seed=8)),
            fast_ge.Request(GROUP_PROMPT, sp(max_new_tokens=12, temperature=1.0, seed=3, n=3))]
    flat = lambda done: [c for d in done for c in (d if isinstance(d, list) else [d])]      # noqa: E731
    m = model(lm=fast_lm).to(device)
    with fast_ge.Generator(m, page_size=4, flash_decode=flash_decode) as gen:
        plain = flat(gen.generate(reqs))
    shortest = min(len(c.prompt_token_ids) + len(c.token_ids) for c in plain)
    train_head(m, [(c.prompt_token_ids + c.token_ids)[:shortest] for c in plain], steps=60, lr=2e-2)
    runs = []
    for knobs in ({}, static):
        calls = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast_ge, "MTPDrafter", recording_drafter(fast_ge, calls))
            if uncompiled:          # (the static step's code without inductor's compile time)
                patch.setattr(torch, "compile", lambda fn, **options: fn)
            with fast_ge.Generator(m, page_size=4, flash_decode=flash_decode, speculative="mtp",
                                   num_speculative_tokens=3, **knobs) as gen:
                done = flat(gen.generate(reqs))
                runs.append((done, calls, gen.stats(), set() if gen.runner.static is None else
                             set(gen.runner.static.graphs)))
    return plain, runs


def check_static_drafts(plain, runs):
    """The static step's drafts are the eager drafter's, call for call; both engines' completions are plain
    decoding's."""
    (eager, eager_calls, _, _), (got, calls, stats, _) = runs
    assert stats["static_draft_steps"] > 0 and stats["accepted_draft_tokens"] > 0, stats
    assert calls == eager_calls and any(first > 0 for _, _, first in calls)      # (after the prefix hit)
    for e, g in zip(plain + plain, eager + got, strict=True):
        assert e.token_ids == g.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), rtol=0, atol=2e-5)


def test_static_drafts_through_flash_decode_are_the_eager_drafters():
    """The static draft's attention through this repo's flash_decode (the GPU's path; here the interpreter, the
    static step uncompiled): k + 1 rows a sample with k_new and cache_leftpad at depth 0, one at each depth
    after; every draft equals the eager drafter's (a call per depth)."""
    check_static_drafts(*drafts_static_and_eager(dict(compile=True, capture_sizes=(2, 8)), uncompiled=True))


@requires_gpu
@pytest.mark.gpu
def test_gpu_mtp_drafts_replay_cuda_graphs():
    """On a GPU, fp32: the head's drafts replay their own CUDA graph (every depth in one, one read-back), as
    decode steps and verifications replay theirs; each draft is the eager engine's, and the completions are
    plain decoding's."""
    plain, runs = drafts_static_and_eager(dict(cuda_graphs=True, capture_sizes=(2, 8)), device=DEVICE)
    keys = runs[1][3]
    assert "draft" in {kind for _, _, kind in keys}, keys
    check_static_drafts(plain, runs)


def train_head(m, sequences: list, steps: int, lr: float) -> torch.Tensor:
    """Adam steps of m.mtp_loss on equal-length ``sequences``, the trunk frozen; returns the last loss."""
    for p in m.parameters():
        p.requires_grad_(False)
    for p in m.mtp.parameters():
        p.requires_grad_(True)
    opt = torch.optim.Adam(m.mtp.parameters(), lr=lr)
    batch = torch.tensor(sequences, device=next(m.parameters()).device)
    for _ in range(steps):
        loss = m.mtp_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


@pytest.mark.parametrize("ge", ENGINES)
def test_training_the_head_raises_acceptance(ge):
    """The trainer keeps the drafter current: a few dozen Adam steps of mtp_loss on the model's own greedy
    completions (the trunk frozen) take the head from chance to accepting many of its drafts, and the tokens
    stay plain decoding's."""
    m = model(lm=LM[ge])
    gen = torch.Generator().manual_seed(6)
    reqs = [ge.Request(torch.randint(0, 64, (5,), generator=gen).tolist(), ge.SamplingParams(max_new_tokens=20))
            for _ in range(8)]

    def serve(spec):
        with ge.Generator(m, speculative=spec, num_speculative_tokens=2, prefix_caching=False) as engine:
            done = engine.generate(reqs)
            stats = engine.stats()
        return done, stats["accepted_draft_tokens"] / max(1, stats["draft_tokens"])

    plain, _ = serve(None)
    _, before = serve("mtp")
    loss = train_head(m, [c.prompt_token_ids + c.token_ids for c in plain], steps=40, lr=1e-2)
    after_done, after = serve("mtp")
    print(f"\n[mtp, {ge.__name__}] acceptance {before:.2f} -> {after:.2f} after 40 steps (loss {loss.item():.2f})")
    assert before < 0.15 < 0.4 < after
    assert [c.token_ids for c in after_done] == [c.token_ids for c in plain]


def test_bad_mtp_arguments_raise():
    with pytest.raises(ValueError, match="mtp_layers >= 1"):
        ref_lm.DecoderLM(dataclasses.replace(CONFIG, mtp_layers=0), linear_layer=GDN, mtp=True)
    with pytest.raises(TypeError, match="mtp must be a bool"):
        ref_lm.DecoderLM(CONFIG, linear_layer=GDN, mtp=1)
    with pytest.raises(ValueError, match="no MTP head"):
        ref_lm.DecoderLM(CONFIG, linear_layer=GDN).mtp_forward(torch.tensor([1]), torch.tensor([0]),
                                                               torch.zeros(1, 32), None)
    with pytest.raises(ValueError, match="needs a model with Qwen3.5's MTP head"):
        ref_ge.Generator(ref_lm.DecoderLM(CONFIG, linear_layer=GDN), speculative="mtp")
    with pytest.raises(ValueError, match="needs a model with Qwen3.5's MTP head"):
        fast_ge.Generator(fast_lm.DecoderLM(fast_lm.ModelConfig()), speculative="mtp")
    with pytest.raises(ValueError, match="mtp_layers >= 1"):
        fast_lm.DecoderLM(fast_lm.ModelConfig(), mtp=True)
    with pytest.raises(TypeError, match="mtp must be a bool"):
        fast_lm.DecoderLM(fast_lm.ModelConfig(mtp_layers=1), mtp=1)
    for lm in (ref_lm, fast_lm):
        with pytest.raises(ValueError, match="no MTP head"):
            lm.DecoderLM(lm.ModelConfig()).mtp_loss(torch.tensor([[1, 2, 3]]))
        with pytest.raises(ValueError, match="not built for tensor parallelism"):
            lm.DecoderLM(lm.ModelConfig(mtp_layers=1), mtp=True, tp_group=object())


@pytest.mark.parametrize("ge", ENGINES)
def test_weight_sync_carries_the_head(ge):
    """load_weights with a trainer's state dict (the head's mtp.* tensors in it) updates the engine's head, so
    its drafts follow the policy; an engine whose model has no head skips those names."""
    lm = LM[ge]
    trainer = model(seed=9, lm=lm)
    with ge.Generator(model(lm=lm), speculative="mtp") as gen:
        gen.load_weights(trainer.state_dict(), 1)
        gen.generate([ge.Request([1, 2, 3], ge.SamplingParams(max_new_tokens=2))])     # (the swap is done)
        for name, t in trainer.state_dict().items():
            assert torch.equal(gen.model.state_dict()[name], t), name
    config = CONFIG if lm is ref_lm else fast_lm.ModelConfig(**dataclasses.asdict(CONFIG))
    with ge.Generator(lm.DecoderLM(config, seed=1, linear_layer=GDN)) as gen:
        gen.load_weights(trainer.state_dict(), 1)
        gen.generate([ge.Request([1, 2, 3], ge.SamplingParams(max_new_tokens=2))])
        assert not any(n.startswith("mtp.") for n in gen.model.state_dict())


def test_mtp_rollouts_stay_bitwise_in_the_mode():
    """The fast engine in the batch-invariant mode (the repo's attention kernels, interpreter) drafting with a
    head trained a few steps (so drafts are accepted and rejected): every completion's tokens and logprobs are
    plain decoding's bit for bit and the trainer's token_logprobs (the head's own rows, attended through
    flash_decode with cache_leftpad, decide only what is proposed)."""
    from conftest import DEVICE
    from fast.flash_decoding import flash_decode
    from fast.paged_varlen_attention import varlen_attn
    mode = functools.partial(model, lm=fast_lm, batch_invariant=True, varlen_attn=varlen_attn, device=DEVICE)
    sp = fast_ge.SamplingParams
    reqs = [fast_ge.Request([3, 9, 27, 17, 51], sp(max_new_tokens=9), request_id="greedy"),
            fast_ge.Request([3, 9, 27, 17, 8], sp(max_new_tokens=9, temperature=0.8, seed=2, n=2), request_id="group")]
    kw = dict(page_size=4, num_pages=24, flash_decode=flash_decode)
    flat = lambda done: [c for d in done for c in (d if isinstance(d, list) else [d])]      # noqa: E731
    with fast_ge.Generator(mode(), **kw) as gen:
        plain = flat(gen.generate(reqs))
    head = model(lm=fast_lm)             # the same weights outside the mode: its head trained (the mode's speed)
    train_head(head, [c.prompt_token_ids + c.token_ids for c in plain], steps=30, lr=2e-2)
    trainer, drafting = mode(), mode()
    for m in (trainer, drafting):
        m.load_state_dict(head.state_dict())
    with fast_ge.Generator(drafting, speculative="mtp", num_speculative_tokens=3, **kw) as gen:
        got = flat(gen.generate(reqs))
        stats = gen.stats()
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"], stats
    with torch.no_grad():
        lps = trainer.token_logprobs([c.prompt_token_ids + c.token_ids for c in got],
                                     [len(c.prompt_token_ids) for c in got],
                                     temperature=[r.sampling.temperature for r in reqs for _ in range(r.sampling.n)])
    for e, g, lp in zip(plain, got, lps, strict=True):
        assert (g.token_ids, g.logprobs) == (e.token_ids, e.logprobs)
        assert torch.equal(torch.tensor(g.logprobs, dtype=torch.float32), lp.cpu())
