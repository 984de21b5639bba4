"""Token-budget, length-bucketed batch sampler; ESM's ``get_batch_indices`` made DDP-aware.

Protein lengths span 10 to 30,000 residues, so fixed-size batches either waste most of their
compute on padding or run out of memory on the long tail. Sorting by length and packing each
batch up to a budget of ``batch_size * max_len_in_batch`` padded tokens keeps both memory and
padding bounded.

With Lightning, pass ``use_distributed_sampler=False`` to the ``Trainer`` (the project's trainer
config does): otherwise Lightning tries to swap this sampler for a ``DistributedSampler``.
Lightning calls ``set_epoch`` at the start of every epoch (train and validation) on
``dataloader.sampler`` and ``dataloader.batch_sampler.sampler``, never on the batch sampler
itself, so :attr:`TokenBudgetBatchSampler.sampler` is a small hook that forwards it: that is all
this sampler needs to reshuffle each epoch and to resume (from the restored epoch) identically.

Mid-epoch resumption: because an epoch's batches are a pure function of ``(seed, epoch)``, skipping
the first ``k`` of them (:attr:`TokenBudgetBatchSampler.start_batch`) continues an interrupted
epoch exactly; :class:`protein_performer.data.loader.ResumableDataLoader` records ``k`` in
Lightning's checkpoints and sets it on resume.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch.distributed as dist

from protein_performer.errors import UserError


class _EpochHook:
    """Stands where Lightning looks for ``batch_sampler.sampler.set_epoch``; forwards the call."""

    def __init__(self, owner: TokenBudgetBatchSampler) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class TokenBudgetBatchSampler:
    """Yield lists of dataset indices whose padded size stays within ``max_tokens``.

    ``lengths[i]`` is the row width item ``i`` will have in the batch (residues + specials,
    already capped at ``max_len``: ``ProteinDataset.model_lengths()``). Per epoch:

    1. sort indices into length buckets of ``bucket_width`` tokens (length rounded up to a
       multiple); within a bucket the order is random when ``shuffle``, so the records sharing a
       batch change every epoch (with exact lengths they would almost never change), and by
       exact length otherwise;
    2. pack greedily: a batch grows while ``(n + 1) * longest <= max_tokens`` and
       ``n + 1 <= max_batch_size``, ``longest`` taken as the rounded-up bucket length, so the
       real padded size (at most that) is always within budget; a record longer than
       ``max_tokens`` gets a batch of its own. ``bucket_width=1`` is ESM's exact packing;
    3. with several replicas, make the batch count a multiple of ``num_replicas``: split the
       batches holding the most records in two (both halves still fit the budget) and only if no
       batch can be split (fewer records than replicas) repeat batches from the start, as
       ``DistributedSampler`` pads; ``drop_last`` drops the surplus batches instead;
    4. shuffle the batch order (``shuffle``) and deal batches round-robin to ranks, so ranks get
       disjoint batches and exactly equal counts (unequal counts hang DDP's gradient all-reduce).

    Batch boundaries depend only on the sorted bucket lengths, never on the epoch, so ``len()``
    is the same every epoch; everything is a function of ``(seed, epoch)``, identical on all ranks.
    ``tag_epoch=True`` yields ``(index, epoch)`` pairs instead of ints so ``ProteinDataset`` in a
    persistent worker draws this epoch's crops and masks.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        max_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        tag_epoch: bool = False,
        bucket_width: int = 8,
    ) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if max_batch_size is not None and max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive or None, got {max_batch_size}")
        if bucket_width < 1:
            raise ValueError(f"bucket_width must be >= 1, got {bucket_width}")
        distributed = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        self.lengths = np.asarray(lengths, dtype=np.int32)  # int32: UniRef50-scale RAM
        self.bucket_width = int(bucket_width)
        w = self.bucket_width
        self.buckets = ((self.lengths + (w - 1)) // w * w).astype(np.int32)  # rounded-up length
        self.max_tokens = int(max_tokens)
        self.max_batch_size = max_batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.drop_last = drop_last
        self.tag_epoch = tag_epoch
        self.epoch = 0
        #: Iterations start at this rank's batch ``start_batch`` of the epoch (mid-epoch resume);
        #: read when ``iter()`` is called, so set it just before and reset it just after.
        self.start_batch = 0
        self._sizes = self._batch_sizes()  # record counts per batch, in ascending-length order
        self._num_batches_total = self._distributed_count()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @property
    def sampler(self) -> _EpochHook:
        """Lightning's ``set_epoch`` entry point (see the module docstring)."""
        return _EpochHook(self)

    def _batch_sizes(self) -> list[int]:
        """Greedy packing of the sorted bucket lengths -> number of records in each batch.

        Works per distinct bucket length (a few hundred) rather than per record, so a 60M-record
        corpus packs in well under a second; the result equals record-by-record greedy packing.
        """
        sizes: list[int] = []
        cap = self.max_batch_size or max(len(self.buckets), 1)
        n = 0  # records in the open batch, all no longer than the current bucket length
        values, counts = np.unique(self.buckets, return_counts=True)
        for m, c in zip(values.tolist(), counts.tolist(), strict=True):
            k = max(1, min(self.max_tokens // max(m, 1), cap))  # batch size at this length
            if n >= k:  # the open batch cannot take a record this long
                sizes.append(n)
                n = 0
            take = min(k - n, c)
            n += take
            c -= take
            if c:
                sizes.append(n)
                full, n = divmod(c, k)
                sizes.extend([k] * full)
        if n:
            sizes.append(n)
        return self._split_for_replicas(sizes)

    def _split_for_replicas(self, sizes: list[int]) -> list[int]:
        """Split the fullest batches until the count divides evenly among replicas."""
        R = self.num_replicas
        if R == 1 or self.drop_last:
            return sizes
        for _ in range((-len(sizes)) % R):
            j = int(np.argmax(sizes)) if sizes else 0
            if not sizes or sizes[j] < 2:
                break  # nothing left to split: the remainder is padded by repetition
            half = sizes[j] // 2
            sizes[j : j + 1] = [sizes[j] - half, half]
        return sizes

    def _distributed_count(self) -> int:
        """Total batches over all ranks after dropping or padding to a multiple of replicas."""
        n, R = len(self._sizes), self.num_replicas
        if self.drop_last:
            return (n // R) * R
        return max(-(-n // R) * R, R if n else 0)

    def _global_batches(self) -> list[np.ndarray]:
        """All ranks' batches for this epoch, in the order they are dealt out."""
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.shuffle:
            perm = rng.permutation(len(self.lengths))
            order = perm[np.argsort(self.buckets[perm], kind="stable")]
        else:
            order = np.argsort(self.lengths, kind="stable")
        bounds = np.cumsum([0, *self._sizes])
        batches = [order[bounds[k] : bounds[k + 1]] for k in range(len(self._sizes))]
        if self.shuffle:
            batches = [batches[k] for k in rng.permutation(len(batches))]
        total = self._num_batches_total
        if total <= len(batches):
            return batches[:total]
        # Padding by repetition (only when no batch could be split): some records repeat.
        return [batches[k % len(batches)] for k in range(total)]

    def __iter__(self) -> Iterator[list[int] | list[tuple[int, int]]]:
        # ``start_batch`` is bound now; the epoch is read at the first ``next()`` (after
        # Lightning's ``set_epoch`` even if the loader called ``iter()`` before it).
        return self._batches(int(self.start_batch))

    def _batches(self, start: int) -> Iterator[list[int] | list[tuple[int, int]]]:
        if start < 0:
            raise ValueError(f"start_batch must be >= 0, got {start}")
        for batch in self._global_batches()[self.rank :: self.num_replicas][start:]:
            if self.tag_epoch:
                yield [(int(i), self.epoch) for i in batch]
            else:
                yield batch.tolist()

    def __len__(self) -> int:
        return self._num_batches_total // self.num_replicas


def budget_batches(lengths: Sequence[int], toks_per_batch: int) -> list[list[int]]:
    """Indices grouped so each batch's padded size ``n * max_width`` stays under the budget.

    Longest first, so an out-of-memory failure happens at the start rather than after an hour.
    A single item wider than the budget gets a batch of its own and is never truncated: the
    budget bounds batching, not sequence length.
    """
    if toks_per_batch <= 0:
        raise UserError(f"--toks-per-batch must be positive, got {toks_per_batch}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        w = int(lengths[i])
        new_width = max(width, w)
        if current and new_width * (len(current) + 1) > toks_per_batch:
            batches.append(current)
            current, new_width = [], w
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    return batches
