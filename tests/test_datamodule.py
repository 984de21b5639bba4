"""ProteinDataModule end to end: real FASTA and store inputs through real DataLoaders/Trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.data.datamodule import ProteinDataModule
from protein_performer.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
# 15 UniRef50 records (71-935 aa): the bundled copy, else the shared one.
CANDIDATES = [
    ROOT / "data/demo/some_proteins.fasta",
    ROOT / "../shared/data/demo/some_proteins.fasta",
]
FASTA = next((p for p in CANDIDATES if p.is_file()), None)

try:
    import protein_performer.data.fasta  # noqa: F401

    HAVE_READER = True
except ImportError:  # written in parallel; the store/FASTA tests wait for it
    HAVE_READER = False

needs_fasta = pytest.mark.skipif(
    FASTA is None or not HAVE_READER,
    reason="some_proteins.fasta not found in data/demo/ nor ../shared/data/demo/"
    if FASTA is None
    else "protein_performer.data.fasta (the FASTA reader) is not available",
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
def test_lightning_epochs_reshuffle_and_resume_reproduces_data(tmp_path: Path) -> None:
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
    _trainer(2, tmp_path).fit(resumed, datamodule=_dm(), ckpt_path=str(ckpt))
    assert [s[0] for s in resumed.seen] == [1] * len(by_epoch[1])
    for (_, ids_a, tok_a), (_, ids_b, tok_b) in zip(resumed.seen, by_epoch[1], strict=True):
        assert ids_a == ids_b and torch.equal(tok_a, tok_b)


@needs_fasta
def test_store_path_gives_the_same_splits_as_fasta(tmp_path: Path) -> None:
    preprocess = pytest.importorskip("protein_performer.data.preprocess", reason="no preprocess")
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


@pytest.mark.skipif(
    not (ROOT / "conf/train.yaml").is_file(), reason="conf/train.yaml not written yet"
)
@pytest.mark.parametrize("name", ["default", "demo"])
def test_hydra_data_configs_instantiate(name: str) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={name}", "paths.root_dir=/nonexistent", "seed=3"])
    dm = instantiate(cfg.data)
    assert isinstance(dm, ProteinDataModule) and dm.seed == 3 and dm.max_len <= 1024
    assert str(dm.paths[0]).startswith("/nonexistent/data/")
