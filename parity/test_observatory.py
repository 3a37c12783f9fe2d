"""The observatory's instrument (parity/observatory.py) against kernels whose counts are known exactly.

Each trivial kernel below has a traffic and FLOP count that can be written down by hand: a copy,
a kernel that re-reads its input, a masked load, atomics, a dot.  The sanitizer must stop a
planted out-of-bounds read and an index computed in int32 past 2^31 (the same kernel with an
int64 index must pass), naming the kernel, the argument, the offset and the program id.  The
recorded specialization must match what Triton's JIT specializes on, and build for sm_90.  Bytes are
attributed to the program that issued them, and the latency model (``LatencyModel``) gives, on
synthetic launches, the value its formula states.  The report's MoE case (bench/roofline.py) is checked at a
tiny shape: its IO bound is its formula and our kernels issue at least it; bench/peers.py's stand-in for the
peers' align op gives the layout vLLM documents.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from conftest import INTERPRET
from observatory import H100, LatencyModel, Launch, OutOfBounds, both_ends, observe

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the observatory instruments the Triton interpreter")
ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _copy_kernel(x, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y + o, tl.load(x + o, mask=m), mask=m)


@triton.jit
def _reread_kernel(x, y, REPEAT: tl.constexpr, BLOCK: tl.constexpr):
    # every program reads all of x REPEAT times and writes one sum
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(REPEAT):
        acc += tl.load(x + o)
    tl.store(y + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _even_lanes_kernel(x, y, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    v = tl.load(x + o, mask=o % 2 == 0, other=0.0)
    tl.store(y + o, v)


@triton.jit
def _atomic_count_kernel(counter, x, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(counter + tl.zeros([BLOCK], dtype=tl.int32), tl.load(x + o))   # BLOCK lanes, one address


@triton.jit
def _dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    o_m, o_n, o_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    b_a = tl.load(a + o_m[:, None] * K + o_k[None, :])
    b_b = tl.load(b + o_k[:, None] * N + o_n[None, :])
    tl.store(c + tl.program_id(0) * M * N + o_m[:, None] * N + o_n[None, :], tl.dot(b_a, b_b))


@triton.jit
def _off_by_one_kernel(x, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o + 1, mask=o < n), mask=o < n)     # reads x[n] in the last program


@triton.jit
def _row_gather_kernel(x, y, stride, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    # row r of a [rows, stride] matrix: the int32 product r * stride wraps past 2^31 unless widened
    row = tl.program_id(0)
    if WIDE:
        row = row.to(tl.int64)
    o = tl.arange(0, BLOCK)
    tl.store(y + tl.program_id(0) * BLOCK + o, tl.load(x + row * stride + o))


@triton.jit(do_not_specialize=["n_plain"])
def _signature_kernel(x, n16, n17, n_one, n_plain, scale, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n16 + n17 + n_one + n_plain
    tl.store(x + o, tl.load(x + o, mask=m) * scale, mask=m)


def _only(obs):
    assert len(obs.launches) == 1, [r.kernel for r in obs.launches]
    return obs.launches[0]


def test_the_cached_builtin_lookup_patches_what_the_interpreters_does():
    """conftest.py installs observatory.skip_interpreter_repeats: each launch must patch the same attributes of the
    same objects as the interpreter's own lookup, with already-patched ones skipped as it skips them."""
    from triton.runtime import interpreter as interp
    from observatory import skip_interpreter_repeats
    assert skip_interpreter_repeats()
    cached, uncached = interp._patch_builtin, interp._patch_builtin.uncached
    pkgs = [tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base]

    def patched(patch):
        scope = interp._LangPatchScope()
        try:
            for pkg in pkgs + pkgs:          # twice: the second pass finds every member already patched
                patch(pkg, interp.interpreter_builder, scope)
            return [(id(obj), name) for obj, name, _ in scope._changes]
        finally:
            scope.restore()
    want = patched(uncached)
    assert len(want) > 100
    assert patched(cached) == want       # its first use: the names looked up and kept
    assert patched(cached) == want       # then the kept names
    x = torch.arange(10, dtype=torch.float32)
    y = torch.full_like(x, float("nan"))
    _copy_kernel[(3,)](x, y, 10, BLOCK=4)       # and a launch through it computes
    assert torch.equal(x, y)


@triton.jit
def _twice_plus_one(x):
    return x * 2.0 + 1.0


@triton.jit
def _helper_loop_kernel(x, y, ITERS: tl.constexpr, BLOCK: tl.constexpr, RAISE: tl.constexpr = False):
    if RAISE:
        tl.arange(0, 3)             # not a power of two: raises inside the launch
    o = tl.arange(0, BLOCK)
    acc = tl.load(x + o)
    for _ in range(ITERS):
        acc = _twice_plus_one(acc)
    tl.store(y + o, acc)


def test_a_helper_inside_a_launch_is_not_patched_again():
    """skip_interpreter_repeats skips the interpreter's full patch at a helper's call inside a launch (the
    launch's is in place): every call of the helper then gets an empty patch, the builtins are the plain
    ones again once the launch is over, even one that raised, and the results are the helper's."""
    from triton.runtime import interpreter as interp
    from observatory import skip_interpreter_repeats
    assert skip_interpreter_repeats()
    scopes = []
    patch_lang = interp._patch_lang

    def recording(fn):                     # (the helper's name, the attributes its patch changed)
        scope = patch_lang(fn)
        scopes.append((fn.__name__, len(scope._changes)))
        return scope
    interp._patch_lang = recording
    try:
        x = torch.arange(8, dtype=torch.float32)
        y = torch.empty_like(x)
        _helper_loop_kernel[(1,)](x, y, ITERS=3, BLOCK=8)
        assert torch.equal(y, ((x * 2 + 1) * 2 + 1) * 2 + 1)
        names = [name for name, _ in scopes]
        assert names == ["_helper_loop_kernel"] + ["_twice_plus_one"] * 3, names
        assert scopes[0][1] > 100                                          # the launch's own patch
        assert all(changed == 0 for _, changed in scopes[1:])              # nothing more at the helper's calls
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)   # restored
        with pytest.raises(Exception, match="power of 2"):
            _helper_loop_kernel[(1,)](x, y, ITERS=1, BLOCK=8, RAISE=True)
        scopes.clear()
        _helper_loop_kernel[(1,)](x, y, ITERS=1, BLOCK=8)                  # the next launch patches afresh
        assert [changed > 100 for _, changed in scopes] == [True, False]
        assert tl.core.is_builtin(tl.load)
    finally:
        interp._patch_lang = patch_lang


def test_the_cached_dtype_lookup_answers_as_the_interpreters():
    from triton.runtime import interpreter as interp
    from observatory import skip_interpreter_repeats
    assert skip_interpreter_repeats()
    cached, uncached = interp._get_np_dtype, interp._get_np_dtype.uncached
    types = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
             tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float8e5, tl.float8e4nv, tl.pointer_type(tl.float32),
             tl.pointer_type(tl.int8), tl.block_type(tl.float16, [4, 8]), tl.block_type(tl.pointer_type(tl.int32), [4])]
    for _ in range(2):                     # the first pass fills the cache, the second reads it
        assert [cached(t) for t in types] == [uncached(t) for t in types]


def test_copy_counts_every_byte_once():
    n, block = 1000, 128                         # 8 programs, the last one masked past 1000
    x = torch.randn(n)
    y = torch.empty(n)
    with observe() as obs:
        _copy_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block)
    r = _only(obs)
    assert torch.equal(x, y)
    assert (r.kernel, r.grid, r.programs_run) == ("_copy_kernel", (8, 1, 1), 8)
    assert (r.read_bytes, r.write_bytes) == (4 * n, 4 * n)
    assert (r.unique_read_bytes, r.unique_write_bytes) == (4 * n, 4 * n)
    assert r.dot_flops == 0 and r.atomics == 0


def test_rereads_issue_more_than_unique():
    block, repeat, programs = 64, 3, 5
    x = torch.randn(block, dtype=torch.float16)
    y = torch.empty(programs)
    with observe() as obs:
        _reread_kernel[(programs,)](x, y, REPEAT=repeat, BLOCK=block)
    r = _only(obs)
    assert r.read_bytes == programs * repeat * block * 2
    assert r.unique_read_bytes == block * 2
    assert (r.write_bytes, r.unique_write_bytes) == (programs * 4, programs * 4)


def test_masked_lanes_cost_nothing():
    x = torch.randn(64)
    y = torch.empty(64)
    with observe() as obs:
        _even_lanes_kernel[(1,)](x, y, BLOCK=64)
    r = _only(obs)
    assert (r.read_bytes, r.unique_read_bytes) == (32 * 4, 32 * 4)
    assert (r.write_bytes, r.unique_write_bytes) == (64 * 4, 64 * 4)


def test_atomics_read_and_write_each_lane():
    block, programs = 16, 4
    counter = torch.zeros(1, dtype=torch.int32)
    x = torch.ones(block * programs, dtype=torch.int32)
    with observe() as obs:
        _atomic_count_kernel[(programs,)](counter, x, BLOCK=block)
    r = _only(obs)
    assert counter.item() == block * programs
    lanes = block * programs
    assert r.atomics == lanes
    assert r.read_bytes == 4 * lanes + 4 * lanes             # the loads of x, then the atomics' reads
    assert r.write_bytes == 4 * lanes
    assert (r.unique_read_bytes, r.unique_write_bytes) == (4 * lanes + 4, 4)


def test_dot_flops():
    m, n, k, programs = 16, 32, 64, 3
    a = torch.randn(m, k, dtype=torch.float16)
    b = torch.randn(k, n, dtype=torch.float16)
    c = torch.empty(programs, m, n)
    with observe() as obs:
        _dot_kernel[(programs,)](a, b, c, M=m, N=n, K=k)
    r = _only(obs)
    torch.testing.assert_close(c[2], a.float() @ b.float(), rtol=1e-3, atol=1e-3)
    assert r.dot_flops == programs * 2 * m * n * k
    assert r.read_bytes == programs * (m * k + k * n) * 2
    assert r.unique_read_bytes == (m * k + k * n) * 2


def test_planted_out_of_bounds_read_fails():
    n, block = 100, 32
    x = torch.randn(n)
    y = torch.empty(n)
    with pytest.raises(OutOfBounds) as info, observe(unique=False):
        _off_by_one_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block)
    text = str(info.value)
    for part in ("_off_by_one_kernel", "'x'", "byte offset +400", "program id (3, 0, 0)"):
        assert part in text, text


def test_int32_index_overflow_is_caught():
    """Rows of a > 2^31-element buffer (int8: 2 GiB, allocated lazily, three rows touched): the int32
    product row * stride wraps at row 2, and the sanitizer names it; widened to int64 it passes."""
    stride, rows, block = 2 ** 30, 3, 16
    x = torch.empty(rows * stride, dtype=torch.int8)
    assert x.numel() > 2 ** 31
    for r in range(rows):
        x[r * stride:r * stride + block] = r + 1
    y = torch.zeros(rows * block, dtype=torch.int8)
    with pytest.raises(OutOfBounds) as info, observe(unique=False):
        _row_gather_kernel[(rows,)](x, y, stride, BLOCK=block, WIDE=False)
    text = str(info.value)
    for part in ("_row_gather_kernel", "'x'", "before its start", "program id (2, 0, 0)"):
        assert part in text, text
    with observe(unique=False) as obs:
        _row_gather_kernel[(rows,)](x, y, stride, BLOCK=block, WIDE=True)
    assert y.view(rows, block).tolist() == [[r + 1] * block for r in range(rows)]
    assert _only(obs).read_bytes == rows * block


def test_program_filter_runs_both_ends():
    n, block = 64 * 20, 64
    x = torch.randn(n)
    y = torch.zeros(n)
    with observe(programs=both_ends(2)) as obs:
        _copy_kernel[(n // block,)](x, y, n, BLOCK=block)
    r = _only(obs)
    ran = [0, 1, 18, 19]
    assert r.programs_run == len(ran)
    assert r.read_bytes == len(ran) * block * 4
    for i in range(n // block):
        chunk = slice(i * block, (i + 1) * block)
        assert torch.equal(y[chunk], x[chunk] if i in ran else torch.zeros(block))


def test_nested_observations_record_in_the_innermost():
    x = torch.randn(256)
    y = torch.empty(256)
    with observe(unique=False) as outer:
        with observe() as inner:
            _copy_kernel[(2,)](x, y, 256, BLOCK=128)
        _copy_kernel[(2,)](x, y, 256, BLOCK=128)
    assert len(inner.launches) == 1 and inner.launches[0].unique_bytes == 2048
    assert len(outer.launches) == 1 and outer.launches[0].unique_bytes is None


@torch.library.custom_op("observatory_test::halve", mutates_args=())
def _halve(x: torch.Tensor) -> torch.Tensor:
    return (x / 2).to(torch.float16)          # two ops inside a custom op: the counter must see them


@_halve.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float16)


def test_torch_ops_between_kernels():
    """Each PyTorch op reads its inputs and writes its outputs once; views and allocations are free;
    a custom op's body is looked into; an op inside a launch (the interpreter's copies) is not one."""
    x = torch.randn(1000)                                    # 4000 bytes
    y = torch.empty(1000)
    with observe(torch_ops=True) as obs:
        z = x.view(10, 100).t()                              # free
        w = z.to(torch.float16)                              # read 4000, write 2000
        y.zero_()                                            # write 4000
        y.add_(x)                                            # read 8000, write 4000
        h = _halve(x)                                        # div: 4000 + 4000, to: 4000 + 2000
        _copy_kernel[(8,)](x, y, 1000, BLOCK=128)            # a kernel: 4000 + 4000
    got = [(r.kernel, r.read_bytes, r.write_bytes) for r in obs.launches]
    assert got == [("torch._to_copy", 4000, 2000), ("torch.zero_", 0, 4000), ("torch.add_", 8000, 4000),
                   ("torch.div", 4000, 4000), ("torch.to", 4000, 2000), ("_copy_kernel", 4000, 4000)], got
    assert w.shape == (100, 10) and h.dtype == torch.float16


def test_specialization_as_the_jit_sees_it():
    x = torch.randn(64)
    with observe() as obs:
        _signature_kernel[(1,)](x, 16, 17, 1, 32, 0.5, BLOCK=64)
    r = _only(obs)
    assert r.signature == {"x": "*fp32:16", "n16": "i32:16", "n17": "i32", "n_one": "constexpr",
                           "n_plain": "i32", "scale": "fp32"}
    assert r.constexprs == {"n_one": 1, "BLOCK": 64}
    assert (r.num_warps, r.num_stages) == (4, 3)


def test_recorded_launch_builds_for_sm90():
    """The static side: a fast kernel's recorded launch, built by parity/aot_compile.py in a process
    without the interpreter, with its SASS counted and its occupancy modelled."""
    from fast.flash_decoding import merge_attention_states
    out = torch.randn(2, 3, 4, 64, dtype=torch.float16)
    lse = torch.randn(2, 4, 3)
    with observe() as obs:
        merge_attention_states(out, lse, out, lse)
    r = _only(obs)
    assert r.kernel == "_merge_states_kernel" and r.grid == (24, 1, 1)
    assert r.signature["T"] == "i32" and r.constexprs["HEAD_DIM"] == 64 and r.num_warps == 1
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path[:0] = sys.argv[1:3]; import aot_compile; "
            "print(json.dumps(aot_compile.build_launch(json.loads(sys.argv[3]))))")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(ROOT / "parity"), json.dumps(r.spec())],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    static = json.loads(proc.stdout.strip().splitlines()[-1])
    assert static["ok"], static
    assert static["reg"] > 0 and static["sass"] > 0 and static["local"] == 0 and static["hgmma"] == 0
    # one warp and few registers: the 32-blocks-per-SM limit binds, 32 of 64 warp slots filled
    assert (static["blocks_per_sm"], static["occupancy"]) == (32, 0.5)
    assert static["waves"] == pytest.approx(24 / (32 * 132))


# ----------------------------------------------------------------------------- per-program bytes, latency model

def test_bytes_are_attributed_to_the_program_that_issued_them():
    """Each program of the copy kernel loads and stores its own block; the last one is masked past n.
    Per-program bytes sum to the launch's issued bytes, ids linear as on a GPU (x fastest)."""
    n, block = 1000, 128
    x = torch.randn(n)
    y = torch.empty(n)
    with observe() as obs:
        _copy_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block)
    r = _only(obs)
    assert r.program_bytes == {**{i: 2 * 4 * block for i in range(7)}, 7: 2 * 4 * (n - 7 * block)}
    assert sum(r.program_bytes.values()) == r.issued_bytes
    x2 = torch.randn(2, 3, 64)
    y2 = torch.empty(6 * 64)
    with observe() as obs:                     # a 2-D grid: program (i, j) copies row 3 i + j
        _grid2d_copy_kernel[(2, 3)](x2, y2, BLOCK=64)
    r = _only(obs)
    assert torch.equal(y2, x2.flatten())
    assert r.program_bytes == {i + 2 * j: 2 * 4 * 64 for i in range(2) for j in range(3)}


@triton.jit
def _grid2d_copy_kernel(x, y, BLOCK: tl.constexpr):
    o = (tl.program_id(0) * 3 + tl.program_id(1)) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o))


def _synthetic(program_bytes, grid, unique, issued=None):
    issued = sum(program_bytes.values()) if issued is None else issued
    return Launch(kernel="synthetic", module="test", file="", grid=grid, read_bytes=issued, write_bytes=0,
                  unique_read_bytes=unique, unique_write_bytes=0, program_bytes=dict(program_bytes))


MODEL = LatencyModel(name="test", sms=4, hbm_bytes_per_s=4e9, l2_bytes_per_s=8e9, l2_bytes=1e6, launch_us=3.0)


def test_latency_model_is_its_formula():
    """launch + max(busiest SM's bytes / (HBM / SMs), unique / HBM + reread / L2), by hand, on a model
    with 4 SMs, 4 GB/s of HBM (1 GB/s an SM, i.e. 1 byte a ns), 8 GB/s of L2 and 3 us per launch."""
    # Memory-bound: four even programs, every byte read twice.  SM term 1000 B / 1 GB/s = 1 us;
    # memory 2000 B / 4 GB/s + 2000 B / 8 GB/s = 0.75 us.  max = 1 us.
    r = MODEL.launch(_synthetic({i: 1000 for i in range(4)}, (4, 1, 1), unique=2000))
    assert r["sm_us"] == pytest.approx(1.0) and r["memory_us"] == pytest.approx(0.75)
    assert r["us"] == pytest.approx(3.0 + 1.0)
    # Rereads bound it: 4 x 1000 B issued of 1000 B unique: 0.25 + 3000 / 8000 = 0.625 us < 1 us.
    # The same bytes with 12000 of them reread: 0.25 + 11000 / 8000 us = 1.625 us > the SM term.
    r = MODEL.launch(_synthetic({i: 3000 for i in range(4)}, (4, 1, 1), unique=1000))
    assert r["sm_us"] == pytest.approx(3.0) and r["memory_us"] == pytest.approx(0.25 + 11000 / 8000)
    assert r["us"] == pytest.approx(3.0 + 3.0)
    r = MODEL.launch(_synthetic({i: 1000 for i in range(4)}, (4, 1, 1), unique=1000, issued=13000))
    assert r["us"] == pytest.approx(3.0 + 0.25 + 12000 / 8000)
    # Unique bytes past the L2's 1 MB: rereads come from HBM.
    big = 4_000_000
    r = MODEL.launch(_synthetic({i: big for i in range(4)}, (4, 1, 1), unique=2 * big))
    assert r["memory_us"] == pytest.approx((2 * big + 2 * big) / 4e9 * 1e6)
    # An op: the sum of its kernels; the torch ops apart, launch + bytes / HBM each.
    torch_op = Launch(kernel="torch.add", module="torch", file="", read_bytes=8000, write_bytes=4000,
                      unique_read_bytes=8000, unique_write_bytes=4000)
    one = _synthetic({0: 1000}, (1, 1, 1), unique=1000)
    total = MODEL.total([one, torch_op, one])
    assert total["us"] == pytest.approx(2 * (3.0 + 1.0)) and total["launches"] == 2
    assert total["torch_ops_us"] == pytest.approx(3.0 + 3.0) and total["torch_ops"] == 1


def test_one_program_is_bound_by_one_sms_share():
    """However few its bytes against the whole GPU's bandwidth, one program gets one SM's share: the
    model charges a launch that leaves SMs idle by its busiest program.  H100: 1 MB in one program is
    1e6 / (3.35e12 / 132) s = 39.4 us, against 0.30 us for the memory system."""
    r = H100.launch(_synthetic({0: 1_000_000}, (1, 1, 1), unique=1_000_000))
    assert r["sm_us"] == pytest.approx(1e6 / (3.35e12 / 132) * 1e6)
    assert r["memory_us"] == pytest.approx(1e6 / 3.35e12 * 1e6)
    assert r["us"] == pytest.approx(H100.launch_us + r["sm_us"])
    # The same megabyte in 132 programs of equal share: the memory system's time, the SM term equal to it.
    even = H100.launch(_synthetic({i: 1_000_000 / 132 for i in range(132)}, (132, 1, 1), unique=1_000_000))
    assert even["sm_us"] == pytest.approx(even["memory_us"])
    assert r["us"] - H100.launch_us == pytest.approx(132 * (even["us"] - H100.launch_us))


def test_programs_past_one_wave_share_an_sm():
    """More programs than SMs: dealt out in launch order to the least-loaded SM, so 2 x SMs equal
    programs put two on each SM, and one heavy program among them sits alone while the rest fill in."""
    assert MODEL.busiest_sm_bytes({i: 100 for i in range(8)}, 8) == 200
    assert MODEL.busiest_sm_bytes({i: 100 for i in range(9)}, 9) == 300
    # program 0 (1000 B) takes SM 0; the next 12 light ones go to SMs 1-3 until they pass it
    heavy = {0: 1000, **{i: 100 for i in range(1, 13)}}
    assert MODEL.busiest_sm_bytes(heavy, 13) == 1000
    # programs that touched no memory (absent from the dict) still take their turn
    assert MODEL.busiest_sm_bytes({4: 100, 5: 100}, 6) == 100
    r = MODEL.launch(_synthetic({i: 100 for i in range(9)}, (9, 1, 1), unique=900))
    assert r["busiest_sm_bytes"] == 300 and r["sm_us"] == pytest.approx(0.3) and r["programs"] == 9


def test_latency_model_needs_unique_bytes():
    with pytest.raises(ValueError, match="unique"):
        MODEL.launch(Launch(kernel="k", module="m", file="", grid=(1, 1, 1), read_bytes=8))


def _roofline():
    """bench/roofline.py (the report), for its MoE case; bench/peers.py comes with it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import roofline
    return roofline


def test_moe_case_bound_and_traffic():
    """bench/roofline.py's MoE case at a tiny shape: the IO bound is its formula (every touched expert's W1
    [2I, H] and W2 [H, I] once, x and out, the logits, int32 ids and fp32 weights), our six kernels run in
    order, and in both modes they issue at least the unique bytes, which are at least the bound."""
    import fast.moe as moe
    roofline = _roofline()
    t, e, k, h, i = 5, 8, 2, 32, 16
    case = roofline.Moe({"moe": moe}, t, experts=e, top_k=k, hidden=h, ffn=i)
    touched = torch.topk(case.logits.float(), k, dim=1).indices.unique().numel()
    assert case.touched == touched and 1 < touched <= e
    assert case.bound == touched * 3 * i * h * 2 + 2 * t * h * 2 + t * e * 2 + t * k * 8
    outputs = []
    for impl in ("ours", "ours_invariant"):
        m = roofline.measure(case, impl)
        assert [r.kernel for r in m.first if r.module != "torch"] == [
            "_route_kernel", "_count_kernel", "_align_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"]
        s = roofline.summarize(case, m)
        assert s["issued"] >= s["unique"] >= case.bound, (impl, s)
        outputs.append(m.outputs[0].float())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-2, atol=1e-3)


def test_peers_moe_align_layout():
    """bench/peers.py's stand-in for the peers' moe_align_block_size CUDA op gives the layout of vLLM's
    docstring example: each expert's pairs in order, padded to the block with numel, an id per block."""
    _roofline()
    import peers
    heard = []

    def hear(*op):
        heard.append(op)
    peers.COMPILED_OP_HOOKS.append(hear)
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, blocks, total = (torch.empty(n, dtype=torch.int32) for n in (27, 7, 1))   # vLLM's buffer sizes
    try:
        peers.align_block_size("vLLM", ids, 5, 4, sorted_ids, blocks, total)
    finally:
        peers.COMPILED_OP_HOOKS.remove(hear)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert blocks[:4].tolist() == [1, 2, 3, 4] and total.item() == 16
    assert heard == [("vLLM moe_align_block_size (CUDA op, emulated)", 12 * 4, (27 + 7 + 1) * 4)]


def test_report_plot_draws_every_implementation(tmp_path, monkeypatch):
    """bench/roofline.py's plot with a bar for every implementation it knows (a colour and a legend entry
    each: with the MoE peers there are more than tab10's ten colours)."""
    from types import SimpleNamespace
    roofline = _roofline()
    monkeypatch.setattr(roofline, "PLOT", tmp_path / "roofline.png")
    per_impl = {impl: {"summary": {"issued_over_bound": 1.0 + n / 10}} for n, impl in enumerate(roofline.IMPLS)}
    roofline.plot([(SimpleNamespace(short="every\nimpl"), per_impl)])
    assert (tmp_path / "roofline.png").stat().st_size > 0
