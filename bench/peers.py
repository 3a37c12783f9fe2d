"""The production peers of the kernel observatory (bench/roofline.py): vLLM's and SGLang's Triton
attention kernels, installed for the report from their wheels and loaded module by module.

    python bench/peers.py          # download the wheels (pip download --no-deps), load the modules, say what loaded

Nothing of theirs is vendored or committed: ``pip download --no-deps vllm==0.33.0 sglang==0.5.23`` puts
the wheels in the cache folder (``TWOFOLD_PEERS_DIR``, default ``~/.cache/twofold/peers``), the few
kernel files the report runs are unzipped beside them, and their package imports (vLLM's platform,
environment and logger modules, SGLang's environment and utils) are answered by the small shims
below, as an H100 would answer them (compute capability 9.0, 132 SMs, CUDA, no ROCm).  A peer that
cannot be downloaded or loaded is reported with the reason; the report runs without it.

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

VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
FILES = {
    "vllm": ["vllm/v1/attention/ops/triton_attention_helpers.py",
             "vllm/v1/attention/ops/triton_unified_attention.py",
             "vllm/v1/attention/ops/triton_decode_attention.py"],
    "sglang": ["sglang/kernels/ops/attention/score_mod.py",
               "sglang/kernels/ops/attention/metadata.py",
               "sglang/kernels/ops/attention/decode_attention.py",
               "sglang/kernels/ops/attention/extend_attention.py"],
}
MODULES = {
    "vllm": ["vllm.v1.attention.ops.triton_unified_attention", "vllm.v1.attention.ops.triton_decode_attention"],
    "sglang": ["sglang.kernels.ops.attention.metadata", "sglang.kernels.ops.attention.decode_attention",
               "sglang.kernels.ops.attention.extend_attention"],
}
H100_SMS = 132


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
        with zipfile.ZipFile(_wheel(name)) as z:
            for f in FILES[name]:
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
            _module("vllm.envs", VLLM_BATCH_INVARIANT=False)
            _module("vllm.logger", init_logger=_Logger)
            _module("vllm.platforms", current_platform=_HopperPlatform())
            _module("vllm.triton_utils", tl=tl, triton=triton)
            _module("vllm.v1.kv_cache_interface", KVQuantMode=_KVQuantMode)
        else:
            _module("sglang", src / "sglang")
            _module("sglang.kernels", src / "sglang/kernels")
            _module("sglang.kernels.ops", src / "sglang/kernels/ops")
            _module("sglang.kernels.ops.attention", src / "sglang/kernels/ops/attention")
            _module("sglang.srt")
            _module("sglang.srt.environ", envs=_Envs())
            # At import: not CUDA (the module would query the device); load() then sets sm_90.
            _module("sglang.srt.utils", is_cuda=lambda: False, is_hip=lambda: False,
                    is_gfx95_supported=lambda: False, is_gfx1250_supported=lambda: False,
                    get_device_core_count=lambda *a: H100_SMS)
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
    return mods


if __name__ == "__main__":
    for peer in VERSIONS:
        try:
            loaded = load(peer)
            print(f"{peer} {VERSIONS[peer]}: loaded {', '.join(loaded)} from {source_dir(peer)}")
        except Exception as e:
            print(f"{peer} {VERSIONS[peer]}: not available ({e})")
