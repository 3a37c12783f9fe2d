"""Generator engine: the reference (readable PyTorch, the specification for tokens and logprobs).

Example::

    # generator_engine.py and decoder_lm.py, copied next to this script
    from decoder_lm import DecoderLM, ModelConfig
    from generator_engine import Generator, Request, SamplingParams

    model = DecoderLM(ModelConfig(vocab_size=128, max_seq_len=64), seed=0)
    with Generator(model, kv_cache_memory=2 ** 24) as gen:                   # a 16 MiB cache
        group = gen.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=1.0, seed=0, n=2))])[0]
        print([c.token_ids for c in group], gen.stats()["max_seq_len"])

What it computes
    ``Generator(model, ...)`` samples from a decoder LM, one request at a time, the way gpt-fast's
    ``generate`` does: a prefill pass over the prompt fills a contiguous KV cache, then one forward
    pass per new token.  The model is the caller's (decoder_lm.py's ``DecoderLM``, what the trainer
    trains; ``Generator.from_pretrained(path, model_class=DecoderLM)`` loads a Hugging Face
    checkpoint), so trainer and generator share one model definition.  A ``Generator`` has the four
    members a router needs (``routed_generator.py``'s ``GeneratorProtocol``: name, policy_version,
    submit -> Future[Completion], load_weights), so it sits behind a ``GeneratorRouter`` as it is;
    no file imports another.

The model protocol (what the engine reads of the model it is given)
    model.config            .vocab_size, .max_seq_len, .num_kv_heads, .head_dim and .kinds (one of
                            "attention" / "linear" per layer)
    model.layers_forward    (ids [T], positions [T], attend, mix) -> final-normed hidden [T, hidden]:
                            the blocks on packed tokens; ``attend(layer, q [T, H_q, D], k [T, H_kv, D],
                            v) -> [T, H_q, D]`` and ``mix(layer, module, h [T, hidden]) -> [T, hidden]``
                            are the engine's (they own the caches)
    model.logits            hidden [..., hidden] -> logits [..., V] fp32
    model.layers[i]         .linear_attn.new_cache() for a "linear" layer (its state between calls)
    model.state_dict()      the weights ``load_weights`` validates and copies into (a tied lm_head may
                            be left out of a loaded state dict: it is the embedding)
    model.attention_window  (optional, gpt-oss) i -> layer i's window W in keys, 0 = full: a sliding layer's
                            token at position p attends to keys p - W < j <= p
    model.attention_sinks   (optional, gpt-oss) i -> layer i's sinks [H_q] or None: one more key per head,
                            of logit sinks[h] and value 0 (``causal_attention`` states the math)
    The engine owns the model it is given (``load_weights`` writes into it): give it its own instance.

Sampling (per request; ``logits`` fp32 [V] at the last position)
    greedy (T = 0)  token = argmax (first index on ties); logprob = log_softmax(logits)[token]
    T > 0           logp = log_softmax(logits * fp32(1 / T)), p = exp(logp).  With top_k / top_p:
                    sort p descending (stable), keep the first top_k and the prefix whose mass
                    before each token is < top_p, zero the rest.  cdf = cumsum(p) in fp64 (sorted
                    order when filtered, vocabulary order when not); u = ``keyed_uniform(seed, j)``
                    for the completion's j-th token (j = 0, 1, ...): SplitMix64's output for the
                    counter j + 1 of the stream ``seed`` (a random 64-bit seed when None), a function
                    of (seed, j) only, so a position's draw never depends on the draws before it (a
                    speculative verification, drawing at the positions it checks, gives plain
                    decoding's tokens); token = the first index with cdf > u * cdf[-1].
                    logprob = logp[token]: the temperature-scaled model distribution before
                    top-k / top-p truncation, what a trainer recomputes from the same weights.
    stop            after a token in stop_token_ids (it is kept, finish "stop"), after
                    max_new_tokens tokens, or when prompt + output reach max_seq_len (finish
                    "length").  Same seed, same weights: same tokens.

The engine (Generator)
    One worker thread takes requests in submission order and runs each to completion (prefill,
    then decode steps) on its own cache: K and V [capacity, H_kv, D] per attention layer and
    the linear layers' own caches.  ``submit`` only enqueues.  ``load_weights`` validates the
    whole state dict first (a missing, unexpected or mis-shaped tensor rejects it whole: weights
    and version stay), then the worker copies it in between two requests, so a completion never
    spans two versions here (min_policy_version == max_policy_version).  The fast engine's parts, here:
    its Scheduler is the worker's queue (one request at a time, ``_check_servable`` at submit); its
    StatePools are ``KVCache`` (one request's contiguous cache) and ``PrefixCache`` (copies of pages); its
    ModelRunner is ``generate`` (prefill, decode steps, ``sample``).  The memory budget of both engines
    (``kv_cache_memory``, ``memory_utilization``, ``max_seq_len``): the section "memory budget".

Groups and the prefix cache (the semantics the fast engine implements with its block allocator)
    group         ``SamplingParams(n=k)``: k samples of one prompt (GRPO's group); the future resolves
                  to k completions (``sample_index`` 0 .. k-1); sample i draws from seed + i, so it is
                  exactly the request alone with ``seed + i`` and n = 1.
    prefix cache  every full page of ``page_size`` tokens a request computes (prompt or generated) is
                  kept, keyed by the chain (parent page's id, its token ids, the weights' version), with
                  its K/V and, for "linear" layers, a checkpoint: their state after its last token.  A
                  later request restores the longest cached run of its prompt's full pages (ending on a
                  page with a checkpoint when the model has linear layers; never its last token, whose
                  logits give the first sample) and prefills only the rest.  A load makes every older
                  page unreachable.  Outputs are the same with the cache on or off (tokens; logprobs to
                  rounding: a page-by-page prefill sums in another order than one pass).

Tensors and types
    KV cache        [capacity, H_kv, head_dim] per attention layer, the model's dtype
    SamplingParams  max_new_tokens int >= 1 (16), temperature float >= 0 (0 = greedy), top_k
                    int >= 0 (0 = off), top_p in (0, 1] (1 = off), stop_token_ids, seed int or None,
                    n int >= 1 (samples of the prompt, 1)
    Request         prompt_token_ids list[int], sampling, request_id str, session_id
    Completion      request_id, prompt_token_ids, token_ids, logprobs (one per token),
                    finish_reason "stop" | "length", generator_id, min/max_policy_version,
                    sample_index (i of a group's n)
    (Repeated in routed_generator.py so that each file works alone; ``submit`` reads a request
    by its fields, so either file's ``Request`` is served.)

Supported, and what raises
    Any model with the protocol (gpt-oss's sinks and sliding windows included); fp32 / fp16 / bf16
    weights on any device (sampling math in fp32/fp64).  Inference only.  Many threads may call
    ``submit`` and ``load_weights``.  ValueError for an empty prompt, a token id >= vocab_size, a
    prompt of max_seq_len tokens or more (no room to generate), a state dict with missing, unexpected
    or mis-shaped tensors, a version below the current one;
    TypeError for a model without the protocol, a request without the Request fields, non-tensor or
    non-floating state-dict values, a non-int version; RuntimeError after ``close()``.

References
    gpt-fast (PyTorch Labs, 2023): prefill + decode loop over a static KV cache; Holtzman et al., The
    Curious Case of Neural Text Degeneration (nucleus sampling, 2020); OpenAI, gpt-oss-120b & gpt-oss-20b
    Model Card (2025: attention sinks, alternating sliding-window and full layers).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import operator
import random
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import Future

import torch
from torch import nn

__all__ = ["SamplingParams", "Request", "Completion", "Generator"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_index(t) -> bool:
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


# ----------------------------------------------------------------------------- data types

# (field, rule, what it must be, error): SamplingParams applies them at construction, the router's
# submit to every request it routes (whoever built it, and whatever was changed after).
_SAMPLING_RULES = (
    ("max_new_tokens", lambda v: _is_int(v) and v >= 1, "an int >= 1", ValueError),
    ("temperature", lambda v: _is_real(v) and v >= 0, "a float >= 0 (0 = greedy)", ValueError),
    ("top_k", lambda v: _is_int(v) and v >= 0, "an int >= 0 (0 = off)", ValueError),
    ("top_p", lambda v: _is_real(v) and 0 < v <= 1, "in (0, 1] (1 = off)", ValueError),
    ("stop_token_ids", lambda v: isinstance(v, (tuple, list)) and all(map(_is_index, v)), "a sequence of ints",
     TypeError),
    ("stop_token_ids", lambda v: all(operator.index(t) >= 0 for t in v), "token ids >= 0", ValueError),
    ("seed", lambda v: v is None or _is_int(v), "an int or None", TypeError),
    ("n", lambda v: _is_int(v) and v >= 1, "an int >= 1", ValueError),
)


def _check_sampling(sp, what: str = "") -> None:
    for field, rule, expected, error in _SAMPLING_RULES:
        if not hasattr(sp, field):
            raise TypeError(f"{what.rstrip('.') or 'sampling'} must be a SamplingParams, got {type(sp).__name__} "
                            f"(no {field})")
        value = getattr(sp, field)
        if not rule(value):
            label = "n (samples of the prompt)" if field == "n" else field
            raise error(f"{what}{label} must be {expected}, got {value!r}")
    if sp.seed is not None and not -2 ** 63 <= sp.seed <= 2 ** 64 - sp.n:   # sample i draws from seed + i
        raise ValueError(f"{what}seed must be in [-2**63, 2**64 - n] (sample i is seeded with seed + i), "
                         f"got {sp.seed}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.  Frozen: one instance may be shared by many requests."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1

    def __post_init__(self):
        stops = self.stop_token_ids
        if isinstance(stops, Iterable) and not isinstance(stops, (str, bytes)):
            object.__setattr__(self, "stop_token_ids", tuple(stops))
        _check_sampling(self)  # the rules the router's submit also applies to every request
        object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in self.stop_token_ids))


_request_ids = itertools.count()  # next() on a count is atomic under the GIL: ids stay unique across threads


@dataclasses.dataclass
class Request:
    """One prompt to complete.  A missing ``request_id`` is filled with a unique one."""

    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    request_id: str | None = None
    session_id: Hashable | None = None

    def __post_init__(self):
        prompt = self.prompt_token_ids
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
                raise TypeError(f"prompt_token_ids must be a 1-D integer tensor, got {prompt.dtype} "
                                f"of shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise TypeError(f"prompt_token_ids must be a sequence of ints, got {type(prompt).__name__}")
        try:
            prompt = [operator.index(t) for t in prompt]
        except TypeError:
            raise TypeError("prompt_token_ids must hold ints (token ids)") from None
        if not prompt:
            raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
        if min(prompt) < 0:
            raise ValueError(f"prompt_token_ids must be token ids >= 0, got {min(prompt)}")
        self.prompt_token_ids = prompt
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.request_id is None:
            self.request_id = f"req-{next(_request_ids)}"
        elif not isinstance(self.request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(self.request_id).__name__}")
        try:
            hash(self.session_id)
        except TypeError:
            raise TypeError(f"session_id must be hashable, got {type(self.session_id).__name__}") from None


@dataclasses.dataclass
class Completion:
    """What a generator returns for one request, stamped with the weights that produced it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    generator_id: str
    min_policy_version: int
    max_policy_version: int
    sample_index: int = 0


# ----------------------------------------------------------------------------- attention over the cache

def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v with GQA, causal and bottom-right aligned, fp32 inside.  q [L_q, H_q, D];
    k, v [L_k, H_kv, D] -> [L_q, H_q, D] in q's dtype.  Query row i sits at position p = i + L_k - L_q and
    sees keys j <= p: the whole prompt in a prefill, every cached key in a decode step (decoder_lm.py
    computes the same).  gpt-oss's layers add two things:
        window   (a sliding layer, W keys) row p sees only p - W < j <= p, its own key included
        sinks    [H_q]: one more key per head, of logit sinks[h] and value 0.  It joins the softmax's
                 denominator and adds nothing to the sum: p_j = e^(s_j) / (e^sinks[h] + sum_j' e^(s_j'))"""
    l_q, h_q, d = q.shape
    l_k, h_kv = k.shape[0], k.shape[1]
    qf = q.float().view(l_q, h_kv, h_q // h_kv, d)                            # [L_q, H_kv, G, D]
    s = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale                 # [H_kv, G, L_q, L_k]
    p = torch.arange(l_q, device=q.device)[:, None] + (l_k - l_q)             # [L_q, 1] each row's position
    j = torch.arange(l_k, device=q.device)[None]                              # [1, L_k]
    hidden = (j > p) | ((j <= p - window) if window else False)
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:                                                     # the sink's column, value 0
        sink = sinks.float().view(h_kv, h_q // h_kv, 1, 1).expand(h_kv, h_q // h_kv, l_q, 1)
        s = torch.cat([s, sink], dim=-1)                                      # [H_kv, G, L_q, L_k + 1]
    weights = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :l_k]             # (drop the sink: its value is 0)
    o = torch.einsum("hgqk,khd->qhgd", weights, v.float())                    # [L_q, H_kv, G, D]
    return o.reshape(l_q, h_q, d).to(q.dtype)


# ----------------------------------------------------------------------------- sampling

def sample(logits: torch.Tensor, sp: SamplingParams, u: float | None) -> tuple[int, float]:
    """One token from fp32 logits [V] (the module docstring's rule) and its logprob; ``u`` in [0, 1) is the
    position's draw (``keyed_uniform``; unused when greedy)."""
    if sp.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    inv_t = torch.tensor(1.0 / sp.temperature, dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits * inv_t, dim=-1)      # times an fp32 1/T: what a batched engine computes
    p = logp.exp()
    order = None
    if sp.top_k or sp.top_p < 1.0:
        p, order = torch.sort(p, descending=True, stable=True)
        keep = torch.ones_like(p, dtype=torch.bool)
        if sp.top_k:
            keep[sp.top_k:] = False
        if sp.top_p < 1.0:
            keep &= (torch.cumsum(p, dim=-1) - p) < sp.top_p              # mass before the token < top_p
        p = torch.where(keep, p, torch.zeros_like(p))
    cdf = torch.cumsum(p.double(), dim=-1)
    index = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    # u * cdf[-1] may round up to cdf[-1]: stay on the last token that has probability.
    last = p.shape[-1] - 1 - int(torch.argmax((p.flip(-1) > 0).to(torch.int8)))
    index = min(index, last)
    token = index if order is None else int(order[index])
    return token, float(logp[token])


# SplitMix64 (Steele, Lea and Flood, 2014): the stream seeded s outputs mix(s + i * gamma) for i = 1, 2, ...,
# so its i-th output is a function of (s, i) alone, computed without the i - 1 before it.
_GAMMA, _MASK64 = 0x9E3779B97F4A7C15, (1 << 64) - 1


def keyed_uniform(seed: int, index: int) -> float:
    """The draw for token ``index`` of a sample whose seed is ``seed``: SplitMix64's output ``index + 1`` of
    the stream ``seed``, its top 53 bits as a float64 in [0, 1)."""
    z = (seed + (index + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53


def request_seed(seed: int | None) -> int:
    """A sample's seed: its own, or a fresh random 64-bit one."""
    return random.SystemRandom().getrandbits(64) if seed is None else seed


# ----------------------------------------------------------------------------- memory budget
# What the caches may take (fast/generator_engine.py's section "memory budget" states the same budget):
# ``kv_cache_memory`` bytes, else on CUDA memory_utilization x the device's memory less what this process
# holds (the weights) and a second copy of the weights (the reference does not profile activations), on a
# CPU memory_utilization x CPU_SHARE of the available memory less that copy.  The reference holds one
# request's contiguous cache (its K/V and the linear layers' state) and the prefix cache's pages (their
# K/V and, for hybrid models, a checkpoint each): max_seq_len defaults to the model's, capped by what one
# sequence can hold, and cache_pages to what the rest of the budget holds.

CPU_SHARE = 0.5


def _size(n: float) -> str:
    """Bytes for a message: '1.50 GiB', '25.0 KiB'."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def _available_host_memory() -> tuple[int, str]:
    """(bytes this process may still allocate on the host, what bounds it): the least of MemAvailable, the
    cgroup's memory.max - memory.current and RLIMIT_AS - the address space in use."""
    import resource
    found = []

    def read(path):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    meminfo = read("/proc/meminfo")
    if meminfo:
        fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
        if "MemAvailable" in fields:
            found.append((int(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable"))
    limit, current = read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")
    if limit and current and limit.strip() != "max":
        found.append((int(limit) - int(current), "the cgroup's memory.max"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    status = read("/proc/self/status")
    if soft != resource.RLIM_INFINITY and status:
        vm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:")), 0)
        found.append((soft - vm, "RLIMIT_AS"))
    if not found:
        raise ValueError("cannot tell how much host memory is available (no /proc/meminfo): pass kv_cache_memory")
    return min(found)


def _memory_budget(device: torch.device, *, kv_cache_memory, memory_utilization: float, weight_bytes: int,
                   activation_bytes: int, device_memory=None) -> tuple[int, str]:
    """(bytes for the pools, where they come from): the section above.  ``device_memory``: a CUDA device's
    (free, total, bytes this process holds: torch's reserved memory, the weights in it), or a CPU's
    (available, what bounds it); measured when None (a parameter so that the arithmetic can be checked for
    a GPU on any machine)."""
    gib = 2 ** 30
    if kv_cache_memory is not None:
        return int(kv_cache_memory), f"kv_cache_memory={int(kv_cache_memory)}"
    if device.type == "cuda":
        free, total, held = device_memory if device_memory is not None else (
            *torch.cuda.mem_get_info(device), torch.cuda.memory_reserved(device))
        asked = memory_utilization * total
        if asked > free + held:
            raise ValueError(f"memory_utilization={memory_utilization} asks for {asked / gib:.2f} GiB of the GPU's "
                             f"{total / gib:.2f} GiB, but only {(free + held) / gib:.2f} GiB are free or held by this "
                             f"process (other processes hold the rest): lower memory_utilization or pass "
                             f"kv_cache_memory")
        budget = asked - held - weight_bytes - activation_bytes
        source = (f"{memory_utilization} x {total / gib:.2f} GiB ({device}) - {held / gib:.2f} GiB held "
                  f"(weights) - {weight_bytes / gib:.2f} GiB shadow weights - {activation_bytes / gib:.2f} GiB "
                  f"activation peak")
    else:
        available, bound = device_memory[:2] if device_memory is not None else _available_host_memory()
        budget = memory_utilization * CPU_SHARE * available - weight_bytes
        source = (f"{memory_utilization} x {CPU_SHARE} x {available / gib:.2f} GiB available ({bound}) - "
                  f"{weight_bytes / gib:.2f} GiB shadow weights")
    if budget <= 0:
        raise ValueError(f"no memory is left for the KV cache ({source} = {_size(budget)}): raise "
                         f"memory_utilization or pass kv_cache_memory")
    return int(budget), source


@torch.no_grad()
def _linear_state_shapes(model) -> dict:
    """Each "linear" layer's cache of one sequence, {layer: {name: (shape, dtype)}}: the layer run as a prefill
    runs it, on one token of zeros with a fresh cache (the plug-in's cache is opaque to the engine; this
    rank's shard of it)."""
    shapes, probed = {}, {}
    for i, kind in enumerate(model.config.kinds):
        if kind == "linear":
            module = model.layers[i].linear_attn
            same = (type(module), tuple((n, t.shape, t.dtype) for n, t in module.state_dict().items()))
            if same not in probed:                      # (layers of one class and sizes are probed once)
                p = next(module.parameters())
                cache = module.new_cache()
                module(torch.zeros(1, 1, model.config.hidden_size, dtype=p.dtype, device=p.device),
                       cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=p.device), cache=cache)
                probed[same] = {name: (tuple(t.shape[1:]), t.dtype) for name, t in vars(cache).items()
                                if isinstance(t, torch.Tensor)}
            shapes[i] = probed[same]
    return shapes


def _reference_plan(model, *, page_size: int, prefix_caching: bool, cache_pages, kv_cache_memory,
                    memory_utilization: float, max_seq_len) -> tuple[int, int, dict]:
    """(max_seq_len, cache_pages, the plan for stats()) from the budget (the section above): one sequence's
    contiguous cache, then the prefix cache's pages; ValueError naming the budget, the bytes per token and
    the largest context that fits when the sequence does not fit, or explicit cache_pages do not."""
    c = model.config
    params = next(model.parameters())
    per_token = 2 * c.kinds.count("attention") * c.num_kv_heads * c.head_dim * params.dtype.itemsize
    per_seq = sum(math.prod(shape) * dtype.itemsize for shapes in _linear_state_shapes(model).values()
                  for shape, dtype in shapes.values())
    weight_bytes = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    budget, source = _memory_budget(params.device, kv_cache_memory=kv_cache_memory,
                                    memory_utilization=memory_utilization, weight_bytes=weight_bytes,
                                    activation_bytes=0)
    fits = (budget - per_seq) // per_token if per_token else c.max_seq_len
    largest = min(fits, c.max_seq_len)
    what = f"the KV cache budget of {_size(budget)} ({source}) holds {max(fits, 0)} tokens at {per_token} " \
           f"bytes per token (beside {per_seq} bytes of linear-layer state)"
    if max_seq_len is not None and max_seq_len > c.max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is longer than the model's ({c.max_seq_len}: its rotary "
                         f"tables); load the model with a longer max_seq_len")
    if max_seq_len is not None and max_seq_len > fits or largest < 2:
        raise ValueError(f"{what}: fewer than max_seq_len={max_seq_len or c.max_seq_len} tokens of one sequence; "
                         f"the largest context that fits is {largest}: pass max_seq_len <= {largest}, or a larger "
                         f"kv_cache_memory / memory_utilization")
    length = max_seq_len or largest
    page_bytes = page_size * per_token + per_seq        # a cached page: its K/V and (hybrid) a checkpoint
    left = budget - length * per_token - per_seq
    pages = cache_pages if cache_pages is not None else max(0, int(left // page_bytes)) if page_bytes else 1024
    if prefix_caching and pages * page_bytes > left:
        raise ValueError(f"{what}: one sequence of {length} tokens and {pages} cached pages of {page_bytes} bytes "
                         f"do not fit; pass fewer cache_pages or a larger kv_cache_memory / memory_utilization")
    return length, pages, dict(memory_budget_bytes=int(budget), memory_budget_source=source,
                               kv_bytes_per_token=per_token, cache_pages=pages, max_seq_len=length)


# ----------------------------------------------------------------------------- the engine

class KVCache:
    """One request's caches: K and V [capacity, H_kv, D] per attention layer, the linear layers' own.

    ``attend`` / ``mix`` are ``model.layers_forward``'s callbacks for the tokens at positions
    ``start .. length - 1`` (set by ``advance``)."""

    def __init__(self, model: nn.Module, capacity: int):
        c, w = model.config, next(model.parameters())
        self.k, self.v, self.linear = {}, {}, {}
        # gpt-oss: each attention layer's window (0: full) and sinks (None: none), when the model has them
        window = getattr(model, "attention_window", lambda i: 0)
        sinks = getattr(model, "attention_sinks", lambda i: None)
        self.window = {i: window(i) for i, kind in enumerate(c.kinds) if kind == "attention"}
        self.sinks = {i: sinks(i) for i, kind in enumerate(c.kinds) if kind == "attention"}
        for i, kind in enumerate(c.kinds):
            if kind == "attention":
                self.k[i] = torch.zeros(capacity, c.num_kv_heads, c.head_dim, device=w.device, dtype=w.dtype)
                self.v[i] = torch.zeros_like(self.k[i])
            else:
                self.linear[i] = model.layers[i].linear_attn.new_cache()
        self.scale, self.device = c.head_dim ** -0.5, w.device
        self.start = self.length = 0

    def advance(self, n: int) -> torch.Tensor:
        """The next forward pass feeds n tokens; returns their positions [n]."""
        self.start, self.length = self.length, self.length + n
        return torch.arange(self.start, self.length, device=self.device)

    def attend(self, i, q, k, v):
        self.k[i][self.start:self.length] = k
        self.v[i][self.start:self.length] = v
        return causal_attention(q, self.k[i][:self.length], self.v[i][:self.length], self.scale,
                                window=self.window[i], sinks=self.sinks[i])

    def mix(self, i, module, h):
        if self.start == 0:  # the first tokens: one document
            cu = torch.tensor([0, h.shape[0]], dtype=torch.int32, device=h.device)
            return module(h[None], cu_seqlens=cu, cache=self.linear[i])[0]
        return module(h[None], cache=self.linear[i])[0]                   # continue from the state: [1, T, hidden]

    def linear_states(self) -> dict:
        """The linear layers' state now (copies): {layer: {name: tensor}}."""
        return {i: {n: t.clone() for n, t in vars(c).items() if isinstance(t, torch.Tensor)}
                for i, c in self.linear.items()}


class PrefixCache:
    """KV pages of earlier requests, reused by later ones (vLLM's automatic prefix caching, per page).

    A full page of ``page_size`` tokens is keyed by (its parent's id, its token ids, the weights'
    version): the same tokens from position 0 under the same weights.  Ids are never reused, so a key
    is exact and a chain whose parent was evicted is unreachable.  An entry holds the page's K and V
    per attention layer and, for models with "linear" layers, a checkpoint: each linear layer's state
    after the page's last token (a page without one cannot end a hit: the linear layers could not
    continue from there).  At most ``capacity`` pages, least recently used evicted first."""

    def __init__(self, page_size: int, capacity: int):
        self.page_size, self.capacity = page_size, capacity
        self.entries: OrderedDict = OrderedDict()   # key -> (id, {layer: (k, v)}, checkpoint or None)
        self.next_id = 1
        self.evictions = 0

    def chain(self, tokens: list, version: int, start_id: int = 0):
        """(key, page index) of the cached full pages of ``tokens``, from page 0 while they are cached."""
        parent, ps = start_id, self.page_size
        for j in range(len(tokens) // ps):
            key = (parent, tuple(tokens[j * ps:(j + 1) * ps]), version)
            if key not in self.entries:
                return
            yield key, j
            parent = self.entries[key][0]

    def match(self, tokens: list, version: int, max_pages: int, need_checkpoint: bool) -> list:
        """The longest run of cached pages, from page 0, ending on one with a checkpoint if needed."""
        keys = [key for key, j in self.chain(tokens, version) if j < max_pages]
        while keys and need_checkpoint and self.entries[keys[-1]][2] is None:
            keys.pop()
        for key in keys:
            self.entries.move_to_end(key)                   # used now
        return [self.entries[key] for key in keys]

    def put(self, parent_id: int, page_tokens: list, version: int, kv: dict, checkpoint) -> int:
        """Add a full page (or refresh it); returns its id, the parent id of the next page."""
        key = (parent_id, tuple(page_tokens), version)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][0]
        self.entries[key] = (self.next_id, kv, checkpoint)
        self.next_id += 1
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
            self.evictions += 1
        return self.next_id - 1

    def clear_older(self, version: int) -> None:
        """Weights changed: KV computed under an older version is never a hit."""
        for key in [k for k in self.entries if k[2] < version]:
            del self.entries[key]


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], sp: SamplingParams, seed: int,
             cache: PrefixCache | None = None, version: int = 0, counts: dict | None = None, max_seq_len=None,
             drafter=None, num_speculative_tokens: int = 0):
    """gpt-fast's loop: prefill the prompt, then one forward pass per token.  -> (tokens, logprobs, reason).
    Token j is drawn with ``keyed_uniform(seed, j)``.

    Speculative (``drafter(tokens, k) -> up to k token ids``): each decode step proposes up to
    ``num_speculative_tokens`` drafts (never more than the completion has room for, less one) and verifies
    them in one forward over [the tokens not cached yet, the drafts]; position by position the token is drawn
    from the target's row with its own keyed draw, a draft accepted while it equals that token, the first
    token that differs (or the token after the last draft) emitted too.  So the tokens are plain decoding's
    (same seed, same draws), the logprobs the target's rows (here computed over several rows at once:
    rounding apart from plain decoding's one-row steps).  The look-ahead is rolled back (the KV length and
    the linear layers' state restored) and the accepted tokens are fed again the plain way: every cache and
    prefix page then holds accepted tokens only.

    With a prefix ``cache``: the longest cached run of the prompt's full pages is restored (its K/V,
    and the linear layers' checkpoint after it), the rest is prefilled a page at a time, and every
    page that fills (prompt or generated tokens) is added to the cache with the linear layers' state
    after it.  At least the prompt's last token is always computed: its logits give the first token.
    ``counts`` (prompt_tokens, computed_prompt_tokens, prefix_hit_tokens; draft_tokens and accepted_draft_tokens
    when speculating) is updated; ``max_seq_len`` (default: the model's) caps prompt + generated tokens."""
    dev = next(model.parameters()).device
    limit = min(sp.max_new_tokens, (max_seq_len or model.config.max_seq_len) - len(prompt))
    kv = KVCache(model, len(prompt) + limit - 1)   # the last token's K/V is never needed
    tokens, generated, logprobs = list(prompt), [], []
    parent = 0                                      # the cache id of the last full page (0: none yet)
    if cache is not None:
        ps, hybrid = cache.page_size, bool(kv.linear)
        hits = cache.match(tokens, version, (len(tokens) - 1) // ps, need_checkpoint=hybrid)
        for j, (page_id, pages, _) in enumerate(hits):
            for i, (k, v) in pages.items():
                kv.k[i][j * ps:(j + 1) * ps], kv.v[i][j * ps:(j + 1) * ps] = k, v
            parent = page_id
        if hits and hybrid:                         # the linear layers continue from the last page's end
            for i, state in hits[-1][2].items():
                for name, t in state.items():
                    setattr(kv.linear[i], name, t.clone())
        kv.start = kv.length = len(hits) * ps
    counts = {} if counts is None else counts
    for name, n in (("prompt_tokens", len(prompt)), ("computed_prompt_tokens", len(prompt) - kv.length),
                    ("prefix_hit_tokens", kv.length)):
        counts[name] = counts.get(name, 0) + n

    if isinstance(drafter, type):                   # a drafter with per-sample state (MTPDrafter)
        drafter = drafter(model, len(prompt) + limit + num_speculative_tokens)
    observe = getattr(drafter, "observe", None)     # it reads the main model's hidden states

    def run(feed: list) -> torch.Tensor:
        """Feed ``feed`` into the caches (a page at a time with a prefix cache, each full page cached with
        the linear layers' state after it) -> the hidden state of its last token [1, hidden]."""
        nonlocal parent
        first, hidden = kv.length, []
        if cache is None:
            pieces = [feed]
        else:  # up to each page boundary, so every full page is cached with the state after it
            room = cache.page_size - kv.length % cache.page_size
            pieces = [feed[:room]] + [feed[p:p + cache.page_size] for p in range(room, len(feed), cache.page_size)]
        for piece in pieces:
            positions = kv.advance(len(piece))
            h = model.layers_forward(torch.tensor(piece, device=dev), positions, kv.attend, kv.mix)
            hidden.append(h)
            if cache is not None and kv.length % cache.page_size == 0:
                j = kv.length // cache.page_size - 1
                pages = {i: (kv.k[i][j * ps:kv.length].clone(), kv.v[i][j * ps:kv.length].clone()) for i in kv.k}
                parent = cache.put(parent, tokens[j * ps:kv.length], version, pages,
                                   kv.linear_states() if kv.linear else None)
        if observe is not None:
            observe(first, torch.cat(hidden))
        return h[-1:]

    feed = tokens[kv.length:]          # the tokens not in the caches yet: the newest is the last
    while True:
        room = limit - len(generated) - 1                    # drafts a verification may accept
        draft = (list(drafter(list(tokens), min(num_speculative_tokens, room))) if drafter and generated and room > 0
                 else [])
        if draft:                      # look ahead: feed + draft, then roll the caches back
            length, states = kv.length, kv.linear_states()
            h = model.layers_forward(torch.tensor(feed + draft, device=dev), kv.advance(len(feed) + len(draft)),
                                     kv.attend, kv.mix)
            rows = model.logits(h[len(feed) - 1:])           # the target's next-token rows: feed's last, each draft
            kv.length = length
            for i, state in states.items():
                for name, t in state.items():
                    setattr(kv.linear[i], name, t)
            counts["draft_tokens"] = counts.get("draft_tokens", 0) + len(draft)
        else:
            rows = model.logits(run(feed))
        new, finish = [], None
        for j, row in enumerate(rows):                       # position by position, each its own keyed draw
            token, logprob = sample(row, sp, keyed_uniform(seed, len(generated)))
            new.append(token)
            generated.append(token)
            tokens.append(token)
            logprobs.append(logprob)
            if token in sp.stop_token_ids:
                finish = "stop"
            elif len(generated) == limit:
                finish = "length"
            if finish or j == len(draft) or token != draft[j]:
                break
        if draft:                      # the accepted drafts (new[:-1]) go into the caches the plain way
            counts["accepted_draft_tokens"] = counts.get("accepted_draft_tokens", 0) + len(new) - 1
            counts.setdefault("acceptance_lengths", []).append(len(new) - 1)
            run(feed + new[:-1])
        if finish:
            return generated, logprobs, finish
        feed = [new[-1]]


def ngram_draft(tokens: list, k: int, max_n: int = 4, min_n: int = 2) -> list:
    """Prompt-lookup drafting (n-gram speculation): for n = max_n down to min_n, find the latest earlier
    occurrence of the sequence's last n tokens that k tokens follow and propose those (else the latest
    occurrence's shorter continuation: in a repeating run the latest match sits just before the suffix);
    [] when none recurs.  Weight-free, for any model: it pays where outputs repeat their context (code
    edits, quoting, reasoning that restates, a model caught in a loop)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix, latest = tokens[-n:], None
        for start in range(len(tokens) - n - 1, -1, -1):             # latest first, the suffix itself excluded
            if tokens[start:start + n] == suffix:
                if len(tokens) - start - n >= k:
                    return tokens[start + n:start + n + k]
                latest = tokens[start + n:start + n + k] if latest is None else latest
        if latest is not None:
            return latest
    return []


class MTPDrafter:
    """``speculative="mtp"``: Qwen3.5's multi-token-prediction head drafts (decoder_lm.py's ``MTPHead``; the
    model built with ``mtp=True``), one per sample, greedily.  The head's row t combines the main model's
    hidden state at position t with token t + 1 and predicts token t + 2; its keys are its own (one K/V cache
    per MTP layer, rows at their positions).  ``observe`` receives the main model's hidden states as the
    engine computes them; a draft first runs the head over every position whose next token is known and whose
    row is not computed yet (its keys kept), the last of them proposing the token after the sequence, then
    feeds the head its own output with each draft, k - 1 more times (those rows are scratch, overwritten by
    the next catch-up).  After a prefix-cache hit the head's rows start at the first computed position
    (drafts may be worse there; the tokens never change: verification decides them)."""

    def __init__(self, model: nn.Module, capacity: int):
        c, w = model.config, next(model.parameters())
        self.model, self.first, self.length, self.hidden = model, None, 0, {}
        self.layers = [c.num_layers + d for d in range(c.mtp_layers)]
        self.k = {i: torch.zeros(capacity, c.num_kv_heads, c.head_dim, device=w.device, dtype=w.dtype)
                  for i in self.layers}
        self.v = {i: torch.zeros_like(t) for i, t in self.k.items()}
        self.scale, self.start, self.end = c.head_dim ** -0.5, 0, 0

    def observe(self, first_position: int, hidden: torch.Tensor) -> None:
        """The main model's final-normed hidden states [n, hidden] of positions first_position ..."""
        if self.first is None:
            self.first = self.length = first_position
        for j in range(hidden.shape[0]):
            self.hidden[first_position + j] = hidden[j]

    def attend(self, i, q, k, v):
        self.k[i][self.start:self.end], self.v[i][self.start:self.end] = k, v
        return causal_attention(q, self.k[i][self.first:self.end], self.v[i][self.first:self.end], self.scale)

    def _rows(self, next_ids: list, start: int, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """The head over positions start .. start + len(next_ids) - 1 -> its logits [n, V]."""
        self.start, self.end = start, start + len(next_ids)
        dev = hidden.device
        y = self.model.mtp_forward(torch.tensor(next_ids, device=dev), torch.arange(start, self.end, device=dev),
                                   hidden, self.attend, depth)
        return y, self.model.logits(y)

    @torch.no_grad()
    def __call__(self, tokens: list, k: int) -> list:
        last = len(tokens) - 2                         # the last position whose next token is known
        if self.first is None or last < self.length:
            return []
        hidden = torch.stack([self.hidden.pop(p) for p in range(self.length, last + 1)])
        y, logits = self._rows(tokens[self.length + 1:last + 2], self.length, hidden, 0)
        self.length = last + 1
        draft = [int(torch.argmax(logits[-1]))]
        for depth in range(1, k):                      # the head on its own output, one position on
            y, logits = self._rows(draft[-1:], last + depth, y[-1:], depth)
            draft.append(int(torch.argmax(logits[-1])))
        return draft


def _drafter(speculative, k):
    """The drafter function ``Generator(speculative=...)`` names, or None; checks ``num_speculative_tokens``."""
    if not _is_int(k) or not 1 <= k <= 64:
        raise ValueError(f"num_speculative_tokens must be an int in [1, 64], got {k!r}")
    if speculative is None or callable(speculative):
        return speculative
    if speculative == "ngram":
        return ngram_draft
    if speculative == "mtp":
        return MTPDrafter
    raise ValueError(f"speculative must be None, 'ngram', 'mtp' or a drafter function (tokens, k) -> token ids, "
                     f"got {speculative!r}")


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index`` of a request draws with its own seed: seed + index (None stays random)."""
    return None if seed is None else seed + index


class Generator:
    """The reference engine: requests one at a time, weights loaded between them.

    ``Generator(model, *, name="generator", policy_version=0, page_size=16, prefix_caching=True,
    cache_pages=1024, kv_on_swap="keep")`` serves ``model`` (the module docstring's protocol: decoder_lm.py's
    ``DecoderLM``), or ``Generator.from_pretrained(path, model_class=DecoderLM, ...)`` a checkpoint;
    ``close()`` (or ``with``) stops its thread and fails what is still queued.  ``prefix_caching``:
    reuse the KV pages (and linear-layer checkpoints) of earlier requests, at most ``cache_pages``
    pages of ``page_size`` tokens (off: every prompt is prefilled whole).  ``kv_on_swap`` ("keep" or
    "recompute"): what the fast engine does with a running request's KV at a weight swap; here a
    request never spans a load, so it never applies.  A request with ``sampling.n > 1`` is a group:
    its future resolves to n completions, sample i drawn from ``seed + i``, each equal to the request
    alone with that seed and n = 1.  ``speculative``: None (plain decoding), ``"ngram"`` (``ngram_draft``:
    prompt lookup), ``"mtp"`` (``MTPDrafter``: Qwen3.5's multi-token-prediction head, the model built with
    ``mtp=True``) or a drafter function ``(tokens, k) -> up to k token ids``; each decode step verifies up
    to ``num_speculative_tokens`` drafts at once (``generate`` states the rule: plain decoding's tokens).
    """

    def __init__(self, model: nn.Module, *, name: str = "generator", policy_version: int = 0, page_size: int = 16,
                 prefix_caching: bool = True, cache_pages: int | None = None, kv_on_swap: str = "keep",
                 kv_cache_memory: int | None = None, memory_utilization: float = 0.9, max_seq_len: int | None = None,
                 speculative=None, num_speculative_tokens: int = 3):
        _check_model(model)
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self._drafter = _drafter(speculative, num_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        if self._drafter is MTPDrafter and getattr(model, "mtp", None) is None:
            raise ValueError("speculative='mtp' needs a model with Qwen3.5's MTP head: decoder_lm.py's "
                             "DecoderLM(..., mtp=True) or DecoderLM.from_pretrained(path, mtp=True)")
        if not _is_int(policy_version):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        _check_cache_options(prefix_caching, page_size, cache_pages, kv_on_swap, kv_cache_memory, memory_utilization,
                             max_seq_len)
        self.name = name
        self.model = model.eval()
        self.config = model.config
        self.device = next(model.parameters()).device
        self._shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self._optional = _tied_aliases(model)
        self._ignored = tuple(getattr(model, "ignored_weight_prefixes", ()))
        self._version = policy_version
        self.page_size, self.kv_on_swap = page_size, kv_on_swap
        self.max_seq_len, cache_pages, self.memory = _reference_plan(
            model, page_size=page_size, prefix_caching=prefix_caching, cache_pages=cache_pages,
            kv_cache_memory=kv_cache_memory, memory_utilization=memory_utilization, max_seq_len=max_seq_len)
        self._cache = PrefixCache(page_size, cache_pages) if prefix_caching else None
        self._counts = dict(prompt_tokens=0, computed_prompt_tokens=0, prefix_hit_tokens=0, draft_tokens=0,
                            accepted_draft_tokens=0, acceptance_lengths=[0] * (num_speculative_tokens + 1))
        self._cv = threading.Condition()
        self._load_lock = threading.Lock()  # one load_weights at a time
        self._queue: deque = deque()        # (request, future), or (None, (tensors, version, done future))
        self._closed = False
        self._running = self._completed = 0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-worker", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path, *, model_class, linear_layer=None, **kwargs) -> Generator:
        """A generator serving the Hugging Face checkpoint at ``path``: ``model_class.from_pretrained(path,
        linear_layer=..., moe_layer=..., dtype=..., device=..., max_seq_len=..., batch_invariant=...)`` (decoder_lm.py's
        ``DecoderLM``; those keywords go to it when given, ``max_seq_len`` to the engine too: it must fit the
        memory budget; ``mtp=True``, the MTP head, is implied by ``speculative="mtp"``), the other keywords to
        ``Generator``."""
        if not callable(getattr(model_class, "from_pretrained", None)):
            raise TypeError(f"model_class must have a from_pretrained(path, ...) classmethod (decoder_lm.py's "
                            f"DecoderLM), got {model_class!r}")
        model_kw = {k: kwargs.pop(k) for k in _MODEL_KEYWORDS if k in kwargs}
        if kwargs.get("speculative") == "mtp":          # the head drafts: load it (mtp.*) with the model
            model_kw.setdefault("mtp", True)
        if "max_seq_len" in model_kw:                   # the model's and the engine's
            kwargs["max_seq_len"] = model_kw["max_seq_len"]
        return cls(model_class.from_pretrained(path, linear_layer=linear_layer, **model_kw), **kwargs)

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request) -> Future:
        """Queue one request; the future resolves to its ``Completion`` (a list of n with
        ``sampling.n > 1``).  Never blocks."""
        _check_servable(request, self.config, self.max_seq_len)
        future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"generator {self.name} is closed")
            self._queue.append((request, future))
            self._cv.notify()
        return future

    def generate(self, requests) -> list:
        """Submit every request, wait, return the completions in order (raises the first failure)."""
        futures = [self.submit(r) for r in list(requests)]
        return [f.result() for f in futures]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Validate, then load between two requests; returns when ``policy_version == version``."""
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        with self._load_lock:
            if version < self._version:
                raise ValueError(f"version must not decrease: got {version}, serving {self._version}")
            tensors = _checked_state_dict(state_dict, self._shapes, self._optional, self._ignored)
            done = Future()
            with self._cv:
                if self._closed:
                    raise RuntimeError(f"generator {self.name} is closed")
                self._queue.appendleft((None, (tensors, version, done)))  # before the waiting requests
                self._cv.notify()
            done.result()

    def stats(self) -> dict:
        """waiting, running, completed, policy_version; prompt_tokens (requested, per sample),
        computed_prompt_tokens (run through the model), prefix_hit_tokens, evictions, cached_pages,
        state_checkpoints (cached pages that carry the linear layers' state); draft_tokens and
        accepted_draft_tokens (speculative decoding: proposed, and accepted by verification), acceptance_lengths
        (how many verifications accepted 0, 1, ..., num_speculative_tokens drafts); the memory budget:
        memory_budget_bytes, memory_budget_source, kv_bytes_per_token, cache_pages (the prefix cache's
        capacity), max_seq_len."""
        with self._cv:
            waiting = sum(r is not None for r, _ in self._queue)
            cache = self._cache
            return dict(waiting=waiting, running=self._running, completed=self._completed,
                        policy_version=self._version, **copy.deepcopy(self._counts),
                        evictions=cache.evictions if cache else 0, cached_pages=len(cache.entries) if cache else 0,
                        state_checkpoints=sum(e[2] is not None for e in cache.entries.values()) if cache else 0,
                        **self.memory)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the worker

    @torch.no_grad()
    def _copy_in(self, tensors: dict) -> None:
        params = self.model.state_dict()
        for n, t in tensors.items():
            params[n].copy_(t)

    def _serve(self, request) -> list:
        """The request's n samples, one after the other (sample i from seed + i)."""
        version, sp, out = self._version, request.sampling, []
        for index in range(sp.n):
            counts = {}
            seed = request_seed(sample_seed(sp.seed, index))
            tokens, logprobs, reason = generate(self.model, request.prompt_token_ids, sp, seed, self._cache,
                                                version, counts, self.max_seq_len, self._drafter,
                                                self.num_speculative_tokens)
            with self._cv:
                for name, n in counts.items():
                    if name == "acceptance_lengths":             # one entry per verification: a histogram
                        for accepted in n:
                            self._counts[name][accepted] += 1
                    else:
                        self._counts[name] += n
            out.append(Completion(request.request_id, list(request.prompt_token_ids), tokens, logprobs, reason,
                                  self.name, version, version, index))
        return out

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._closed):
                    self._cv.wait()
                if self._closed:
                    leftover, self._queue = list(self._queue), deque()
                    break
                request, job = self._queue.popleft()
                self._running = int(request is not None)
            if request is None:  # a weight load, between two requests
                tensors, version, done = job
                try:
                    self._copy_in(tensors)
                    self._version = version
                    if self._cache is not None:
                        self._cache.clear_older(version)
                    done.set_result(None)
                except Exception as exc:  # validated already; a device error lands here
                    done.set_exception(exc)
                continue
            future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                samples = self._serve(request)
                outcome = (future.set_result, samples if request.sampling.n > 1 else samples[0])
            except Exception as exc:
                outcome = (future.set_exception, exc)
            with self._cv:
                self._running = 0
                self._completed += 1
            outcome[0](outcome[1])  # outside every lock: callbacks may submit again
        closed = RuntimeError(f"generator {self.name} closed before serving the request")
        for request, job in leftover:
            if request is None:
                job[2].set_exception(closed)
            elif job.set_running_or_notify_cancel():
                job.set_exception(closed)


# ----------------------------------------------------------------------------- input checks

def _check_servable(request, config, max_seq_len: int) -> None:
    """What makes a request unservable: ValueError / TypeError (a router keeps the generator)."""
    prompt = getattr(request, "prompt_token_ids", None)
    if not isinstance(prompt, list) or not hasattr(getattr(request, "sampling", None), "max_new_tokens"):
        raise TypeError(f"request must be a Request (prompt_token_ids, sampling, request_id), "
                        f"got {type(request).__name__}")
    _check_sampling(request.sampling)
    if not all(_is_int(t) for t in prompt):
        raise TypeError("prompt_token_ids must hold ints (token ids)")
    if not prompt:
        raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
    if max(prompt) >= config.vocab_size or min(prompt) < 0:
        raise ValueError(f"prompt_token_ids must be token ids in [0, {config.vocab_size}), got {max(prompt)}")
    if len(prompt) >= max_seq_len:
        raise ValueError(f"prompt_token_ids: a prompt of {len(prompt)} tokens leaves no room to generate "
                         f"in a context of max_seq_len={max_seq_len}")


def _check_cache_options(prefix_caching, page_size, cache_pages, kv_on_swap, kv_cache_memory, memory_utilization,
                         max_seq_len) -> None:
    if not isinstance(prefix_caching, bool):
        raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
    for name, value in (("page_size", page_size), ("cache_pages", cache_pages), ("kv_cache_memory", kv_cache_memory),
                        ("max_seq_len", max_seq_len)):
        if (name == "page_size" or value is not None) and (not _is_int(value) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if (not isinstance(memory_utilization, (int, float)) or isinstance(memory_utilization, bool)
            or not 0 < memory_utilization <= 1):
        raise ValueError(f"memory_utilization must be a fraction in (0, 1], got {memory_utilization!r}")
    if kv_on_swap not in ("keep", "recompute"):
        raise ValueError(f"kv_on_swap must be 'keep' or 'recompute', got {kv_on_swap!r}")


_MODEL_KEYWORDS = ("moe_layer", "dtype", "device", "max_seq_len", "batch_invariant", "mtp")


def _check_model(model) -> None:
    """The model protocol (ref/generator_engine.py's docstring states it), or a TypeError naming what is missing."""
    missing = [name for name in ("config", "layers_forward", "logits", "state_dict", "layers")
               if not hasattr(model, name)]
    missing += [f"config.{name}" for name in ("vocab_size", "max_seq_len", "num_kv_heads", "head_dim", "kinds")
                if hasattr(model, "config") and not hasattr(model.config, name)]
    if not isinstance(model, nn.Module) or missing:
        raise TypeError(f"model must be an nn.Module with the engine's protocol (decoder_lm.py's DecoderLM); "
                        f"{type(model).__name__} lacks {missing or ['nn.Module']}")


def _tied_aliases(model: nn.Module) -> set:
    """State-dict names whose tensor is an earlier name's (a tied lm_head): optional when loading."""
    seen, aliases = set(), set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases.add(name)
        seen.add(id(t))
    return aliases


def _checked_state_dict(state_dict, shapes: dict, optional: set = frozenset(), ignored: tuple = ()) -> dict:
    """Validate a whole state dict against the model's names and shapes before touching anything (names
    under the model's ``ignored_weight_prefixes``, such as a multimodal checkpoint's vision tower, are
    dropped; a tied alias may be absent)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    state_dict = {n: t for n, t in state_dict.items() if not (ignored and n.startswith(ignored))}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"state_dict[{name!r}] must be a floating tensor, got {t.dtype}")
    missing = [n for n in shapes if n not in state_dict and n not in optional]
    unexpected = [n for n in state_dict if n not in shapes]
    misshaped = [f"{n}: got {tuple(state_dict[n].shape)}, expected {shapes[n]}"
                 for n in shapes if n in state_dict and tuple(state_dict[n].shape) != shapes[n]]
    if missing or unexpected or misshaped:
        parts = [f"{label} {items[:5]}{' ...' if len(items) > 5 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                 if items]
        raise ValueError("state_dict rejected whole (weights and version unchanged): " + "; ".join(parts))
    return {n: state_dict[n] for n in shapes if n in state_dict}


if __name__ == "__main__":  # a short self-check with a two-layer model in this file: greedy decoding is deterministic
    class _TinyLM(nn.Module):
        """An embedding, one causal attention layer and a tied head: the protocol at its smallest."""
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), dict(vocab_size=64, max_seq_len=32, num_kv_heads=1, head_dim=8,
                                                  kinds=("attention",)))()
            self.layers = [None]
            self.embed = nn.Embedding(64, 8)

        def layers_forward(self, ids, positions, attend, mix):
            x = self.embed(ids)
            return x + attend(0, x[:, None], x[:, None], x[:, None])[:, 0]

        def logits(self, h):
            return (h @ self.embed.weight.t()).float()

    torch.manual_seed(0)
    with Generator(_TinyLM()) as g:
        a = g.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=5))])[0]
        g.load_weights(g.model.state_dict(), 1)
        b = g.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=5))])[0]
    assert a.token_ids == b.token_ids and (b.min_policy_version, b.max_policy_version) == (1, 1)
    print("ok:", a.token_ids)
