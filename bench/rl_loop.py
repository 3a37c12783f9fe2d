"""An RL-style loop with every feature of the repo at once (``make demo``).

What it runs
    A trainer and two generators behind a ``GeneratorRouter``, PipelineRL-style: while the
    trainer learns from one batch of rollouts, the generators already sample the next one, and
    after every optimizer step the trainer pushes its weights with ``router.sync_weights(...,
    mode="hot_swap")``: the generators swap them in between two decode steps, so rollouts may
    span two policy versions, and every completion says which (min/max_policy_version).

    model        a tiny hybrid ``DecoderLM`` (fast/decoder_lm.py): Gated DeltaNet layers
                 (ref/gated_deltanet.py's Qwen3.5 layer, plugged in as the "linear" layers) and
                 rotary GQA attention layers, 3:1 like Qwen3.5 on the GPU size, 1:1 on the CPU size
    generators   two fast ``Generator``s (continuous batching, paged KV cache, seeded sampling), each
                 serving its own copy of the model, in this process or (``--ray``) as Ray actors;
                 on a GPU their attention is this repo's fast varlen_attn (prefill) and
                 flash_decode (decode) and their Gated DeltaNet runs fast's Triton kernels; on a
                 CPU the in-file PyTorch attention and the reference delta rule
    trainer      the same model, forward under ``OffloadActivations`` (fast/view_replay_offload.py):
                 saved activations go to host memory once per storage and views are replayed in
                 backward; step 0 checks the gradients are bitwise those of a run without it.
                 Its Gated DeltaNet is fast's Triton chunk kernel with its Triton backward on a
                 GPU, and the reference delta rule (recurrent form, cheapest at these lengths)
                 on a CPU; with ``--batch-invariant`` the generators' chunk form (the mode's)
    task         random prompts; reward = share of generated tokens in the residue class (mod 4) of
                 the token before them (a random policy scores ~1/4); group-relative advantages (G
                 samples per prompt), a PPO-clipped loss on the generators' own logprobs (the
                 behaviour policy, possibly older than the trainer's: the clip absorbs the staleness)

    on-policy    every step, the trainer recomputes the logprobs of the sampled tokens
                 (``DecoderLM.token_logprobs``, one packed forward, on the weights of the version
                 that served them, in the generators' dtype) and compares them with the ones the
                 generators reported.  ``--batch-invariant``: generators' and trainer's models in the
                 batch-invariant mode (fast varlen_attn / flash_decode with batch_invariant=True; on
                 a CPU under the Triton interpreter, so a smaller workload): the difference is 0.

What it prints (lines under 100 characters)
    per step, on two lines: mean reward, loss, generated tokens/s (this step's tokens over this
    step's wall time), staleness (lag = trainer version when the rollout is consumed minus the
    version it started on; span = max - min version inside one rollout); the trainer's time, the
    hot-swap sync time, the time spent waiting for rollouts, the bytes offloaded in this step, the
    largest |generator - trainer| logprob difference over the rollouts served on one version ("n/a"
    when every rollout of the step spans two versions: nothing to compare).  At the end the totals,
    each labelled as one.  The CPU size runs in about a minute; ``--size gpu`` (default on CUDA) is
    larger.

    python bench/rl_loop.py               # CPU: 60 steps, ~1 min on 2 cores; reward ~0.25 -> ~0.9
    python bench/rl_loop.py --steps 30    # half as long; reward ~0.25 -> 0.6-0.9 (timing moves staleness)
    python bench/rl_loop.py --ray         # the generators as Ray actors (ray_generators), a local Ray
    python bench/rl_loop.py --ray --kill-at 10   # ... and SIGKILL one actor's process at step 10
    python bench/rl_loop.py --batch-invariant --steps 4   # bitwise on-policy: max |diff| 0 every step
    python bench/rl_loop.py --model DIR --steps 4         # from a Hugging Face checkpoint directory

With ``--ray`` the two generators run as Ray actors (each builds its engine itself; weights reach
them through the object store) on a new local Ray instance, or on the cluster ``RAY_ADDRESS`` names
(which must answer within 30 s); the fleet's health events are printed as they happen: with
``--kill-at`` the killed actor is opened, restarted by Ray, re-synced to the current version and
closed again after a probe, while the loop goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import statistics
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--batch-invariant" in sys.argv[1:] and not torch.cuda.is_available():
    # The mode's attention kernels on CPU tensors: the Triton interpreter, chosen before any kernel is defined.
    os.environ["TRITON_INTERPRET"] = "1"

import fast.decoder_lm as lm  # noqa: E402
import fast.generator_engine as ge  # noqa: E402
import fast.routed_generator as rg  # noqa: E402
import ref.gated_deltanet as ref_gdn  # noqa: E402
from fast.view_replay_offload import OffloadActivations  # noqa: E402

SIZES = {
    "cpu": dict(model=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=16, max_seq_len=64, tie_embeddings=False,
                           layer_types=("linear", "attention", "linear", "attention"), linear_num_k_heads=2,
                           linear_num_v_heads=4, linear_head_k_dim=16, linear_head_v_dim=16),
                prompts=8, group=4, prompt_len=8, out_len=16, lr=1e-2),
    # --batch-invariant on a CPU: the attention kernels run under the Triton interpreter.
    "cpu-invariant": dict(model=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                                     num_kv_heads=1, head_dim=32, max_seq_len=32, tie_embeddings=False,
                                     layer_types=("linear", "attention"), linear_num_k_heads=2, linear_num_v_heads=4,
                                     linear_head_k_dim=16, linear_head_v_dim=16),
                          prompts=4, group=2, prompt_len=6, out_len=8, lr=1e-2),
    "gpu": dict(model=dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                           num_kv_heads=2, head_dim=64, max_seq_len=1024, tie_embeddings=False,
                           layer_types=("linear", "linear", "linear", "attention") * 2, linear_num_k_heads=4,
                           linear_num_v_heads=8, linear_head_k_dim=64, linear_head_v_dim=64),
                prompts=16, group=8, prompt_len=64, out_len=128, lr=1e-3),
}
TEMPERATURE = 1.0
CLIP = 0.2


def gdn_factory(chunk_fn, recurrent_fn):
    """The "linear" layers: ref/gated_deltanet.py's layer with these delta-rule functions, built from the
    config's linear_* sizes."""
    return functools.partial(ref_gdn.GatedDeltaNet, chunk_fn=chunk_fn, recurrent_fn=recurrent_fn)


def make_batch(step: int, size: dict, vocab: int):
    """``prompts`` prompts, each ``group`` times with its own sampling seed."""
    gen = torch.Generator().manual_seed(10_000 + step)
    requests = []
    for i in range(size["prompts"]):
        prompt = torch.randint(0, vocab, (size["prompt_len"],), generator=gen).tolist()
        for j in range(size["group"]):
            sp = rg.SamplingParams(max_new_tokens=size["out_len"], temperature=TEMPERATURE,
                                   seed=step * 100_003 + i * 101 + j)
            requests.append(rg.Request(prompt, sp, request_id=f"s{step}-p{i}-g{j}"))
    return requests


def rewards(completions) -> torch.Tensor:
    """Share of generated tokens in the residue class (mod 4) of the token before them."""
    out = []
    for c in completions:
        prev = [c.prompt_token_ids[-1]] + c.token_ids[:-1]
        out.append(sum(t % 4 == p % 4 for t, p in zip(c.token_ids, prev)) / len(c.token_ids))
    return torch.tensor(out)


def loss_fn(model, completions, group: int, device, offload=None):
    """PPO-clipped policy gradient with group-relative advantages, on the generators' logprobs."""
    r = rewards(completions).view(-1, group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1).to(device)
    ids = torch.tensor([c.prompt_token_ids + c.token_ids for c in completions], device=device)
    p = len(completions[0].prompt_token_ids)
    behaviour = torch.tensor([c.logprobs for c in completions], device=device)
    with offload if offload is not None else contextlib.nullcontext():
        if model.batch_invariant:   # the mode's packed forward: the generators' numbers, bit for bit
            logp = torch.stack(model.token_logprobs(ids.tolist(), [p] * len(completions), temperature=TEMPERATURE))
        else:
            logits = model(ids[:, :-1])                               # [N, P + L - 1, V]
            logp = torch.log_softmax(logits[:, p - 1:] / TEMPERATURE, dim=-1).gather(-1, ids[:, p:, None])[..., 0]
        ratio = torch.exp(logp - behaviour)
        loss = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
    return loss, r.mean().item()


@torch.no_grad()
def logprob_mismatch(checker, snapshots: dict, completions) -> tuple[float, int, int]:
    """The trainer's recompute against the generators' logprobs: for the completions served on one
    policy version v (min == max version), ``checker.token_logprobs`` on v's weights.  Returns (largest
    |difference|, completions compared, completions skipped: they span two versions, two policies)."""
    worst, compared = 0.0, 0
    for v in sorted({c.min_policy_version for c in completions}):
        batch = [c for c in completions if c.min_policy_version == c.max_policy_version == v]
        if not batch or v not in snapshots:
            continue
        checker.load_state_dict(snapshots[v])
        lps = checker.token_logprobs([c.prompt_token_ids + c.token_ids for c in batch],
                                     [len(c.prompt_token_ids) for c in batch], temperature=TEMPERATURE)
        for c, lp in zip(batch, lps):
            worst = max(worst, float((lp.double().cpu() - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max()))
        compared += len(batch)
    return worst, compared, len(completions) - compared


# The Triton interpreter is not thread-safe (it patches triton.language while a kernel runs): on a CPU the
# mode's kernels, in the generators' engine threads and in the trainer, run one at a time under this lock.
INTERPRETER_LOCK = threading.RLock()


def one_at_a_time(kernel):
    @functools.wraps(kernel)
    def call(*args, **kwargs):
        with INTERPRETER_LOCK:
            return kernel(*args, **kwargs)
    return call


def check_offload_is_exact(model, completions, group, device):
    """One backward with and one without the offload hooks: the gradients must be bitwise equal."""
    grads = []
    for offload in (None, OffloadActivations(min_offload_bytes=4096, module=model)):
        model.zero_grad(set_to_none=True)
        loss, _ = loss_fn(model, completions, group, device, offload)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return all(torch.equal(a, b) for a, b in zip(*grads)) and len(grads[0]) == len(grads[1])


def say(text: str, indent: str = "") -> None:
    """Print wrapped under 100 columns (continuation lines indented)."""
    print(textwrap.fill(text, width=99, initial_indent=indent, subsequent_indent=indent + "    ",
                        break_on_hyphens=False), flush=True)


def one_line(text: str, indent: str = "         ") -> None:
    """Print on one line under 100 columns (an error's details shortened)."""
    print(indent + textwrap.shorten(text, width=99 - len(indent), placeholder=" ..."), flush=True)


def build_model(config_or_path, linear_layer, model_kw: dict):
    """The model: a checkpoint directory's (``--model DIR``), or random weights of a config (seed 0)."""
    if isinstance(config_or_path, str):
        return lm.DecoderLM.from_pretrained(config_or_path, linear_layer=linear_layer, **model_kw)
    return lm.DecoderLM(config_or_path, seed=0, linear_layer=linear_layer, **model_kw)


def build_generator(config_or_path, linear_layer, model_kw: dict, kw: dict):
    """One engine on its own model (in this process, or inside a Ray actor: then with one intra-op thread
    on a CPU); ``model_kw`` go to the DecoderLM, ``kw`` to the Generator."""
    if model_kw["device"].type == "cpu":
        torch.set_num_threads(1)
    return ge.Generator(build_model(config_or_path, linear_layer, model_kw), **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="gpu" if torch.cuda.is_available() else "cpu",
                    help="model and batch size (default: gpu on CUDA, else cpu)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps to run (default: 60)")
    ap.add_argument("--ray", action="store_true", help="run the generators as Ray actors")
    ap.add_argument("--kill-at", type=int, default=None, help="with --ray: SIGKILL one actor's process at this step")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a Hugging Face checkpoint directory (Llama 3, Qwen2/2.5, Qwen3, Qwen3.5) to start from; "
                         "the task works on token ids, so no tokenizer is needed")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="generators and trainer in the batch-invariant mode: bitwise on-policy logprobs")
    args = ap.parse_args(argv)
    if args.kill_at is not None and not args.ray:
        ap.error("--kill-at needs --ray")
    on_gpu = args.size == "gpu"
    invariant = args.batch_invariant
    if invariant and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--batch-invariant on a CPU runs the Triton interpreter: pass it on the command line "
                 "(python bench/rl_loop.py --batch-invariant) or set TRITON_INTERPRET=1")
    size = SIZES["cpu-invariant" if invariant and not on_gpu else args.size]
    device = torch.device("cuda" if on_gpu else "cpu")
    if not on_gpu:
        torch.set_num_threads(1)  # three engine/trainer threads on a small CPU: no OpenMP team collisions
    config = lm.ModelConfig(**size["model"]) if args.model is None else lm.ModelConfig.from_hf(
        args.model, max_seq_len=size["prompt_len"] + size["out_len"])
    source = config if args.model is None else args.model    # what each model is built from

    gen_model_kw = dict(device=device, dtype=torch.bfloat16 if on_gpu else torch.float32)
    gen_kw = dict(page_size=16,
                  num_pages=size["prompts"] * size["group"] * -(-(size["prompt_len"] + size["out_len"]) // 16) + 16)
    if on_gpu:
        import fast.gated_deltanet as fast_gdn
        from fast.flash_decoding import flash_decode
        from fast.paged_varlen_attention import varlen_attn
        gen_layer = gdn_factory(fast_gdn.chunk_gated_delta_rule, fast_gdn.fused_recurrent_gated_delta_rule)
        gen_kw.update(varlen_attn=varlen_attn, flash_decode=flash_decode)
        kernels = "fast varlen_attn + flash_decode + fast Gated DeltaNet kernels"
    else:
        gen_layer = gdn_factory(ref_gdn.chunk_gated_delta_rule, ref_gdn.fused_recurrent_gated_delta_rule)
        kernels = "in-file PyTorch attention + reference Gated DeltaNet (no CUDA)"
    if on_gpu:  # fast's chunk kernel has a Triton backward: the trainer uses it too
        train_layer = gdn_factory(fast_gdn.chunk_gated_delta_rule, fast_gdn.fused_recurrent_gated_delta_rule)
    else:  # on the short CPU rollouts the reference recurrent form beats the chunk form's 64-row solve
        train_layer = gdn_factory(ref_gdn.fused_recurrent_gated_delta_rule, ref_gdn.fused_recurrent_gated_delta_rule)

    mode = {}
    if invariant:  # the engine's bitwise contract: one attention kernel family, one GDN chunk form everywhere
        train_layer = gen_layer                     # (the mode runs chunk_fn in every phase, chunks aligned)
        from fast.flash_decoding import flash_decode
        from fast.paged_varlen_attention import varlen_attn
        if not on_gpu:
            varlen_attn, flash_decode = one_at_a_time(varlen_attn), one_at_a_time(flash_decode)
        mode = dict(batch_invariant=True, varlen_attn=varlen_attn)
        gen_model_kw.update(mode)
        gen_kw.update(varlen_attn=varlen_attn, flash_decode=flash_decode)
        kernels = "batch-invariant mode: fast varlen_attn + flash_decode (batch_invariant=True)" + (
            "" if on_gpu else " under the Triton interpreter, reference Gated DeltaNet (chunk form)")
    if args.model is not None:     # the checkpoint's context capped to the loop's sequences
        gen_model_kw["max_seq_len"] = config.max_seq_len
        mode = dict(mode, max_seq_len=config.max_seq_len)
    model = build_model(source, train_layer, dict(device=device, dtype=torch.float32, **mode)).train()
    # The trainer's recompute of the rollouts' logprobs, in the generators' dtype on the weights that served them.
    checker = build_model(source, train_layer, dict(device=device, dtype=gen_model_kw["dtype"], **mode)).eval()
    snapshots = {0: {k: v.detach().clone() for k, v in model.state_dict().items()}}
    opt = torch.optim.AdamW(model.parameters(), lr=size["lr"], weight_decay=0.0)
    offload = OffloadActivations(min_offload_bytes=4096, module=model)
    if args.ray:  # a new local Ray instance, or the cluster RAY_ADDRESS names (checked within 30 s)
        gens = rg.ray_generators(functools.partial(build_generator, source, gen_layer, gen_model_kw, gen_kw), 2,
                                 name_prefix="gen", num_cpus=0, num_gpus=0.5 if on_gpu else 0, connect_timeout_s=30.0,
                                 ray_init_options=dict(logging_level="ERROR", log_to_driver=False))
        kernels += f"; as Ray actors (pids {[g.pid for g in gens]})"
    else:
        gens = [build_generator(source, gen_layer, gen_model_kw, gen_kw) for _ in range(2)]
        for i, g in enumerate(gens):
            g.name = f"gen{i}"
    router = rg.GeneratorRouter(gens, policy="least_loaded")
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{'model ' + args.model if args.model else 'hybrid model'}: {config.kinds}, {n_params / 1e6:.2f}M parameters")
    say(f"generators: {kernels}")
    say(f"per step: {size['prompts']} prompts x {size['group']} samples x {size['out_len']} tokens")

    version, history = 0, []
    t_start = t_step = time.perf_counter()
    offloaded_before = 0
    pending = [router.submit(r) for r in make_batch(0, size, config.vocab_size)]
    try:
        for step in range(args.steps):
            upcoming = ([router.submit(r) for r in make_batch(step + 1, size, config.vocab_size)]
                        if step + 1 < args.steps else [])             # sampled while this step trains
            t0 = time.perf_counter()
            completions = [f.result() for f in pending]
            waited = time.perf_counter() - t0
            if step == 0:
                with INTERPRETER_LOCK if invariant and not on_gpu else contextlib.nullcontext():
                    exact = check_offload_is_exact(model, completions, size["group"], device)
                say(f"view-replay offload: gradients bitwise equal to a run without it: {exact}")
                if not exact:
                    return 1
            # (the trainer's backward launches interpreter kernels too: it holds the lock throughout)
            with INTERPRETER_LOCK if invariant and not on_gpu else contextlib.nullcontext():
                mismatch, compared, skipped = logprob_mismatch(checker, snapshots, completions)
                t1 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
                    loss, reward = loss_fn(model, completions, size["group"], device, offload)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            t2 = time.perf_counter()
            lag = [version - c.min_policy_version for c in completions]
            span = [c.max_policy_version - c.min_policy_version for c in completions]
            version += 1
            snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the optimizer updates in place
            snapshots[version] = snapshot
            for old in [v for v in snapshots if v < version - 2]:  # rollouts lag by one or two versions
                del snapshots[old]
            try:
                router.sync_weights(snapshot, version, mode="hot_swap")
            except rg.RouterError as exc:  # a generator missed it: it is re-synced when it returns
                one_line(f"sync {version}: {exc}")
            t3 = time.perf_counter()
            tokens = sum(len(c.token_ids) for c in completions)
            offloaded, offloaded_before = offload.stats["offloaded_bytes"] - offloaded_before, \
                offload.stats["offloaded_bytes"]
            history.append(dict(reward=reward, tokens=tokens, lag=lag, span=span, train_s=t2 - t1,
                                sync_s=t3 - t2, wait_s=waited, mismatch=mismatch, compared=compared,
                                skipped=skipped))
            # This step's figures only (the totals come at the end); a max over no rollouts is n/a.
            diff = f"{mismatch:.1e}" if compared else "n/a"
            print(f"step {step:3d}  reward {reward:.3f}  loss {loss.item():+.4f}  "
                  f"{tokens / (t3 - t_step):6,.0f} tok/s  logprob diff {diff} ({compared}/{len(completions)} compared)")
            print(f"          lag {statistics.fmean(lag):.2f} (max {max(lag)})  span {statistics.fmean(span):.2f}  "
                  f"train {1e3 * (t2 - t1):.0f} ms  sync {1e3 * (t3 - t2):.0f} ms  wait {1e3 * waited:.0f} ms  "
                  f"offload {offloaded / 2**20:.1f} MiB", flush=True)
            t_step = t3
            for _, name, event, detail in router.health_events():
                if event != "synced":
                    one_line(f"fleet: {name} {event}: {detail}")
            if args.kill_at == step:
                one_line(f"killing {gens[0].name}'s process (pid {gens[0].pid})")
                os.kill(gens[0].pid, signal.SIGKILL)
            pending = upcoming
    finally:
        router.close()
        for g in gens:
            g.close()
    elapsed = time.perf_counter() - t_start
    gen_tokens = sum(h["tokens"] for h in history)
    first, last = (statistics.fmean(h["reward"] for h in part) for part in (history[:5], history[-5:]))
    all_lag = [x for h in history for x in h["lag"]]
    all_span = [x for h in history for x in h["span"]]
    s = offload.stats
    print()
    say(f"totals over {args.steps} steps ({elapsed:.1f} s): {gen_tokens / elapsed:,.0f} generated tokens/s end "
        f"to end; mean per step: trainer {statistics.fmean(h['train_s'] for h in history) * 1e3:.0f} ms, "
        f"hot-swap sync {statistics.fmean(h['sync_s'] for h in history) * 1e3:.1f} ms")
    say(f"reward {first:.3f} (mean of the first 5 steps) -> {last:.3f} (last 5); staleness over all rollouts: "
        f"lag mean {statistics.fmean(all_lag):.2f} max {max(all_lag)}, spanning two versions "
        f"{100 * sum(x > 0 for x in all_span) / len(all_span):.0f}%")
    say(f"offload, total: {s['offloaded_storages']} storages / {s['offloaded_bytes'] / 2**20:.1f} MiB to host, "
        f"{s['replayed_views']} views replayed, {s['kept']} small tensors kept")
    compared_all = sum(h["compared"] for h in history)
    worst = max((h["mismatch"] for h in history if h["compared"]), default=None)
    say(f"on-policy check, all steps: largest |generator - trainer| logprob "
        f"{'n/a' if worst is None else f'{worst:.3e}'} over {compared_all} rollouts "
        f"({sum(h['skipped'] for h in history)} spanning two versions not compared); batch-invariant mode "
        f"{'on' if invariant else 'off'}")
    for name, st in router.stats().items():
        say(f"generator {name}, total: {st['completed']} completions, {st['failures']} failures "
            f"({st['timeouts']} deadlines), state {st['state']}, serving version {st['policy_version']}")
    return 1 if invariant and (worst is None or worst != 0) else 0


if __name__ == "__main__":
    sys.exit(main())
