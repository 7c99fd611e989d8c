"""Which worker is which: world = pp × tp workers, rank = stage · tp + tp_rank.

Plain Python, apart from pp_runtime/comm.py (torch.distributed), so that a Ray deployment's
driver, which places and watches the workers but never touches a tensor, does not import torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    pp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.tp)

    def tp_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, r) for r in range(self.tp)]
