"""transformers models through flashfold's Triton kernels on the GPU, against SDPA.

Run on the GPU machine from the repository root (transformers is in its image)::

    PYTHONPATH=src python benchmarks/transformers_gpu.py            # checks + timings (~2 min)
    PYTHONPATH=src python benchmarks/transformers_gpu.py --check-only   # ~1 min
    PYTHONPATH=src python benchmarks/transformers_gpu.py --timing-only  # ~1-2 min
    PYTHONPATH=src python benchmarks/transformers_gpu.py --cpu      # CPU dry run (tests the script)

1. Correctness: the small BERT-style and Llama-style models of ``tests/test_transformers.py``
   (random seeded weights; Llama with GQA 4:2), in bfloat16 on CUDA, with
   ``attn_implementation`` = flashfold, ``sdpa`` and ``eager``, without padding, with left / right /
   mixed padding, and (Llama) prefill + greedy decoding with a dynamic KV cache (the steps
   run ``flashfold.decode``, left-padded ones with ``cache_start``; the padded prefill
   packed varlen attention). The
   reference is the eager model in float64 with the *same* bf16-rounded weights, run on
   each sequence alone (unpadded); only real rows are compared. Criterion (FlashAttention's):
   flashfold's max error <= 2 x the smaller of SDPA's and bf16 eager's + 1e-3 (bf16 models
   drift through the layers; all run the same bf16 matmuls outside attention; a peer
   whose error is NaN, e.g. from a fully masked padded row, is left out). The script also checks that
   the Triton kernel ran (it counts launches of ``flashfold.kernels.attention.fwd``) and
   that every decode step went to ``flashfold.decode`` (with ``cache_start`` when padded).
2. Timing (``triton.testing.do_bench`` median, bf16): a Llama-shaped model (hidden 2048, 16
   query / 8 KV heads of 128, 4 layers, vocabulary 8192, random weights made on the GPU) forward over batch 8 x 2048 tokens
   without and with padding (up to 25% of each row padded on the left), and a 2048-token
   prefill + 64 decode steps with a dynamic cache, padded and not (``flashfold.decode``
   steps, with ``cache_start`` when padded); flashfold against SDPA (which picks its flash / cuDNN /
   efficient backend). Prints ms and flashfold / SDPA.

Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
import warnings

import torch

import flashfold.integrations.transformers as fft
from flashfold.api import decode as api_decode
from flashfold.kernels.attention import fwd

warnings.filterwarnings("ignore", category=FutureWarning)

from transformers import (BertConfig, BertModel, DynamicCache, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)

FF = fft.ATTN_IMPLEMENTATION
DEV = "cuda"
DTYPE = torch.bfloat16
VOCAB, SEQ = 97, 45
PADDINGS = {"none": [(0, 0)] * 4, "left": [(0, 0), (17, 0), (1, 0), (40, 0)],
            "right": [(0, 0), (0, 9), (0, 1), (0, 44)], "mixed": [(0, 0), (7, 0), (0, 13), (3, 5)]}
FAILED: list[str] = []
LAUNCHES = [0]
#: flashfold.decode calls: [without cache_start, with cache_start]
DECODES = [0, 0]


def _count_launches():
    inner = fwd.attention_forward

    def counted(*a, **k):
        LAUNCHES[0] += 1
        return inner(*a, **k)
    fwd.attention_forward = counted
    inner_decode = api_decode.decode

    def counted_decode(*a, **k):
        DECODES[k.get("cache_start") is not None] += 1
        return inner_decode(*a, **k)
    api_decode.decode = counted_decode


def config(style, impl, **kw):
    if style == "llama":
        kw = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "max_position_embeddings": 256, **kw}
        cfg = LlamaConfig(**kw)
    else:
        kw = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **kw}
        cfg = BertConfig(**kw)
    cfg._attn_implementation = impl
    return cfg


def build(style, impl, dtype, seed=1234, **kw):
    torch.manual_seed(seed)
    cfg = config(style, impl, **kw)
    m = LlamaForCausalLM(cfg) if style == "llama" else BertModel(cfg)
    return m.to(DTYPE).to(dtype).to(DEV).eval()        # bf16-rounded weights in every copy


def run(model, ids, mask=None, pos=None, **kw):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def cache_kw(model, cache):
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def batch(padding, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g).to(DEV)
    if padding == "none":
        return ids, None, None
    mask = torch.ones(4, SEQ, dtype=torch.long)
    for b, (left, right) in enumerate(PADDINGS[padding]):
        mask[b, :left] = 0
        mask[b, SEQ - right:] = 0
    mask = mask.to(DEV)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def alone(ref, ids, mask):
    rows = []
    for b in range(ids.shape[0]):
        real = mask[b].bool() if mask is not None else torch.ones_like(ids[b], dtype=torch.bool)
        rows.append((real, run(ref, ids[b, real][None])[0]))
    return rows


def max_err(out, rows):
    """max |out[b, real] - r| over the ``(real, r)`` of each sequence ``b``; NaN when any
    sequence's error is (Python's ``max`` would keep the first of a number and a NaN)."""
    errs = [float((out[b, real].double() - r).abs().max()) for b, (real, r) in enumerate(rows)]
    return math.nan if any(map(math.isnan, errs)) else max(errs)


def verdict(name, e_ff, e_sdpa, e_eager):
    """flashfold's error against the best finite peer's (SDPA, eager in the same dtype)."""
    peers = [e for e in (e_sdpa, e_eager) if e == e and e != float("inf")]
    ok = bool(peers) and e_ff <= 2 * min(peers) + 1e-3
    print(f"  {'ok ' if ok else 'BAD'} {name:<28} flashfold err {e_ff:.2e}   sdpa {e_sdpa:.2e}   "
          f"eager {e_eager:.2e}", flush=True)
    if not ok:
        FAILED.append(name)


def correctness():
    print(f"== correctness ({str(DTYPE)[6:]} models vs the eager float64 model on each sequence "
          f"alone; attn_implementation={FF!r})")
    for style in ("bert", "llama"):
        ff, sd, ea = build(style, FF, DTYPE), build(style, "sdpa", DTYPE), build(style, "eager", DTYPE)
        ref = build(style, "eager", torch.float64)
        for padding in PADDINGS:
            ids, mask, pos = batch(padding)
            rows = alone(ref, ids, mask)
            before = LAUNCHES[0]
            o_ff = run(ff, ids, mask, pos)
            if DEV == "cuda" and LAUNCHES[0] == before:
                FAILED.append(f"{style} {padding}: the Triton kernel did not run")
            if not torch.isfinite(o_ff).all():
                FAILED.append(f"{style} {padding}: non-finite output")
            verdict(f"{style} {padding}", max_err(o_ff, rows), max_err(run(sd, ids, mask, pos), rows),
                    max_err(run(ea, ids, mask, pos), rows))
    # decoding: prefill, then greedy steps with a dynamic cache; the steps run
    # flashfold.decode (split-KV), left-padded ones from each row's first real key
    peers = {"ff": build("llama", FF, DTYPE), "sdpa": build("llama", "sdpa", DTYPE),
             "eager": build("llama", "eager", DTYPE)}
    ref = build("llama", "eager", torch.float64)
    for padding in ("left", "none"):
        ids, mask, pos = batch(padding, seed=3)
        if mask is None:
            mask = torch.ones_like(ids)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
        caches = {name: DynamicCache(config=m.config) for name, m in peers.items()}
        seq, am, step_ids = ids, mask, ids
        before = list(DECODES)
        for step in range(6):
            outs = {}
            for name, m in peers.items():
                with torch.no_grad():
                    outs[name] = m(input_ids=step_ids, attention_mask=am, position_ids=pos,
                                   use_cache=True, **cache_kw(m, caches[name])).logits[:, -1]
            want = [run(ref, seq[b, am[b].bool()][None])[0, -1] for b in range(seq.shape[0])]
            err = lambda o: max_err(o, [(slice(None), w) for w in want])  # noqa: E731
            verdict(f"llama decode {padding} step {step}", err(outs["ff"]), err(outs["sdpa"]),
                    err(outs["eager"]))
            nxt = torch.stack(want).argmax(-1, keepdim=True)       # follow the reference
            seq = torch.cat([seq, nxt], 1)
            am = torch.cat([am, torch.ones_like(nxt)], 1)
            step_ids, pos = nxt, pos[:, -1:] + 1
        used = DECODES[padding == "left"] - before[padding == "left"]
        if used != 5 * 2:                                  # 5 steps x 2 layers
            FAILED.append(f"llama decode {padding}: {used} flashfold.decode calls "
                          f"{'with' if padding == 'left' else 'without'} cache_start, not 10")


def bench(fn):
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def _timing_model(impl, kw):
    """A random Llama-shaped model initialized on the device (a CPU init of ~300M
    parameters takes longer than the timings)."""
    torch.manual_seed(0)
    cfg = config("llama", impl, **kw)
    with torch.device(DEV):
        m = LlamaForCausalLM(cfg)
    return m.to(DTYPE).eval()


def timing(batch_size=8, seq=2048, layers=4, steps=64):
    """Per case, flashfold and SDPA one after the other; each row is printed as soon as
    it is measured."""
    print(f"\n== timing: Llama-shaped (hidden 2048, 16/8 heads of 128, {layers} layers), "
          f"{str(DTYPE)[6:]}, batch {batch_size} x {seq} tokens, do_bench median", flush=True)
    kw = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=8192,
              max_position_embeddings=seq + steps + 8)
    if DEV != "cuda":                                                   # --cpu: toy sizes
        kw.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=VOCAB)
    models = {"flashfold": _timing_model(FF, kw), "sdpa": _timing_model("sdpa", kw)}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, kw["vocab_size"], (batch_size, seq), generator=g).to(DEV)
    mask = torch.ones(batch_size, seq, dtype=torch.long, device=DEV)
    lens = torch.randint(seq * 3 // 4, seq + 1, (batch_size,), generator=g)
    for b in range(batch_size):
        mask[b, :seq - int(lens[b])] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    full = torch.ones_like(mask)
    full_pos = full.cumsum(-1) - 1

    def decode(m, mask, pos):
        cache = DynamicCache(config=m.config)
        out = m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                **cache_kw(m, cache))
        nxt, am, p = out.logits[:, -1:].argmax(-1), mask, pos[:, -1:]
        for _ in range(steps):
            am = torch.cat([am, torch.ones_like(nxt)], 1)
            p = p + 1
            out = m(input_ids=nxt, attention_mask=am, position_ids=p, use_cache=True,
                    **cache_kw(m, cache))
            nxt = out.logits[:, -1:].argmax(-1)

    cases = {
        "prefill": lambda m: m(input_ids=ids, use_cache=False),
        "prefill padded": lambda m: m(input_ids=ids, attention_mask=mask, position_ids=pos,
                                      use_cache=False),
        f"prefill + {steps} decode steps, padded": lambda m: decode(m, mask, pos),
        f"prefill + {steps} decode steps": lambda m: decode(m, full, full_pos),
    }
    print(f"  {'case':<40}{'flashfold ms':>14}{'sdpa ms':>12}{'ff / sdpa':>11}", flush=True)
    for case, fn in cases.items():
        with torch.no_grad():
            t = {name: bench(lambda m=m: fn(m)) for name, m in models.items()}
        print(f"  {case:<40}{t['flashfold']:>14.2f}{t['sdpa']:>12.2f}"
              f"{t['flashfold'] / t['sdpa']:>11.2f}", flush=True)


def main(argv=None):
    global DEV, DTYPE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (float32, toy sizes)")
    args = ap.parse_args(argv)
    FAILED.clear()
    if args.cpu:
        DEV, DTYPE = "cpu", torch.float32
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu for a dry run)")
        return 2
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU dry run'}")
    _count_launches()
    t0 = time.time()
    if not args.timing_only:
        correctness()
    if not args.check_only:
        if args.cpu:
            timing(batch_size=2, seq=16, layers=1, steps=2)
        else:
            timing()
    print(f"\n{'all checks passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)} "
          f"({time.time() - t0:.0f} s)")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
