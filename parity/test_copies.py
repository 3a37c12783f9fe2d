"""One source of truth for what the single-file rule copies (CONTRIBUTING.md, rule 1).

Every file in ref/ and fast/ works alone, so definitions are repeated: the data types of the router and the
engines, decoder_lm.py's config, checkpoint reader and tensor-parallel layout in both files, the weight-sync
plan, the attention kernels' shared helpers.  A copy that drifts is a bug nobody sees (issue 40: the router's
SamplingParams accepted temperature=True, which the engine's refused).  For each pair of files below, every
top-level definition the two share a name for must be the same code (its AST: comments and formatting
aside), unless ``DIFFERENT`` says why that one differs.  And the four places that take a request (the
router's and the engine's, ref and fast) accept and refuse the same sampling parameters.
"""
from __future__ import annotations

import ast
import difflib
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]

PAIRS = [(f"ref/{name}.py", f"fast/{name}.py") for name in (
    "decoder_lm", "generator_engine", "routed_generator", "weight_sync", "view_replay_offload", "gated_deltanet", "moe",
    "paged_varlen_attention", "flash_decoding")] + [
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py"),        # the attention kernels' helpers
    ("ref/flash_decoding.py", "ref/paged_varlen_attention.py"),
    ("fast/generator_engine.py", "fast/routed_generator.py"),            # the data types
    ("ref/generator_engine.py", "ref/routed_generator.py"),
    ("ref/generator_engine.py", "fast/routed_generator.py"),
    ("fast/decoder_lm.py", "fast/generator_engine.py"),
    ("ref/decoder_lm.py", "ref/generator_engine.py"),
]

# (file a, file b, name) -> why the two definitions differ on purpose
DIFFERENT = {
    ("ref/decoder_lm.py", "fast/decoder_lm.py", "DecoderLM"): "the fast model fuses projections, a rope table",
    ("ref/decoder_lm.py", "fast/decoder_lm.py", "_check_mode"): "fast's mode needs varlen_attn",
    ("ref/decoder_lm.py", "fast/decoder_lm.py", "_local_tree"): "fast: the invariant matmul in column blocks",
    ("ref/decoder_lm.py", "fast/decoder_lm.py", "_log_softmax"): "fast: the invariant sum through its matmul",
    ("ref/decoder_lm.py", "fast/decoder_lm.py", "_register_shared_grad_hooks"): "fast: fused tensors' parts",
    ("ref/decoder_lm.py", "fast/decoder_lm.py", "_sigmoid"): "fast: composed from exp in the mode",
    ("ref/decoder_lm.py", "fast/decoder_lm.py", "_silu"): "fast: composed from exp in the mode",
    ("ref/generator_engine.py", "fast/generator_engine.py", "Generator"): "the engines themselves",
    ("ref/generator_engine.py", "fast/generator_engine.py", "MTPDrafter"): "ref: a sample's own K/V tensors; "
                                                                          "fast: every sample, the page pool",
    ("ref/routed_generator.py", "fast/routed_generator.py", "GeneratorProtocol"): "fast adds Ray's members",
    ("ref/routed_generator.py", "fast/routed_generator.py", "GeneratorRouter"): "the routers themselves",
    ("ref/routed_generator.py", "fast/routed_generator.py", "_Attempt"): "fast: deadlines on a heap",
    ("ref/routed_generator.py", "fast/routed_generator.py", "_Member"): "fast: counters for its policies",
    ("ref/routed_generator.py", "fast/routed_generator.py", "_Ticket"): "fast: __slots__, a queue timestamp",
    ("ref/routed_generator.py", "fast/routed_generator.py", "_check_request"):
        "fast: one expression for the common case, then the reference's table (test_sampling_rules_agree)",
    ("ref/weight_sync.py", "fast/weight_sync.py", "checksum"): "fast: one pass in int32 column sums",
    ("ref/weight_sync.py", "fast/weight_sync.py", "pack"): "fast: into a reusable bucket buffer",
    ("ref/view_replay_offload.py", "fast/view_replay_offload.py", "OffloadActivations"): "the techniques",
    ("ref/view_replay_offload.py", "fast/view_replay_offload.py", "_Storage"): "fast: CUDA streams and events",
    ("ref/moe.py", "fast/moe.py", "route"): "the techniques",
    ("ref/moe.py", "fast/moe.py", "moe_experts"): "the techniques",
    ("ref/moe.py", "fast/moe.py", "dequantize_mxfp4"): "fast: a Triton kernel",
    ("ref/moe.py", "fast/moe.py", "_activation"): "fast: the kernels' epilogue (Triton)",
    ("ref/gated_deltanet.py", "fast/gated_deltanet.py", "_l2norm"): "fast: a Triton kernel",
    ("ref/gated_deltanet.py", "fast/gated_deltanet.py", "_softplus"): "fast: Triton's",
    ("ref/gated_deltanet.py", "fast/gated_deltanet.py", "chunk_gated_delta_rule"): "the techniques",
    ("ref/gated_deltanet.py", "fast/gated_deltanet.py", "fused_recurrent_gated_delta_rule"): "the techniques",
    ("ref/paged_varlen_attention.py", "fast/paged_varlen_attention.py", "varlen_attn"): "the techniques",
    ("ref/paged_varlen_attention.py", "fast/paged_varlen_attention.py", "varlen_attn_out"): "the techniques",
    ("ref/flash_decoding.py", "fast/flash_decoding.py", "_check_inputs"): "fast checks strides and devices",
    ("ref/flash_decoding.py", "fast/flash_decoding.py", "_check_values"): "fast: one host copy for all",
    ("ref/flash_decoding.py", "fast/flash_decoding.py", "cascade_decode"): "the techniques",
    ("ref/flash_decoding.py", "fast/flash_decoding.py", "choose_num_splits"): "fast reads the device",
    ("ref/flash_decoding.py", "fast/flash_decoding.py", "flash_decode"): "the techniques",
    ("ref/flash_decoding.py", "fast/flash_decoding.py", "merge_attention_states"): "fast: a Triton kernel",
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py", "_SIZES"): "each op's size limits",
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py", "_check_device"): "names its own file",
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py", "_check_scalars"): "each op's arguments",
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py", "_check_tensors"): "each op's arguments",
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py", "_check_values"): "each op's index tensors",
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py", "_invariant_config"): "each op's tiles",
    ("fast/flash_decoding.py", "fast/paged_varlen_attention.py", "_prepare"): "each op's outputs",
    ("ref/flash_decoding.py", "ref/paged_varlen_attention.py", "_SIZES"): "each op's size limits",
    ("ref/flash_decoding.py", "ref/paged_varlen_attention.py", "_check_scalars"): "each op's arguments",
    ("ref/flash_decoding.py", "ref/paged_varlen_attention.py", "_check_tensors"): "each op's arguments",
    ("ref/flash_decoding.py", "ref/paged_varlen_attention.py", "_check_values"): "each op's index tensors",
    ("ref/flash_decoding.py", "ref/paged_varlen_attention.py", "_merge"): "decode's splits / attention's chunks",
    ("ref/decoder_lm.py", "ref/generator_engine.py", "causal_attention"):
        "decoder_lm's wraps its attention_with_lse; the engine's stands alone (the same math)",
}


def definitions(path: str) -> dict:
    """Top-level functions, classes and single-name assignments of a file: name -> (AST dump, source lines)."""
    text = (ROOT / path).read_text()
    out = {}
    for node in ast.parse(text).body:
        name = node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else (
            node.targets[0].id if isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) else None)
        if name is not None and name not in ("__all__", "_"):
            out[name] = (ast.dump(node), text.splitlines()[node.lineno - 1:node.end_lineno])
    return out


@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a}~{b}" for a, b in PAIRS])
def test_shared_definitions_are_the_same_code(a, b):
    da, db = definitions(a), definitions(b)
    shared = sorted(da.keys() & db.keys())
    drifted = [name for name in shared if da[name][0] != db[name][0] and (a, b, name) not in DIFFERENT]
    report = "\n".join("\n".join(difflib.unified_diff(da[n][1], db[n][1], f"{a}: {n}", f"{b}: {n}", lineterm=""))
                       for n in drifted[:3])
    assert not drifted, f"{a} and {b} define {drifted} differently (make them one code, or say why in DIFFERENT):\n" \
                        f"{report}"
    stale = [n for (x, y, n) in DIFFERENT if (x, y) == (a, b) and (n not in shared or da[n][0] == db[n][0])]
    assert not stale, f"DIFFERENT lists {stale} for {a} / {b}, which are no longer different: remove them"
    print(f"\n{a} / {b}: {len(shared) - sum((a, b, n) in DIFFERENT for n in shared)} shared definitions the same")


def test_a_planted_drift_fails(tmp_path, monkeypatch):
    """The check above can fail: a copy of fast/routed_generator.py with SamplingParams' rules loosened."""
    drifted = (ROOT / "fast/routed_generator.py").read_text().replace(
        '("temperature", lambda v: _is_real(v) and v >= 0,', '("temperature", lambda v: v >= 0,')
    assert drifted != (ROOT / "fast/routed_generator.py").read_text()
    (tmp_path / "fast").mkdir()
    (tmp_path / "fast/routed_generator.py").write_text(drifted)
    (tmp_path / "fast/generator_engine.py").write_text((ROOT / "fast/generator_engine.py").read_text())
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"_SAMPLING_RULES"):
        test_shared_definitions_are_the_same_code("fast/generator_engine.py", "fast/routed_generator.py")


# ----------------------------------------------------------------------------- the sampling rules, by behaviour

def _sampling_cases():
    good = dict(max_new_tokens=4, temperature=0.7, top_k=0, top_p=1.0, stop_token_ids=(), seed=None, n=1)
    bad_values = dict(max_new_tokens=[0, -1, True, 2.0, None], temperature=[True, -0.1, math.nan, "1", None],
                      top_k=[-1, True, 1.5], top_p=[0.0, 1.5, True, math.nan, None],
                      stop_token_ids=[(1, -2), ("a",), 3], seed=[1.5, True, "7", 2 ** 64, -2 ** 63 - 1],
                      n=[0, True, 2.0])
    yield "good", good
    for field, values in bad_values.items():
        for v in values:
            yield f"{field}={v!r}", dict(good, **{field: v})
    for field, v in (("temperature", 0), ("temperature", math.inf), ("top_p", 1), ("seed", 2 ** 64 - 3),
                     ("seed", -2 ** 63), ("stop_token_ids", [2, 3]), ("n", 3),
                     ("stop_token_ids", (True,))):          # (an index, as a token id in a prompt may be)
        yield f"{field}={v!r} (accepted)", dict(good, **{field: v})


@pytest.mark.parametrize("case,fields", list(_sampling_cases()), ids=[c for c, _ in _sampling_cases()])
def test_sampling_rules_agree(case, fields):
    """The router's and the engine's checks (ref and fast) accept and refuse the same sampling parameters,
    with the same exception type, on a request built by hand (not through SamplingParams)."""
    import fast.decoder_lm as fast_lm
    import fast.generator_engine as fast_ge
    import fast.routed_generator as fast_rg
    import ref.generator_engine as ref_ge
    import ref.routed_generator as ref_rg
    request = SimpleNamespace(prompt_token_ids=[1, 2, 3], sampling=SimpleNamespace(**fields), request_id="r",
                              session_id=None)
    config = fast_lm.ModelConfig(vocab_size=16, max_seq_len=2 ** 12)
    checks = {
        "ref router": lambda: ref_rg._check_request(request),
        "fast router": lambda: fast_rg._check_request(request),
        "ref engine": lambda: ref_ge._check_servable(request, config, config.max_seq_len),
        "fast engine": lambda: _fast_scheduler(fast_ge).check_servable(request, config),
        "fast SamplingParams": lambda: fast_ge.SamplingParams(**fields),
        "ref SamplingParams": lambda: ref_ge.SamplingParams(**fields),
    }
    outcomes = {}
    for name, check in checks.items():
        try:
            check()
            outcomes[name] = "accepted"
        except (TypeError, ValueError) as exc:
            outcomes[name] = type(exc).__name__
    if isinstance(fields["stop_token_ids"], list) or fields["stop_token_ids"] == 3:
        # SamplingParams turns a list into a tuple (and 3 fails as not a sequence) where a hand-built object keeps it
        outcomes = {k: v for k, v in outcomes.items() if "SamplingParams" not in k}
    assert len(set(outcomes.values())) == 1, f"{case}: {outcomes}"
    assert ("accepted" in set(outcomes.values())) == ("accepted" in case or case == "good"), f"{case}: {outcomes}"


_SCHEDULERS: dict = {}


def _fast_scheduler(fast_ge):
    """A fast engine's scheduler, built once (its check reads the pool's sizes)."""
    if not _SCHEDULERS:
        import fast.decoder_lm as fast_lm
        model = fast_lm.DecoderLM(fast_lm.ModelConfig(vocab_size=16, max_seq_len=2 ** 12), seed=0)
        gen = fast_ge.Generator(model, kv_cache_memory=2 ** 26, max_seq_len=2 ** 12)
        gen.close()
        _SCHEDULERS["s"] = gen.scheduler
    return _SCHEDULERS["s"]
