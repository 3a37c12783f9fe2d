"""The production peers of the kernel observatory (bench/roofline.py): vLLM's and SGLang's Triton
attention and MoE kernels, installed for the report from their wheels and loaded module by module.

    python bench/peers.py          # download the wheels (pip download --no-deps), load the modules, say what loaded

Nothing of theirs is vendored or committed: ``pip download --no-deps vllm==0.33.0 sglang==0.5.23`` puts
the wheels in the cache folder (``TWOFOLD_PEERS_DIR``, default ``~/.cache/twofold/peers``), the few
kernel files the report runs (and the MoE tile configs named for an H100) are unzipped beside them, and
their package imports (vLLM's platform, environment, logger and MoE helper modules, SGLang's environment,
utils, runtime context and MoE helpers) are answered by the small shims below, as an H100 would answer
them (compute capability 9.0, 132 SMs, device name "NVIDIA H100 80GB HBM3", CUDA, no ROCm, no
quantization).  A peer that cannot be downloaded or loaded is reported with the reason; the report runs
without it.

The kernels (every row of the report names the one it ran):
- vLLM ``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py): ``kernel_unified_attention``,
  its 2D path (one program per 16-row query tile and KV head) and its 3D path (16 softmax segments per
  sequence, merged by ``reduce_segments``), the latter chosen by vLLM's Triton backend when the batch
  has fewer than 128 / H_kv sequences (``seq_threshold_3D``).
- vLLM ``decode_attention_fwd`` (vllm/v1/attention/ops/triton_decode_attention.py), the 2-stage decode:
  ``_fwd_grouped_kernel_stage1`` writes fp32 partials per split, ``_fwd_kernel_stage2`` merges; the split
  count is the one vLLM's Triton MLA backend picks (``_compute_num_kv_splits``: next power of 2 of
  L / 512, at most 2 x SMs).
- SGLang ``decode_attention_fwd`` (sglang/kernels/ops/attention/decode_attention.py), its 2-stage decode
  (``_fwd_grouped_kernel_stage1``, ``_fwd_kernel_stage2``), with the split counts SGLang's Triton backend
  computes (``get_num_kv_splits_triton``, sglang/kernels/ops/attention/metadata.py, its default
  ``triton_attention_num_kv_splits`` 8, run before the measured call as SGLang runs it once per batch).
- SGLang ``extend_attention_fwd`` (sglang/kernels/ops/attention/extend_attention.py), its prefill
  (``_fwd_kernel``) with Hopper's tiles (BLOCK_M 128, BLOCK_N 64 at D = 128).
- vLLM ``fused_experts_impl`` (vllm/model_executor/layers/fused_moe/fused_moe.py), its Triton MoE: the
  ``fused_moe_kernel`` twice (gate/up, then down with the routing weights), the tile config from vLLM's own
  ``try_get_optimal_moe_config`` (its shipped JSON for the shape and an H100 if the wheel has one, else
  ``get_default_config``; the 0.33.0 wheel ships E=128,N=768 files for H200, H20 and B200, none for H100).
- SGLang's Triton MoE: ``invoke_fused_moe_kernel`` and ``moe_sum_reduce_triton``
  (sglang/kernels/ops/moe/fused_moe_triton_kernels.py), the configs from its ``try_get_optimal_moe_config``
  (sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py, which takes the newest Triton
  version folder holding the shape's H100 file: triton_3_7_1 for E=128,N=768, up and ``_down``), and its
  ``moe_align_block_size`` wrapper (its Triton single-CTA kernel at <= 64 pairs); bench/roofline.py runs
  the steps of its ``_fused_moe_kernel_sequence`` (sglang/srt/.../fused_moe.py, too entangled with the
  server to import) in that order, as on CUDA.

The compiled (CUDA) ops around those kernels cannot run here, so they are computed with PyTorch the way
the ops define them, and each tells the report (``COMPILED_OP_HOOKS``) its bytes: every input read once,
every output written whole once (``compiled_op``).  They are vLLM's ``moe_align_block_size``
(vllm._custom_ops, called by vLLM's own Python wrapper, which sizes the buffers), ``silu_and_mul`` and
``moe_sum``; SGLang's sgl_kernel ``moe_align_block_size`` (behind its wrapper), ``silu_and_mul`` and
``moe_sum_reduce`` (above 32 tokens; at most 32 on an H100 it runs the Triton ``moe_sum_reduce_triton``);
and both routers' ``topk_softmax`` (softmax over the experts, top k, renormalized).  The aligned layouts
match the CUDA ops' (each expert's pairs in (token, slot) order, its run padded to the block size with
``numel``, one expert id per block); the order within an expert, which the CUDA ops leave to atomics,
moves no byte.
"""
from __future__ import annotations

import enum
import importlib
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
VLLM_MOE = "vllm/model_executor/layers/fused_moe"
SGLANG_MOE = "sglang/srt/layers/moe/moe_runner/triton_utils"
FILES = {
    "vllm": ["vllm/v1/attention/ops/triton_attention_helpers.py",
             "vllm/v1/attention/ops/triton_unified_attention.py",
             "vllm/v1/attention/ops/triton_decode_attention.py",
             "vllm/utils/math_utils.py",
             f"{VLLM_MOE}/activation.py", f"{VLLM_MOE}/moe_align_block_size.py", f"{VLLM_MOE}/fused_moe.py"],
    "sglang": ["sglang/kernels/ops/attention/score_mod.py",
               "sglang/kernels/ops/attention/metadata.py",
               "sglang/kernels/ops/attention/decode_attention.py",
               "sglang/kernels/ops/attention/extend_attention.py",
               "sglang/kernels/ops/moe/fused_moe_triton_kernels.py",
               "sglang/kernels/ops/moe/moe_align_small_numel.py",
               f"{SGLANG_MOE}/moe_align_block_size.py", f"{SGLANG_MOE}/fused_moe_triton_config.py"],
}
# The tuned MoE tile configs an H100 looks up (its device name in the file name), unzipped with the kernels.
CONFIGS = {"vllm": (f"{VLLM_MOE}/configs/", "device_name=NVIDIA_H100_80GB_HBM3"),
           "sglang": (f"{SGLANG_MOE}/configs/", "device_name=NVIDIA_H100_80GB_HBM3")}
MODULES = {
    "vllm": ["vllm.v1.attention.ops.triton_unified_attention", "vllm.v1.attention.ops.triton_decode_attention"],
    "sglang": ["sglang.kernels.ops.attention.metadata", "sglang.kernels.ops.attention.decode_attention",
               "sglang.kernels.ops.attention.extend_attention"],
}
MOE_MODULES = {   # imported after MODULES (load() says why)
    "vllm": ["vllm.model_executor.layers.fused_moe.fused_moe"],
    "sglang": ["sglang.kernels.ops.moe.fused_moe_triton_kernels",
               "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size",
               "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"],
}
H100_SMS = 132
H100_NAME = "NVIDIA H100 80GB HBM3"       # torch.cuda.get_device_name() of an H100 SXM5


def cache_dir() -> Path:
    return Path(os.environ.get("TWOFOLD_PEERS_DIR", "~/.cache/twofold/peers")).expanduser()


def _wheel(name: str) -> Path:
    """The cached wheel of ``name`` (downloaded once with pip); raises RuntimeError saying why not."""
    version, cache = VERSIONS[name], cache_dir()
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache),
                               f"{name}=={version}"], capture_output=True, text=True, timeout=900)
        found = sorted(cache.glob(f"{name}-{version}-*.whl"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"pip download --no-deps {name}=={version} failed: "
                               f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return found[0]


def source_dir(name: str) -> Path:
    """The folder holding the kernel files of ``name``, unzipped from its wheel (once)."""
    src = cache_dir() / "src" / f"{name}-{VERSIONS[name]}"
    if not all((src / f).exists() for f in FILES[name]):
        folder, device = CONFIGS[name]
        with zipfile.ZipFile(_wheel(name)) as z:
            configs = [f for f in z.namelist() if f.startswith(folder) and device in f.rsplit("/", 1)[-1]]
            for f in FILES[name] + configs:
                z.extract(f, src)
    return src


# ----------------------------------------------------------------------------- shims for their imports

def _module(name: str, path: Path | None = None, **attrs) -> types.ModuleType:
    """A stand-in module in sys.modules; with ``path`` a package whose submodules load from that folder."""
    mod = sys.modules.get(name) or types.ModuleType(name)
    if path is not None:
        mod.__path__ = [str(path)]
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


class _Logger(logging.LoggerAdapter):
    """vLLM's logger: a logging.Logger with ``*_once`` methods."""

    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})

    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)

    info_once = warning_once = debug_once


class _HopperPlatform:
    """vLLM's ``current_platform`` as an H100 (sm_90, CUDA) answers it."""

    @staticmethod
    def fp8_dtype():
        import torch
        return torch.float8_e4m3fn

    is_rocm = is_xpu = is_cpu = staticmethod(lambda: False)
    is_cuda = staticmethod(lambda: True)
    is_device_capability_family = staticmethod(lambda family: family == 90)
    is_device_capability = staticmethod(lambda cap: tuple(cap) == (9, 0))
    num_compute_units = staticmethod(lambda *a: H100_SMS)
    get_device_name = staticmethod(lambda *a: H100_NAME)


class _ModularExperts:
    """vLLM's FusedMoEExpertsModular, for its activation width: a gated activation halves N."""

    @staticmethod
    def adjust_N_for_activation(n: int, activation) -> int:
        return n // 2 if activation.is_gated else n


class _KVQuantMode(enum.IntEnum):
    """vllm.v1.kv_cache_interface.KVQuantMode's first modes (the report runs NONE)."""
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class _EnvFlag:
    """SGLang's ``envs.NAME``: an object with ``.get()``; every flag the kernels read is off."""

    def get(self):
        return False


class _Envs:
    def __getattr__(self, name):
        return _EnvFlag()


def _unquantized_only(*args, **kwargs):
    raise NotImplementedError("the report runs the peers' unquantized (fp16) MoE path only")


def _vllm_config_dtype(dtype, **quant) -> str | None:
    """vLLM's _get_config_dtype_str for unquantized experts: the configs' dtype key (none for 16-bit)."""
    import torch
    if any(quant.values()):
        _unquantized_only()
    return "float32" if dtype == torch.float32 else None


def _vllm_quantize_input(A, A_scale, quant_dtype, per_act_token_quant, block_shape=None, **kwargs):
    """vLLM's moe_kernel_quantize_input (its argument names) with no quantization: the input as it is."""
    if quant_dtype is not None:
        _unquantized_only()
    return A, A_scale


# ----------------------------------------------------------------------------- their compiled (CUDA) ops

COMPILED_OP_HOOKS: list = []   # functions (name, bytes read, bytes written): bench/roofline.py counts the ops


def compiled_op(name: str, reads, writes, compute) -> None:
    """One of a peer's compiled (CUDA) ops, which cannot run here: ``compute()`` fills its outputs with
    PyTorch out of sight of any TorchDispatchMode (the report's op counter), and each hook hears its bytes:
    every tensor of ``reads`` read once, every tensor of ``writes`` written whole once."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        compute()
    for hook in COMPILED_OP_HOOKS:
        hook(name, sum(t.numel() * t.element_size() for t in reads),
             sum(t.numel() * t.element_size() for t in writes))


def align_block_size(peer, topk_ids, buckets, block, sorted_ids, expert_ids, post_pad, offset=0) -> None:
    """moe_align_block_size's CUDA op: bucket b = expert + ``offset`` (SGLang counts an EP-filtered id -1 as
    bucket 0); each bucket's pairs (flat (token, slot) indices, in order) padded to whole blocks with
    ``numel``, buckets in order; one expert id per block (0 past the last); the padded total."""
    import torch

    def compute():
        flat = topk_ids.reshape(-1).long() + offset                        # [P]: each pair's bucket
        counts = torch.bincount(flat, minlength=buckets)
        padded = (counts + block - 1) // block * block
        by_bucket, pairs = torch.sort(flat, stable=True)
        rank = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[by_bucket]
        sorted_ids.fill_(flat.numel())
        sorted_ids[(torch.cumsum(padded, 0) - padded)[by_bucket] + rank] = pairs.to(sorted_ids.dtype)
        per_block = torch.repeat_interleave(torch.arange(buckets) - offset, padded // block)
        expert_ids.fill_(0)
        expert_ids[:per_block.numel()] = per_block.to(expert_ids.dtype)
        post_pad[0] = int(padded.sum())
    compiled_op(f"{peer} moe_align_block_size (CUDA op, emulated)", [topk_ids],
                [sorted_ids, expert_ids, post_pad[:1]], compute)


def silu_and_mul(peer, out, x, extra_reads=()) -> None:
    """out [..., d] = silu(x[..., :d]) * x[..., d:], in fp32, rounded once (the CUDA op)."""
    import torch.nn.functional as F
    d = x.shape[-1] // 2
    compiled_op(f"{peer} silu_and_mul (CUDA op, emulated)", [x, *extra_reads], [out],
                lambda: out.copy_(F.silu(x[..., :d].float()) * x[..., d:].float()))


def moe_sum(peer, x, out, scale: float = 1.0) -> None:
    """out [T, H] = scale * the sum of x [T, k, H] over k, in fp32 (the CUDA op)."""
    compiled_op(f"{peer} moe_sum (CUDA op, emulated)", [x], [out], lambda: out.copy_(x.float().sum(1) * scale))


def topk_softmax(peer, logits, top_k: int, expert_indices: bool = False):
    """The routers' topk_softmax CUDA op with renormalize: (weights [T, k] fp32, ids [T, k] int32), the
    k largest softmax probabilities over the experts, divided by their sum; with ``expert_indices``
    also vLLM's token_expert_indices [T, k] int32 output."""
    import torch
    t = logits.shape[0]
    weights = torch.empty(t, top_k)
    ids = torch.empty(t, top_k, dtype=torch.int32)
    extra = [torch.empty(t, top_k, dtype=torch.int32)] if expert_indices else []

    def compute():
        w, i = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
        weights.copy_(w / w.sum(-1, keepdim=True))
        ids.copy_(i)
        for e in extra:
            e.copy_(torch.arange(t * top_k, dtype=torch.int32).view(top_k, t).t())
    compiled_op(f"{peer} topk_softmax (CUDA op, emulated)", [logits], [weights, ids, *extra], compute)
    return weights, ids


def _vllm_align(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad, expert_map=None,
                scatter_idx=None):
    """vllm._custom_ops.moe_align_block_size (no expert map, no scatter index)."""
    if expert_map is not None or scatter_idx is not None:
        raise NotImplementedError("the report runs vLLM's align without expert parallelism")
    align_block_size("vLLM", topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad)


def _vllm_activation(activation, output, input, **kwargs):
    """vLLM's apply_moe_activation for SiLU: torch.ops._C.silu_and_mul."""
    if activation.value != "silu" or any(v is not None for v in kwargs.values()):
        raise NotImplementedError("the report runs vLLM's plain SiLU activation")
    silu_and_mul("vLLM", output, input)


def _sglang_align(topk_ids, buckets, block_size, sorted_ids, expert_ids, num_tokens_post_pad, cumsum_buffer,
                  pad_sorted_token_ids=False, ignore_invalid_expert=False):
    """sgl_kernel's moe_align_block_size under SGLang's +1 offset (buckets = experts + 1)."""
    align_block_size("SGLang", topk_ids, buckets, block_size, sorted_ids, expert_ids, num_tokens_post_pad, offset=1)


def install_shims(names=("vllm", "sglang")) -> dict:
    """Registers the peers' packages (pointing at the unzipped kernel files) and the shims of their
    imports.  Returns {name: reason} for the peers that are not available."""
    import triton
    import triton.language as tl
    missing = {}
    for name in names:
        try:
            src = source_dir(name)
        except Exception as e:  # no network, no wheel, a broken zip: the report says so and goes on
            missing[name] = f"{type(e).__name__}: {e}"
            continue
        if name == "vllm":
            _module("vllm", src / "vllm")
            _module("vllm.v1", src / "vllm/v1")
            _module("vllm.v1.attention", src / "vllm/v1/attention")
            _module("vllm.v1.attention.ops", src / "vllm/v1/attention/ops")
            _module("vllm.envs", VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None, VLLM_TRITON_USE_TD=None)
            _module("vllm.logger", init_logger=_Logger)
            _module("vllm.platforms", current_platform=_HopperPlatform())
            _module("vllm.triton_utils", tl=tl, triton=triton)
            _module("vllm.v1.kv_cache_interface", KVQuantMode=_KVQuantMode)
            # The Triton MoE (fused_moe.py): its package without its __init__, the compiled ops emulated.
            _module("vllm.utils", src / "vllm/utils")
            _module("vllm.utils.platform_utils", get_device_name_as_file_name=lambda *a: H100_NAME.replace(" ", "_"))
            _module("vllm.utils.torch_utils", direct_register_custom_op=lambda **kw: None)
            _module("vllm.triton_utils.allocation", set_triton_allocator=lambda device: None)
            _module("vllm._custom_ops", moe_align_block_size=_vllm_align,
                    moe_sum=lambda x, out, topk_ids=None, expert_map=None: moe_sum("vLLM", x, out))
            _module("vllm.model_executor", src / "vllm/model_executor")
            _module("vllm.model_executor.layers", src / "vllm/model_executor/layers")
            _module("vllm.model_executor.layers.fused_moe", src / VLLM_MOE, get_config=lambda: None)   # no override
            _module("vllm.model_executor.layers.fused_moe.modular_kernel", FusedMoEExpertsModular=_ModularExperts)
            _module("vllm.model_executor.layers.fused_moe.config", FUSED_MOE_UNQUANTIZED_CONFIG=None,
                    FusedMoEQuantConfig=object, _get_config_dtype_str=_vllm_config_dtype)
            _module("vllm.model_executor.layers.fused_moe.utils", enable_swap_ab=lambda bm, bn: bm < 64 and bn >= 64,
                    moe_kernel_quantize_input=_vllm_quantize_input,
                    resolve_moe_use_td=lambda: False,                 # VLLM_TRITON_USE_TD unset: XPU only
                    warn_if_moe_use_td_ineffective=lambda *a, **k: None)
        else:
            _module("sglang", src / "sglang")
            _module("sglang.kernels", src / "sglang/kernels")
            _module("sglang.kernels.ops", src / "sglang/kernels/ops")
            _module("sglang.kernels.ops.attention", src / "sglang/kernels/ops/attention")
            _module("sglang.srt", src / "sglang/srt")
            _module("sglang.srt.environ", envs=_Envs())
            # At import: not CUDA (the module would query the device); load() then sets sm_90.
            _module("sglang.srt.utils", is_cuda=lambda: False, is_hip=lambda: False, is_musa=lambda: False,
                    is_xpu=lambda: False, is_cpu=lambda: False, cpu_has_amx_support=lambda: False,
                    is_sm90_supported=lambda: True, get_device_name=lambda *a: H100_NAME,
                    is_gfx95_supported=lambda: False, is_gfx1250_supported=lambda: False,
                    get_device_core_count=lambda *a: H100_SMS)
            # The Triton MoE: its kernels file, align wrapper and config lookup; the compiled ops emulated.
            _module("sglang.kernels.jit")
            _module("sglang.kernels.jit.utils", is_arch_support_pdl=lambda: True)      # sm_90: PDL launches
            _module("sglang.kernels.ops.quantization")
            _module("sglang.kernels.ops.quantization.fp8_kernel", per_token_group_quant_fp8=_unquantized_only,
                    scaled_fp8_quant=_unquantized_only, sglang_per_token_group_quant_fp8=_unquantized_only)
            _module("sglang.kernels.ops.quantization.int8_kernel", per_token_group_quant_int8=_unquantized_only,
                    per_token_quant_int8=_unquantized_only, sglang_per_token_group_quant_int8=_unquantized_only)
            _module("sglang.kernels.ops.moe", src / "sglang/kernels/ops/moe", moe_align_block_size=_sglang_align)
            _module("sglang.srt.batch_invariant_ops", is_batch_invariant_mode_enabled=lambda: False)
            _module("sglang.srt.runtime_context", get_exec=lambda: SimpleNamespace(
                deterministic=SimpleNamespace(enable_deterministic_inference=False),
                moe=SimpleNamespace(enable_fused_moe_sum_all_reduce=False)))
            _module("sglang.srt.layers", src / "sglang/srt/layers")
            _module("sglang.srt.layers.moe", src / "sglang/srt/layers/moe")
            _module("sglang.srt.layers.moe.utils", get_moe_padding_size=lambda aiter: 0)   # SGLANG_MOE_PADDING unset
            _module("sglang.srt.layers.moe.moe_runner", src / "sglang/srt/layers/moe/moe_runner")
            _module("sglang.srt.layers.moe.moe_runner.triton_utils", src / SGLANG_MOE, get_config=lambda: None)
    return missing


def load(name: str) -> dict:
    """{module name: module} of a peer, answering as an H100; raises RuntimeError with the reason."""
    missing = install_shims((name,))
    if missing:
        raise RuntimeError(missing[name])
    mods = {m: importlib.import_module(m) for m in MODULES[name]}
    if name == "sglang":
        extend = mods["sglang.kernels.ops.attention.extend_attention"]
        extend._is_cuda, extend.CUDA_CAPABILITY = True, (9, 0)        # Hopper's tiles
        # The MoE modules' CUDA branches import only what the shims answer: from here on, CUDA.
        sys.modules["sglang.srt.utils"].is_cuda = lambda: True
    else:
        # vLLM's activation module as it is, but for its SiLU, a CUDA op (torch.ops._C.silu_and_mul): emulated.
        importlib.import_module(f"{VLLM_MOE.replace('/', '.')}.activation").apply_moe_activation = _vllm_activation
    mods.update({m: importlib.import_module(m) for m in MOE_MODULES[name]})
    return mods


if __name__ == "__main__":
    for peer in VERSIONS:
        try:
            loaded = load(peer)
            print(f"{peer} {VERSIONS[peer]}: loaded {', '.join(loaded)} from {source_dir(peer)}")
        except Exception as e:
            print(f"{peer} {VERSIONS[peer]}: not available ({e})")
