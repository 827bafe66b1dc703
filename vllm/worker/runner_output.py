"""What the model runner hands back to the engine after one step."""

from dataclasses import dataclass, field

from vllm.model_executor.layers.logprobs import TokenLogprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens, keyed by request id (forked samples included), and their logprobs.

    `forward_seconds`: the step's wall time in the model, from its forward pass until its logits
    are on the host (or the forward pass returned, in a step that samples nothing): the weights'
    products and attention, without preparing the inputs or sampling.

    `prompt_logprobs[request_id]` = (first prompt position, one entry per position from there):
    entry i holds the logprob of prompt token `first + i + 1`, as predicted at `first + i`.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    forward_seconds: float = 0.0
