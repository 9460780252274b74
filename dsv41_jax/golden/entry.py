"""One golden-check result row, and the replay threshold the check and the DSpark entries share."""
from __future__ import annotations

import dataclasses

REPLAY_ULPS = 2  # single-layer replays and DSpark traced tensors: within 2 bf16 ulps (tests/README.md)


@dataclasses.dataclass
class Entry:
    name: str
    passed: bool
    max_abs_err: float | None = None
    mean_abs_err: float | None = None
    argmax_agreement: float | None = None
    forced_decisions: bool = False
    topk_sets_equal: bool | None = None
    detail: str = ""
    mechanisms: tuple[str, ...] = ()  # what the case exercised (golden/mechanisms.py)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
