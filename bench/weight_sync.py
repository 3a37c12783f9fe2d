"""Weight sync benchmark: the collective transport (fast/weight_sync.py) against the Ray object store and
against one raw broadcast of the same bytes, on the machine it runs on.

Every case runs its trainer and each receiving rank as processes of their own (spawned fresh for every
implementation, so one's memory does not flatter another's), all on this machine: gloo over loopback
here (no GPU: the NCCL path has not run), the object store through shared memory (one node; on a cluster
each other node gets its copy over the network).  Receivers hold their weights as plain tensors, in the
generator's dtype (bf16), allocated and touched before the clock starts.

Cases
    sync 1GB bf16 -> N x tp1           a 1 GiB bf16 state dict (64 tensors of 16 MiB) to N = 2, 4 generators
                                       of one rank each
    sync qwen3.5-0.8b fp32 -> N x tp1  Qwen3.5-0.8B's tensors (the text model: 24 layers, 18 Gated DeltaNet,
                                       tied embedding; 0.75 B parameters) as an fp32 master, to N = 2, 4
                                       generators holding bf16 (1.5 GB each): the cast is part of each sync
    sync qwen3.5-0.8b fp32 -> 2 x tp2  the same to two generators of two tensor-parallel ranks: each rank
                                       receives its shard (bytes_per_rank, beside full_bytes), not the model
    sync decode gap                    a generator (fp32, 8 layers, hidden 1024: 0.5 GB) decoding 8 requests
                                       while a sync of its weights streams in (receive_weights on its own
                                       thread, into the shadow): the largest gap between two decode steps
                                       during the sync, beside the median step and the largest before it
Implementations
    collective      WeightSender.send to every destination at once (each bucket packed once), one receiving
                    process per rank: slice, cast, checksum, gloo send; check, copy into the weights
    collective_per_destination  one send per destination, each in its own thread (what the router's
                    per-generator loads do: each destination's buckets packed for it)
    object_store    what ray_generators does without a transport: the state dict (cast to bf16 first, timed)
                    packed into one flat buffer, ray.put once, every actor ray.get's it (zero-copy on this
                    node) and copies it into its weights
    raw_broadcast   one gloo broadcast of one flat buffer of the bytes each generator needs (the wire's bound
                    on this machine: no packing, no cast, no checksum, no copy out)
Metrics
    seconds             wall time from the start of the sync to the last receiver done (median of reps)
    GB/s                bytes delivered to all receivers / seconds
    x_raw_broadcast     seconds / raw_broadcast's seconds on the same case (the target: <= 1.5)
    peak_extra_bytes    the largest extra memory on one side: the transport's staging buffers as it counts
                        them (collective: 0 when every bucket goes in place, from the trainer's tensor into
                        the generator's), the flat buffer by construction (raw_broadcast: on every side;
                        object_store: the packed copy); ``peak_extra_bytes_sender`` / ``_receiver`` per side;
                        ``rss_growth_*`` what each process's peak RSS grew by during the sync (measured: the
                        casts, the object store's copies, allocator slack)
    bucket_bytes        the collective's bucket size
    bytes_per_rank      what each receiving rank got (collective: its shard; the others: the full bytes)

    python bench/weight_sync.py              # all cases; rows to bench/results/latest/ (untracked)
    python bench/weight_sync.py --record     # ... and appended to bench/results/weight_sync.csv
    python bench/weight_sync.py --quick      # 64 MiB, a smaller Qwen-shaped model, 4 MiB buckets, one repetition
Memory: the full run holds up to ~12 GB at once (the Qwen-shaped fp32 master, four receivers' bf16 copies, the
object store's); --quick fits in 2 GB.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import Recorder, bench_parser, optional_import  # noqa: E402
import fast.weight_sync as ws  # noqa: E402

GiB = 1 << 30
BUCKET = ws.DEFAULT_BUCKET_BYTES


# ----------------------------------------------------------------------------- state dicts

def flat_state(total: int) -> dict:
    """``total`` bytes of bf16 in tensors of 16 MiB (fewer, smaller ones under --quick).  The values do not
    matter to a transport that never compresses: each tensor is filled with one number (cheap to make)."""
    per = min(16 << 20, total // 4)
    return {f"layer{i}.weight": torch.full((per // 2 // 2048, 2048), 0.01 * (i + 1), dtype=torch.bfloat16)
            for i in range(total // per)}


def qwen_config(quick: bool):
    import fast.decoder_lm as lm
    layers = 8 if quick else 24                        # [L, L, L, F] x 6 (x 2 under --quick)
    return lm.ModelConfig(vocab_size=248320 // (8 if quick else 1), hidden_size=1024, intermediate_size=3584,
                          num_layers=layers, num_heads=8, num_kv_heads=2, head_dim=256, tie_embeddings=True,
                          attn_output_gate=True, qk_norm=True, zero_centered_norm=True, partial_rotary_factor=0.25,
                          layer_types=("linear", "linear", "linear", "attention") * (layers // 4),
                          linear_num_k_heads=16, linear_num_v_heads=16, linear_head_k_dim=128, linear_head_v_dim=128,
                          linear_conv_kernel_size=4, weight_prefix="model.")


def qwen_state(quick: bool) -> dict:
    """Qwen3.5-0.8B-shaped fp32 tensors: the checkpoint's names and shapes, each filled with one number."""
    import fast.decoder_lm as lm
    import ref.gated_deltanet as gdn
    shapes = {n: tuple(t.shape) for n, t in
              lm.DecoderLM(qwen_config(quick), device="meta", linear_layer=gdn.GatedDeltaNet).state_dict().items()
              if n != "lm_head.weight"}                 # tied: the embedding
    return {n: torch.full(s, 0.001 * (i + 1)) for i, (n, s) in enumerate(shapes.items())}


def make_state(kind: str, quick: bool) -> dict:
    return flat_state(64 << 20 if quick else GiB) if kind == "flat" else qwen_state(quick)


def layouts(kind: str, state: dict, quick: bool, tp: int):
    source = ws.layout(state)
    if tp == 1:
        return source, ws.layout(state, dtype=torch.bfloat16)
    import fast.decoder_lm as lm
    spec = functools.partial(lm.shard_spec, c=qwen_config(quick))
    return source, ws.layout(state, dtype=torch.bfloat16, tp=tp, shard_spec=spec)


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------- receiving processes

def _receiver(impl: str, setup, rank: int, size: int, pipe) -> None:
    """One receiving rank: its weights allocated and touched, then each sync on command; answers
    (seconds since the go signal's timestamp, rss growth, transport's staging bytes)."""
    torch.set_num_threads(1)
    try:
        if impl.startswith("collective"):
            recipe, layout_dict = setup
            tensors = ws.allocate(layout_dict, rank)
            for t in tensors.values():
                t.zero_()
            endpoint = recipe.connect(rank, size, tensors)
            pipe.send(("ready", None))
            endpoint.receive(None, pipe.recv(), None)              # channels formed before any timing
            pipe.send(("ready", None))
            while True:
                message = pipe.recv()
                if message is None:
                    return
                base = _rss()
                endpoint.receive(message[0], message[1], tensors)
                pipe.send(("done", (time.time(), _rss() - base, endpoint.peak_buffer_bytes)))
        else:                                                      # raw_broadcast
            import torch.distributed as dist
            address, port, world, nbytes = setup
            store = dist.TCPStore(address, port, world, False)
            group = dist.ProcessGroupGloo(store, rank, world, _gloo_options(address))
            flat = torch.zeros(nbytes, dtype=torch.uint8)
            pipe.send(("ready", None))
            while True:
                if pipe.recv() is None:
                    return
                base = _rss()
                group.broadcast(flat, 0).wait()
                pipe.send(("done", (time.time(), _rss() - base, 0)))
    except Exception as exc:  # noqa: BLE001 - reported to the trainer
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))


def _gloo_options(address: str):
    import datetime

    import torch.distributed as dist
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=600)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return options


def _spawn(impl: str, setup, rank: int, size: int):
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(impl, setup, rank, size, theirs), daemon=True)
    proc.start()
    return proc, mine


def _expect(pipe, what: str, timeout: float = 600):
    if not pipe.poll(timeout):
        raise RuntimeError(f"a receiver sent no {what!r} within {timeout} s")
    kind, detail = pipe.recv()
    if kind != what:
        raise RuntimeError(f"a receiver failed: {detail}")
    return detail


# ----------------------------------------------------------------------------- the implementations

def run_collective(kind: str, quick: bool, n: int, tp: int, reps: int, per_destination: bool) -> dict:
    state = make_state(kind, quick)
    source, dest = layouts(kind, state, quick, tp)
    sender = ws.WeightSender(source, destination=dest, timeout_s=600, bucket_bytes=(4 << 20) if quick else BUCKET)
    names = [f"g{i}" for i in range(n)]
    procs = [_spawn("collective", (sender.receiver(name), dest), r, tp) for name in names for r in range(tp)]
    for _, pipe in procs:
        _expect(pipe, "ready")
    for i, (_, pipe) in enumerate(procs):
        pipe.send(sender.header(names[i // tp], 0))
    failed: dict = {}
    sender._connect(names, failed)
    assert not failed, failed
    for _, pipe in procs:
        _expect(pipe, "ready")
    seconds, rss_send, rss_recv, staged = [], [], [], []
    for version in range(1, reps + 1):
        for i, (_, pipe) in enumerate(procs):
            pipe.send((version, sender.header(names[i // tp], version)))
        base, t0 = _rss(), time.time()
        if per_destination:
            threads = [threading.Thread(target=sender.send, args=(name, state, version)) for name in names]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            sender.send(names, state, version)
        rss_send.append(_rss() - base)
        done = [_expect(pipe, "done") for _, pipe in procs]
        seconds.append(max(d[0] for d in done) - t0)
        rss_recv.append(max(d[1] for d in done))
        staged.append(max(d[2] for d in done))
    for proc, pipe in procs:
        pipe.send(None)
        proc.join(30)
    p = sender._plan_of(names[0])
    return dict(seconds=statistics.median(seconds), delivered=sum(p.bytes_to(r) for r in range(tp)) * n,
                peak_extra_bytes_sender=sender.peak_buffer_bytes, peak_extra_bytes_receiver=max(staged),
                rss_growth_sender=max(rss_send), rss_growth_receiver=max(rss_recv), bucket_bytes=sender.bucket_bytes,
                bytes_per_rank=max(p.bytes_to(r) for r in range(tp)),
                full_bytes=sum(t.numel() for t in state.values()) * 2)


def run_raw_broadcast(kind: str, quick: bool, n: int, reps: int) -> dict:
    import torch.distributed as dist
    state = make_state(kind, quick)
    nbytes = sum(t.numel() for t in state.values()) * 2               # the bf16 bytes each generator needs
    del state
    address = "127.0.0.1"
    store = dist.TCPStore(address, 0, n + 1, True, wait_for_workers=False)
    procs = [_spawn("raw_broadcast", (address, store.port, n + 1, nbytes), r, n + 1) for r in range(1, n + 1)]
    group = dist.ProcessGroupGloo(store, 0, n + 1, _gloo_options(address))
    flat = torch.ones(nbytes, dtype=torch.uint8)
    for _, pipe in procs:
        _expect(pipe, "ready")
    seconds, rss_recv = [], []
    for _ in range(reps):
        for _, pipe in procs:
            pipe.send(True)
        t0 = time.time()
        group.broadcast(flat, 0).wait()
        done = [_expect(pipe, "done") for _, pipe in procs]
        seconds.append(max(d[0] for d in done) - t0)
        rss_recv.append(max(d[1] for d in done))
    for proc, pipe in procs:
        pipe.send(None)
        proc.join(30)
    return dict(seconds=statistics.median(seconds), delivered=nbytes * n, peak_extra_bytes_sender=nbytes,
                peak_extra_bytes_receiver=nbytes, rss_growth_receiver=max(rss_recv), bytes_per_rank=nbytes)


class _Holder:  # (defined at module level: Ray imports it by name in the actor's process)
    """A Ray actor holding a generator's weights (bf16), loading them as ray_generators' actors do."""

    def __init__(self, shapes: dict):
        torch.set_num_threads(1)
        self.tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}

    def load(self, packed) -> tuple:
        import fast.routed_generator as rg
        base = _rss()
        for name, t in rg._unpack_weights(packed).items():         # views of the shared-memory object
            self.tensors[name].copy_(t)
        return time.time(), _rss() - base


def run_object_store(kind: str, quick: bool, n: int, reps: int) -> dict:
    import ray

    import fast.routed_generator as rg
    state = make_state(kind, quick)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    nbytes = sum(t.numel() for t in state.values()) * 2
    temp_dir = tempfile.mkdtemp(prefix="rayb", dir="/tmp")
    root = str(Path(__file__).resolve().parents[1])
    ray.init(address="local", num_cpus=n + 1, include_dashboard=False, _temp_dir=temp_dir, logging_level="ERROR",
             log_to_driver=False, object_store_memory=max(2 * nbytes + (256 << 20), 512 << 20),
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    try:
        import importlib
        holder = ray.remote(importlib.import_module("bench.weight_sync")._Holder)   # by name, not __main__'s
        actors = [holder.options(num_cpus=1).remote(shapes) for _ in range(n)]
        ray.get([a.__ray_ready__.remote() for a in actors])
        seconds, rss_send, rss_recv = [], [], []
        for _ in range(reps):
            base, t0 = _rss(), time.time()
            bf16 = {name: t.to(torch.bfloat16) for name, t in state.items()}   # (a no-op for bf16 state dicts)
            ref = ray.put(rg._pack_weights(bf16))
            done = ray.get([a.load.remote(ref) for a in actors])
            rss_send.append(_rss() - base)
            seconds.append(max(d[0] for d in done) - t0)
            rss_recv.append(max(d[1] for d in done))
            del ref, bf16
    finally:
        ray.shutdown()
    return dict(seconds=statistics.median(seconds), delivered=nbytes * n, peak_extra_bytes_sender=nbytes,
                rss_growth_sender=max(rss_send), rss_growth_receiver=max(rss_recv), bytes_per_rank=nbytes)


def _isolated(fn, *args) -> dict:
    """Run one implementation in a fresh trainer process (its peak RSS its own; not a daemon: it spawns
    the receivers)."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_run_and_send, args=(theirs, fn, args))
    proc.start()
    kind, value = mine.recv()
    proc.join(60)
    if kind == "error":
        raise RuntimeError(f"{fn.__name__}{args}: {value}")
    return value


def _run_and_send(pipe, fn, args) -> None:
    torch.set_num_threads(1)
    try:
        pipe.send(("ok", fn(*args)))
    except Exception as exc:  # noqa: BLE001 - re-raised in the parent
        import traceback
        pipe.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"))


# ----------------------------------------------------------------------------- the decode gap

def _decode_gap_generator(recipe, quick: bool, pipe) -> None:
    """A generator process: decodes while a sync streams in; answers the step times before and during."""
    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    torch.set_num_threads(1)
    cfg = lm.ModelConfig(vocab_size=32000, hidden_size=512 if quick else 1024, intermediate_size=2048 if quick else
                         4096, num_layers=4 if quick else 8, num_heads=8, num_kv_heads=2, head_dim=64 if quick else 128,
                         max_seq_len=512, tie_embeddings=False)
    gen = ge.Generator(lm.DecoderLM(cfg, seed=0), page_size=16, weight_receiver=recipe)
    times, step = [], gen._step

    def timed(settle):
        step(settle)
        times.append(time.perf_counter())
    gen._step = timed
    pipe.send("connected")                                       # (its receiver bumped the generation)
    gen.receive_weights(None, header=pipe.recv())                # channels formed first
    pipe.send("ready")
    requests = [ge.Request([1 + i, 2, 3], ge.SamplingParams(max_new_tokens=400)) for i in range(8)]
    futures = [gen.submit(r) for r in requests]
    while len(times) < 20:
        time.sleep(0.01)
    version, header = pipe.recv()
    t0 = time.perf_counter()
    gen.receive_weights(version, header=header)
    t1 = time.perf_counter()
    time.sleep(0.5)
    gen.close()
    for f in futures:
        f.exception()
    before = [b - a for a, b in zip(times, times[1:]) if b < t0]
    during = [b - a for a, b in zip(times, times[1:]) if t0 < b <= t1 + (b - a)]
    pipe.send(dict(median_step_s=statistics.median(before), max_step_before_s=max(before),
                   max_gap_during_s=max(during) if during else None, steps_during=len(during), sync_s=t1 - t0))


def run_decode_gap(quick: bool) -> dict:
    import fast.decoder_lm as lm
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    cfg = lm.ModelConfig(vocab_size=32000, hidden_size=512 if quick else 1024, intermediate_size=2048 if quick else
                         4096, num_layers=4 if quick else 8, num_heads=8, num_kv_heads=2, head_dim=64 if quick else 128,
                         max_seq_len=512, tie_embeddings=False)
    state = lm.DecoderLM(cfg, seed=1).state_dict()                  # fp32 both sides: a CPU decodes fp32 best
    sender = ws.WeightSender(ws.layout(state), destination=ws.layout(state), timeout_s=600, bucket_bytes=16 << 20)
    proc = ctx.Process(target=_decode_gap_generator, args=(sender.receiver("g"), quick, theirs), daemon=True)
    proc.start()
    assert mine.poll(600) and mine.recv() == "connected"
    mine.send(sender.header("g", 0))
    failed: dict = {}
    sender._connect(["g"], failed)
    assert mine.poll(600) and mine.recv() == "ready"
    mine.send((1, sender.header("g", 1)))
    stats = sender.send("g", state, 1)
    out = mine.recv() if mine.poll(600) else {}
    proc.join(30)
    return dict(out, bytes=sum(t.numel() * t.element_size() for t in state.values()), send_s=stats["seconds"])


# ----------------------------------------------------------------------------- main

def record(rec: Recorder, case: str, impl: str, r: dict, raw: dict | None = None) -> None:
    rec.add(case, impl, "seconds", r["seconds"], "s")
    rec.add(case, impl, "GB/s", r["delivered"] / r["seconds"] / 1e9, "GB/s")      # delivered to all receivers
    if raw is not None:
        rec.add(case, impl, "x_raw_broadcast", r["seconds"] / raw["seconds"], "x")   # lower is better; target <= 1.5
    rec.add(case, impl, "peak_extra_bytes", max(r.get("peak_extra_bytes_sender", 0),
                                                r.get("peak_extra_bytes_receiver", 0)), "bytes")
    for key in ("peak_extra_bytes_sender", "peak_extra_bytes_receiver", "rss_growth_sender", "rss_growth_receiver",
                "bucket_bytes", "bytes_per_rank", "full_bytes"):
        if key in r:
            rec.add(case, impl, key, r[key], "bytes")


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--part", choices=["all", "flat", "qwen", "gap"], default="all")
    args = ap.parse_args(argv)
    rec = Recorder("weight_sync", record=args.record or None)
    quick, reps = args.quick, 1 if args.quick else 3
    ray_ok = optional_import("ray") is not None
    where = "one machine: gloo over loopback, the object store through shared memory"
    print(f"weight sync on {os.cpu_count()} cores ({where}); every trainer and receiver a process of its own")
    if torch.cuda.is_available():
        print("(CPU tensors over gloo even here: the NCCL path needs a GPU per process and has not been measured)")
    try:
        for kind, label in (("flat", f"{'64MiB' if quick else '1GB'} bf16"),
                            ("qwen", f"qwen3.5-0.8b{'/8' if quick else ''} fp32")):
            if args.part not in ("all", kind):
                continue
            for n in (2, 4):
                case = f"sync {label} -> {n} x tp1"
                raw = _isolated(run_raw_broadcast, kind, quick, n, reps)
                record(rec, case, "raw_broadcast", raw)
                record(rec, case, "collective", _isolated(run_collective, kind, quick, n, 1, reps, False), raw)
                record(rec, case, "collective_per_destination",
                       _isolated(run_collective, kind, quick, n, 1, reps, True), raw)
                if ray_ok:
                    record(rec, case, "object_store", _isolated(run_object_store, kind, quick, n, reps), raw)
                else:
                    rec.missing(case, "object_store", "ray is not installed")
            if kind == "qwen":
                case = f"sync {label} -> 2 x tp2"
                record(rec, case, "collective", _isolated(run_collective, kind, quick, 2, 2, reps, False))
        if args.part in ("all", "gap"):
            r = _isolated(run_decode_gap, quick)
            case = "sync decode gap"
            rec.add(case, "collective", "median_step_ms", 1e3 * r["median_step_s"], "ms")
            rec.add(case, "collective", "max_step_before_ms", 1e3 * r["max_step_before_s"], "ms")
            if r.get("max_gap_during_s") is not None:
                rec.add(case, "collective", "max_gap_during_ms", 1e3 * r["max_gap_during_s"], "ms")
            rec.add(case, "collective", "steps_during", r["steps_during"], "steps")
            rec.add(case, "collective", "seconds", r["sync_s"], "s")
            rec.add(case, "collective", "bytes", r["bytes"], "bytes")
    finally:
        if not args.no_save and rec.rows:
            rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
