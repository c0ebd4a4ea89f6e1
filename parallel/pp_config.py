"""`[parallel.pipeline]`, pipeline parallel's settings, and the facts of each schedule they name:
a leaf module (configs only), so that parallel/dims.py can nest it in ParallelConfig without an
import cycle through the planner. The arithmetic is parallel/pp_plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from configs import ConfigError

Schedule = Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"]

# Stages per rank each schedule runs (None: any number >= 2), and how stages map to ranks:
# "loop" puts stage s on rank s % pp, "v" puts stages r and 2 pp - 1 - r on rank r.
SCHEDULES: dict[str, tuple[int | None, str]] = {
    "1f1b": (1, "loop"),
    "gpipe": (1, "loop"),
    "interleaved_1f1b": (None, "loop"),
    "zbv": (2, "v"),
    "dualpipev": (2, "v"),
}
# The zero-bubble schedules split backward into input and weight gradients by walking the
# autograd graph, which a compiled block hides (torch refuses OptimizedModule stages).
ZERO_BUBBLE = ("zbv", "dualpipev")


@dataclass
class PipelineConfig:
    """`[parallel.pipeline]`: how parallel.pp > 1 runs its stages (docs/parallelism.md)."""

    schedule: Schedule = "1f1b"
    """'1f1b' (one stage per rank), 'gpipe' (all forwards, then all backwards), or, with
    stages_per_rank > 1, 'interleaved_1f1b' (Megatron's virtual stages), 'zbv' (zero-bubble
    V: backward split into input and weight gradients to fill the bubble) or 'dualpipev'
    (DeepSeek's DualPipe cut in half); the last two hold 2 stages per rank in a V."""
    stages_per_rank: int = 0
    """Virtual stages per rank (0: the schedule's own: 1, or 2 for the others). The model is
    cut into pp x stages_per_rank stages."""
    microbatches: int = 0
    """Micro-batches per step through the pipeline: the step's own, so the loss does not depend
    on pp (0: train.global_batch_size / (train.micro_batch_size x data-parallel ranks); when
    set, it must equal that)."""
    split: list[int] = field(default_factory=list)
    """Blocks per stage in order, e.g. [9, 10, 10, 9] (empty: balanced by the planner's cost
    of each block, the output projection and loss counted on the last stage)."""

    def __post_init__(self) -> None:
        if self.stages_per_rank < 0 or self.microbatches < 0 or any(n < 1 for n in self.split):
            raise ConfigError(
                "parallel.pipeline: stages_per_rank and microbatches must be >= 0, and every "
                f"entry of split >= 1 (got {self.stages_per_rank}, {self.microbatches}, "
                f"{self.split})"
            )

    def local_stages(self) -> int:
        """Stages per rank, the schedule's own when not set."""
        fixed, _ = SCHEDULES[self.schedule]
        return self.stages_per_rank or fixed or 2


def stage_ranks(pp: int, stages_per_rank: int, schedule: Schedule) -> list[int]:
    """The pp rank of each stage, in stage order."""
    n = pp * stages_per_rank
    if SCHEDULES[schedule][1] == "v":
        return [s if s < pp else n - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]
