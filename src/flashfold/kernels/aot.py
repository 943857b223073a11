"""Ahead-of-time compilation of a kernel launch for a GPU target, without a GPU.

The interpreter (``TRITON_INTERPRET=1``) executes kernels as Python and accepts programs the
compiler rejects. Triton's NVIDIA backend, with the ``ptxas`` and ``cuobjdump`` it ships,
compiles for any target on a CPU-only machine, so CI can run the real pipeline (TTIR ->
TTGIR -> LLVM -> PTX -> cubin) on every constexpr variant, binding the launch's arguments
exactly as the JIT would (specialization on 16-byte alignment and on integers equal to 1),
and read what a kernel engineer reads off the output: registers and spills, shared memory,
TMA / wgmma use, the width of global accesses, SASS instruction counts.

Must run in a process where ``TRITON_INTERPRET`` is unset when the kernels are defined
(``@triton.jit`` returns interpreter objects otherwise). Nothing here launches a kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cached_property

__all__ = ["compile_launch", "Compiled"]


def _tool(name: str) -> str:
    from .compat import nvidia_tool          # the ptxas Triton itself assembles sm_90 with
    return nvidia_tool(name)


def _run_on_cubin(cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([_tool("cuobjdump"), *args, path], capture_output=True,
                              text=True, check=False).stdout
    finally:
        os.unlink(path)


@dataclass
class Compiled:
    """What the compiler produced for one specialization of a kernel."""
    name: str
    ptx: str
    ttgir: str
    cubin: bytes
    num_warps: int
    shared: int          # bytes of shared memory

    @cached_property
    def _usage(self) -> tuple[int, int]:
        out = _run_on_cubin(self.cubin, "--dump-resource-usage")
        regs = re.search(r"REG:(\d+)", out)
        stack = re.search(r"STACK:(\d+)", out)
        local = re.search(r"LOCAL:(\d+)", out)
        spill = max(int(stack.group(1)) if stack else 0, int(local.group(1)) if local else 0)
        return (int(regs.group(1)) if regs else -1), spill

    @property
    def registers(self) -> int:
        """Registers per thread (from the cubin)."""
        return self._usage[0]

    @property
    def spill_bytes(self) -> int:
        """Local memory (stack) per thread: > 0 means register spills."""
        return self._usage[1]

    @property
    def uses_tma(self) -> bool:
        return "cp.async.bulk.tensor" in self.ptx

    @property
    def uses_wgmma(self) -> bool:
        return "wgmma.mma_async" in self.ptx

    def resources(self) -> dict:
        """Registers and spill-store bytes as ``ptxas -v`` reports them for the PTX, and
        whether ptxas serialized the kernel's wgmma (its performance warning C7515: every
        wgmma then waits for the previous one, e.g. when a wgmma stays in flight across a
        loop's back edge while other instructions write accumulator registers)."""
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(self.ptx)
            r = subprocess.run([_tool("ptxas"), "-v", "-arch=sm_90a", src, "-o",
                                os.path.join(d, "k.o")], capture_output=True, text=True)
        text = r.stderr + r.stdout
        regs = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes spill stores", text)
        return {"registers": int(regs.group(1)) if regs else None,
                "spill_stores": int(spill.group(1)) if spill else None,
                "wgmma_serialized": "C7515" in text}

    def loads(self) -> dict:
        """``{'ld.global.v4.b32': count, ...}`` over the PTX."""
        return _count(r"ld\.global[\.\w]*", self.ptx)

    def stores(self) -> dict:
        return _count(r"st\.global[\.\w]*", self.ptx)

    def sass_instructions(self) -> int:
        """SASS instructions of the kernel (every line of its disassembly)."""
        sass = _run_on_cubin(self.cubin, "-sass")
        return len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))

    def sass_counts(self, *opcodes: str) -> dict:
        """Occurrences of SASS opcodes (e.g. ``"MUFU.EX2"``, ``"SHFL"``, ``"BAR"``)."""
        sass = _run_on_cubin(self.cubin, "-sass")
        return {op: len(re.findall(r"\b" + re.escape(op), sass)) for op in opcodes}


def _count(pattern: str, text: str) -> dict:
    out: dict = {}
    for m in re.findall(pattern, text):
        out[m] = out.get(m, 0) + 1
    return out


def compile_launch(kernel, args, kwargs, arch: int = 90) -> Compiled:
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
    kwargs = dict(kwargs)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():       # Gluon kernels (GPU-only)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    c = compile(source(kernel, signature, constexprs, attrs), target=target,
                options=options.__dict__)
    return Compiled(c.metadata.name, c.asm["ptx"], c.asm["ttgir"], c.asm["cubin"],
                    c.metadata.num_warps, c.metadata.shared)
