"""moe benchmark: the routing mismatch the batch-invariant mode removes, and Qwen3-30B-A3B's layers on a CPU.

Cases (CPU-meaningful: routing decisions, logprob differences, memory and the engine's decode rate; the expert
kernels' bytes are the observatory's, ``make roofline``)
    routing <dtype> <mode>    R3's measurement (arXiv 2510.11370) for this repo's own stack: a Qwen3-MoE-shaped
                              model (128 experts, top 8, q/k norms; 4 layers at hidden 256, random weights,
                              every norm weight perturbed) serves 8 requests on the fast engine (continuous
                              batching, greedy and sampled rows, no preemption); the trainer then recomputes
                              the same sequences in one packed forward (``token_logprobs``).  Every MoE
                              layer's chosen experts are recorded on both sides for every (token, layer):
                              ``decode_route_mismatch`` (the fraction of (completion token, layer) pairs whose
                              top-k expert set differs between the engine's decode step and the trainer's
                              recompute), ``prompt_route_mismatch`` (the same for prompt tokens: the engine's
                              prefill against the trainer), ``tokens_with_a_changed_route`` (the fraction of
                              completion tokens with a different set in at least one layer) and
                              ``max_logprob_diff`` (the largest |engine - trainer| over the completion
                              tokens).  Modes: ``default`` (bf16 and fp32: BLAS matmuls whose blocking depends
                              on the batch) and ``invariant`` (fp32: ``batch_invariant=True``, the repo's
                              attention kernels under the Triton interpreter on a CPU), whose figures must
                              be 0.  The MoE layer is ref/moe.py's here (the interpreter computes bf16
                              wrong; parity/test_checkpoints.py holds fast/moe.py's kernels to the
                              trainer's bits in the mode).
    layers qwen3-30b-a3b      2 decoder layers of Qwen3-30B-A3B's shapes (hidden 2048, 32 / 4 heads of 128,
                              128 experts of FFN 768, top 8; vocab 4096: the layers are what is measured) in
                              bf16 with random weights, written as a checkpoint with one tensor per expert as
                              transformers writes Qwen3-MoE and loaded by ``DecoderLM.from_pretrained``:
                              ``load_s`` (a fresh process), ``weights_bytes``, ``peak_rss_bytes`` (the load's
                              high-water mark: the stacked experts are a second copy while loading),
                              decode ``tokens/s`` at 1 and 16 requests (prompt 16, 8 new tokens, greedy,
                              the fast engine's in-file attention and ref/moe.py's experts).

    python bench/moe.py                    # both parts; rows to bench/results/latest/ (untracked)
    python bench/moe.py --record           # ... and appended to bench/results/moe.csv
    python bench/moe.py --part routing     # routing | layers
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import child_facts, run_bench  # noqa: E402

ROUTING_MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=64, max_seq_len=256, tie_embeddings=False, qk_norm=True,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=64, norm_topk_prob=True)
QWEN3_30B_A3B_LAYERS = dict(model_type="qwen3_moe", vocab_size=4096, hidden_size=2048, intermediate_size=6144,
                            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], torch_dtype="bfloat16")


# ----------------------------------------------------------------------------- routing: engine against trainer

class RouteLog:
    """Every MoE layer's chosen experts per (request, sample, position), for the rows of the pass in flight:
    the caller names the pass's rows (``rows``) before the model runs, each layer's ``route_fn`` is wrapped
    to file its ids under them."""

    def __init__(self, model):
        self.rows: list | None = None
        self.routes: dict = {}                  # (request_id, sample, position) -> {layer: expert ids}
        for i in model.config.moe_layers:
            layer = model.layers[i].mlp
            layer.route_fn = self._recording(i, layer.route_fn)

    def _recording(self, layer: int, route_fn):
        def route(logits, top_k, **kw):
            weights, ids = route_fn(logits, top_k, **kw)
            if self.rows is not None:
                for key, chosen in zip(self.rows, ids.tolist()):
                    self.routes.setdefault(key, {})[layer] = frozenset(chosen)
            return weights, ids
        return route


def _engine_rows(gen, log: RouteLog) -> None:
    """Name the rows of each engine pass: a prefill chunk's tokens start .. end - 1 of its sample, a decode
    step's row the sample's last token (the engine's ModelRunner.prefill / decode arguments)."""
    runner = gen.runner
    prefill, decode = runner.prefill, runner.decode

    def key(seq, position):
        return seq.group.request.request_id, seq.index, position

    def named_prefill(model, work):
        log.rows = [key(c.seq, p) for c in work for p in range(c.start, c.end)]
        return prefill(model, work)

    def named_decode(model, seqs):
        log.rows = [key(s, len(s.tokens) - 1) for s in seqs]
        return decode(model, seqs)
    runner.prefill, runner.decode = named_prefill, named_decode


def routing_case(dtype: torch.dtype, invariant: bool, *, requests: int = 8, new_tokens: int = 16) -> dict:
    """One case, in a fresh process (the mode's attention kernels need the interpreter chosen before triton
    is imported, on a CPU)."""
    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    import ref.moe as moe
    kernels = {}
    if invariant:
        from fast.flash_decoding import flash_decode
        from fast.paged_varlen_attention import varlen_attn
        kernels = dict(varlen_attn=varlen_attn)
    config = lm.ModelConfig(**ROUTING_MODEL)

    def make_model():
        return lm.DecoderLM(config, seed=5, moe_layer=moe.MoE, batch_invariant=invariant, dtype=dtype, **kernels)
    gen_ = torch.Generator().manual_seed(11)
    reqs = []
    for i in range(requests):
        prompt = torch.randint(1, config.vocab_size, (int(torch.randint(12, 40, (1,), generator=gen_)),),
                               generator=gen_).tolist()
        sp = ge.SamplingParams(max_new_tokens=new_tokens, temperature=(0.0, 1.0)[i % 2], seed=100 + i)
        reqs.append(ge.Request(prompt, sp, request_id=f"r{i}"))
    engine_model = make_model()
    engine_log = RouteLog(engine_model)
    extra = dict(flash_decode=flash_decode) if invariant else {}
    with ge.Generator(engine_model, page_size=16, max_batch_size=16, **extra) as gen:
        _engine_rows(gen, engine_log)
        done = gen.generate(reqs)
        if gen.stats()["preemptions"]:
            raise AssertionError("a preemption recomputed routes: give the pool more room")
    trainer = make_model()
    trainer_log = RouteLog(trainer)
    seqs = [c.prompt_token_ids + c.token_ids for c in done]
    # The rows of token_logprobs' forward: each sequence's fed tokens in order (the default packed forward); in
    # the mode (fast/decoder_lm.py's _SharedPrompts layout) every prompt first, then every completion's tokens.
    rows = [[(c.request_id, 0, p) for p in range(len(s) - 1)] for c, s in zip(done, seqs)]
    if invariant:
        cut = [len(c.prompt_token_ids) for c in done]
        trainer_log.rows = [k for r, n in zip(rows, cut) for k in r[:n]] + [k for r, n in zip(rows, cut) for k in r[n:]]
    else:
        trainer_log.rows = [k for r in rows for k in r]
    with torch.no_grad():
        want = trainer.token_logprobs(seqs, [len(c.prompt_token_ids) for c in done],
                                      temperature=[r.sampling.temperature for r in reqs], share_prompts=False)
    counts = dict(decode=[0, 0], prompt=[0, 0])
    changed_tokens, completion_tokens, worst = 0, 0, 0.0
    for c, s, w in zip(done, seqs, want):
        worst = max(worst, (torch.tensor(c.logprobs, dtype=torch.float32) - w.float()).abs().max().item())
        for p in range(len(s) - 1):
            a, b = engine_log.routes[(c.request_id, 0, p)], trainer_log.routes[(c.request_id, 0, p)]
            differ = [a[i] != b[i] for i in config.moe_layers]
            part = counts["decode" if p >= len(c.prompt_token_ids) else "prompt"]
            part[0] += sum(differ)
            part[1] += len(differ)
            if p >= len(c.prompt_token_ids) - 1:          # the rows that predicted a completion token
                completion_tokens += 1
                changed_tokens += any(differ)
    return dict(decode_route_mismatch=counts["decode"][0] / counts["decode"][1],
                prompt_route_mismatch=counts["prompt"][0] / counts["prompt"][1],
                tokens_with_a_changed_route=changed_tokens / completion_tokens, max_logprob_diff=worst,
                pairs=counts["decode"][1] + counts["prompt"][1])


def bench_routing(rec) -> None:
    cases = [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)]
    for dtype, invariant in cases:
        name = f"routing {str(dtype).split('.')[-1]} {'invariant' if invariant else 'default'}"
        t0 = time.perf_counter()
        env = dict(os.environ, TRITON_INTERPRET="0" if torch.cuda.is_available() else "1")
        proc = subprocess.run([sys.executable, __file__, "--routing-child", str(dtype).split(".")[-1],
                               str(int(invariant))], capture_output=True, text=True, timeout=3600, env=env)
        facts = child_facts(proc, name)
        for metric in ("decode_route_mismatch", "prompt_route_mismatch", "tokens_with_a_changed_route"):
            rec.add(name, "fast", metric, facts[metric], "fraction")
        rec.add(name, "fast", "max_logprob_diff", facts["max_logprob_diff"], "nats")
        rec.add(name, "fast", "token_layer_pairs", facts["pairs"], "pairs")
        print(f"{name}: {facts} ({time.perf_counter() - t0:.0f} s)", flush=True)


# ----------------------------------------------------------------------------- Qwen3-30B-A3B's layers

def _write_layers_checkpoint(path: Path) -> None:
    """config.json and model.safetensors: QWEN3_30B_A3B_LAYERS with bf16 weights (std 0.02, norms 1 +), one
    tensor per expert as transformers writes Qwen3-MoE (checked against it in parity/test_checkpoints.py)."""
    from safetensors.torch import save_file
    raw = dict(QWEN3_30B_A3B_LAYERS)
    h, i, e = raw["hidden_size"], raw["moe_intermediate_size"], raw["num_experts"]
    d, hq, hkv = raw["head_dim"], raw["num_attention_heads"], raw["num_key_value_heads"]
    bank = (torch.randn(10 ** 6 + 3, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    offset = [0]

    def draw(*shape):
        n = int(torch.tensor(shape).prod())
        offset[0] += n
        return bank.roll(-offset[0] % bank.numel()).repeat(n // bank.numel() + 1)[:n].view(shape).clone()
    tensors = {"model.embed_tokens.weight": draw(raw["vocab_size"], h), "lm_head.weight": draw(raw["vocab_size"], h),
               "model.norm.weight": 1 + draw(h)}
    for layer in range(raw["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({p + "input_layernorm.weight": 1 + draw(h), p + "post_attention_layernorm.weight": 1 + draw(h),
                        p + "self_attn.q_proj.weight": draw(hq * d, h), p + "self_attn.k_proj.weight": draw(hkv * d, h),
                        p + "self_attn.v_proj.weight": draw(hkv * d, h), p + "self_attn.o_proj.weight": draw(h, hq * d),
                        p + "self_attn.q_norm.weight": 1 + draw(d), p + "self_attn.k_norm.weight": 1 + draw(d),
                        p + "mlp.gate.weight": draw(e, h) * 25})     # a router with spread logits
        for n in range(e):
            q = f"{p}mlp.experts.{n}."
            tensors.update({q + "gate_proj.weight": draw(i, h), q + "up_proj.weight": draw(i, h),
                            q + "down_proj.weight": draw(h, i)})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))


def layers_child(path: str) -> dict:
    """In a fresh process: load, then decode at 1 and 16 requests."""
    import resource
    import fast.decoder_lm as lm
    import fast.generator_engine as ge
    import ref.moe as moe
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model = lm.DecoderLM.from_pretrained(path, moe_layer=moe.MoE, max_seq_len=64)
    facts = dict(load_s=time.perf_counter() - t0,
                 weights_bytes=sum(p.numel() * p.element_size() for p in model.state_dict().values()),
                 peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    gen_ = torch.Generator().manual_seed(3)
    with ge.Generator(model, page_size=16, max_batch_size=16, kv_cache_memory=256 << 20) as gen:
        for batch in (1, 16):
            reqs = [ge.Request(torch.randint(1, 4096, (16,), generator=gen_).tolist(),
                               ge.SamplingParams(max_new_tokens=8)) for _ in range(batch)]
            gen.generate(reqs[:1])                                      # warm
            t0 = time.perf_counter()
            gen.generate(reqs)
            facts[f"tokens_per_s_b{batch}"] = batch * 8 / (time.perf_counter() - t0)
    return facts


def bench_layers(rec) -> None:
    case = "layers qwen3-30b-a3b"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        _write_layers_checkpoint(path)
        proc = subprocess.run([sys.executable, __file__, "--layers-child", str(path)], capture_output=True,
                              text=True, timeout=3600)
    facts = child_facts(proc, case)
    rec.add(case, "fast", "load_s", facts["load_s"], "s")
    for metric in ("weights_bytes", "peak_rss_bytes"):
        rec.add(case, "fast", metric, facts[metric], "B")
    for batch in (1, 16):
        rec.add(case, "fast", f"tokens/s b={batch}", facts[f"tokens_per_s_b{batch}"], "tok/s")
    print(f"{case}: {facts}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--routing-child"]:
        torch.set_num_threads(1)
        print("FACTS " + json.dumps(routing_case(getattr(torch, argv[1]), bool(int(argv[2])))), flush=True)
        return 0
    if argv[:1] == ["--layers-child"]:
        print("FACTS " + json.dumps(layers_child(argv[1])), flush=True)
        return 0

    def configure(ap):
        ap.add_argument("--part", choices=["all", "routing", "layers"], default="all")

    def cpu(rec, args):
        if args.part in ("all", "routing"):
            bench_routing(rec)
        if args.part in ("all", "layers"):
            bench_layers(rec)
    return run_bench("moe", __doc__, gpu=cpu, cpu=cpu, configure=configure, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
