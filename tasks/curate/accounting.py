"""Per-stage accounting: rows in = rows kept + rows removed (by reason), and decision rows."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import polars as pl

from data_specs import get_spec


@dataclass
class StageCount:
    stage: str
    rows_in: int = 0
    kept: int = 0
    removed: Counter = field(default_factory=Counter)   # reason -> rows
    rewritten: int = 0                                   # kept rows a rule changed

    @property
    def removed_total(self) -> int:
        return sum(self.removed.values())

    @property
    def balanced(self) -> bool:
        return self.rows_in == self.kept + self.removed_total

    def check(self) -> StageCount:
        if not self.balanced:
            raise RuntimeError(f"{self.stage}: accounting broken: {self.rows_in} in != "
                               f"{self.kept} kept + {self.removed_total} removed {dict(self.removed)}")
        return self

    def counters(self) -> dict[str, float]:
        out = {"rows_in": self.rows_in, "kept": self.kept, "removed": self.removed_total,
               "rewritten": self.rewritten}
        out.update({f"removed.{reason.replace(':', '.')}": n for reason, n in self.removed.items()})
        return out


class DecisionLog:
    """Collects decision rows for one curate run; one frame at the end."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._rows: list[dict] = []

    def add(self, row_id: str, stage: str, reason: str, reference_id: str | None = None,
            score: float | None = None, rewritten: bool = False) -> None:
        """A removed row (with the kept row or benchmark item it matched), or a kept row a rule rewrote."""
        self._rows.append({"row_id": row_id, "stage": stage, "decision": "rewritten" if rewritten else "removed",
                           "reason": reason, "reference_id": reference_id,
                           "score": None if score is None else float(score), "run_id": self.run_id})

    def frame(self) -> pl.DataFrame:
        spec = get_spec("decisions")
        return pl.DataFrame(self._rows, schema=spec.schema) if self._rows else spec.empty()

    def __len__(self) -> int:
        return len(self._rows)
