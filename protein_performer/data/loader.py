"""A train DataLoader whose position in the epoch survives a checkpoint (mid-epoch resume).

Lightning 2.x saves ``state_dict()`` of every train dataloader that has ``state_dict`` and
``load_state_dict`` (``_Stateful``) under the fit loop's ``combined_loader`` key, and on a
restart calls ``load_state_dict`` in ``FitLoop.setup_data`` *before* the first ``iter()`` and
before ``set_epoch`` (``FitLoop.on_advance_start``). It also restores its own batch counters, so
it expects the loader to continue where the checkpoint left it: after ``k`` batches of an epoch
it asks for only ``len(loader) - k`` more.

:class:`ResumableDataLoader` therefore keeps ``{epoch, batches_yielded}``: the number of batches
its iterator has *handed to the caller* this epoch (batches prefetched by worker processes are
not counted), and on resume makes the :class:`TokenBudgetBatchSampler` start at batch ``k``
of that epoch. The batch order depends only on ``(seed, epoch)`` and items on
``(seed, epoch, index)``, so the continued epoch is exactly the rest of the interrupted one.

``iter()`` is lazy: the sampler (and any worker prefetching) starts at the first ``next()``, so
the epoch Lightning sets after its first ``iter()`` is the one used (without this, a resumed
run with ``num_workers > 0`` would prefetch epoch 0's batches for the restored epoch).

Under DDP every rank yields the same number of batches per epoch, so rank 0's state (the one in
the checkpoint) is every rank's; each rank skips its own first ``k`` batches.

Lightning drops the restored loader state when the train loader was built before the restore
(``trainer.estimated_stepping_batches`` in ``configure_optimizers``: Lightning-AI/pytorch-lightning
#20550), so ``ProteinDataModule`` also checkpoints this state and hands it to the loader.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from protein_performer.data.sampler import TokenBudgetBatchSampler

log = logging.getLogger(__name__)


class ResumableDataLoader(DataLoader):
    """``DataLoader`` over a :class:`TokenBudgetBatchSampler` with ``state_dict`` /
    ``load_state_dict`` for Lightning's mid-epoch resumption (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
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

        Also sets the sampler's epoch, so the loader resumes by itself; under Lightning the
        ``set_epoch`` that follows gives the same epoch when the checkpoint was taken mid-epoch,
        and the next epoch (the skip then no longer applies) when it was taken at the epoch end.
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
        # Runs at the first next(): after Lightning's set_epoch (see the module docstring).
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
