"""The single-file rules of CONTRIBUTING.md, checked on every file in ref/ and fast/.

1. Copyable alone: each file is copied into an empty directory and imported there as a fresh
   interpreter imports it, seeing nothing of this repository (parity/warm_python.py).  The import
   must print nothing and must not touch a device (``torch.cuda`` stays uninitialized).
2. Imports only the standard library, torch, triton, einops; no relative imports.
3. A header docstring and an ``__all__`` whose names all exist.
4. ref and fast share a contract: the same ``__all__``, and every public function, class
   and public method has the same parameters (names, order, kinds, defaults).  The few
   deliberate differences are listed in ``ALLOWED_EXTRA`` with the reason.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from warm_python import run_script

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_MODULES = {"torch", "triton", "einops", "__future__"} | set(sys.stdlib_module_names)


def _feature_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")


FILES = _feature_files("ref") + _feature_files("fast")
FEATURES = sorted({p.stem for p in FILES})

# (feature, public name) -> why the name is public in one of ref/fast only.
ALLOWED_ONE_SIDED: dict[tuple[str, str], str] = {
    ("gated_deltanet", "GatedDeltaNet"): "the Qwen3.5 layer is written once (ref) and takes its kernel "
                                         "functions as constructor arguments, so the fast ones drop in",
    ("gated_deltanet", "GatedDeltaNetCache"): "the layer's decode cache lives beside the layer in ref only",
    ("routed_generator", "ray_generators"): "the Ray fleet is a deployment of the fast router's protocol; the "
                                            "reference specifies routing, not process management",
    ("weight_sync", "WeightSender"): "the transport between processes (torch.distributed); the reference "
                                     "specifies the plan and runs it in one process (transfer)",
    ("weight_sync", "WeightReceiver"): "the generator's side of that transport",
}

# (folder, public name or "*", parameter name) -> why the parameter exists on one side only.
ALLOWED_EXTRA = {
    ("ref", "*", "upcast"): "the reference can run its math in the input dtype to give the "
                            "low-precision baseline of the tolerance rule",
    # view_replay_offload: the reference copies synchronously; these tune fast's CUDA-stream machinery.
    ("fast", "OffloadActivations", "prefetch"): "storages reloaded ahead of use in backward (fast prefetches)",
    ("fast", "OffloadActivations", "max_inflight_bytes"): "device bytes whose async copy may be pending",
    ("fast", "OffloadActivations", "max_pool_bytes"): "cap on the free pinned-buffer pool (fast only pins)",
    ("fast", "cascade_decode", "capturable"): "its launch sized from shapes, nothing read back, so a CUDA graph "
                                              "can capture it (the reference has no launch to size)",
    # generator_engine: the fast engine's knobs (the reference engine has a contiguous per-request
    # cache and plain attention, so it has nothing to tune or plug in).
    ("fast", "Generator", "varlen_attn"): "prefill attention plug-in of the paged engine",
    ("fast", "Generator", "flash_decode"): "decode attention plug-in of the paged engine",
    ("fast", "Generator", "cascade_decode"): "shared-prefix decode plug-in for a group's samples",
    ("ref", "Generator", "cache_pages"): "the reference's prefix cache keeps copies of pages beside each "
                                         "request's contiguous cache (fast's cached pages live in its pool)",
    ("fast", "Generator", "checkpoint_interval"): "hybrid models: pages between linear-state checkpoints "
                                                  "(the reference checkpoints every page)",
    ("fast", "Generator", "num_checkpoints"): "hybrid models: checkpoint slots beside the KV pool",
    ("fast", "Generator", "num_pages"): "paged KV cache: pool size",
    ("fast", "Generator", "max_batch_size"): "continuous batching: requests decoding at once",
    ("fast", "Generator", "max_prefill_tokens"): "continuous batching: prompt tokens per iteration",
    ("fast", "Generator", "tensor_parallel_size"): "the fast engine runs over N processes (the reference states the "
                                                   "layout and the reduction in ref/decoder_lm.py, one process)",
    ("fast", "Generator", "tp_timeout_s"): "tensor parallelism: a dead or hung worker fails the generator after it",
    ("fast", "Generator", "tp_address"): "tensor parallelism: the process group's address (loopback by default)",
    ("fast", "Generator", "_tp_worker"): "private: the engine a tensor-parallel worker process runs",
    ("fast", "Generator", "compile"): "the paged engine's static decode step, compiled (the reference is the eager "
                                      "specification)",
    ("fast", "Generator", "capture_sizes"): "the static step's padded batch sizes",
    ("fast", "Generator", "cuda_graphs"): "the paged engine's static decode step replayed from CUDA graphs",
    ("fast", "Generator", "weight_receiver"): "fast/weight_sync.py's transport, connected on every rank (the "
                                              "reference engine loads state dicts only)",
}

_IMPORT_PROBE = r"""
import importlib, json, sys
import torch
name, result_path = sys.argv[1], sys.argv[2]
mod = importlib.import_module(name)
public = getattr(mod, "__all__", None)
json.dump({
    "cuda_initialized": bool(torch.cuda.is_initialized()),
    "all": list(public) if public is not None else None,
    "missing": [n for n in (public or []) if not hasattr(mod, n)],
    "file": mod.__file__,
}, open(result_path, "w"))
"""


def _import_alone(path: Path) -> dict:
    """The probe above, run as a fresh interpreter runs it (parity/warm_python.py) from an empty folder that
    holds the copy."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / path.name
        target.write_bytes(path.read_bytes())
        result_path = Path(tmp) / "result.json"
        (Path(tmp) / "probe.py").write_text(_IMPORT_PROBE)
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "TRITON_INTERPRET"}}
        proc = run_script(Path(tmp) / "probe.py", argv=[path.stem, str(result_path)], cwd=tmp, env=env, timeout=300)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        result.update(returncode=proc.returncode, output=proc.stdout, tmp=tmp)
        return result


@pytest.fixture(scope="module")
def import_results():
    # Each probe is a forked interpreter (parity/warm_python.py): run them side by side.
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = dict(zip(FILES, pool.map(_import_alone, FILES)))
    return results


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_imports_alone_quietly(path, import_results):
    r = import_results[path]
    assert r["returncode"] == 0, f"{path.name} does not import alone:\n{r['output'][-3000:]}"
    assert r["file"].startswith(r["tmp"]), f"{path.name} was imported from {r['file']}, not the copy"
    assert r["output"] == "", f"importing {path.name} printed: {r['output'][:500]!r}"
    assert not r["cuda_initialized"], f"importing {path.name} initialized CUDA (no work at import)"
    assert r["all"], f"{path.name} has no __all__"
    assert not r["missing"], f"{path.name}: __all__ names that do not exist: {r['missing']}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_imports_and_docstring(path):
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.splitlines()) >= 10, f"{path.name}: the header docstring is missing or too thin"
    # Anything else (ray, numpy, ...) only inside the function that needs it: the file still imports
    # without it (test_imports_alone_quietly checks that part).
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}:{node.lineno}: relative import"
            mods = [node.module or ""]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            assert m.split(".")[0] in ALLOWED_MODULES or id(node) in lazy, (
                f"{path.name}:{node.lineno}: imports {m!r} at module level; only the standard library, torch, "
                f"triton, einops (others inside the function that needs them)")


def test_every_feature_has_both_files():
    for feature in FEATURES:
        assert (ROOT / "ref" / f"{feature}.py").exists(), f"ref/{feature}.py is missing"
        assert (ROOT / "fast" / f"{feature}.py").exists(), f"fast/{feature}.py is missing"


# ----------------------------------------------------------------------------- contract

def _params(obj) -> list[tuple]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [(p.name, p.kind.name, _default(p.default)) for p in sig.parameters.values()]


def _default(value) -> str:
    """A default's text; a function default by name (each file's own ``route`` is the same contract)."""
    return f"<function {value.__name__}>" if inspect.isfunction(value) else repr(value)


def _allowed(folder: str, public: str, param: str) -> bool:
    return (folder, "*", param) in ALLOWED_EXTRA or (folder, public, param) in ALLOWED_EXTRA


def _compare_params(public: str, ref_obj, fast_obj) -> list[str]:
    ref_p = [p for p in _params(ref_obj) if not _allowed("ref", public, p[0])]
    fast_p = [p for p in _params(fast_obj) if not _allowed("fast", public, p[0])]
    if ref_p != fast_p:
        return [f"{public}: parameters differ\n  ref : {ref_p}\n  fast: {fast_p}"]
    return []


def _public_members(cls) -> dict:
    out = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_"):  # __init__ is compared through the class signature
            continue
        if inspect.isfunction(member) or inspect.ismethod(member) or isinstance(member, property):
            out[name] = member
    return out


@pytest.mark.parametrize("feature", FEATURES)
def test_ref_and_fast_share_contract(feature):
    ref = importlib.import_module(f"ref.{feature}")
    fast = importlib.import_module(f"fast.{feature}")
    one_sided = {name for (feat, name) in ALLOWED_ONE_SIDED if feat == feature}
    only_ref = set(ref.__all__) - set(fast.__all__) - one_sided
    only_fast = set(fast.__all__) - set(ref.__all__) - one_sided
    assert not only_ref and not only_fast, (
        f"__all__ differs: only in ref {sorted(only_ref)}, only in fast {sorted(only_fast)}")
    problems = []
    for public in sorted(set(ref.__all__) & set(fast.__all__)):
        r, f = getattr(ref, public), getattr(fast, public)
        if callable(r) != callable(f) or inspect.isclass(r) != inspect.isclass(f):
            problems.append(f"{public}: a {type(r).__name__} in ref but a {type(f).__name__} in fast")
            continue
        if inspect.isclass(r):
            if dataclasses.is_dataclass(r):
                rf = [(x.name, repr(x.default)) for x in dataclasses.fields(r)]
                ff = [(x.name, repr(x.default)) for x in dataclasses.fields(f)]
                if rf != ff:
                    problems.append(f"{public}: dataclass fields differ\n  ref : {rf}\n  fast: {ff}")
            problems += _compare_params(public, r, f)
            rm, fm = _public_members(r), _public_members(f)
            for name in sorted(set(rm) - set(fm)):
                problems.append(f"{public}.{name}: in ref only")
            for name in sorted(set(rm) & set(fm)):
                if not isinstance(rm[name], property):
                    problems += _compare_params(f"{public}.{name}", rm[name], fm[name])
        elif callable(r):
            problems += _compare_params(public, r, f)
    assert not problems, "ref and fast contracts differ:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_module_forwards_are_called(path):
    """Dead code vulture cannot see: a private nn.Module class's ``forward`` runs only when one of its instances
    is called, so the file must call an attribute it assigns an instance of that class to (``self.mlp = _MLP(..)``
    and ``block.mlp(...)``; autograd Functions, applied as ``.apply``, aside).  make lint runs vulture for the
    rest (parity/vulture_whitelist.py)."""
    tree = ast.parse(path.read_text())
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
              for node in ast.walk(tree) if isinstance(node, ast.Call)}
    dead = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("_")):
        if any(getattr(b, "attr", getattr(b, "id", "")) == "Function" for b in cls.bases):
            continue
        if not any(isinstance(m, ast.FunctionDef) and m.name == "forward" for m in cls.body):
            continue
        holders = {t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", None)
                   for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                   and getattr(node.value.func, "id", None) == cls.name for t in node.targets}
        if not holders & called:
            dead.append(cls.name)
    assert not dead, f"{path.name}: {dead} define forward, and no instance of them is ever called"
