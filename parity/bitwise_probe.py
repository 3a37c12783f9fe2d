"""The batch-invariant mode's bitwise contract, checked in one process under whatever CPU kernels the
environment selects (``OPENBLAS_CORETYPE`` for numpy's OpenBLAS, which runs the Triton interpreter's
``tl.dot``; ``ATEN_CPU_CAPABILITY`` and ``MKL_ENABLE_INSTRUCTIONS`` for torch's own CPU kernels).

parity/test_bitwise_blas.py runs it in subprocesses, one per kernel family, because a result that
holds only for the BLAS of the machine it was developed on is not a result: OpenBLAS's Haswell / Zen
sgemm rounds rows 6-11 of a 16-row tile through another micro-kernel than the others, which broke the
mode on AVX2-only machines until every phase put a row at the same slot of the same tile shape.
Run by hand for a fresh workload (other seeds, sizes, page sizes)::

    OPENBLAS_CORETYPE=Haswell python parity/bitwise_probe.py --requests 24 --seed 7 --page-size 5

Checks (each reports the rows or requests that were bitwise out of those compared):
  matmul      the invariant matmul (torch's per-row CPU product, and the Triton kernel under the
              interpreter) gives a row the same bits in a call of 1, 7 or 45 rows;
  attention   varlen_attn's packed forward (the trainer's), paged prefill chunks cut at random points
              and decode steps through flash_decode / varlen_attn agree bit for bit, fp32 and fp16;
  gdn         the Gated DeltaNet chunk form (reference and Triton kernels) gives a row of a chunk the
              same bits whole, packed, in a partial chunk and before zero tokens, and the layer in
              the mode gives a token the same bits packed, alone, prefilled in pieces and decoded
              (chunk boundaries crossed in every way);
  engine      Generator(model) on a DecoderLM(batch_invariant=True) under preemption == the same
              requests alone == DecoderLM.token_logprobs, on the real architectures' numerics: an
              attention-only model with Qwen2's q/k/v bias, Qwen3's q/k norms and Llama 3's rope
              scaling, and a Qwen3.5-MoE-style hybrid (Gated DeltaNet, the attention output gate, partial
              rotary, zero-centred norms, and MoE MLPs: routed experts on fast/moe.py's kernels beside the
              shared expert; served again with speculative decoding: the same bits).
Prints one JSON line: {"corename", "aten", "checks": {name: {"bitwise", "total", "error"}}}.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import conftest  # noqa: E402, F401  (sets TRITON_INTERPRET=1 on a CPU before triton is imported)
import torch  # noqa: E402


def openblas_corename() -> str:
    """The kernel family numpy's OpenBLAS runs (the one ``tl.dot`` uses under the interpreter)."""
    import numpy
    libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs", "*openblas*.so*"))
    for path in libs:
        lib = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "unknown"


def check_matmul() -> tuple[int, int]:
    import fast.decoder_lm as fast_lm
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(45, 40, generator=gen), torch.randn(24, 40, generator=gen)
    good = total = 0
    for fn in (fast_lm._invariant_linear, fast_lm._triton_invariant_matmul):
        full = fn(x, w)
        for lo, m in ((3, 1), (3, 7), (17, 7), (38, 7)):
            total += m
            good += int((fn(x[lo:lo + m], w) == full[lo:lo + m]).all(1).sum())
    return good, total


def check_attention(seed: int) -> tuple[int, int]:
    import test_batch_invariant_attention as t
    good = total = 0
    for case, dtype in ((t.CASES[1], torch.float32), (t.CASES[0], torch.float16)):   # every route, both dtypes
        name, h_q, h_kv, d, page, softcap, use_sinks, left = case
        s = t.make_sequences(seed=seed + sum(map(ord, name)), n=4, max_len=33, h_q=h_q, h_kv=h_kv, d=d, dtype=dtype)
        attn = t.attention_kwargs(s, softcap, use_sinks, left)
        trainer = t.trainer_forward(s, attn)
        cache = t.paged_cache(s, page)
        routes = ("varlen",) if left >= 0 else ("varlen", "flash_decode", "flash_decode, one split", "contiguous")
        for rows in (t.prefill_chunks(s, attn, cache), t.decode_steps(s, attn, cache, routes=routes)):
            for (b, pos), (out, lse) in rows.items():
                total += 1
                good += int(torch.equal(out, trainer[b][0][pos]) and torch.equal(lse, trainer[b][1][:, pos]))
    return good, total


def check_gdn() -> tuple[int, int]:
    """The Gated DeltaNet invariance tests (each a case: its asserts compare every row bitwise)."""
    import test_batch_invariant_engine as e
    import test_gated_deltanet as g
    cases = [lambda: g.test_chunk_rows_are_batch_and_split_invariant("ref", torch.float32),
             lambda: g.test_chunk_rows_are_batch_and_split_invariant("fast", torch.float32),
             lambda: e.test_gated_deltanet_layer_is_batch_and_split_invariant("ref", [66, 131, 9, 40], [0, 61, 3, 40]),
             lambda: e.test_gated_deltanet_layer_is_batch_and_split_invariant("fast", [66, 6, 35], [60, 0, 29])]
    torch.set_num_threads(1)
    for case in cases:
        case()
    return len(cases), len(cases)


# The architectures' flags on the test models (their random init perturbs every norm weight and bias):
# each is a formula the mode must write in its invariant form.
ARCHITECTURES = {
    "attention": dict(qkv_bias=True, qk_norm=True, rope_type="llama3", rope_factor=4.0,
                      rope_original_max_position=16),
    "hybrid": dict(qk_norm=True, attn_output_gate=True, partial_rotary_factor=0.5, zero_centered_norm=True),
}
ARCHITECTURES["hybrid-moe"] = ARCHITECTURES["hybrid"]         # + Qwen3.5-MoE's experts (the test's config)
ARCHITECTURES["gpt-oss"] = {}       # the test's config: sinks, a sliding window, biases, the clamped experts


def check_engine(kind: str, *, requests: int, seed: int, page_size: int, speculative: bool = False) -> tuple[int, int]:
    """Engine == trainer (and alone == busy) for every request; a run without a preemption fails.
    ``speculative``: the busy run again with drafts of its own continuations, one planted error each
    (parity/test_speculative.py's drafter): the same completions bit for bit, accepted and rejected drafts."""
    import dataclasses

    import fast.decoder_lm as fast_lm
    import fast.generator_engine as fast_ge
    import test_batch_invariant_engine as t
    from fast.flash_decoding import flash_decode
    from fast.paged_varlen_attention import varlen_attn

    def make_model():
        config = dataclasses.replace(t.config(kind), **ARCHITECTURES[kind])
        return fast_lm.DecoderLM(config, seed=3, linear_layer=t.MODELS[kind]["linear_layer"],
                                 moe_layer=t.MODELS[kind].get("moe_layer"), batch_invariant=True,
                                 varlen_attn=varlen_attn)

    reqs = t.requests(seed=seed, n=requests)
    # make parity runs this probe at nice 19 beside its busy test workers, where it gets ~1.5% of a core: a request
    # may wait many minutes (two engine checks once passed the tests' 120 s wait).  A hung engine is caught by the
    # probe's own time limit in make parity (conftest.BACKGROUND_TIMEOUT); run by hand, by this hour.
    t.TIMEOUT = max(t.TIMEOUT, 3600.0)
    torch.set_num_threads(1)
    knobs = dict(page_size=page_size, num_pages=-(-56 // page_size), max_batch_size=8, flash_decode=flash_decode)
    with fast_ge.Generator(make_model(), **knobs) as gen:
        busy = t.serve_busy(gen, reqs, seed=seed + 1)
        if gen.stats()["preemptions"] < 1:
            raise AssertionError(f"no preemption in the busy run: {gen.stats()}")
        alone = {i: gen.generate([reqs[i]])[0] for i in (0, requests - 1)}
    trainer = make_model()
    trainer.load_state_dict(gen.model.state_dict())
    with torch.no_grad():
        recomputed = t.trainer_logprobs(trainer, reqs, busy)
    for i, a in alone.items():
        if a.token_ids != busy[i].token_ids or a.logprobs != busy[i].logprobs:
            raise AssertionError(f"request {i} alone differs from the same request in the busy batch")
    if speculative:
        from test_speculative import PlantedDrafter
        with fast_ge.Generator(make_model(), speculative=PlantedDrafter(busy, reqs), num_speculative_tokens=3,
                               **knobs) as gen:
            drafted = t.serve_busy(gen, reqs, seed=seed + 1)
            stats = gen.stats()
        if not 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]:
            raise AssertionError(f"no accepted and rejected drafts in the speculative run: {stats}")
        for a, b in zip(busy, drafted):
            if (a.token_ids, a.logprobs) != (b.token_ids, b.logprobs):
                raise AssertionError(f"{a.request_id}: speculative decoding changed the completion")
    good = sum(torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), recomputed[c.request_id]) for c in busy)
    return good, len(busy)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12, help="requests per engine run (default 12)")
    parser.add_argument("--seed", type=int, default=11, help="workload seed (default 11)")
    parser.add_argument("--page-size", type=int, default=3, help="KV page size of the engines (default 3)")
    parser.add_argument("--only", choices=["matmul", "attention", "gdn", "engine"], action="append",
                        help="run only these checks (repeatable; default all)")
    args = parser.parse_args(argv)
    checks = {
        "matmul": lambda: check_matmul(),
        "attention": lambda: check_attention(args.seed),
        "gdn": lambda: check_gdn(),
        "engine attention-only": lambda: check_engine(
            "attention", requests=args.requests, seed=args.seed, page_size=args.page_size),
        # the hybrid with MoE MLPs: Gated DeltaNet, gated attention and the expert kernels in one model; with
        # prompt-lookup speculation (verification rows, the linear layers' rollback)
        "engine hybrid-moe": lambda: check_engine(
            "hybrid-moe", requests=args.requests, seed=args.seed, page_size=args.page_size + 1, speculative=True),
        # gpt-oss: sinks in the kernels, rows whose window starts inside the prompt or past it
        "engine gpt-oss": lambda: check_engine(
            "gpt-oss", requests=args.requests, seed=args.seed, page_size=args.page_size),
    }
    report = {"corename": openblas_corename(), "aten": torch.backends.cpu.get_cpu_capability(), "checks": {}}
    for name, run in checks.items():
        if args.only and name.split()[0] not in args.only:
            continue
        wall, cpu = time.monotonic(), time.process_time()
        try:
            good, total = run()
            report["checks"][name] = {"bitwise": good, "total": total, "error": None}
        except Exception as e:  # reported, and the test fails on it
            report["checks"][name] = {"bitwise": 0, "total": 0, "error": "".join(
                traceback.format_exception_only(type(e), e)).strip()[-2000:]}
        # progress on stderr, so that a probe killed midway (its report comes last) shows how far it got
        print(f"probe: {name}: {report['checks'][name]} in {time.monotonic() - wall:.0f} s "
              f"({time.process_time() - cpu:.0f} CPU s)", file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0 if all(c["error"] is None and c["bitwise"] == c["total"] for c in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
