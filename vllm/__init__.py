"""A chunked-prefill (SARATHI) inference engine shaped like vLLM's Gaudi branch."""

from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.engine.llm_engine import LLMEngine
from vllm.entrypoints.llm import LLM
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TextPrompt", "TokensPrompt"]
__all__ += ["AsyncLLMEngine", "AsyncEngineArgs"]
__version__ = "0.1.0"
