"""decoder_lm benchmark: real checkpoint sizes on the engine, what tensor parallelism sends, the trainer compiled.

Cases (CPU-meaningful: this measures loading, memory, the engine's batching and the wire, not a kernel)
    checkpoint <shape>        a Hugging Face checkpoint of Qwen3-0.6B's and Qwen3.5-0.8B's shapes (random
                              weights, written here in bf16 as released, loaded in fp32 for the CPU):
                              ``load_s`` (DecoderLM.from_pretrained, a fresh process), ``weights_bytes``,
                              ``rss_anon_bytes`` (the process's anonymous memory after the load: weights
                              plus what the loader kept; the checkpoint itself is memory-mapped and not
                              counted) and ``peak_rss_bytes`` (the high-water mark, mapped pages included),
                              decode ``tokens/s`` of the fast engine at 1 and 16 requests (prompt 32, 16 new
                              tokens, greedy, in-file attention), its ``kv_pool_bytes`` and
                              ``checkpoint_bytes`` (the hybrid's linear-state slots); and what the memory
                              budget gives a Generator with default arguments at the released context
                              (``default_*``: the budget, the KV pool and its tokens, the state slots and
                              checkpoints, max_seq_len, max_batch_size).
    tp <model> tp=N <mode>    fast/generator_engine.py's Generator(model, tensor_parallel_size=N) decoding B
                              requests, inside a private network namespace (so the loopback counters see
                              only this run): ``step_ms`` (mean iteration), ``wire_bytes_per_token``
                              (loopback bytes sent per token through the model, all ranks, TCP/IP headers
                              and ACKs included: counted), ``predicted_bytes_per_token`` (2 row-parallel sums
                              of hidden elements per layer and token: a ring all-reduce sends 2 (N-1)
                              payloads over all ranks, the batch-invariant all-gather N (N-1); plus rank
                              0's token broadcast each iteration) and ``payload_bytes_per_layer`` (what
                              one rank contributes per layer and decode step: two sums of B x hidden).
                              Mode ``default`` or ``invariant`` (the reduction tree: on a CPU its kernels
                              run under the Triton interpreter, so its step time is the interpreter's).
    pool <n> requests, <p> pages   what a pool too small for the load costs (bench_pool): ``preemptions``,
                              ``recomputed_tokens`` (prompt tokens computed beyond those asked) and
                              ``wall_s``, on pools that hold all, 8 or 3 of the sequences.
    compiled trainer <model> threads=<n>   the trainer's step (DecoderLM.forward(ids, cu_seqlens=...) on 512
                              tokens packed in 4 documents, cross-entropy, backward; fp32, SDPA) eagerly and
                              under torch.compile(model, fullgraph=True) (inductor), in a fresh process per
                              thread count (1 and every core): ``fwd_bwd_ms`` (the median of alternating
                              eager / compiled steps after 3 warm-up steps each), ``compile_s`` (the first
                              compiled step, inductor's cache empty) and ``speedup`` (eager ms / compiled ms;
                              the target: >= 1).
    engine decode step L28 h128 fp32 B=<b> threads=1   fast/generator_engine.py's decode iteration (schedule,
                              the forward, sampling: ``Generator._step`` with no prefill in it) on a
                              Qwen3-0.6B-deep model of negligible arithmetic (``ENGINE_MODEL``), eager and
                              ``compile=True``, each in a fresh process with an empty inductor cache, B
                              requests of 16 + 40 tokens: ``step_ms`` (median), ``torch_calls`` (median per
                              step: Python's calls into torch's C functions on the engine thread),
                              ``warm_s`` (the first run, its compiles included) and ``speedup`` (eager ms /
                              compiled ms; the target: >= 3 at B = 1 and 16).  ``engine verification
                              step ... k=4`` (part engine-verify): the same for an iteration whose work is
                              speculative verification alone (4 drafts a sample, ``_repeat_last``): the
                              eager prefill pass against the compiled static step; ``engine MTP drafts
                              ... k=4`` (part engine-draft): a call of the MTP head's drafter (the model
                              with one head layer, 4 drafts a sample), a call per depth against the
                              compiled static step's one (the call counter's hook on only around the
                              measured drafts: the compiles run untraced, so ``warm_s`` is not the other
                              tables').  On a GPU instead:
    engine GPU decode Qwen3-0.6B-shaped bf16 B=<b>   the fast engine with this repo's kernels, eager and
                              ``cuda_graphs=True``, B = 1, 16, 64 requests of 128 + 128 tokens:
                              decode ``tokens_per_s`` and ``step_ms``, the memory floor's ``step_ms`` (the
                              weights and 192 keys of K and V a request over the measured copy bandwidth),
                              the graphs' ``over_floor``, ``graph_bytes`` and ``speedup``.
    speculative ...           speculative decoding (bench_speculative): n-gram drafting (k = 4) on 8 prompts
                              that repeat a phrase (the fast engine throughout, POOL_MODEL); Qwen3.5's MTP
                              head (k = 3, a tiny hybrid) on held-out prompts, untrained and after
                              ``mtp_loss`` training on the model's own completions of other prompts; decode
                              ``tokens_per_s`` at a Qwen3.5-0.8B-shaped model (random weights, fp32, B = 1
                              and 8), plain, with drafts of plain decoding's own tokens (all accepted, or
                              one planted error each) and with an untrained MTP head (a random model
                              repeats nothing: n-gram drafting would propose nothing there).  Per drafter:
                              ``acceptance`` (accepted / proposed drafts), ``forwards_per_token`` (target forwards per
                              generated token: 1 - accepted / generated) and ``verifications_accepting_j``.
                              On a GPU instead (``speculative GPU Qwen3-0.6B-shaped bf16 B=<b> k=4``): the
                              fast engine with this repo's kernels, B = 1 and 16 requests of 128 + 128
                              tokens: ``tokens_per_s`` of plain decoding (``cuda_graphs=True``) and of
                              drafts of its own tokens (all accepted; one error each), ``speedup``.
    observatory Qwen3-0.6B decode layer ...  one Qwen3-0.6B decoder layer's decode step (fp16, B = 1 and 16,
                              context 1024) run in the kernel observatory (parity/observatory.py: Triton
                              kernels interpreted, torch ops recorded as launches of their own), without
                              and with fast/decoder_lm.py's fused elementwise kernels: ``launches``
                              (``kernels`` + ``torch_ops``), ``issued_bytes``, the H100 latency model's
                              ``modeled_us``, ``speedup`` and the output's ``max_abs_diff``.
    modeled GPU speculative step ...  not a measurement (bench_modeled_speculative): the speculative step on an
                              H100 priced as ``modeled GPU decode step`` (plus the compute bound), Qwen3-0.6B /
                              8B shapes, B = 1, 16, 64, k = 2, 4, assumed acceptance 0.6 and 0.8: ``step_us``,
                              ``tokens_per_step`` and ``speedup`` over the plain graph step, n-gram and MTP
                              drafting, verification captured (built: ``cuda_graphs=True``) and in
                              the eager pass; the MTP head captured (built: ``StaticDecode.draft``) or eager.

    python bench/decoder_lm.py                 # every part; rows to bench/results/latest/ (untracked)
    python bench/decoder_lm.py --record        # ... and appended to bench/results/decoder_lm.csv
    python bench/decoder_lm.py --part tp       # checkpoint | tp | pool | compiled | engine-compiled | engine-verify |
                                               # engine-draft | modeled-step | speculative |
                                               # modeled-speculative | fused-layer
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "parity"))
sys.path.insert(0, str(ROOT / "bench"))

from harness import child_facts, run_bench  # noqa: E402
from hf_models import REAL_SIZES as SHAPES, write_real_size_checkpoint as write_checkpoint  # noqa: E402

TP_MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2,
                head_dim=64, max_seq_len=256, tie_embeddings=False)


# ----------------------------------------------------------------------------- checkpoints at real sizes

def _memory() -> tuple[int, int]:
    """(RssAnon, VmHWM) of this process in bytes, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["VmHWM"]


def checkpoint_child(path: str) -> dict:
    """In a fresh process: load, measure memory, decode at 1 and 16 requests."""
    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    import ref.gated_deltanet as gdn
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    anon_before, _ = _memory()
    start = time.perf_counter()
    model = lm.DecoderLM.from_pretrained(path, linear_layer=gdn.GatedDeltaNet, dtype=torch.float32)
    load_s = time.perf_counter() - start
    anon_after, peak = _memory()
    out = dict(load_s=load_s, weights_bytes=sum(p.numel() * p.element_size() for p in
                                                {id(p): p for p in model.parameters()}.values()),
               rss_anon_bytes=anon_after - anon_before, peak_rss_bytes=peak)
    with ge.Generator(model) as g:                     # default arguments: the memory budget decides
        stats = g.stats()
        out.update({f"default_{k}": stats[k] for k in ("memory_budget_bytes", "kv_pool_bytes", "kv_tokens",
                                                       "state_slot_bytes", "checkpoint_capacity_bytes",
                                                       "max_seq_len")}, default_max_batch_size=g.max_batch_size)
    with ge.Generator(model, page_size=16, max_batch_size=16, max_seq_len=64) as g:
        gen = torch.Generator().manual_seed(0)
        for batch in (1, 16):
            reqs = [ge.Request(torch.randint(0, model.config.vocab_size, (32,), generator=gen).tolist(),
                               ge.SamplingParams(max_new_tokens=16)) for _ in range(batch)]
            g.generate(reqs[:1])                                      # warm
            start = time.perf_counter()
            done = g.generate(reqs)
            out[f"tokens_per_s_b{batch}"] = sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)
        stats = g.stats()
        out.update(kv_pool_bytes=stats["kv_pool_bytes"], checkpoint_bytes=stats["checkpoint_bytes"])
    return out


def bench_checkpoints(rec, quick: bool) -> None:
    for shape in (["qwen3-0.6b"] if quick else list(SHAPES)):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / shape
            write_checkpoint(shape, path)
            proc = subprocess.run([sys.executable, __file__, "--checkpoint-child", str(path)], capture_output=True,
                                  text=True, timeout=3600)
        facts = child_facts(proc, f"checkpoint {shape}")
        case = f"checkpoint {shape}"
        rec.add(case, "fast", "load_s", facts["load_s"], "s")
        for metric in ("weights_bytes", "rss_anon_bytes", "peak_rss_bytes", "kv_pool_bytes", "checkpoint_bytes",
                       "default_memory_budget_bytes", "default_kv_pool_bytes", "default_state_slot_bytes",
                       "default_checkpoint_capacity_bytes"):
            rec.add(case, "fast", metric, facts[metric], "B")
        for metric in ("default_kv_tokens", "default_max_seq_len", "default_max_batch_size"):
            rec.add(case, "fast", metric, facts[metric], "tokens" if "batch" not in metric else "sequences")
        for batch in (1, 16):
            rec.add(case, "fast", f"tokens/s b={batch}", facts[f"tokens_per_s_b{batch}"], "tok/s")


# ----------------------------------------------------------------------------- tensor parallelism on the wire

def _loopback_tx() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])                 # transmit bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


def tp_child(tp: int, mode: str, batch: int) -> dict:
    """Inside a private network namespace: decode steps of a tensor-parallel generator, timed and counted."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import fast.decoder_lm as lm
    import fast.flash_decoding as fd
    import fast.generator_engine as ge
    import fast.paged_varlen_attention as pva
    torch.set_num_threads(1)
    invariant = mode == "invariant"
    cfg = lm.ModelConfig(**TP_MODEL)
    model = lm.DecoderLM(cfg, seed=0, batch_invariant=invariant, varlen_attn=pva.varlen_attn if invariant else None)
    steps, new = [], 12
    kw = dict(flash_decode=fd.flash_decode) if invariant else {}
    with ge.Generator(model, tensor_parallel_size=tp, page_size=16, **kw) as g:
        reqs = [ge.Request(list(range(1 + i, 17 + i)), ge.SamplingParams(max_new_tokens=new)) for i in range(batch)]
        g.generate(reqs)                                            # warm: every rank has run every shape
        before_tx, before_steps = _loopback_tx(), g.stats()["steps"]
        start = time.perf_counter()
        futures = [g.submit(r) for r in reqs]
        while not all(f.done() for f in futures):
            time.sleep(0.001)
        elapsed = time.perf_counter() - start
        after_tx, after_steps = _loopback_tx(), g.stats()["steps"]
        steps = after_steps - before_steps
    elt = 4
    prompt_len = 16
    tokens = batch * prompt_len + batch * (new - 1)                    # through the model: prefill, then decode
    sums = 2 * cfg.num_layers                                           # two row-parallel sums per layer
    wire_factor = tp * (tp - 1) if invariant else 2 * (tp - 1)          # bytes sent over all ranks, per payload
    predicted = sums * tokens * cfg.hidden_size * elt * wire_factor + steps * (tp - 1) * batch * 8  # + tokens bcast
    return dict(step_ms=elapsed / steps * 1e3, wire_bytes_per_token=(after_tx - before_tx) / tokens,
                predicted_bytes_per_token=predicted / tokens if tp > 1 else 0,
                payload_bytes_per_layer=2 * batch * cfg.hidden_size * elt, steps=steps)


def bench_tp(rec, quick: bool) -> None:
    from netns import run_isolated, unavailable
    if unavailable():
        rec.missing("tp", "fast", unavailable())
        return
    runs = [(1, "default"), (2, "default"), (2, "invariant")] + ([] if quick else [(4, "default"), (4, "invariant")])
    for tp, mode in runs:
        batch = 4
        proc = run_isolated([sys.executable, __file__, "--tp-child", str(tp), mode, str(batch)], timeout=1800,
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        facts = child_facts(proc, f"tp={tp} {mode}")
        case = f"tp 4-layer-512 tp={tp} {mode} b={batch}"
        rec.add(case, "fast", "step_ms", facts["step_ms"], "ms")
        for metric in ("wire_bytes_per_token", "predicted_bytes_per_token", "payload_bytes_per_layer"):
            rec.add(case, "fast", metric, facts[metric], "B")


# ----------------------------------------------------------------------------- a pool too small for the load

POOL_MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_seq_len=256)


def bench_pool(rec, quick: bool) -> None:
    """What a pool too small for the load costs: 32 requests (prompt 64, 64 new tokens, distinct prompts, greedy)
    on pools of 256 pages (all at once), 64 (8 sequences' worth) and 24 (3): preemptions, tokens recomputed
    (prompt tokens run through the model beyond the 32 x 64 asked) and the wall time."""
    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = lm.DecoderLM(lm.ModelConfig(**POOL_MODEL), seed=0)
    gen = torch.Generator().manual_seed(1)
    reqs = [ge.Request(torch.randint(0, 512, (64,), generator=gen).tolist(), ge.SamplingParams(max_new_tokens=64))
            for _ in range(8 if quick else 32)]
    for pages in (256, 64, 24):
        with ge.Generator(model, page_size=16, num_pages=pages, max_seq_len=256) as g:
            start = time.perf_counter()
            g.generate(reqs)
            wall = time.perf_counter() - start
            st = g.stats()
        case = f"pool {len(reqs)} requests, {pages} pages of 16"
        rec.add(case, "fast", "preemptions", st["preemptions"], "")
        rec.add(case, "fast", "recomputed_tokens", st["computed_prompt_tokens"] - st["prompt_tokens"], "tokens")
        rec.add(case, "fast", "wall_s", wall, "s")


# ----------------------------------------------------------------------------- the trainer compiled

COMPILED_MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_seq_len=512)
COMPILED_DOCS = (160, 96, 192, 64)                      # T = 512 packed in 4 documents


def compiled_child(threads: int, reps: int) -> dict:
    """In a fresh process at ``threads`` threads (inductor builds its C++ for the thread count it compiles
    under): the trainer's step eagerly and compiled, alternating, after warm-up."""
    import statistics

    import torch.nn.functional as F

    import fast.decoder_lm as lm
    torch.set_num_threads(threads)
    model = lm.DecoderLM(lm.ModelConfig(**COMPILED_MODEL), seed=0)
    gen = torch.Generator().manual_seed(0)
    t = sum(COMPILED_DOCS)
    ids = torch.randint(0, COMPILED_MODEL["vocab_size"], (1, t), generator=gen)
    targets = torch.randint(0, COMPILED_MODEL["vocab_size"], (t,), generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(COMPILED_DOCS)], dtype=torch.int32)

    def step(forward):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(forward(ids, cu_seqlens=cu)[0], targets).backward()

    compiled = torch.compile(model, fullgraph=True)
    start = time.perf_counter()
    step(compiled)
    compile_s = time.perf_counter() - start
    for _ in range(3):
        step(model)
        step(compiled)
    times = {"eager": [], "compiled": []}
    for _ in range(reps):                                   # alternating: both see the same machine load
        for name, forward in (("eager", model), ("compiled", compiled)):
            start = time.perf_counter()
            step(forward)
            times[name].append(time.perf_counter() - start)
    return dict(compile_s=compile_s, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()})


def bench_compiled(rec, quick: bool) -> None:
    for threads in sorted({1, os.cpu_count() or 1}):
        with tempfile.TemporaryDirectory() as cache:        # inductor's cache empty: compile_s is a first compile
            proc = subprocess.run([sys.executable, __file__, "--compiled-child", str(threads), str(5 if quick else 15)],
                                  capture_output=True, text=True, timeout=1800, cwd=ROOT,
                                  env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        facts = child_facts(proc, f"compiled trainer threads={threads}")
        case = f"compiled trainer h256-L4 T=512 in 4 docs threads={threads}"
        rec.add(case, "eager", "fwd_bwd_ms", facts["eager_ms"], "ms")
        rec.add(case, "compiled", "fwd_bwd_ms", facts["compiled_ms"], "ms")
        rec.add(case, "compiled", "compile_s", facts["compile_s"], "s")
        rec.add(case, "compiled", "speedup", facts["eager_ms"] / facts["compiled_ms"], "x")


# The engine's decode step (issue: the engine at GPU speed): a Qwen3-0.6B-deep model whose arithmetic is small
# (28 layers, 16 query / 8 KV heads of 8, hidden 128, FFN 384, qk norms, vocab 1024; fp32), so what a step
# costs is mostly the host's work: the PyTorch calls Python makes and their dispatch.
ENGINE_MODEL = dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=28, num_heads=16,
                    num_kv_heads=8, head_dim=8, qk_norm=True, max_seq_len=512)


class _TorchCalls:
    """Counts the calls Python makes into torch's C functions (a ``c_call`` whose function is torch's or a
    tensor's method) on every thread started after it is installed, while ``on``."""

    def __init__(self):
        import threading
        self.on, self.calls = False, 0
        threading.setprofile(self._hook)

    def _hook(self, frame, event, arg):
        if self.on and event == "c_call":
            owner = getattr(arg, "__self__", None)
            if ((getattr(arg, "__module__", None) or "").startswith("torch") or isinstance(owner, torch.Tensor)
                    or type(owner).__module__.startswith("torch")):
                self.calls += 1


class _DecodeSteps:
    """Wraps ``gen._step``: each decode-only iteration (no prompt prefilled in it, no verification) appends
    its wall time to ``times`` and, with a ``_TorchCalls`` counter, the torch calls it made to ``calls``; an
    iteration whose work was verification alone (speculative decoding) to ``verify_times`` / ``verify_calls``;
    ``sync`` (CUDA) closes the device's work on both sides of the timing."""

    def __init__(self, gen, counter=None, sync=lambda: None):
        self.times, self.calls, self.verify_times, self.verify_calls = [], [], [], []
        self._prefilled = self._verified = False
        step, prefill, verify = gen._step, gen.runner.prefill, gen._verify

        def timed_prefill(model, work):
            self._prefilled |= any(not c.drafts for c in work)        # (an eager verification is a pass too)
            return prefill(model, work)

        def timed_verify(*args, **kwargs):
            self._verified = True
            return verify(*args, **kwargs)

        def timed_step(settle):
            self._prefilled = self._verified = False
            if counter is not None:
                counter.calls, counter.on = 0, True
            sync()
            start = time.perf_counter()
            step(settle)
            sync()
            elapsed = time.perf_counter() - start
            if counter is not None:
                counter.on = False
            if not self._prefilled:
                times, calls = (self.verify_times, self.verify_calls) if self._verified else (self.times, self.calls)
                times.append(elapsed)
                calls.append(counter.calls if counter is not None else 0)

        gen.runner.prefill, gen._step, gen._verify = timed_prefill, timed_step, timed_verify

    def clear(self):
        self.times.clear(), self.calls.clear(), self.verify_times.clear(), self.verify_calls.clear()


def _repeat_last(tokens: list, k: int) -> list:
    """A drafter for timing verification: k copies of the last token (mostly rejected; a verification's rows
    and work do not depend on what it accepts in a model without linear layers)."""
    return [tokens[-1]] * k


ENGINE_STEPS = ("decode", "verify", "draft")


def engine_child(batch: int, compiled: bool, reps: int, what: str = "decode") -> dict:
    """One engine (eager or ``compile=True``) at one thread: B requests of a 16-token prompt decoding 40 tokens
    greedily; a first run compiles (every padded size and table width the measured runs meet), then per
    decode-only iteration (``Generator._step`` with no prefill) its wall time and the torch calls made on the
    engine thread.  ``what="verify"``: with speculative decoding (k = 4 drafts, ``_repeat_last``), per
    iteration whose work is verification alone instead; ``"draft"``: the model with an MTP head drafting (k =
    4, ``speculative="mtp"``), per call of the drafter (``MTPDrafter.propose``: every depth of every sample)."""
    import statistics

    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    torch.set_num_threads(1)
    counter = _TorchCalls()
    config, spec = dict(ENGINE_MODEL), {}
    if what == "verify":
        spec = dict(speculative=_repeat_last, num_speculative_tokens=4)
    elif what == "draft":
        config, spec = dict(config, mtp_layers=1), dict(speculative="mtp", num_speculative_tokens=4)
    gen = ge.Generator(lm.DecoderLM(lm.ModelConfig(**config), seed=0, mtp=what == "draft"), page_size=16,
                       num_pages=16 * batch + 8, max_batch_size=max(batch, 1), compile=compiled, **spec)
    steps = _DecodeSteps(gen, counter)
    draft_times, draft_calls, measuring = [], [], []
    if what == "draft":     # the call counter's profile hook on the engine thread only around each draft
        drafter, step = gen.scheduler.drafter, gen._step     # (not while the steps compile: traced, 5x slower)
        propose = drafter.propose

        def untraced_step(settle):
            sys.setprofile(None)
            step(settle)

        def timed_propose(seqs, rooms):
            if not measuring:                           # (the first run: the compiles)
                return propose(seqs, rooms)
            counter.calls, counter.on = 0, True
            sys.setprofile(counter._hook)
            start = time.perf_counter()
            drafts = propose(seqs, rooms)
            draft_times.append(time.perf_counter() - start)
            sys.setprofile(None)
            draft_calls.append(counter.calls)
            counter.on = False
            return drafts
        gen._step, drafter.propose = untraced_step, timed_propose

    def run():
        gen.generate([ge.Request(list(range(1, 17)), ge.SamplingParams(max_new_tokens=40)) for _ in range(batch)])

    start = time.perf_counter()
    run()
    warm_s = time.perf_counter() - start
    steps.clear(), draft_times.clear(), draft_calls.clear(), measuring.append(True)
    for _ in range(reps):
        run()
    stats = gen.stats()
    gen.close()
    times, calls = {"decode": (steps.times, steps.calls), "verify": (steps.verify_times, steps.verify_calls),
                    "draft": (draft_times, draft_calls)}[what]
    return dict(step_ms=1e3 * statistics.median(times), calls=statistics.median(calls), warm_s=warm_s,
                static_steps=stats[{"decode": "static_decode_steps", "verify": "static_verify_steps",
                                    "draft": "static_draft_steps"}[what]],
                decode_steps=stats["decode_steps"], iterations=len(times))


QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, qk_norm=True, max_seq_len=4096, tie_embeddings=True)


def engine_gpu_child(batch: int) -> dict:
    """On a GPU: a Qwen3-0.6B-shaped model (random weights, bf16) with this repo's varlen_attn and
    flash_decode, B requests of 128 + 128 tokens (greedy), eager and ``cuda_graphs=True``: decode step ms
    (decode-only iterations), after a first run that captures; and the memory floor of a step (the weights
    once, every request's K and V at 192 keys, over the device's copy bandwidth measured here)."""
    dev = torch.device("cuda")
    facts = {graphs: _engine_gpu_run(batch, graphs, dev) for graphs in (False, True)}
    weights = facts[True].pop("weight_bytes")
    kv = batch * 192 * QWEN3_06B["num_layers"] * 2 * QWEN3_06B["num_kv_heads"] * QWEN3_06B["head_dim"] * 2
    src = torch.empty(1 << 28, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy_bps = 2 * src.nbytes * 10 / (time.perf_counter() - start)
    return dict(eager_ms=facts[False]["step_ms"], graphs_ms=facts[True]["step_ms"],
                floor_ms=1e3 * (weights + kv) / copy_bps, graph_bytes=facts[True]["graph_bytes"])


def _engine_gpu_run(batch: int, graphs: bool, dev) -> dict:
    import statistics

    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    from fast.flash_decoding import flash_decode
    from fast.paged_varlen_attention import varlen_attn
    model = lm.DecoderLM(lm.ModelConfig(**QWEN3_06B), seed=0, device=dev, dtype=torch.bfloat16, varlen_attn=varlen_attn)
    gen = ge.Generator(model, page_size=16, kv_cache_memory=4 << 30, max_batch_size=max(batch, 8),
                       flash_decode=flash_decode, cuda_graphs=graphs)
    steps = _DecodeSteps(gen, sync=torch.cuda.synchronize)

    def run():
        gen.generate([ge.Request([(7 * i + j) % 1000 for j in range(128)], ge.SamplingParams(max_new_tokens=128))
                      for i in range(batch)])

    run()
    steps.clear()
    run()
    stats = gen.stats()
    gen.close()
    return dict(step_ms=1e3 * statistics.median(steps.times), graph_bytes=stats["cuda_graph_bytes"],
                weight_bytes=sum(p.nbytes for p in model.parameters()))


def bench_engine_gpu(rec, quick: bool) -> None:
    for batch in (1, 16, 64):
        proc = subprocess.run([sys.executable, __file__, "--engine-gpu-child", str(batch)], capture_output=True,
                              text=True, timeout=1200, cwd=ROOT)
        facts = child_facts(proc, f"engine GPU B={batch}")
        case = f"engine GPU decode Qwen3-0.6B-shaped bf16 B={batch}"
        for name, ms in (("eager", facts["eager_ms"]), ("cuda_graphs=True", facts["graphs_ms"]),
                         ("memory floor", facts["floor_ms"])):
            rec.add(case, name, "step_ms", ms, "ms")
            rec.add(case, name, "tokens_per_s", 1e3 * batch / ms, "tok/s")
        rec.add(case, "cuda_graphs=True", "over_floor", facts["graphs_ms"] / facts["floor_ms"], "x")
        rec.add(case, "cuda_graphs=True", "graph_bytes", facts["graph_bytes"], "B")
        rec.add(case, "cuda_graphs=True", "speedup", facts["eager_ms"] / facts["graphs_ms"], "x")


def bench_engine_compiled(rec, quick: bool) -> None:
    if torch.cuda.is_available():
        bench_engine_gpu(rec, quick)
        return
    _engine_steps(rec, quick)


def bench_engine_verify(rec, quick: bool) -> None:
    """An iteration of speculative verification alone, eager (the prefill pass) and compiled (the static step)."""
    _engine_steps(rec, quick, what="verify")


def bench_engine_draft(rec, quick: bool) -> None:
    """The MTP head's drafts of a step, eager (a call per depth) and compiled (the static step: every depth)."""
    _engine_steps(rec, quick, what="draft")


def _engine_steps(rec, quick: bool, what: str = "decode") -> None:
    for batch in (1, 16):
        facts = {}
        for compiled in (False, True):
            with tempfile.TemporaryDirectory() as cache:    # inductor's cache empty: warm_s includes a first compile
                proc = subprocess.run([sys.executable, __file__, "--engine-child", str(batch), str(int(compiled)),
                                       str(1 if quick else 3), what], capture_output=True, text=True,
                                      timeout=3600, cwd=ROOT, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
            facts[compiled] = child_facts(proc, f"engine compiled={compiled} B={batch} {what}")
            if compiled and not facts[compiled]["static_steps"]:
                raise AssertionError(f"engine B={batch} {what}: nothing went through the static step")
        case = {"verify": f"engine verification step L28 h128 fp32 B={batch} k=4 threads=1",
                "draft": f"engine MTP drafts L28 h128 fp32 B={batch} k=4 threads=1",
                "decode": f"engine decode step L28 h128 fp32 B={batch} threads=1"}[what]
        for compiled, name in ((False, "eager"), (True, "compile=True")):
            rec.add(case, name, "step_ms", facts[compiled]["step_ms"], "ms")
            rec.add(case, name, "torch_calls", facts[compiled]["calls"], "calls")
        rec.add(case, "compile=True", "warm_s", facts[True]["warm_s"], "s")
        rec.add(case, "compile=True", "speedup", facts[False]["step_ms"] / facts[True]["step_ms"], "x")


# The modeled GPU decode step.  Counted here, on the CPU (per layer and per step, from two depths: count = fixed
# + per_layer x layers): the Python-to-torch calls of the eager decode iteration and the kernels of the static
# step (the aten ops its forward dispatches, views excluded), i.e. what a CUDA graph of it would replay.
# Priced with stated constants, never measured:
#   eager step  = max(host, device): host = calls x HOST_US_PER_CALL (each call a dispatch and a launch from
#                 Python: 5 us, the low end of what a PyTorch op costs on a GPU host); device as below
#   graph step  = device = kernels x the observatory's launch_us (2 us: the gap between dependent launches,
#                 kept inside a graph) + bytes / HBM bandwidth (H100: 3.35 TB/s)
#   floor       = bytes / HBM bandwidth, bytes = the weights once (bf16, the embedding's B rows only) + every
#                 request's K and V (CONTEXT keys, bf16)
# The kernel count is this engine's static step: with its in-file attention and plain torch ops, without
# inductor's fusions ("graph") and with them ("graph of the compiled step": inductor's CPU kernels stand in for
# its GPU ones, the same fusion decisions over the same graph, not the same code); and as a CUDA graph of the
# uncompiled step replays it on a GPU with this repo's kernels ("graph, this repo's kernels": flash_decode as
# the attention plug-in and fast/decoder_lm.py's fused elementwise kernels, run in the kernel observatory,
# every Triton launch and every torch op between them a kernel; the value checks a capture skips left out).
HOST_US_PER_CALL, CONTEXT = 5.0, 1024
GPU_SHAPES = {   # Qwen3 0.6B and 8B (their config.json): hidden, FFN, layers, q / kv heads, head dim, vocab, tied
    "Qwen3-0.6B": dict(hidden=1024, ffn=3072, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936, tied=True),
    "Qwen3-8B": dict(hidden=4096, ffn=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936, tied=False),
}


def _step_counts(layers: int, batch: int, compiled: bool = True) -> dict:
    """(eager calls, static-step kernels, and with ``compiled`` the compiled step's kernels) of one decode
    iteration of ENGINE_MODEL at this depth."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import fast.decoder_lm as lm
    import fast.generator_engine as ge

    class Kernels(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Kernels.count += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    counter = _TorchCalls()
    model = lm.DecoderLM(lm.ModelConfig(**dict(ENGINE_MODEL, num_layers=layers)), seed=0)
    gen = ge.Generator(model, page_size=16, num_pages=16 * batch + 8, max_batch_size=batch)
    step, calls = gen._step, []

    def counted_step(settle):
        counter.calls, counter.on = 0, True
        step(settle)
        counter.on = False
        calls.append(counter.calls)

    gen._step = counted_step
    gen.generate([ge.Request(list(range(1, 17)), ge.SamplingParams(max_new_tokens=4)) for _ in range(batch)])
    gen.close()                                             # (the last iteration was a decode step)
    static, args = _static_step(gen, batch)                 # its forward, eagerly: the ops a graph would hold
    with torch.no_grad(), Kernels():
        static._forward(*args)
    return dict(calls=calls[-1], kernels=Kernels.count,
                compiled_kernels=_compiled_kernels(static, args) if compiled else 0)


def _static_step(gen, batch: int) -> tuple:
    """A StaticDecode over a closed engine's runner and its forward's arguments at ``batch`` rows (the buffers
    as built: padding rows, two pages of the block table): the step a graph would hold, to run eagerly."""
    import fast.generator_engine as ge
    static = ge.StaticDecode(gen.runner, (batch,), batch)
    return static, (gen.model, static.ids[:batch], static.positions[:batch], static.used[:batch],
                    static.rows[:batch], static.prompts[:batch], static.table[:batch, :2])


def repo_kernels_child(layers: int, batch: int) -> dict:
    """The kernels a CUDA graph of the uncompiled static decode step replays on a GPU with this repo's kernels
    (flash_decode as the attention plug-in, fast/decoder_lm.py's fused elementwise kernels forced on a CPU), in
    the kernel observatory: its Triton launches and the torch ops between them, ENGINE_MODEL at this depth.
    flash_decode's value checks are skipped, as they are under capture (a graph holds no host check)."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "parity"))
    import fast.decoder_lm as lm
    import fast.flash_decoding as fd
    import fast.generator_engine as ge
    from observatory import observe
    lm.FUSED_KERNELS = "always"
    fd._check_values = fd._check_leftpad = lambda *args, **kwargs: None
    torch.set_num_threads(1)
    model = lm.DecoderLM(lm.ModelConfig(**dict(ENGINE_MODEL, num_layers=layers)), seed=0)
    gen = ge.Generator(model, page_size=16, num_pages=16 * batch + 8, max_batch_size=batch,
                       flash_decode=fd.flash_decode)
    gen.generate([ge.Request(list(range(1, 17)), ge.SamplingParams(max_new_tokens=2)) for _ in range(batch)])
    gen.close()
    static, args = _static_step(gen, batch)
    with torch.no_grad(), observe(torch_ops=True) as obs:
        static._forward(*args)
    triton_launches = sum(1 for launch in obs.launches if launch.module != "torch")
    return dict(kernels=len(obs.launches), triton=triton_launches, torch_ops=len(obs.launches) - triton_launches)


def _repo_kernels_by_depth(batch: int) -> tuple[dict, dict]:
    """(fixed, per layer) of ``repo_kernels_child``, each depth in a fresh process."""
    counts = []
    for layers in (2, 4):
        proc = subprocess.run([sys.executable, __file__, "--repo-kernels-child", str(layers), str(batch)],
                              capture_output=True, text=True, timeout=1800, cwd=ROOT)
        counts.append(child_facts(proc, f"repo kernels L{layers} B={batch}"))
    low, high = counts
    per_layer = {k: (high[k] - low[k]) / 2 for k in low}
    return {k: low[k] - 2 * per_layer[k] for k in low}, per_layer


def _compiled_kernels(static, args) -> int:
    """The kernels of the static step compiled by inductor (its fusions; on a CPU, C++ kernels plus the BLAS
    calls), counted by the profiler in one call (the Python wrapper, so that each kernel is an event)."""
    import torch._inductor.config as inductor
    from torch.profiler import profile
    with torch.no_grad(), inductor.patch({"cpp.enable_kernel_profile": True}):
        compiled = torch.compile(static._forward, dynamic=False)
        compiled(*args)
        with profile() as prof:
            compiled(*args)
    extern = ("aten::mm", "aten::addmm", "aten::bmm", "aten::index_copy_")
    return sum(1 for e in prof.events() if e.name.startswith("graph_") or e.name in extern)


def _counts_by_depth(batch: int) -> tuple[dict, dict]:
    """(fixed, per layer) of ``_step_counts``, from two depths: count = fixed + per layer x layers."""
    low, high = _step_counts(2, batch), _step_counts(4, batch)
    per_layer = {k: (high[k] - low[k]) / 2 for k in low}
    return {k: low[k] - 2 * per_layer[k] for k in low}, per_layer


def _layer_params(s: dict) -> int:
    """One decoder layer's parameters at a GPU_SHAPES shape: q, k, v, o, the SwiGLU MLP, two norms."""
    h, d = s["hidden"], s["head_dim"]
    return h * (s["heads"] + 2 * s["kv_heads"]) * d + s["heads"] * d * h + 3 * h * s["ffn"] + 2 * h


def bench_modeled_step(rec, quick: bool) -> None:
    from observatory import H100
    for batch in (1, 16, 64):
        fixed, per_layer = _counts_by_depth(batch)
        repo_fixed, repo_per_layer = _repo_kernels_by_depth(batch)
        for name, s in GPU_SHAPES.items():
            h, d = s["hidden"], s["head_dim"]
            layer_params = _layer_params(s)
            weight_bytes = 2 * (s["layers"] * layer_params + s["vocab"] * h + (0 if s["tied"] else batch * h))
            kv_bytes = 2 * batch * CONTEXT * s["layers"] * 2 * s["kv_heads"] * d
            floor_us = (weight_bytes + kv_bytes) / H100.hbm_bytes_per_s * 1e6
            calls = fixed["calls"] + per_layer["calls"] * s["layers"]
            kernels = fixed["kernels"] + per_layer["kernels"] * s["layers"]
            fused = fixed["compiled_kernels"] + per_layer["compiled_kernels"] * s["layers"]
            device_us = kernels * H100.launch_us + floor_us
            fused_us = fused * H100.launch_us + floor_us
            eager_us = max(calls * HOST_US_PER_CALL, device_us)
            case = f"modeled GPU decode step {name} B={batch} context {CONTEXT} bf16 H100"
            rec.add(case, "floor", "step_us", floor_us, "us")
            rec.add(case, "eager", "step_us", eager_us, "us")
            rec.add(case, "graph", "step_us", device_us, "us")
            rec.add(case, "graph", "over_floor", device_us / floor_us, "x")
            rec.add(case, "eager", "over_floor", eager_us / floor_us, "x")
            rec.add(case, "eager", "torch_calls", calls, "calls")
            rec.add(case, "graph", "kernels", kernels, "kernels")
            rec.add(case, "graph", "kernels_per_layer", per_layer["kernels"], "kernels")
            rec.add(case, "graph of the compiled step", "step_us", fused_us, "us")
            rec.add(case, "graph of the compiled step", "over_floor", fused_us / floor_us, "x")
            rec.add(case, "graph of the compiled step", "kernels", fused, "kernels")
            rec.add(case, "graph of the compiled step", "kernels_per_layer", per_layer["compiled_kernels"], "kernels")
            repo = repo_fixed["kernels"] + repo_per_layer["kernels"] * s["layers"]
            repo_us = repo * H100.launch_us + floor_us
            rec.add(case, "graph, this repo's kernels", "step_us", repo_us, "us")
            rec.add(case, "graph, this repo's kernels", "over_floor", repo_us / floor_us, "x")
            rec.add(case, "graph, this repo's kernels", "kernels", repo, "kernels")
            rec.add(case, "graph, this repo's kernels", "kernels_per_layer", repo_per_layer["kernels"], "kernels")


# ----------------------------------------------------------------------------- the decode layer, fused

def fused_layer_child(batch: int, context: int) -> dict:
    """One Qwen3-0.6B decoder layer's decode step (fp16: the interpreter computes no bf16) for ``batch``
    requests at ``context`` keys, fast/decoder_lm.py's ``_block`` with flash_decode over a paged cache, run
    in the kernel observatory (parity/observatory.py, torch ops recorded as launches of their own) with the
    fused elementwise kernels off and on: launches, issued bytes, the H100 latency model's microseconds."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "parity"))
    import fast.decoder_lm as lm
    from fast.flash_decoding import flash_decode
    from observatory import H100, observe
    torch.manual_seed(0)
    config = lm.ModelConfig(**dict(QWEN3_06B, num_layers=1, vocab_size=1024))
    model = lm.DecoderLM(config, seed=0, dtype=torch.float16)
    c, ps = model.config, 16
    pages = context // ps
    kc = torch.randn(batch * pages, ps, c.num_kv_heads, c.head_dim, dtype=torch.float16)
    vc = torch.randn_like(kc)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    used = torch.full((batch,), context, dtype=torch.int32)
    x = torch.randn(batch, c.hidden_size, dtype=torch.float16)
    before = 0.5 * torch.randn(batch, c.hidden_size, dtype=torch.float16)     # the block before's output
    rotary = model._rotary_at(torch.full((batch,), context - 1))

    def attend(i, q, k, v):                 # (k = v = None: the fused q + k launch wrote them: kv_slots)
        new = {} if k is None else dict(k_new=k[:, None], v_new=v[:, None])
        return flash_decode(q[:, None], kc, vc, used, block_table=table, scale=c.head_dim ** -0.5, **new)[:, 0]

    slots = table[:, (context - 1) // ps].long() * ps + (context - 1) % ps      # the new token's, as an engine's
    attend.kv_slots = lambda i: (kc.flatten(0, 1), vc.flatten(0, 1), slots)

    facts, outputs = {}, {}
    for fused in (False, "always"):
        lm.FUSED_KERNELS = fused
        with torch.no_grad(), observe(torch_ops=True) as obs:
            outputs[fused] = model._block(0, model.layers[0], x, rotary, attend, None, before)
        total = H100.total(obs.launches)
        facts["fused" if fused else "unfused"] = dict(
            kernels=total["launches"], torch_ops=total["torch_ops"], launches=total["launches"] + total["torch_ops"],
            modeled_us=total["us"] + total["torch_ops_us"],
            issued_bytes=sum(r.issued_bytes for r in obs.launches),
            names=sorted({r.kernel for r in obs.launches if r.module != "torch"}))
    facts["max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                for a, b in zip(outputs[False], outputs["always"]))
    return facts


def bench_fused_layer(rec, quick: bool) -> None:
    """fused_layer_child at B = 1 and 16 (context 1024; 256 with --quick), each in a fresh process."""
    context = 256 if quick else 1024
    for batch in (1, 16):
        proc = subprocess.run([sys.executable, __file__, "--fused-layer-child", str(batch), str(context)],
                              capture_output=True, text=True, timeout=3600, cwd=ROOT)
        facts = child_facts(proc, f"fused layer B={batch}")
        case = f"observatory Qwen3-0.6B decode layer fp16 B={batch} context {context} H100 model"
        for impl in ("unfused", "fused"):
            f = facts[impl]
            for metric, unit in (("launches", "launches"), ("kernels", "kernels"), ("torch_ops", "ops"),
                                 ("issued_bytes", "B"), ("modeled_us", "us")):
                rec.add(case, impl, metric, f[metric], unit)
        rec.add(case, "fused", "max_abs_diff", facts["max_abs_diff"], "")
        rec.add(case, "fused", "speedup", facts["unfused"]["modeled_us"] / facts["fused"]["modeled_us"], "x")


# ----------------------------------------------------------------------------- speculative decoding

H100_BF16_FLOPS = 989e12        # dense bf16 tensor-core peak (H100 SXM5 datasheet), the compute bound's rate
SPEC_ACCEPTANCE = (0.6, 0.8)    # assumed per-draft acceptance rates (i.i.d.): the model's inputs, not measured


def bench_modeled_speculative(rec, quick: bool) -> None:
    """The speculative decode step on an H100, modeled like ``bench_modeled_step`` (counts from this CPU, the
    observatory's prices) at Qwen3-0.6B and Qwen3-8B shapes, B = 1, 16, 64, k = 2 and 4, against the plain
    graph-replayed decode step.  A verification of B samples with k drafts computes R = B (k + 1) rows and
    reads the weights once: device time = kernels x launch cost + max(bytes / HBM bandwidth, FLOPs / bf16
    peak), the FLOPs 2 x (layer and lm_head parameters) x R plus attention's 4 R x context x heads x
    head_dim per layer.  With each draft accepted with probability a (independently), a verification emits
    E = (1 - a^(k + 1)) / (1 - a) tokens per sample.  Drafters: n-gram (no device work) and the MTP head (one
    decoder layer, its fc and the lm_head per depth, k depths a step: at a 152k vocabulary the lm_head
    reads dominate).  "captured": the verification replayed from a graph of the compiled step's kernels
    (``StaticDecode.verify`` under ``cuda_graphs=True``, built, not yet run on a GPU); "eager pass": in the
    prefill pass, as a verification beside a prompt's prefill, in the batch-invariant mode or with sliding
    layers runs (host-bound: the eager step's torch calls at 5 us each).  "mtp captured": the MTP head's
    depths captured too (``StaticDecode.draft``: built, not yet run on a GPU); "mtp captured verification":
    its depths eager, their torch calls on the host while the device works (the fallback, for a head that
    lags).  The plain step it is set against: the graph of the compiled decode
    step."""
    from observatory import H100
    for batch in (1, 16, 64):
        fixed, per_layer = _counts_by_depth(batch)
        for name, s in GPU_SHAPES.items():
            h, d = s["hidden"], s["head_dim"]
            layer_params = _layer_params(s)
            head_params = s["vocab"] * h
            kv_per_token = s["layers"] * 2 * s["kv_heads"] * d * 2                     # bytes, bf16
            kernels = fixed["compiled_kernels"] + per_layer["compiled_kernels"] * s["layers"]   # the fused step
            calls = fixed["calls"] + per_layer["calls"] * s["layers"]

            def device_us(rows: int, layers: int, extra_params: int = 0, launches: int = kernels) -> float:
                weight_bytes = 2 * (layers * layer_params + head_params + extra_params)
                memory = (weight_bytes + batch * CONTEXT * kv_per_token * layers / s["layers"]) / H100.hbm_bytes_per_s
                flops = 2 * (layers * layer_params + head_params + extra_params) * rows \
                    + 4 * rows * CONTEXT * s["heads"] * d * layers
                return launches * H100.launch_us + max(memory, flops / H100_BF16_FLOPS) * 1e6

            plain_us = device_us(batch, s["layers"])
            case_plain = f"modeled GPU speculative step {name} B={batch} context {CONTEXT} bf16 H100"
            rec.add(case_plain, "plain graph of the compiled step", "step_us", plain_us, "us")
            rec.add(case_plain, "plain graph of the compiled step", "tokens_per_s", batch / plain_us * 1e6, "tokens/s")
            for k in (2, 4):
                verify_us = device_us(batch * (k + 1), s["layers"])
                # the MTP head per depth: one decoder layer and fc (2 h x h) over B rows, the lm_head
                mtp_launches = per_layer["compiled_kernels"] + 4
                mtp_us = k * device_us(batch, 1, extra_params=2 * h * h, launches=mtp_launches)
                mtp_calls = k * (per_layer["calls"] + 20)
                for a in SPEC_ACCEPTANCE:
                    emitted = (1 - a ** (k + 1)) / (1 - a)
                    case = f"modeled GPU speculative step {name} B={batch} k={k} acceptance {a} context {CONTEXT}"
                    for impl, step_us in (
                            ("ngram captured", verify_us),
                            ("ngram eager pass", max(calls * HOST_US_PER_CALL, verify_us)),
                            ("mtp captured", verify_us + mtp_us),
                            ("mtp captured verification", max(mtp_calls * HOST_US_PER_CALL, verify_us + mtp_us)),
                            ("mtp eager pass", max((calls + mtp_calls) * HOST_US_PER_CALL, verify_us + mtp_us))):
                        rec.add(case, impl, "step_us", step_us, "us")
                        rec.add(case, impl, "tokens_per_step", emitted, "tokens")
                        rec.add(case, impl, "speedup", emitted * plain_us / step_us, "x")


SPEC_MTP_MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_seq_len=96, layer_types=("linear", "attention"),
                      linear_num_k_heads=2, linear_num_v_heads=4, linear_head_k_dim=8, linear_head_v_dim=8,
                      qk_norm=True, attn_output_gate=True, zero_centered_norm=True, partial_rotary_factor=0.5,
                      mtp_layers=1, tie_embeddings=False)


def _speculation_rows(rec, case: str, impl: str, stats: dict) -> None:
    """Acceptance (drafts accepted / proposed), the verifications by drafts accepted, and target forwards per
    generated token: each forward of a sample emits 1 + the drafts it accepted, so forwards = generated -
    accepted (a plain step is a forward that accepted none)."""
    generated = stats.get("generated_tokens")
    rec.add(case, impl, "acceptance", stats["accepted_draft_tokens"] / max(1, stats["draft_tokens"]), "")
    if generated:
        rec.add(case, impl, "forwards_per_token", (generated - stats["accepted_draft_tokens"]) / generated, "")
    for j, n in enumerate(stats["acceptance_lengths"]):
        rec.add(case, impl, f"verifications_accepting_{j}", n, "")


def speculative_gpu_run(batch: int, config: dict, dev, new_tokens: int = 128, **engine) -> dict:
    """tokens/s of the fast engine (this repo's kernels on a GPU) over ``batch`` greedy requests of 128 prompt
    tokens: plain decoding with ``cuda_graphs=True`` (its best), then drafts of plain decoding's own tokens (k
    = 4: all accepted, then one planted error each), verifications replayed from CUDA graphs too (alone in their
    iteration; the static step, ``StaticDecode.verify``).  The tokens must be plain decoding's."""
    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    from fast.flash_decoding import flash_decode
    from fast.paged_varlen_attention import varlen_attn
    model = lm.DecoderLM(lm.ModelConfig(**config), seed=0, device=dev, dtype=torch.bfloat16 if dev.type == "cuda"
                         else torch.float32, varlen_attn=varlen_attn)
    reqs = [ge.Request([(7 * i + j) % 1000 for j in range(128)], ge.SamplingParams(max_new_tokens=new_tokens))
            for i in range(batch)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    facts, plain = {}, None
    for impl in ("plain", "all accepted", "one error per draft"):
        drafter = None if plain is None else _ContinuationDrafter(plain, errors=impl != "all accepted", k=4,
                                                                  vocab=config["vocab_size"])
        with ge.Generator(model, page_size=16, max_batch_size=max(batch, 8), flash_decode=flash_decode,
                          cuda_graphs=dev.type == "cuda", speculative=drafter,
                          num_speculative_tokens=4, **engine) as gen:
            gen.generate(reqs[:1])                                     # warm: compiles, autotunes, captures
            sync()
            start = time.perf_counter()
            done = gen.generate(reqs)
            sync()
            wall = time.perf_counter() - start
            stats = gen.stats()
        if plain is None:
            plain = {tuple(r.prompt_token_ids): c.token_ids for r, c in zip(reqs, done)}
        elif [c.token_ids for c in done] != [plain[tuple(r.prompt_token_ids)] for r in reqs]:
            raise AssertionError(f"speculative GPU B={batch} {impl}: speculative decoding changed the tokens")
        facts[impl] = dict(tokens_per_s=sum(len(c.token_ids) for c in done) / wall,
                           acceptance=stats["accepted_draft_tokens"] / max(1, stats["draft_tokens"]))
    return facts


def bench_speculative_gpu(rec, quick: bool) -> None:
    """On a GPU (``make gpu-evidence``): speculative_gpu_run at Qwen3-0.6B's shape, B = 1 and 16."""
    for batch in (1, 16):
        proc = subprocess.run([sys.executable, __file__, "--speculative-gpu-child", str(batch)], capture_output=True,
                              text=True, timeout=1200, cwd=ROOT)
        facts = child_facts(proc, f"speculative GPU B={batch}")
        case = f"speculative GPU Qwen3-0.6B-shaped bf16 B={batch} k=4"
        for impl, f in facts.items():
            rec.add(case, impl, "tokens_per_s", f["tokens_per_s"], "tok/s")
            if impl != "plain":
                rec.add(case, impl, "acceptance", f["acceptance"], "")
                rec.add(case, impl, "speedup", f["tokens_per_s"] / facts["plain"]["tokens_per_s"], "x")


def bench_speculative(rec, quick: bool) -> None:
    """Speculative decoding (issue 43), the fast engine: n-gram drafting on a repetitive task, Qwen3.5's MTP
    head before and after training it with ``mtp_loss``, and decode tokens/s with and without speculation at
    a Qwen3.5-0.8B-shaped model on this CPU.  On a GPU: ``bench_speculative_gpu``."""
    if torch.cuda.is_available():
        bench_speculative_gpu(rec, quick)
        return
    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    import ref.gated_deltanet as gdn
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gen = torch.Generator().manual_seed(1)

    def repetitive(vocab: int, n: int) -> list:           # prompts that repeat a phrase of 4 .. 11 tokens
        out = []
        for _ in range(n):
            phrase = torch.randint(0, vocab, (int(torch.randint(4, 12, (), generator=gen)),), generator=gen).tolist()
            out.append(phrase * 6)
        return out

    # 1. n-gram drafting, the fast engine: 8 prompts repeating a phrase, 64 greedy tokens each, k = 4
    model = lm.DecoderLM(lm.ModelConfig(**POOL_MODEL), seed=0)
    reqs = [ge.Request(p, ge.SamplingParams(max_new_tokens=64)) for p in repetitive(512, 8)]
    case = "speculative ngram repetitive B=8 k=4"
    for spec in (None, "ngram"):
        with ge.Generator(model, page_size=16, speculative=spec, num_speculative_tokens=4) as g:
            start = time.perf_counter()
            g.generate(reqs)
            wall = time.perf_counter() - start
            stats = g.stats()
        impl = "ngram" if spec else "plain"
        rec.add(case, impl, "steps", stats["steps"], "")
        rec.add(case, impl, "wall_s", wall, "s")
        if spec:
            _speculation_rows(rec, case, impl, stats)

    # 2. the MTP head (the fast engine): its drafts on held-out prompts before and after training it on the
    #    model's own greedy completions of other prompts (the trunk frozen; Adam, lr 1e-2)
    mtp_model = lm.DecoderLM(lm.ModelConfig(**SPEC_MTP_MODEL), seed=1, linear_layer=gdn.GatedDeltaNet, mtp=True)
    prompts = [torch.randint(0, 64, (5,), generator=gen).tolist() for _ in range(24)]
    train = [ge.Request(p, ge.SamplingParams(max_new_tokens=24)) for p in prompts[:16]]
    held_out = [ge.Request(p, ge.SamplingParams(max_new_tokens=24)) for p in prompts[16:]]

    def serve(requests, spec):
        with ge.Generator(mtp_model, speculative=spec, num_speculative_tokens=3, prefix_caching=False) as g:
            done = g.generate(requests)
            stats = g.stats()
        stats["generated_tokens"] = sum(len(c.token_ids) for c in done)
        return done, stats

    case = "speculative mtp held-out B=1 k=3"
    _speculation_rows(rec, case, "mtp untrained", serve(held_out, "mtp")[1])
    sequences = torch.tensor([c.prompt_token_ids + c.token_ids for c in serve(train, None)[0]])
    for p in mtp_model.parameters():
        p.requires_grad_(False)
    for p in mtp_model.mtp.parameters():
        p.requires_grad_(True)
    opt = torch.optim.Adam(mtp_model.mtp.parameters(), lr=1e-2)
    steps = 60 if quick else 300
    for _ in range(steps):
        loss = mtp_model.mtp_loss(sequences)
        opt.zero_grad()
        loss.backward()
        opt.step()
    rec.add(case, f"mtp trained {steps} steps", "final_mtp_loss", loss.item(), "nats")
    _speculation_rows(rec, case, f"mtp trained {steps} steps", serve(held_out, "mtp")[1])
    _speculation_rows(rec, "speculative mtp training prompts B=1 k=3", f"mtp trained {steps} steps",
                      serve(train, "mtp")[1])

    # 3. decode tokens/s at Qwen3.5-0.8B's shape (random weights, fp32, the reference Gated DeltaNet layer):
    #    plain decoding, then drafts that plain decoding's tokens make (what a perfect drafter proposes: every
    #    draft accepted), then the same with one planted error per draft (positions 0 .. k cycling: half
    #    accepted, and every rejection runs the linear layers again over the accepted rows), then Qwen3.5's
    #    MTP head, untrained (what drafting costs: its drafts are rejected).  A random model's outputs do
    #    not repeat its prompt, so n-gram drafting would propose nothing here: these drafters measure what
    #    verification, rollback and the head cost and buy at this size.
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint("qwen3.5-0.8b", tmp)
        trunk = lm.DecoderLM.from_pretrained(tmp, linear_layer=gdn.GatedDeltaNet, dtype=torch.float32,
                                             max_seq_len=256)
    big = lm.DecoderLM(dataclasses.replace(trunk.config, mtp_layers=1), linear_layer=gdn.GatedDeltaNet, mtp=True)
    big.load_state_dict(trunk.state_dict(), strict=False)        # the trunk's weights, a random head
    del trunk
    for batch in (1, 8):
        prompts = [torch.randint(0, 4096, (24,), generator=gen).tolist() for _ in range(batch)]
        reqs = [ge.Request(p, ge.SamplingParams(max_new_tokens=16 if quick else 48)) for p in prompts]
        case = f"speculative Qwen3.5-0.8B-shaped fp32 B={batch} k=4"
        plain = None
        for impl in ("plain", "all accepted", "one error per draft", "mtp untrained"):
            drafter = (None if plain is None else "mtp" if impl.startswith("mtp") else
                       _ContinuationDrafter(plain, errors=impl != "all accepted", k=4, vocab=4096))
            with ge.Generator(big, page_size=16, speculative=drafter, num_speculative_tokens=4,
                              max_seq_len=256) as g:
                start = time.perf_counter()
                done = g.generate(reqs)
                wall = time.perf_counter() - start
                stats = g.stats()
            if plain is None:
                plain = {tuple(r.prompt_token_ids): c.token_ids for r, c in zip(reqs, done)}
            elif [c.token_ids for c in done] != [plain[tuple(r.prompt_token_ids)] for r in reqs]:
                raise AssertionError(f"{case} {impl}: speculative decoding changed the tokens")
            rec.add(case, impl, "tokens_per_s", sum(len(c.token_ids) for c in done) / wall, "tokens/s")
            rec.add(case, impl, "steps", stats["steps"], "")
            if drafter is not None:
                _speculation_rows(rec, case, impl, stats)


class _ContinuationDrafter:
    """Drafts what plain decoding produced after the sequence so far (found by its prompt); ``errors``: one
    draft token replaced per proposal, at positions 0 .. k cycling (k: none)."""

    def __init__(self, plain: dict, errors: bool, k: int, vocab: int):
        self.plain, self.errors, self.k, self.vocab, self.calls = plain, errors, k, vocab, 0

    def __call__(self, tokens: list, k: int) -> list:
        for prompt, completion in self.plain.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                draft = list(completion[len(tokens) - len(prompt):][:k])
                spot, self.calls = self.calls % (self.k + 1), self.calls + 1
                if self.errors and spot < len(draft):
                    draft[spot] = (draft[spot] + 1) % self.vocab
                return draft
        return []


PARTS = {"checkpoint": bench_checkpoints, "tp": bench_tp, "pool": bench_pool, "compiled": bench_compiled,
         "engine-compiled": bench_engine_compiled, "engine-verify": bench_engine_verify,
         "engine-draft": bench_engine_draft,
         "modeled-step": bench_modeled_step,
         "speculative": bench_speculative, "modeled-speculative": bench_modeled_speculative,
         "fused-layer": bench_fused_layer}


def cpu(rec, args) -> None:
    for name, bench in PARTS.items():
        if args.part in ("all", name):
            bench(rec, args.quick)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--checkpoint-child"]:
        print("FACTS " + json.dumps(checkpoint_child(argv[1])), flush=True)
        return 0
    if argv[:1] == ["--tp-child"]:
        print("FACTS " + json.dumps(tp_child(int(argv[1]), argv[2], int(argv[3]))), flush=True)
        return 0
    if argv[:1] == ["--compiled-child"]:
        print("FACTS " + json.dumps(compiled_child(int(argv[1]), int(argv[2]))), flush=True)
        return 0
    if argv[:1] == ["--engine-gpu-child"]:
        print("FACTS " + json.dumps(engine_gpu_child(int(argv[1]))), flush=True)
        return 0
    if argv[:1] == ["--repo-kernels-child"]:
        print("FACTS " + json.dumps(repo_kernels_child(int(argv[1]), int(argv[2]))), flush=True)
        return 0
    if argv[:1] == ["--fused-layer-child"]:
        print("FACTS " + json.dumps(fused_layer_child(int(argv[1]), int(argv[2]))), flush=True)
        return 0
    if argv[:1] == ["--speculative-gpu-child"]:
        facts = speculative_gpu_run(int(argv[1]), QWEN3_06B, torch.device("cuda"), kv_cache_memory=8 << 30)
        print("FACTS " + json.dumps(facts), flush=True)
        return 0
    if argv[:1] == ["--engine-child"]:
        print("FACTS " + json.dumps(engine_child(int(argv[1]), bool(int(argv[2])), int(argv[3]),
                                                 argv[4] if len(argv) > 4 else "decode")), flush=True)
        return 0

    def configure(ap):
        ap.add_argument("--part", choices=["all", *PARTS], default="all")
    return run_bench("decoder_lm", __doc__, gpu=cpu, cpu=cpu, configure=configure, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
