"""What graph capture cost and how well the buckets fit, as the engine reports it."""

from dataclasses import dataclass, field


@dataclass
class GraphStats:
    enabled: bool = False
    buckets: list[int] = field(default_factory=list)
    graphs_compiled_at_warmup: int = 0
    warmup_seconds: float = 0.0
    compiles_after_warmup: int = 0   # must stay 0: every step should hit a warmed bucket
    unwarmed_steps: int = 0          # steps too large for any bucket, run eagerly
    fused_decode_steps: int = 0      # steps of only decodes run by the C layers, no graph needed
    real_tokens: int = 0
    padded_tokens: int = 0           # padding added on top of the real tokens

    @property
    def padding_overhead(self) -> float:
        """Padded tokens per real token (0.0 = no padding)."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0
