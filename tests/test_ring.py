"""Ring attention (:mod:`flashfold.distributed.ring`) on CPU: gloo process groups of 2 and
4 ranks (``torch.multiprocessing``), forward and backward against single-process
``flashfold.attention`` on the full sequence, in float64 (tolerances: the float64 row; the
float32 LSE output: the float32 row). Contiguous and zigzag layouts, causal or not, even
and uneven shards (an empty one too), GQA, softcap, gradients through the returned LSE, both
per-block backward paths. Process start-up dominates the time, so each world size runs all
its cases inside one spawn; the references are computed once, in the parent.

Also: the layout helpers, the block plan, the merge-derivative of the autograd backward
path (single process), and argument validation."""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import math
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashfold
from flashfold.distributed import (chunk_lengths, ring_attention, shard, shard_lengths,
                                   unshard)
from flashfold.distributed import ring as ring_mod
from flashfold.kernels.attention.reference import (attention_reference,
                                                   merge_states_reference)
from flashfold.testing import assert_close

from bench_script import load_benchmark


# --- cases --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple            # per-rank shard lengths (zigzag: shard_lengths(N, W, "zigzag"))
    layout: str = "contiguous"
    causal: bool = True
    heads: tuple = (2, 2)     # (Hq, Hk)
    batch: int = 1
    softcap: float | None = None
    scale: float | None = None
    use_lse: bool = False     # return_lse and a loss term on it
    backward: str = "auto"    # "auto" (the heuristic) or "autograd" (forced)
    kernel: bool = False      # the CUDA path: Triton kernels under TRITON_INTERPRET, float32


CASES = {
    2: [
        Case("contig-even-noncausal", (16, 16), causal=False, batch=2),
        Case("contig-uneven-causal", (7, 13)),
        Case("contig-uneven-gqa-lse", (13, 7), causal=False, heads=(4, 2), use_lse=True),
        Case("zigzag-even-causal", tuple(shard_lengths(32, 2, "zigzag")), "zigzag"),
        Case("zigzag-uneven-causal-gqa-lse", tuple(shard_lengths(23, 2, "zigzag")), "zigzag",
             heads=(4, 1), use_lse=True),
        Case("zigzag-uneven-noncausal", tuple(shard_lengths(23, 2, "zigzag")), "zigzag",
             causal=False),
        Case("contig-uneven-causal-autograd-lse", (7, 13), use_lse=True, backward="autograd"),
        Case("zigzag-causal-autograd", tuple(shard_lengths(21, 2, "zigzag")), "zigzag",
             heads=(4, 2), backward="autograd"),
        Case("contig-softcap-scale", (9, 11), softcap=2.0, scale=0.3, use_lse=True),
        Case("kernel-zigzag-causal-gqa-lse", tuple(shard_lengths(23, 2, "zigzag")), "zigzag",
             heads=(4, 2), use_lse=True, kernel=True),
        Case("kernel-contig-uneven-noncausal", (9, 14), causal=False, kernel=True),
    ],
    4: [
        Case("contig-uneven-empty-shard-causal-gqa", (5, 0, 9, 3), heads=(4, 2), use_lse=True),
        Case("zigzag-uneven-causal", tuple(shard_lengths(30, 4, "zigzag")), "zigzag",
             batch=2),
        Case("contig-even-noncausal-autograd", (6, 6, 6, 6), causal=False, use_lse=True,
             backward="autograd"),
        Case("zigzag-causal-autograd-lse", tuple(shard_lengths(19, 4, "zigzag")), "zigzag",
             use_lse=True, backward="autograd"),
    ],
}

D = 32


def _inputs(case: Case, seed: int):
    """Full-sequence float64 inputs (float32 values for kernel cases) and loss weights."""
    g = torch.Generator().manual_seed(seed)
    n = sum(case.lengths)
    hq, hk = case.heads
    f64 = dict(dtype=torch.float64, generator=g)
    dt = torch.float32 if case.kernel else torch.float64
    q = torch.randn(case.batch, hq, n, D, **f64).to(dt)
    k = torch.randn(case.batch, hk, n, D, **f64).to(dt)
    v = torch.randn(case.batch, hk, n, D, **f64).to(dt)
    go = torch.randn(case.batch, hq, n, D, **f64).to(dt)
    gl = torch.randn(case.batch, hq, n, **f64).float() if case.use_lse else None
    return q, k, v, go, gl


def _reference(case: Case, q, k, v, go, gl):
    """Single-process flashfold.attention on the full sequence, in float64: o, lse, dq, dk,
    dv."""
    q, k, v, go = (t.double() for t in (q, k, v, go))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flashfold.attention(q, k, v, causal=case.causal, scale=case.scale,
                                 softcap=case.softcap, return_lse=True)
    loss = (o * go).sum() + ((lse * gl).sum() if gl is not None else 0)
    loss.backward()
    return [t.detach() for t in (o, lse, q.grad, k.grad, v.grad)]


def _shard(case: Case, x, rank, world):
    if case.layout == "zigzag":
        return shard(x, rank, world, layout="zigzag")
    offs = [sum(case.lengths[:r]) for r in range(world)]
    return x.narrow(2, offs[rank], case.lengths[rank])


def _shard_rows(case: Case, x, rank, world):
    """The shard of an LSE-shaped ``(B, H, N)`` tensor."""
    return _shard(case, x.unsqueeze(-1), rank, world).squeeze(-1)


# --- benchmarks/ring.py on CPU: a dry run of its code paths (correctness checks included) ----------

BENCH_DRY_RUN = ["--device", "cpu", "--dtype", "float32", "--lengths", "48,80",
                 "--check-len", "37", "--check-heads", "4,2", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "32", "--reps", "1", "--warmup", "1"]


def _bench_module():
    return load_benchmark("ring")


def test_benchmark_dry_run_simulated_ring(capsys):
    """One process: the simulated 2-rank ring (the one-GPU fallback) on CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny matmuls: threads only cost
    try:
        assert _bench_module().main(BENCH_DRY_RUN) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "SIMULATED 2-rank ring" in out and "BAD" not in out and "ESTIMATE" in out
    assert not dist.is_initialized()


# --- the worker (one process per rank) -----------------------------------------------------------

def _worker(rank, world, init_file, payload):
    faulthandler.enable()           # a crash in native code prints every thread's stack
    torch.set_num_threads(1)        # several ranks share 2 cores: no OpenMP spinning
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        failures = []
        heuristic = ring_mod._block_backward_fn
        for case, inputs, expected in payload:
            q, k, v, go, gl = inputs
            mine = [_shard(case, t, rank, world) for t in (q, k, v, go)]
            ring_mod._block_backward_fn = (
                heuristic if case.backward == "auto"
                else (lambda q_, det=False: ring_mod._autograd_block_backward))
            undo = _kernel_dispatch() if case.kernel else None
            names = ("o", "lse", "dq", "dk", "dv")
            if case.kernel and not _has_backward_kernel():
                names = ("o", "lse")         # the backward kernel is not in this tree yet
            # non-contiguous inputs on purpose: the ring must not assume a layout
            qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                          for t in mine[:3])
            try:
                o, lse = ring_attention(qs, ks, vs, causal=case.causal, layout=case.layout,
                                        scale=case.scale, softcap=case.softcap, return_lse=True)
                if len(names) > 2:
                    loss = (o * mine[3]).sum()
                    if gl is not None:
                        loss = loss + (lse * _shard_rows(case, gl, rank, world)).sum()
                    loss.backward()
            finally:
                if undo:
                    undo()
            got = (o, lse, qs.grad, ks.grad, vs.grad)
            for name, a, e in zip(names, got, expected):
                e = _shard_rows(case, e, rank, world) if name == "lse" else _shard(case, e, rank, world)
                dt = "float32" if name == "lse" or case.kernel else "float64"
                # float32 results: scaled by the magnitude of what was summed, as the
                # kernel tests do; float64 ones: the plain float64 row
                scale = max(1.0, float(e.abs().max())) if case.kernel and name != "lse" else 1.0
                try:
                    assert_close(a, e, dt, scale=scale, name=f"{case.name} rank {rank}: {name}")
                except AssertionError as err:
                    failures.append(str(err))
        ring_mod._block_backward_fn = heuristic
        if world == 2:
            failures += _validation_across_ranks(rank)
            rc = _bench_module().main(BENCH_DRY_RUN)
            if rc != 0:
                failures.append(f"rank {rank}: benchmarks/ring.py dry run returned {rc}")
        # every rank has finished talking before any leaves
        dist.barrier()
        if failures:
            raise AssertionError("\n".join(failures))
    except BaseException:
        dist.destroy_process_group()
        raise
    # All checks passed on this rank. Leave without running gloo's C++ teardown: CI saw a
    # rank abort there twice ("terminate called without an active exception", SIGABRT)
    # after every check had passed, once even with the barrier above and an explicit
    # destroy_process_group. os._exit skips the destructors and atexit hooks; the exit
    # status is 0 only on this path, so a failed check still fails the spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _has_backward_kernel():
    try:
        from flashfold.kernels.attention.bwd import attention_backward  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel_dispatch():
    """Route flashfold's attention and merge to the Triton kernels (as the CUDA path does)
    with 16 x 16 tiles and pointer loads; returns the undo."""
    from flashfold.api import attention as api
    from flashfold.kernels.attention import fwd
    saved = [(api, "_use_kernel", api._use_kernel), (fwd, "default_config", fwd.default_config)]
    api._use_kernel = lambda t: True
    fwd.default_config = lambda q, d, dv, causal=False: fwd.FwdConfig(16, 16, use_tma=False)
    if _has_backward_kernel():
        from flashfold.kernels.attention import bwd
        saved.append((bwd, "default_config", bwd.default_config))
        bwd.default_config = lambda q, d, dv, features=False, causal=False: bwd.BwdConfig(
            16, 16, 4, 1, 16, 16, 4, 1, use_tma=False, atomic_dq=True)

    def undo():
        for mod, name, value in saved:
            setattr(mod, name, value)
    return undo


def _raises(fn, exc, match):
    try:
        fn()
    except exc as e:
        if match in str(e):
            return None
        return f"expected {exc.__name__} with {match!r}, got {e!r}"
    return f"expected {exc.__name__} with {match!r}, nothing raised"


def _validation_across_ranks(rank):
    """Inconsistent shards raise the same ValueError on every rank (no hang)."""
    out = []
    t = lambda n, d=D: torch.randn(1, 2, n, d, dtype=torch.float64)
    q = t(10 + 3 * rank)                          # 10, 13: not a zigzag split of 23
    out.append(_raises(lambda: ring_attention(q, q, q, layout="zigzag"), ValueError,
                       "do not match the zigzag layout"))
    q = t(8, D if rank == 0 else 64)
    out.append(_raises(lambda: ring_attention(q, q, q), ValueError, "head_dim differs"))
    q = t(8)
    out.append(_raises(lambda: ring_attention(q, q, q, causal=bool(rank)), ValueError,
                       "causal"))
    out.append(_raises(lambda: ring_attention(q, q, q, layout=["contiguous", "zigzag"][rank]),
                       ValueError, "layout"))
    # a bad argument on one rank only: that rank raises its own error, the other one a
    # ValueError naming it (no rank left waiting in the all_gather); then a normal call
    # still runs on the same group
    if rank == 0:
        out.append(_raises(lambda: ring_attention(q.int(), q.int(), q.int()), TypeError,
                           "q dtype"))
    else:
        out.append(_raises(lambda: ring_attention(q, q, q), ValueError, "rank(s) [0]"))
    if rank == 1:
        out.append(_raises(lambda: ring_attention(q, q, q, scale=-1.0), ValueError, "scale"))
    else:
        out.append(_raises(lambda: ring_attention(q, q, q), ValueError, "rank(s) [1]"))
    o = ring_attention(q, q, q, causal=True)
    if o.shape != q.shape or not torch.isfinite(o).all():
        out.append(f"a call after the refused ones gave {tuple(o.shape)}")
    return [f"rank {rank}: {m}" for m in out if m]


def _run(world):
    payload = []
    for i, case in enumerate(CASES[world]):
        inputs = _inputs(case, seed=100 * world + i)
        payload.append((case, inputs, _reference(case, *inputs)))
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), payload), nprocs=world)


def test_ring_attention_two_ranks():
    _run(2)


def test_ring_attention_four_ranks():
    _run(4)


def _nan_on_one_rank_worker(rank, world, init_file, verdicts):
    """benchmarks/ring.py's check on two ranks, the ring's output of rank 1 holding a NaN:
    every rank's verdict (``verdicts[rank]``, 1 for a pass)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    bench = _bench_module()
    real = bench.ring_attention

    def poisoned(*a, **kw):
        o, lse = real(*a, **kw)
        if rank == 1:
            o = o + torch.where(torch.arange(o.shape[-1]) == 0, math.nan, 0.0).to(o.dtype)
        return o, lse
    bench.ring_attention = poisoned
    verdicts[rank] = int(bench.correctness(torch.device("cpu"), torch.float32, 21, 2, 1, 16, 2))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)                     # (gloo's C++ teardown: see _worker)


def test_benchmark_check_fails_on_a_nan_of_another_rank():
    """A NaN on rank 1 fails the check on every rank: gloo's (and NCCL's) MAX reduction
    keeps rank 0's finite error when the NaN comes second, so the error is reduced with
    NaN as inf."""
    verdicts = mp.get_context("spawn").Array("i", [-1, -1])
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_nan_on_one_rank_worker, args=(2, os.path.join(d, "init"), verdicts), nprocs=2)
    assert list(verdicts) == [0, 0]


# --- single process: layouts, plans, the backward's algebra ----------------------------------------

def test_chunk_and_shard_lengths():
    assert chunk_lengths(10, 4) == [3, 3, 2, 2]
    assert shard_lengths(10, 4) == [3, 3, 2, 2]
    assert shard_lengths(23, 2, "zigzag") == [6 + 5, 6 + 6]
    assert shard_lengths(3, 2, "zigzag") == [1, 2]          # empty chunks
    assert sum(shard_lengths(1000, 8, "zigzag")) == 1000


def test_zigzag_shard_holds_mirrored_chunks():
    x = torch.arange(8).view(1, 1, 8, 1)
    assert shard(x, 0, 2, layout="zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert shard(x, 1, 2, layout="zigzag").flatten().tolist() == [2, 3, 4, 5]
    assert shard(x, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    assert shard(x, 1, 2).data_ptr() == x[:, :, 4:].data_ptr()    # contiguous: a view


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("n,world", [(0, 1), (1, 2), (7, 2), (23, 3), (64, 4), (5, 4)])
@pytest.mark.parametrize("dim", [0, 2, -1])
def test_shard_unshard_roundtrip(layout, n, world, dim):
    shape = [3, 2, 4]
    shape[dim] = n
    x = torch.randn(shape)
    parts = [shard(x, r, world, layout=layout, dim=dim) for r in range(world)]
    assert [p.shape[dim] for p in parts] == shard_lengths(n, world, layout)
    assert torch.equal(unshard(parts, layout=layout, dim=dim), x)


def test_plan_tasks_zigzag_causal():
    """Rank 1 of 2, zigzag N=8 (chunks of 2; rank 1 holds positions 2,3,4,5): its own block
    is one causal call, rank 0's block (0,1,6,7): keys 0,1 fully visible to all, 6,7 never."""
    plan = ring_mod._plan("zigzag", [4, 4], 1, True)
    own, other = plan.tasks[1], plan.tasks[0]
    assert own == (ring_mod._Task(slice(0, 4), slice(0, 4), True),)
    assert other == (ring_mod._Task(slice(0, 4), slice(0, 2), False),)
    # rank 0 (positions 0,1,6,7) on rank 1's block (2..5): only the late chunk sees it, all of it
    plan0 = ring_mod._plan("zigzag", [4, 4], 0, True)
    assert plan0.tasks[1] == (ring_mod._Task(slice(2, 4), slice(0, 4), False),)
    # contiguous: later blocks are skipped, earlier ones fully visible, empty ones ignored
    plan = ring_mod._plan("contiguous", [3, 0, 5], 2, True)
    assert plan.tasks == ((ring_mod._Task(slice(0, 5), slice(0, 3), False),), (),
                          (ring_mod._Task(slice(0, 5), slice(0, 5), True),))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_plan_covers_each_visible_pair_once(layout, world):
    """Brute force over lengths (empty chunks and shards included): the tasks of every
    (rank, source block) cover exactly the causally visible (query, key) pairs, once each;
    non-causal: every pair once."""
    for n in [0, 1, 2 * world - 1, 2 * world + 3, 17]:
        lens = shard_lengths(n, world, layout)
        pos = [[off + i for off, m in segs for i in range(m)]
               for segs in ring_mod._segments(layout, lens)]
        for causal in (True, False):
            for r in range(world):
                plan = ring_mod._plan(layout, lens, r, causal)
                for src in range(world):
                    hits = torch.zeros(lens[r], lens[src], dtype=torch.int64)
                    for t in plan.tasks[src]:
                        nq, nk = t.q.stop - t.q.start, t.k.stop - t.k.start
                        i = torch.arange(nq)[:, None]
                        j = torch.arange(nk)[None, :]
                        vis = (j <= i + nk - nq) if t.causal else torch.ones(nq, nk, dtype=torch.bool)
                        hits[t.q, t.k] += vis.long()
                    want = torch.tensor([[int(not causal or kp <= qp) for kp in pos[src]]
                                         for qp in pos[r]], dtype=torch.int64).view(lens[r], lens[src])
                    assert torch.equal(hits, want), (layout, world, n, causal, r, src)


@pytest.mark.parametrize("path", ["autograd", "formula"])
@pytest.mark.parametrize("use_dlse", [False, True])
def test_block_backward_paths_sum_to_the_gradient(path, use_dlse):
    """Single process, simulated ring: split the keys into uneven blocks, merge the blocks'
    partials (merge_states' reference), and check that the per-block backward (with the
    merged O, LSE) summed over blocks equals autograd through the whole merge."""
    if path == "formula":
        fn = ring_mod._block_backward_fn(torch.empty(0))
        if fn is ring_mod._autograd_block_backward:
            pytest.skip("the CPU reference backward (kernels/attention/autograd.py) is absent")
    else:
        fn = ring_mod._autograd_block_backward
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 11, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 17, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 17, D, dtype=torch.float64, generator=g, requires_grad=True)
    do = torch.randn(1, 4, 11, D, dtype=torch.float64, generator=g)
    dl = torch.randn(1, 4, 11, dtype=torch.float64, generator=g) if use_dlse else None
    cuts, causal_last = [0, 4, 5, 17], True
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        # the last block is a bottom-right causal one (as the ring's diagonal block)
        causal = causal_last and i == len(cuts) - 2
        parts.append((a, b, causal, *attention_reference(q, k[:, :, a:b], v[:, :, a:b],
                                                         causal=causal, softcap=3.0)))
    o, lse = merge_states_reference(torch.stack([p[3] for p in parts]),
                                    torch.stack([p[4] for p in parts]))
    loss = (o * do).sum() + ((lse * dl).sum() if dl is not None else 0)
    eq, ek, ev = torch.autograd.grad(loss, (q, k, v))
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    scale = 1 / math.sqrt(D)
    for a, b, causal, _, _ in parts:
        gq, gk, gv = fn(q.detach(), k.detach()[:, :, a:b], v.detach()[:, :, a:b], o.detach(),
                        lse.detach(), do, dl, causal, scale, 3.0)
        dq += gq
        dk[:, :, a:b] += gk
        dv[:, :, a:b] += gv
    for name, a, e in (("dq", dq, eq), ("dk", dk, ek), ("dv", dv, ev)):
        assert_close(a, e, "float64", name=name)


# --- validation (no process group needed) -----------------------------------------------------------

def test_helpers_validation():
    x = torch.randn(1, 1, 6, 4)
    with pytest.raises(ValueError, match="world"):
        shard(x, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        shard(x, 2, 2)
    with pytest.raises(ValueError, match="layout"):
        shard(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="dim"):
        shard(x, 0, 2, dim=4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        shard([1, 2], 0, 1)
    with pytest.raises(ValueError, match="layout"):
        shard_lengths(6, 2, "zig")
    with pytest.raises(ValueError, match="n must be"):
        shard_lengths(-1, 2)
    with pytest.raises(TypeError, match="shards"):
        unshard([])
    with pytest.raises(TypeError, match=r"shards\[1\]"):
        unshard([x, "y"])
    # zigzag needs the lengths of its split: world vs chunks
    with pytest.raises(ValueError, match="do not match the zigzag layout"):
        unshard([x, x[:, :, :4]], layout="zigzag")
    with pytest.raises(ValueError, match="dims"):
        unshard([x, x[0]])


def test_ring_attention_local_validation(monkeypatch):
    q = torch.randn(1, 2, 8, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="same positions"):
        ring_attention(q, q[:, :, :5], q[:, :, :5])
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, layout="ring")
    with pytest.raises(TypeError, match="causal"):
        ring_attention(q, q, q, causal=1)
    with pytest.raises(TypeError, match="group"):
        ring_attention(q, q, q, group="world")
    empty = torch.randn(1, 2, 8, 0, dtype=torch.float64)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        ring_attention(empty, empty, empty)
    from flashfold.api import attention as api
    wide = torch.randn(1, 2, 8, 300, dtype=torch.float16)       # past the kernels' tiles
    with monkeypatch.context() as m:
        m.setattr(api, "_use_kernel", lambda q: True)
        with pytest.raises(ValueError, match="head_dim must be in 1..256 for the GPU kernels"):
            ring_attention(wide, wide, wide)
    with pytest.raises(ValueError, match="scale"):
        ring_attention(q, q, q, scale=-1.0)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ring_attention(q, q, q)
