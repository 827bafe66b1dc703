"""vLLM's common engine arguments, as a vLLM user passes them to `LLM(...)`: each is accepted and
takes effect, or is logged as not applying here."""

import logging

import pytest
import torch

from vllm import LLM, SamplingParams

SMALL = dict(max_model_len=128, block_size=16, num_gpu_blocks_override=32)


def _config(llm):
    return llm.llm_engine.config


def _platform(llm):
    return llm.llm_engine.runner.platform


# (keyword arguments, check of the built engine's config) -- the check shows the setting took
# effect; `device` chooses the platform, which the engine's runner holds.
TAKES_EFFECT = {
    "dtype": ({"dtype": "bfloat16"}, lambda c: c.model.dtype == torch.bfloat16),
    "seed": ({"seed": 7}, lambda c: c.model.seed == 7),
    "max_model_len": ({"max_model_len": 96}, lambda c: c.model.max_model_len == 96),
    "block_size": ({"block_size": 32}, lambda c: c.cache.block_size == 32),
    "enable_chunked_prefill": ({"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
                               lambda c: not c.scheduler.enable_chunked_prefill),
    "max_num_batched_tokens": ({"max_num_batched_tokens": 48},
                               lambda c: c.scheduler.max_num_batched_tokens == 48),
    "max_num_seqs": ({"max_num_seqs": 3}, lambda c: c.scheduler.max_num_seqs == 3),
    "max_num_partial_prefills": ({"max_num_partial_prefills": 2},
                                 lambda c: c.scheduler.max_num_partial_prefills == 2),
    "max_long_partial_prefills": ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 2},
                                  lambda c: c.scheduler.max_long_partial_prefills == 2),
    "long_prefill_token_threshold": ({"long_prefill_token_threshold": 8},
                                     lambda c: c.scheduler.long_prefill_token_threshold == 8),
    "max_logprobs": ({"max_logprobs": 3}, lambda c: c.model.max_logprobs == 3),
    "enforce_eager": ({"enforce_eager": True}, lambda c: c.enforce_eager),
    "kv_cache_memory_bytes": ({"kv_cache_memory_bytes": 2**20, "num_gpu_blocks_override": None},
                              lambda c: c.cache.num_blocks == 2**20 // (16 * 512)),
    "num_gpu_blocks_override": ({"num_gpu_blocks_override": 40}, lambda c: c.cache.num_blocks == 40),
    "trust_remote_code": ({"trust_remote_code": True}, lambda c: c.model.trust_remote_code),
    "disable_log_stats": ({"disable_log_stats": False}, lambda c: not c.disable_log_stats),
    "generation_config": ({"generation_config": "vllm"}, lambda c: c.model.generation_config == "vllm"),
    "override_generation_config": ({"override_generation_config": {"max_new_tokens": 4}},
                                   lambda c: c.model.get_diff_sampling_param() == {"max_tokens": 4}),
    # The neutral values of features not built yet (other values raise: test_engine_args.py),
    # and vLLM's default gpu_memory_utilization, as scripts pass them.
    "neutral": ({"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                 "distributed_executor_backend": None, "quantization": None,
                 "gpu_memory_utilization": 0.9}, lambda c: True),
}

# (keyword arguments, what the log says): accepted, and said once not to apply on this CPU engine.
LOGGED = {
    "gpu_memory_utilization": ({"gpu_memory_utilization": 0.5},
                               "gpu_memory_utilization=0.5 does not apply on cpu"),
    "swap_space": ({"swap_space": 16}, "swap_space=16 does not apply"),
    "revision": ({"revision": "main"}, "revision='main' does not apply to the local path"),
    "disable_chunked_mm_input": ({"disable_chunked_mm_input": True},
                                 "disable_chunked_mm_input does not apply"),
}


def _generate_one(llm) -> None:
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("name", list(TAKES_EFFECT))
def test_argument_takes_effect(tiny_checkpoints, name):
    kwargs, check = TAKES_EFFECT[name]
    llm = LLM(tiny_checkpoints["llama"], **{"dtype": "float32", **SMALL, **kwargs})
    assert check(_config(llm)), name
    _generate_one(llm)


def test_device_chooses_the_platform(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], device="cpu", dtype="float32", **SMALL)
    assert _platform(llm).device_type == "cpu"
    _generate_one(llm)


@pytest.mark.parametrize("name", list(LOGGED))
def test_argument_logged_as_not_applying(tiny_checkpoints, caplog, monkeypatch, name):
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # to caplog's handler
    kwargs, message = LOGGED[name]
    with caplog.at_level(logging.INFO):
        llm = LLM(tiny_checkpoints["llama"], **{"dtype": "float32", **SMALL, **kwargs})
    assert message in caplog.text, caplog.text
    _generate_one(llm)


def test_download_dir_is_accepted_for_a_local_model(tiny_checkpoints, tmp_path):
    # It names the cache that holds hub ids (tests/test_model_sources.py); a path needs none.
    _generate_one(LLM(tiny_checkpoints["llama"], download_dir=str(tmp_path), dtype="float32", **SMALL))
