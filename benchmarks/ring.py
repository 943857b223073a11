"""Ring attention across GPUs against single-GPU flashfold on the same total sequence.

Run (from the repository root)::

    PYTHONPATH=src torchrun --nproc_per_node=2 benchmarks/ring.py            # 2 GPUs, NCCL (~3 min)
    PYTHONPATH=src torchrun --nproc_per_node=2 benchmarks/ring.py --quick    # 16K and 32K only
    PYTHONPATH=src python benchmarks/ring.py                                 # 1 GPU: simulated ring

(``--nproc_per_node=1`` is the same as the plain ``python`` run.) The script sets
``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` before the process group
starts (NVLink multicast is off on the device machines).

1. Correctness, before any timing (bf16, batch 2, 8 query / 4 key-value heads, head dim
   128, an uneven total length 3007, both layouts, causal and not): the ring's ``o``,
   ``lse`` and ``dq, dk, dv`` (gradients of a random loss on ``o`` and ``lse``) against a
   float64 dense reference, with FlashAttention's criterion: the error must be at most
   twice that of a naive bf16 PyTorch attention (matmuls in bf16, softmax in fp32) against
   the same reference, plus fp32 rounding. Single-GPU ``flashfold.attention``'s error is
   printed beside it.
2. Timing, bf16, batch 1, 16 heads, head dim 128, total lengths 16K..128K: forward, and
   forward + backward, of

   * ``single``: ``flashfold.attention`` on the whole sequence on one GPU;
   * ``ring``: :func:`flashfold.distributed.ring_attention` over the ``W`` ranks (the time
     of the slowest rank);
   * ``compute``: every rank's ring schedule with all K/V blocks already in its memory, i.e.
     the ring without its communication (same kernels, merges and accumulations).

   ``efficiency = t_single / (W * t_ring)`` (1.0: perfect scaling) and
   ``overlap = t_compute / t_ring`` (1.0: the K/V transfers are fully hidden behind the
   kernels). Rows: causal with the zigzag layout (balanced), non-causal contiguous, and
   (not with ``--quick``) causal contiguous, whose last rank does most of the work.
   FLOPs = 4 B H D (visible pairs), causal N(N+1)/2; forward + backward counts 3.5x.

With one process (one GPU, or ``--nproc_per_node=1``) there is no communication to
measure: the script then *simulates* a ring of ``--sim-world`` (2) ranks on the one GPU,
runs each simulated rank's schedule in turn (the ``compute`` path above) and reports the
estimated efficiency ``t_single / (W * max_r t_r)``: the cost of splitting the work
(shorter kernels, merges, load balance), not of communicating. The output says which mode
ran.

Timings: ``--warmup`` calls, then ``--reps`` (default: fewer for longer sequences; the same
on every rank, since ring calls must match), synchronized, host clock; the slowest rank's
mean. ``--device cpu`` runs everything on CPU tensors (gloo; a dry run of the code paths,
used by the tests).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashfold  # noqa: E402
from flashfold.distributed import ring as ring_mod  # noqa: E402
from flashfold.distributed import ring_attention, shard, shard_lengths, unshard  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --- set-up ------------------------------------------------------------------------------------

def setup(device_arg):
    """``(device, created)``: the process group (NCCL for several GPUs, else gloo; a
    one-rank gloo group for a single process) and this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_arg == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --device cpu (a dry run)")
        if world > torch.cuda.device_count():
            sys.exit(f"{world} ranks but {torch.cuda.device_count()} GPU(s): NCCL needs one GPU "
                     f"per rank; run with --nproc_per_node=1 (the simulated ring)")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    created = False
    if not dist.is_initialized():
        if world == 1:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("nccl" if cuda else "gloo")
        created = True
    return dev, created


def _comm_device(dev):
    return dev if "nccl" in str(dist.get_backend()).lower() else torch.device("cpu")


def allmax(x: float, dev) -> float:
    """The largest ``x`` over the ranks, a NaN counted as inf (the MAX of gloo and NCCL
    keeps a finite value met before a NaN: a NaN error of one rank would vanish)."""
    t = torch.tensor([math.inf if math.isnan(x) else float(x)], dtype=torch.float64,
                     device=_comm_device(dev))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps, warmup):
    """Mean seconds per call of ``fn`` on the slowest rank (same call counts everywhere)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return allmax((time.perf_counter() - t0) / reps, dev)


def say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# --- one rank's schedule without communication ------------------------------------------------------

class LocalRank:
    """Rank ``rank``'s ring schedule with every K/V block already in memory: the same
    per-block kernels, merges and gradient accumulations as the ring, no transfers."""

    def __init__(self, q, k, v, rank, world, layout, causal):
        lens = shard_lengths(q.shape[2], world, layout)
        self.plan = ring_mod._plan(layout, lens, rank, causal)
        self.q = shard(q, rank, world, layout=layout)
        self.blocks = [(shard(k, s, world, layout=layout), shard(v, s, world, layout=layout))
                       for s in range(world)]
        self.order = [(rank - t) % world for t in range(world)]
        self.scale = 1.0 / math.sqrt(q.shape[3])

    def forward(self):
        """``(o, lse)``: ``o`` in the input dtype, ``lse`` float32 (float64 for float64)."""
        o = lse = None
        for src in self.order:
            kb, vb = self.blocks[src]
            o, lse = ring_mod._forward_block(self.q, kb, vb, self.plan.tasks[src], o, lse,
                                             self.scale, None)
        if o is None:
            o, lse = ring_mod._empty_state(self.q, self.blocks[0][1])
        return o.to(self.q.dtype), lse

    def backward(self, o, lse, do, dlse=None):
        """``(dq, [(dk_s, dv_s) for each block s])``, accumulated in float32."""
        bwd = ring_mod._block_backward_fn(self.q)
        acc = ring_mod._acc_dtype(self.q.dtype)
        dq = torch.zeros(self.q.shape, dtype=acc, device=self.q.device)
        grads = [None] * len(self.blocks)
        for src in self.order:
            kb, vb = self.blocks[src]
            dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
            dv = torch.zeros(vb.shape, dtype=acc, device=vb.device)
            for ks, dk_t, dv_t in ring_mod._backward_block(
                    bwd, self.q, kb, vb, self.plan.tasks[src], o, lse, do, dlse, dq,
                    self.scale, None):
                dk[:, :, ks] += dk_t
                dv[:, :, ks] += dv_t
            grads[src] = (dk, dv)
        return dq, grads

    def forward_backward(self, do):
        o, lse = self.forward()
        return self.backward(o, lse, do)


# --- correctness ----------------------------------------------------------------------------------

def dense(q, k, v, causal, dtype):
    """Whole-matrix attention with matmuls in ``dtype``, softmax in float32 or better:
    ``dtype=float64`` is the reference, the input dtype the naive low-precision peer.
    Differentiable; returns ``(o, lse)``."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2) * (1.0 / math.sqrt(q.shape[3]))).to(sd)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).to(dtype)
    return p @ v.to(dtype), lse


def _grads(fn, q, k, v, go, gl, grad=True):
    """``[o, lse, dq, dk, dv]`` of ``fn`` for the loss ``sum(o go) + sum(lse gl)``
    (``[o, lse]`` without ``grad``)."""
    if not grad:
        with torch.no_grad():
            return list(fn(q, k, v))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v)
    ((o.double() * go).sum() + (lse.double() * gl).sum()).backward()
    return [t.detach() for t in (o, lse, q.grad, k.grad, v.grad)]


def _maxerr(a, e):
    fin = torch.isfinite(e)
    return (a.double() - e.double())[fin].abs().max().item() if fin.any() else 0.0


def correctness(dev, dtype, n, hq, hk, d, sim_world):
    """The checks of step 1 on every rank; returns True when all pass (on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    W = world if world > 1 else sim_world
    mode = "ring" if world > 1 else f"simulated {W}-rank ring"
    say(f"== correctness ({mode}): max err <= 2 * naive {dtype} err + fp32 rounding, "
        f"reference float64; B=2 Hq={hq} Hk={hk} D={d} N={n}")
    bwd_why = _backward_available(dev, dtype)
    grad = bwd_why is None
    if not grad:
        say(f"   forward only (no backward here: {bwd_why})")
    g = torch.Generator(device=dev).manual_seed(1)
    shape = lambda h, *tail: (2, h, n, *tail)
    q = torch.randn(shape(hq, d), generator=g, device=dev).to(dtype)
    k = torch.randn(shape(hk, d), generator=g, device=dev).to(dtype)
    v = torch.randn(shape(hk, d), generator=g, device=dev).to(dtype)
    go = torch.randn(shape(hq, d), generator=g, device=dev, dtype=torch.float64)
    gl = torch.randn(shape(hq), generator=g, device=dev, dtype=torch.float64)
    all_ok = True
    for layout, causal in (("zigzag", True), ("contiguous", True), ("contiguous", False)):
        ref = _grads(lambda a, b, c: dense(a, b, c, causal, torch.float64), q, k, v, go, gl, grad)
        naive = _grads(lambda a, b, c: dense(a, b, c, causal, dtype), q, k, v, go, gl, grad)
        single = _grads(lambda a, b, c: flashfold.attention(a, b, c, causal=causal,
                                                            return_lse=True), q, k, v, go, gl, grad)
        if world > 1:
            sh = lambda t: shard(t, rank, world, layout=layout)
            mine = _grads(lambda a, b, c: ring_attention(a, b, c, causal=causal, layout=layout,
                                                         return_lse=True),
                          sh(q), sh(k), sh(v), sh(go), sh(gl.unsqueeze(-1)).squeeze(-1), grad)
            # compare this rank's rows of o, lse, dq and its own k/v rows of dk, dv
            exp = [sh(ref[0]), sh(ref[1].unsqueeze(-1)).squeeze(-1)] + [sh(t) for t in ref[2:]]
        else:
            ranks = [LocalRank(q, k, v, r, W, layout, causal) for r in range(W)]
            outs = [lr.forward() for lr in ranks]
            o = unshard([x[0] for x in outs], layout=layout)
            lse = unshard([x[1].unsqueeze(-1) for x in outs], layout=layout).squeeze(-1)
            mine, exp = [o, lse], ref
        if world == 1 and grad:
            # the loss's gradients of o and lse, as autograd would feed them
            dos = [shard(go.to(dtype), r, W, layout=layout) for r in range(W)]
            dls = [shard(gl.unsqueeze(-1), r, W, layout=layout).squeeze(-1).float()
                   for r in range(W)]
            back = [lr.backward(oo.to(dtype), ll, do_, dl_)
                    for lr, (oo, ll), do_, dl_ in zip(ranks, outs, dos, dls)]
            dq = unshard([b[0] for b in back], layout=layout)
            dk = unshard([sum(b[1][s][0] for b in back) for s in range(W)], layout=layout)
            dv = unshard([sum(b[1][s][1] for b in back) for s in range(W)], layout=layout)
            mine = [o, lse, dq, dk, dv]
        names = ("o", "lse", "dq", "dk", "dv")[:len(mine)]
        errs = [allmax(_maxerr(a, e), dev) for a, e in zip(mine, exp)]
        nerrs = [_maxerr(a, e) for a, e in zip(naive, ref)]
        serrs = [_maxerr(a, e) for a, e in zip(single, ref)]
        mags = [e[torch.isfinite(e)].abs().max().item() for e in ref]
        ok = True
        cols = []
        for name, err, nerr, serr, mag in zip(names, errs, nerrs, serrs, mags):
            bound = 2 * nerr + 1e-5 * max(1.0, mag)
            good = err <= bound and math.isfinite(err)
            ok &= good
            cols.append(f"{name} {err:.1e}{'' if good else '!'} (naive {nerr:.1e}, single {serr:.1e})")
        ok = allmax(0.0 if ok else 1.0, dev) == 0.0
        all_ok &= ok
        say(f"  {'ok ' if ok else 'BAD'} {layout:<10} causal={causal!s:<5} " + "  ".join(cols))
    return all_ok


# --- timing ---------------------------------------------------------------------------------------

def _flops(n, h, d, causal, b=1):
    pairs = n * (n + 1) / 2 if causal else n * n
    return 4 * b * h * d * pairs


def _backward_available(dev, dtype):
    """None if single-GPU and ring backward can run here, else the reason."""
    try:
        x = torch.randn(1, 1, 64, 64, device=dev, dtype=dtype, requires_grad=True)
        flashfold.attention(x, x, x).sum().backward()
    except Exception as e:                                  # noqa: BLE001 - report and go on
        return f"{type(e).__name__}: {e}"
    return None


def _reps(n, reps):
    return reps if reps else max(2, min(10, (8 * 16384) // n))


def speed(dev, dtype, lengths, h, hk, d, quick, reps, warmup, sim_world):
    rank, world = dist.get_rank(), dist.get_world_size()
    real = world > 1
    W = world if real else sim_world
    bwd_why = _backward_available(dev, dtype)
    if real:
        mode = f"ring over {W} ranks, {dist.get_backend()} on {dev.type}"
    else:
        mode = f"SIMULATED {W}-rank ring on one device, no communication"
    say(f"== timing ({mode}): {dtype}, B=1, Hq={h}, Hk={hk}, D={d}; mean ms per call, "
        f"slowest rank")
    if bwd_why:
        say(f"   forward + backward skipped: {bwd_why}")
    configs = [("zigzag", True), ("contiguous", False)] + ([] if quick else [("contiguous", True)])
    rows = []
    for layout, causal in configs:
        for n in lengths:
            r = _reps(n, reps)
            g = torch.Generator(device=dev).manual_seed(n)
            q = torch.randn(1, h, n, d, generator=g, device=dev).to(dtype)
            k = torch.randn(1, hk, n, d, generator=g, device=dev).to(dtype)
            v = torch.randn(1, hk, n, d, generator=g, device=dev).to(dtype)
            do = torch.randn(1, h, n, d, generator=g, device=dev).to(dtype)
            row = dict(layout=layout, causal=causal, n=n)
            with torch.no_grad():
                row["single"] = timed(lambda: flashfold.attention(q, k, v, causal=causal), dev, r, warmup)
                if real:
                    sh = lambda t: shard(t, rank, world, layout=layout)
                    qs, ks, vs, dos = sh(q), sh(k), sh(v), sh(do)
                    lens = shard_lengths(n, world, layout)        # no per-call all_gather
                    row["ring"] = timed(lambda: ring_attention(
                        qs, ks, vs, causal=causal, layout=layout, lengths=lens), dev, r, warmup)
                    local = LocalRank(q, k, v, rank, world, layout, causal)
                    row["compute"] = timed(local.forward, dev, r, warmup)
                else:
                    ranks = [LocalRank(q, k, v, i, W, layout, causal) for i in range(W)]
                    per = [timed(lr.forward, dev, r, warmup) for lr in ranks]
                    row["ring"] = row["compute"] = max(per)
                    row["balance"] = min(per) / max(per)
            if bwd_why is None:
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                def single_fb():
                    for t in leaves:
                        t.grad = None
                    flashfold.attention(*leaves, causal=causal).backward(do)
                row["single_fb"] = timed(single_fb, dev, r, warmup)
                if real:
                    sleaves = [t.detach().requires_grad_() for t in (qs, ks, vs)]

                    def ring_fb():
                        for t in sleaves:
                            t.grad = None
                        ring_attention(*sleaves, causal=causal, layout=layout,
                                       lengths=lens).backward(dos)
                    row["ring_fb"] = timed(ring_fb, dev, r, warmup)
                    row["compute_fb"] = timed(lambda: local.forward_backward(dos), dev, r, warmup)
                else:
                    dsh = [shard(do, i, W, layout=layout) for i in range(W)]
                    per = [timed(lambda lr=lr, x=x: lr.forward_backward(x), dev, r, warmup)
                           for lr, x in zip(ranks, dsh)]
                    row["ring_fb"] = row["compute_fb"] = max(per)
            _print_row(row, W, h, d, real)
            rows.append(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _eff(row, W, key="ring", single="single"):
    return row[single] / (W * row[key]) if key in row else float("nan")


def _print_row(row, W, h, d, real):
    f = _flops(row["n"], h, d, row["causal"])
    parts = [f"{row['layout']:<10} causal={row['causal']!s:<5} N={row['n']:>6}",
             f"fwd single {row['single'] * 1e3:8.2f} ms ({f / row['single'] / 1e12:5.0f} TF/s)",
             f"ring {row['ring'] * 1e3:8.2f} ms ({f / row['ring'] / 1e12:5.0f} TF/s aggregate)"]
    if real:
        parts.append(f"compute-only {row['compute'] * 1e3:8.2f} ms")
        parts.append(f"eff {_eff(row, W):5.1%} overlap {row['compute'] / row['ring']:5.1%}")
    else:
        parts.append(f"est. eff {_eff(row, W):5.1%} balance {row['balance']:5.1%}")
    if "single_fb" in row:
        ffb = 3.5 * f
        parts.append(f"| fwd+bwd single {row['single_fb'] * 1e3:8.2f} ms ({ffb / row['single_fb'] / 1e12:5.0f} TF/s)"
                     f" ring {row['ring_fb'] * 1e3:8.2f} ms")
        if real:
            parts.append(f"compute-only {row['compute_fb'] * 1e3:8.2f} ms "
                         f"eff {_eff(row, W, 'ring_fb', 'single_fb'):5.1%} "
                         f"overlap {row['compute_fb'] / row['ring_fb']:5.1%}")
        else:
            parts.append(f"est. eff {_eff(row, W, 'ring_fb', 'single_fb'):5.1%}")
    say("  " + "  ".join(parts))


def summary(rows, W, real):
    say("== summary: scaling efficiency t_single / (W * t_ring) at the longest sequence"
        + ("" if real else " (ESTIMATE from a simulated ring on one device: no communication)"))
    for layout, causal in dict.fromkeys((r["layout"], r["causal"]) for r in rows):
        mine = [r for r in rows if r["layout"] == layout and r["causal"] == causal]
        r = max(mine, key=lambda x: x["n"])
        line = f"  {layout:<10} causal={causal!s:<5} N={r['n']}: forward {_eff(r, W):.1%}"
        if "ring_fb" in r:
            line += f", forward+backward {_eff(r, W, 'ring_fb', 'single_fb'):.1%}"
        if real:
            line += f"; overlap (compute-only / ring) forward {r['compute'] / r['ring']:.1%}"
        say(line)


# --- main -----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="16K and 32K, two configurations")
    p.add_argument("--lengths", type=str, default=None,
                   help="comma-separated total lengths (default 16384..131072)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--check-len", type=int, default=3007)
    p.add_argument("--check-heads", type=str, default="8,4", help="query,kv heads of the check")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--reps", type=int, default=0, help="timed calls (default: by length)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sim-world", type=int, default=2,
                   help="ranks of the simulated ring when one process runs")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
               else [16384, 32768] if args.quick else [16384, 32768, 65536, 131072])
    dtype = DTYPES[args.dtype]
    dev, created = setup(args.device)
    try:
        world = dist.get_world_size()
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        say(f"flashfold ring attention benchmark: {world} rank(s), backend "
            f"{dist.get_backend()}, device {name}, torch {torch.__version__}")
        chq, chk = (int(x) for x in args.check_heads.split(","))
        ok = correctness(dev, dtype, args.check_len, chq, chk, args.head_dim, args.sim_world)
        if not ok:
            say("correctness FAILED: no timing")
            return 1
        if args.check_only:
            return 0
        rows = speed(dev, dtype, lengths, args.heads, args.kv_heads or args.heads,
                     args.head_dim, args.quick, args.reps, args.warmup, args.sim_world)
        summary(rows, world if world > 1 else args.sim_world, world > 1)
        return 0
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
