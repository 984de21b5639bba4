"""LightningDataModule: a store or FASTA path in, length-bucketed token-budget loaders out.

Configured from Hydra (``conf/data/*.yaml``). The train loader's sampler gets ``set_epoch`` from
Lightning at every epoch start (the trainer runs with ``use_distributed_sampler=False`` so
Lightning keeps our sampler) and tags indices with the epoch, so crops, masks and batch order are
functions of ``(seed, epoch, index)``: a resumed run sees the same data as an uninterrupted one,
with or without persistent workers. The train loader is a
:class:`~protein_performer.data.loader.ResumableDataLoader`: Lightning checkpoints its position in
the epoch, so a run resumed from a mid-epoch ``last.ckpt`` continues with the very batches the
interrupted run would have seen next. Validation and test items always use epoch 0 (fixed crops
and masks), so their losses are comparable between epochs and runs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.trainer.states import TrainerFn
from torch.utils.data import DataLoader

from protein_performer.data.dataset import (
    SPLITS,
    ConcatSource,
    ProteinCollator,
    ProteinDataset,
    RecordSource,
    StoreSubset,
    check_max_len,
    fasta_splits,
)
from protein_performer.data.family import DEFAULT_MEMORY_DROPOUT, FamilyDataset
from protein_performer.data.inputs import Input, open_input
from protein_performer.data.loader import ResumableDataLoader
from protein_performer.data.msa import FAMILY_COORDINATES
from protein_performer.data.sampler import TokenBudgetBatchSampler
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.io.processes import leave_group_stop

if TYPE_CHECKING:
    from protein_performer.data.store import TokenStore

log = logging.getLogger(__name__)

_FRACTION_FOR = {"valid": "valid_frac", "test": "test_frac"}
_FAMILY_NEEDS_STORE = (
    "data.layout=family needs data.path to be one store: run `protein-performer preprocess "
    "FASTA --out STORE --cluster-split 0.5` and set data.path=STORE (families are built inside "
    "the store's splits, so none crosses them)"
)


def _as_paths(path: str | Path | Sequence[str | Path]) -> list[Path]:
    """Accept one path or a list (Hydra gives ``ListConfig``), expand ``~``."""
    items = [path] if isinstance(path, (str, Path)) else list(path)
    if not items:
        raise UserError("data.path is empty: give a preprocessed store directory or FASTA file(s)")
    return [Path(str(p)).expanduser() for p in items]


def worker_init(worker_id: int, rank: int = 0) -> None:
    """The DataLoader workers' start: they leave the command's process group (a group's SIGTERM
    reaches the main process, which saves ``last.ckpt`` and stops them), then Lightning's own
    seeding when ``seed_everything(workers=True)`` asked for it (Lightning adds it only to
    loaders without a ``worker_init_fn``)."""
    from lightning_fabric.utilities.seed import pl_worker_init_function

    leave_group_stop(worker_id)
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank)


class ProteinDataModule(pl.LightningDataModule):
    """Train/valid/test loaders over a preprocessed store (``path`` is a directory) or FASTA.

    A store carries its own split (chosen at ``preprocess`` time); ``valid_frac``/``test_frac``
    only apply when reading FASTA, with the same hashing rule, so both routes agree.
    ``max_len`` counts ``<cls>``/``<eos>``; ``max_tokens`` is the padded-token budget per batch
    (per device); ``limit_records`` keeps the first N records of the input (quick runs).
    ``concat=True`` trains on each split's records joined with ``<eos>`` and cut into rows of
    exactly ``max_len`` tokens (:class:`ConcatSource`), as in the Performer paper's L=8192 run.
    ``layout="family"`` makes each row one family's members, ``<cls> A <eos> <cls> B <eos>...``
    up to ``family_max_tokens`` (:class:`~protein_performer.data.family.FamilyDataset`); the
    families (``family_method`` search or cluster at ``family_identity``, MMseqs2) are built
    inside each split of a store and cached there (``data.homology.store_families``).
    ``family_coordinates="aligned"`` keys each member's tokens in a position memory by its
    alignment to the family's first member (a family search's; member positions where there is
    none, as for ``cluster`` families) instead of its member positions.
    ``family_memory_dropout`` hides each later member of a training row from a position memory
    with that probability (valid/test rows never), so the weights also learn to predict alone
    (:class:`~protein_performer.data.family.FamilyDataset`).
    ``split_flag`` names the caller's own option for the FASTA fractions in messages
    (``linearize``: ``--heldout-frac``).
    """

    def __init__(
        self,
        path: str | Sequence[str],
        objective: str = "mlm",
        max_len: int = 1024,
        max_tokens: int = 16384,
        max_batch_size: int | None = None,
        mlm_prob: float = 0.15,
        valid_frac: float = 0.02,
        test_frac: float = 0.02,
        num_workers: int = 0,
        seed: int | None = 0,
        on_invalid: str = "error",
        pin_memory: bool = False,
        limit_records: int | None = None,
        split_by: str = "auto",
        concat: bool = False,
        layout: str = "single",
        family_max_tokens: int = 8192,
        family_method: str = "search",
        family_identity: float = 0.3,
        split_flag: str | None = None,
        family_coordinates: str = "positions",
        family_memory_dropout: float = DEFAULT_MEMORY_DROPOUT,
    ) -> None:
        super().__init__()
        self.paths = _as_paths(path)
        path = [str(p) for p in self.paths]  # plain strings in the checkpoint, not ListConfig
        self.save_hyperparameters()
        if objective not in ("mlm", "clm"):
            raise UserError(f"data.objective must be mlm or clm, got {objective!r}")
        if on_invalid not in ("error", "skip"):
            raise UserError(f"data.on_invalid must be error or skip, got {on_invalid!r}")
        check_max_len(max_len)
        if max_tokens < max_len:
            log.warning(
                "data.max_tokens=%d < data.max_len=%d: the longest records get a batch of "
                "their own and exceed the budget",
                max_tokens,
                max_len,
            )
        self.objective = objective
        self.max_len = max_len
        self.max_tokens = max_tokens
        self.max_batch_size = max_batch_size
        self.mlm_prob = mlm_prob
        self.valid_frac = valid_frac
        self.test_frac = test_frac
        self.num_workers = num_workers
        self.seed = 0 if seed is None else int(seed)  # a run with seed=null still needs one
        self.on_invalid = on_invalid
        self.pin_memory = pin_memory
        self.limit_records = limit_records
        self.split_by = split_by
        self.concat = bool(concat)
        if layout not in ("single", "family"):
            raise UserError(f"data.layout must be single or family, got {layout!r}")
        if layout == "family" and self.concat:
            raise UserError(
                "data.layout=family and data.concat=true both define a row: choose one"
            )
        self.layout = layout
        self.family_max_tokens = int(family_max_tokens)
        self.family_method = family_method
        self.family_identity = float(family_identity)
        if family_coordinates not in FAMILY_COORDINATES:
            raise UserError(
                f"data.family_coordinates must be {' or '.join(FAMILY_COORDINATES)}, got "
                f"{family_coordinates!r}"
            )
        self.family_coordinates = family_coordinates
        self.family_memory_dropout = float(family_memory_dropout)
        if family_coordinates == "aligned" and layout == "family" and family_method != "search":
            log.warning(
                "data.family_coordinates=aligned: %s families carry no alignments, so every "
                "member is keyed by its member positions (use data.family_method=search)",
                family_method,
            )
        self.split_flag = split_flag
        self._families: dict[str, Any] = {}
        self._inputs: list[Input] | None = None  # data.path opened once: :meth:`_open`
        if layout == "family" and (len(self.paths) != 1 or not self.paths[0].is_dir()):
            raise UserError(_FAMILY_NEEDS_STORE)
        self.alphabet = Alphabet()
        self.collator = ProteinCollator(self.alphabet)
        self.sources: dict[str, RecordSource] | None = None
        self.datasets: dict[str, ProteinDataset] = {}
        self._train_loader: ResumableDataLoader | None = None  # the last one handed out
        self._train_loader_state: dict[str, Any] | None = None  # restored, not yet applied

    # ---- loading -----------------------------------------------------------------------------
    def _load_sources(self) -> dict[str, RecordSource]:
        sources = self._split_sources()
        if not self.concat:
            return sources
        # Chunks fill a whole row: <cls> + (max_len - 2) tokens + <eos>.
        eos = self.alphabet.eos_idx
        return {k: ConcatSource(src, self.max_len - 2, eos) for k, src in sources.items()}

    def _open(self) -> list[Input]:
        """data.path through the one opener (:func:`~protein_performer.data.inputs.open_input`:
        a directory is a store, anything else FASTA), once: the splits and the families read
        the same store."""
        if self._inputs is None:
            missing = [p for p in self.paths if not p.exists()]
            if missing:
                raise UserError(
                    f"data.path {str(missing[0])!r} does not exist: give a store directory "
                    "made by `protein-performer preprocess` or FASTA file(s)"
                )
            self._inputs = [open_input(p) for p in self.paths]
        return self._inputs

    def _store(self) -> TokenStore | None:
        """The store data.path names, or None where it names FASTA file(s)."""
        inputs = self._open()
        return inputs[0].store if len(inputs) == 1 else None

    def _split_sources(self) -> dict[str, RecordSource]:
        store = self._store()
        if store is not None:
            return self._store_sources(store)
        stores = [i for i in self._open() if i.store is not None]
        if stores:
            raise UserError(
                f"data.path mixes a directory ({stores[0].path}) with other paths: give one "
                "store directory, or only FASTA files"
            )
        return fasta_splits(
            self.paths,
            self.valid_frac,
            self.test_frac,
            on_invalid=self.on_invalid,
            limit_records=self.limit_records,
            split_by=self.split_by,
            alphabet=self.alphabet,
        )

    def _store_sources(self, store: TokenStore) -> dict[str, RecordSource]:
        directory = store.path
        split_meta = (getattr(store, "meta", None) or {}).get("split", {})
        for key in ("valid_frac", "test_frac"):
            if key in split_meta and split_meta[key] != getattr(self, key):
                log.info(
                    "store %s was split with %s=%s at preprocess time; data.%s=%s does not "
                    "apply to stores",
                    directory,
                    key,
                    split_meta[key],
                    key,
                    getattr(self, key),
                )
        out: dict[str, RecordSource] = {}
        for split in SPLITS:
            idx = np.asarray(store.indices(split), dtype=np.int64)
            if self.limit_records is not None:
                idx = idx[idx < self.limit_records]
            out[split] = StoreSubset(store, idx)
        return out

    def _check_nonempty(self, split: str) -> None:
        assert self.sources is not None
        if len(self.sources[split]):
            return
        total = sum(len(s) for s in self.sources.values())
        where = ", ".join(str(p) for p in self.paths)
        if self._store() is not None:  # a store: data.*_frac unread
            change = (
                "smaller --valid-frac/--test-frac" if split == "train"
                else f"larger --{_FRACTION_FOR[split].replace('_', '-')}"
            )  # fmt: skip
            hint = (
                f"a store's splits are fixed when it is made (data.valid_frac and "
                f"data.test_frac are not read for one): re-run `protein-performer preprocess` "
                f"with a {change}, or give more records"
            )
        elif split == "train":
            knobs = self.split_flag or "data.valid_frac / data.test_frac"
            hint = f"lower {knobs}, or give more records"
        else:
            frac = _FRACTION_FOR[split]
            hint = (
                f"raise {self.split_flag or f'data.{frac}'} (now {getattr(self, frac)}) so at "
                f"least one of the {total} records lands there, or give more records"
            )
        if self.limit_records is not None:
            hint += f" (data.limit_records={self.limit_records} also limits the input)"
        raise UserError(f"the {split} split of {where} is empty: {hint}")

    def setup(self, stage: str | None = None) -> None:
        if self.sources is None:
            self.sources = self._load_sources()
        needed = {
            "fit": ("train", "valid"),
            "validate": ("valid",),
            "test": ("test",),
            None: ("train", "valid"),
        }.get(stage, ())
        for split in needed:
            self._check_nonempty(split)
        for split in SPLITS:
            if split in self.datasets or not len(self.sources[split]):
                continue
            if self.layout == "family":
                if split in needed:  # families cost an MMseqs2 run: only the splits in use
                    self.datasets[split] = self._family_dataset(split)
            else:
                self.datasets[split] = ProteinDataset(
                    self.sources[split],
                    objective=self.objective,  # type: ignore[arg-type]
                    max_len=self.max_len,
                    crop="random" if split == "train" else "fixed",
                    mlm_prob=self.mlm_prob,
                    seed=self.seed,
                    alphabet=self.alphabet,
                )

    # ---- family layout -----------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build and cache the families once (Lightning runs this on one process per node,
        before ``setup`` on every rank), so DDP ranks do not all run MMseqs2."""
        if self.layout == "family":
            for split in ("train", "valid"):
                self._store_families(split)

    def _store_families(self, split: str) -> Any:
        from protein_performer.data.homology import store_families
        from protein_performer.data.preprocess import default_workers

        store = self._store()
        assert store is not None  # a family layout is refused without a directory at construction
        if split not in self._families:
            if "clusters" not in store.meta.get("split", {}):
                log.warning(
                    "store %s was not split with --cluster-split: valid/test records may "
                    "have close relatives in training families",
                    self.paths[0],
                )
            self._families[split] = store_families(
                store, split, self.family_method, self.family_identity, default_workers(),
                aligned=self.family_coordinates == "aligned",
            )
        return self._families[split]

    def _family_dataset(self, split: str) -> ProteinDataset:
        assert self.sources is not None
        source = self.sources[split]
        assert isinstance(source, StoreSubset)
        families = self._store_families(split).restrict(source.indices)
        return FamilyDataset(
            source,
            families,
            objective=self.objective,  # type: ignore[arg-type]
            max_len=self.max_len,
            row_tokens=self.family_max_tokens,
            crop="random" if split == "train" else "fixed",
            mlm_prob=self.mlm_prob,
            seed=self.seed,
            alphabet=self.alphabet,
            coordinates=self.family_coordinates,
            # training rows only: a valid/test row is read as a context is, every member
            memory_dropout=self.family_memory_dropout if split == "train" else 0.0,
        )

    # ---- loaders -----------------------------------------------------------------------------
    def _replicas(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1, 0
        return int(trainer.world_size), int(trainer.global_rank)

    def batch_sampler(self, split: str) -> TokenBudgetBatchSampler:
        """The sampler a loader uses; public so scripts and tests can inspect batches."""
        if split not in self.datasets:
            self.setup("test" if split == "test" else "fit")
            self._check_nonempty(split)
        num_replicas, rank = self._replicas()
        train = split == "train"
        return TokenBudgetBatchSampler(
            self.datasets[split].model_lengths(),
            self.max_tokens,
            max_batch_size=self.max_batch_size,
            shuffle=train,
            seed=self.seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=False,
            tag_epoch=train,
        )

    def _loader(self, split: str) -> DataLoader:
        sampler = self.batch_sampler(split)
        # Only training resumes mid-epoch; evaluation loops always run their loaders whole.
        cls = ResumableDataLoader if split == "train" else DataLoader
        return cls(
            self.datasets[split],
            batch_sampler=sampler,
            collate_fn=self.collator,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=functools.partial(worker_init, rank=self._replicas()[1]),
        )

    def train_dataloader(self) -> DataLoader:
        loader = self._loader("train")
        assert isinstance(loader, ResumableDataLoader)
        if self._train_loader_state is not None:
            loader.load_state_dict(self._train_loader_state)
            self._train_loader_state = None
        self._train_loader = loader
        return loader

    # ---- checkpointed state ------------------------------------------------------------------
    # Lightning saves and restores a stateful train loader itself, but drops the restored
    # state when the train loader was built before the checkpoint was restored, which
    # ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (our LR schedule) does:
    # Lightning-AI/pytorch-lightning#20550. So the datamodule carries the loader's position too,
    # through LightningDataModule's public ``state_dict`` / ``load_state_dict`` hooks, and hands
    # it to the loader whenever that is built (loading twice, here and by Lightning, is
    # harmless, and the loader applies it at its first batch whatever the order).
    def _fit_train_loader(self) -> ResumableDataLoader | None:
        trainer = getattr(self, "trainer", None)
        loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
        return loader if isinstance(loader, ResumableDataLoader) else self._train_loader

    def state_dict(self) -> dict[str, Any]:
        loader = self._fit_train_loader()
        return {} if loader is None else {"train_loader": loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_loader")
        trainer = getattr(self, "trainer", None)
        if state is None or (trainer is not None and trainer.state.fn != TrainerFn.FITTING):
            return  # validate/test from a training checkpoint: the train position is not used
        loader = self._fit_train_loader()
        if loader is None:
            self._train_loader_state = dict(state)  # applied when train_dataloader() runs
        else:
            loader.load_state_dict(state)

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def summary(self) -> dict[str, Any]:
        """Record and residue counts per split, for logs and the CLI."""
        if self.sources is None:
            self.setup("fit")
        assert self.sources is not None
        return {
            split: {"records": len(src), "residues": int(np.sum(src.lengths))}
            for split, src in self.sources.items()
        }
