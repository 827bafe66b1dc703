"""Builds the engine's small C kernels for this CPU on first use, and loads them with ctypes.

The kernels' sources and headers are in vllm/csrc/cpu/ (`KERNEL_SOURCES`), shipped with the
package. Each kernel is one C file and the headers it includes (no torch headers, so a build
takes about a second), compiled with the system compiler into VLLM_CACHE_ROOT (default
~/.cache/vllm), once per source, the headers it includes, compiler flags and CPU. Without a
compiler, if the build fails, or with VLLM_CPU_C_KERNELS=0, `load_c_library` returns None and
the caller keeps its torch path.

VLLM_C_SANITIZE=address builds them with AddressSanitizer and UndefinedBehaviorSanitizer instead
(into a cache directory of their own), for tests: the process must then start with the ASan
runtime preloaded (LD_PRELOAD=$(cc -print-file-name=libasan.so)), and the first error aborts it.
VLLM_C_EMULATE=amx builds the kernels' AMX copies over a C emulation of the tile instructions
(csrc/cpu/amx_emulation.h), so that tests run them on a CPU with AVX512-BF16 but no AMX; it may be
combined with VLLM_C_SANITIZE. VLLM_CPU_ISA=avx2 builds them for x86-64-v3 (into
kernels-avx2/), as for an AVX2-only CPU; an AVX2-only CPU builds them for itself, tuned as for
x86-64-v3 (`isa_flags`).
"""

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm.envs import cache_root
from vllm.logger import init_logger
from vllm.platforms.cpu import cpu_flags, cpu_isa

logger = init_logger(__name__)

KERNEL_SOURCES = Path(__file__).parents[1] / "csrc" / "cpu"
# -fopenmp links libgomp, the OpenMP runtime torch's CPU wheels load: the kernels' threads are
# torch's threads (same soname, one runtime in the process).
BUILD_FLAGS = ["-O3", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c11", f"-I{KERNEL_SOURCES}"]


def c_kernels_enabled() -> bool:
    flag = os.environ.get("VLLM_CPU_C_KERNELS", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"VLLM_CPU_C_KERNELS={flag!r} must be 0 or 1")
    return flag == "1"


_SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                   "-g", "-O1"]


def sanitizer_flags() -> list[str]:
    """Extra compiler flags that VLLM_C_SANITIZE asks for (none by default)."""
    mode = os.environ.get("VLLM_C_SANITIZE", "")
    if mode not in ("", "address"):
        raise ValueError(f"VLLM_C_SANITIZE={mode!r} must be empty or 'address'")
    return _SANITIZE_FLAGS if mode else []


def isa_flags() -> list[str]:
    """The target: this CPU, or x86-64-v3 under VLLM_CPU_ISA=avx2 (vllm/platforms/cpu.py). Where
    AVX2 is this CPU's widest vector extension (no AVX-512), its instructions with GCC's generic
    tuning, as VLLM_CPU_ISA=avx2 builds the same AVX2 kernels: tuned for AMD Zen 3 instead, GCC
    spills more of the AVX2 int8 GEMM's registers to the stack, and prefill runs slower
    (benchmarks/results/ab_epyc_zen3_avx2_mtune_generic.json)."""
    if cpu_isa() == "avx2":
        return ["-march=x86-64-v3", "-mtune=generic"]
    flags = cpu_flags()
    if "avx2" in flags and not any(f.startswith("avx512") for f in flags):
        return ["-march=native", "-mtune=generic"]
    return ["-march=native"]


def emulation_flags() -> list[str]:
    """Extra compiler flags that VLLM_C_EMULATE asks for (none by default)."""
    mode = os.environ.get("VLLM_C_EMULATE", "")
    if mode not in ("", "amx"):
        raise ValueError(f"VLLM_C_EMULATE={mode!r} must be empty or 'amx'")
    return ["-DVLLM_EMULATE_AMX"] if mode else []


def _compile(compiler: str, source: Path, library: Path, flags: list[str]) -> str | None:
    """Builds `source` into `library`; returns the compiler's complaint if it fails."""
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: processes building at once never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    result = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        return result.stderr[-2000:] or f"{compiler} exited with status {result.returncode}"
    os.replace(tmp, library)
    return None


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def included_headers(source: Path) -> list[Path]:
    """The quoted headers `source` includes, directly or through other headers, found as the
    compiler finds them: beside the including file, then in KERNEL_SOURCES."""
    found: dict[Path, None] = {}
    pending = [source]
    while pending:
        including = pending.pop()
        for name in _LOCAL_INCLUDE.findall(including.read_bytes()):
            name = name.decode()
            header = next((d / name for d in (including.parent, KERNEL_SOURCES) if (d / name).is_file()), None)
            if header is not None and header not in found:  # a missing one fails the compile itself
                found[header] = None
                pending.append(header)
    return sorted(found)


def build_flags() -> list[str]:
    return BUILD_FLAGS + isa_flags() + sanitizer_flags() + emulation_flags()  # the later -O wins


def library_path(compiler: str, source: Path, flags: list[str]) -> Path:
    """Where the library of `source` built with `flags` is kept: keyed by the source, the headers
    it includes, the compiler and flags, and the CPU."""
    text = source.read_bytes() + b"".join(h.read_bytes() for h in included_headers(source))
    build = " ".join([compiler, *flags, *sorted(cpu_flags())])
    key = hashlib.sha256(text + build.encode()).hexdigest()[:16]
    variant = ("kernels" + ("-" + cpu_isa() if cpu_isa() else "") + ("-sanitized" if sanitizer_flags() else "")
               + ("-amx-emulated" if emulation_flags() else ""))
    return cache_root() / variant / f"{source.stem}_{key}.so"


def build_kernels() -> None:
    """Builds every kernel in KERNEL_SOURCES not built yet, one compiler per core, so that their
    first uses find them built (a first start waits for the longest build rather than the sum).
    A build that fails here fails again, logged, on first use."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if not c_kernels_enabled() or compiler is None:
        return
    flags = build_flags()
    missing = [(source, library) for source in sorted(KERNEL_SOURCES.glob("*.c"))
               if not (library := library_path(compiler, source, flags)).exists()]
    if missing:
        with ThreadPoolExecutor(max_workers=min(len(missing), os.cpu_count() or 1)) as pool:
            list(pool.map(lambda job: _compile(compiler, *job, flags), missing))


def load_c_library(source: Path, fallback: str) -> ctypes.CDLL | None:
    """The built library of `source`, or None (logged, naming `fallback`, the path used instead)."""
    if not c_kernels_enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("No C compiler found for %s: %s", source.name, fallback)
        return None
    flags = build_flags()
    library = library_path(compiler, source, flags)
    try:
        error = None if library.exists() else _compile(compiler, source, library, flags)
        lib = None if error else ctypes.CDLL(str(library))
    except OSError as e:  # cache not writable, library not loadable
        error = str(e)
    if error:
        logger.warning("Building %s failed; %s:\n%s", source.name, fallback, error)
        return None
    return lib


if __name__ == "__main__":
    build_kernels()  # `python -m vllm.platforms.c_build`: this CPU's kernels (and variant), now
