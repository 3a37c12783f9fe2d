"""Turn the recorded benchmark rows into bench/README.md's tables and plots.

    python bench/report.py                    # rewrite bench/README.md's block + bench/results/*.png (make report)
    python bench/report.py --print            # print the tables of the committed CSVs instead
    python bench/report.py --print --latest   # print the tables of the last run (bench/results/latest/)

Rows are long-format (one number per row: case, impl, metric, value, unit; see harness.py).
For each feature and each device class, each *case family* shows the newest run that measured it,
as a small table (cases that share a prefix, listed in FAMILIES below with a one-line caption: what is
measured, its unit, what good looks like).  A family with a ``compare`` metric is pivoted: one
row per case, one column per implementation, and the ratio ``ref / fast`` (or ``fast / ref``
for higher-is-better metrics) as a speedup column, in bold where fast loses; other families list every metric of every
(case, impl).  Counts print as integers.  Plots (matplotlib, a bench-only dependency) are drawn
where a person would rather look than read, and are embedded in the block ("Latest measured numbers").
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import re
import sys
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "bench" / "README.md"   # the tables' page; the top-level README links to it
BEGIN, END = "<!-- bench-tables:begin -->", "<!-- bench-tables:end -->"


@dataclasses.dataclass(frozen=True)
class Family:
    prefix: str                 # cases starting with this belong here (the longest matching prefix wins)
    title: str
    caption: str                # what is measured, the unit, what good looks like
    compare: str | None = None  # pivot this metric by impl, with a speedup column
    higher_is_better: bool = False
    baseline: str = "ref"       # the speedup column is baseline vs "fast"


FAMILIES: dict[str, list[Family]] = {
    "paged_varlen_attention": [
        Family("device", "Device ceilings", "What this GPU measured itself: bf16 matmul TFLOP/s and copy GB/s; "
               "every kernel row below is a fraction of one of them."),
        Family("prefill", "Prefill forward", "Causal packed (or paged) prefill, bf16, D = 128, GQA 32/8: ms and "
               "TFLOP/s; speedup_vs_<peer> > 1 means fast wins."),
        Family("mixed", "Serving step", "Prefill chunks and decode rows in one launch over a paged cache: ms; "
               "speedup_vs_<peer> > 1 means fast wins."),
        Family("train", "Training (forward + backward)", "Autograd step, bf16, causal GQA 32/8, 16k packed "
               "tokens: ms and TFLOP/s (3.5x the forward's FLOPs); target >= 0.9x PyTorch varlen_attn."),
        Family("cpu", "Reference on CPU", "The reference's own speed on a small fp32 case (no kernel runs "
               "on a CPU): ms.", compare="ms"),
    ],
    "flash_decoding": [
        Family("device", "Device ceilings", "What this GPU measured itself: copy GB/s and bf16 matmul TFLOP/s."),
        Family("B", "Decode", "One query token per sequence over a paged bf16 cache (page 16, D = 128): ms, GB/s "
               "of the minimum bytes (K and V read once) and its fraction of copy bandwidth; speedup_vs_<peer> > 1 "
               "means fast wins."),
    ],
    "gated_deltanet": [
        Family("fwd T", "Chunk forward", "Prefill, bf16, K = V = 128, H = 16: ms and TFLOP/s (algorithmic "
               "count); target >= 1.0x fla."),
        Family("fwd varlen", "Chunk forward, varlen", "32k tokens in several documents: ms and TFLOP/s; "
               "target >= 1.0x fla."),
        Family("fwd+bwd", "Training (forward + backward)", "ms, TFLOP/s, peak memory beside fla's; targets "
               ">= 1.0x fla speed, peak memory <= fla's."),
        Family("decode", "Recurrent decode", "One token, fp32 state read and written once: ms, GB/s of the "
               "minimum bytes; target >= 70% of copy bandwidth at batch >= 64."),
        Family("cpu ref", "Reference on CPU", "The reference's own speed on small fp32 cases (no kernel runs on "
               "a CPU): ms per call."),
    ],
    "view_replay_offload": [
        Family("cpu hooks", "Hook cost and memory freed on CPU", "Microseconds of pack + unpack work per saved "
               "tensor of a small block stack (identity hooks are the floor of any Python hook; lower is better), "
               "beside what it buys: the activation KiB one step's autograd graph still holds in place between "
               "forward and backward (device memory on a GPU; identity hooks hold what no offloading holds; on a "
               "CPU save_on_cpu's copy is a no-op) and the KiB copied out; counts per step."),
        Family("bf16", "Training step on GPU", "Step time, peak activation memory and bytes moved per step; "
               "targets: peak cut >= 50%, step overhead <= 10%, >= 1.3x faster than save_on_cpu."),
    ],
    "routed_generator": [
        Family("overhead n=", "Router overhead", "CPU microseconds the router adds per request (instant fake "
               "generators), by fleet size and policy; lower is better, fast vs ref > 1 means fast is cheaper.",
               compare="overhead_cpu"),
        Family("overhead_queued", "Router overhead with a full fleet", "As above with in-flight caps, so "
               "requests wait in the router's queue: us per request.", compare="overhead_cpu"),
        Family("throughput", "Fleet throughput", "Requests/s through the router over simulated generators of "
               "known capacity; of_capacity near 100% means the router never starves a generator."),
        Family("policy", "Policies under a slow generator", "One generator 5x slower: p50 / p99 latency and "
               "the slow generator's share of requests; caps keep the tail short."),
        Family("staleness", "Policy staleness", "Weight syncs while serving: versions a completion spans "
               "(span) and how far behind the newest it finished (lag); drain keeps span at 0."),
        Family("engine", "Engine tokens/s on CPU", "Generated tokens per second of one engine on a CPU, by "
               "batch size; fast (continuous batching) vs ref (one request at a time).", compare="tokens_per_s",
               higher_is_better=True),
        Family("sync", "Weight sync pause", "Milliseconds to load new weights: hot_swap stages them while "
               "decoding continues (stall is the pause seen by requests), drain waits for in-flight requests."),
        Family("ray tokens", "Fleet tokens/s: Ray actors vs in-process", "Tokens/s through 1, 2 and 4 engines, "
               "as in-process threads and as Ray actors on a local cluster.  This machine has 2 cores, so more "
               "engines cannot add throughput here; the rows show what Ray's transport costs."),
        Family("ray sync", "Fleet weight sync", "Milliseconds for a hot_swap sync and for a drain sync, in-process "
               "vs Ray (each version goes to the object store once, every actor loads it from there)."),
        Family("ray restart", "Fleet recovery", "Seconds from SIGKILL of a Ray actor to its return at the current "
               "weight version (restart, re-sync, probe)."),
        Family("invariant engine", "Batch-invariant mode: engine", "Generated tokens/s of the fast engine with "
               "this repo's attention kernels, mode off (default) and on (batch_invariant), and the slowdown. On a "
               "CPU the kernels run in the Triton interpreter, so these rows say nothing about a GPU; "
               "default[torch-attn] is the engine's own PyTorch attention."),
        Family("invariant trainer", "Batch-invariant mode: trainer", "Forward + backward of DecoderLM over packed "
               "sequences, mode off and on (same attention kernels), ms, and the slowdown."),
        Family("invariant linear", "Batch-invariant mode: the matmul", "x [M, K] @ W^T: F.linear vs the "
               "invariant product (one row and 8 columns at a time on a CPU), us per call, and the slowdown."),
        Family("grpo engine", "GRPO groups and the prefix cache: engine", "32 prompts x n = 8 samples behind a "
               "shared 128-token system prompt (prompts 256-1,024 tokens, completions 32-128), the 4-layer model on "
               "a CPU with torch attention: prompt tokens requested and actually computed (lower computed_frac is "
               "better; target <= 0.15), generated tokens/s and the prefill / decode seconds."),
        Family("grpo router", "GRPO samples through the router", "The same samples as 256 plain requests over two "
               "engines: the prefix-cache hit rate (hit tokens / prompt tokens; higher is better, at most 7/8 "
               "plus the system prompt's share; target >= 0.85 with prefix_affinity) and prompt tokens computed."),
        Family("grpo trainer", "GRPO recompute in the trainer", "token_logprobs forward + backward over the same "
               "samples: prompts shared once per group (share_prompts=True) vs whole sequences: tokens through the "
               "model and CPU seconds (lower is better)."),
        Family("chunked prefill", "Chunked prefill", "The largest and the median gap (ms) between two decode "
               "steps of running requests while a prompt of 8x the token budget arrives, chunked vs whole; "
               "lower is better."),
    ],
    "decoder_lm": [
        Family("checkpoint", "Real checkpoint sizes on a CPU", "Hugging Face checkpoints of Qwen3-0.6B's and "
               "Qwen3.5-0.8B's shapes (random weights, bf16 on disk, loaded in fp32): load seconds in a fresh "
               "process, the weights' bytes beside the process's anonymous memory after the load (the checkpoint "
               "is memory-mapped) and its peak, decode tokens/s of the fast engine at 1 and 16 requests, and the "
               "KV pool and linear-state checkpoint bytes."),
        Family("tp", "Tensor parallelism on a CPU", "Generator(model, tensor_parallel_size=N) decoding over gloo "
               "on loopback: mean step ms, the bytes on the wire per token (counted) beside the prediction, and "
               "what one rank contributes per layer and step; invariant = the batch-invariant mode's reduction "
               "tree (its step time is the Triton interpreter's on a CPU)."),
        Family("compiled trainer", "The trainer compiled on a CPU", "A trainer's step (forward on 512 tokens "
               "packed in 4 documents, cross-entropy, backward; hidden 256, 4 layers, fp32, SDPA) eagerly and "
               "under torch.compile(model, fullgraph=True): median ms of alternating steps, the first compiled "
               "step's seconds, and the speedup (eager / compiled; target >= 1), at 1 thread and every core."),
        Family("engine decode step", "The engine's decode step compiled on a CPU", "One decode iteration of the "
               "fast engine (scheduling, forward, sampling) on a Qwen3-0.6B-deep model of negligible arithmetic "
               "(28 layers, hidden 128, fp32, one thread), eager and Generator(compile=True), each in a fresh "
               "process with an empty inductor cache: median ms, Python's calls into torch per iteration, the "
               "first run's seconds (compiles included) and the speedup (targets: >= 3x, <= 300 calls)."),
        Family("engine verification step", "The engine's speculative verification compiled on a CPU", "An "
               "iteration of the fast engine whose work is speculative verification alone (k = 4 drafts a sample, "
               "B (k + 1) rows; the same model, thread and fresh processes as the decode step's table): eager (the "
               "prefill pass) and through the compiled static step (StaticDecode.verify): median ms, Python's "
               "calls into torch per iteration, the first run's seconds and the speedup."),
        Family("engine MTP drafts", "The MTP head's drafts compiled on a CPU", "One call of the fast engine's "
               "MTP drafter (MTPDrafter.propose: k = 4 drafts a sample; the same model with one head layer, thread "
               "and fresh processes as the decode step's table): eager (a head call and a read-back per depth) and "
               "through the compiled static step (StaticDecode.draft: every depth in one call, one read-back): "
               "median ms, Python's calls into torch per call, the first run's seconds (every compile of the "
               "engine: decode, verification, drafts) and the speedup."),
        Family("speculative", "Speculative decoding on a CPU", "Acceptance (accepted / proposed drafts), target "
               "forwards per generated token, and the verifications by drafts accepted, all on the fast engine: "
               "n-gram drafting (k = 4) on 8 prompts repeating a phrase; Qwen3.5's MTP head (k = 3, a tiny hybrid) "
               "untrained and after 300 steps of mtp_loss on the model's own completions of 16 prompts, on 8 "
               "held-out prompts and on those 16; and decode tokens/s at a Qwen3.5-0.8B-shaped model (random "
               "weights, fp32, the reference Gated DeltaNet layer, 24-token prompts, 48 new tokens), plain, with "
               "drafts of plain decoding's own tokens (all accepted, or one planted error each: every rejection "
               "runs the linear layers again over the accepted rows) and with an untrained MTP head (its drafts "
               "rejected: what drafting costs).  Tokens equal plain decoding's in every run."),
        Family("speculative GPU", "Speculative decoding on a GPU", "The fast engine with this repo's kernels at a "
               "Qwen3-0.6B shape (random weights, bf16), B greedy requests of 128 + 128 tokens: tokens/s of plain "
               "decoding replayed from CUDA graphs, and of drafts of its own tokens (k = 4, all accepted, or one "
               "planted error each) whose verifications replay CUDA graphs too; speedup over plain."),
        Family("observatory Qwen3-0.6B decode layer", "The decode layer's elementwise work fused, in the kernel "
               "observatory", "One Qwen3-0.6B decoder layer's decode step (fp16, random weights, flash_decode over "
               "a paged cache of 1,024 keys a request) run by the kernel observatory: Triton kernels interpreted "
               "and counted, every PyTorch op between them a launch of its own (on a GPU each is a kernel, or a "
               "host-side check a CUDA graph would not replay), priced by the H100 latency model (2 us a launch "
               "plus bytes); unfused: the four RMSNorms, the rotary and SwiGLU as PyTorch ops, flash_decode "
               "appending the new K and V; fused: fast/decoder_lm.py's three kernels (residual add + RMSNorm, q/k "
               "norm + rotary: q's and k's heads in one launch, which also writes the new K and V into the paged "
               "cache, as an engine's step does; SwiGLU).  Not a GPU measurement."),
        Family("modeled GPU speculative step", "The speculative decode step on an H100, modeled", "Not a "
               "measurement: the verification of B samples' k drafts (B (k + 1) rows, the weights read once) priced "
               "as the modeled decode step below plus a compute bound (FLOPs over 989 TFLOPS bf16), drafts accepted "
               "independently with an assumed probability a, so a verification emits (1 - a^(k+1)) / (1 - a) tokens; "
               "the MTP head's k depths each read one decoder layer and the lm_head; 'captured' verifies as one "
               "replay of the compiled step's kernels (built since: StaticDecode.verify under cuda_graphs=True, not "
               "yet run on a GPU), 'eager pass' in the prefill pass (beside a prompt's prefill, the batch-invariant "
               "mode, sliding layers through a plug-in without window_size; host-bound at 5 us a torch call); "
               "the MTP head's depths captured too ('mtp captured': built since, StaticDecode.draft) or eager on "
               "the host ('mtp captured verification': a head that lags, the fallback).  speedup = tokens per "
               "second over the graph of the compiled plain decode step's."),
        Family("engine GPU decode", "The engine's decode on a GPU: eager against CUDA graphs", "A Qwen3-0.6B-shaped "
               "model (random weights, bf16) with this repo's kernels, B requests of 128 + 128 tokens: decode step "
               "ms and tokens/s, eager and Generator(cuda_graphs=True), beside the memory floor (the weights and "
               "192 keys of K and V a request over the measured copy bandwidth)."),
        Family("modeled GPU decode step", "The decode step on an H100, modeled", "Not a measurement: counts "
               "taken on the CPU (the eager iteration's torch calls, the static step's kernels) priced at 5 us "
               "of host time per call and the observatory's 2 us per kernel, plus bytes (bf16 weights once, K "
               "and V of 1,024 keys a request) over 3.35 TB/s; eager = max(host, device), graph = device, floor "
               "= bytes only; over_floor = step / floor (the target at Qwen3-8B, B = 16: <= 1.3x).  'graph' "
               "counts the static step's torch ops (its in-file attention, its visibility mask built once a "
               "step, no fusion); 'graph of the compiled "
               "step' inductor's kernels; 'graph, this repo's kernels' what a CUDA graph of the uncompiled step "
               "replays on a GPU with flash_decode as the attention plug-in and fast/decoder_lm.py's fused "
               "elementwise kernels, the KV append in the q + k launch (counted in the kernel observatory: each "
               "Triton launch and each torch op "
               "between them, the value checks a capture skips left out)."),
    ],
    "moe": [
        Family("routing", "MoE routing: engine against trainer", "R3's measurement for this repo's stack: a "
               "Qwen3-MoE-shaped model (128 experts, top 8, 4 layers at hidden 256) serves 8 requests on the fast "
               "engine and the trainer recomputes them: the fraction of (token, layer) pairs whose expert set "
               "differs (completion tokens: the engine's decode; prompt tokens: its prefill), the fraction of "
               "completion tokens with a changed set in some layer, and the largest logprob difference; default "
               "mode in bf16 and fp32, the batch-invariant mode in fp32 (its attention kernels in the "
               "interpreter), whose figures are 0."),
        Family("layers", "Qwen3-30B-A3B's layers on a CPU", "Two decoder layers of Qwen3-30B-A3B's shapes (128 "
               "experts of FFN 768, top 8, hidden 2048; vocab 4,096), bf16, loaded from a checkpoint with one "
               "tensor per expert in a fresh process: load seconds, the weights' bytes beside the load's peak "
               "memory, decode tokens/s of the fast engine at 1 and 16 requests (ref/moe.py's experts)."),
    ],
    "weight_sync": [
        Family("sync", "Weight sync", "A state dict from a trainer process to N generator processes on one "
               "machine (gloo over loopback; the object store through shared memory, not a network): seconds "
               "(lower is better), GB/s delivered, x_raw_broadcast (targets: <= 1.5), extra memory per side "
               "(target: <= two buckets) and the bytes each rank receives."),
        Family("sync 1GB", "Weight sync: 1 GB to N generators", "1 GiB of bf16 (64 tensors of 16 MiB) from a trainer "
               "process to N generator processes on one machine: gloo over loopback (collective, raw_broadcast), "
               "the object store through shared memory (one node: no network).  seconds (lower is better), GB/s "
               "delivered to all, x_raw_broadcast (target <= 1.5), extra memory per side (target <= two buckets)."),
        Family("sync qwen3.5-0.8b", "Weight sync: Qwen3.5-0.8B-shaped", "The text model's tensors as an fp32 "
               "master, cast to bf16 on the way (1.5 GB per generator), to N generators of one rank or two of two "
               "tensor-parallel ranks (bytes_per_rank: each rank's shard, beside full_bytes; the tied embedding is "
               "replicated on every rank).  Same machine and metrics as above."),
        Family("sync decode gap", "Weight sync while decoding", "A generator process decoding 8 requests while a "
               "sync of its 0.5 GB of weights streams in: the largest gap between two decode steps during the "
               "sync, beside the median step and the largest before it (ms; 2 cores shared by trainer, "
               "receiver and engine)."),
    ],
}


# ----------------------------------------------------------------------------- loading

# bench/roofline.py (the kernel observatory) writes its own block of bench/README.md from its CSV.
OWN_REPORT = {"roofline"}


def load_rows(directory: Path = RESULTS) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(p for p in directory.glob("*.csv") if p.stem not in OWN_REPORT):
        with path.open() as f:
            out[path.stem] = list(csv.DictReader(f))
    return out


def _device_class(device: str) -> str:
    """Every CPU is one class (CPU rows measure overheads, and older CPU runs ran older code);
    each GPU model is its own."""
    return "cpu" if device.lower().startswith("cpu") else device


def latest_runs(feature: str, rows: list[dict]) -> list[list[dict]]:
    """For each device class, newest first: each case family's rows from the newest run that measured
    it (so a run of one part of a benchmark, e.g. ``--part invariant``, updates its own tables and
    leaves the others at their last recording)."""
    keys = [(_device_class(r["device"]), family_of(feature, r["case"]).prefix) for r in rows]
    newest: dict[tuple, str] = {}
    for key, r in zip(keys, rows):
        newest[key] = max(newest.get(key, ""), r["run_id"])
    by_class: dict[str, list[dict]] = {}
    for (cls, fam), r in zip(keys, rows):
        if newest[(cls, fam)] == r["run_id"]:
            by_class.setdefault(cls, []).append(r)
    return sorted(by_class.values(), key=lambda run: max(r["run_id"] for r in run), reverse=True)


def family_of(feature: str, case: str) -> Family:
    matches = [f for f in FAMILIES.get(feature, []) if case.startswith(f.prefix)]
    if matches:
        return max(matches, key=lambda f: len(f.prefix))
    word = re.split(r"[\s=-]", case, maxsplit=1)[0]
    return Family(word, word, "(no caption: add this family to FAMILIES in bench/report.py)")


# ----------------------------------------------------------------------------- tables

def fmt(value: str, unit: str = "") -> str:
    """Integral values (counts, syncs, tokens) as integers with thousands separators; others with
    three significant digits, or two decimals between 1 and 100."""
    try:
        v = float(value)
    except ValueError:
        return value
    if v != v:
        return "n/a"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _pivot(rows: list[dict], fam: Family) -> list[str]:
    """One row per case, one column per impl of ``fam.compare``, and baseline vs fast."""
    unit = next((r["unit"] for r in rows if r["metric"] == fam.compare), "")
    impls: OrderedDict[str, None] = OrderedDict()
    cells: OrderedDict[str, dict] = OrderedDict()
    for r in rows:
        if r["metric"] == fam.compare:
            impls.setdefault(r["impl"], None)
            cells.setdefault(r["case"], {})[r["impl"]] = float(r["value"])
    fasts = [i for i in impls if i.startswith("fast")] if fam.baseline in impls else []
    head = [f"{impl} ({unit})" if unit else impl for impl in impls]
    head += [f"{f} vs {fam.baseline} (x)" for f in fasts]
    lines = ["| case | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for case, vals in cells.items():
        row = [fmt(str(vals[i]), unit) if i in vals else "" for i in impls]
        for f in fasts:
            base, mine = vals.get(fam.baseline), vals.get(f)
            if not base or not mine:
                row.append("")
                continue
            ratio = mine / base if fam.higher_is_better else base / mine
            row.append(f"**{ratio:.2f}**" if ratio < 1 else f"{ratio:.2f}")   # bold: fast loses
        lines.append(f"| {case} | " + " | ".join(row) + " |")
    return lines


def _listing(rows: list[dict]) -> list[str]:
    """One row per (case, impl), one column per metric present in this family."""
    columns: OrderedDict[str, None] = OrderedDict()
    cells: OrderedDict[tuple, dict] = OrderedDict()
    for r in rows:
        key = (r["case"], r["impl"])
        cells.setdefault(key, {})
        if r["metric"] == "missing":
            cells[key]["note"] = "missing: " + r["unit"]
            columns.setdefault("note", None)
            continue
        col = f"{r['metric']} ({r['unit']})" if r["unit"] else r["metric"]
        columns.setdefault(col, None)
        cells[key][col] = fmt(r["value"], r["unit"])
    cols = list(columns)
    lines = ["| case | impl | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for (case, impl), vals in cells.items():
        lines.append(f"| {case} | {impl} | " + " | ".join(vals.get(c, "") for c in cols) + " |")
    return lines


def tables(feature: str, run: list[dict]) -> str:
    head = max(run, key=lambda r: r["run_id"])
    groups: OrderedDict[Family, list[dict]] = OrderedDict()
    for r in run:
        groups.setdefault(family_of(feature, r["case"]), []).append(r)
    parts = [f"*{head['device']}, torch {head['torch']}, triton {head['triton']}, "
             f"commit {head['commit']}, {head['date']}*"]
    for fam, rows in groups.items():
        body = _pivot(rows, fam) if fam.compare else _listing(rows)
        older = rows[0]
        where = "" if older["device"] == head["device"] else f", {older['device']}"   # (one CPU class, many CPUs)
        when = ("" if older["run_id"] == head["run_id"]
                else f" *(recorded {older['date']}, commit {older['commit']}{where})*")
        parts.append(f"**{fam.title}.**{when} {fam.caption}\n\n" + "\n".join(body))
    return "\n\n".join(parts)


def render(directory: Path = RESULTS, *, gpu_only: bool = False, features=None, plots=()) -> str:
    parts = []
    for feature, rows in load_rows(directory).items():
        if features and feature not in features:
            continue
        runs = [run for run in latest_runs(feature, rows)
                if not (gpu_only and _device_class(run[0]["device"]) == "cpu")]
        if not runs:
            continue
        body = "\n\n".join(tables(feature, run) for run in runs)
        for png, caption in plots:
            if png.name.startswith(feature):
                body += f"\n\n![{caption}](results/{png.name})"
        parts.append(f"### {feature}\n\n{body}")
    if not parts:
        return "_No GPU run has been recorded yet._" if gpu_only else "_No benchmark has been recorded yet._"
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- plots

def _series(rows, case_re: str, metric: str):
    """{(label, impl): [(x, value), ...]} for cases matching ``case_re`` (groups: x, optional label)."""
    out: dict[tuple, list] = {}
    for r in rows:
        m = re.fullmatch(case_re, r["case"])
        if m and r["metric"] == metric:
            label = m.groupdict().get("label") or ""
            out.setdefault((label, r["impl"]), []).append((float(m.group("x")), float(r["value"])))
    return {k: sorted(v) for k, v in out.items()}


def draw_plots(all_rows: dict[str, list[dict]]) -> list[tuple[Path, str]]:
    """PNG files under bench/results/ from the newest CPU or GPU run of each feature; returns
    (path, caption) of each plot drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    drawn = []
    # Every plot tells ref from fast by colour and by label (and by line style); grey is a baseline.
    impl_color = {"ref": "#d95f02", "fast": "#1b65b0"}

    def color_of(impl):
        return next((c for prefix, c in impl_color.items() if impl.startswith(prefix)), "#7f7f7f")

    def save(fig, name, caption):
        fig.tight_layout()
        path = RESULTS / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        drawn.append((path, caption))

    def line_plot(name, caption, series, xlabel, ylabel, *, better, logx=False):
        """One line per (label, impl): colour and style by impl, marker by label; the legend lists
        fast's lines in its first column and ref's in its second."""
        if not series:
            return
        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
        labels = sorted({label for label, _ in series})
        markers = dict(zip(labels, "osD^vP*X"))
        order = sorted(series, key=lambda key: (not key[1].startswith("fast"), key[1], key[0]))
        for label, impl in order:
            xs, ys = zip(*series[(label, impl)])
            ax.plot(xs, ys, marker=markers[label], color=color_of(impl),
                    linestyle="-" if impl.startswith("fast") else "--", label=f"{impl}: {label}" if label else impl)
        if logx:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(sorted({x for pts in series.values() for x, _ in pts})))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{ylabel}\n({better} is better)")
        ax.set_ylim(bottom=0)
        ax.set_title(caption, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(order) > 4 else 1)
        save(fig, name, caption)

    def offload_plot(name, caption, run):
        """Left: what offloading costs in time; right: what it buys in memory, per impl."""
        def values(metric):
            return {r["impl"]: float(r["value"]) for r in run if r["metric"] == metric}, \
                next((r["unit"] for r in run if r["metric"] == metric), "")
        cpu = any(r["metric"] == "hook_time_per_saved_tensor" for r in run)
        (time_v, time_unit), (mem_v, mem_unit) = (
            (values("hook_time_per_saved_tensor"), values("activations_in_place")) if cpu
            else (values("step_time"), values("peak_activation_mem")))
        if not time_v or not mem_v:
            return
        baseline = "identity_hooks" if cpu else "none"
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(8.4, 3.6), dpi=110)
        for ax, vals, unit, what in ((ax_t, time_v, time_unit, "time: hook work per saved tensor" if cpu
                                      else "time: training step"),
                                     (ax_m, mem_v, mem_unit, "memory: activations held in place until backward"
                                      if cpu else "memory: peak activations")):
            impls = list(vals)
            bars = ax.bar(range(len(impls)), list(vals.values()), color=[color_of(i) for i in impls])
            for bar, impl in zip(bars, impls):
                v = vals[impl]
                text = f"{v:.3g}"
                if ax is ax_m and mem_v.get(baseline):
                    text += f"\n{v / mem_v[baseline]:.0%}"
                ax.text(bar.get_x() + bar.get_width() / 2, v, text, ha="center", va="bottom", fontsize=8)
            ticks = [f"{i}\n(no-op on CPU)" if cpu and i == "save_on_cpu" and ax is ax_m else i for i in impls]
            ax.set_xticks(range(len(impls)), ticks, fontsize=8)
            ax.set_ylabel(f"{unit} (lower is better)")
            ax.set_title(what, fontsize=9)
            ax.set_ylim(0, max(vals.values()) * 1.25 or 1)
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle(caption, fontsize=10)
        save(fig, name, caption)

    for feature, rows in all_rows.items():
        for run in latest_runs(feature, rows)[:1]:
            if feature == "routed_generator":
                line_plot("routed_generator_overhead", "Router overhead per request vs fleet size (CPU)",
                          _series(run, r"overhead n=(?P<x>\d+) (?P<label>\w+)", "overhead_cpu"),
                          "generators in the fleet", "us per request", better="lower", logx=True)
                line_plot("routed_generator_engine", "Engine tokens/s vs batch (CPU)",
                          _series(run, r"engine cpu b=(?P<x>\d+) .*", "tokens_per_s"),
                          "requests in flight", "tokens/s", better="higher", logx=True)
            elif feature == "view_replay_offload":
                where = "CPU" if _device_class(run[0]["device"]) == "cpu" else run[0]["device"]
                offload_plot("view_replay_offload_hooks",
                             f"Offloading: the time it costs beside the activation memory it frees ({where})", run)
    return drawn


# ----------------------------------------------------------------------------- README

def update_readme(block: str) -> bool:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"bench/README.md lacks the markers {BEGIN} ... {END}")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    new = before + BEGIN + "\n" + block + "\n" + END + after
    if new != text:
        README.write_text(new)
        return True
    return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the tables instead of writing bench/README.md")
    ap.add_argument("--latest", action="store_true", help="with --print: the last run (bench/results/latest/)")
    ap.add_argument("--gpu-only", action="store_true", help="only runs recorded on a GPU")
    ap.add_argument("--feature", action="append", help="only this feature (repeatable)")
    args = ap.parse_args(argv)
    if args.print:
        directory = RESULTS / "latest" if args.latest else RESULTS
        print(render(directory, gpu_only=args.gpu_only, features=args.feature))
        return 0
    plots = draw_plots(load_rows())
    changed = update_readme(render(plots=plots))
    print("bench/README.md " + ("updated" if changed else "unchanged") + f"; {len(plots)} plots in bench/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
