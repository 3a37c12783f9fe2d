"""Tensor-parallel probes: real processes over gloo, run by parity/test_tensor_parallel.py inside a private
network namespace (loopback only).  Each command prints one JSON line of facts; the test asserts on them.

  trainer KIND MODE TP...   fast/decoder_lm.py's DecoderLM(tp_group=...) used SPMD (torchrun-style, every rank
                            the same inputs): logits, token_logprobs and the gradients at each tp, against tp = 1
  engine KIND MODE TP...    fast/generator_engine.py's Generator(model, tensor_parallel_size=tp) on a request
                            mix with groups, prefix-cache hits, chunked prefill and preemption, then a weight
                            load: tokens and logprobs against tp = 1 and against the trainer's token_logprobs
  faults                    a worker killed mid-step, a worker hung (SIGSTOP) mid-step: how long until the
                            generator fails, what its requests and a later submit get, how long close() takes
  checkpoint PATH TP        Generator.from_pretrained(PATH, tensor_parallel_size=TP) greedy tokens, each rank
                            reading its shard of the checkpoint (an MoE one's experts: its own only)

KIND: attention (4 query heads, 2 KV heads), hybrid (Qwen3.5-like: Gated DeltaNet with Hk = 2, Hv = 4, then
gated attention with 4 / 2 heads) or moe (the hybrid with Qwen3.5-MoE blocks: 8 experts, top 3, a shared
expert; expert parallelism over the same ranks); MODE: default or invariant.  tp = 4 replicates the KV heads (and the
Gated DeltaNet key heads) on two ranks each.
"""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import sys
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fast.decoder_lm as lm  # noqa: E402
import fast.flash_decoding as fd  # noqa: E402
import fast.generator_engine as ge  # noqa: E402
import fast.moe as fast_moe  # noqa: E402
import fast.paged_varlen_attention as pva  # noqa: E402
import ref.gated_deltanet as gdn  # noqa: E402
import ref.moe as ref_moe  # noqa: E402
import tp_models  # noqa: E402

if os.environ["TRITON_INTERPRET"] == "1":      # (speed only: see observatory.skip_interpreter_repeats)
    from observatory import skip_interpreter_repeats
    skip_interpreter_repeats()


def config(kind: str) -> lm.ModelConfig:
    return tp_models.config(kind, lm)


def model_kw(mode: str, moe_layer=fast_moe.MoE) -> dict:
    """The layers' plug-ins: the reference Gated DeltaNet and an MoE layer: fast/moe.py's (its kernels in the
    interpreter: the trainer) or ref/moe.py's (the same expert-parallel code over PyTorch's products: the
    engine's runs, where the engine's paths are under test and the interpreter would triple their time)."""
    invariant = mode == "invariant"
    return dict(linear_layer=gdn.GatedDeltaNet, moe_layer=moe_layer, batch_invariant=invariant,
                varlen_attn=pva.varlen_attn if invariant else None)


def requests(repeating: bool = False) -> list:
    """A group of 3, a prompt sharing the group's first pages (a prefix-cache hit), a long prompt cut into
    chunks, short ones; greedy and sampled (``repeating``: and a prompt repeating a phrase, for n-gram drafts)."""
    base = list(range(3, 22))
    extra = [ge.Request([9, 4, 30, 12, 50] * 4, ge.SamplingParams(max_new_tokens=12))] if repeating else []
    return [ge.Request(base, ge.SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, n=3)),
            ge.Request(base[:12] + [40, 41, 42], ge.SamplingParams(max_new_tokens=4)),
            ge.Request([7] * 30, ge.SamplingParams(max_new_tokens=3, temperature=0.7, seed=9)),
            ge.Request([1, 2], ge.SamplingParams(max_new_tokens=5)), *extra]


def engine_kw(mode: str) -> dict:
    """A small pool (preemption), a small prefill budget (chunks), pages of 4 (prefix hits)."""
    kw = dict(page_size=4, num_pages=16, max_prefill_tokens=12, max_batch_size=8)
    return dict(kw, flash_decode=fd.flash_decode) if mode == "invariant" else kw


def flat(completions) -> list:
    return [s for c in completions for s in (c if isinstance(c, list) else [c])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the trainer, SPMD

def _trainer_rank(rank, tp, port, kind, mode, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    model = lm.DecoderLM(config(kind), seed=1, tp_group=dist.group.WORLD, **model_kw(mode))
    logits, logps = _trainer_pass(model)
    grads = _grad_state_dict(model)
    buffer = io.BytesIO()                    # bytes through the queue: nothing shared outlives this process
    torch.save((rank, logits, logps, grads), buffer)
    out.put(buffer.getvalue())
    dist.barrier()
    dist.destroy_process_group()


def _trainer_pass(model):
    ids = torch.randint(0, 61, (1, 23), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)
    logits = model(ids, cu_seqlens=cu)
    seqs = [list(range(3, 20)), list(range(3, 12)) + [5, 6, 7], [9, 9, 2, 4]]
    logps = model.token_logprobs(seqs, [9, 9, 2], temperature=1.0)
    (logits.sum() + sum(lp.sum() for lp in logps)).backward()
    return logits.detach(), [lp.detach() for lp in logps]


def _grad_state_dict(model) -> dict:
    """The gradients under the canonical names (fused weights split into their parts)."""
    params = list(model.parameters())
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        return {n: t.clone() for n, t in model.state_dict().items()}
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def trainer(kind: str, mode: str, tps: list) -> dict:
    import torch.multiprocessing as mp
    torch.set_num_threads(1)
    full = lm.DecoderLM(config(kind), seed=1, **model_kw(mode))
    logits, logps = _trainer_pass(full)
    grads = _grad_state_dict(full)
    facts = {}
    for tp in tps:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_trainer_rank, args=(r, tp, port, kind, mode, out)) for r in range(tp)]
        for p in procs:
            p.start()
        results = sorted((torch.load(io.BytesIO(out.get(timeout=300)), weights_only=True) for _ in range(tp)),
                         key=lambda r: r[0])
        for p in procs:
            p.join(60)
        shard_of = lm.DecoderLM(config(kind), device="meta", linear_layer=gdn.GatedDeltaNet, moe_layer=fast_moe.MoE)
        grad_err = 0.0
        for rank, _, _, g in results:
            for name, got in g.items():
                want = lm.shard(grads[name], lm.shard_spec(name, shard_of.config, tp, rank))
                grad_err = max(grad_err, ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item())
        facts[tp] = dict(
            logits_bitwise=all(torch.equal(r[1], logits) for r in results),
            logprobs_bitwise=all(all(torch.equal(a, b) for a, b in zip(r[2], logps)) for r in results),
            ranks_agree=all(torch.equal(r[1], results[0][1]) for r in results),
            logits_max_diff=max((r[1] - logits).abs().max().item() for r in results),
            logprobs_max_diff=max((a - b).abs().max().item() for r in results for a, b in zip(r[2], logps)),
            grad_max_rel_err=grad_err)
    return facts


# ----------------------------------------------------------------------------- the engine

class ContinuationDrafter:
    """Drafts a known continuation of the sequence so far (the tp = 1 plain engine's completions, matched by
    prefix), one token wrong where len(tokens) % (k + 1) < k: accepted and rejected drafts.  No state: every
    rank (a pickled copy each) proposes the same drafts for the same tokens."""

    def __init__(self, completions: list, vocab: int):
        self.known, self.vocab = [c.prompt_token_ids + c.token_ids for c in completions], vocab

    def __call__(self, tokens: list, k: int) -> list:
        for seq in self.known:
            if len(seq) > len(tokens) and seq[:len(tokens)] == tokens:
                draft, spot = seq[len(tokens):len(tokens) + k], len(tokens) % (k + 1)
                if spot < len(draft):
                    draft[spot] = (draft[spot] + 1) % self.vocab
                return draft
        return []


PAGES_SPECULATIVE = 20     # (drafts take free pages only: a little room beside the preempting pool)


def engine(kind: str, mode: str, tps: list, compiled: bool = False, speculative: bool = False) -> dict:
    """tp = 1 (eager, plain decoding) and each of ``tps`` (``compiled``: Generator(compile=True), every rank its
    compiled static step, one padded size; ``speculative``: a picklable drafter's drafts, k = 3, accepted
    and rejected, and a prompt repeating a phrase among the requests; compiled, every rank's static step)."""
    torch.set_num_threads(1)
    cfg, mkw = config(kind), model_kw(mode, moe_layer=ref_moe.MoE)
    new_weights = lm.DecoderLM(cfg, seed=2, **mkw).state_dict()
    runs = {}
    for tp in [1, *tps]:
        start = time.time()
        static = dict(compile=True, capture_sizes=(8,)) if compiled and tp > 1 else {}
        if speculative and tp > 1:               # (compiled: a verification alone runs each rank's static step)
            static = dict(speculative=ContinuationDrafter(runs[1][0] + runs[1][1], cfg.vocab_size),
                          num_speculative_tokens=3, compile=True, capture_sizes=(8,))
        kw = dict(engine_kw(mode), num_pages=PAGES_SPECULATIVE) if speculative else engine_kw(mode)
        with ge.Generator(lm.DecoderLM(cfg, seed=1, **mkw), tensor_parallel_size=tp, tp_timeout_s=120,
                          **kw, **static) as g:
            first = flat(g.generate(requests(speculative)))
            stats = g.stats()
            g.load_weights(new_weights, 1)
            second = flat(g.generate(requests(speculative)))
        runs[tp] = (first, second, stats, time.time() - start)
    temps = [r.sampling.temperature for r in requests(speculative) for _ in range(r.sampling.n)]   # per sample
    trainer_lps = {}
    for version, seed in ((0, 1), (1, 2)):
        model = lm.DecoderLM(cfg, seed=seed, **mkw)
        done = runs[1][version]
        with torch.no_grad():
            trainer_lps[version] = model.token_logprobs([s.prompt_token_ids + s.token_ids for s in done],
                                                        [len(s.prompt_token_ids) for s in done],
                                                        temperature=temps)
    facts = {}
    for tp, (first, second, stats, seconds) in runs.items():
        pairs = list(zip(first, runs[1][0])) + list(zip(second, runs[1][1]))
        vs_trainer = [(s, lp) for version, done in enumerate((first, second))
                      for s, lp in zip(done, trainer_lps[version])]
        facts[tp] = dict(
            seconds=round(seconds, 1), preemptions=stats["preemptions"], prefix_hit_tokens=stats["prefix_hit_tokens"],
            decode_steps=stats["decode_steps"], static_decode_steps=stats["static_decode_steps"],
            static_verify_steps=stats["static_verify_steps"],
            draft_tokens=stats["draft_tokens"], accepted_draft_tokens=stats["accepted_draft_tokens"],
            tensor_parallel_size=stats["tensor_parallel_size"], versions=[s.max_policy_version for s in second],
            tokens_equal_tp1=all(a.token_ids == b.token_ids for a, b in pairs),
            logprobs_bitwise_tp1=all(a.logprobs == b.logprobs for a, b in pairs),
            logprobs_max_diff_tp1=max(max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) for a, b in pairs),
            logprobs_bitwise_trainer=all(torch.equal(torch.tensor(s.logprobs, dtype=torch.float32), lp)
                                         for s, lp in vs_trainer))
    return facts


# ----------------------------------------------------------------------------- faults

def faults() -> dict:
    torch.set_num_threads(1)
    cfg = config("attention")
    facts = {}
    for how in ("kill", "hang"):
        timeout = 6.0
        g = ge.Generator(lm.DecoderLM(cfg, seed=1, linear_layer=gdn.GatedDeltaNet), tensor_parallel_size=2,
                         tp_timeout_s=timeout, page_size=4)
        g.generate([ge.Request([1, 2, 3], ge.SamplingParams(max_new_tokens=2))])          # warm: the ranks work
        futures = [g.submit(ge.Request([i + 1] * 9, ge.SamplingParams(max_new_tokens=54))) for i in range(3)]
        while g.stats()["steps"] < 3:                                                      # mid-decode
            time.sleep(0.001)
        worker = g._tp.procs[0]
        start = time.time()
        os.kill(worker.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        in_flight = sum(not f.done() for f in futures)
        errors = []
        for f in futures:
            try:
                f.result(timeout=timeout * 4)
                errors.append(None)
            except Exception as exc:       # noqa: BLE001 (the type is a fact to report)
                errors.append(f"{type(exc).__name__}: {exc}")
        failed_after = time.time() - start
        try:
            g.submit(ge.Request([1], ge.SamplingParams(max_new_tokens=1)))
            later = "accepted"
        except RuntimeError as exc:
            later = f"RuntimeError: {exc}"
        start = time.time()
        g.close()
        close_s = time.time() - start
        if how == "hang" and worker.is_alive():     # (close() ends a hung worker itself)
            os.kill(worker.pid, signal.SIGKILL)
        facts[how] = dict(timeout_s=timeout, in_flight=in_flight, failed_after_s=round(failed_after, 2), errors=errors,
                          later_submit=later, close_s=round(close_s, 2), worker_alive_after_close=worker.is_alive(),
                          threads_after_close=engine_threads())
    return facts


def engine_threads() -> list:
    """The generator's threads still alive (its engine loop, the workers' watchdog): none after close().  (A
    watchdog left running held the generator, and with it rank 0's process group: dropping that last
    reference during the interpreter's shutdown crashed the process now and then.)"""
    return [t.name for t in threading.enumerate() if t.name.endswith("-engine") or t.name == "tp-watchdog"]


# ----------------------------------------------------------------------------- a checkpoint

def checkpoint(path: str, tp: int) -> dict:
    torch.set_num_threads(1)
    prompts = [[5, 17, 3, 44, 2, 9], list(range(20, 41))]
    out = {}
    for size in (1, tp):
        with ge.Generator.from_pretrained(path, model_class=lm.DecoderLM, linear_layer=gdn.GatedDeltaNet,
                                          moe_layer=fast_moe.MoE, tensor_parallel_size=size, page_size=8) as g:
            done = g.generate([ge.Request(p, ge.SamplingParams(max_new_tokens=8)) for p in prompts])
            out[size] = dict(tokens=[c.token_ids for c in done], logprobs=[c.logprobs for c in done])
        out[size]["threads_after_close"] = engine_threads()
    return out


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "trainer":
        result = trainer(args[0], args[1], [int(a) for a in args[2:]])
    elif command in ("engine", "engine-compiled", "engine-speculative"):
        result = engine(args[0], args[1], [int(a) for a in args[2:]], compiled=command == "engine-compiled",
                        speculative=command == "engine-speculative")
    elif command == "faults":
        result = faults()
    else:
        result = checkpoint(args[0], int(args[1]))
    print("FACTS " + json.dumps(result, default=str), flush=True)
    # (and the interpreter's own teardown: rank 0's process group and store are destroyed there, so a crash in
    # it fails the test; a generator's close() joins its threads first, ``engine_threads``)
