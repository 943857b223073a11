"""Ahead-of-time compilation of a prepared launch for a GPU target, without a GPU.

Triton's NVIDIA backend (with its bundled ``ptxas``) compiles for any target on a CPU-only
machine, so the real compiler can check every constexpr variant of a kernel in CI
(``tests/test_attention_compile.py``): that it compiles (no interpreter-only construct),
that it uses TMA / wgmma where expected, and its registers, spills and shared memory.

Must run in a process where ``TRITON_INTERPRET`` is unset when the kernels are defined
(``@triton.jit`` returns interpreter objects otherwise).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass
class CompiledInfo:
    """What the compiler produced for one specialization."""
    name: str
    shared: int          # bytes of shared memory
    registers: int       # per thread
    spill_bytes: int     # local memory (stack) per thread: > 0 means register spills
    num_warps: int
    ttgir: str
    ptx: str

    @property
    def uses_tma(self) -> bool:
        return "cp.async.bulk.tensor" in self.ptx

    @property
    def uses_wgmma(self) -> bool:
        return "wgmma.mma_async" in self.ptx


def compile_launch(kernel, args, kwargs, arch: int = 90) -> CompiledInfo:
    """Compile ``kernel[grid](*args, **kwargs)`` for ``sm_<arch>`` without launching it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):
        raise RuntimeError("compile_launch needs a compiled-mode kernel: unset TRITON_INTERPRET "
                           "before importing the kernel module")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                       options=options.__dict__)
    regs, spill = _resource_usage(compiled.asm["cubin"])
    return CompiledInfo(compiled.metadata.name, compiled.metadata.shared, regs, spill,
                        compiled.metadata.num_warps, compiled.asm["ttgir"], compiled.asm["ptx"])


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=False).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    spill = max(int(stack.group(1)) if stack else 0, int(local.group(1)) if local else 0)
    return (int(regs.group(1)) if regs else -1), spill


__all__ = ["compile_launch", "CompiledInfo"]
