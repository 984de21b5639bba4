"""A train DataLoader whose position in the epoch survives a checkpoint (mid-epoch resume).

:class:`ResumableDataLoader` keeps ``{epoch, batches_yielded}``: the number of batches its
iterator has *handed to the caller* this epoch (batches prefetched by worker processes are not
counted), and on resume makes the :class:`TokenBudgetBatchSampler` start at batch ``k`` of that
epoch. The batch order depends only on ``(seed, epoch)`` and items on ``(seed, epoch, index)``,
so the continued epoch is exactly the rest of the interrupted one; a position at the end of an
epoch resumes with the next epoch, whole.

What it relies on from Lightning is public and documented: a train loader with ``state_dict`` /
``load_state_dict`` is a resumable ("stateful") loader, whose state Lightning checkpoints and
restores, and whose fit loop then asks for only the rest of the epoch; ``set_epoch`` reaches the
sampler at every epoch start. It does not rely on *when* Lightning calls these: the loaded
position is applied at the first ``next()`` of the iteration whose epoch it belongs to (``iter()``
is lazy: the sampler, and any worker prefetching, starts at the first ``next()``), so any order
of ``load_state_dict``, ``iter()`` and ``set_epoch`` gives the same batches, and loading the same
state twice is harmless. ``ProteinDataModule`` also carries the position through its own
``state_dict`` / ``load_state_dict`` hooks, because Lightning drops a restored loader state when
the train loader was built before the restore (``trainer.estimated_stepping_batches`` in
``configure_optimizers``: Lightning-AI/pytorch-lightning#20550).

Under DDP every rank yields the same number of batches per epoch, so rank 0's state (the one in
the checkpoint) is every rank's; each rank skips its own first ``k`` batches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from protein_performer.data.sampler import TokenBudgetBatchSampler

log = logging.getLogger(__name__)


class ResumableDataLoader(DataLoader):
    """``DataLoader`` over a :class:`TokenBudgetBatchSampler` with ``state_dict`` /
    ``load_state_dict`` for Lightning's mid-epoch resumption (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Its own generator for the workers' base seed: drawn from the global one, each epoch's
        # first batch would shift the dropout stream of a run resumed at an epoch's end.
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(*args, **kwargs)
        if not isinstance(self.batch_sampler, TokenBudgetBatchSampler):
            raise TypeError(
                "ResumableDataLoader needs batch_sampler=TokenBudgetBatchSampler, got "
                f"{type(self.batch_sampler).__name__}"
            )
        self._epoch = self.batch_sampler.epoch  # epoch of the current (or last) iteration
        self._yielded = 0  # batches handed out by that iteration
        self._resume: dict[str, int] | None = None  # loaded state, applied at the next iter

    @property
    def token_sampler(self) -> TokenBudgetBatchSampler:
        assert isinstance(self.batch_sampler, TokenBudgetBatchSampler)
        return self.batch_sampler

    def state_dict(self) -> dict[str, int]:
        """Where this rank is: ``epoch`` and ``batches_yielded`` in it (plus sampler facts used
        to check that a resume can be exact)."""
        if self._resume is not None:  # loaded, not yet iterated: pass the position on
            return dict(self._resume)
        sampler = self.token_sampler
        return {
            "epoch": int(self._epoch),
            "batches_yielded": int(self._yielded),
            "num_batches": len(sampler),
            "num_replicas": sampler.num_replicas,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the next iteration of the same epoch.

        Also sets the sampler's epoch, so the loader resumes by itself: the same epoch from a
        mid-epoch position, the next one from the end of an epoch. A ``set_epoch`` that
        follows (Lightning's) gives the same epoch; a different one drops the position.
        """
        epoch = int(state_dict["epoch"])
        skip = int(state_dict["batches_yielded"])
        if skip < 0:
            raise ValueError(f"batches_yielded must be >= 0, got {skip}")
        sampler = self.token_sampler
        expected = (state_dict.get("num_batches"), state_dict.get("num_replicas"))
        if expected != (None, None) and expected != (len(sampler), sampler.num_replicas):
            log.warning(
                "resuming the train loader from a checkpoint of %s batches per rank over %s "
                "ranks, now %d over %d (different data, max_tokens or devices): skipping the "
                "first %d batches of epoch %d is not the exact continuation",
                expected[0],
                expected[1],
                len(sampler),
                sampler.num_replicas,
                skip,
                epoch,
            )
        if skip >= len(sampler) and expected[0] in (None, len(sampler)):
            # A finished epoch: continue with the next one, whole, whether or not a set_epoch
            # follows (Lightning's, for the next epoch, says the same).
            epoch, skip = epoch + 1, 0
        self._resume = {**state_dict, "epoch": epoch, "batches_yielded": skip}
        self._epoch, self._yielded = epoch, skip
        sampler.set_epoch(epoch)

    def _start_batch(self, epoch: int) -> int:
        """Batches to skip in ``epoch``: the loaded position if it is this epoch's, else 0."""
        resume, self._resume = self._resume, None
        if resume is None:
            return 0
        if resume["epoch"] != epoch:
            log.debug("loader state of epoch %d not used in epoch %d", resume["epoch"], epoch)
            return 0
        return min(resume["batches_yielded"], len(self.token_sampler))

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # Runs at the first next(), after any set_epoch (see the module docstring).
        sampler = self.token_sampler
        epoch = sampler.epoch
        start = self._start_batch(epoch)
        self._epoch, self._yielded = epoch, start
        sampler.start_batch = start  # bound by every iter(sampler) inside super().__iter__()
        try:
            batches = super().__iter__()
        finally:
            sampler.start_batch = 0
        for batch in batches:
            self._yielded += 1  # counted before the caller gets it: a checkpoint includes it
            yield batch
