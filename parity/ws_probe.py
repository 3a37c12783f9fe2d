"""Weight-sync probes: real processes over gloo, run by parity/test_weight_sync.py inside a private network
namespace (loopback only).  Each command prints one JSON line of facts; the test asserts on them.

  equivalence     fast/weight_sync.py's WeightSender and receivers over loopback gloo (threads of this
                  process, one per rank): every destination rank's tensors against the reference's
                  local_tensors, bitwise, for destination tp 1 / 2 / 4 and sharded sources (2 -> 4, 4 -> 2),
                  attention and hybrid models, fp32 -> bf16
  engine          a tensor-parallel Generator (tp = 2, hybrid model: Gated DeltaNet's fused projection in
                  three pieces) behind GeneratorRouter through WeightSender.attach: a sync gives the tokens of
                  a tp = 1 engine loaded with those weights; a sync whose bucket to the worker is corrupted is
                  refused whole (version and tokens unchanged), the router opens the generator and re-syncs it;
                  a sync streamed slowly while a request decodes: every decode step saw one version's weights,
                  whole, and steps ran while the buckets arrived
  receivers       two receiver processes; one SIGKILLed mid-sync (the other finishes as fast as alone, the
                  sender fails the dead one within its timeout, a new process for it connects and syncs); one
                  SIGSTOPped mid-sync (the same; after SIGCONT it refuses that sync and takes the next one)
  trainer         the sender in a child process, SIGKILLed mid-sync: the generator (tp = 2) raises within the
                  timeout and serves its last complete version
  nogroup         a receiver whose store does not exist, a sender whose receiver never comes, a receiver whose
                  sender never sends: RuntimeError naming the cause, within the timeout
  memory          48 MB of fp32 weights to a bf16 receiver process in 1 MiB buckets: peak RSS growth of each
                  side during the sync, and the staging buffers the transport counted
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import resource
import signal
import sys
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fast.decoder_lm as lm  # noqa: E402
import fast.generator_engine as ge  # noqa: E402
import fast.routed_generator as rg  # noqa: E402
import fast.weight_sync as ws  # noqa: E402
import ref.decoder_lm as ref_lm  # noqa: E402
import ref.gated_deltanet as gdn  # noqa: E402
import ref.weight_sync as ref_ws  # noqa: E402
import tp_models  # noqa: E402


def config(kind: str, mod=lm):
    return tp_models.config(kind, mod)


def full_weights(kind: str, seed: int) -> dict:
    return {n: t.detach().clone() for n, t in
            ref_lm.DecoderLM(config(kind, ref_lm), seed=seed, linear_layer=gdn.GatedDeltaNet).state_dict().items()}


def layouts(kind: str, full: dict, source_tp: int, dest_tp: int, dest_dtype=torch.bfloat16):
    spec = functools.partial(ref_lm.shard_spec, c=config(kind, ref_lm))
    return (ws.layout(full, tp=source_tp, shard_spec=spec),
            ws.layout(full, dtype=dest_dtype, tp=dest_tp, shard_spec=spec))


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _threads(fns: list, timeout: float = 120) -> list:
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = ("ok", fns[i]())
        except Exception as exc:  # noqa: BLE001 - reported as a fact
            out[i] = ("error", f"{type(exc).__name__}: {exc}"[:400])
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


# ----------------------------------------------------------------------------- equivalence

def equivalence() -> dict:
    torch.set_num_threads(1)
    facts = {}
    for kind in ("attention", "hybrid"):
        full = full_weights(kind, 3)
        for source_tp, dest_tp in ((1, 1), (1, 2), (1, 4), (2, 4), (4, 2)):
            src, dst = layouts(kind, full, source_tp, dest_tp)
            senders = [ws.WeightSender(src, destination=dst, bucket_bytes=512, timeout_s=30)]
            senders += [ws.WeightSender(src, destination=dst, source_rank=q, bucket_bytes=512, timeout_s=30,
                                        port=senders[0].port) for q in range(1, source_tp)]
            recipe = [s.receiver("g") for s in senders][0]
            dests = [ws.allocate(dst, r) for r in range(dest_tp)]
            for t in dests:                                  # poison: a byte the transfer forgot stays NaN
                for x in t.values():
                    x.fill_(float("nan"))
            endpoints = [recipe.connect(r, dest_tp, dests[r]) for r in range(dest_tp)]
            header = senders[0].header("g", 1)
            sent = [ref_ws.local_tensors(full, src, q) for q in range(source_tp)]
            results = _threads([functools.partial(e.receive, 1, header, d) for e, d in zip(endpoints, dests)]
                               + [functools.partial(s.send, "g", t, 1) for s, t in zip(senders, sent)])
            want = [ref_ws.local_tensors(full, dst, r) for r in range(dest_tp)]
            p = ref_ws.plan(ref_ws.layout(full, tp=source_tp, shard_spec=functools.partial(
                ref_lm.shard_spec, c=config(kind, ref_lm))), ref_ws.layout(full, dtype=torch.bfloat16, tp=dest_tp,
                shard_spec=functools.partial(ref_lm.shard_spec, c=config(kind, ref_lm))), bucket_bytes=512)
            facts[f"{kind} {source_tp}->{dest_tp}"] = dict(
                errors=[r[1] for r in results if r is None or r[0] != "ok"],
                bitwise=all(sorted(dests[r]) == sorted(want[r]) and all(torch.equal(dests[r][n], want[r][n])
                                                                        for n in want[r]) for r in range(dest_tp)),
                digest_equals_ref=header["digest"] == p.digest,
                received_bytes=[sum(t.numel() * t.element_size() for t in d.values()) for d in dests],
                plan_bytes=[p.bytes_to(r) for r in range(dest_tp)],
                sent_bytes=sum(r[1]["bytes"] for r in results[dest_tp:] if r and r[0] == "ok"),
                peak_buffers=[e.peak_buffer_bytes for e in endpoints] + [s.peak_buffer_bytes for s in senders])
    return facts


# ----------------------------------------------------------------------------- the engine

def _fingerprint(model) -> float:
    return sum(float(t.double().sum()) for t in model.state_dict().values())


def engine() -> dict:
    torch.set_num_threads(1)
    kind, cfg = "hybrid", config("hybrid")
    mkw = dict(linear_layer=gdn.GatedDeltaNet)
    weights = {v: {n: t.detach().clone() for n, t in lm.DecoderLM(cfg, seed=10 + v, **mkw).state_dict().items()}
               for v in (1, 2, 3)}
    src, dst = layouts(kind, weights[1], 1, 2, torch.float32)
    sender = ws.WeightSender(src, destination=dst, bucket_bytes=2048, timeout_s=20)
    facts = {}
    requests = [rg.Request([5, 17, 3, 44, 2, 9], rg.SamplingParams(max_new_tokens=8), request_id="a"),
                rg.Request(list(range(20, 33)), rg.SamplingParams(max_new_tokens=6, temperature=0.8, seed=3),
                           request_id="b")]

    def oracle(version):
        with ge.Generator(lm.DecoderLM(cfg, seed=0, **mkw), page_size=4) as g:
            if version:
                g.load_weights(weights[version], version)
            return [c.token_ids for c in g.generate(requests)]

    def served(name, version):          # what the router's generator `name` serves, against the oracle
        outs = [router.generate([r])[0] for r in requests for _ in range(4)]   # (least_loaded alternates)
        mine = [c.token_ids for c in outs if c.generator_id == name]
        expect = oracle(version)
        return bool(mine) and all(t in expect for t in mine) and {c.max_policy_version for c in outs} == {version}

    gen = ge.Generator(lm.DecoderLM(cfg, seed=0, **mkw), tensor_parallel_size=2, tp_timeout_s=60, page_size=4,
                       name="g")
    other = ge.Generator(lm.DecoderLM(cfg, seed=0, **mkw), page_size=4, name="h")
    handles = [sender.attach(gen), sender.attach(other, destination=layouts(kind, weights[1], 1, 1, torch.float32)[1])]
    router = rg.GeneratorRouter(handles, request_timeout_s=60, sync_timeout_s=60, backoff_s=(0.3, 0.6))
    try:
        router.sync_weights(weights[1], 1)
        facts["synced"] = dict(versions=[gen.policy_version, other.policy_version], g_tokens=served("g", 1),
                               h_tokens=served("h", 1))
        # A corrupted bucket to g's rank 1 (its worker process): g refuses version 2 whole, h loads it; the
        # router opens g and re-syncs it at re-admission.
        sender._corrupt = lambda name, bucket, data: _flipped(data) if (name, bucket.dest_rank, bucket.index) == \
            ("g", 1, 3) else None
        before = _fingerprint(gen.model)
        try:
            router.sync_weights(weights[2], 2)
            refused = None
        except rg.RouterError as exc:
            refused = str(exc)[:600]
        sender._corrupt = None
        facts["corrupt"] = dict(error=refused, versions_after=[gen.policy_version, other.policy_version],
                                live_weights_unchanged=_fingerprint(gen.model) == before,
                                state=router.stats()["g"]["state"])
        deadline = time.monotonic() + 30
        while router.stats()["g"]["state"] != "closed" and time.monotonic() < deadline:
            served("g", 2)                                  # traffic: the probe that closes it again
        facts["resynced"] = dict(version=gen.policy_version, g_tokens=served("g", 2),
                                 events=[e for _, name, e, _ in router.health_events() if name == "g"])
        facts["overlap"] = _overlap(gen, handles[0], weights)
    finally:
        router.close()
        gen.close()
        other.close()
    return facts


def _flipped(data: torch.Tensor) -> torch.Tensor:
    out = data.clone()
    out[7] ^= 0x10
    return out


def _overlap(gen, handle, weights) -> dict:
    """Requests decode while version 3 streams in slowly: every step must run on one version's weights, whole
    (rank 0's live weights fingerprinted before and after each step), and a request spans the swap.

    Two chains of requests of 20 tokens each keep the engine busy, the second started 10 iterations after
    the first, each request submitted by its predecessor's done-callback (on the engine thread, in time for
    the next iteration): the engine never idles and the chains' boundaries never meet, so whichever iteration
    the swap lands before, one chain's request is midway and spans it (one chain alone leaves it 1 in 20 to
    land between two requests, and a thread that submits the next after result() leaves the engine idle)."""
    fp = {v: _fingerprint(_as_model(gen, weights[v])) for v in (gen.policy_version, 3)}
    steps, step = [], gen._step
    receiving, stop = threading.Event(), threading.Event()
    spans, ended, errors = [], threading.Semaphore(0), []

    def chain(i):                                       # one request, then (unless told to stop) the next
        if stop.is_set():
            ended.release()
            return
        future = gen.submit(rg.Request([1, 2, 3 + i % 50], rg.SamplingParams(max_new_tokens=20)))

        def then(f):
            if f.exception() is not None:
                errors.append(repr(f.exception()))
                ended.release()
                return
            spans.append((f.result().min_policy_version, f.result().max_policy_version))
            chain(i + 2)
        future.add_done_callback(then)

    def watched(settle):
        a = _fingerprint(gen.model)
        step(settle)
        steps.append((a, _fingerprint(gen.model), gen.policy_version, receiving.is_set()))
        if len(steps) == 10:                            # (the engine thread: the next iteration takes it)
            chain(1)
    gen._step = watched
    chain(0)
    while len(steps) < 12:
        time.sleep(0.01)
    handle._sender._corrupt = lambda name, bucket, data: time.sleep(0.01)   # pace: ~10 ms a bucket
    receiving.set()
    t0 = time.monotonic()
    handle.load_weights(weights[3], 3)
    sync_s = time.monotonic() - t0
    receiving.clear()
    handle._sender._corrupt = None
    seen = len(steps)
    while len(steps) < seen + 5:
        time.sleep(0.01)
    stop.set()
    chains_ended = all(ended.acquire(timeout=120) for _ in range(2))
    gen._step = step
    labels = [[v for v, f in fp.items() if f == a] for a, _, _, _ in steps]
    return dict(steps=len(steps), steps_during_sync=sum(1 for s in steps if s[3]), sync_s=round(sync_s, 2),
                every_step_one_version=all(a == b for a, b, _, _ in steps) and all(len(x) == 1 for x in labels),
                versions_in_order=[x[:1] for x in labels] == sorted(x[:1] for x in labels),
                labels_match_version=all(x[:1] == [s[2]] for x, s in zip(labels, steps)),
                spans=sorted(set(spans)), chains_ended=chains_ended, errors=errors)


def _as_model(gen, weights):
    """Rank 0's shard of a full state dict, as a model whose fingerprint the live one must match."""
    shard = type(gen.model)(gen.model.config, tp_group=gen.model.tp_group, device="meta",
                            **gen.model.init_kwargs).to_empty(device="cpu")
    shard.load_state_dict(gen.model.shard_state_dict(weights))
    return shard


# ----------------------------------------------------------------------------- receiver processes

def _receiver_main(recipe, rank, size, layout_dict, pipe) -> None:
    """A receiver process: connect, then receive each version it is told to; answer with a digest."""
    torch.set_num_threads(1)
    try:
        tensors = ws.allocate(layout_dict, rank)
        endpoint = recipe.connect(rank, size, tensors)
        pipe.send(("ready", os.getpid()))
    except Exception as exc:  # noqa: BLE001
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        message = pipe.recv()
        if message[0] == "stop":
            return
        _, version, header = message
        t0 = time.monotonic()
        try:
            endpoint.receive(version, header, tensors)
            pipe.send(("ok", digest(tensors), time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001
            pipe.send(("error", f"{type(exc).__name__}: {exc}"[:400], time.monotonic() - t0))


def _spawn_receiver(recipe, layout_dict, rank=0, size=1):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(recipe, rank, size, layout_dict, theirs), daemon=True)
    proc.start()
    assert mine.poll(120), "the receiver process did not start"
    kind, detail = mine.recv()
    assert kind == "ready", detail
    return proc, mine


def _sync(sender, names_pipes: dict, weights: dict, version: int, during=None, answers=None) -> dict:
    """Send version to every named destination in its own thread (as a router does) while each receiver
    process receives; {name: (send outcome, seconds, receiver outcome, digest)}; the receivers' answers are
    awaited from ``answers`` only (default: all)."""
    for name, pipe in names_pipes.items():
        pipe.send(("receive", version, sender.header(name, version)))
    answers = list(names_pipes) if answers is None else answers
    out = {}

    def send(name):
        t0 = time.monotonic()
        try:
            sender.send(name, weights, version)
            out[name] = ["ok", time.monotonic() - t0]
        except Exception as exc:  # noqa: BLE001
            out[name] = [f"{type(exc).__name__}: {exc}"[:300], time.monotonic() - t0]
    threads = [threading.Thread(target=send, args=(n,), daemon=True) for n in names_pipes]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(120)
    for name, pipe in names_pipes.items():
        answer = pipe.recv()[:2] if name in answers and pipe.poll(60) else None
        out[name].append(answer[0] if answer and answer[0] == "ok" else answer)
        out[name].append(answer[1] if answer and answer[0] == "ok" else None)
    return out


def receivers() -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    base = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(16)}      # 4 MB fp32 -> 2 MB bf16
    src, dst = ws.layout(base), ws.layout(base, dtype=torch.bfloat16)
    versions = {v: {n: t + v for n, t in base.items()} for v in range(1, 7)}
    timeout = 4.0
    sender = ws.WeightSender(src, destination=dst, bucket_bytes=16 << 10, timeout_s=timeout)
    procs, pipes = {}, {}
    for name in ("a", "b"):
        procs[name], pipes[name] = _spawn_receiver(sender.receiver(name), dst)
    facts = {"want": {v: digest(ref_ws.local_tensors(w, dst, 0)) for v, w in versions.items()}}
    facts["first"] = _sync(sender, pipes, versions[1], 1)
    sender._corrupt = lambda name, bucket, data: time.sleep(0.004)    # ~0.5 s a sync: room to strike mid-way
    facts["paced"] = _sync(sender, pipes, versions[2], 2)

    def kill_a():
        time.sleep(0.15)
        os.kill(procs["a"].pid, signal.SIGKILL)
    facts["kill"] = _sync(sender, pipes, versions[3], 3, during=kill_a, answers=["b"])
    procs["a"].join(10)
    procs["a"], pipes["a"] = _spawn_receiver(sender.receiver("a"), dst)          # the process comes back
    facts["after_kill"] = _sync(sender, pipes, versions[4], 4)

    def stop_b():
        time.sleep(0.15)
        os.kill(procs["b"].pid, signal.SIGSTOP)
    facts["stall"] = _sync(sender, pipes, versions[5], 5, during=stop_b, answers=["a"])
    os.kill(procs["b"].pid, signal.SIGCONT)
    answer = pipes["b"].recv() if pipes["b"].poll(30) else None      # its receive of version 5 ends in an error
    facts["stalled_receiver_said"] = None if answer is None else answer[:2]
    facts["after_stall"] = _sync(sender, pipes, versions[6], 6)
    facts["timeout_s"] = timeout
    for name, pipe in pipes.items():
        pipe.send(("stop",))
        procs[name].join(10)
    return facts


# ----------------------------------------------------------------------------- the trainer dies

def _trainer_main(kind, port_pipe) -> None:
    torch.set_num_threads(1)
    weights = {v: full_weights(kind, 20 + v) for v in (1, 2)}
    src, dst = layouts(kind, weights[1], 1, 2, torch.float32)
    sender = ws.WeightSender(src, destination=dst, bucket_bytes=1024, timeout_s=10)
    port_pipe.send(sender.receiver("g"))
    while True:
        message = port_pipe.recv()
        if message[0] == "stop":
            return
        version, pace = message[1], message[2]
        sender._corrupt = (lambda name, bucket, data: time.sleep(pace)) if pace else None
        port_pipe.send(("header", sender.header("g", version)))
        try:
            sender.send("g", weights[version], version)
            port_pipe.send(("sent", None))
        except Exception as exc:  # noqa: BLE001
            port_pipe.send(("error", str(exc)))


def trainer() -> dict:
    import multiprocessing as mp
    torch.set_num_threads(1)
    kind = "attention"
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_trainer_main, args=(kind, theirs), daemon=True)
    proc.start()
    recipe = mine.recv()
    cfg = config(kind)
    gen = ge.Generator(lm.DecoderLM(cfg, seed=0), tensor_parallel_size=2, tp_timeout_s=60, page_size=4,
                       weight_receiver=recipe)
    request = [rg.Request([5, 17, 3, 44, 2, 9], rg.SamplingParams(max_new_tokens=8))]
    facts = {}
    try:
        mine.send(("sync", 1, 0.0))
        header = mine.recv()[1]
        gen.receive_weights(1, header=header)
        facts["v1"] = [gen.policy_version, mine.recv()[0]]
        tokens_v1 = gen.generate(request)[0].token_ids
        mine.send(("sync", 2, 0.05))                    # slow: ~3 s, killed after 0.5 s
        header = mine.recv()[1]
        timer = threading.Timer(0.5, lambda: os.kill(proc.pid, signal.SIGKILL))
        timer.start()
        t0 = time.monotonic()
        try:
            gen.receive_weights(2, header=header)
            facts["error"] = None
        except RuntimeError as exc:
            facts["error"] = str(exc)[:500]
        facts["failed_after_s"] = time.monotonic() - t0
        facts["version_after"] = gen.policy_version
        facts["tokens_still_v1"] = gen.generate(request)[0].token_ids == tokens_v1
        facts["timeout_s"] = 10
    finally:
        gen.close()
        proc.join(5)
    return facts


# ----------------------------------------------------------------------------- groups that cannot form

def nogroup() -> dict:
    torch.set_num_threads(1)
    weights = {"w": torch.randn(64, 64)}
    src = ws.layout(weights)
    timeout = 2.0
    facts = {}
    sender = ws.WeightSender(src, destination=src, timeout_s=timeout)
    recipe = sender.receiver("absent")
    import dataclasses
    nowhere = dataclasses.replace(recipe, port=_free_port())          # nobody listens there
    t0 = time.monotonic()
    try:
        nowhere.connect(0, 1, ws.allocate(src, 0))
        facts["no_store"] = None
    except RuntimeError as exc:
        facts["no_store"] = str(exc)[:300]
    facts["no_store_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:                                                                # its receiver never comes
        sender.send("absent", weights, 1)
        facts["no_receiver"] = None
    except RuntimeError as exc:
        facts["no_receiver"] = str(exc)[:300]
    facts["no_receiver_s"] = time.monotonic() - t0
    endpoint = recipe.connect(0, 1, ws.allocate(src, 0))
    t0 = time.monotonic()
    try:                                                                # its sender never sends
        endpoint.receive(2, sender.header("absent", 2), ws.allocate(src, 0))
        facts["no_sender"] = None
    except RuntimeError as exc:
        facts["no_sender"] = str(exc)[:300]
    facts["no_sender_s"] = time.monotonic() - t0
    facts["timeout_s"] = timeout
    return facts


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- memory

def _rss_receiver(recipe, layout_dict, pipe) -> None:
    torch.set_num_threads(1)
    tensors = ws.allocate(layout_dict, 0)
    for t in tensors.values():
        t.zero_()                                                        # touched: resident before the sync
    endpoint = recipe.connect(0, 1, tensors)
    pipe.send("connected")
    endpoint.receive(None, pipe.recv(), None)                            # channels formed before measuring
    endpoint.receive(1, pipe.recv(), tensors)                            # warm: first-use allocations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    endpoint.receive(2, pipe.recv(), tensors)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    pipe.send(((after - before) * 1024, endpoint.peak_buffer_bytes))


def memory() -> dict:
    import multiprocessing as mp
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    weights = {f"layer{i}": torch.randn(1024, 1024, generator=g) for i in range(12)}   # 48 MB fp32
    src, dst = ws.layout(weights), ws.layout(weights, dtype=torch.bfloat16)
    bucket = 1 << 20
    sender = ws.WeightSender(src, destination=dst, bucket_bytes=bucket, timeout_s=60)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_rss_receiver, args=(sender.receiver("r"), dst, theirs), daemon=True)
    proc.start()
    assert mine.poll(120) and mine.recv() == "connected"
    header = sender.header("r", 1)
    mine.send(header)
    failed: dict = {}
    sender._connect(["r"], failed)                                       # (forms with the receiver's None)
    assert not failed, failed
    mine.send(header)
    mine.send(sender.header("r", 2))
    sender.send("r", weights, 1)                                         # warm: first-use allocations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = sender.send("r", weights, 2)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert mine.poll(120), "the receiver did not answer"
    receiver_rss, receiver_buffers = mine.recv()
    proc.join(10)
    return dict(bucket_bytes=bucket, model_bytes=sum(t.numel() * 4 for t in weights.values()),
                sender_rss_growth=(after - before) * 1024, sender_buffers=stats["peak_buffer_bytes"],
                receiver_rss_growth=receiver_rss, receiver_buffers=receiver_buffers, seconds=stats["seconds"])


# ----------------------------------------------------------------------------- a Ray fleet

def _ray_engine(tp: int):
    """What each actor builds: a tensor-parallel engine on the attention model (one thread per rank)."""
    torch.set_num_threads(1)
    return ge.Generator(lm.DecoderLM(config("attention"), seed=0), tensor_parallel_size=tp, tp_timeout_s=60,
                        page_size=4)


class _Unreachable:
    """A transport whose receivers point at a port nobody listens on: the actors fall back to the object store."""

    def __init__(self, sender):
        self.sender = sender

    def receiver(self, name):
        import dataclasses
        full = self.sender.default_destination
        one = {n: ws.TensorLayout(tl.shape, tl.dtype, ((tuple((0, d) for d in tl.shape),),)) for n, tl in full.items()}
        return dataclasses.replace(self.sender.receiver(name, one), port=_free_port(), timeout_s=2.0)

    def header(self, name, version):
        return self.sender.header(name, version)

    def send(self, name, state_dict, version):
        return self.sender.send(name, state_dict, version)


def ray_fleet() -> dict:
    import tempfile
    torch.set_num_threads(1)
    cfg = config("attention")
    weights = {v: {n: t.detach().clone() for n, t in lm.DecoderLM(cfg, seed=30 + v).state_dict().items()}
               for v in (1, 2, 3)}
    src, dst = layouts("attention", weights[1], 1, 2, torch.float32)
    sender = ws.WeightSender(src, destination=dst, bucket_bytes=4096, timeout_s=20)
    requests = [rg.Request([5, 17, 3, 44, 2, 9], rg.SamplingParams(max_new_tokens=8), request_id=f"r{i}")
                for i in range(4)]

    @functools.cache
    def oracle(version):
        with ge.Generator(lm.DecoderLM(cfg, seed=0), page_size=4) as g:
            g.load_weights(weights[version], version)
            return tuple(g.generate(requests[:1])[0].token_ids)

    facts, t0 = {}, time.monotonic()
    temp_dir = tempfile.mkdtemp(prefix="rayw", dir="/tmp")
    options = dict(num_cpus=4, include_dashboard=False, _temp_dir=temp_dir, logging_level="ERROR", log_to_driver=False)
    gens = rg.ray_generators(functools.partial(_ray_engine, 2), 2, num_cpus=1, max_restarts=1, call_timeout_s=90,
                             weight_transport=sender, ray_init_options=options)
    solo = rg.ray_generators(functools.partial(_ray_engine, 1), 1, name_prefix="solo", num_cpus=1,
                             call_timeout_s=90, weight_transport=_Unreachable(sender))
    facts["up_s"] = time.monotonic() - t0
    facts["paths"] = [g.weights_path for g in gens + solo]
    facts["solo_error"] = (solo[0].transport_error or "")[:300]
    router = rg.GeneratorRouter(gens + solo, request_timeout_s=60, sync_timeout_s=90, backoff_s=(0.3, 1.0))

    def serves(version):
        """Every generator in rotation serves ``version`` with the oracle's tokens (a request pinned to each)."""
        outs = [router.generate([rg.Request(requests[0].prompt_token_ids, requests[0].sampling,
                                            session_id=g.name)])[0] for g in gens + solo for _ in range(2)]
        return sorted({(c.generator_id, c.max_policy_version, tuple(c.token_ids) == oracle(version)) for c in outs})

    try:
        router.sync_weights(weights[1], 1)
        facts["v1"] = serves(1)
        # A corrupted bucket to ray-gen0's rank 1: refused whole, the others load; re-admission re-syncs it.
        sender._corrupt = lambda name, bucket, data: _flipped(data) if (name, bucket.dest_rank, bucket.index) == \
            ("ray-gen0", 1, 2) else None
        try:
            router.sync_weights(weights[2], 2)
            facts["corrupt"] = None
        except rg.RouterError as exc:
            facts["corrupt"] = [name for name, _ in exc.causes]
        sender._corrupt = None
        facts["after_corrupt"] = [g.policy_version for g in gens + solo]
        deadline = time.monotonic() + 60
        while router.stats()["ray-gen0"]["state"] != "closed" and time.monotonic() < deadline:
            router.generate(requests)
        facts["resynced"] = [router.stats()["ray-gen0"]["state"], gens[0].policy_version]
        # SIGKILL ray-gen1's process: Ray restarts it, its ranks connect again, the router re-syncs it.
        killed = gens[1].pid
        os.kill(killed, signal.SIGKILL)
        t_kill = time.monotonic()
        # (up to 240 s: on a loaded machine the restarted actor's first re-sync can miss the 90 s sync deadline;
        # the router then opens it again and re-admits it with a second one)
        while (router.stats()["ray-gen1"]["state"] != "closed" or gens[1].pid == killed) and \
                time.monotonic() < t_kill + 240:
            router.generate(requests)
        facts["restart"] = [router.stats()["ray-gen1"]["state"], gens[1].policy_version, gens[1].pid != killed,
                            gens[1].weights_path, round(time.monotonic() - t_kill, 1)]
        facts["restart_events"] = [(round(t - t_kill, 1), e, d[:300]) for t, name, e, d in router.health_events()
                                   if name == "ray-gen1"]
        router.sync_weights(weights[3], 3)
        facts["v3"] = serves(3)
    finally:
        router.close()
        for g in gens + solo:
            g.close()
        import ray
        ray.shutdown()
    facts["total_s"] = time.monotonic() - t0
    return facts


if __name__ == "__main__":
    command = sys.argv[1]
    result = dict(equivalence=equivalence, engine=engine, receivers=receivers, trainer=trainer, nogroup=nogroup,
                  memory=memory, ray=ray_fleet)[command]()
    print("FACTS " + json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)          # without tearing process groups down from under their threads
