"""Which model class runs which Hugging Face architecture."""

from torch import nn

from vllm.model_executor.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_model_class(hf_config) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures and hf_config.model_type == "llama":
        architectures = ["LlamaForCausalLM"]  # configs read from GGUF metadata name no class
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(f"model architectures {architectures} are not supported; "
                     f"supported: {supported_architectures()}")
