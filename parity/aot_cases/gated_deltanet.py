"""Ahead-of-time build cases for fast/gated_deltanet.py (read by parity/aot_compile.py and parity/test_compile.py).

``cases(m)`` takes the fast module ``m`` (imported with the Triton compiler, not the interpreter)
and lists its launches in aot_compile.py's case format, reading the module's private config tables
so that what is built is what the launcher launches.  CI builds each case with its first config;
``make compile-check`` builds every config.  ``chunk_gated_delta_rule(batch_invariant=True)`` launches each
autotuned kernel at the first config its pruning keeps (built by every case) and the gate sums in token
order (the cumsum cases with IN_ORDER).
"""
from __future__ import annotations

import torch
import triton

F32, I32, I8 = "*fp32", "*i32", "*i8"


def _shape(m, dtype, dk: int, dv: int, suffix: str = ""):
    """What every case at one (dtype, K, V) needs: its name tag, whether its dots must use tensor cores,
    the dot precision, the input pointer type, and the arguments the pruning functions read."""
    dt = m._TL_DTYPES[dtype]
    named = dict(K=dk, V=dv, k=torch.empty(0, dtype=dtype), q=torch.empty(0, dtype=dtype))
    return f"[{dt},K={dk},V={dv}{suffix}]", dtype != torch.float32, m._prec(dtype), f"*{dt}", named


def cases(m) -> list[dict]:
    """Every kernel at the shapes that decide its code: fp16 / bf16 / fp32 at K = V = 128; bf16 at
    K = V = 100 (padded, masked) and 256 (four state tiles); fp32 at K = V = 256 (four tiles of FMA
    products: the register-heaviest state and dhu builds); bf16 at K = V = 64 (one K tile) and fp32
    at K = 64, V = 48 (one K tile, masked V).  Varlen, initial and final state on (the superset of
    the code paths).  Autotuned kernels build every config their pruning keeps, except at the lean
    shapes, which build the first one per kernel to keep the check's time down: fp16 compiles like
    bf16 (the same registers in every build compared), and each of the last three shapes prunes to
    a subset of the configs built at K = V = 128 of its dtype (fp32 state, dhu and output keep a
    single config at every K: that one is built), so only its tile shapes are new."""
    cases = []
    full = [(torch.bfloat16, 128, 128), (torch.float32, 128, 128), (torch.bfloat16, 100, 100),
            (torch.bfloat16, 256, 256)]
    lean = [(torch.float16, 128, 128), (torch.float32, 256, 256), (torch.bfloat16, 64, 64), (torch.float32, 64, 48)]
    heads = dict(H=16, HV=32)
    for dtype, dk, dv, one in [(*x, False) for x in full] + [(*x, True) for x in lean]:
        tag, tc, prec, ptr, named = _shape(m, dtype, dk, dv)
        bk_full = m._pow2(dk)
        cases.append(dict(kernel=m._l2norm_kernel, name="l2norm" + tag, signature=dict(x=ptr, y=ptr, rstd=F32, R="i32"),
                          constexprs=dict(D=dk, BR=4096 // bk_full, BD=bk_full), num_warps=4))
        # 16-row blocks: mma.sync, too few rows for wgmma
        cases.append(dict(kernel=m._chunk_kkt_solve_kernel, name="kkt_solve" + tag, tensor_cores=tc, wgmma=False,
                          signature=dict(k=ptr, gc=F32, gr=I8, beta=F32, A=ptr, cu=I32, chunk_idx=I32, T="i32"),
                          constexprs=dict(**heads, K=dk, BT=m.CHUNK, BK=min(64, bk_full), IS_VARLEN=True, PREC=prec),
                          num_warps=m._KKT_WARPS))
        wu = m._wu_tiles(dtype, dk, dv)
        cases.append(dict(kernel=m._chunk_wu_kernel, name="wu" + tag, tensor_cores=tc,
                          signature=dict(k=ptr, v=ptr, beta=F32, gs=F32, A=ptr, w=ptr, u=ptr, cu=I32,
                                         chunk_idx=I32, T="i32"),
                          constexprs=dict(**heads, K=dk, V=dv, BT=m.CHUNK, BK=wu["BK"], BV=wu["BV"], IS_VARLEN=True,
                                          PREC=prec), num_warps=wu["num_warps"]))
        cases += _state_cases(m, dtype, dk, dv, heads, tag, one_config=one, v_first=False)
        cases.append(dict(kernel=m._chunk_o_tuned, name="output" + tag, tensor_cores=tc,
                          configs=m._prune_out_configs(m._OUT_CONFIGS, named)[:1 if one else None],
                          signature=dict(q=ptr, k=ptr, v_new=ptr, h=ptr, gc=F32, gr=I8, o=ptr, cu=I32, chunk_idx=I32,
                                         scale="fp32", T="i32"),
                          constexprs=dict(**heads, K=dk, V=dv, BT=m.CHUNK, BK=32 if not tc else min(64, bk_full),
                                          IS_VARLEN=True, PREC=prec)))
        cases.append(_recurrent_case(m, dtype, dk, dv, heads, NO_OPTIONS, tag))
        cases += _backward_cases(m, dtype, dk, dv, heads, one_config=one)
    for hv in (16, 64):
        for gate in (False, True):                  # use_gate_in_kernel: the gate and its backward fused in
            tag = f"[HV={hv}{',gate' if gate else ''}]"
            options = dict(USE_GATE=gate, HAS_BIAS=gate)
            cases.append(dict(kernel=m._chunk_dg_kernel, name="dg" + tag,
                              signature=dict(db="*fp32", dg="*fp32", g="*fp32", A_log="*fp32", dt_bias="*fp32",
                                             dparams="*fp32", cu="*i32", chunk_idx="*i32", T="i32", NROWS="i32"),
                              constexprs=dict(HV=hv, NB=6, BT=m.CHUNK, BH=hv, IS_VARLEN=True, **options), num_warps=4))
            for in_order in (False, True):          # batch_invariant sums the gates in token order
                cases.append(dict(kernel=m._chunk_cumsum_kernel, name="cumsum" + tag[:-1] + (",in order]" if in_order
                                                                                             else "]"),
                                  signature=dict(g=F32, A_log=F32, dt_bias=F32, gc=F32, gr=I8, gs=F32, ge=F32,
                                                 cu="*i32", chunk_idx="*i32", T="i32"),
                                  constexprs=dict(HV=hv, BT=m.CHUNK, BH=hv, IS_VARLEN=True, IN_ORDER=in_order,
                                                  **options), num_warps=4))
    cases += _option_cases(m)
    return cases


# fla's options off: the launches most calls make
NO_OPTIONS = dict(USE_GATE=False, HAS_BIAS=False, BETA_ACT=0, STATE_V_FIRST=False)
# fla's options on (use_gate_in_kernel with dt_bias, 2 sigmoid(beta), the [N, HV, V, K] state layout)
ALL_OPTIONS = dict(USE_GATE=True, HAS_BIAS=True, BETA_ACT=2, STATE_V_FIRST=True)


def _option_cases(m) -> list[dict]:
    """The kernels whose code fla's options change (the state layout in the state passes; the gate
    and beta activations in the recurrent kernels), with every option on, at the register-heaviest
    shapes of each kind: bf16 at K = V = 128 and 256, fp32 at K = V = 256; first config only."""
    cases = []
    heads = dict(H=16, HV=32)
    for dtype, dk, dv in ((torch.bfloat16, 128, 128), (torch.bfloat16, 256, 256), (torch.float32, 256, 256)):
        tag, tc, prec, ptr, named = _shape(m, dtype, dk, dv, ",options")
        cases += _state_cases(m, dtype, dk, dv, heads, tag, one_config=True, v_first=True)
        cases.append(_recurrent_case(m, dtype, dk, dv, heads, ALL_OPTIONS, tag))
        cases += _dhu_cases(m, dtype, dk, dv, heads, tag, one_config=True, v_first=True)
        cases.append(_recurrent_bwd_case(m, dtype, dk, dv, heads, ALL_OPTIONS, tag))
    return cases


def _backward_cases(m, dtype, dk: int, dv: int, heads: dict, one_config: bool) -> list:
    """The backward kernels at one (dtype, K, V), for sm_80 and sm_90 with the tiles each launches."""
    tag, tc, prec, ptr, _ = _shape(m, dtype, dk, dv)
    cases = []
    for arch in (80, 90):
        common = dict(**heads, K=dk, V=dv, BT=m.CHUNK, IS_VARLEN=True, PREC=prec)
        tiles = {name: m._bwd_tiles(name, dtype, arch, dk, dv) for name in ("dv_local", "dqkwg", "wy")}
        launch = {name: dict(num_warps=t.pop("num_warps"), num_stages=t.pop("num_stages")) for name, t in tiles.items()}
        nb = 2 * (triton.cdiv(dk, tiles["dqkwg"]["BK"]) + 1)
        cases.append(dict(kernel=m._chunk_dv_local_kernel, name=f"dv_local{tag}", archs=[arch], tensor_cores=tc,
                          signature=dict(q=ptr, k=ptr, gc=F32, gr=I8, do=ptr, dv=ptr, cu=I32, chunk_idx=I32,
                                         scale="fp32", T="i32"),
                          constexprs=dict(**common, **tiles["dv_local"]), **launch["dv_local"]))
        cases += _dhu_cases(m, dtype, dk, dv, heads, tag, one_config=one_config, v_first=False, archs=(arch,))
        cases.append(dict(kernel=m._chunk_dqkwg_kernel, name=f"dqkwg{tag}", archs=[arch], tensor_cores=tc,
                          signature=dict(q=ptr, k=ptr, v_new=ptr, gc=F32, gr=I8, gs=F32, ge=F32, h=ptr, do=ptr, dh=ptr,
                                         dv=ptr, dq=ptr, dk=ptr, dw=ptr, db=F32, cu=I32, chunk_idx=I32, scale="fp32",
                                         T="i32"),
                          constexprs=dict(**common, **tiles["dqkwg"], NB=nb), **launch["dqkwg"]))
        cases.append(dict(kernel=m._chunk_wy_bwd_kernel, name=f"wy_bwd{tag}", archs=[arch], tensor_cores=tc,
                          signature=dict(k=ptr, v=ptr, beta=ptr, gc=F32, gr=I8, gs=F32, A=ptr, w=ptr, u=ptr, dw=ptr,
                                         du=ptr, dk=ptr, dk_out=ptr, dv=ptr, dbeta=ptr, db=F32, cu=I32, chunk_idx=I32,
                                         T="i32"),
                          constexprs=dict(**common, **tiles["wy"], NB=nb, HOLD_T=dtype != torch.float32),
                          **launch["wy"]))
    cases.append(_recurrent_bwd_case(m, dtype, dk, dv, heads, NO_OPTIONS, tag))
    cases.append(dict(kernel=m._l2norm_bwd_kernel, name=f"l2norm_bwd{tag}",
                      signature=dict(y=ptr, rstd=F32, dy=F32, dx=ptr, R="i32"),
                      constexprs=dict(D=dk, BR=4096 // m._pow2(dk), BD=m._pow2(dk)), num_warps=4))
    return cases


def _state_cases(m, dtype, dk: int, dv: int, heads: dict, tag: str, one_config: bool, v_first: bool) -> list:
    """The state pass (kernel 4) for sm_80 and sm_90, with the configs each keeps."""
    _, tc, prec, ptr, _ = _shape(m, dtype, dk, dv)
    return [dict(kernel=m._chunk_h_tuned, name="state" + tag, archs=[arch], tensor_cores=tc,
                 configs=m._state_keep(m._STATE_CONFIGS, dtype, arch, dk, dv)[:1 if one_config else None],
                 signature=dict(k=ptr, w=ptr, u=ptr, gs=F32, ge=F32, h=ptr, v_new=ptr, h0=F32, ht=F32, cu=I32,
                                chunk_off=I32, T="i32", NHV="i32"),
                 constexprs=dict(**heads, K=dk, V=dv, BT=m.CHUNK, **m._state_rows(dtype, dk), USE_H0=True,
                                 STORE_FINAL=True, STATE_V_FIRST=v_first, IS_VARLEN=True, PREC=prec))
            for arch in (80, 90)]


def _dhu_cases(m, dtype, dk: int, dv: int, heads: dict, tag: str, one_config: bool, v_first: bool,
               archs=(80, 90)) -> list:
    """The reverse state pass (backward step b) per arch, with the configs each keeps."""
    _, tc, prec, ptr, _ = _shape(m, dtype, dk, dv)
    return [dict(kernel=m._chunk_dhu_tuned, name=f"dhu{tag}", archs=[arch], tensor_cores=tc,
                 configs=m._dhu_keep(m._DHU_CONFIGS, dtype, arch, dk, dv)[:1 if one_config else None],
                 signature=dict(q=ptr, k=ptr, w=ptr, gs=F32, ge=F32, do=ptr, dv_local=ptr, dv=ptr, dh=ptr,
                                dht=F32, dh0=F32, cu=I32, chunk_off=I32, scale="fp32", T="i32", NHV="i32"),
                 constexprs=dict(**heads, K=dk, V=dv, BT=m.CHUNK, IS_VARLEN=True, PREC=prec, **m._dhu_rows(dtype, dk),
                                 USE_DHT=True, STORE_DH0=True, STATE_V_FIRST=v_first))
            for arch in archs]


def _recurrent_case(m, dtype, dk: int, dv: int, heads: dict, options: dict, tag: str, **flags) -> dict:
    """The recurrent (decode) kernel at its fixed tiles; ``flags`` override IS_VARLEN, USE_H0, STORE_FINAL
    (all on by default: the superset of the code paths)."""
    ptr = f"*{m._TL_DTYPES[dtype]}"
    config = m._rec_config(dk, dv)
    return dict(kernel=m._recurrent_kernel, name="recurrent" + tag,
                signature=dict(q=ptr, k=ptr, v=ptr, g=F32, beta=ptr, A_log=F32, dt_bias=F32, o=ptr, h0=F32, ht=F32,
                               cu=I32, scale="fp32", T="i32"),
                constexprs=dict(**heads, K=dk, V=dv, BK=m._pow2(dk), BV=config["BV"],
                                **dict(dict(USE_H0=True, STORE_FINAL=True, IS_VARLEN=True), **flags), L2NORM=True,
                                **options),
                num_warps=config["num_warps"], num_stages=config["num_stages"])


def _recurrent_bwd_case(m, dtype, dk: int, dv: int, heads: dict, options: dict, tag: str) -> dict:
    ptr = f"*{m._TL_DTYPES[dtype]}"
    rec = m._rec_bwd_tiles(dk, dv)
    return dict(kernel=m._recurrent_bwd_kernel, name=f"recurrent_bwd{tag}",
                signature=dict(q=ptr, k=ptr, v=ptr, g=F32, beta=ptr, A_log=F32, dt_bias=F32, do=ptr, h0=F32, dht=F32,
                               dq=F32, dk1=F32, dk2=F32, dv=ptr, dg=F32, dbeta=F32, da=F32, dh0=F32, p_buf=F32,
                               dp_buf=F32, z_buf=F32, cu=I32, scale="fp32", T="i32", NTOK="i32"),
                constexprs=dict(**heads, K=dk, V=dv, BK=m._pow2(dk), BV=rec["BV"], USE_H0=True, USE_DHT=True,
                                IS_VARLEN=True, L2NORM=True, **options), num_warps=rec["num_warps"],
                num_stages=rec["num_stages"])


def invariant_forward_cases(m, dtype, dk: int, dv: int, arch: int, varlen: bool) -> dict:
    """The chunk forward as ``batch_invariant=True`` launches it (the first config each pruning keeps, the
    gate sums in token order, the layer's gate outside the kernels) for one arch, varlen (a trainer's and a
    prefill's call: cu_seqlens) or dense (the engine's decode step: N whole chunks, no cu_seqlens): {kernel:
    case}.  parity/invariant_sass.py compares the two builds' floating-point instructions."""
    tag, tc, prec, ptr, named = _shape(m, dtype, dk, dv, ",varlen" if varlen else ",dense")
    heads = dict(H=16, HV=32)
    bk = m._pow2(dk)
    wu = m._wu_tiles(dtype, dk, dv)
    state = _state_cases(m, dtype, dk, dv, heads, tag, one_config=True, v_first=False)
    state = next(c for c in state if c["archs"] == [arch])
    state = dict(state, constexprs=dict(state["constexprs"], IS_VARLEN=varlen))
    return {
        "cumsum": dict(kernel=m._chunk_cumsum_kernel, name="cumsum" + tag,
                       signature=dict(g=F32, A_log=F32, dt_bias=F32, gc=F32, gr=I8, gs=F32, ge=F32, cu=I32,
                                      chunk_idx=I32, T="i32"),
                       constexprs=dict(HV=heads["HV"], BT=m.CHUNK, BH=m._pow2(heads["HV"], 2), IS_VARLEN=varlen,
                                       IN_ORDER=True, USE_GATE=False, HAS_BIAS=False), num_warps=4),
        "kkt_solve": dict(kernel=m._chunk_kkt_solve_kernel, name="kkt_solve" + tag, tensor_cores=tc, wgmma=False,
                          signature=dict(k=ptr, gc=F32, gr=I8, beta=F32, A=ptr, cu=I32, chunk_idx=I32, T="i32"),
                          constexprs=dict(**heads, K=dk, BT=m.CHUNK, BK=min(64, bk), IS_VARLEN=varlen, PREC=prec),
                          num_warps=m._KKT_WARPS),
        "wu": dict(kernel=m._chunk_wu_kernel, name="wu" + tag, tensor_cores=tc,
                   signature=dict(k=ptr, v=ptr, beta=F32, gs=F32, A=ptr, w=ptr, u=ptr, cu=I32, chunk_idx=I32, T="i32"),
                   constexprs=dict(**heads, K=dk, V=dv, BT=m.CHUNK, BK=wu["BK"], BV=wu["BV"], IS_VARLEN=varlen,
                                   PREC=prec), num_warps=wu["num_warps"]),
        "state": state,
        "output": dict(kernel=m._chunk_o_tuned, name="output" + tag, tensor_cores=tc,
                       configs=m._prune_out_configs(m._OUT_CONFIGS, named)[:1],
                       signature=dict(q=ptr, k=ptr, v_new=ptr, h=ptr, gc=F32, gr=I8, o=ptr, cu=I32, chunk_idx=I32,
                                      scale="fp32", T="i32"),
                       constexprs=dict(**heads, K=dk, V=dv, BT=m.CHUNK, BK=32 if not tc else min(64, bk),
                                       IS_VARLEN=varlen, PREC=prec)),
    }
