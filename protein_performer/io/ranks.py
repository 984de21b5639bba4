"""This process's place in a job: its rank among the ranks ``torchrun`` or SLURM started, one
process otherwise. Read by the output policy (:mod:`protein_performer.io.outputs`: rank 0 holds
an output's lock for the job) and by the sharded runs (:mod:`protein_performer.io.sharding`),
which therefore need not import each other for it; torch-free, like the output policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def device(self, device: str) -> str:
        """``auto``/``cuda`` -> this rank's own GPU when several ranks share a node."""
        import torch  # on first use: claiming an output (io.outputs) stays torch-free

        if self.distributed and device in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return device


def detect_ranks() -> Ranks:
    """Ranks from ``torchrun`` or SLURM; one process otherwise.

    Under SLURM the main address and port come from Lightning's ``SLURMEnvironment`` (the first
    node of the allocation), so ``srun protein-performer embed ...`` needs no launcher script.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return Ranks(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        from lightning_fabric.plugins.environments import SLURMEnvironment

        env = SLURMEnvironment()
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        return Ranks(env.global_rank(), env.world_size(), env.local_rank())
    return Ranks()


def rank_label(what: str) -> str:
    """``what``, or ``what[rank R/N]`` in a sharded job (progress lines of several ranks)."""
    r = detect_ranks()
    return f"{what}[rank {r.rank}/{r.world_size}]" if r.distributed else what
