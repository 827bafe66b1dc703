"""The package as `pip install .` builds it: a wheel of this checkout carries every C kernel source
and header, since the kernels are compiled from the installed copy on first use."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm.platforms.c_build import KERNEL_SOURCES

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_every_kernel_source_and_header(tmp_path):
    # Built from a copy, so the checkout gets no build/ or egg-info of the test's making.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "vllm", source / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("vllm-*.whl")
    prefix = KERNEL_SOURCES.relative_to(ROOT).as_posix() + "/"
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name.removeprefix(prefix) for name in archive.namelist() if name.startswith(prefix)}
    kernels = {path.name for path in KERNEL_SOURCES.iterdir() if path.suffix in (".c", ".h")}
    assert kernels and shipped == kernels
