"""TEMPORARY probe (removed in the next commit): %globaltimer / %smid stamps of every split
program of the decode kernel at the target rows, to see whether the end of the kernel is a
tail (programs ending at different times) or a uniform streaming rate.

Writes src/flashfold/kernels/decode/_stamped.py (a copy of splitkv.py whose split kernel
stores (start, end, smid) of each program into the unused START argument) and runs it.
PYTHONPATH=src python benchmarks/_probe_decode_stamps.py
"""
import pathlib
import re
import sys

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src/flashfold/kernels/decode/splitkv.py"
DST = ROOT / "src/flashfold/kernels/decode/_stamped.py"

text = SRC.read_text()
a = text.index("def _splitkv_kernel(")
z = text.index("@triton.jit\ndef _merge_kernel(")
kern = text[a:z]
kern = kern.replace("    pid = tl.program_id(0)\n", "    pid = tl.program_id(0)\n    _t0 = _gt(pid)\n", 1)
kern = kern.rstrip("\n") + """
    _t1 = _gt(pid)
    _lin = (tl.program_id(1) * tl.num_programs(0) + pid).to(tl.int64)
    tl.store(START + _lin * 4, _t0)
    tl.store(START + _lin * 4 + 1, _t1)
    tl.store(START + _lin * 4 + 2, _smid(pid).to(tl.int64))


"""
helpers = '''
@triton.jit
def _gt(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid(x):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x],
                                     dtype=tl.int32, is_pure=False, pack=1)


'''
head = text[:a]
assert head.endswith("@triton.jit\n")
DST.write_text(head[:-len("@triton.jit\n")] + helpers.lstrip("\n") + "@triton.jit\n" + kern
               + text[z:])

sys.path.insert(0, str(ROOT / "src"))
from flashfold.kernels import launcher  # noqa: E402
from flashfold.kernels.decode import _stamped as S  # noqa: E402
from flashfold.kernels.decode import splitkv  # noqa: E402

DEV = "cuda"
D = 128
FLUSH = torch.ones(2**26, device=DEV, dtype=torch.float32)


RAW = {}


def run_row(batch, length, splits=None, reps=3):
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(batch, 32, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, 8, length, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, 8, length, D, device=DEV, dtype=torch.bfloat16, generator=g)
    lens = torch.full((batch,), length, device=DEV, dtype=torch.int32)
    L = S.prepare(q, k, v, lens, None, scale=D ** -0.5, num_splits=splits)
    grid, args, kwargs = L.split
    n_prog = grid[0] * grid[1]
    stamps = torch.zeros(n_prog * 4, device=DEV, dtype=torch.int64)
    args = list(args)
    args[7] = stamps
    nbytes = 2 * k.numel() * 2

    def call():
        launcher.launch(S._splitkv_kernel, grid, tuple(args), kwargs)
        if L.merge is not None:
            mg, ma, mk = L.merge
            launcher.launch(S._merge_kernel, mg, ma, mk)

    ref = splitkv.splitkv_decode(q, k, v, lens, None, scale=D ** -0.5, num_splits=splits)[0]
    call()
    torch.cuda.synchronize()
    same = torch.equal(L.out, ref)
    plain = lambda: splitkv.splitkv_decode(q, k, v, lens, None, scale=D ** -0.5,  # noqa: E731
                                           num_splits=splits)
    t_st = triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median")
    t_pl = triton.testing.do_bench(plain, warmup=10, rep=60, return_mode="median")
    print(f"\n== batch {batch} len {length}: grid {grid} ({n_prog} programs, "
          f"{L.plan.n_splits} splits), TMA {kwargs['USE_TMA']}, out bitwise = plain: {same}; "
          f"do_bench stamped {t_st * 1e3:.1f} us, plain {t_pl * 1e3:.1f} us "
          f"({nbytes / t_pl / 1e6:.0f} GB/s)")
    for r in range(reps):
        FLUSH.sum()
        call()
        torch.cuda.synchronize()
        st = stamps.view(n_prog, 4).cpu().double()
        RAW.setdefault((batch, length, L.plan.n_splits), []).append(stamps.view(n_prog, 4).cpu().clone())
        t0 = st[:, 0].min()
        s, e, sm = (st[:, 0] - t0) / 1e3, (st[:, 1] - t0) / 1e3, st[:, 2].long()
        dur = e - s
        es = e.sort().values
        q_ = lambda x, f: x.sort().values[min(len(x) - 1, int(f * (len(x) - 1)))].item()  # noqa: E731
        per_sm = torch.bincount(sm, minlength=132)
        occ = torch.bincount(per_sm, minlength=4)
        print(f"  rep {r}: span {es[-1]:.1f} us; start spread {s.max():.2f} us (p50 "
              f"{q_(s, .5):.2f}); end p0 {es[0]:.1f} p10 {q_(e, .1):.1f} p50 {q_(e, .5):.1f} "
              f"p90 {q_(e, .9):.1f} p99 {q_(e, .99):.1f} max {es[-1]:.1f}; "
              f"duration p0 {dur.min():.1f} p50 {q_(dur, .5):.1f} max {dur.max():.1f}")
        print(f"    programs per SM: " + ", ".join(f"{i}: {int(c)} SMs" for i, c in enumerate(occ)
                                                  if c))
        for k_ in range(1, int(per_sm.max()) + 1):
            mask = per_sm[sm] == k_
            if mask.any():
                print(f"    on SMs with {k_}: duration p50 {q_(dur[mask], .5):.1f} "
                      f"min {dur[mask].min():.1f} max {dur[mask].max():.1f}, end max "
                      f"{e[mask].max():.1f}")
        # bytes each program reads are equal: aggregate rate over time from active counts
        grid_t = torch.linspace(0, es[-1].item(), 21)
        act = [int(((s <= t) & (e > t)).sum()) for t in grid_t[:-1]]
        print(f"    active programs at 0..95% of the span: {act}")
        # mean per-program rate and the span if every program had ended at the median end
        print(f"    tail: max end - p50 end = {es[-1] - q_(e, .5):.1f} us "
              f"({100 * (es[-1] - q_(e, .5)) / es[-1]:.1f}% of the span)")
    del q, k, v
    torch.cuda.empty_cache()


for batch, length, splits in ((8, 8192, None), (8, 65536, None)):
    run_row(batch, length, splits, reps=6)
import os
torch.save(RAW, os.path.join(os.environ.get("OUT", "."), "s14_decode_stamps_raw.pt"))
DST.unlink()
