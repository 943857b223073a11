"""The README's Python examples run, and pass what the README says they pass.

Every ```python block of README.md must compile. A self-contained block (every name it
reads is imported or assigned in it) runs as it is written, in a fresh namespace: on the
CPU when it names no CUDA device, else on the GPU (``-m gpu``). Each top-level
``check_laws(...)`` / ``prove(...)`` statement in it becomes an assertion that the check
holds (or, when the line's comment says the check fails, that it fails). Fragments that
read names defined elsewhere (``q``, ``MY_MONOID``) are compiled only.
"""

import ast
import builtins
import os
import re

import pytest
import torch

HERE = os.path.dirname(__file__)
README = os.path.join(HERE, os.pardir, "README.md")

#: checks whose result a README statement claims
CHECKS = ("check_laws", "prove")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of each ```python block of a Markdown text."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if re.match(r"^```python\s*$", lines[i]):
            start, body = i + 2, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _readme_blocks():
    with open(README, encoding="utf-8") as f:
        return python_blocks(f.read())


def free_names(src: str) -> set[str]:
    """Names a block reads that it neither binds nor gets from builtins (scopes merged:
    a name bound anywhere in the block counts as bound)."""
    bound, read = set(), set()
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.Name):
            (bound if isinstance(n.ctx, (ast.Store, ast.Del)) else read).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
    return read - bound - set(dir(builtins))


BLOCKS = _readme_blocks()
RUNNABLE = [(line, src) for line, src in BLOCKS if not free_names(src)]
CPU_BLOCKS = [(line, src) for line, src in RUNNABLE if "cuda" not in src]
GPU_BLOCKS = [(line, src) for line, src in RUNNABLE if "cuda" in src]


def _called(node) -> str | None:
    """Name of the function a call expression calls (``ff.check_laws`` -> check_laws)."""
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    return None


class _AssertClaims(ast.NodeTransformer):
    """``check_laws(M)  # comment`` -> ``assert check_laws(M)`` (``assert not`` when the
    comment says the check fails), with the report as the assertion's message."""

    def __init__(self, lines):
        self.lines = lines

    def visit_Expr(self, node):
        if _called(node.value) not in CHECKS:
            return node
        comment = self.lines[node.end_lineno - 1].partition("#")[2].lower()
        expect_fail = "fail" in comment
        tmp = ast.Name("_claim", ast.Store())
        keep = ast.Assign([tmp], node.value)
        test = ast.Name("_claim", ast.Load())
        if expect_fail:
            test = ast.UnaryOp(ast.Not(), test)
        msg = ast.Call(ast.Name("str", ast.Load()), [ast.Name("_claim", ast.Load())], [])
        out = [keep, ast.Assert(test, msg)]
        for n in out:
            ast.copy_location(n, node)
        return out


def run_block(src: str, line: int, filename: str = "README.md") -> dict:
    """Execute one README block with its check claims asserted; returns its namespace."""
    tree = ast.parse(src, filename)
    tree = ast.fix_missing_locations(_AssertClaims(src.splitlines()).visit(tree))
    ast.increment_lineno(tree, line - 1)
    ns = {"__name__": "readme_example"}
    exec(compile(tree, filename, "exec"), ns)
    return ns


def test_the_readme_has_cpu_examples_with_law_claims():
    assert CPU_BLOCKS, "no CPU-runnable python block found in README.md"
    claims = [n for _, src in CPU_BLOCKS for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.Expr) and _called(n.value) in CHECKS]
    assert claims, "the README's monoid example no longer checks its laws"


@pytest.mark.parametrize("line,src", BLOCKS, ids=[f"README.md:{ln}" for ln, _ in BLOCKS])
def test_every_python_block_compiles(line, src):
    compile(src, f"README.md:{line}", "exec")


@pytest.mark.parametrize("line,src", CPU_BLOCKS, ids=[f"README.md:{ln}" for ln, _ in CPU_BLOCKS])
def test_cpu_examples_run_and_pass_their_claims(line, src):
    run_block(src, line)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("line,src", GPU_BLOCKS, ids=[f"README.md:{ln}" for ln, _ in GPU_BLOCKS])
def test_gpu_examples_run(line, src):
    run_block(src, line)


def test_fragments_are_told_apart_from_examples():
    assert free_names("import torch\nx = torch.ones(2)\nf = lambda a: a + x\n") == set()
    assert free_names("o = ring_attention(q, k, v)\n") == {"ring_attention", "q", "k", "v"}


def test_a_failing_claim_is_caught():
    """The harness itself: a claimed check that does not hold fails the test."""
    src = ("import flashfold as ff\nfrom flashfold import ops\n"
           "AVG = ff.Monoid('avg', fields=('x',), identity=(0.0,), lift=lambda x: (x,),\n"
           "                combine=lambda a, b: ((a.x + b.x) / 2,), commutative=True)\n"
           "ff.check_laws(AVG)\n")
    with pytest.raises(AssertionError, match="associativity : FAILED"):
        run_block(src, 1)
    claimed_failure = "ff.check_laws(AVG)   # fails: not associative\n"
    run_block(src.replace("ff.check_laws(AVG)\n", claimed_failure), 1)
