"""The C kernels (vllm/csrc/cpu/), and the benchmarks' C measurements beside them, compile without
a warning under -Wall -Wextra, for every instruction set they have code for, whatever this
machine has: each target below selects other #if branches of the sources (AVX2 only, AVX-512,
AVX512-BF16 and VNNI without AMX, AMX, and the AMX copies over the C emulation of the tile
instructions). Only the compiler runs, at -O0 into
/dev/null: nothing is executed, so a target need not be this CPU's, and code generation still
refuses an intrinsic used outside the #if of its instruction set."""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm.platforms.c_build import BUILD_FLAGS, KERNEL_SOURCES

TARGETS = {
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512-bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    "amx": ["-march=sapphirerapids"],
    "amx-emulated": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-DVLLM_EMULATE_AMX"],
}
SOURCES = sorted(KERNEL_SOURCES.glob("*.c")) + sorted((Path(__file__).parents[1] / "benchmarks").glob("*.c"))
COMPILER = shutil.which("cc")

pytestmark = pytest.mark.skipif(COMPILER is None or platform.machine() != "x86_64",
                                reason="needs a C compiler for x86-64")


def _knows(target: list[str]) -> bool:
    """Whether the compiler takes the target's flags (an older one may not know a CPU's name)."""
    return subprocess.run([COMPILER, *target, "-E", "-x", "c", "-"], input="", capture_output=True,
                          text=True).returncode == 0


@pytest.mark.parametrize("target", TARGETS)
def test_the_kernels_compile_without_warnings(target):
    if not _knows(TARGETS[target]):
        pytest.skip(f"{COMPILER} does not take {TARGETS[target]}")
    names = {path.name for path in SOURCES}
    assert {"cpu_gguf_gemv.c", "cpu_paged_decode.c", "llama_cpu_layers.c", "gemv_bandwidth.c"} <= names, names
    flags = [f for f in BUILD_FLAGS if f != "-shared"] + TARGETS[target]
    failures = {}
    for path in SOURCES:
        result = subprocess.run([COMPILER, *flags, "-O0", "-Wall", "-Wextra", "-Werror", "-c", "-o", os.devnull,
                                 str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            failures[path.name] = result.stderr
    assert not failures, "\n".join(f"{name}:\n{err}" for name, err in failures.items())
