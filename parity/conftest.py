"""Shared parity machinery: device choice, seeded inputs, the tolerance rule, NaN poisoning.

Device choice
    CUDA when present: the GPU tier runs (every dtype, the large shapes).  Otherwise the
    Triton kernels run through the Triton interpreter on CPU tensors: ``TRITON_INTERPRET=1``
    is set here, before anything imports triton (``import torch`` does not; torch._dynamo
    does), and the tests use small shapes in fp32 and fp16 (the interpreter has no bf16).

The tolerance rule (CONTRIBUTING.md; FlashAttention's rule)
    Every output is compared with the reference computed in fp64 (``ref64``).  The fast
    result may be at most ``factor`` times as wrong as the reference run in the test dtype
    (``ref_lowp``: what plain PyTorch gets in that precision) plus a floor, the dtype's
    rounding noise at the output's scale::

        max|fast - ref64| <= factor * max|ref_lowp - ref64| + eps(dtype) * max|ref64|

    ``factor`` is 2 for outputs and 3 for gradients; for fp32 results computed on a GPU it is
    doubled (GPU_FP32_FACTOR: see there why).  Long recurrences add an RMS-ratio
    guard ``rms(fast - ref64) / rms(ref64) <= rms_ratio``.  NaN and inf must sit in the
    same places on both sides.  The helper prints max and mean errors of both sides, so a
    passing run still shows how much headroom it had (``pytest -s``).

Inputs
    Seeded, random, never zeros: varlen lengths with empty sequences, page pools that are
    over-allocated and shuffled, block tables that are random permutations, partly filled
    last pages whose unused slots hold NaN (a kernel that reads past ``seqused_k`` and
    multiplies by zero still turns the output into NaN, so the test sees it).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton 3.9 warns on every compile unless the FP-fusion default is stated; keep fusion on.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# TWOFOLD_EMULATE_OPENBLAS=SkylakeX: the interpreter's tl.dot rounds as OpenBLAS's AVX-512 kernels do, on
# a CPU that cannot run them (parity/openblas_emulation.py; the sweep of CONTRIBUTING.md uses it).
if INTERPRET and os.environ.get("TWOFOLD_EMULATE_OPENBLAS"):
    from openblas_emulation import install as _emulate_openblas
    _emulate_openblas(os.environ["TWOFOLD_EMULATE_OPENBLAS"])

if INTERPRET:   # (speed only: the interpreter's repeated host work per launch, skipped)
    from observatory import skip_interpreter_repeats
    skip_interpreter_repeats()

requires_gpu = pytest.mark.skipif(not ON_GPU, reason="GPU tier: needs CUDA")
needs_bf16_compute = pytest.mark.skipif(
    INTERPRET, reason="the Triton interpreter cannot compute in bf16; runs on a GPU"
)


def gpu_case(*values, id=None):
    """A parametrize entry that runs only in the GPU tier (large shapes, long sequences)."""
    return pytest.param(*values, id=id, marks=[pytest.mark.gpu, requires_gpu])


def dtype_params(*dtypes: torch.dtype):
    """fp32 and fp16 everywhere, bf16 where it can be computed (a GPU)."""
    dtypes = dtypes or (torch.float32, torch.float16, torch.bfloat16)
    params = []
    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        marks = [needs_bf16_compute] if dt == torch.bfloat16 else []
        params.append(pytest.param(dt, id=name, marks=marks))
    return params


# ----------------------------------------------------------------------------- inputs

def make_generator(seed: int) -> torch.Generator:
    """A CPU generator: inputs are drawn on the CPU and moved, so every device sees the same data."""
    return torch.Generator().manual_seed(seed)


def randn(*shape, gen: torch.Generator, dtype=torch.float32, device=DEVICE, scale=1.0, shift=0.0):
    """Seeded normal values drawn in fp64 on the CPU, then cast and moved."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift
    return x.to(dtype=dtype, device=device)


def random_lengths(n: int, max_len: int, *, gen: torch.Generator, min_len: int = 0,
                   with_empty: bool = True) -> list[int]:
    """``n`` sequence lengths in ``[min_len, max_len]``; with ``with_empty`` (and n >= 2) one is 0
    and one is ``max_len``, so the edge cases are always present."""
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    if n >= 2:
        slots = torch.randperm(n, generator=gen).tolist()
        lengths[slots[0]] = max_len
        if with_empty:
            lengths[slots[1]] = 0
    return lengths


def cu_seqlens(lengths, device=DEVICE) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int32, the layout varlen APIs take."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out.to(device)


def build_page_pool(seqs, page_size: int, *, gen: torch.Generator, extra_pages: int = 3,
                    extra_table_cols: int = 1, fill=float("nan")):
    """Scatter per-sequence tensors ``seqs[i] [L_i, ...]`` into a shuffled, over-allocated pool.

    Returns ``(pool [num_pages, page_size, ...], block_table [N, max_pages] int32,
    seqused [N] int32)``.  Pages are handed out in a random permutation of the pool, the
    pool has ``extra_pages`` pages nobody owns, slots past a sequence's length are filled
    with ``fill`` (NaN by default), and the table has ``extra_table_cols`` spare columns
    pointing at random pages (a kernel that reads them reads someone else's data).
    Several tensors sharing one table: call with the same ``gen`` state via
    ``build_page_pools``.
    """
    pools, table, used = build_page_pools([seqs], page_size, gen=gen, extra_pages=extra_pages,
                                          extra_table_cols=extra_table_cols, fill=fill)
    return pools[0], table, used


def build_page_pools(tensor_lists, page_size: int, *, gen: torch.Generator, extra_pages: int = 3,
                     extra_table_cols: int = 1, fill=float("nan")):
    """``build_page_pool`` for several per-sequence lists (K and V) that share one block table."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    lengths = [int(s.shape[0]) for s in tensor_lists[0]]
    pages_per_seq = [-(-length // page_size) for length in lengths]
    num_pages = sum(pages_per_seq) + extra_pages
    max_pages = max(pages_per_seq + [1]) + extra_table_cols
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.randint(0, num_pages, (len(lengths), max_pages), generator=gen, dtype=torch.int32)
    cursor = 0
    for i, n_pages in enumerate(pages_per_seq):
        table[i, :n_pages] = perm[cursor:cursor + n_pages].to(torch.int32)
        cursor += n_pages
    pools = []
    for seqs in tensor_lists:
        ref = seqs[0]
        pool = torch.full((num_pages, page_size, *ref.shape[1:]), fill, dtype=ref.dtype, device=ref.device)
        for i, s in enumerate(seqs):
            for p in range(pages_per_seq[i]):
                chunk = s[p * page_size:(p + 1) * page_size]
                pool[int(table[i, p]), :chunk.shape[0]] = chunk
        pools.append(pool)
    device = tensor_lists[0][0].device
    used = torch.tensor(lengths, dtype=torch.int32, device=device)
    return pools, table.to(device), used


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (floats) or a huge value (ints) before a fast call, so an
    element the kernel forgot to write fails the comparison."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return poison_(torch.empty_like(t))


@contextlib.contextmanager
def nan_allocations():
    """For ops that allocate their outputs and intermediates themselves (gradients, fla's API with
    no ``out=``): while this is active every new floating tensor from torch.empty / empty_like
    starts as NaN, so an element a kernel forgot to write, or read before writing, shows up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return poison_(t) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return poison_(t) if t.is_floating_point() else t

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


# ----------------------------------------------------------------------------- tolerance

def _floor(dtype: torch.dtype, scale: float) -> float:
    return torch.finfo(dtype).eps * max(scale, 1e-30)


# fp32 on a GPU: the first runs on one (an H200, Triton 3.6) found the compiled kernels' fp32 errors up to 3.8
# times the reference's on outputs (decode over 8k-128k keys, split or not; prefill over 8k) and up to 3.5
# times on gradients, above FlashAttention's 2 and 3, which hold for every case under the interpreter's small
# shapes (one Gated DeltaNet dg: 6 times a reference error of half an ulp at its scale, within the
# floor).  The same runs with exp, exp2, log and log2 through libdevice (correctly rounded to 1-2 ulp, instead
# of Triton's ex2.approx / lg2.approx) moved those errors by at most 16% (but one: the strong-decay dh0 of
# test_gated_deltanet_backward.py): the gap is the order of long fp32
# sums (the online softmax rescales its accumulator once per key block), not transcendental accuracy.  In
# 16-bit dtypes the storage rounding dominates and the rule is FlashAttention's.  Until a kernel-side fix
# (compensated accumulation) is measured on a GPU, fp32 on CUDA doubles the factor.
GPU_FP32_FACTOR = 2.0


def check_close(name: str, fast: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor | None, *,
                factor: float = 2.0, floor: float | None = None, rms_ratio: float | None = None,
                atol: float | None = None) -> dict:
    """The tolerance rule above.  ``ref_lowp`` is the reference run in the test dtype; pass None only
    where no low-precision run exists and give ``atol`` instead.  Returns the measured errors."""
    assert fast.shape == ref64.shape, f"{name}: shape {tuple(fast.shape)} != reference {tuple(ref64.shape)}"
    fast64 = fast.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref64.detach().to(device="cpu", dtype=torch.float64)

    nan_f, nan_r = torch.isnan(fast64), torch.isnan(ref64)
    if not torch.equal(nan_f, nan_r):
        where = (nan_f != nan_r).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: NaN pattern differs ({int(nan_f.sum())} NaN in fast, "
                             f"{int(nan_r.sum())} in reference); first differing indices {where}")
    inf_f, inf_r = torch.isinf(fast64), torch.isinf(ref64)
    if not torch.equal(inf_f, inf_r) or not torch.equal(fast64[inf_f], ref64[inf_r]):
        where = (inf_f != inf_r).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: inf pattern differs; first differing indices {where}")

    finite = torch.isfinite(ref64)
    if not finite.any():
        return {"err_fast": 0.0, "err_lowp": 0.0}
    diff = (fast64 - ref64)[finite].abs()
    scale = ref64[finite].abs().max().item()
    err_fast, mean_fast = diff.max().item(), diff.mean().item()
    if ref_lowp is not None:
        assert ref_lowp.shape == ref64.shape, f"{name}: ref_lowp shape {tuple(ref_lowp.shape)}"
        lowp64 = ref_lowp.detach().to(device="cpu", dtype=torch.float64)
        diff_lowp = (lowp64 - ref64)[finite].abs()
        err_lowp, mean_lowp = diff_lowp.max().item(), diff_lowp.mean().item()
        if fast.is_cuda and fast.dtype == torch.float32:
            factor *= GPU_FP32_FACTOR
        bound = factor * err_lowp + (floor if floor is not None else _floor(fast.dtype, scale))
    else:
        assert atol is not None, f"{name}: without ref_lowp an explicit atol is needed"
        err_lowp = mean_lowp = float("nan")
        bound = atol
    if atol is not None and ref_lowp is not None:
        bound = max(bound, atol)
    report = (f"{name}: max|fast-ref64| {err_fast:.3e} (mean {mean_fast:.3e}) | "
              f"max|lowp-ref64| {err_lowp:.3e} (mean {mean_lowp:.3e}) | bound {bound:.3e} | scale {scale:.3e}")
    print(report)
    assert err_fast <= bound, "tolerance exceeded: " + report
    out = {"err_fast": err_fast, "err_lowp": err_lowp, "bound": bound}
    if rms_ratio is not None:
        rms_ref = ref64[finite].pow(2).mean().sqrt().item()
        ratio = (fast64 - ref64)[finite].pow(2).mean().sqrt().item() / max(rms_ref, 1e-30)
        print(f"{name}: rms ratio {ratio:.3e} (limit {rms_ratio:.1e})")
        assert ratio <= rms_ratio, f"{name}: rms ratio {ratio:.3e} > {rms_ratio:.1e}"
        out["rms_ratio"] = ratio
    return out


def rms_ratio(a: torch.Tensor, ref: torch.Tensor) -> float:
    """fla's metric: ``rms(a - ref) / rms(ref)``."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return ((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def fp64(*tensors):
    """Detached fp64 copies on the same device (``None`` passes through)."""
    out = tuple(None if t is None else t.detach().to(torch.float64) for t in tensors)
    return out[0] if len(out) == 1 else out


def assert_finite(name: str, t: torch.Tensor):
    bad = ~torch.isfinite(t)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values, first at {bad.nonzero()[:3].tolist()}"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)



# ----------------------------------------------------------------------------- background runs

# What test_compile.py (the ahead-of-time builds), test_bitwise_blas.py and test_numerics_blas.py start at
# collection: jobs in background threads whose child processes run at the lowest CPU priority, so they use what
# the interpreter tests leave idle.  Each job's result is a JSON file in the run's folder (BACKGROUND_DIR: one
# per test run, carried to pytest-xdist's workers by the environment), written whole once the job is done; the
# tests read it from whichever process runs them.  One process starts the jobs: a plain run, or xdist's first
# worker, which then waits for them before it exits (its share of the tests may end first).
BACKGROUND_NICE = 19
# A job's time limit (background_process's ``timeout``) guards against a hung child only: it counts wall time from
# the job's start, and at nice 19 beside two busy test workers a job gets ~1.5% of a core (CFS weights 15 against
# 1024), so it runs mostly when the tests wait or once they are done.  A CI run killed the BLAS probe at a
# 900 s limit this way (exit -9, no report) while the tests still held both cores; it needed a few minutes alone.
BACKGROUND_TIMEOUT = 2400.0
_BACKGROUND: dict = {"jobs": [], "procs": set(), "pool": None, "own_dir": False}


def starts_background() -> bool:
    """Whether this process starts the run's background jobs: a plain run, or pytest-xdist's worker gw0."""
    return os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"


def background_dir() -> Path:
    return Path(os.environ["TWOFOLD_BACKGROUND_DIR"])


def start_job(name: str, fn) -> None:
    """Run ``fn()`` (-> a JSON-able dict) in a background thread; its result lands in <dir>/<name>.json."""
    import json
    from concurrent.futures import ThreadPoolExecutor
    if _BACKGROUND["pool"] is None:
        _BACKGROUND["pool"] = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
    path = background_dir() / f"{name}.json"

    def run():
        try:
            result = fn()
        except Exception as e:   # the reading test reports it
            result = dict(returncode=-1, log=f"background job {name} raised {type(e).__name__}: {e}")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.rename(path)
    _BACKGROUND["jobs"].append(_BACKGROUND["pool"].submit(run))


def job_result(name: str, timeout: float) -> dict:
    """The result of background job ``name``, once it is done (whichever process of this run started it)."""
    import json
    import time
    path, deadline = background_dir() / f"{name}.json", time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"background job {name} gave no result within {timeout:.0f} s ({path})")
        time.sleep(0.5)
    return json.loads(path.read_text())


def background_process(cmd: list, *, timeout: float = BACKGROUND_TIMEOUT, **popen_kw) -> dict:
    """For a job: run ``cmd`` at the lowest priority (output to a file: a full pipe would stall it), killed at
    ``timeout`` (wall seconds; see BACKGROUND_TIMEOUT) or when the session is interrupted.  -> {returncode, log};
    a child killed by a signal ends its log with a line that says which, and whether the limit sent it.

    The priority comes from nice(1), not a preexec_fn: a preexec_fn makes Python fork() the test process,
    and the kernel charges the child a copy of every private writable mapping of a parent that may hold
    gigabytes by then; once that passes the machine's memory, fork() fails with ENOMEM (it did, late in a
    make parity on a 24 GiB machine).  Without one, Python starts the child with vfork(), which copies nothing."""
    import subprocess
    import tempfile
    import time
    if shutil.which("nice"):
        cmd = ["nice", "-n", str(BACKGROUND_NICE), *cmd]
    with tempfile.TemporaryFile("w+") as out:
        start, timed_out = time.monotonic(), False
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, **popen_kw)
        _BACKGROUND["procs"].add(proc)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            returncode = proc.wait()
        finally:
            _BACKGROUND["procs"].discard(proc)
        out.seek(0)
        log = out.read()
    if returncode < 0:
        why = (f"its time limit ({timeout:.0f} s of wall time)" if timed_out else
               "not this run's time limit (the kernel's OOM killer, or the session ending)")
        log += f"\n[killed by signal {-returncode} after {time.monotonic() - start:.0f} s: {why}]\n"
    return dict(returncode=returncode, log=log)


def pytest_configure(config):
    if "TWOFOLD_BACKGROUND_DIR" not in os.environ:     # a plain run, or xdist's controller before its workers start
        import tempfile
        os.environ["TWOFOLD_BACKGROUND_DIR"] = tempfile.mkdtemp(prefix="twofold-background-")
        _BACKGROUND["own_dir"] = True


def pytest_sessionfinish(session, exitstatus):
    """The starting process waits for its jobs unless the run was interrupted (then they are killed)."""
    if exitstatus != pytest.ExitCode.INTERRUPTED:
        for job in _BACKGROUND["jobs"]:
            job.result()
    for proc in list(_BACKGROUND["procs"]):
        proc.kill()
    if _BACKGROUND["pool"] is not None:
        _BACKGROUND["pool"].shutdown(wait=True, cancel_futures=True)


def pytest_unconfigure(config):
    if _BACKGROUND["own_dir"]:
        shutil.rmtree(os.environ.pop("TWOFOLD_BACKGROUND_DIR"), ignore_errors=True)


# ----------------------------------------------------------------------------- test order

# Tests that run several processes at once (each mostly one core): they go after the others, when the
# background builds are done and a core would otherwise idle beside the single-threaded interpreter
# (test_bitwise_blas.py's probes start in the background at collection: its tests, late, read their reports).
LATE = ("test_bitwise_blas.py", "test_numerics_blas.py", "test_gpu_builds_run_the_same_arithmetic")


# What `make parity` leaves out on a CPU (`-m "not slow"`; `make parity-all` runs everything): the longer cases of
# properties it checks on fewer cases, so that it keeps near its 20 minutes on a 2-core CPU machine.  Each line
# is a node id, ``*`` matching any text; the comment says which case in make parity holds the property.
# A line that matches nothing in a collected file fails the collection (a renamed test must not slip in).
SLOW = (
    # engine == trainer bitwise: the hybrid at pages of 3; groups, prefix hits, chunks and preemption:
    # test_checkpoints.py's qwen3_5_moe_text checkpoint (Gated DeltaNet, attention, experts)
    "parity/test_batch_invariant_engine.py::test_engine_logprobs_equal_the_trainers_bitwise[attention-page4]",
    "parity/test_batch_invariant_engine.py::test_bitwise_with_groups_prefix_cache_and_chunks[*",
    # across Gated DeltaNet chunks: the reference layer's preempting run against the trainer
    "parity/test_batch_invariant_engine.py::test_bitwise_across_gated_deltanet_chunks[hybrid-every-run]",
    "parity/test_batch_invariant_engine.py::test_bitwise_across_gated_deltanet_chunks[hybrid-fast_gdn]",
    # the negative control and the layer's invariance: the hybrid, and test_gated_deltanet.py's chunk rows
    "parity/test_batch_invariant_engine.py::test_negative_control_mode_off_mismatches[attention]",
    "parity/test_batch_invariant_engine.py::test_gated_deltanet_layer_is_batch_and_split_invariant[fast*",
    # MoE: the Qwen3.5-MoE-style hybrid's engine runs (test_checkpoints.py's qwen3_5_moe_text checkpoint keeps
    # engine == trainer bitwise with groups, prefix hits, chunks and preemption on the expert kernels)
    "parity/test_batch_invariant_engine.py::test_engine_logprobs_equal_the_trainers_bitwise[hybrid-moe-page5]",
    # gpt-oss in the mode: test_checkpoints.py's gpt_oss checkpoint (groups, hits, chunks, preemption, windows
    # leaving the prompt) and the BLAS probe's gpt-oss engine
    "parity/test_batch_invariant_engine.py::test_engine_logprobs_equal_the_trainers_bitwise[gpt-oss-page3]",
    "parity/test_batch_invariant_engine.py::test_negative_control_mode_off_mismatches[hybrid-moe]",
    # tensor-parallel engine: tp = 2 in both modes (tp = 4 replicating KV heads and 2 experts a rank: the trainer's
    # SPMD test); sharded checkpoints: Qwen3-MoE's per-expert tensors and gpt-oss (the GDN shards: the moe kind)
    "parity/test_tensor_parallel.py::test_fast_engine_tensor_parallel[moe-invariant-tp4]",
    # tensor-parallel compiled: test_fast_engine_tensor_parallel_speculative runs the same hybrid at tp = 2
    # compiled on both ranks (decode steps and verifications static, preemption, a prefix hit, a weight load)
    "parity/test_tensor_parallel.py::test_fast_engine_tensor_parallel_compiled",
    # the compiled step with windows and sinks: test_engine_compile.py's cascade test (a gpt-oss-like model
    # with both, compiled, against the eager engine)
    "parity/test_engine_compile.py::test_compiled_decode_equals_eager[windows+sinks]",
    # ... and with the toy plug-in's two state rows: the gated-deltanet case's plug-in (ref/gated_deltanet.py's
    # layer: recurrent and conv states, the same hybrid layout) runs the same state-row path compiled
    "parity/test_engine_compile.py::test_compiled_decode_equals_eager[toy-linear]",
    "parity/test_tensor_parallel.py::test_fast_engine_tensor_parallel[attention-invariant-tp4]",
    # gpt-oss's sinks and windows in the mode at tp = 2 and 4: the reference model's threads (test above)
    "parity/test_tensor_parallel.py::test_fast_engine_tensor_parallel[gpt_oss-invariant-tp2-tp4]",
    "parity/test_tensor_parallel.py::test_sharded_loading_from_a_checkpoint[qwen3_5_text]",
    # checkpoints: bitwise on the Qwen3.5-MoE hybrid (GDN + attention + experts); on this repo's kernels Llama and
    # Qwen3.5-MoE's text model
    "parity/test_checkpoints.py::test_batch_invariant_engine_equals_trainer_bitwise[qwen3]",
    "parity/test_checkpoints.py::test_batch_invariant_engine_equals_trainer_bitwise[qwen3_5_text]",
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[qwen3_5]",
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[qwen3_5_text]",
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[qwen3]",
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[qwen2]",
    "parity/test_checkpoints.py::test_batch_invariant_engine_equals_trainer_bitwise[qwen3_moe]",
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[qwen3_moe]",
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[qwen3_5_moe]",
    # the default mode's kernels in the engine on a checkpoint: Llama's; the experts' and the Gated DeltaNet's:
    # gpt-oss's chunks-groups-preemption test and test_generator_engine.py's hybrid on the fast kernels
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[qwen3_5_moe_text]",
    "parity/test_checkpoints.py::test_fast_engine_on_this_repos_kernels_equals_transformers[gpt_oss]",
    # invariant attention routes: GQA with softcap and sinks in fp32, a window in fp16
    "parity/test_batch_invariant_attention.py::test_every_route_gives_the_same_bits[mha-d64-page16-*",
    "parity/test_batch_invariant_attention.py::test_every_route_gives_the_same_bits[gqa4-d100-page1-window-sinks-*",
    "parity/test_batch_invariant_attention.py::test_every_route_gives_the_same_bits[gqa4-d60-page3-softcap-sinks-float16]",
    "parity/test_batch_invariant_attention.py::test_every_route_gives_the_same_bits[gqa1-d64-page3-softcap-window-float32]",
    "parity/test_batch_invariant_attention.py::test_default_mode_is_not_invariant[float16]",
    # the fused merge: the paged fp32 cases with softcap, sinks and auto splits; split counts and mergers: the
    # shape with an empty row in fp32
    "parity/test_flash_decoding.py::test_fused_merge_is_the_merge_kernel[*-fp16]",
    "parity/test_flash_decoding.py::test_fused_merge_is_the_merge_kernel[dense-*",
    "parity/test_flash_decoding.py::test_fused_merge_is_the_merge_kernel[page1-gqa4-9-fp32]",
    "parity/test_cascade_decode.py::test_any_split_count_and_any_merger_give_the_same_bits[odd-*",
    "parity/test_cascade_decode.py::test_any_split_count_and_any_merger_give_the_same_bits[wide-*",
    # indices past 2**31: the recurrent state batch, flash_decode's batch, the varlen backward
    "parity/test_large_index.py::test_merges_past_2_31",
    "parity/test_large_index.py::test_gated_deltanet_state_batch_past_2_31[chunk]",
    # Gated DeltaNet: the fp32 cases (the fp16 chunk gradients: T = 1 and the tight T = 75 positive-gate case)
    "parity/test_gated_deltanet.py::test_chunk_rows_are_batch_and_split_invariant[fast-fp16]",
    "parity/test_gated_deltanet_backward.py::test_layer_in_the_mode_has_the_default_gradients[fast]",
    "parity/test_gated_deltanet_backward.py::test_chunk_grads_match_ref[float16-T130-*",
    "parity/test_gated_deltanet_backward.py::test_chunk_grads_match_ref[float16-T63-*",
    # a real-size checkpoint served with default arguments: Qwen3.5-0.8B's (hybrid: state slots cap the batch)
    "parity/test_memory_budget.py::test_real_size_checkpoint_with_default_arguments[qwen3-0.6b]",
    # the prefix cache's leak check: with recompute on swap
    "parity/test_prefix_cache.py::test_nothing_leaks_after_random_traffic[keep]",
    # the compiled trainer's logprobs with the varlen plug-in (two inductor compiles, about 35 s): the compiled
    # logprobs' values, the SDPA case; the varlen plug-in without a graph break, the packed-forward test
    "parity/test_compiled_trainer.py::test_token_logprobs_run_the_compiled_forward[varlen]",
    # speculative rollouts bitwise in the mode on the attention-only model: the hybrid's case (its attention layer
    # verifies through the same kernels, beside the Gated DeltaNet rollback; the BLAS probe's hybrid-moe engine
    # speculates in the mode too)
    "parity/test_speculative.py::test_speculative_rollouts_stay_bitwise_in_the_mode[attention]",
    # the ahead-of-time builds for sm_80 (about a third of the build CPU): sm_90's stay; make compile-check
    # builds every config for both
    "parity/test_compile.py::test_kernels_build_for_gpus[*-sm80]",
    # the batch-invariant mode's SASS read for sm_80 (half of the probe's 170 CPU s): sm_90's stays, the same
    # groups and the same mma.sync m16n8k16 for every attention launch (the mode's 16-row groups take no wgmma)
    "parity/test_batch_invariant_attention.py::test_gpu_builds_run_the_same_arithmetic[sm80]",
)


def _mark_slow(items) -> None:
    """On a CPU (on a GPU every case is quick: make parity runs them all)."""
    import re
    patterns = {p: re.compile(re.escape(p).replace(r"\*", ".*")) for p in SLOW}
    matched = set()
    for item in items:
        for p, rx in patterns.items():
            if rx.fullmatch(item.nodeid):
                item.add_marker(pytest.mark.slow)
                matched.add(p)
    # a line is stale when every test file was collected (make parity's run) and nothing matched it
    collected = {item.nodeid.split("::")[0] for item in items}
    every_file = {f"parity/{p.name}" for p in Path(__file__).parent.glob("test_*.py")} <= collected
    stale = [p for p in SLOW if p not in matched] if every_file else []
    if stale:
        raise pytest.UsageError(f"conftest.SLOW names tests that were not collected: {stale}")


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(session, config, items):
    """The tests of SLOW are marked ``slow``; the multi-process tests (LATE) run after the others, and the
    ahead-of-time GPU build check (test_compile.py) last ..."""
    if not ON_GPU:
        _mark_slow(items)

    def rank(item):
        if item.path.name == "test_compile.py":
            return 2
        return int(item.path.name in LATE or item.originalname in LATE)
    items.sort(key=rank)   # (stable: the order within each rank is kept)


def pytest_collection_finish(session):
    """... and its builds start now (after -k / -m deselection), in background processes: compiling
    uses the cores the single-threaded interpreter tests leave idle (and so do the BLAS-family probes of
    test_bitwise_blas.py, whose tests then read their reports)."""
    for name, start in (("test_compile.py", "start_builds"), ("test_bitwise_blas.py", "start_probes"),
                        ("test_numerics_blas.py", "start_runs")):
        items = [item for item in session.items if item.path.name == name]
        if items and not session.config.option.collectonly and starts_background():
            getattr(items[0].module, start)(items)   # what the selected tests read, in the background
    _start_progress(session)


# ----------------------------------------------------------------------------- progress

_PROGRESS: dict = {}


def _start_progress(session):
    import collections
    import time
    now = time.monotonic()
    _PROGRESS.update(remaining=collections.Counter(item.location[0] for item in session.items), counts={},
                     start=now, file_start=now,
                     reporter=session.config.pluginmanager.get_plugin("terminalreporter"))


@pytest.hookimpl(trylast=True)   # after the terminal reporter wrote this test's dot
def pytest_runtest_logreport(report):
    """One summary line per test file as it finishes ("[ 3/14] parity/test_x.py: 35 passed, 4 skipped
    in 52 s, 8.1 min so far"), so a long CPU run (the interpreter tier takes minutes) can be followed."""
    if not _PROGRESS:
        return
    path = report.location[0]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "failed" if report.failed else ("skipped" if report.skipped else "passed")
        counts = _PROGRESS["counts"].setdefault(path, {})
        counts[outcome] = counts.get(outcome, 0) + 1
    if report.when != "teardown":
        return
    remaining = _PROGRESS["remaining"]
    remaining[path] -= 1
    if remaining[path] or _PROGRESS["reporter"] is None:
        return
    import time
    now = time.monotonic()
    done = sum(1 for n in remaining.values() if n <= 0)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(_PROGRESS["counts"].get(path, {}).items()))
    writer = _PROGRESS["reporter"]._tw             # the dots of -q share its line: start a new one
    if writer.width_of_current_line:
        writer.line()
    _PROGRESS["reporter"].write_line(f"[{done:2d}/{len(remaining)}] {path}: {summary} in "
                                     f"{now - _PROGRESS['file_start']:.0f} s, "
                                     f"{(now - _PROGRESS['start']) / 60:.1f} min so far")
    _PROGRESS["file_start"] = now


# ----------------------------------------------------------------------------- the sanitizer

@pytest.fixture(scope="module")
def one_intra_op_thread():
    """For the engine tests (``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``): an engine
    runs in its own thread, and two OpenMP teams on a 2-core shared machine oversubscribe it (parallel
    regions then stall); these models are too small to gain from intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def interpreter_sanitizer():
    """In the interpreter tier, every Triton kernel a test launches runs under the observatory's bounds
    check (parity/observatory.py, cheap mode: no unique-address sets): an active lane outside every
    tensor argument of its launch raises OutOfBounds, and fails the test at teardown even if the test
    swallowed the exception.  ``TWOFOLD_SANITIZE=0`` turns it off (to measure what it costs)."""
    if not INTERPRET or os.environ.get("TWOFOLD_SANITIZE", "1") == "0":
        yield None
        return
    from observatory import observe
    with observe(unique=False) as obs:
        yield obs
    assert not obs.violations, "out-of-bounds accesses:\n" + "\n".join(obs.violations)


def on_threads(fns: list) -> list:
    """Run one function per rank, each on its own thread (decoder_lm.py's LocalGroup ranks meet at a barrier);
    their results in order, or the first error raised."""
    out, errors = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out
