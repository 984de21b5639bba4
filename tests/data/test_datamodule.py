"""ProteinDataModule end to end: real FASTA and store inputs through real DataLoaders/Trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.data.datamodule import ProteinDataModule
from protein_performer.data.dataset import ProteinCollator, ProteinDataset
from protein_performer.data.loader import ResumableDataLoader
from protein_performer.data.sampler import TokenBudgetBatchSampler
from protein_performer.errors import UserError
from tests.data.test_dataset import in_memory_source
from tests.paths import DEMO_DATA, REPO

ROOT = REPO
# 15 UniRef50 records (71-935 aa): the bundled copy, else the shared one.
CANDIDATES = [
    ROOT / "protein_performer/data/demo/some_proteins.fasta",
    ROOT / "../shared/data/demo/some_proteins.fasta",
]
FASTA = next((p for p in CANDIDATES if p.is_file()), None)

needs_fasta = pytest.mark.skipif(
    FASTA is None,
    reason="some_proteins.fasta not in protein_performer/data/demo/ nor ../shared/data/demo/",
)


def _dm(path: object = None, **kwargs: object) -> ProteinDataModule:
    args: dict = dict(
        objective="mlm", max_len=256, max_tokens=1024, valid_frac=0.2, test_frac=0.2, seed=0
    )
    args.update(kwargs)
    return ProteinDataModule(str(path or FASTA), **args)


def _epoch_batches(loader: torch.utils.data.DataLoader, epoch: int) -> list[dict]:
    loader.batch_sampler.set_epoch(epoch)
    return list(loader)


def test_missing_path_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        ProteinDataModule(str(tmp_path / "nope.fasta")).setup("fit")


@needs_fasta
def test_empty_split_names_the_fraction_to_change() -> None:
    with pytest.raises(UserError, match="valid_frac"):
        _dm(valid_frac=0.0).setup("fit")
    with pytest.raises(UserError, match="test_frac"):
        _dm(test_frac=0.0).setup("test")


@needs_fasta
def test_fasta_through_real_dataloaders() -> None:
    dm = _dm()
    dm.setup("fit")
    sizes = {k: v["records"] for k, v in dm.summary().items()}
    assert sum(sizes.values()) == 15 and all(sizes.values())
    train_ids = {dm.sources["train"].id(i) for i in range(sizes["train"])}
    loader = dm.train_dataloader()
    batches = _epoch_batches(loader, 0)
    assert len(batches) == len(loader)
    seen = []
    for b in batches:
        tokens, targets, pad = b["tokens"], b["targets"], b["padding_mask"]
        B, T = tokens.shape
        assert T <= 256 and (B == 1 or B * T <= 1024)
        assert targets.shape == pad.shape == (B, T)
        assert torch.all(tokens[:, 0] == dm.alphabet.cls_idx)
        assert torch.all(tokens[pad] == dm.alphabet.pad_idx)
        assert torch.all(targets[pad] == -100)
        assert ((targets != -100).sum(1) >= 1).all()
        seen += b["ids"]
    assert sorted(seen) == sorted(train_ids)
    val = list(dm.val_dataloader())
    assert sum(len(b["ids"]) for b in val) == sizes["valid"]
    # Validation is fixed: identical masks and crops whatever the epoch.
    val_again = _epoch_batches(dm.val_dataloader(), 5)
    assert all(
        torch.equal(a["targets"], b["targets"]) for a, b in zip(val, val_again, strict=True)
    )


@needs_fasta
def test_persistent_workers_see_the_new_epoch() -> None:
    """Epoch-tagged indices reach workers that were started in an earlier epoch."""
    ref = _dm(num_workers=0).train_dataloader()
    dm = _dm(num_workers=2)
    loader = dm.train_dataloader()
    assert loader.persistent_workers
    for epoch in (0, 1):
        got, want = _epoch_batches(loader, epoch), _epoch_batches(ref, epoch)
        for a, b in zip(got, want, strict=True):
            assert a["ids"] == b["ids"] and torch.equal(a["tokens"], b["tokens"])
    e0 = torch.cat([b["targets"].flatten() for b in _epoch_batches(ref, 0)])
    e1 = torch.cat([b["targets"].flatten() for b in _epoch_batches(ref, 1)])
    assert not torch.equal(e0, e1)


class _Recorder:
    """Builds a minimal LightningModule that records what each training step received."""

    @staticmethod
    def module() -> object:
        import pytorch_lightning as pl

        class Rec(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(()))
                self.seen: list[tuple[int, list[str], torch.Tensor]] = []

            def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
                self.seen.append((self.current_epoch, batch["ids"], batch["tokens"].clone()))
                return self.w * batch["tokens"].float().mean()

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.0)

        return Rec()


def _trainer(max_epochs: int, tmp_path: Path) -> object:
    import pytorch_lightning as pl

    return pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


@needs_fasta
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_epochs_reshuffle_and_resume_reproduces_data(
    tmp_path: Path, num_workers: int
) -> None:
    full = _Recorder.module()
    trainer = _trainer(2, tmp_path)
    trainer.fit(full, datamodule=_dm())
    assert trainer.train_dataloader.batch_sampler.__class__.__name__ == "TokenBudgetBatchSampler"
    by_epoch = [[s for s in full.seen if s[0] == e] for e in (0, 1)]
    assert by_epoch[0] and len(by_epoch[0]) == len(by_epoch[1])
    # Lightning's set_epoch reached the sampler, whose epoch tags gave new crops and masks.
    assert trainer.train_dataloader.batch_sampler.epoch == 1
    masks = [torch.cat([s[2].flatten() for s in ep]) for ep in by_epoch]
    assert masks[0].shape != masks[1].shape or not torch.equal(masks[0], masks[1])

    first = _Recorder.module()
    t1 = _trainer(1, tmp_path)
    t1.fit(first, datamodule=_dm())
    ckpt = tmp_path / "epoch1.ckpt"
    t1.save_checkpoint(ckpt)
    resumed = _Recorder.module()
    # With workers, Lightning's iter() comes before set_epoch(1): the loader must start lazily.
    dm = _dm(num_workers=num_workers)
    _trainer(2, tmp_path).fit(resumed, datamodule=dm, ckpt_path=str(ckpt))
    assert [s[0] for s in resumed.seen] == [1] * len(by_epoch[1])
    for (_, ids_a, tok_a), (_, ids_b, tok_b) in zip(resumed.seen, by_epoch[1], strict=True):
        assert ids_a == ids_b and torch.equal(tok_a, tok_b)


def _synthetic_loader(num_workers: int, rank: int = 0, replicas: int = 1) -> ResumableDataLoader:
    """A train loader like the datamodule's over 80 random proteins: ~20 batches an epoch."""
    rng = np.random.default_rng(0)
    aa = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    records = [(f"p{i}", "".join(rng.choice(aa, rng.integers(20, 150)))) for i in range(80)]
    dataset = ProteinDataset(in_memory_source(records), max_len=96, seed=1)
    sampler = TokenBudgetBatchSampler(
        dataset.model_lengths(), 512, seed=1, num_replicas=replicas, rank=rank, tag_epoch=True
    )
    return ResumableDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=ProteinCollator(),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a["ids"] == b["ids"]
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["targets"], b["targets"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_resumes_mid_epoch(num_workers: int) -> None:
    """State after k batches, loaded into a fresh loader: the rest of the very same epoch."""
    ref = _synthetic_loader(0)
    full = _epoch_batches(ref, 2)
    k = 5
    assert len(full) > k + 3

    crashed = _synthetic_loader(num_workers)
    crashed.batch_sampler.set_epoch(2)
    it = iter(crashed)
    _same([next(it) for _ in range(k)], full[:k])
    state = crashed.state_dict()  # workers have prefetched more: only handed-out batches count
    assert state["epoch"] == 2 and state["batches_yielded"] == k
    _same(list(it), full[k:])  # the interrupted loader itself goes on unaffected
    assert crashed.state_dict()["batches_yielded"] == len(full)

    # Lightning's order on resume: load_state_dict, iter(), then set_epoch, then next().
    resumed = _synthetic_loader(num_workers)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["batches_yielded"] == k  # a checkpoint before the 1st batch
    it = iter(resumed)
    resumed.batch_sampler.sampler.set_epoch(2)
    first = next(it)
    assert resumed.state_dict()["batches_yielded"] == k + 1  # counts on from the position
    _same([first, *it], full[k:])
    # The position applies once: the next epochs are whole.
    _same(_epoch_batches(resumed, 3), _epoch_batches(ref, 3))
    _same(_epoch_batches(resumed, 2), full)

    # Without set_epoch the loaded epoch is used; a state from an earlier epoch is not applied.
    again = _synthetic_loader(num_workers)
    again.load_state_dict(state)
    _same(list(again), full[k:])
    later = _synthetic_loader(num_workers)
    later.load_state_dict(state)
    _same(_epoch_batches(later, 3), _epoch_batches(ref, 3))


def test_loader_state_at_an_epoch_end_resumes_with_the_next_epoch() -> None:
    """A position at the end of epoch e continues with epoch e + 1, whole, in any order of
    set_epoch (none, before or after iter()): the loader does not count on Lightning's."""
    ref = _synthetic_loader(0)
    done = {"epoch": 2, "batches_yielded": len(ref), "num_batches": len(ref), "num_replicas": 1}
    want = _epoch_batches(ref, 3)
    alone = _synthetic_loader(0)
    alone.load_state_dict(done)
    _same(list(alone), want)
    for set_first in (True, False):
        loader = _synthetic_loader(0)
        loader.load_state_dict(done)
        loader.load_state_dict(done)  # twice (the datamodule's and Lightning's): harmless
        if set_first:
            loader.batch_sampler.sampler.set_epoch(3)
        it = iter(loader)
        loader.batch_sampler.sampler.set_epoch(3)
        _same(list(it), want)


def test_loader_iter_before_set_epoch_uses_the_new_epoch() -> None:
    """Lightning calls iter() before set_epoch on resume; workers must not prefetch epoch 0."""
    loader = _synthetic_loader(2)
    it = iter(loader)
    loader.batch_sampler.sampler.set_epoch(4)
    _same(list(it), _epoch_batches(_synthetic_loader(0), 4))


def test_loader_state_per_rank() -> None:
    """Under DDP each rank skips its own first k batches (rank 0's state serves all ranks)."""
    for rank in range(2):
        full = _epoch_batches(_synthetic_loader(0, rank, 2), 1)
        loader = _synthetic_loader(0, rank, 2)
        loader.load_state_dict({"epoch": 1, "batches_yielded": 3})
        _same(list(loader), full[3:])


class _StepCrashError(Exception):
    pass


@needs_fasta
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_resumes_mid_epoch_with_the_same_batches(
    tmp_path: Path, num_workers: int
) -> None:
    """Checkpoint mid-epoch, crash, resume: the run continues with the uninterrupted batches.

    The module asks for ``trainer.estimated_stepping_batches`` (as our LR schedule does), which
    builds the train loader before the checkpoint is restored (Lightning issue #20550).
    """
    import pytorch_lightning as pl

    kwargs = dict(max_len=128, max_tokens=128, num_workers=num_workers)  # 6 batches an epoch

    class Stepping(type(_Recorder.module())):  # type: ignore[misc]
        def configure_optimizers(self) -> torch.optim.Optimizer:
            assert self.trainer.estimated_stepping_batches == 12
            return super().configure_optimizers()

    class SaveThenCrash(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 8:  # epoch 1, 2 of its 6 batches done
                trainer.save_checkpoint(tmp_path / "mid.ckpt")
                raise _StepCrashError

    def trainer(*callbacks: pl.Callback) -> pl.Trainer:
        t = _trainer(2, tmp_path)
        t.callbacks.extend(callbacks)
        return t

    full = Stepping()
    trainer().fit(full, datamodule=_dm(**kwargs))
    assert len(full.seen) == 12
    crashed = Stepping()
    with pytest.raises(_StepCrashError):
        trainer(SaveThenCrash()).fit(crashed, datamodule=_dm(**kwargs))
    resumed = Stepping()
    t = trainer()
    t.fit(resumed, datamodule=_dm(**kwargs), ckpt_path=str(tmp_path / "mid.ckpt"))
    assert t.global_step == 12
    assert [s[0] for s in resumed.seen] == [1] * 4
    for (_, ids_a, tok_a), (_, ids_b, tok_b) in zip(resumed.seen, full.seen[8:], strict=True):
        assert ids_a == ids_b and torch.equal(tok_a, tok_b)


@needs_fasta
def test_store_path_gives_the_same_splits_as_fasta(tmp_path: Path) -> None:
    from protein_performer.data import preprocess

    out = tmp_path / "store"
    preprocess.preprocess([FASTA], out, valid_frac=0.2, test_frac=0.2, progress=False)
    from_store, from_fasta = _dm(out), _dm()
    from_store.setup("fit")
    from_fasta.setup("fit")
    for split in ("train", "valid", "test"):
        a, b = from_store.sources[split], from_fasta.sources[split]
        assert [a.id(i) for i in range(len(a))] == [b.id(i) for i in range(len(b))]
        assert np.array_equal(a.lengths, b.lengths)
        assert all(np.array_equal(a.tokens(i), b.tokens(i)) for i in range(len(a)))
    # Same sources, same seed -> the very same batches.
    for x, y in zip(
        _epoch_batches(from_store.train_dataloader(), 1),
        _epoch_batches(from_fasta.train_dataloader(), 1),
        strict=True,
    ):
        assert x["ids"] == y["ids"] and torch.equal(x["targets"], y["targets"])
    limited = _dm(out, limit_records=5)
    limited.setup("test")
    assert sum(len(s) for s in limited.sources.values()) == 5


@pytest.mark.parametrize("name", ["default", "demo"])
def test_hydra_data_configs_instantiate(name: str, tmp_path: Path) -> None:
    from hydra.utils import instantiate

    from protein_performer.training.compose import compose_config

    overrides = [f"data={name}", "paths.root_dir=/nonexistent", "seed=3"]
    cfg = compose_config(overrides, output_dir=tmp_path)
    dm = instantiate(cfg.data)
    assert isinstance(dm, ProteinDataModule) and dm.seed == 3 and dm.max_len <= 1024
    # Your data is found under the root; the demo's ships inside the package.
    expected = "/nonexistent/data/" if name == "default" else str(DEMO_DATA)
    assert str(dm.paths[0]).startswith(expected)


def test_an_empty_split_names_the_knob_that_is_read(tmp_path: Path) -> None:
    """A store ignores data.valid_frac (its splits are fixed by preprocess), and linearize
    sets the fractions with --heldout-frac: the hint names what works (issue 42 #20)."""
    from protein_performer.data.store import StoreWriter

    fasta = tmp_path / "two.fasta"
    fasta.write_text(">a\nMKTAYIAK\n>b\nLAGVMKT\n")
    store = tmp_path / "store"
    with StoreWriter(store) as w:
        w.write_chunk(["a", "b"], ["MKTAYIAK", "LAGVMKT"], [0, 0], ["", ""])
        w.commit({})
    with pytest.raises(UserError) as info:
        ProteinDataModule(str(store)).setup("fit")
    said = str(info.value)
    assert "re-run `protein-performer preprocess` with a larger --valid-frac" in said
    assert "raise data.valid_frac" not in said
    dm = ProteinDataModule(str(fasta), valid_frac=1e-9, test_frac=1e-9,
                           split_flag="--heldout-frac")  # fmt: skip
    with pytest.raises(UserError, match=r"valid split .* raise --heldout-frac \(now 1e-09\)"):
        dm.setup("fit")
