"""What graph capture cost and how well the buckets fit, as the engine reports it."""

from dataclasses import dataclass, field

from vllm.compilation.regions import RegionStats


@dataclass
class GraphStats:
    """Graphs come from two counters: dynamo's (the whole-model graph a CPU compiles once) and
    the platform's regions (what a device graph runtime compiles: one graph per distinct input
    signature of each captured region, vllm/compilation/regions.py)."""

    enabled: bool = False
    buckets: list[int] = field(default_factory=list)
    region_stats: RegionStats = field(default_factory=RegionStats)
    dynamo_graphs_at_warmup: int = 0
    device_graphs: dict[str, int] = field(default_factory=dict)  # per region, at warm-up
    warmup_seconds: float = 0.0
    dynamo_compiles_after_warmup: int = 0
    unwarmed_steps: int = 0          # steps too large for any bucket, run eagerly
    eager_steps: int = 0             # steps the attention backend ran outside the graphs
    real_tokens: int = 0
    padded_tokens: int = 0           # padding added on top of the real tokens

    @property
    def graphs_compiled_at_warmup(self) -> int:
        """Device graphs where the platform captures regions, else dynamo's graphs."""
        return sum(self.device_graphs.values()) or self.dynamo_graphs_at_warmup

    @property
    def compiles_after_warmup(self) -> int:
        """Must stay 0: every step should hit warmed shapes."""
        return self.dynamo_compiles_after_warmup + sum(self.region_stats.unwarmed.values())

    @property
    def padding_overhead(self) -> float:
        """Padded tokens per real token (0.0 = no padding)."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0
