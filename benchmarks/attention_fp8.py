r"""The FP8 (E4M3) attention forward on the GPU: correctness first, then its speed against
flashfold's bf16 forward and cuDNN's bf16 SDPA on the same shapes, in one run.

Run (H200, from the repository root)::

    PYTHONPATH=src python benchmarks/attention_fp8.py            # checks, then the rows
    PYTHONPATH=src python benchmarks/attention_fp8.py --check-only
    PYTHONPATH=src python benchmarks/attention_fp8.py --tune     # template FP8 tiles

Rows: 16,384 tokens per batch, the d128 and d256 shapes of the workload grid
(``benchmarks/workloads.py``: Llama-3 8B's GQA 32:8 causal, a dense d128, Gemma-2's d256
causal with softcap 50, a dense d256) and a d64 row. Inputs are ``randn``, quantized per
(batch, KV head) by :func:`flashfold.quantize_fp8`, the E4M3 ``v`` stored keys-contiguous
(the layout the FP8 kernel reads, as a KV cache can keep it; made outside timing: a
row-major ``v`` adds one transpose per call); flashfold's bf16 forward and cuDNN's
take them in bf16. (With a few outlier channels the rounding of q and k to E4M3 dominates
both FP8 computations and the criterion below would hardly test the kernel;
``flashfold numerics`` reports that case.)

1. Correctness at the row's full shape: no NaN; on the last 256 query rows of batch 0,
   query head 0, the FP8 output's max error against the float64 attention of the
   *unquantized* inputs is at most twice that of a naive FP8 attention (the inputs
   dequantized to bf16, bf16 matmuls, softmax in fp32) plus 1e-5, the issue's criterion;
   the LSE within 1e-3 of the float64 LSE of the dequantized inputs.
   Each row also says which kernel runs the FP8 call (the planner's
   :func:`~flashfold.kernels.attention.dispatch.forward_gluon`; repeated in a line before
   the timings): ``gluon``, the warp-specialized kernel on E4M3 descriptors (sm_90, the
   default policy), or ``template``, the Triton template's ``FP8`` flag
   (``FLASHFOLD_GLUON=0``, other GPUs).
2. Speed: ``triton.testing.do_bench`` medians of the forward, eager and replayed from a
   CUDA graph (:func:`flashfold.bench.graph_replay`), for flashfold FP8, flashfold bf16
   and SDPA cuDNN bf16. TFLOP/s count the row's visible pairs (``4 H D P``, ``P = N^2``
   dense, ``N^2 / 2`` causal, as ``benchmarks/attention.py``), the same for every method.
   Printed ratios: FP8 over flashfold bf16 (target >= 1.6 on the d128 and d256 rows), over
   cuDNN bf16 and over cuDNN FP8.

``--tune``: after the checks, the Triton template's FP8 forward of each d128 / d256 row
(a forced configuration runs the template) under each of :data:`TUNE_CONFIGS` (tile
rows, key tiles, warps, stages; TMA), graph replays, TFLOP/s against the default configuration's (the bf16 table's,
:data:`flashfold.kernels.attention.fwd.HOPPER_CONFIGS`): an E4M3 tile holds half a bf16 tile's bytes, so wider key tiles or more stages fit in the
same shared memory.

``--accumulation``: before the checks, how exactly the tensor cores sum an E4M3 product
(the question behind a packed row's LSE that sits 1.1x past its bound while its outputs
pass): ``tl.dot`` of ``[64, K]`` by ``[K, 64]`` tiles, E4M3 and fp16 inputs of the same
values (E4M3 values are exact in fp16), fp32 accumulator, against the float64 product of those values; per ``K``, the
largest error relative to ``sum_k |a_k b_k|`` of its entry. Summing in fp32 bounds that by
about ``K 2^-24``; an accumulator that keeps fewer bits shows as a floor far above it.

Peers with FP8 attention: cuDNN's FP8 SDPA through ``nvidia-cudnn-frontend``'s Python
graph API (``sdpa_fp8``: per-tensor scales, here all 1; on Hopper its output is E4M3; no
softcap, so not on the softcap row), timed eagerly (its handle's stream is fixed, so no
graph capture), where the package imports. The GPU machine has no network: its wheel
(cp312, ~11 MB) goes with the call, e.g. ``pip download nvidia-cudnn-frontend --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .peers1``,
unpacked there with ``python -m zipfile -e .peers1/nvidia_cudnn_frontend-*.whl /tmp/site``
and ``PYTHONPATH=/tmp/site:src``. FlashAttention-4 (4.0.0b36) runs FP8 on SM100 only (its
interface asserts compute capability 10.x). The last lines say what this machine had.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import triton
import triton.language as tl

import flashfold as ff
from flashfold.bench import graph_replay
from flashfold.kernels.attention import dispatch, fwd
from flashfold.kernels.attention.reference import dequantize_fp8, naive_attention

#: (name, B, Hq, Hk, N, D, causal, softcap)
ROWS = [
    ("llama3-8b d128 gqa causal", 4, 32, 8, 4096, 128, True, None),
    ("dense d128", 4, 16, 16, 4096, 128, False, None),
    ("gemma2 d256 causal softcap", 2, 16, 8, 8192, 256, True, 50.0),
    ("dense d256", 4, 16, 16, 4096, 256, False, None),
    ("dense d64", 4, 16, 16, 4096, 64, False, None),
]
CHECK_ROWS = 256
#: where the rows run (the tests run the checks on the CPU, under the interpreter)
DEVICE = "cuda"


def inputs(B, Hq, Hk, N, D, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, Hq, N, D, device=DEVICE, generator=g)
    k = torch.randn(B, Hk, N, D, device=DEVICE, generator=g)
    v = torch.randn(B, Hk, N, D, device=DEVICE, generator=g)
    (q8, qd), (k8, kd), (v8, vd) = (ff.quantize_fp8(q, Hk), ff.quantize_fp8(k),
                                    ff.quantize_fp8(v))
    # v8 keys-contiguous: the layout the FP8 kernel reads (any other is transposed per call)
    v8 = v8.transpose(-1, -2).contiguous().transpose(-1, -2)
    return (q, k, v), (q8, k8, v8, qd, kd, vd)


def _rows_ref(q, k, v, causal, softcap, dtype, scale):
    """The last CHECK_ROWS query rows of batch 0, head 0 (KV head 0), in ``dtype``."""
    n = q.shape[2]
    qq = q[:1, :1, n - CHECK_ROWS:].to(dtype)
    kk, vv = k[:1, :1].to(dtype), v[:1, :1].to(dtype)
    s = (qq @ kk.transpose(-1, -2)).to(torch.float64 if dtype == torch.float64 else
                                        torch.float32) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        i = torch.arange(n - CHECK_ROWS, n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        s = s.masked_fill(j > i, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)
    return (p.to(dtype) @ vv).double()[0, 0], lse.double()[0, 0]


def check(row, chk):
    """The row's checks (``chk(name, what, ok)`` each); returns ``(ok, kernel)``, the
    kernel that ran the FP8 call: ``gluon`` or ``template``."""
    name, B, Hq, Hk, N, D, causal, softcap = row
    (q, k, v), (q8, k8, v8, qd, kd, vd) = inputs(B, Hq, Hk, N, D)
    o, lse = ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                          softcap=softcap, return_lse=True)
    # (the planner's own test; v8 is passed keys-contiguous, as the kernels read it)
    gluon = dispatch.forward_gluon(q8, k8, v8, scale=1 / math.sqrt(D), softcap=softcap,
                                   right=0 if causal else None)
    kernel = "gluon" if gluon else "template"
    print(f"  {name}: FP8 kernel {kernel}", flush=True)
    scale = 1 / math.sqrt(D)
    ok = chk(name, "no NaN", not (o.isnan().any() or lse.isnan().any()))
    truth, _ = _rows_ref(q, k, v, causal, softcap, torch.float64, scale)
    deq = [dequantize_fp8(t, d, Hk) for t, d in ((q8, qd), (k8, kd), (v8, vd))]
    naive, _ = _rows_ref(*deq, causal, softcap, torch.bfloat16, scale)
    _, lse_ref = _rows_ref(*deq, causal, softcap, torch.float64, scale)
    got = o[0, 0, N - CHECK_ROWS:].double()
    err, yard = (got - truth).abs().max().item(), (naive - truth).abs().max().item()
    ok &= chk(name, f"o: err {err:.3g} <= 2 x naive FP8 {yard:.3g}", err <= 2 * yard + 1e-5)
    lerr = (lse[0, 0, N - CHECK_ROWS:].double() - lse_ref).abs().max().item()
    ok &= chk(name, f"lse: err {lerr:.3g} <= 1e-3", lerr <= 1e-3)
    return ok, kernel


def cudnn_fp8(q8, k8, v8, causal, scale):
    """cuDNN's FP8 SDPA (``nvidia-cudnn-frontend``) on these E4M3 tensors: a callable that
    runs it once (per-tensor scales of 1, E4M3 output). Raises what the frontend raises
    (not installed, unsupported shape)."""
    import cudnn
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32,
                          compute_data_type=fp32, handle=handle)
    tq, tk, tv = (graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()),
                               data_type=e4m3) for n, t in (("q", q8), ("k", k8), ("v", v8)))
    scalars = [graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
               for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s",
                         "scale_o")]
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=tq, k=tk, v=tv, descale_q=scalars[0], descale_k=scalars[1], descale_v=scalars[2],
        descale_s=scalars[3], scale_s=scalars[4], scale_o=scalars[5], generate_stats=False,
        attn_scale=scale, use_causal_mask=causal, name="sdpa_fp8")
    out = torch.empty(q8.shape[:3] + (v8.shape[3],), dtype=torch.float8_e4m3fn,
                      device=q8.device)
    o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
    amax = [torch.empty(1, 1, 1, 1, device=q8.device) for _ in range(2)]
    for t in (amax_s, amax_o):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device=q8.device, dtype=torch.uint8)
    one = torch.ones(1, 1, 1, 1, device=q8.device)
    pack = {tq: q8, tk: k8, tv: v8, o: out, amax_s: amax[0], amax_o: amax[1],
            **{t: one for t in scalars}}

    def call():
        graph.execute(pack, workspace, handle=handle)
        return out
    return call


def flops(B, Hq, N, D, causal):
    pairs = N * N / 2 if causal else N * N
    return 4 * B * Hq * D * pairs


def timed(fn, graph):
    if graph and getattr(fn, "eager_only", False):
        raise RuntimeError("timed eagerly only (its stream is fixed at creation)")
    call = graph_replay(fn) if graph else fn
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def time_row(row, verdict, notes):
    name, B, Hq, Hk, N, D, causal, softcap = row
    ok, _ = verdict
    (q, k, v), (q8, k8, v8, qd, kd, vd) = inputs(B, Hq, Hk, N, D)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    calls = {
        "ff fp8": lambda: ff.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                       causal=causal, softcap=softcap),
        "ff bf16": lambda: ff.attention(qb, kb, vb, causal=causal, softcap=softcap),
    }
    if softcap is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    qb, kb, vb, is_causal=causal, enable_gqa=Hq != Hk)
        calls["cudnn bf16"] = cudnn
        try:
            calls["cudnn fp8"] = cudnn_fp8(q8, k8, v8.contiguous(), causal, 1 / math.sqrt(D))
            calls["cudnn fp8"].eager_only = True
        except Exception as e:                # not installed, or this shape unsupported
            notes.append(f"{name}: cudnn fp8 not run: {type(e).__name__}: {str(e)[:200]}")
    f = flops(B, Hq, N, D, causal)
    out = {}
    for graph in (False, True):
        for m, fn in calls.items():
            try:
                out[(m, graph)] = f / timed(fn, graph) / 1e9
            except Exception as e:            # a peer that cannot run this row: said
                notes.append(f"{name}: {m} {'graph' if graph else 'eager'} failed: "
                             f"{type(e).__name__}: {str(e)[:200]}")    # after the table
    rates = [out.get((m, g), float("nan")) for g in (False, True)
             for m in ("ff fp8", "ff bf16", "cudnn bf16")] + [
        out.get(("cudnn fp8", False), float("nan"))]
    ratios = [_ratio(out, "ff fp8", b, g) for g in (False, True)
              for b in ("ff bf16", "cudnn bf16")] + [_ratio(out, "ff fp8", "cudnn fp8", False)]
    print(f"| {name} |" + "".join(f" {x:.0f} |" for x in rates)
          + "".join(f" {x} |" for x in ratios) + (" |" if ok else " CHECK FAILED |"),
          flush=True)


def _ratio(out, a, b, graph):
    x, y = out.get((a, graph)), out.get((b, graph))
    return f"{x / y:.2f}" if x and y else "-"


#: (block_m, block_n, warps, stages) tried by ``--tune``
TUNE_CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                (128, 128, 8, 4), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4)]


def tune(rows=None):
    """TFLOP/s of the FP8 forward of each d128 / d256 row under each of TUNE_CONFIGS (graph
    replays), the default configuration first."""
    print("\n## FP8 forward by configuration, TFLOP/s (CUDA graph replays)")
    print("| row | config | TFLOP/s | / default |")
    print("|---|---|---:|---:|")
    for name, B, Hq, Hk, N, D, causal, softcap in rows or ROWS:
        if D not in (128, 256):
            continue
        _, (q8, k8, v8, qd, kd, vd) = inputs(B, Hq, Hk, N, D)
        f = flops(B, Hq, N, D, causal)
        base = None
        for cfg in [None] + [fwd.FwdConfig(*c, use_tma=True) for c in TUNE_CONFIGS]:
            def call(cfg=cfg):
                return fwd.attention_forward(
                    q8, k8, v8, scale=1 / math.sqrt(D), softcap=softcap,
                    right=0 if causal else None, config=cfg, return_lse=False,
                    descales=(qd, kd, vd), out_dtype=torch.bfloat16)
            try:
                rate = f / timed(call, True) / 1e9
            except Exception as e:                 # too much shared memory, or a spill
                print(f"| {name} | {cfg} | failed: {type(e).__name__}: {str(e)[:80]} | |")
                continue
            base = base or rate
            print(f"| {name} | {cfg or 'default'} | {rate:.0f} | {rate / base:.2f} |",
                  flush=True)


@triton.jit
def _dot_probe(A, B, C, K: tl.constexpr):
    """``C = A B`` of one ``[64, K]`` by ``[K, 64]`` tile pair (row-major), fp32 accumulator."""
    rows = tl.arange(0, 64)
    ks = tl.arange(0, K)
    a = tl.load(A + rows[:, None] * K + ks[None, :])
    b = tl.load(B + ks[:, None] * 64 + rows[None, :])
    tl.store(C + rows[:, None] * 64 + rows[None, :], tl.dot(a, b))


#: reduction lengths of the accumulation probe (the d64 .. d256 rows' S = Q K^T, and P V's
#: key tiles)
PROBE_K = (32, 64, 128, 256)


def accumulation(ks=PROBE_K, seed=0):
    """Per ``K``: the largest error of ``tl.dot`` against float64, relative to the sum of
    the magnitudes of its entry's products, for E4M3 and for fp16 inputs holding the same
    values (``randn``, rounded to E4M3 first). Returns ``{K: (e4m3, fp16)}``."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = {}
    for K in ks:
        a8 = torch.randn(64, K, device=DEVICE, generator=g).to(torch.float8_e4m3fn)
        b8 = torch.randn(K, 64, device=DEVICE, generator=g).to(torch.float8_e4m3fn)
        a, b = a8.double(), b8.double()
        exact, size = a @ b, a.abs() @ b.abs()
        errs = []
        for x, y in ((a8, b8), (a8.half(), b8.half())):
            c = torch.empty(64, 64, device=DEVICE, dtype=torch.float32)
            _dot_probe[(1,)](x, y, c, K=K)
            errs.append(((c.double() - exact).abs() / size.clamp_min(1e-30)).max().item())
        out[K] = tuple(errs)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--tune", action="store_true", help="FP8 tile configurations, after the checks")
    ap.add_argument("--accumulation", action="store_true",
                    help="how exactly tl.dot sums E4M3 products, before the checks")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}, python {sys.version.split()[0]}")
    if args.accumulation:
        print("## tl.dot accumulation: max |C - AB| / sum_k |a_k b_k| against float64")
        print("| K | E4M3 inputs | fp16 inputs | K 2^-24 |")
        print("|---:|---:|---:|---:|")
        for K, (e8, e16) in accumulation().items():     # (fp16: the 16-bit wgmma's sum)
            print(f"| {K} | {e8:.2e} | {e16:.2e} | {K * 2.0 ** -24:.2e} |")
    failed = []

    def chk(name, what, cond):
        print(f"  {'ok  ' if cond else 'FAIL'} {name}: {what}", flush=True)
        if not cond:
            failed.append((name, what))
        return cond
    print(f"## Checks (last {CHECK_ROWS} rows of batch 0, head 0, at the full shape)")
    verdict = {row[0]: check(row, chk) for row in ROWS}      # (ok, FP8 kernel)
    print(f"checks: {'all passed' if not failed else f'{len(failed)} failed'}")
    if args.check_only:
        return 1 if failed else 0
    if args.tune:
        tune()
        return 1 if failed else 0
    print("\nFP8 kernels: " + ", ".join(f"{name}: {verdict[name][1]}" for name in verdict))
    print("\n## FP8 forward, TFLOP/s (eager | CUDA graph) and ratios of FP8 over each")
    print("| row | fp8 | bf16 | cuDNN bf16 | fp8 graph | bf16 graph | cuDNN graph | "
          "cuDNN fp8 | /bf16 | /cuDNN | /bf16 graph | /cuDNN graph | /cuDNN fp8 | |")
    print("|---|" + "---:|" * 12 + "---|")
    notes = []
    for row in ROWS:
        time_row(row, verdict[row[0]], notes)
    for note in notes:
        print(f"  {note}")
    try:
        import cudnn
        print(f"\ncuDNN FP8 peer: nvidia-cudnn-frontend {getattr(cudnn, '__version__', '?')} "
              f"(cuDNN {cudnn.backend_version()})")
    except Exception as e:                         # ImportError, or no cuDNN library
        print(f"\ncuDNN FP8 peer: nvidia-cudnn-frontend not usable on this machine "
              f"({type(e).__name__}: {str(e)[:120]})")
    print("FlashAttention-4 FP8 peer: none on SM90 (4.0.0b36 runs FP8 on SM100 only)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
