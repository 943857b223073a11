#!/usr/bin/env bash
# The CuTeDSL's Python package for the FlashAttention-4 / QuACK peers. The archives of
# /work/shared/peers/fetch.sh hold nvidia-cutlass-dsl-libs-base and -libs-cu13 (the MLIR
# compiler and runtime) but not nvidia-cutlass-dsl-libs-core, which libs-base requires and
# which holds `cutlass.cute` itself: without it `import flash_attn.cute` fails with "No
# module named 'cutlass.cute'". This adds it as one more small archive (~1.5 MB), unpacked
# into the same site folder. Usage: bash benchmarks/peers_core.sh .peers
set -euo pipefail
out=${1:?usage: peers_core.sh OUTDIR}
mkdir -p "$out"; out=$(cd "$out" && pwd)
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$work/whl" nvidia-cutlass-dsl-libs-core==4.8.1
mkdir -p "$work/core"
for w in "$work"/whl/*.whl; do (cd "$work/core" && python3 -m zipfile -e "$w" .); done
(cd "$work/core" && tar -cf - . | xz -6 -T0 > "$out/cutlass_core.tar.xz")
rm -rf "$work"
ls -la "$out/cutlass_core.tar.xz"
