"""Engine arguments: one definition, as keyword arguments and as vLLM's command-line flags."""

import argparse
import dataclasses
import logging

import pytest

from vllm import AsyncEngineArgs, EngineArgs
from vllm.platforms.cpu import CpuPlatform

# The Gaudi fork's README command for benchmark_throughput.py, minus the benchmark's own flags.
GAUDI_README_FLAGS = ("--model /models/Meta-Llama-3-8B-Instruct/ --trust-remote-code --enforce-eager "
                      "--max-num-batched-tokens 4096 --max-num-seqs 128 --enable-chunked-prefill")


def parse(flags: str, cls=EngineArgs):
    parser = cls.add_cli_args(argparse.ArgumentParser())
    return cls.from_cli_args(parser.parse_args(flags.split()))


def test_no_flags_give_the_dataclass_defaults():
    assert parse("") == EngineArgs()
    assert parse("", AsyncEngineArgs) == AsyncEngineArgs()


def test_gaudi_readme_flags():
    args = parse(GAUDI_README_FLAGS)
    assert args == EngineArgs(model="/models/Meta-Llama-3-8B-Instruct/", trust_remote_code=True,
                              enforce_eager=True, max_num_batched_tokens=4096, max_num_seqs=128,
                              enable_chunked_prefill=True)


def test_every_field_has_a_flag_with_help():
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    flags = {}
    for action in parser._actions:
        flags.setdefault(action.dest, action)  # the field's own flag, before any alias flag
    for f in dataclasses.fields(AsyncEngineArgs):
        assert f.name in flags, f.name
        assert flags[f.name].help, f"{f.name} has no help"
        assert f"--{f.name.replace('_', '-')}" in flags[f.name].option_strings


@pytest.mark.parametrize("flags,field,value", [
    ("--no-enable-chunked-prefill", "enable_chunked_prefill", False),
    ("--no-enforce-eager", "enforce_eager", False),
    ("--enforce-eager", "enforce_eager", True),
    ("--disable-log-stats", "disable_log_stats", True),
    ("--max-model-len 4096", "max_model_len", 4096),
    ("--gpu-memory-utilization 0.5", "gpu_memory_utilization", 0.5),
    ("--swap-space 0", "swap_space", 0.0),
    ("--dtype bfloat16", "dtype", "bfloat16"),
    ("-tp 1", "tensor_parallel_size", 1),
    ("--long-prefill-token-threshold 2048", "long_prefill_token_threshold", 2048),
    ("--max-long-partial-prefills 2", "max_long_partial_prefills", 2),
    ("--max-step-latency-ms 75.5", "max_step_latency_ms", 75.5),
    ("", "max_step_latency_ms", None),
])
def test_flag_values(flags, field, value):
    assert getattr(parse(flags), field) == value


def test_bad_flag_values_are_refused_by_the_parser(capsys):
    for flags in ("--dtype int8", "--max-num-seqs many", "--enable-chunked-prefill false"):
        with pytest.raises(SystemExit):
            parse(flags)


def test_async_engine_args():
    assert parse("--enable-log-requests", AsyncEngineArgs).enable_log_requests
    assert not parse("--disable-log-requests", AsyncEngineArgs).enable_log_requests
    only = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser(), async_args_only=True)
    assert {a.dest for a in only._actions} == {"help", "enable_log_requests"}


@pytest.mark.parametrize("field,value", [("quantization", "awq")])
def test_settings_of_features_not_built_are_refused_by_name(tiny_checkpoints, field, value):
    args = EngineArgs(model=tiny_checkpoints["llama"], **{field: value})
    with pytest.raises(ValueError, match=f"{field}=.*not supported yet"):
        args.create_engine_config(CpuPlatform())


def test_neutral_settings_are_accepted(tiny_checkpoints):
    args = EngineArgs(model=tiny_checkpoints["llama"], tensor_parallel_size=1, pipeline_parallel_size=1,
                      data_parallel_size=1, distributed_executor_backend=None, quantization=None,
                      disable_log_stats=True)
    config, _, _ = args.create_engine_config(CpuPlatform())
    assert config.disable_log_stats


def test_settings_that_do_not_apply_on_cpu_are_logged(tiny_checkpoints, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # to caplog's handler
    args = EngineArgs(model=tiny_checkpoints["llama"], gpu_memory_utilization=0.5, swap_space=8)
    with caplog.at_level(logging.INFO, logger="vllm.engine.arg_utils"):
        args.create_engine_config(CpuPlatform())
    text = caplog.text
    assert "gpu_memory_utilization=0.5 does not apply on cpu" in text
    assert "swap_space=8 does not apply" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.engine.arg_utils"):
        EngineArgs(model=tiny_checkpoints["llama"]).create_engine_config(CpuPlatform())
    assert "does not apply" not in caplog.text  # defaults say nothing


@pytest.mark.parametrize("field,value", [("gpu_memory_utilization", 0.0),
                                         ("gpu_memory_utilization", 1.5), ("swap_space", -1),
                                         # 0 is a value, refused, not "unset": None means the default
                                         ("max_num_seqs", 0), ("max_model_len", 0),
                                         ("kv_cache_memory_bytes", 0), ("max_num_batched_tokens", 0)])
def test_out_of_range_values(tiny_checkpoints, field, value):
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=tiny_checkpoints["llama"], **{field: value}).create_engine_config(CpuPlatform())


@pytest.mark.parametrize("model,quantization", [("llama", None), ("llama", "int8"), ("smollm2", "gguf")])
def test_auto_dtype_follows_the_cpu_and_the_weights(tiny_checkpoints, model, quantization):
    """bf16 where the CPU has native bf16 dot products; else float32, but for a GGUF file whose
    types (SmolLM2's Q4_1 and Q8_0) the int8 GEMM built here decodes, as this machine's kernels
    promise."""
    import torch

    from tests.utils import smollm2_path
    from vllm.model_executor.layers.quantization import cpu_gguf_gemv
    from vllm.platforms.cpu import cpu_has_native_bf16_dot

    path = smollm2_path() if model == "smollm2" else tiny_checkpoints[model]
    gemm_takes_smollm2 = cpu_gguf_gemv.gemm_takes(3) and cpu_gguf_gemv.gemm_takes(8)  # Q4_1, Q8_0
    bf16 = cpu_has_native_bf16_dot() or (quantization == "gguf" and gemm_takes_smollm2)
    config, _, _ = EngineArgs(model=path, quantization=quantization).create_engine_config(CpuPlatform())
    assert config.model.dtype == (torch.bfloat16 if bf16 else torch.float32)
    explicit, _, _ = EngineArgs(model=path, quantization=quantization,
                                dtype="float32").create_engine_config(CpuPlatform())
    assert explicit.model.dtype == torch.float32
