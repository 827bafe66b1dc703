"""Builds a model from a local checkpoint: config, tokenizer and weights."""

import os

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization import int8_weights
from vllm.model_executor.model_loader.gguf_metadata import converted_metadata_dir
from vllm.model_executor.model_loader.gguf_weights import iter_gguf_weights, quantized_type_names
from vllm.model_executor.model_loader.hf_weights import iter_hf_weights
from vllm.model_executor.model_loader.source import ModelSource, resolve_model_source
from vllm.model_executor.models.registry import resolve_model_class

logger = init_logger(__name__)

__all__ = ["ModelSource", "resolve_model_source", "load_hf_config", "load_generation_config",
           "load_tokenizer", "load_model", "model_weight_bytes", "resident_weight_bytes",
           "quantized_type_names"]


def _metadata_location(source: ModelSource, needed_file: str) -> tuple[str, dict]:
    """(directory, from_pretrained kwargs) to read `source`'s config or tokenizer from: for a GGUF
    file, the files converted from its metadata where they hold `needed_file`, else the
    checkpoint itself."""
    if source.gguf_file:
        converted = converted_metadata_dir(source.directory, source.gguf_file)
        if converted is not None and os.path.isfile(os.path.join(converted, needed_file)):
            return converted, {"local_files_only": True}
    return source.directory, source.hf_kwargs()


def load_hf_config(source: ModelSource):
    from transformers import AutoConfig

    try:
        directory, kwargs = _metadata_location(source, "config.json")
        return AutoConfig.from_pretrained(directory, **kwargs)
    except (OSError, KeyError) as e:
        raise ValueError(f"cannot read the model config of {source.display_name}: {e}") from e


def load_generation_config(directory: str, hf_config) -> dict:
    """The values of `directory`'s generation_config.json that differ from transformers'
    defaults; without that file, the generation fields of the model config (its EOS ids), as
    transformers derives them."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:
        config = GenerationConfig.from_model_config(hf_config)
    return config.to_diff_dict()


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        directory, kwargs = _metadata_location(source, "tokenizer_config.json")
        return AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {source.display_name}: {e}") from e


def model_weight_bytes(hf_config, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in `dtype`, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = resolve_model_class(hf_config)(hf_config, max_position=1, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load_model(source: ModelSource, hf_config, dtype: torch.dtype, max_position: int,
               device: torch.device, quantization: str | None = None) -> nn.Module:
    """Instantiates the model class for `hf_config` in `dtype` and fills it from the checkpoint,
    one tensor at a time: host memory peaks at the model in `dtype` plus one checkpoint tensor.
    With quantization="gguf" the GGUF file's quantized matrices stay in their blocks; with
    "int8" each product weight becomes Q8_0 blocks of per-channel scales as it is read (a .gguf
    file's tensors dequantized first). Either way the dense tensors of the weights kept in
    blocks are created but never written (so never resident) before the blocks replace them."""
    model_class = resolve_model_class(hf_config)
    model = model_class(hf_config, max_position=max_position, dtype=dtype)
    if source.gguf_file:
        weights = iter_gguf_weights(os.path.join(source.directory, source.gguf_file),
                                    hf_config.num_attention_heads, hf_config.num_key_value_heads,
                                    keep_quantized=quantization == "gguf")
    else:
        assert quantization in (None, "int8"), "quantization is checked against the checkpoint by EngineArgs"
        weights = iter_hf_weights(source.directory)
    if quantization == "int8":
        weights = int8_weights.quantize_linear_weights(weights, model)
    model.load_weights(weights)
    if quantization == "int8":
        int8_weights.check_quantized(model)
    model = model.to(device=device, dtype=dtype).eval()  # weights of blocks keep their uint8
    logger.info("Model weights: %.1f MiB resident (%s)", resident_weight_bytes(model) / 2**20,
                quantization or "unquantized")
    return model


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters hold in memory (rows of GGUF blocks at their own size)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
