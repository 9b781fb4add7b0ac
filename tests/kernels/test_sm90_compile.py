"""Every Triton kernel of turnkv compiles for an H100 (sm_90), on a machine without a GPU.

Triton's interpreter, which runs the kernel tests on CPU, accepts code that the compiler rejects
(a `tl.constexpr` reassigned in a `tl.static_range`, a dot of mismatched dtypes after a constexpr
`if` that returns). Here sm90.py compiles each kernel for sm_90 with ptxas, at the engine's shapes and
constexpr settings (sm90_cases.py), in subprocesses without TRITON_INTERPRET; nothing runs. The
checker itself is tested on a planted constexpr reassignment (sm90_planted.py).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHARDS = 2  # compiles are CPU-bound and single-threaded: one process per core of a CI runner


def compile_sm90(cases: Path, shards: int = 1, only: list[str] | None = None) -> list[dict]:
    """Run sm90.py over `cases` in `shards` processes at once -> one result per case (sm90.py's JSON)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, str(HERE / "sm90.py"), "--cases", str(cases)]
    if only is not None:
        command += ["--only", *only]
    procs = [subprocess.Popen([*command, "--shard", f"{i}/{shards}"], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(shards)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=1200)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert proc.returncode in (0, 1) and (lines or proc.returncode == 0), f"sm90.py died:\n{err[-4000:]}"
        assert proc.returncode == (0 if all(r["ok"] for r in lines) else 1)
        results += lines
    return results


def launched_kernels() -> set[str]:
    """module.kernel of every @triton.jit function of turnkv that some code launches (`kernel[grid](...)`)."""
    names = set()
    for path in (REPO / "turnkv").rglob("*.py"):
        tree = ast.parse(path.read_text())
        jitted = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
                  and any("jit" in ast.unparse(d) for d in f.decorator_list)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in jitted:
                names.add(f"{path.stem}.{node.func.value.id}")
    return names


@pytest.fixture(scope="module")
def engine_results():
    results = compile_sm90(HERE / "sm90_cases.py", shards=SHARDS)
    assert results, "no case ran"
    return results


def test_every_engine_kernel_compiles_for_sm90(engine_results):
    failed = [f"{r['case']}:\n{r['error']}" for r in engine_results if not r["ok"]]
    assert not failed, "kernels that do not compile for sm_90:\n\n" + "\n\n".join(failed)


def test_the_cases_cover_every_launched_kernel(engine_results):
    compiled = {name.split("[")[0] for r in engine_results for name in r["compiled"]}
    expected = launched_kernels()
    assert len(expected) >= 20, expected  # the scan finds the kernels (catches a broken scan)
    assert expected <= compiled, f"kernels with no case in sm90_cases.py: {sorted(expected - compiled)}"


# Variants an H100 runs that the CPU tests never reach (their device-dependent choices differ there:
# docs/gpu-and-cpu.md): the compile run must have taken the H100's side of each choice.
H100_VARIANTS = {
    "PDL on (capability 9)": ("GDC=True, EARLY=True",),
    "int8 codes by inline PTX": ("decode._decode_chunk[", "QUANT=3, FP8=False"),
    "fp8 codes by cast": ("decode._decode_chunk[", "QUANT=1, FP8=True"),
    "skinny matmul on tensor cores, 2..8 rows": ("gemv._skinny_matmul[BLOCK_M=16", "DOT=True", "GDC=True"),
    "skinny matmul at M = 1": ("gemv._skinny_matmul[M=1, BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048",),
    "decode split for 132 SMs": ("decode._decode_chunk[H=8", "SPLIT=True"),
    "chunk attention split, engine tiles": ("chunk_prefill._chunk_attention[H=8, G=4, D=128", "BLOCK_M=128",
                                            "SPLIT=True", "PRECISION='tf32'"),
}


@pytest.mark.parametrize("variant", H100_VARIANTS)
def test_the_h100_side_of_each_device_choice_compiled(engine_results, variant):
    compiled = [name for r in engine_results for name in r["compiled"]]
    assert any(all(part in name for part in H100_VARIANTS[variant]) for name in compiled), variant


def test_step_sizes_compile_no_new_variant():
    """Batch sizes, chunk lengths, histories and table widths that change from step to step compile
    once per constexpr setting (sm90_steady.py): the same record twice is a recompile for a size."""
    results = compile_sm90(HERE / "sm90_steady.py")
    assert [r["case"] for r in results] == ["steady/decode", "steady/chunk", "steady/write_heads",
                                            "steady/window_scores", "steady/radix_top_k"]
    for r in results:
        assert r["ok"], r["error"]
        repeated = sorted({name for name in r["compiled"] if r["compiled"].count(name) > 1})
        assert not repeated, f"{r['case']} compiled these again for a new size: {repeated}"
    kernels = [name.split("[")[0] for r in results for name in r["compiled"]]
    assert kernels.count("decode._decode_chunk") == 1  # every batch and history here splits its keys
    assert kernels.count("chunk_prefill._chunk_attention") == 2
    assert kernels.count("window_scores._window_lse") == 1 and kernels.count("window_scores._merge_partials") == 1


def test_the_check_fails_on_a_constexpr_reassigned_in_static_range():
    results = {r["case"]: r for r in compile_sm90(HERE / "sm90_planted.py")}
    bad, good = results["planted/constexpr_reassigned"], results["planted/constexpr_once"]
    assert good["ok"], good["error"]
    assert good["compiled"] == ["sm90_planted.constexpr_once[N=64; warps=4, stages=3, pointers=i32]"]
    assert not bad["ok"] and bad["compiled"] == []
    # Rejected by Triton's code generator, at the planted line, for the reassignment.
    assert bad["error"].startswith("triton.compiler.errors.CompilationError")
    assert "SHIFT: tl.constexpr = 4 * r" in bad["error"]
    assert "constexpr cannot be reassigned" in bad["error"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="shows what Triton's interpreter accepts")
def test_the_interpreter_runs_the_planted_kernel():
    """The planted kernel is wrong only for the compiler: interpreted, it computes what the correct one does."""
    import torch

    from . import sm90_planted as planted

    x = torch.arange(planted.N, dtype=torch.int32) * 37
    expected = (x & 15) + ((x >> 4) & 15)
    assert torch.equal(planted.launch(planted.constexpr_reassigned, x), expected)
    assert torch.equal(planted.launch(planted.constexpr_once, x), expected)
