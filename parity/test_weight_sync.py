"""Weight sync: the plan (ref/weight_sync.py, the specification) and the transport (fast/weight_sync.py).

In one process: the reference's plan moves each destination rank exactly its shard (decoder_lm.py's
``shard_spec`` slices, cast to the destination's dtype, bit for bit) for tp 1 / 2 / 4 and sharded sources,
in buckets that respect their bound; fast's plan, bytes, digests and checksums equal the reference's; a
corrupted bucket fails its checksum; bad layouts raise.  Over real processes (parity/ws_probe.py, inside a
private network namespace the test creates: loopback only, bounded in time): fast's transfer gives every
rank the reference's tensors bitwise; a tensor-parallel generator refuses a corrupted sync whole and the
router re-syncs it; a sync streamed while requests decode never mixes versions in a step; a receiver killed
or stopped mid-sync costs the other destination nothing and fails within the timeout; a trainer killed
mid-sync leaves the generator on its last version; groups that cannot form raise within the timeout;
memory stays within two buckets per side; a Ray fleet of tensor-parallel generators syncs through the
collective (an actor that cannot reach it through the object store), refuses a bad bucket, and is re-synced
after an actor restart.
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.weight_sync as fast_ws
import ref.decoder_lm as ref_lm
import ref.gated_deltanet as ref_gdn
import ref.moe as ref_moe
import ref.weight_sync as ref_ws
from netns import run_isolated, unavailable

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [(1, 1), (1, 2), (1, 4), (2, 4), (4, 2), (2, 1), (4, 4)]   # (source tp, destination tp)


def _config(kind: str) -> ref_lm.ModelConfig:
    kw = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, max_seq_len=64, tie_embeddings=True, qk_norm=True, attn_output_gate=True,
              zero_centered_norm=True, partial_rotary_factor=0.5)
    if kind in ("hybrid", "moe"):
        kw.update(layer_types=("linear", "attention"), linear_num_k_heads=2, linear_num_v_heads=4,
                  linear_head_k_dim=8, linear_head_v_dim=8)
    if kind == "moe":                           # Qwen3.5-MoE's blocks: 8 experts (expert parallel), a shared one
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
    return ref_lm.ModelConfig(**kw)


def _full(kind: str, seed: int = 3) -> dict:
    return ref_lm.DecoderLM(_config(kind), seed=seed, linear_layer=ref_gdn.GatedDeltaNet,
                            moe_layer=ref_moe.MoE).state_dict()


def _layouts(mod, kind, full, source_tp, dest_tp, dtype=torch.bfloat16):
    spec = functools.partial(ref_lm.shard_spec, c=_config(kind))
    return mod.layout(full, tp=source_tp, shard_spec=spec), mod.layout(full, dtype=dtype, tp=dest_tp, shard_spec=spec)


# ----------------------------------------------------------------------------- the plan, one process

@pytest.mark.parametrize("source_tp,dest_tp", PAIRS)
@pytest.mark.parametrize("kind", ["attention", "hybrid", "moe"])
def test_each_rank_receives_exactly_its_shard(kind, source_tp, dest_tp):
    """ref transfer: destination rank r holds shard(full, shard_spec(name, tp, r)).to(bf16) for every tensor
    (bitwise; a tied lm_head listed once), receives exactly those bytes (no replicated tensor twice, no other
    rank's rows: an MoE model's rank receives its experts only), in buckets within the bound, at aligned
    offsets that do not overlap."""
    c, full = _config(kind), _full(kind)
    src, dst = _layouts(ref_ws, kind, full, source_tp, dest_tp)
    assert "lm_head.weight" not in dst and "model.embed_tokens.weight" in dst       # tied: listed once
    plan = ref_ws.plan(src, dst, bucket_bytes=1024)
    sources = [ref_ws.local_tensors(full, src, q) for q in range(source_tp)]
    for q, tensors in enumerate(sources):                   # the source's local tensors are its shards
        for name, t in tensors.items():
            assert torch.equal(t, ref_lm.shard(full[name], ref_lm.shard_spec(name, c, source_tp, q)))
    dests = [{n: torch.full_like(t, float("nan")) for n, t in ref_ws.allocate(dst, r).items()} for r in range(dest_tp)]
    ref_ws.transfer(plan, sources, dests)
    for r in range(dest_tp):
        want = {n: ref_lm.shard(full[n], ref_lm.shard_spec(n, c, dest_tp, r)).to(torch.bfloat16) for n in dst}
        assert sorted(dests[r]) == sorted(want)
        for n in want:
            assert torch.equal(dests[r][n], want[n]), (r, n)
        assert plan.bytes_to(r) == sum(t.numel() * 2 for t in want.values())
    for b in plan.buckets:
        assert b.nbytes <= 1024 and b.nbytes % 16 == 0
        ends = sorted((it.offset, it.offset + it.nbytes) for it in b.items)
        assert all(it.offset % 16 == 0 for it in b.items) and all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:]))
    # each channel counts its buckets from 0, in order
    for q in range(source_tp):
        for r in range(dest_tp):
            assert [b.index for b in plan.channel(q, r)] == list(range(len(plan.channel(q, r))))


def test_large_regions_are_cut_along_dim0_then_dim1():
    """A region larger than a bucket goes in runs of whole rows; a single row larger than a bucket is cut
    along its columns; the pieces still land in place."""
    full = {"a": torch.randn(40, 300), "b": torch.randn(3, 7, 5), "c": torch.randn(11)}
    src, dst = ref_ws.layout(full), ref_ws.layout(full, dtype=torch.float16)
    plan = ref_ws.plan(src, dst, bucket_bytes=256)                     # a row of "a" is 600 bytes
    boxes_a = [it.box for b in plan.buckets for it in b.items if it.name == "a"]
    assert all(hi - lo == 1 for (lo, hi), _ in boxes_a) and {box[1] for box in boxes_a} == {(0, 128), (128, 256),
                                                                                            (256, 300)}
    assert all(b.nbytes <= 256 for b in plan.buckets)
    out = [ref_ws.allocate(dst, 0)]
    ref_ws.transfer(plan, [full], out)
    assert all(torch.equal(out[0][n], full[n].half()) for n in full)


def test_plan_of_a_qwen3_30b_a3b_layout_in_well_under_a_second():
    """The sync plan of a Qwen3-30B-A3B-shaped model (48 layers of 128 experts, fp32 trainer to bf16 generator):
    the experts are two fused tensors per layer, as transformers holds them and as this repo's model names
    them, so the plan has 531 tensors for 30.5 billion parameters and is computed in well under a second
    (SGLang spent 55-63 s per sync matching 18k per-expert names quadratically: its issue #30848)."""
    import time
    config = fast_lm.ModelConfig.from_hf(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960))
    model = fast_lm.DecoderLM(config, moe_layer=ref_moe.MoE, device="meta")
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    start = time.perf_counter()
    plan = fast_ws.plan(fast_ws.layout(shapes, dtype=torch.float32), fast_ws.layout(shapes, dtype=torch.bfloat16))
    seconds = time.perf_counter() - start
    params = sum(math.prod(s) for s in shapes.values())
    print(f"{len(shapes)} tensors, {params / 1e9:.1f} B parameters: planned in {seconds:.3f} s")
    assert len(shapes) == 531 and 30.4e9 < params < 30.6e9
    assert sum(b.nbytes for b in plan.buckets) == 2 * params and seconds < 1.0


def test_expert_parallel_plan_sends_each_rank_its_experts_only():
    """The same layout from a trainer (tp = 1, and tp = 2) to a tensor-parallel generator (tp = 4: 32 of the 128
    experts a rank, the router replicated): layouts and plan in well under a second; each generator rank is sent
    its 32 experts' rows of every expert tensor and nothing of the others' (its bytes: a quarter of the experts
    and of the attention, all of the replicated tensors).  With the checkpoint's per-expert names instead
    (18,867 tensors) the plan is still linear in the tensors: measured and bounded loosely."""
    import time
    config = fast_lm.ModelConfig.from_hf(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960))
    shapes = {n: tuple(t.shape) for n, t in
              fast_lm.DecoderLM(config, moe_layer=ref_moe.MoE, device="meta").state_dict().items()}
    spec = functools.partial(fast_lm.shard_spec, c=config)
    for source_tp in (1, 2):
        times = []
        for _ in range(3):      # the least of three: the planner's cost, not another process's load on the cores
            start = time.perf_counter()
            plan = fast_ws.plan(fast_ws.layout(shapes, dtype=torch.float32, tp=source_tp, shard_spec=spec),
                                fast_ws.layout(shapes, dtype=torch.bfloat16, tp=4, shard_spec=spec))
            times.append(time.perf_counter() - start)
        seconds = min(times)
        print(f"trainer tp {source_tp} -> generator tp 4: {len(shapes)} tensors planned in {seconds:.3f} s")
        assert seconds < 1.0
        for r in range(4):
            boxes = {}
            for b in plan.buckets:
                if b.dest_rank == r:
                    for it in b.items:
                        boxes.setdefault(it.name, []).append(it.box)
            for name, got in boxes.items():
                if ".mlp.experts." in name:                  # dim 0: experts [32 r, 32 (r + 1)), all of them
                    assert {box[0] for box in got} <= {(a, b) for a in range(32 * r, 32 * (r + 1))
                                                       for b in range(a + 1, 32 * (r + 1) + 1)}, (r, name)
                    assert sum(math.prod(hi - lo for lo, hi in box) for box in got) == math.prod(shapes[name]) // 4
            assert sum(1 for n in boxes if ".mlp.experts." in n) == 2 * 48
        sizes = [plan.bytes_to(r) for r in range(4)]
        assert len(set(sizes)) == 1
    per_expert = {n: s for n, s in shapes.items() if ".mlp.experts." not in n}
    for layer in range(48):
        for e in range(128):
            for part, shape in (("gate_proj", (768, 2048)), ("up_proj", (768, 2048)), ("down_proj", (2048, 768))):
                per_expert[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] = shape
    start = time.perf_counter()
    plan = fast_ws.plan(fast_ws.layout(per_expert, dtype=torch.bfloat16, tp=1, shard_spec=spec),
                        fast_ws.layout(per_expert, dtype=torch.bfloat16, tp=4, shard_spec=spec))
    seconds = time.perf_counter() - start
    print(f"per-expert names: {len(per_expert)} tensors planned in {seconds:.3f} s")
    assert len(per_expert) == 18867 and seconds < 10
    for b in plan.buckets:
        for it in b.items:
            parts = it.name.split(".mlp.experts.")
            if len(parts) == 2:
                assert int(parts[1].split(".")[0]) // 32 == b.dest_rank, it.name


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_fast_plan_and_bytes_equal_the_reference(kind):
    """fast/weight_sync.py's plan has the reference's buckets and digest, its pack gives the same bytes
    (reusing a dirty buffer too: padding is zeroed), its checksum the same value."""
    full = _full(kind)
    for source_tp, dest_tp in [(1, 2), (2, 4), (4, 2)]:
        src, dst = _layouts(ref_ws, kind, full, source_tp, dest_tp)
        rp = ref_ws.plan(src, dst, bucket_bytes=2048)
        fp = fast_ws.plan(*_layouts(fast_ws, kind, full, source_tp, dest_tp), bucket_bytes=2048)
        assert fp.digest == rp.digest and len(fp.buckets) == len(rp.buckets)
        sources = [ref_ws.local_tensors(full, src, q) for q in range(source_tp)]
        dirty = torch.full((2048,), 0xAB, dtype=torch.uint8)
        for rb, fb in zip(rp.buckets, fp.buckets):
            assert (rb.source_rank, rb.dest_rank, rb.index, rb.nbytes) == (fb.source_rank, fb.dest_rank, fb.index,
                                                                          fb.nbytes)
            want = ref_ws.pack(rb, sources[rb.source_rank])
            fast_ws._pack_into(fb, sources[fb.source_rank], dirty[:fb.nbytes])
            assert torch.equal(fast_ws.pack(fb, sources[fb.source_rank]), want)
            assert torch.equal(dirty[:fb.nbytes], want)
            assert fast_ws.checksum(want) == ref_ws.checksum(want)


def test_checksum_formula_and_what_it_catches():
    """A*2^32 + B over int32 words (A = sum s_i, B = sum (1 + i mod 65521) s_i, both mod 2^32), as plain Python
    integers say; fast's one-pass column sums agree with ref around its 65521-word rows; a flipped bit, two
    swapped words and a zeroed word each change it."""
    g = torch.Generator().manual_seed(0)
    small = torch.randint(0, 256, (4 * 70000,), dtype=torch.uint8, generator=g)
    words = small.view(torch.int32).tolist()
    want = (sum(words) % 2 ** 32) * 2 ** 32 + sum((1 + i % 65521) * s for i, s in enumerate(words)) % 2 ** 32
    assert ref_ws.checksum(small) == fast_ws.checksum(small) == want
    for n in (4, 16, 4 * 65520, 4 * 65521, 4 * (4 * 65521 + 3), 4 * (9 * 65521 + 17)):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert fast_ws.checksum(data) == ref_ws.checksum(data), n
    extreme = torch.full((4 * 3 * 65521,), 0xFF, dtype=torch.uint8)
    extreme[3::4] = 0x7F                                             # every word 2^31 - 1: the int32 sums wrap
    assert fast_ws.checksum(extreme) == ref_ws.checksum(extreme)
    base = fast_ws.checksum(small)
    flipped = small.clone()
    flipped[1234] ^= 4
    swapped = small.clone().view(torch.int32)
    swapped[[10, 11]] = swapped[[11, 10]]
    zeroed = small.clone().view(torch.int32)
    zeroed[500] = 0
    assert len({base, fast_ws.checksum(flipped), fast_ws.checksum(swapped.view(torch.uint8)),
                fast_ws.checksum(zeroed.view(torch.uint8))}) == 4
    with pytest.raises(ValueError, match="uint8"):
        fast_ws.checksum(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("mod", [ref_ws, fast_ws], ids=["ref", "fast"])
def test_a_corrupted_bucket_is_refused(mod):
    full = _full("attention")
    src, dst = _layouts(mod, "attention", full, 1, 2)
    plan = mod.plan(src, dst, bucket_bytes=1024)

    def corrupt(bucket, data):
        if bucket.dest_rank == 1 and bucket.index == 2:
            data[3] ^= 1
    with pytest.raises(ValueError, match="bucket 2 from source rank 0 to destination rank 1 fails its checksum"):
        mod.transfer(plan, [ref_ws.local_tensors(full, src, 0)], [mod.allocate(dst, r) for r in range(2)],
                     corrupt=corrupt)


@pytest.mark.parametrize("mod", [ref_ws, fast_ws], ids=["ref", "fast"])
def test_bad_layouts_and_inputs_raise(mod):
    w = {"a": torch.randn(8, 4), "b": torch.randn(6)}
    src = mod.layout(w)
    with pytest.raises(ValueError, match="bucket_bytes"):
        mod.plan(src, src, bucket_bytes=100)
    with pytest.raises(ValueError, match="missing \\['c'\\]"):
        mod.plan(src, mod.layout(dict(w, c=torch.randn(2))))
    with pytest.raises(ValueError, match="a: source \\(8, 4\\), destination \\(8, 5\\)"):
        mod.plan(src, mod.layout({"a": torch.randn(8, 5)}))
    overlapping = {"a": mod.TensorLayout((8, 4), torch.float32, ((((0, 5), (0, 4)),), (((3, 8), (0, 4)),)))}
    with pytest.raises(ValueError, match="overlapping but different boxes of 'a'"):
        mod.plan(overlapping, {"a": src["a"]})
    holey = {"a": mod.TensorLayout((8, 4), torch.float32, ((((0, 3), (0, 4)),), (((5, 8), (0, 4)),)))}
    with pytest.raises(ValueError, match="holds 24 of the 32 elements of 'a'"):
        mod.plan(holey, {"a": src["a"]})
    with pytest.raises(ValueError, match="not a non-empty region"):
        mod.TensorLayout((8, 4), torch.float32, ((((0, 9), (0, 4)),),))
    with pytest.raises(ValueError, match="cannot be concatenated"):
        mod.TensorLayout((8, 4), torch.float32, ((((0, 2), (0, 4)), ((2, 4), (0, 3))),))
    with pytest.raises(TypeError, match="floating"):
        mod.TensorLayout((8, 4), torch.int32, ((((0, 8), (0, 4)),),))
    with pytest.raises(ValueError, match="dtype="):
        mod.layout({"a": (8, 4)})
    with pytest.raises(ValueError, match="lacks 'b'"):
        mod.transfer(mod.plan(src, src), [{"a": w["a"]}], [mod.allocate(src, 0)])


def test_sender_and_receiver_check_their_inputs():
    """The transport's own checks, before any network: a state dict that does not match the source layout, a
    receiver connected on weights that do not match its layout, a header of another plan."""
    w = {"a": torch.randn(8, 4), "b": torch.randn(6)}
    sender = fast_ws.WeightSender(fast_ws.layout(w), destination=fast_ws.layout(w, dtype=torch.bfloat16),
                                  timeout_s=5, address="127.0.0.1")
    recipe = sender.receiver("g")
    with pytest.raises(ValueError, match="missing \\['b'\\]"):
        sender.send("g", {"a": w["a"]}, 1)
    with pytest.raises(ValueError, match="no destination named 'x'"):
        sender.send("x", w, 1)
    with pytest.raises(ValueError, match="do not match the destination layout: .*a: \\(8, 4\\) torch.float32"):
        recipe.connect(0, 1, {"a": torch.zeros(8, 4), "b": torch.zeros(6, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="1 rank"):
        recipe.connect(0, 2, fast_ws.allocate(recipe.destination, 0))
    endpoint = recipe.connect(0, 1, fast_ws.allocate(recipe.destination, 0))
    with pytest.raises(ValueError, match="not this receiver's plan"):
        endpoint.receive(1, dict(sender.header("g", 1), digest=1), fast_ws.allocate(recipe.destination, 0))
    with pytest.raises(ValueError, match="source_rank"):
        fast_ws.WeightSender(fast_ws.layout(w), source_rank=1)


# ----------------------------------------------------------------------------- the transport, real processes

def _probe(command: str, timeout: float = 300) -> dict:
    if unavailable():
        pytest.skip(unavailable())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    proc = run_isolated([sys.executable, str(ROOT / "parity" / "ws_probe.py"), command], timeout=timeout, cwd=ROOT,
                        env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, f"ws_probe {command} failed:\n{proc.stdout[-6000:]}"
    facts = json.loads(lines[-1][6:])
    print(json.dumps(facts, indent=1)[:6000])
    return facts


def test_fast_transfer_equals_the_reference_plan():
    """WeightSender -> receivers over gloo (one thread per rank): every destination rank's tensors are the
    reference's local_tensors bitwise (poisoned with NaN first), tp 1 / 2 / 4 and sharded sources 2 -> 4 and
    4 -> 2; each rank receives only its shard's bytes; staging stays within two buckets per side."""
    facts = _probe("equivalence")
    assert len(facts) == 10
    for case, f in facts.items():
        assert not f["errors"] and f["bitwise"] and f["digest_equals_ref"], (case, f)
        assert f["received_bytes"] == f["plan_bytes"], (case, f)
        source_tp = int(case.split()[1].split("->")[0])
        assert all(b <= 2 * (512 + 32) * source_tp for b in f["peak_buffers"]), (case, f)   # 2 per channel


def test_generator_refuses_a_corrupted_sync_and_never_mixes_versions():
    """A tensor-parallel generator (tp = 2, hybrid) behind the router through WeightSender.attach: the sync's
    tokens are a tp = 1 engine's with those weights; a corrupted bucket to its worker is refused whole (its
    version and live weights unchanged, the other generator loads it), the router opens it and re-syncs it;
    requests decoding while a version streams in: every step ran on one version's weights, whole, in order,
    and steps ran during the sync."""
    f = _probe("engine")
    assert f["synced"] == dict(versions=[1, 1], g_tokens=True, h_tokens=True), f["synced"]
    c = f["corrupt"]
    assert c["error"] and "reached 1 of 2" in c["error"] and "bucket 3 fails its checksum" in c["error"], c
    assert c["versions_after"] == [1, 2] and c["live_weights_unchanged"] and c["state"] == "open", c
    r = f["resynced"]
    assert r["version"] == 2 and r["g_tokens"] and "resynced" in r["events"], r
    o = f["overlap"]
    assert o["every_step_one_version"] and o["versions_in_order"] and o["labels_match_version"], o
    assert o["steps_during_sync"] >= 3 and [2, 3] in o["spans"], o      # decoding went on; a request spans the swap
    assert o["chains_ended"] and not o["errors"], o


def test_a_receiver_killed_or_stopped_mid_sync_costs_the_others_nothing():
    """Two destinations; one SIGKILLed mid-sync: the other receives everything (its bytes checked), the
    sender fails the dead one at once; a new process for it connects and syncs.  One SIGSTOPped mid-sync:
    the other finishes, the stopped one fails within the timeout; after SIGCONT it refuses that sync and
    takes the next."""
    f = _probe("receivers")
    want, timeout = f["want"], f["timeout_s"]
    for step, version in (("first", "1"), ("paced", "2"), ("after_kill", "4"), ("after_stall", "6")):
        for name in ("a", "b"):
            assert f[step][name][0] == "ok" and f[step][name][2:] == ["ok", want[version]], (step, name, f[step])
    assert f["kill"]["b"][0] == "ok" and f["kill"]["b"][2:] == ["ok", want["3"]], f["kill"]
    assert f["kill"]["a"][0].startswith("RuntimeError") and f["kill"]["a"][1] < timeout, f["kill"]
    assert f["kill"]["b"][1] < f["paced"]["b"][1] + timeout, f["kill"]     # at most one timeout lost
    assert f["stall"]["a"][0] == "ok" and f["stall"]["a"][2:] == ["ok", want["5"]], f["stall"]
    assert f["stall"]["b"][0].startswith("RuntimeError") and timeout <= f["stall"]["b"][1] < 2 * timeout + 5, f["stall"]
    assert f["stall"]["a"][1] < f["paced"]["a"][1] + timeout, f["stall"]
    assert f["stalled_receiver_said"][0] == "error" and "refused whole" in f["stalled_receiver_said"][1], f


def test_a_trainer_killed_mid_sync_leaves_the_generator_on_its_last_version():
    f = _probe("trainer")
    assert f["v1"] == [1, "sent"], f
    assert f["error"] and "refused whole (still serving version 1)" in f["error"], f
    assert f["failed_after_s"] < f["timeout_s"] + 5 and f["version_after"] == 1 and f["tokens_still_v1"], f


def test_groups_that_cannot_form_raise_within_the_timeout():
    f = _probe("nogroup")
    t = f["timeout_s"]
    assert f["no_store"] and "could not be reached within timeout_s=2" in f["no_store"] and f["no_store_s"] < 3 * t + 5
    assert f["no_receiver"] and "could not form within timeout_s=2" in f["no_receiver"] and f["no_receiver_s"] < t + 5
    assert f["no_sender"] and "could not form within timeout_s=2" in f["no_sender"] and f["no_sender_s"] < t + 5


def test_memory_is_bounded_by_the_bucket_size():
    """48 MB of fp32 weights in 1 MiB buckets: two staging buffers per side, counted by the transport; each
    process's peak RSS grows by a few buckets at most (checksum temporaries, allocator slack), not the model."""
    f = _probe("memory")
    bucket = f["bucket_bytes"]
    assert f["sender_buffers"] <= 2 * (bucket + 32) and f["receiver_buffers"] <= 2 * (bucket + 32), f
    assert f["sender_rss_growth"] < 6 * bucket and f["receiver_rss_growth"] < 6 * bucket, f
    assert f["model_bytes"] > 40 * bucket


def test_a_ray_fleet_of_tensor_parallel_generators_syncs_through_the_collective():
    """ray_generators(..., weight_transport=sender): two actors with tp = 2 engines join the trainer's channels at
    start-up (weights_path "collective"); an actor whose receiver cannot reach the store loads through the object
    store; syncs give the oracle's tokens everywhere; a corrupted bucket is refused by that actor alone and the
    router re-syncs it; an actor SIGKILLed comes back (Ray restarts it, its ranks connect again) and is re-synced
    over new channels before it serves."""
    pytest.importorskip("ray")
    f = _probe("ray", timeout=540)
    assert f["paths"] == ["collective", "collective", "object_store"], f
    assert "could not be reached within timeout_s=2" in f["solo_error"], f["solo_error"]
    everyone = ["ray-gen0", "ray-gen1", "solo0"]
    assert f["v1"] == [[name, 1, True] for name in everyone], f["v1"]
    assert f["corrupt"] == ["ray-gen0"] and f["after_corrupt"] == [1, 2, 2], f
    assert f["resynced"] == ["closed", 2], f
    state, version, new_pid, path, _ = f["restart"]
    assert (state, version, new_pid, path) == ("closed", 2, True, "collective"), f["restart"]
    events = [e for _, e, _ in f["restart_events"]]
    assert events.index("opened") < events.index("resynced") < events.index("closed"), f["restart_events"]
    assert f["v3"] == [[name, 3, True] for name in everyone], f["v3"]
