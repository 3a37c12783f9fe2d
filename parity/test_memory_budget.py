"""The engines size their caches from a memory budget (issue 39), as vLLM and SGLang do.

1. Real sizes on this CPU: Qwen3-0.6B- and Qwen3.5-0.8B-shaped checkpoints (random bf16 weights, the released
   configs with their max_position_embeddings of 40960 and 262144) served by ``Generator.from_pretrained(path,
   model_class=DecoderLM)`` with default arguments, in a child process under an address-space limit (a
   regression then fails the test, not the machine): the pools stay within the budget, which stays within
   the limit, and the engine decodes.  Before the budget the first one asked for 32 x 40960 tokens of KV.
2. The arithmetic for an 80 GB GPU (no GPU needed: the device's free / total memory are parameters): both
   checkpoints' shapes in bf16 hold their whole context there, the old default would not have fitted.
3. Too small a budget is a ValueError naming the budget, the bytes per token and the largest context that
   fits, before any pool is allocated; explicit sizes beyond the budget too; bad arguments raise.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fast.decoder_lm as fast_lm
import fast.generator_engine as fast_ge
import ref.gated_deltanet as gdn
import ref.generator_engine as ref_ge
from conftest import ON_GPU
from hf_models import REAL_SIZES, write_real_size_checkpoint

ROOT = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
AS_LIMIT = 14 * GIB          # the child's address space: torch and its libraries, the weights, the pools


def _child(path: str) -> None:
    """The child: serve the checkpoint with default arguments, decode 4 tokens for 2 requests, print FACTS."""
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    with fast_ge.Generator.from_pretrained(path, model_class=fast_lm.DecoderLM,
                                           linear_layer=gdn.GatedDeltaNet) as gen:
        done = gen.generate([fast_ge.Request([5, 17, 2, 9, 11, 3, 8, 1], fast_ge.SamplingParams(max_new_tokens=4)),
                             fast_ge.Request([7, 7, 1], fast_ge.SamplingParams(max_new_tokens=4))])
        stats = gen.stats()
        facts = dict(stats, tokens=[d.token_ids for d in done], max_batch_size=gen.max_batch_size,
                     num_checkpoints=gen.num_checkpoints, model_max_seq_len=gen.config.max_seq_len,
                     weights=sum(p.nbytes for p in gen.model.parameters()))
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    facts.update(vm_peak=int(status["VmPeak"].split()[0]) * 1024, rss_peak=int(status["VmHWM"].split()[0]) * 1024)
    print("FACTS " + json.dumps(facts))


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    """shape -> the directory of a real-size random checkpoint of it, written on first use."""
    root = tmp_path_factory.mktemp("real-size")

    def path(shape):
        if not (root / shape).exists():
            write_real_size_checkpoint(shape, root / shape)
        return root / shape
    return path


@pytest.mark.skipif(ON_GPU, reason="the CPU's budget (the GPU's is checked by arithmetic below and on a GPU)")
@pytest.mark.parametrize("shape", list(REAL_SIZES))
def test_real_size_checkpoint_with_default_arguments(real_checkpoint, shape):
    script = (f"import sys; sys.path[:0] = [{str(ROOT / 'parity')!r}, {str(ROOT)!r}]; import conftest; "
              f"import test_memory_budget as t; t._child({str(real_checkpoint(shape))!r})")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, (
        f"{shape}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    f = json.loads(lines[-1][6:])
    pools = f["kv_pool_bytes"] + f["state_slot_bytes"] + f["checkpoint_capacity_bytes"]
    print(f"\n{shape}: budget {f['memory_budget_bytes'] / GIB:.2f} GiB ({f['memory_budget_source']}); KV "
          f"{f['kv_pool_bytes'] / GIB:.2f} GiB = {f['kv_tokens']} tokens at {f['kv_bytes_per_token']} B, state slots "
          f"{f['state_slot_bytes'] / GIB:.2f} GiB x{f['max_batch_size']}, checkpoints "
          f"{f['checkpoint_capacity_bytes'] / GIB:.2f} GiB x{f['num_checkpoints']}; max_seq_len {f['max_seq_len']} "
          f"of {f['model_max_seq_len']}; weights {f['weights'] / GIB:.2f} GiB; peak RSS {f['rss_peak'] / GIB:.2f} GiB, "
          f"address space {f['vm_peak'] / GIB:.2f} of {AS_LIMIT / GIB:.0f} GiB")
    assert f["model_max_seq_len"] == REAL_SIZES[shape]["max_position_embeddings"]
    assert 0 < pools <= f["memory_budget_bytes"] <= 0.9 * 0.5 * AS_LIMIT
    assert f["kv_tokens"] >= f["max_seq_len"] >= 2
    assert all(len(t) == 4 for t in f["tokens"])
    if "linear_num_value_heads" in REAL_SIZES[shape]:   # Qwen3.5: ~19 MB of state a sequence caps the slots
        assert f["max_batch_size"] < fast_ge.DEFAULT_MAX_BATCH_SIZE and f["num_checkpoints"] >= 1
        assert f["state_slot_bytes"] <= f["memory_budget_bytes"] / 4


def _sizes(shape: str, dtype=torch.bfloat16) -> dict:
    """(weight bytes, KV bytes per token, linear state bytes per sequence, max_seq_len) of a real shape."""
    c = fast_lm.ModelConfig.from_hf(REAL_SIZES[shape])
    model = fast_lm.DecoderLM(c, linear_layer=gdn.GatedDeltaNet, device="meta", dtype=dtype)
    weights = sum(p.nbytes for p in model.parameters())
    per_token = 2 * c.kinds.count("attention") * c.num_kv_heads * c.head_dim * dtype.itemsize
    state = 0
    if "linear" in c.kinds:   # one layer at the real size, probed as the engine probes it
        one_layer = SimpleNamespace(config=SimpleNamespace(kinds=("linear",), hidden_size=c.hidden_size),
                                    layers=[SimpleNamespace(linear_attn=gdn.GatedDeltaNet(**c.linear_layer_sizes(),
                                                                                          dtype=dtype))])
        shapes = fast_ge._linear_state_shapes(one_layer)[0]
        state = c.kinds.count("linear") * sum(torch.Size(s).numel() * d.itemsize for s, d in shapes.values())
    return dict(weights=weights, per_token=per_token, state=state, max_seq_len=c.max_seq_len)


@pytest.mark.parametrize("shape", list(REAL_SIZES))
def test_budget_arithmetic_on_an_80gb_gpu(shape):
    """An 80 GB GPU (H100: 79.1 GiB usable, 0.5 GiB held by the CUDA context), the model's weights held,
    a profiled activation peak of 2 GiB (the prefill of 8192 tokens; measured on a GPU by the engine):
    the whole released context fits, and the old default (32 sequences of max_seq_len) would not have."""
    s = _sizes(shape)
    free, total = 79.1 * GIB - s["weights"], 79.1 * GIB
    budget, source = fast_ge._memory_budget(torch.device("cuda"), kv_cache_memory=None, memory_utilization=0.9,
                                            weight_bytes=s["weights"], activation_bytes=2 * GIB,
                                            device_memory=(free, total, s["weights"] + GIB // 2))
    assert budget == int(0.9 * total - 2 * s["weights"] - GIB // 2 - 2 * GIB), source
    plan = fast_ge.plan_memory(budget, source, kv_bytes_per_token=s["per_token"], state_bytes_per_sequence=s["state"],
                               page_size=16, model_max_seq_len=s["max_seq_len"],
                               checkpoints_wanted=s["state"] > 0)
    held = plan.kv_bytes + plan.state_bytes + plan.checkpoint_bytes
    print(f"\n{shape} on 80 GB: budget {budget / GIB:.1f} GiB, KV {plan.kv_bytes / GIB:.1f} GiB "
          f"({plan.num_pages * 16} tokens), {plan.max_batch_size} slots, {plan.num_checkpoints} checkpoints; "
          f"the old default: {32 * s['max_seq_len'] * s['per_token'] / GIB:.0f} GiB of KV")
    assert held <= budget and plan.max_seq_len == s["max_seq_len"] == REAL_SIZES[shape]["max_position_embeddings"]
    assert 32 * s["max_seq_len"] * s["per_token"] > total          # what the first run used to ask for
    # a GPU that others already use: asking for 0.9 of it is refused with the numbers
    with pytest.raises(ValueError, match="memory_utilization=0.9 asks for .* GiB are free"):
        fast_ge._memory_budget(torch.device("cuda"), kv_cache_memory=None, memory_utilization=0.9,
                               weight_bytes=s["weights"], activation_bytes=0, device_memory=(40 * GIB, total, 0))


def _tiny(hybrid=False, max_seq_len=256):
    kinds = ("linear", "attention") if hybrid else None
    c = fast_lm.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16, max_seq_len=max_seq_len, layer_types=kinds,
                            linear_num_k_heads=1, linear_num_v_heads=2, linear_head_k_dim=8, linear_head_v_dim=8)
    return fast_lm.DecoderLM(c, linear_layer=gdn.GatedDeltaNet if hybrid else None)


class _NoBigAllocation:
    """Fails on any torch.zeros of more than 10^5 elements inside (a pool allocated before the checks)."""

    def __enter__(self):
        self.real = torch.zeros

        def zeros(*shape, **kw):
            size = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
            assert torch.Size(size).numel() <= 10 ** 5, f"allocated {tuple(size)} before refusing"
            return self.real(*shape, **kw)
        torch.zeros = zeros
        return self

    def __exit__(self, *exc):
        torch.zeros = self.real


@pytest.mark.parametrize("ge", [fast_ge, ref_ge], ids=["fast", "ref"])
def test_too_small_budget_is_a_clear_error_before_allocating(ge):
    model = _tiny()
    per_token = 2 * 2 * 1 * 16 * 4                           # K and V, 2 attention layers, 1 head of 16, fp32
    with _NoBigAllocation(), pytest.raises(ValueError) as err:
        ge.Generator(model, kv_cache_memory=100 * per_token, max_seq_len=200)
    text = str(err.value)
    assert f"kv_cache_memory={100 * per_token}" in text and f"{per_token} bytes per token" in text
    assert "largest context that fits is" in text
    assert "max_seq_len=200" in text
    # the default max_seq_len is capped by the budget instead
    with ge.Generator(model, kv_cache_memory=100 * per_token) as gen:
        assert gen.stats()["max_seq_len"] <= 100
        assert len(gen.generate([ge.Request([1, 2, 3], ge.SamplingParams(max_new_tokens=200))])[0].token_ids) \
            == gen.stats()["max_seq_len"] - 3
    with _NoBigAllocation(), pytest.raises(ValueError, match="not even one sequence|largest context"):
        ge.Generator(model, kv_cache_memory=per_token)
    for bad in (dict(kv_cache_memory=0), dict(kv_cache_memory=1.5e9), dict(memory_utilization=0),
                dict(memory_utilization=1.5), dict(memory_utilization=True), dict(max_seq_len=0)):
        with pytest.raises(ValueError):
            ge.Generator(model, **bad)
    with pytest.raises(ValueError, match="longer than the model's"):
        ge.Generator(model, max_seq_len=257)


def test_fast_explicit_sizes_must_fit_and_hybrid_slots_are_budgeted():
    model = _tiny(hybrid=True)
    with fast_ge.Generator(model, kv_cache_memory=2 ** 20) as gen:
        st, plan = gen.stats(), gen.memory
        per_seq = plan.state_bytes_per_sequence
        assert per_seq > 0 and st["state_slot_bytes"] == plan.max_batch_size * per_seq
        assert plan.kv_bytes + plan.state_bytes + plan.checkpoint_bytes <= 2 ** 20
        assert plan.num_checkpoints <= plan.num_pages
        out = gen.generate([fast_ge.Request(list(range(1, 40)), fast_ge.SamplingParams(max_new_tokens=5))])
        assert len(out[0].token_ids) == 5
    with _NoBigAllocation(), pytest.raises(ValueError, match="explicit num_pages"):
        fast_ge.Generator(model, kv_cache_memory=2 ** 20, num_pages=10 ** 5)
    with _NoBigAllocation(), pytest.raises(ValueError, match="explicit num_pages"):
        fast_ge.Generator(model, kv_cache_memory=2 ** 20, max_batch_size=10 ** 4)
