"""Routed generator benchmark: the router's cost and its scheduling quality, on the CPU by design.

The router is host code, so every number here is meaningful on a CPU (recorded rows are committed).
Generators are simulated engines (no model): ``SimEngine`` has ``lanes`` parallel lanes and draws
each request's latency from a long-tailed log-normal, driven by one shared clock thread.

Cases
    overhead n=N policy       router overhead per request: time to submit a batch and collect
                              every result through the router, minus the same requests sent to
                              the generators directly, divided by the batch.  The generator is
                              "instant" (its future is done when submit returns), so all the work
                              happens in the benchmark thread: ``overhead_cpu`` is that thread's
                              CPU time (robust on a shared machine), ``overhead_wall`` wall time;
                              best of several interleaved repetitions.  Target for fast: < 50 us.
    overhead_queued n=8 ...   the same with max_inflight=4 and a deep router queue (held futures
                              released one by one): the queue and re-dispatch path.
    throughput n=N            a closed loop keeping 2x the fleet's lanes outstanding through N
                              SimEngines (4 lanes, median 100 ms, sigma 0.8), least_loaded with
                              max_inflight=4 (so requests wait in the router queue): requests/s,
                              its fraction of the engines' capacity (lanes / mean latency), p99
                              latency.  Near 100% means the router is not the bottleneck.
    policy=P                  a batch submitted at once to 8 engines (4 lanes, median 20 ms), one
                              4x slower: makespan, p50 / p99 latency, share sent to the slow one.
    staleness mode=M          a closed-loop stream while the trainer publishes a version every
                              50 ms (loads take 20 ms): span = max - min policy version of a
                              completion, lag = trainer's newest version at finish - min version,
                              throughput and p99 latency.


Engine cases (part 2: the real ``Generator``s serving ``DecoderLM``; greedy, no stop tokens, so every
request generates exactly ``out`` tokens; a batch of B requests submitted at once, timed from the
first submit to the last completion, prefill included)
    engine <dev> b=B p=P o=O  generated tokens/s of ref (one request at a time), fast with its in-file
                              PyTorch attention (``fast[torch-attn]``) and, on a GPU, fast with this
                              repo's varlen_attn + flash_decode plugged in (``fast[repo-kernels]``),
                              and fast's speedup over ref.  CPU: a 4M-parameter model, batch 1..32
                              (these rows are CPU-meaningful: they measure the engines' batching, not
                              a kernel).  GPU: a 0.1B model, batch 1..256, prompt/output 128..2048;
                              ref only where its serial run stays short (b <= 8, and b = 64 at 128/128).
    sync <model> b=B          weight-sync pause with B requests decoding: ``step_ms`` (median gap
                              between decode steps), hot swap ``stall_ms`` (longest step gap while
                              load_weights runs, minus step_ms; target: < one step) and ``load_ms``
                              (load_weights wall time, spent off the engine thread), drain
                              ``drain_ms`` (in-flight requests finishing) and ``pause_ms`` (drain +
                              load: how long a new request waits).  CPU: a 4M model; GPU: 0.1B..1B.  The
                              shadow weights are allocated by a first load before timing.

Fleet cases (the generators as Ray actors, ``fast/routed_generator.py``'s ``ray_generators``, on a
local Ray instance bound to 127.0.0.1; the same 4M model, engines with one intra-op thread each)
    ray tokens n=N            tokens/s of a batch of 32 requests (prompt 64, 32 new tokens) through
                              the router over N engines, in this process (``inproc``) and as Ray
                              actors (``ray``), N = 1, 2, 4: what the actor hop costs, and whether
                              the fleet scales on this machine's cores.
    ray sync n=N              ``sync_weights`` wall time, hot swap with an idle fleet (``sync_ms``),
                              and a drain with a batch in flight (``drain_sync_ms``: the in-flight
                              requests finish, then every engine loads).
    ray restart n=2           an actor's process SIGKILLed under steady traffic: ``restart_s`` from the
                              kill until that actor is back in rotation at the current version (Ray
                              restarts it, the router re-syncs it, a probe served by the new process
                              closes its breaker).

Batch-invariant mode (part 4: what a ``Generator`` serving ``DecoderLM(batch_invariant=True)`` costs; on a CPU
its attention kernels run under the Triton interpreter, set before they are defined, so these rows measure the
interpreter)
    invariant engine <dev> b=B  generated tokens/s of the fast engine with this repo's varlen_attn +
                              flash_decode, mode off (``default``) and on (``batch_invariant``), and
                              the mode's ``slowdown`` (default / invariant); ``default[torch-attn]``: the
                              engine's in-file PyTorch attention (what a CPU runs without the mode).
                              A 2-layer attention model; ``hybrid`` rows: Gated DeltaNet + attention
                              (fast/gated_deltanet.py's kernels; the mode runs their chunk form in every
                              phase, sequences past a 64-token chunk).
    invariant trainer <dev> n=N forward + backward of ``DecoderLM`` over N packed sequences with the same
                              varlen_attn, mode off (``forward`` + cross-entropy) and on
                              (``token_logprobs``): ms per step and the ``slowdown``; ``default[sdpa]``:
                              the forward's in-file attention (SDPA, block-diagonal mask).
    invariant linear <dev> m=M  the mode's matmul alone, x [M, K] @ W^T (K = N = 256 on CPU): F.linear
                              vs the invariant product, us per call (no interpreter in these rows).

    python bench/routed_generator.py                  # all cases; rows to bench/results/latest/ (untracked)
    python bench/routed_generator.py --record         # ... and appended to bench/results/routed_generator.csv
    python bench/routed_generator.py --quick          # fewer repetitions
    python bench/routed_generator.py --part fleet     # router | engine | fleet | invariant | grpo
"""
from __future__ import annotations

import functools
import gc
import math
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if not torch.cuda.is_available():  # the batch-invariant rows' attention kernels: interpreted on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.harness import ON_GPU, Recorder, bench_parser, optional_import  # noqa: E402
import fast.decoder_lm as fast_lm  # noqa: E402
import fast.generator_engine as fast_ge  # noqa: E402
import fast.routed_generator as fast_rg  # noqa: E402
import ref.decoder_lm as ref_lm  # noqa: E402
import ref.generator_engine as ref_ge  # noqa: E402
import ref.routed_generator as ref_rg  # noqa: E402
from parity.fleet_sim import Clock  # noqa: E402

IMPLS = {"ref": ref_rg, "fast": fast_rg}


# ----------------------------------------------------------------------------- simulated generators

class InstantGen:
    """A generator whose future is already done when ``submit`` returns."""

    def __init__(self, rg, name):
        self.rg, self.name, self.policy_version = rg, name, 0

    def submit(self, request):
        fut = Future()
        fut.set_result(self.completion(request))
        return fut

    def completion(self, request):  # (the direct baseline builds the same object: it is not router cost)
        return self.rg.Completion(request.request_id, request.prompt_token_ids, [0], [0.0], "length", self.name,
                                  self.policy_version, self.policy_version)

    def load_weights(self, state_dict, version):
        self.policy_version = version


class HoldGen(InstantGen):
    """Futures held until ``release_all``: builds a deep router queue."""

    def __init__(self, rg, name):
        super().__init__(rg, name)
        self.held = deque()

    def submit(self, request):
        fut = Future()
        self.held.append((fut, self.completion(request)))
        return fut


class SimEngine:
    """``lanes`` parallel lanes, FIFO beyond them; latency ~ slow * min(lognormal(median, sigma), 10 median).

    In-flight weight loads (hot swap): ``load_weights`` takes ``load_time`` and switches the
    version at its end; requests running across the switch finish with the new version."""

    def __init__(self, rg, name, clock, *, lanes=8, median_s=0.002, sigma=0.8, slow=1.0, load_time=0.0, seed=0):
        self.rg, self.name, self.clock = rg, name, clock
        self.lanes, self.mu, self.sigma, self.slow, self.load_time = lanes, math.log(median_s), sigma, slow, load_time
        self.rng = random.Random(seed)
        self.policy_version = 0
        self.lock = threading.Lock()
        self.busy, self.waiting = 0, deque()
        self.served = 0

    def _latency(self):
        return self.slow * min(self.rng.lognormvariate(self.mu, self.sigma), 10 * math.exp(self.mu))

    def submit(self, request):
        fut = Future()
        with self.lock:
            job = (request, fut, self.policy_version)
            start = self.busy < self.lanes
            if start:
                self.busy += 1
                delay = self._latency()
            else:
                self.waiting.append(job)
        if start:
            self.clock.call_later(delay, lambda: self._finish(job))
        return fut

    def _finish(self, job):
        request, fut, v0 = job
        with self.lock:
            nxt = self.waiting.popleft() if self.waiting else None
            if nxt is None:
                self.busy -= 1
            else:
                delay = self._latency()
            self.served += 1
            v1 = self.policy_version
        if nxt is not None:
            self.clock.call_later(delay, lambda: self._finish(nxt))
        fut.set_result(self.rg.Completion(request.request_id, request.prompt_token_ids, [0], [0.0], "length",
                                          self.name, v0, v1))

    def load_weights(self, state_dict, version):
        if self.load_time:
            time.sleep(self.load_time)  # the transfer; the engine keeps decoding meanwhile
        self.policy_version = version


# ----------------------------------------------------------------------------- measurements

def _best_of(fns, reps):
    """Best (cpu_us, wall_us) per callable, repetitions interleaved so drift hits all alike.  The
    cyclic garbage collector is off while a repetition runs (as timeit does): a collection landing
    in one costs ~50 us per request here, and says nothing about the router."""
    best = [[math.inf, math.inf] for _ in fns]
    for _ in range(reps):
        for k, (fn, batch) in enumerate(fns):
            gc.collect()
            gc.disable()
            try:
                c0, w0 = time.thread_time(), time.perf_counter()
                fn()
                c1, w1 = time.thread_time(), time.perf_counter()
            finally:
                gc.enable()
            best[k][0] = min(best[k][0], (c1 - c0) / batch * 1e6)
            best[k][1] = min(best[k][1], (w1 - w0) / batch * 1e6)
    return best


def bench_overhead(rec, reps, batch=2000):
    for n in (1, 8, 64, 512):
        direct_gens = [InstantGen(ref_rg, f"g{i}") for i in range(n)]
        direct_reqs = [ref_rg.Request([1, 2, 3]) for _ in range(batch)]

        def direct():
            futs = [direct_gens[i % n].submit(r) for i, r in enumerate(direct_reqs)]
            for f in futs:
                f.result()
        for policy in ("least_loaded", "round_robin", "power_of_two", "sticky"):
            fns = [(direct, batch)]
            for rg in IMPLS.values():
                router = rg.GeneratorRouter([InstantGen(rg, f"g{i}") for i in range(n)], policy=policy, seed=0)
                reqs = [rg.Request([1, 2, 3], session_id=i % 1024) for i in range(batch)]

                def routed(router=router, reqs=reqs):
                    futs = [router.submit(r) for r in reqs]
                    for f in futs:
                        f.result()
                fns.append((routed, batch))
            (d_cpu, d_wall), *rows = _best_of(fns, reps)
            for impl, (cpu, wall) in zip(IMPLS, rows):
                rec.add(f"overhead n={n} {policy}", impl, "overhead_cpu", cpu - d_cpu, "us/req")
                rec.add(f"overhead n={n} {policy}", impl, "overhead_wall", wall - d_wall, "us/req")


def bench_overhead_queued(rec, reps, batch=2000, n=8, cap=4):
    maker = InstantGen(ref_rg, "direct")
    reqs = [ref_rg.Request([1, 2, 3], request_id=str(i)) for i in range(batch)]

    def direct():
        futs = [Future() for _ in range(batch)]
        for f, r in zip(futs, reqs):
            f.set_result(maker.completion(r))
        for f in futs:
            f.result()
    fns = [(direct, batch)]
    for rg in IMPLS.values():
        def routed(rg=rg):
            gens = [HoldGen(rg, f"g{i}") for i in range(n)]
            router = rg.GeneratorRouter(gens, policy="least_loaded", max_inflight=cap)
            futs = [router.submit(rg.Request([1, 2, 3], request_id=str(i))) for i in range(batch)]
            while router.queued or any(g.held for g in gens):
                for g in gens:  # release one per engine per round: each release re-dispatches
                    if g.held:
                        fut, completion = g.held.popleft()
                        fut.set_result(completion)
            for f in futs:
                f.result()
        fns.append((routed, batch))
    (d_cpu, d_wall), *rows = _best_of(fns, reps)
    for impl, (cpu, wall) in zip(IMPLS, rows):
        rec.add(f"overhead_queued n={n} cap={cap}", impl, "overhead_cpu", cpu - d_cpu, "us/req")
        rec.add(f"overhead_queued n={n} cap={cap}", impl, "overhead_wall", wall - d_wall, "us/req")


def _run_batch(router, rg, n_req, sessions=None, rng=None):
    """Submit a batch, wait for all; returns (makespan s, latencies s)."""
    lat = [0.0] * n_req
    done = threading.Event()
    left = [n_req]
    lock = threading.Lock()

    def finished(i, t0):
        def cb(fut):
            lat[i] = time.perf_counter() - t0
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return cb
    start = time.perf_counter()
    for i in range(n_req):
        sid = rng.randrange(sessions) if sessions else None
        t0 = time.perf_counter()
        router.submit(rg.Request([1, 2, 3], session_id=sid)).add_done_callback(finished(i, t0))
    assert done.wait(120), "benchmark batch did not finish"
    return time.perf_counter() - start, lat


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _closed_loop(router, rg, window, duration, warmup, on_done=None):
    """Keep ``window`` requests outstanding for ``warmup + duration`` s; count what finishes in the
    last ``duration`` s.  Returns (requests/s, latencies of those requests in s)."""
    slots = threading.Semaphore(window)
    lat = []
    t_start = time.perf_counter()
    t_measure, t_end = t_start + warmup, t_start + warmup + duration

    def done(t0):
        def cb(fut):
            fut.result()
            if on_done is not None:
                on_done(fut)
            t1 = time.perf_counter()
            if t_measure <= t1 <= t_end:
                lat.append(t1 - t0)
            slots.release()
        return cb
    while time.perf_counter() < t_end:
        if not slots.acquire(timeout=0.05):
            continue
        router.submit(rg.Request([1, 2, 3])).add_done_callback(done(time.perf_counter()))
    for _ in range(window):  # let the tail finish before the next case
        assert slots.acquire(timeout=60), "benchmark requests did not finish"
    return len(lat) / duration, lat


def bench_throughput(rec, quick):
    """Closed loop with twice the fleet's lanes outstanding: requests wait in the router queue
    and are dispatched as lanes free up.  Engines: 4 lanes, median 100 ms, sigma 0.8."""
    clock = Clock()
    lanes, median, sigma = 4, 0.100, 0.8
    draw = random.Random(0)  # the mean of the truncated log-normal the engines draw from
    mean = statistics.fmean(min(draw.lognormvariate(math.log(median), sigma), 10 * median) for _ in range(200_000))
    duration = 0.8 if quick else 2.0
    try:
        for n in (1, 2, 4, 8, 16, 32, 64):
            capacity = n * lanes / mean
            for impl, rg in IMPLS.items():
                gens = [SimEngine(rg, f"g{i}", clock, lanes=lanes, median_s=median, sigma=sigma, seed=i)
                        for i in range(n)]
                router = rg.GeneratorRouter(gens, policy="least_loaded", max_inflight=lanes)
                rate, lat = _closed_loop(router, rg, 2 * n * lanes, duration, warmup=0.5)
                case = f"throughput n={n}"
                rec.add(case, impl, "throughput", rate, "req/s")
                rec.add(case, impl, "of_capacity", 100.0 * rate / capacity, "%")
                rec.add(case, impl, "p99_latency", _pct(lat, 0.99) * 1e3, "ms")
    finally:
        clock.close()


def bench_policies(rec, quick):
    """A batch submitted at once to 8 engines (4 lanes, median 20 ms, sigma 0.8), engine 0 4x slower."""
    clock = Clock()
    n_req = 600 if quick else 2000
    try:
        for policy, cap in (("round_robin", None), ("least_loaded", None), ("round_robin", 4), ("least_loaded", 4),
                            ("power_of_two", 4), ("sticky", 4)):
            gens = [SimEngine(fast_rg, f"g{i}", clock, lanes=4, median_s=0.020, sigma=0.8,
                              slow=4.0 if i == 0 else 1.0, seed=i) for i in range(8)]
            router = fast_rg.GeneratorRouter(gens, policy=policy, max_inflight=cap, seed=0)
            makespan, lat = _run_batch(router, fast_rg, n_req, sessions=64, rng=random.Random(0))
            case = f"policy={policy} cap={cap}"
            rec.add(case, "fast", "makespan", makespan * 1e3, "ms")
            rec.add(case, "fast", "p50_latency", _pct(lat, 0.5) * 1e3, "ms")
            rec.add(case, "fast", "p99_latency", _pct(lat, 0.99) * 1e3, "ms")
            rec.add(case, "fast", "slow_engine_share", 100.0 * gens[0].served / n_req, "%")
    finally:
        clock.close()


def bench_staleness(rec, quick):
    """A closed-loop stream (64 outstanding) over 4 engines (4 lanes, median 10 ms) while the trainer
    publishes a new version every 50 ms and each load takes 20 ms.  span = max - min version of a
    completion; lag = the trainer's newest version when it finished - its min version."""
    clock = Clock()
    duration = 1.0 if quick else 3.0
    try:
        for mode in ("hot_swap", "drain"):
            gens = [SimEngine(fast_rg, f"g{i}", clock, lanes=4, median_s=0.010, sigma=0.8, load_time=0.020, seed=i)
                    for i in range(4)]
            router = fast_rg.GeneratorRouter(gens, policy="least_loaded", max_inflight=8)
            stop = threading.Event()
            trainer_version = [0]

            def trainer():
                while not stop.wait(0.050):  # a training step, then publish
                    trainer_version[0] += 1
                    router.sync_weights({}, trainer_version[0], mode=mode)
            t = threading.Thread(target=trainer)
            completions = []

            def on_done(fut):
                c = fut.result()
                completions.append((c.min_policy_version, c.max_policy_version, trainer_version[0]))
            t.start()
            rate, lat = _closed_loop(router, fast_rg, 64, duration, warmup=0.3, on_done=on_done)
            stop.set()
            t.join()
            spans = [hi - lo for lo, hi, _ in completions]
            lags = [tv - lo for lo, _, tv in completions]
            case = f"staleness mode={mode}"
            rec.add(case, "fast", "syncs", trainer_version[0], "")
            rec.add(case, "fast", "span_mean", statistics.fmean(spans), "versions")
            rec.add(case, "fast", "span_max", max(spans), "versions")
            rec.add(case, "fast", "spanning_share", 100.0 * sum(x > 0 for x in spans) / len(spans), "%")
            rec.add(case, "fast", "lag_mean", statistics.fmean(lags), "versions")
            rec.add(case, "fast", "lag_max", max(lags), "versions")
            rec.add(case, "fast", "throughput", rate, "req/s")
            rec.add(case, "fast", "p99_latency", _pct(lat, 0.99) * 1e3, "ms")
    finally:
        clock.close()


# ----------------------------------------------------------------------------- the engines

CPU_MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=2,
                 head_dim=32, max_seq_len=512, tie_embeddings=False)
GPU_MODELS = {  # non-embedding + embedding parameters, untied
    "0.1B": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                 num_kv_heads=4, head_dim=64, max_seq_len=4352, tie_embeddings=False),
    "0.5B": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_layers=16, num_heads=12,
                 num_kv_heads=4, head_dim=128, max_seq_len=4352, tie_embeddings=False),
    "1B": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=20, num_heads=16,
               num_kv_heads=4, head_dim=128, max_seq_len=4352, tie_embeddings=False),
}


GPU_DEVICE, GPU_DTYPE = "cuda", torch.bfloat16


def _n_params(model) -> float:
    return sum(p.numel() for p in model.parameters())


def _engine_requests(rg, batch, prompt_len, out_len, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [rg.Request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
                       rg.SamplingParams(max_new_tokens=out_len)) for _ in range(batch)]


def _tokens_per_s(gen, rg, batch, prompt_len, out_len, vocab) -> float:
    gen.generate(_engine_requests(rg, min(batch, 4), prompt_len, 4, vocab, seed=1))  # warm-up
    reqs = _engine_requests(rg, batch, prompt_len, out_len, vocab)
    t0 = time.perf_counter()
    outs = gen.generate(reqs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sum(len(c.token_ids) for c in outs) / (time.perf_counter() - t0)


def _repo_kernels() -> dict:
    """This repo's fast attention, when importable (flash_decoding lands separately)."""
    kernels = {}
    pva = optional_import("fast.paged_varlen_attention")
    fd = optional_import("fast.flash_decoding")
    if pva is not None:
        kernels["varlen_attn"] = pva.varlen_attn
    if fd is not None:
        kernels["flash_decode"] = fd.flash_decode
    return kernels


def bench_engine(rec, quick):
    if ON_GPU:
        cfg, dev, dtype = GPU_MODELS["0.1B"], GPU_DEVICE, GPU_DTYPE
        shapes = [(128, 128), (512, 512), (2048, 2048)] if not quick else [(128, 128)]
        batches = [1, 8, 64, 256] if not quick else [1, 64]
    else:
        cfg, dev, dtype = CPU_MODEL, "cpu", torch.float32
        shapes = [(64, 32)]
        batches = [1, 8, 32] if not quick else [1, 8]
    kernels = _repo_kernels() if ON_GPU else {}
    label = "gpu" if ON_GPU else "cpu"
    for prompt_len, out_len in shapes:
        for batch in batches:
            case = f"engine {label} b={batch} p={prompt_len} o={out_len}"
            pages = -(-(batch * (prompt_len + out_len)) // 16) + 64
            rates = {}
            run_ref = batch <= 8 or (batch == 64 and prompt_len == 128) if ON_GPU else True
            if run_ref:
                with ref_ge.Generator(ref_lm.DecoderLM(ref_lm.ModelConfig(**cfg), device=dev, dtype=dtype)) as g:
                    rates["ref"] = _tokens_per_s(g, ref_ge, batch, prompt_len, out_len, cfg["vocab_size"])
            variants = [("fast[torch-attn]", {})]
            if ON_GPU:
                if len(kernels) == 2:
                    variants.append(("fast[repo-kernels]", kernels))
                else:
                    rec.missing(case, "fast[repo-kernels]", "fast.flash_decoding or fast.paged_varlen_attention "
                                                            "not importable")
            for impl, plug in variants:
                model = fast_lm.DecoderLM(fast_lm.ModelConfig(**cfg), device=dev, dtype=dtype)
                with fast_ge.Generator(model, num_pages=pages, max_batch_size=max(batch, 4), **plug) as g:
                    rates[impl] = _tokens_per_s(g, fast_ge, batch, prompt_len, out_len, cfg["vocab_size"])
            for impl, rate in rates.items():
                rec.add(case, impl, "tokens_per_s", rate, "tok/s")
                if impl != "ref" and "ref" in rates:
                    rec.add(case, impl, "speedup_vs_ref", rate / rates["ref"], "x")


class _StepClock:
    """The in-file decode attention, noting when each decode step starts (its first layer's call)."""

    def __init__(self, layers):
        self.layers, self.calls, self.starts = layers, 0, []

    def __call__(self, *args, **kwargs):
        if self.calls % self.layers == 0:
            self.starts.append(time.perf_counter())
        self.calls += 1
        return fast_ge._torch_flash_decode(*args, **kwargs)


def bench_sync(rec, quick):
    if ON_GPU:
        models = [(name, cfg) for name, cfg in GPU_MODELS.items()]
        dev, dtype, batch, out_len = GPU_DEVICE, GPU_DTYPE, 32, 512
    else:
        models = [("4M", CPU_MODEL)]
        dev, dtype, batch, out_len = "cpu", torch.float32, 16, 96
    if quick:
        models = models[:1]
    for name, cfg in models:
        config = fast_lm.ModelConfig(**cfg)
        clock = _StepClock(config.num_layers)
        case = f"sync {name} b={batch}"
        with fast_ge.Generator(fast_lm.DecoderLM(config, device=dev, dtype=dtype), flash_decode=clock,
                               num_pages=batch * (-(-(128 + out_len) // 16)) + 64) as gen:
            new = {k: v.clone()
                   for k, v in fast_lm.DecoderLM(config, seed=1, device=dev, dtype=dtype).state_dict().items()}
            rec.add(case, "fast", "params", _n_params(gen.model) / 1e6, "M")
            gen.load_weights(new, 0)  # allocates the shadow weights (once per engine), outside the timing
            futures = [gen.submit(r) for r in _engine_requests(fast_ge, batch, 128, out_len, config.vocab_size)]
            while len(clock.starts) < out_len // 4:  # steady decoding
                time.sleep(0.001)
            t0 = time.perf_counter()
            gen.load_weights(new, 1)  # hot swap: decoding goes on
            t1 = time.perf_counter()
            while len(clock.starts) < out_len // 2:
                time.sleep(0.001)
            gaps = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
            step = statistics.median(gaps[: out_len // 4])
            during = [b - a for a, b in zip(clock.starts, clock.starts[1:]) if b >= t0 and a <= t1]
            rec.add(case, "fast", "step_ms", step * 1e3, "ms")
            rec.add(case, "fast", "hot_swap_load_ms", (t1 - t0) * 1e3, "ms")
            rec.add(case, "fast", "hot_swap_stall_ms", (max(during, default=step) - step) * 1e3, "ms")
            t2 = time.perf_counter()  # drain: the in-flight requests finish (about half their tokens left), then load
            for f in futures:
                f.result()
            t3 = time.perf_counter()
            gen.load_weights(new, 2)
            t4 = time.perf_counter()
            rec.add(case, "fast", "drain_ms", (t3 - t2) * 1e3, "ms")
            rec.add(case, "fast", "drain_load_ms", (t4 - t3) * 1e3, "ms")
            rec.add(case, "fast", "drain_pause_ms", (t4 - t2) * 1e3, "ms")


# ----------------------------------------------------------------------------- the fleet on Ray

def _fleet_engine():
    """What each actor (and each in-process engine) builds: the CPU model, one intra-op thread."""
    torch.set_num_threads(1)
    return fast_ge.Generator(fast_lm.DecoderLM(fast_lm.ModelConfig(**CPU_MODEL), seed=0), num_pages=512,
                             max_batch_size=32)


def _fleet_batch(tag, n=32, prompt_len=64, out_len=32):
    gen = torch.Generator().manual_seed(0)
    return [fast_rg.Request(torch.randint(0, CPU_MODEL["vocab_size"], (prompt_len,), generator=gen).tolist(),
                            fast_rg.SamplingParams(max_new_tokens=out_len), request_id=f"{tag}-{i}") for i in range(n)]


def _fleet_tokens_per_s(router, tag) -> float:
    router.generate(_fleet_batch(f"{tag}-warm", n=4, out_len=4))
    t0 = time.perf_counter()
    outs = router.generate(_fleet_batch(tag))
    return sum(len(c.token_ids) for c in outs) / (time.perf_counter() - t0)


def bench_fleet(rec, quick):
    import ray
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR",
             log_to_driver=False, _node_ip_address="127.0.0.1")
    trained = fast_lm.DecoderLM(fast_lm.ModelConfig(**CPU_MODEL), seed=1)
    weights = {k: v.clone() for k, v in trained.state_dict().items()}
    try:
        for n in ((1, 2) if quick else (1, 2, 4)):
            local = [_fleet_engine() for _ in range(n)]
            for i, g in enumerate(local):
                g.name = f"local{i}"
            actors = fast_rg.ray_generators(_fleet_engine, n, num_cpus=0, name_prefix=f"n{n}-")
            for kind, gens in (("inproc", local), ("ray", actors)):
                router = fast_rg.GeneratorRouter(gens, policy="least_loaded")
                rec.add(f"ray tokens n={n}", kind, "tokens_per_s", _fleet_tokens_per_s(router, f"{kind}{n}"), "tok/s")
                t0 = time.perf_counter()
                router.sync_weights(weights, 1, mode="hot_swap")
                rec.add(f"ray sync n={n}", kind, "sync_ms", (time.perf_counter() - t0) * 1e3, "ms")
                inflight = [router.submit(r) for r in _fleet_batch(f"drain{kind}{n}")]
                t0 = time.perf_counter()
                router.sync_weights(weights, 2, mode="drain")
                rec.add(f"ray sync n={n}", kind, "drain_sync_ms", (time.perf_counter() - t0) * 1e3, "ms")
                [f.result() for f in inflight]
                router.close()
            for g in local:
                g.close()
            for g in actors:
                g.close()
        rec.add("ray restart n=2", "ray", "restart_s", _restart_time(weights), "s")
    finally:
        ray.shutdown()


def _restart_time(weights) -> float:
    """SIGKILL one of two actors under steady traffic; seconds until it is back in rotation at the current version."""
    gens = fast_rg.ray_generators(_fleet_engine, 2, num_cpus=0, name_prefix="restart-")
    router = fast_rg.GeneratorRouter(gens, policy="least_loaded", request_timeout_s=60.0)
    router.sync_weights(weights, 1)
    victim = gens[0]
    stop = threading.Event()

    def traffic():
        i = 0
        while not stop.is_set():
            router.generate(_fleet_batch(f"t{i}", n=4, out_len=8))
            i += 1
    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    time.sleep(1.0)
    t_kill = time.perf_counter()
    os.kill(victim.pid, signal.SIGKILL)
    deadline, back, opened = t_kill + 120, None, False
    while back is None and time.perf_counter() < deadline:  # out (opened), then closed again after its probe
        state = router.stats()[victim.name]["state"]
        opened |= state != "closed"
        if opened and state == "closed" and victim.policy_version == 1:
            back = time.perf_counter() - t_kill
        time.sleep(0.01)
    stop.set()
    t.join(60)
    events = [f"{e}" for _, g, e, _ in router.health_events() if g == victim.name]
    print(f"  (restart: {victim.name} events {events})")
    router.close()
    for g in gens:
        g.close()
    return float("nan") if back is None else back


# ----------------------------------------------------------------------------- the batch-invariant mode's cost

INVARIANT_CPU_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=32, max_seq_len=64, tie_embeddings=False)
# The hybrid rows: Gated DeltaNet "linear" layers (fast/gated_deltanet.py's kernels) beside attention; sequences
# past a 64-token chunk, so the mode's decode steps run their chunk so far and its prefill cuts chunks.
INVARIANT_CPU_HYBRID = dict(INVARIANT_CPU_MODEL, max_seq_len=160, layer_types=("linear", "attention"),
                            linear_num_k_heads=2, linear_num_v_heads=4, linear_head_k_dim=16, linear_head_v_dim=16)
INVARIANT_GPU_HYBRID = dict(GPU_MODELS["0.1B"], layer_types=("linear", "linear", "linear", "attention") * 3,
                            linear_num_k_heads=4, linear_num_v_heads=8, linear_head_k_dim=128, linear_head_v_dim=128)


def _time_ms(fn, reps) -> float:
    fn()                                                                # warm-up (and autotuning, off the clock)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def _gdn_layer():
    """The Qwen3.5 layer on fast/gated_deltanet.py's kernels (the interpreter on a CPU), or None."""
    ref_gdn, fast_gdn = optional_import("ref.gated_deltanet"), optional_import("fast.gated_deltanet")
    if ref_gdn is None or fast_gdn is None:
        return None
    return functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=fast_gdn.chunk_gated_delta_rule,
                             recurrent_fn=fast_gdn.fused_recurrent_gated_delta_rule)


def bench_invariant(rec, quick):
    kernels = _repo_kernels()
    if len(kernels) != 2:
        rec.missing("invariant", "batch_invariant", "fast.flash_decoding or fast.paged_varlen_attention not importable")
        return
    dev, dtype, label = (GPU_DEVICE, GPU_DTYPE, "gpu") if ON_GPU else ("cpu", torch.float32, "cpu")
    attention = GPU_MODELS["0.1B"] if ON_GPU else INVARIANT_CPU_MODEL
    # (kind, config, linear layer, engine prompt / completion lengths and batches, trainer sequences and length)
    kinds = [("", attention, None, (128, 128) if ON_GPU else (16, 16), [1, 64] if ON_GPU else [1, 8],
              (16, 256) if ON_GPU else (4, 24))]
    gdn = _gdn_layer()
    if gdn is None:
        rec.missing("invariant hybrid", "batch_invariant", "ref/fast gated_deltanet.py not importable")
    else:
        kinds.append(("hybrid ", INVARIANT_GPU_HYBRID if ON_GPU else INVARIANT_CPU_HYBRID, gdn,
                      (128, 128) if ON_GPU else (60, 16), [1, 64] if ON_GPU else [4], (16, 256) if ON_GPU else (4, 80)))
    for kind, cfg, linear_layer, (prompt_len, out_len), batches, (n, length) in kinds:
        model_kw = dict(device=dev, dtype=dtype, linear_layer=linear_layer)
        for batch in batches:
            case = f"invariant engine {label} {kind}b={batch} p={prompt_len} o={out_len}"
            rates = {}
            for impl, mode, plug in (("default[torch-attn]", False, {}), ("default", False, kernels),
                                     ("batch_invariant", True, kernels)):
                model = fast_lm.DecoderLM(fast_lm.ModelConfig(**cfg), batch_invariant=mode,
                                          varlen_attn=plug.get("varlen_attn"), **model_kw)
                with fast_ge.Generator(model, max_batch_size=max(batch, 4), flash_decode=plug.get("flash_decode"),
                                       num_pages=-(-(batch * (prompt_len + out_len)) // 16) + 16) as g:
                    rates[impl] = _tokens_per_s(g, fast_ge, batch, prompt_len, out_len, cfg["vocab_size"])
                rec.add(case, impl, "tokens_per_s", rates[impl], "tok/s")
            rec.add(case, "batch_invariant", "slowdown", rates["default"] / rates["batch_invariant"], "x")
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, cfg["vocab_size"], (length,), generator=gen).tolist() for _ in range(n)]
        case = f"invariant trainer {label} {kind}n={n} t={length}"
        times = {}
        for impl, mode, attn in (("default[sdpa]", False, None), ("default", False, kernels["varlen_attn"]),
                                 ("batch_invariant", True, kernels["varlen_attn"])):
            model = fast_lm.DecoderLM(fast_lm.ModelConfig(**cfg), batch_invariant=mode, varlen_attn=attn, **model_kw)

            def step():
                model.zero_grad(set_to_none=True)
                if mode:
                    loss = -torch.cat(model.token_logprobs(seqs, [1] * n)).sum()
                else:
                    ids = torch.tensor([t for s in seqs for t in s[:-1]], device=dev)[None]
                    cu = torch.arange(n + 1, dtype=torch.int32, device=dev) * (length - 1)
                    targets = torch.tensor([t for s in seqs for t in s[1:]], device=dev)
                    loss = torch.nn.functional.cross_entropy(model(ids, cu_seqlens=cu)[0], targets, reduction="sum")
                loss.backward()
            times[impl] = _time_ms(step, 2 if quick else 3)
            rec.add(case, impl, "fwd_bwd_ms", times[impl], "ms")
        rec.add(case, "batch_invariant", "slowdown", times["batch_invariant"] / times["default"], "x")
    k = 4096 if ON_GPU else 256
    w = torch.randn(k, k, device=dev, dtype=dtype)
    for m in ([1, 64, 4096] if ON_GPU else [1, 64, 1024]):
        x = torch.randn(m, k, device=dev, dtype=dtype)
        case = f"invariant linear {label} m={m} k={k} n={k}"
        base = _time_ms(lambda: torch.nn.functional.linear(x, w), 20)
        inv = _time_ms(lambda: fast_lm._invariant_linear(x, w), 20)
        rec.add(case, "F.linear", "us_per_call", 1e3 * base, "us")
        rec.add(case, "batch_invariant", "us_per_call", 1e3 * inv, "us")
        rec.add(case, "batch_invariant", "slowdown", inv / base, "x")


# ----------------------------------------------------------------------------- GRPO groups and the prefix cache

GRPO_CPU_MODEL = dict(CPU_MODEL, max_seq_len=1536)


def grpo_workload(rg, *, prompts, n, system, lengths, outs, vocab, groups, seed=0):
    """``prompts`` prompts of ``lengths`` tokens (a shared ``system``-token system prompt first), n samples
    each at temperature 1 (sample i seeded seed + i), ``outs`` new tokens (no stop token, so every run
    generates the same number).  ``groups``: one request with n samples per prompt, else n requests."""
    rng = random.Random(seed)
    head = [rng.randrange(vocab) for _ in range(system)]
    reqs = []
    for i in range(prompts):
        prompt = head + [rng.randrange(vocab) for _ in range(rng.randint(*lengths) - system)]
        out, base = rng.randint(*outs), 1000 * i
        if groups:
            reqs.append(rg.Request(prompt, rg.SamplingParams(max_new_tokens=out, temperature=1.0, seed=base, n=n)))
        else:
            reqs += [rg.Request(prompt, rg.SamplingParams(max_new_tokens=out, temperature=1.0, seed=base + j))
                     for j in range(n)]
    return reqs


def _served(results) -> int:
    return sum(len(c.token_ids) for r in results for c in (r if isinstance(r, list) else [r]))


def bench_grpo(rec, quick):
    """GRPO groups behind a shared system prompt: the fast engine with the prefix cache and groups against
    the same samples as n plain requests with the cache off (today's engine).  CPU, the 4-layer model."""
    cfg = fast_lm.ModelConfig(**GRPO_CPU_MODEL)
    shape = dict(prompts=8, n=4, system=128, lengths=(256, 512), outs=(16, 32)) if quick else \
        dict(prompts=32, n=8, system=128, lengths=(256, 1024), outs=(32, 128))
    case = f"grpo engine cpu {shape['prompts']}x{shape['n']} sys={shape['system']}"
    pages = shape["prompts"] * shape["n"] * -(-(shape["lengths"][1] + shape["outs"][1]) // 16) + 64
    for impl, groups, caching in (("cache+groups", True, True), ("no cache", False, False)):
        reqs = grpo_workload(fast_ge, vocab=cfg.vocab_size, groups=groups, **shape)
        with _PhaseClock(fast_lm.DecoderLM(cfg), num_pages=pages, max_batch_size=shape["prompts"] * shape["n"],
                         prefix_caching=caching) as gen:
            t0 = time.perf_counter()
            done = gen.generate(reqs)
            seconds = time.perf_counter() - t0
            stats = gen.stats()
        rec.add(case, impl, "prompt_tokens", stats["prompt_tokens"], "tok")
        rec.add(case, impl, "computed_prompt_tokens", stats["computed_prompt_tokens"], "tok")
        rec.add(case, impl, "computed_frac", stats["computed_prompt_tokens"] / stats["prompt_tokens"], "")
        rec.add(case, impl, "tokens_per_s", _served(done) / seconds, "tok/s")
        rec.add(case, impl, "prefill_s", gen.seconds["prefill"], "s")
        rec.add(case, impl, "decode_s", gen.seconds["decode"], "s")
        print(f"  {impl}: {stats['computed_prompt_tokens']} of {stats['prompt_tokens']} prompt tokens computed, "
              f"{_served(done) / seconds:.0f} generated tok/s; prefill {gen.seconds['prefill']:.1f} s, "
              f"decode {gen.seconds['decode']:.1f} s")


def bench_grpo_router(rec, quick):
    """The same GRPO samples as n ordinary requests (what many RL stacks send) through a router over two
    engines: prefix_affinity (a prompt's samples meet its pages on one engine) vs least_loaded.  Hit
    rate = prompt tokens skipped / prompt tokens requested, over both engines.  Completions of 8-16
    tokens (the hit rate depends on the prompts only)."""
    cfg = fast_lm.ModelConfig(**GRPO_CPU_MODEL)
    shape = dict(prompts=8, n=4, system=128, lengths=(256, 512), outs=(4, 8)) if quick else \
        dict(prompts=32, n=8, system=128, lengths=(256, 1024), outs=(8, 16))
    case = f"grpo router cpu 2 engines {shape['prompts']}x{shape['n']} sys={shape['system']}"
    pages = shape["prompts"] * shape["n"] * -(-(shape["lengths"][1] + shape["outs"][1]) // 16) + 64
    for policy in ("prefix_affinity", "least_loaded"):
        gens = [fast_ge.Generator(fast_lm.DecoderLM(cfg), name=f"e{i}", num_pages=pages,
                                  max_batch_size=shape["prompts"] * shape["n"]) for i in range(2)]
        router = fast_rg.GeneratorRouter(gens, policy=policy, affinity_slack=64)
        try:
            t0 = time.perf_counter()
            done = router.generate(grpo_workload(fast_rg, vocab=cfg.vocab_size, groups=False, **shape))
            seconds = time.perf_counter() - t0
            stats = [g.stats() for g in gens]
        finally:
            router.close()
            for g in gens:
                g.close()
        hits = sum(s["prefix_hit_tokens"] for s in stats) / sum(s["prompt_tokens"] for s in stats)
        rec.add(case, policy, "hit_rate", hits, "")
        rec.add(case, policy, "computed_prompt_tokens", sum(s["computed_prompt_tokens"] for s in stats), "tok")
        rec.add(case, policy, "tokens_per_s", _served(done) / seconds, "tok/s")
        print(f"  {policy}: hit rate {hits:.3f}, {_served(done) / seconds:.0f} generated tok/s")


def bench_grpo_trainer(rec, quick):
    """The trainer's recompute of the GRPO samples (token_logprobs, forward + backward, the 4-layer model
    on the CPU, its in-file attention): each prompt once (share_prompts=True) or every sequence whole.
    One call per group of n sequences (their packed attention mask stays small)."""
    cfg = fast_lm.ModelConfig(**GRPO_CPU_MODEL)
    shape = dict(prompts=4, n=4, system=128, lengths=(256, 512), outs=(16, 32)) if quick else \
        dict(prompts=32, n=8, system=128, lengths=(256, 1024), outs=(32, 128))
    case = f"grpo trainer cpu {shape['prompts']}x{shape['n']} sys={shape['system']}"
    model = fast_lm.DecoderLM(cfg, seed=0)
    rng = random.Random(1)
    groups = []
    for r in grpo_workload(fast_rg, vocab=cfg.vocab_size, groups=True, **shape):
        completions = [[rng.randrange(cfg.vocab_size) for _ in range(r.sampling.max_new_tokens)]
                       for _ in range(r.sampling.n)]
        groups.append(([r.prompt_token_ids + c for c in completions], [len(r.prompt_token_ids)] * r.sampling.n))
    for impl, share in (("shared prompts", True), ("whole sequences", False)):
        tokens = sum((len(seqs[0]) - 1 - p[0]) * len(seqs) + (p[0] if share else p[0] * len(seqs))
                     for seqs, p in groups)
        t0 = time.process_time()
        for seqs, prompts in groups:
            model.zero_grad(set_to_none=True)
            lps = model.token_logprobs(seqs, prompts, temperature=1.0, share_prompts=share)
            torch.stack([lp.sum() for lp in lps]).sum().backward()
        cpu_s = time.process_time() - t0
        rec.add(case, impl, "tokens_processed", tokens, "tok")
        rec.add(case, impl, "cpu_s", cpu_s, "s")
        print(f"  {impl}: {tokens} tokens through the model, {cpu_s:.1f} CPU-s forward + backward")


class _PhaseClock(fast_ge.Generator):
    """The fast engine, adding up the seconds its prefill passes and decode steps take."""

    def __init__(self, *args, **kw):
        self.seconds = dict(prefill=0.0, decode=0.0)
        super().__init__(*args, **kw)

    def _timed(self, phase, step, *args):
        t0 = time.perf_counter()
        try:
            return step(*args)
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def _prefill(self, model, work, settle):
        return self._timed("prefill", super()._prefill, model, work, settle)

    def _decode(self, model, seqs, settle):
        return self._timed("decode", super()._decode, model, seqs, settle)


class _DecodeClock(fast_ge.Generator):
    """The fast engine, noting when each decode step starts and which requests it decodes."""

    def __init__(self, *args, **kw):
        self.steps = []
        super().__init__(*args, **kw)

    def _decode(self, model, seqs, settle):
        self.steps.append((time.perf_counter(), [s.group.request.request_id for s in seqs]))
        return super()._decode(model, seqs, settle)


def bench_chunked_prefill(rec, quick):
    """A prompt of 8x the per-iteration budget arrives while a request decodes: the largest gap between
    two of that request's decode steps, the prompt cut into page-aligned chunks or taken whole."""
    cfg = fast_lm.ModelConfig(**dict(CPU_MODEL, max_seq_len=4608 if not quick else 1152))
    budget = 512 if not quick else 128
    rng = random.Random(3)
    case = f"chunked prefill cpu budget={budget} prompt={8 * budget}"
    for impl, limit in (("chunked", budget), ("whole prompt", 16 * budget)):
        running = fast_ge.Request([rng.randrange(cfg.vocab_size) for _ in range(16)],
                                  fast_ge.SamplingParams(max_new_tokens=400), request_id="running")
        long = fast_ge.Request([rng.randrange(cfg.vocab_size) for _ in range(8 * budget)],
                               fast_ge.SamplingParams(max_new_tokens=4), request_id="long")
        with _DecodeClock(fast_lm.DecoderLM(cfg), max_prefill_tokens=limit, num_pages=-(-9 * budget // 16) + 64) as gen:
            first = gen.submit(running)
            while len(gen.steps) < 20:
                time.sleep(0.001)
            gen.submit(long).result()
            first.result()
            times = [t for t, ids in gen.steps if "running" in ids]
        gaps = [1e3 * (b - a) for a, b in zip(times, times[1:])]
        rec.add(case, impl, "max_gap_ms", max(gaps), "ms")
        rec.add(case, impl, "median_gap_ms", statistics.median(gaps), "ms")
        print(f"  {impl}: largest gap between two decode steps {max(gaps):.1f} ms "
              f"(median {statistics.median(gaps):.1f} ms)")


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--part", choices=["all", "router", "engine", "fleet", "invariant", "grpo"], default="all")
    args = ap.parse_args(argv)
    rec = Recorder("routed_generator", record=args.record or None)
    reps = 3 if args.quick else 9
    if args.part in ("all", "router"):
        print("router overhead per request (instant generators; best of interleaved repetitions)")
        bench_overhead(rec, reps)
        bench_overhead_queued(rec, reps)
        print("throughput vs number of generators (simulated long-tail engines)")
        bench_throughput(rec, args.quick)
        print("makespan / p99 per policy (8 engines, one 4x slower)")
        bench_policies(rec, args.quick)
        print("staleness under hot_swap vs drain")
        bench_staleness(rec, args.quick)
    if args.part in ("all", "engine"):
        if not ON_GPU:
            # Engine threads on a small shared CPU: one intra-op thread each, or OpenMP teams collide.
            torch.set_num_threads(1)
            print("(no CUDA: engine rows on the CPU with a 4M model; the GPU grid and 0.1B..1B sync rows need CUDA)")
        print("engine tokens/s: ref vs fast")
        bench_engine(rec, args.quick)
        print("weight sync: hot swap vs drain")
        bench_sync(rec, args.quick)
    if args.part in ("all", "fleet"):
        if optional_import("ray") is None:
            rec.missing("ray fleet", "ray", "ray is not installed")
        else:
            torch.set_num_threads(1)
            print("the fleet on Ray (CPU, a local Ray instance) beside the same fleet in this process")
            bench_fleet(rec, args.quick)
    if args.part in ("all", "grpo"):
        torch.set_num_threads(1)
        print("GRPO groups and the prefix cache (CPU, the 4-layer model)")
        bench_grpo(rec, args.quick)
        print("chunked prefill: decode gaps while a long prompt arrives")
        bench_chunked_prefill(rec, args.quick)
        print("GRPO samples as plain requests through a router over two engines: prefix_affinity vs least_loaded")
        bench_grpo_router(rec, args.quick)
        print("the trainer's recompute: shared prompts vs whole sequences")
        bench_grpo_trainer(rec, args.quick)
    if args.part in ("all", "invariant"):
        torch.set_num_threads(1)
        print("the batch-invariant mode's cost: engine tokens/s, trainer forward + backward, the matmul alone")
        bench_invariant(rec, args.quick)
    if not args.no_save:
        rec.save()  # bench/results/latest/ always; the committed CSV only with --record / RECORD=1
    return 0


if __name__ == "__main__":
    sys.exit(main())
