"""--max-nonfinite-skips: stop a run whose optimizer steps keep being skipped for a non-finite gradient.

finish_step skips the update when the global gradient norm is NaN/inf (one bad batch should not
poison the weights), but a run where every step is skipped (NaN weights, --lr inf, an overflow
in the loss) would otherwise finish with exit 0 and nothing learned. The guard counts skipped
steps in a row, from what each train_step reports: a train_step (one rollout's, or one SFT
batch's, optimizer steps) with any applied step resets the count, one with every step skipped
adds them. Deviation: miles has no such stop.
"""
from __future__ import annotations

from dataclasses import dataclass


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row were skipped for a non-finite gradient norm."""


@dataclass
class NonFiniteGuard:
    max_skips: int              # --max-nonfinite-skips; 0: never stop
    num_in_a_row: int = 0       # skipped steps since the last applied one

    def observe(self, num_steps: int, num_skipped: int, where: str) -> None:
        self.num_in_a_row = self.num_in_a_row + num_skipped if num_skipped == num_steps else 0
        if self.max_skips and self.num_in_a_row >= self.max_skips:
            raise NonFiniteError(
                f"--max-nonfinite-skips: {self.num_in_a_row} optimizer steps in a row skipped for a non-finite "
                f"gradient norm (last at {where}); check the weights, --lr, --adam-eps and the rewards")
