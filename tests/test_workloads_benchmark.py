"""benchmarks/workloads.py on the CPU: the smoke run end to end (row builders, checks,
tables), the FLOP counts of full-size rows against hand-computed values, checks that fail
on a wrong result, the FlashAttention-4 adapter's layouts against a stand-in with FA4's
documented shapes, and the FA4 compile workers' reports.

The script itself spends scarce GPU time in one run; these make sure it runs and that its
numbers mean what its docstring says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

import flashfold
from flashfold import mods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.fixture(scope="module")
def wl():
    # imported by name (not from a file spec) so that spawned workers can unpickle its objects
    sys.path.insert(0, BENCH)
    try:
        import workloads
        yield workloads
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def smoke_output():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + (os.pathsep + env["PYTHONPATH"]
                                                     if env.get("PYTHONPATH") else "")
    res = subprocess.run([sys.executable, os.path.join(BENCH, "workloads.py"), "--smoke"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _flops(out: str) -> dict:
    rows = {}
    for m in re.finditer(r"^\s+flops (\S+)\s+pairs=(\d+) fwd=(\d+) bwd=(\d+)(?: docs=(\S+))?$",
                         out, re.M):
        rows[m.group(1)] = dict(pairs=int(m.group(2)), fwd=int(m.group(3)), bwd=int(m.group(4)),
                                docs=[int(x) for x in m.group(5).split(",")] if m.group(5) else None)
    return rows


def test_smoke_run_checks_every_row_and_prints_the_tables(smoke_output, wl):
    out = smoke_output
    n = len(wl.grid())
    assert f"== checks: {n}/{n} rows passed, 0 not checked" in out
    assert "checks PASSED" in out
    assert out.count("check flashfold vs float64: ok") == n
    assert "check flashfold vs Flex: ok" in out                       # a peer compared
    for title in ("### forward, eager", "### backward alone, eager"):
        table = out[out.index(title):].split("\n\n")[0].splitlines()
        assert table[1].startswith("| model | shape | flashfold ms | TFLOP/s | cuDNN | FA2 | FA4 "
                                   "| Flex | best peer | ratio to best |")
        assert len(table) == 3 + n, table                              # no row dropped
    assert "graph" not in out.split("== second pass")[1].split("###")[0]    # no CUDA graphs
    for w in wl.grid():
        assert f"| {w.model} |" in out
    # a CUDA-only peer says why once and leaves its cells empty
    assert out.count("FA4: needs CUDA") == 1


def test_flop_counts_of_full_size_rows(smoke_output):
    f = _flops(smoke_output)
    assert len(f) == 21
    # causal dense (convention N^2 / 2): Llama-3 8B, B 4, N 4096, 32 query heads of 128
    assert f["llama-4k"]["pairs"] == 4 * 4096 * 4096 // 2
    assert f["llama-4k"]["fwd"] == 4 * 32 * 128 * 33_554_432 == 549_755_813_888
    assert f["llama-4k"]["bwd"] == 2.5 * 549_755_813_888
    # causal window (4096, 0) at N 16384: rows 0..4096 see i + 1 keys, the rest 4097
    mistral = 4097 * 4098 // 2 + (16384 - 4097) * 4097
    assert f["mistral-w4096"]["pairs"] == mistral == 58_734_592
    assert f["mistral-w4096"]["fwd"] == 4 * 32 * 128 * 58_734_592
    # Phi-3-mini: window (2047, 0), N 4096, B 4, d96
    phi3 = 4 * (2048 * 2049 // 2 + (4096 - 2048) * 2048)
    assert f["phi3-w2047"]["pairs"] == phi3 == 25_169_920
    assert f["phi3-w2047"]["fwd"] == 4 * 32 * 96 * phi3
    # DeepSeek-V3 MLA: D_avg = (192 + 128) / 2 = 160
    assert f["deepseek-mla"]["fwd"] == 4 * 16 * 160 * (4 * 4096 * 4096 // 2) == 343_597_383_680
    # packed documents: 24 lengths in [40, 1340] summing to 16384, each causal L (L + 1) / 2
    docs = f["llama-varlen"]["docs"]
    assert len(docs) == 24 and sum(docs) == 16384 and 40 <= min(docs) and max(docs) <= 1340
    assert f["llama-varlen"]["fwd"] == 4 * 32 * 128 * sum(d * (d + 1) // 2 for d in docs)
    eq = f["llama-equal-docs"]["docs"]
    assert sorted(set(eq)) == [682, 683] and sum(eq) == 16384
    # prefix-LM 1024 at N 4096, B 4: the prefix block P^2, then causal rows
    assert f["prefix-lm-d128"]["pairs"] == 4 * (1024 ** 2 + 4096 * 4097 // 2 - 1024 * 1025 // 2)
    # document mask: 8 documents of one 4096-token sequence, B 4
    d8 = f["documents-d64"]["docs"]
    assert len(d8) == 8 and sum(d8) == 4096
    assert f["documents-d64"]["fwd"] == 4 * 16 * 64 * 4 * sum(d * (d + 1) // 2 for d in d8)


def test_key_padding_counts_real_keys(wl):
    w = next(w for w in wl.grid() if w.key == "minilm-padding")
    assert w.pairs() == 512 * sum(w.key_lens) and w.key_lens[0] < 512
    assert w.flops() == 4 * 12 * 32 * w.pairs()


def test_document_lengths(wl):
    a = wl.doc_lengths(16384, 24, 40, 1340, seed=0)
    assert a == wl.doc_lengths(16384, 24, 40, 1340, seed=0)             # fixed seed
    assert a != wl.doc_lengths(16384, 24, 40, 1340, seed=3)
    b = wl.doc_lengths(1000, 7, 100, 150, seed=5)                        # tight: clipped
    assert sum(b) == 1000 and all(100 <= x <= 150 for x in b)
    with pytest.raises(ValueError):
        wl.doc_lengths(100, 3, 40, 50, seed=0)
    assert wl.equal_lengths(10, 4) == (3, 3, 2, 2)


def _ff(w, x, **kw):
    return flashfold.attention(x.q, x.k, x.v, return_lse=True, **kw)


def test_reference_check_fails_on_a_wrong_result(wl):
    w = next(w for w in wl.grid() if w.key == "mistral-w4096").smoke()
    st = wl.Static(w, "cpu")
    st.build("flashfold")
    x = wl.make_inputs(w, "cpu", torch.bfloat16)
    o, lse = _ff(w, x, **st.kw["flashfold"])
    assert wl.check_reference(w, st, x, o.detach(), lse.detach())[0]
    ok, msg = wl.check_reference(w, st, x, o.detach() * 1.02, lse.detach())
    assert not ok and "o err" in msg
    # the window forgotten: the reference, which applies it, tells
    o2, lse2 = _ff(w, x, causal=True)
    assert not wl.check_reference(w, st, x, o2.detach(), lse2.detach())[0]
    nan = o.detach().clone()
    nan[0, 1, 3] = float("nan")                        # outside the rows compared
    assert "NaN" in wl.check_reference(w, st, x, nan, lse.detach())[1]


def test_peer_check_fails_on_a_wrong_peer(wl):
    o = torch.randn(2, 4, 64, 32)
    g = [torch.randn(2, 4, 64, 32) for _ in range(3)]
    lse = torch.randn(2, 4, 64)
    assert wl.compare_peer((o, lse, g), (o.clone(), lse.clone(), g))[0]
    assert not wl.compare_peer((o, lse, g), (o + 0.1, lse, g))[0]
    assert not wl.compare_peer((o, lse, g), (o, lse + 0.1, g))[0]
    assert not wl.compare_peer((o, lse, g), (o, lse, [g[0], g[1] * 1.2, g[2]]))[0]


def _fake_fa4():
    """FA4's interface as its docstrings give it ((batch, seq, heads, dim), or packed
    (total, heads, dim) with ``cu_seqlens``; ``seqused_k``; ``window_size`` around the
    diagonal; LSE ``(batch, heads, seq)`` or ``(heads, total)``), computed by flashfold's
    CPU path: a stand-in that checks the adapter's layouts, not FA4."""
    def dense(q, k, v, causal=False, window_size=(None, None), softcap=0.0, return_lse=False):
        o, lse = flashfold.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     causal=causal, return_lse=True, softcap=softcap or None,
                                     window=None if window_size == (None, None) else window_size)
        return o.transpose(1, 2), lse

    def varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, seqused_k=None, causal=False, return_lse=False):
        if seqused_k is not None:
            o, lse = flashfold.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         causal=causal, return_lse=True,
                                         mask_mod=mods.key_padding_mask(seqused_k))
            return o.transpose(1, 2), lse
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        o, lse = flashfold.attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), causal=causal,
                                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     return_lse=True)
        return o[0].transpose(0, 1), lse[0]
    return types.SimpleNamespace(flash_attn_func=dense, flash_attn_varlen_func=varlen)


@pytest.mark.parametrize("key", ["llama-4k", "llama-varlen", "mistral-w4096", "gemma2-softcap",
                                 "deepseek-mla", "minilm-padding", "documents-d64"])
def test_fa4_adapter_layouts(wl, key):
    """Outputs, LSE and gradients of the FA4 adapter (layouts (B, N, H, D), packed
    documents, seqused_k) come back in flashfold's layout and agree with flashfold."""
    w = next(w for w in wl.grid() if w.key == key).smoke()
    fa4 = _fake_fa4()
    st = wl.Static(w, "cpu", fa4)
    x = wl.make_inputs(w, "cpu", torch.bfloat16)
    ff = wl.build_impl("flashfold", w, st, x, None)
    impl = wl.build_impl("fa4", w, st, x, None)
    assert impl.leaves[0].shape[-3:] != x.q.shape[-3:] or w.varlen     # its own layout
    got = wl._results(impl, True)
    ok, msg = wl.compare_peer(wl._results(ff, True), got)
    assert ok, msg
    assert got[1].shape == x.q.shape[:3] and got[0].shape == x.do.shape


def test_fa4_workers_report_an_import_failure(wl):
    """Workers that cannot import FA4 say so for every configuration instead of hanging."""
    rows = [w for w in wl.grid() if w.key in ("llama-4k", "llama-16k", "gemma2-softcap")]
    pool = wl.FA4Pool(rows, 2, backward=True)
    try:
        pool.poll(timeout=240)
    finally:
        pool.close()
    assert pool.expected == len({wl.fa4_config(w) for w in rows}) == 3
    assert len(pool.done) == 3, pool.done
    assert all(not ok and msg.startswith("import:") for ok, msg in pool.done.values())
    assert not pool.result(rows[0])[0]
    assert not any(p.is_alive() for p in pool.procs)


def test_budget_skips_peers_but_keeps_rows(wl, capsys):
    """Past the budget, peers are skipped and rows are still listed (never dropped)."""
    rows = [w.smoke() for w in wl.grid() if w.key in ("mistral-w4096", "bert")]
    args = types.SimpleNamespace(fwd_only=True, no_peers=False, budget=-100.0, fa4_workers=0,
                                 rows="", quick=False, kernels=False, mask_cost=False)
    ctx = wl.Context(args, "cpu", torch.bfloat16, len(rows))
    results = [wl.RowResult(w) for w in rows]
    wl.run_rows(results, ctx)
    wl.print_tables(results, ctx.measures)
    out = capsys.readouterr().out
    assert out.count("not run (time budget)") == 2 and out.count("(not run) |") == 2
    ctx = wl.Context(replace_budget(args, 5.0 + 10 * len(rows)), "cpu", torch.bfloat16, len(rows))
    ctx.t0 -= 10.0                                      # 10 s in: peers closed, rows open
    results = [wl.RowResult(w) for w in rows]
    wl.run_rows(results, ctx)
    out = capsys.readouterr().out
    assert "flex skipped (time budget)" in out and all(r.run for r in results)
    assert all(set(r.ms[("fwd", "eager")]) == {"flashfold"} for r in results)


def replace_budget(args, budget):
    new = types.SimpleNamespace(**vars(args))
    new.budget = budget
    return new


def test_smoke_rows_keep_the_shape_of_their_rows(wl):
    for w in wl.grid():
        s = w.smoke()
        assert s.Hq // s.Hk == w.Hq // w.Hk and (s.D, s.dv) == (w.D, w.dv)
        assert s.causal == w.causal and s.softcap == w.softcap and s.alibi == w.alibi
        assert (s.window is None) == (w.window is None) and (s.docs is None) == (w.docs is None)
        assert s.pairs() > 0 and (not s.docs or sum(s.docs) == s.N)
    assert replace(wl.grid()[0], N=8).pairs() == 4 * 32


def test_peer_check_names_an_outlier_only_against_two_agreeing_peers(wl):
    """Check (2) follows the first peer; where it alone disagrees, flashfold passes only if
    at least two other peers ran and it agrees with all of them (the first is named)."""
    assert wl.peer_verdict([]) == (True, "")
    assert wl.peer_verdict([("fa4", True), ("cudnn", False)]) == (True, "")
    ok, why = wl.peer_verdict([("fa4", False), ("cudnn", True), ("flash", True)])
    assert ok and "FA4 differs" in why and "cuDNN, FA2" in why
    assert wl.peer_verdict([("fa4", False), ("cudnn", True)]) == (False, "")
    assert wl.peer_verdict([("fa4", False), ("cudnn", True), ("flash", False)]) == (False, "")
    assert wl.peer_verdict([("fa4", False)]) == (False, "")


def test_kernels_lines_follow_the_timings_and_leave_the_tables_alone(wl, capsys):
    """``--kernels``: after a row's timings, one line per implementation and direction
    with what its eager call ran and that call's eager time; the results parser reads the
    measurement lines as without it."""
    from flashfold.bench import parse_workloads
    assert wl.main(["--smoke", "--rows", "bert", "--no-peers", "--kernels"]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^   kernels (fwd|bwd) +flashfold: sum ([\d.]+) us, eager ([\d.]+) us \| "
                       r"(.+)$", out, re.M)
    assert [d for d, *_ in lines] == ["fwd", "bwd"], out[-2000:]
    for _, total, eager, parts in lines:
        assert float(total) > 0 and float(eager) > 0 and parts.count(";") >= 1
    rows = parse_workloads(out).rows
    assert {(r["direction"], r["mode"]) for r in rows} == {("fwd", "eager"), ("bwd", "eager")}
    assert all(r["model"] == "BERT-base" for r in rows)


def test_mask_cost_variants_keep_the_rows_tiles(wl):
    """``--mask-cost``'s variants of a block mask: the document mask, which runs as
    intervals of keys, as written (its user mask in the kernels' place); the same PARTIAL
    / FULL lists with a mask_mod that only compares ``kv_idx >= 0``, and the same tiles
    all FULL; and the visited tiles counted over the broadcast batches and heads, against
    a count by brute force over the row's document ids."""
    from flashfold.kernels.attention import mods as km
    w = next(w for w in wl.grid() if w.key == "documents-d64").smoke()
    st = wl.Static(w, "cpu")
    st.build("flashfold")
    bm = st.kw["flashfold"]["mask_mod"]
    assert bm.row_mod is not bm.mod
    written, one, full = wl.mask_variants(bm).values()
    assert written.row_mod is written.mod is bm.mod
    for name in ("partial_num", "partial_idx", "full_num", "full_idx", "state"):
        assert torch.equal(getattr(one, name), getattr(bm, name)), name
        assert torch.equal(getattr(written, name), getattr(bm, name)), name
    i = torch.arange(w.N)
    assert one.mod.torch_fn("cpu")(0, 0, i[:, None], i[None, :]).all()
    assert not full.partial_num.any()
    assert torch.equal(full.full_num, bm.partial_num + bm.full_num)
    for r in range(bm.state.shape[2]):
        listed = set(bm.partial_idx[0, 0, r, :bm.partial_num[0, 0, r]].tolist())
        listed |= set(bm.full_idx[0, 0, r, :bm.full_num[0, 0, r]].tolist())
        assert set(full.full_idx[0, 0, r, :full.full_num[0, 0, r]].tolist()) == listed
    ids = st.doc_ids
    vis = (ids[:, None] == ids[None, :]) & (i[:, None] >= i[None, :])
    bq, bk = bm.BLOCK_SIZE
    nq, nk = -(-w.N // bq), -(-w.N // bk)
    blocks = sum(bool(vis[a * bq:(a + 1) * bq, c * bk:(c + 1) * bk].any())
                 for a in range(nq) for c in range(nk))
    assert wl.visited_tiles(w, bm) == blocks * w.batch * w.Hq


def test_mask_cost_lines_follow_block_mask_rows_only(wl, capsys):
    """``--mask-cost``: one line after the timings of each row with a block mask
    (documents, prefix-LM), naming the row's forward and its variants with their visited
    tiles (the documents, which run as intervals of keys, also as written); none for rows
    without one (a callable mask_mod, no mask)."""
    rows = ("documents-d64", "prefix-lm-d64", "minilm", "bert")
    assert wl.main(["--smoke", "--rows", ",".join(rows), "--no-peers", "--fwd-only",
                    "--mask-cost"]) == 0
    out = capsys.readouterr().out
    cell = r"([\d.]+) us, [\d.]+ per tile per SM \| "
    lines = re.findall(r"^   mask cost fwd flashfold: as run " + cell + r"(?:the mask as written "
                       + cell + r")?one compare per pair " + cell + r"no mask evaluated " + cell
                       + r"(\d+) visited tiles; evaluating the mask -?\d+% of the row$", out, re.M)
    assert len(lines) == 2, out[-3000:]
    assert lines[0][1] and not lines[1][1]     # the documents' as written; not prefix-LM's
    for w, line in zip([w.smoke() for w in wl.grid() if w.key in rows[:2]], lines):
        st = wl.Static(w, "cpu")
        st.build("flashfold")
        assert int(line[4]) == wl.visited_tiles(w, st.kw["flashfold"]["mask_mod"])
        assert all(float(t) > 0 for t in line[:4] if t)
