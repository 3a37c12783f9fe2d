"""The fast engine's static decode step, compiled (``Generator(compile=True)``): the same tokens and logprobs
as its eager step.

The static step (fast/generator_engine.py, "the static decode step") pads the batch to the next of
``capture_sizes``, cuts the block table to a power-of-two width of at least two pages, reads every input
from buffers allocated once, attends over the cached keys and the step's new key, and writes the pools at its
end in one op; ``torch.compile`` (inductor, its C++ wrapper) traces it once per padded size.  In fp32 on a
CPU its logprobs differ from the eager step's by rounding only (other kernels, other summation orders): the
bound is test_generator_engine's, 32 fp32 epsilons relative, tokens equal up to a genuine greedy near-tie.
Each case compiles one padded size (``capture_sizes=(8,)``) to keep the compile time of ``make parity`` low.
"""
from __future__ import annotations

import functools
import random
import threading
import warnings

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.generator_engine as fast_ge
import ref.decoder_lm as ref_lm
from conftest import DEVICE, requires_gpu
from fleet_sim import wait_until
from test_generator_engine import (LP_RTOL, TIMEOUT, ToyLinear, _switch_run, assert_same, dense_attention,
                                   make_requests, paged, small_config)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# every kind of layer the static step has a path for: full attention, a sliding window with sinks and biases
# (gpt-oss's), a "linear" layer's state rows (the toy plug-in's two, and Gated DeltaNet's recurrent and conv
# states through ref/gated_deltanet.py's layer)
HYBRID = dict(layer_types=("linear", "attention", "linear"), num_layers=3)
MODELS = {
    "dense": dict(qk_norm=True),
    "windows+sinks": dict(layer_types=("attention", "attention", "attention"), num_layers=3, sliding_window=5,
                          sliding_layers=(0, 2), attention_sinks=True, qkv_bias=True, o_proj_bias=True),
    "toy-linear": HYBRID,
    "gated-deltanet": dict(HYBRID, linear_num_k_heads=2, linear_num_v_heads=4, linear_head_k_dim=16,
                           linear_head_v_dim=16),
}


def _linear_layer(kind: str):
    if kind == "toy-linear":
        return ToyLinear
    if kind == "gated-deltanet":
        import ref.gated_deltanet as gdn
        return functools.partial(gdn.GatedDeltaNet, chunk_fn=gdn.chunk_gated_delta_rule,
                                 recurrent_fn=gdn.fused_recurrent_gated_delta_rule)
    return None


def _model(kind: str, seed: int = 3) -> fast_lm.DecoderLM:
    cfg = small_config(fast_ge, **MODELS[kind])
    model = fast_lm.DecoderLM(cfg, seed=seed, linear_layer=_linear_layer(kind))
    with torch.no_grad():                            # every parameter away from its init (zeros / ones hide formulas)
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _workload(seed: int) -> list:
    """Mixed prompts, greedy and sampled, stops; a group of 3 samples; two requests with the prompt of an
    earlier one (prefix hits)."""
    reqs = make_requests(fast_ge, seed, n=9, max_prompt=20, max_new=14)
    group = fast_ge.SamplingParams(max_new_tokens=9, temperature=1.0, seed=5, n=3)
    again = fast_ge.SamplingParams(max_new_tokens=7)
    return reqs + [fast_ge.Request(reqs[3].prompt_token_ids, group, request_id="group"),
                   fast_ge.Request(reqs[0].prompt_token_ids + [5], again, request_id="hit-0"),
                   fast_ge.Request(reqs[2].prompt_token_ids, again, request_id="hit-2")]


def _serve(model, compile: bool, **kw):
    knobs = dict(page_size=3, num_pages=20, max_batch_size=8, max_prefill_tokens=24, capture_sizes=(8,))
    knobs.update(kw)
    with fast_ge.Generator(model, compile=compile, **knobs) as gen:
        out = gen.generate(_workload(21))
        return out, gen.stats()


@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_decode_equals_eager(kind):
    """Continuous batching with chunked prefill (24 tokens an iteration), prefix hits, a group, preemption (20
    pages of 3 for up to 8 sequences of up to 34 tokens): the compiled step's completions equal the eager
    step's, and every decode step ran compiled, at the one padded size."""
    model = _model(kind)
    eager, eager_stats = _serve(model, compile=False)
    got, stats = _serve(model, compile=True)
    assert stats["static_decode_steps"] == stats["decode_steps"] > 10 and eager_stats["static_decode_steps"] == 0
    assert {size for size, _ in stats["static_decode_shapes"]} == {8}
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0, stats
    flat = lambda groups: [c for g in groups for c in (g if isinstance(g, list) else [g])]   # noqa: E731
    for e, g in zip(flat(eager), flat(got), strict=True):
        assert_same(e, g, model=None)


def test_batches_past_the_largest_size_step_eagerly():
    """capture_sizes=(2,): a step of up to 2 samples runs compiled (padded to 2), a larger one eagerly;
    both kinds of step in one run, the completions equal an eager engine's."""
    model = _model("dense", seed=4)
    eager, _ = _serve(model, compile=False)
    got, stats = _serve(model, compile=True, capture_sizes=(2,))
    assert 0 < stats["static_decode_steps"] < stats["decode_steps"], stats
    assert {size for size, _ in stats["static_decode_shapes"]} == {2}
    for e, g in zip(eager, got, strict=True):
        for a, b in zip(e if isinstance(e, list) else [e], g if isinstance(g, list) else [g], strict=True):
            assert_same(a, b)


@torch.no_grad()
def test_hot_swap_lands_between_compiled_steps():
    """A weight load while a request decodes through the compiled step (held at decode step 5's sampling, outside
    the graph, until the shadow copy is staged): the swap brings another module, of the same structure, read
    through the same graph (its parameters are the graph's inputs), and the sequence grows from one page to
    three through it too: one graph in all; decode steps 1..5 ran on model A, the rest on B, exactly as the
    reference's loop switched there gives."""
    cfg = small_config(fast_ge, qk_norm=True)
    prompt, n_tokens, switch_after = [9, 8, 7, 6, 5], 14, 5
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with fast_ge.Generator(fast_lm.DecoderLM(cfg, seed=0), page_size=8, num_pages=8, max_batch_size=2,
                           compile=True, capture_sizes=(1,)) as gen:
        sample, calls = gen.runner.sample, []
        reached, release = threading.Event(), threading.Event()

        def gated(*args, **kwargs):              # call 0 samples the prefill's token, call s decode step s's
            if len(calls) == switch_after:
                reached.set()
                assert release.wait(TIMEOUT)
            calls.append(1)
            return sample(*args, **kwargs)

        gen.runner.sample = gated
        fut = gen.submit(fast_ge.Request(prompt, fast_ge.SamplingParams(max_new_tokens=n_tokens)))
        assert reached.wait(TIMEOUT)
        loader = threading.Thread(target=gen.load_weights, args=(fast_lm.DecoderLM(cfg, seed=1).state_dict(), 1))
        loader.start()
        wait_until(lambda: gen.stats()["weights_staged"], what="the shadow copy")
        release.set()
        got = fut.result(TIMEOUT)
        loader.join(TIMEOUT)
        stats = gen.stats()
    assert (got.min_policy_version, got.max_policy_version) == (0, 1)
    assert stats["static_decode_steps"] == stats["decode_steps"] == n_tokens - 1
    assert stats["static_decode_shapes"] == [(1, 2), (1, 4)]        # 1 page (a table of 2: see _shape), 2, 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
    ref_cfg = ref_lm.ModelConfig(**{f: getattr(cfg, f) for f in ("vocab_size", "hidden_size", "intermediate_size",
                                                                 "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                                 "max_seq_len", "tie_embeddings", "qk_norm")})
    a, b = ref_lm.DecoderLM(ref_cfg, seed=0), ref_lm.DecoderLM(ref_cfg, seed=1)
    tokens, logprobs = _switch_run(a, b, prompt, n_tokens, switch_after)
    assert got.token_ids == tokens
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-5)
    assert tokens != _switch_run(a, a, prompt, n_tokens, 99)[0]                     # the new weights did serve


def _grpo_workload(seed: int) -> list:
    """Two GRPO groups of 3 samples (greedy and sampled) behind a shared system prompt of 8 tokens, and two
    single requests between them."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 96) for _ in range(8)]
    reqs = []
    for i in range(4):
        prompt = system + [rng.randrange(1, 96) for _ in range(rng.randint(2, 9))]
        n = 3 if i % 2 == 0 else 1
        sp = fast_ge.SamplingParams(max_new_tokens=rng.randint(6, 10), temperature=(0.0, 0.9)[i // 2], seed=i, n=n)
        reqs.append(fast_ge.Request(prompt, sp, request_id=f"q{i}"))
    return reqs


def test_compiled_decode_cascades_a_group(monkeypatch):
    """With this repo's flash_decode and cascade_decode plugged in (the Triton interpreter here), a step whose
    batch holds a GRPO group's samples runs the compiled static step too: ``cascade_decode(...,
    capturable=True)`` over the padded groups (a padding row a group of its own), a sliding layer through
    flash_decode (the window may not reach the group's prompt).  The completions equal the eager engine's
    with the same plug-ins; every decode step ran compiled, most of them with a cascade.  A plug-in without
    a ``capturable`` keyword keeps those steps eager (and only those)."""
    from fast.flash_decoding import cascade_decode, flash_decode
    model = _model("windows+sinks", seed=5).to(DEVICE)
    kw = dict(flash_decode=flash_decode, page_size=4, num_pages=40, max_batch_size=8, capture_sizes=(8,))
    with fast_ge.Generator(model, cascade_decode=cascade_decode, **kw) as gen:
        eager = gen.generate(_grpo_workload(7))
    import fast.flash_decoding as fast_fd
    kernel, largest_groups = fast_fd._cascade_fwd_kernel, []

    class Recording:         # each launch's largest group and the smallest prefix of a group of several
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                sizes, prefixes = args[5].diff(), args[6]
                largest_groups.append((int(sizes.max()), int(prefixes[sizes > 1].min()) if sizes.max() > 1 else 0))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(fast_fd, "_cascade_fwd_kernel", Recording())
    with fast_ge.Generator(model, cascade_decode=cascade_decode, compile=True, **kw) as gen:
        got = gen.generate(_grpo_workload(7))
        stats = gen.stats()
    assert stats["static_decode_steps"] == stats["decode_steps"] > 5, stats
    assert 0 < stats["static_cascade_steps"] < stats["static_decode_steps"], stats
    assert max(size for size, _ in largest_groups) == 3, largest_groups        # a group's 3 samples in a launch,
    assert all(prefix >= 8 for size, prefix in largest_groups if size > 1), largest_groups   # 2+ pages shared
    monkeypatch.undo()
    flat = lambda groups: [c for g in groups for c in (g if isinstance(g, list) else [g])]   # noqa: E731
    for e, g in zip(flat(eager), flat(got), strict=True):
        assert_same(e, g, model=None)

    def sized_only(q, k_cache, v_cache, seqused_k, **kw):      # the same kernel, no capturable keyword
        return cascade_decode(q, k_cache, v_cache, seqused_k, **kw)

    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)    # (the static step uncompiled: no compile time)
    with fast_ge.Generator(model, cascade_decode=sized_only, compile=True, **kw) as gen:
        again = gen.generate(_grpo_workload(7))
        plain = gen.stats()
    assert plain["static_cascade_steps"] == 0, plain
    assert plain["static_decode_steps"] == plain["decode_steps"] - stats["static_cascade_steps"], (plain, stats)
    for e, g in zip(flat(eager), flat(again), strict=True):
        assert_same(e, g, model=None)


@pytest.mark.parametrize("window,s_q", [(0, 1), (4, 1), (0, 3)], ids=["full", "window4", "verify3"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_static_attention_is_the_definition(window, s_q, with_sinks):
    """The static step's attention (``_paged_decode_attention``, eager here) against the row-by-row
    definition: GQA 3, D 10, pages of 3, a table wider than the sequences, the step's S new keys (1 in a
    decode step, 3 in a verification: causal among them), padding rows that see only their own keys."""
    gen = torch.Generator().manual_seed(window + 10 * with_sinks + 100 * s_q)
    h_q, h_kv, d, ps, scale = 6, 2, 10, 3, 10 ** -0.5
    sinks = torch.randn(h_q, generator=gen) * 2 if with_sinks else None
    n_keys = [7, s_q, 11]
    keys = [torch.randn(n, h_kv, d, generator=gen) for n in n_keys]
    values = [torch.randn(n, h_kv, d, generator=gen) for n in n_keys]
    k_pool, v_pool, table = paged(keys, values, ps, gen)
    table = torch.cat([table, table[:, :1]], 1)                   # one more column than any sequence needs
    used = torch.tensor(n_keys, dtype=torch.int32)
    q = torch.randn(3, s_q, h_q, d, generator=gen)
    k_new = torch.stack([k[-s_q:] for k in keys])                 # the new keys: the step's, not yet in the pool
    v_new = torch.stack([v[-s_q:] for v in values])
    for b in range(3):
        for p in range(n_keys[b] - s_q, n_keys[b]):
            slot = table[b, p // ps] * ps + p % ps
            k_pool.view(-1, h_kv, d)[slot] = float("nan")        # poisoned: the step must not read them
            v_pool.view(-1, h_kv, d)[slot] = float("nan")
    first = (used - window).clamp(min=0) if window else None
    got = fast_ge._paged_decode_attention(q, k_new, v_new, k_pool, v_pool, table.long(), used, first, scale, sinks)
    assert got.shape == q.shape
    for b in range(3):
        positions = list(range(n_keys[b] - s_q, n_keys[b]))
        want = dense_attention(q[b], keys[b], values[b], positions,
                               [max(p - window + 1, 0) if window else 0 for p in positions], scale, sinks)
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-5)


def test_compile_knobs_are_checked_and_the_mode_stays_eager():
    cfg = small_config(fast_ge)
    model = fast_lm.DecoderLM(cfg, seed=0)
    for sizes in [(), (0, 2), (4, 2), (2, 2), [1, 2], (1.5,)]:
        with pytest.raises(ValueError, match="capture_sizes"):
            fast_ge.Generator(model, num_pages=8, compile=True, capture_sizes=sizes)
    with pytest.raises(TypeError, match="compile must be a bool"):
        fast_ge.Generator(model, num_pages=8, compile=1)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        fast_ge.Generator(model, num_pages=8, cuda_graphs="yes")
    from fast.flash_decoding import flash_decode
    from fast.paged_varlen_attention import varlen_attn
    mode = fast_lm.DecoderLM(cfg, seed=0, batch_invariant=True, varlen_attn=varlen_attn)
    with pytest.warns(UserWarning, match="batch-invariant mode keeps its eager decode step"):
        gen = fast_ge.Generator(mode, num_pages=8, flash_decode=flash_decode, compile=True)
    with gen:
        assert gen.runner.static is None and gen.stats()["static_decode_steps"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with fast_ge.Generator(model, num_pages=8, compile=True) as gen:
            assert gen.runner.static is not None and gen.runner.static.sizes[-1] >= gen.max_batch_size
        with fast_ge.Generator(model, num_pages=8, cuda_graphs=True) as gen:    # on a CPU: no graphs, no static step
            assert gen.runner.static is None and gen.stats()["cuda_graph_sizes"] == []


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "windows+sinks", "gated-deltanet"])
@pytest.mark.parametrize("kernels", ["torch", "repo"])
def test_gpu_cuda_graphs_equal_eager(kind, kernels):
    """On a GPU, fp32: decode steps replayed from CUDA graphs (one per padded size; a capture per weight set)
    give the eager step's completions, with the in-file attention or this repo's flash_decode, on the
    workload above; the graphs' sizes and memory are reported."""
    plug = {}
    if kernels == "repo":
        from fast.flash_decoding import flash_decode
        plug["flash_decode"] = flash_decode
    model = _model(kind).to(DEVICE)
    eager, _ = _serve(model, compile=False, **plug)
    got, stats = _serve(model, compile=False, cuda_graphs=True, capture_sizes=(2, 8), **plug)
    assert stats["cuda_graph_sizes"] and set(stats["cuda_graph_sizes"]) <= {2, 8}, stats
    assert stats["static_decode_steps"] == stats["decode_steps"] and stats["cuda_graph_bytes"] > 0, stats
    for e, g in zip(eager, got, strict=True):
        for a, b in zip(e if isinstance(e, list) else [e], g if isinstance(g, list) else [g], strict=True):
            assert_same(a, b, rtol=4 * LP_RTOL)                 # (fp32 on a GPU: the doubled factor, twice)


@requires_gpu
@pytest.mark.gpu
def test_gpu_cuda_graphs_cascade_a_group():
    """On a GPU, fp32: the GRPO workload's steps with a group's cascade replay a graph of their own (captured
    with ``cascade_decode(..., capturable=True)``), the others the plain one; the completions equal the eager
    engine's with the same plug-ins."""
    from fast.flash_decoding import cascade_decode, flash_decode
    model = _model("windows+sinks", seed=5).to(DEVICE)
    kw = dict(flash_decode=flash_decode, cascade_decode=cascade_decode, page_size=4, num_pages=40, max_batch_size=8,
              capture_sizes=(2, 8))
    with fast_ge.Generator(model, **kw) as gen:
        eager = gen.generate(_grpo_workload(7))
    with fast_ge.Generator(model, cuda_graphs=True, **kw) as gen:
        got = gen.generate(_grpo_workload(7))
        stats, keys = gen.stats(), set(gen.runner.static.graphs)
    assert stats["static_decode_steps"] == stats["decode_steps"] and stats["static_cascade_steps"] > 0, stats
    assert {kind for _, _, kind in keys} == {"decode", "cascade"}, keys
    flat = lambda groups: [c for g in groups for c in (g if isinstance(g, list) else [g])]   # noqa: E731
    for e, g in zip(flat(eager), flat(got), strict=True):
        assert_same(e, g, rtol=4 * LP_RTOL)
