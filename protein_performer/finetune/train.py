"""``finetune(cfg)``: the pure entry point of supervised fine-tuning (``protein-performer
finetune``), composed from ``finetune.yaml`` like ``train(cfg)`` from ``train.yaml``.

Same trust guarantees as training because the same skeleton runs it (``training/runner.py``:
checks, seed, threads, trainer, fit, SIGTERM, test, one launch path): a real Lightning
``Trainer`` with ``DivergenceGuard`` (NaN stop), ``RunCheckpoint`` (``last.ckpt`` at every
validation, at the end and on SIGTERM), ``SafeCheckpointIO`` (atomic saves, ``weights_only``
loads) and the token-budget sampler with its resumable loader (a resumed run continues
mid-epoch exactly).
The base model is read by the one loader (any source ``pp.load`` takes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch

from protein_performer.data.loader import ResumableDataLoader
from protein_performer.data.sampler import TokenBudgetBatchSampler, budget_batches
from protein_performer.errors import UserError
from protein_performer.finetune.data import (
    FeatureDataset,
    LabelledSet,
    TokenDataset,
    assign_splits,
    collate,
    read_labels,
)
from protein_performer.finetune.module import MODES, FinetuneModule, label_stats
from protein_performer.model.performer import PerformerLM
from protein_performer.model.task_heads import HeadConfig, TaskHead, residue_mask
from protein_performer.training.runner import Entry, Job, holds_run_dir, run

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

#: ``gradient_checkpointing: auto`` turns it on when a training sequence is longer than this.
AUTO_CHECKPOINT_LENGTH = 1024


class FinetuneDataModule(pl.LightningDataModule):
    """Train/valid/test datasets with token-budget batches; the train loader resumes
    mid-epoch (its position goes through this module's state, Lightning-AI#20550)."""

    def __init__(self, datasets: dict[str, Any], task: str, max_tokens: int,
                 max_batch_size: int, seed: int) -> None:  # fmt: skip
        super().__init__()
        self.datasets, self.task = datasets, task
        self.max_tokens, self.max_batch_size, self.seed = max_tokens, max_batch_size, seed
        self._train_loader: ResumableDataLoader | None = None
        self._state: dict[str, Any] | None = None

    def _loader(self, split: str) -> torch.utils.data.DataLoader:
        ds = self.datasets[split]
        train = split == "train"
        sampler = TokenBudgetBatchSampler(
            ds.lengths(), self.max_tokens, max_batch_size=self.max_batch_size, shuffle=train,
            seed=self.seed, bucket_width=1 if not train else 8,
        )  # fmt: skip
        cls = ResumableDataLoader if train else torch.utils.data.DataLoader
        return cls(ds, batch_sampler=sampler, collate_fn=lambda b: collate(b, self.task))

    def train_dataloader(self) -> ResumableDataLoader:
        loader = self._loader("train")
        if self._state is not None:
            loader.load_state_dict(self._state)
            self._state = None
        self._train_loader = loader  # type: ignore[assignment]
        return loader  # type: ignore[return-value]

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader("valid")

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader("test")

    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "trainer", None)
        loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
        loader = loader if isinstance(loader, ResumableDataLoader) else self._train_loader
        return {} if loader is None else {"train_loader": loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_loader")
        if state is None:
            return
        if self._train_loader is None:
            self._state = dict(state)
        else:
            self._train_loader.load_state_dict(state)


@torch.inference_mode()
def cached_features(backbone: PerformerLM, head: TaskHead, sequences: list[str],
                    toks_per_batch: int = 4096) -> list[torch.Tensor]:  # fmt: skip
    """The frozen mode's inputs, computed once: per sequence the pooled vector (D,) for mean
    and cls pooling, else the residues' hidden states (L, D). float32 on CPU."""
    from protein_performer.data.tokenizer import Alphabet

    alphabet, c = Alphabet(), backbone.config
    device = next(backbone.parameters()).device
    was_training = backbone.training
    backbone.eval()
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for batch in budget_batches([len(s) + 2 for s in sequences], toks_per_batch):
        tokens = alphabet.encode_batch([sequences[i] for i in batch]).to(device)
        res = backbone(tokens, repr_layers=[head.config.layer])
        hidden = next(iter(res.hidden_states.values())).float()
        mask = residue_mask(tokens, c.pad_idx, c.cls_idx, c.eos_idx)
        if head.needs_tokens():
            for k, i in enumerate(batch):
                out[i] = hidden[k, 1 : 1 + len(sequences[i])].cpu().clone()
        else:
            pooled = head.pool(hidden, mask).cpu()
            for k, i in enumerate(batch):
                out[i] = pooled[k].clone()
    backbone.train(was_training)
    return out  # type: ignore[return-value]


def load_base(base: str, device: str = "cpu") -> tuple[PerformerLM, dict[str, Any] | None]:
    """The backbone to fine-tune, from any source the one loader reads (a fine-tuned model's
    LoRA is merged first; its head is dropped)."""
    from protein_performer.interop.finetuned import merge_lora
    from protein_performer.interop.loading import load_model

    loaded = merge_lora(load_model(base, device))
    return loaded.model, loaded.contact_regression


def build_data(cfg: DictConfig) -> tuple[LabelledSet, dict[str, list[int]]]:
    d = cfg.data
    labels = list(d.labels) if not isinstance(d.labels, str) else [d.labels]
    data = read_labels(
        d.train, cfg.task.name, labels, sequence_col=d.sequence_col, id_col=d.id_col,
        split_col=d.split_col, fasta=d.get("fasta"), classes=d.get("classes"), on_nan=d.on_nan,
    )  # fmt: skip
    splits = assign_splits(data, d.get("split_by"), float(d.valid_frac), float(d.test_frac),
                           int(cfg.seed or 0), float(d.identity))  # fmt: skip
    if not splits["train"]:
        raise UserError(
            f"{d.train}: the train split is empty; check the split column or "
            "data.valid_frac/data.test_frac"
        )
    if not splits["valid"]:
        raise UserError(
            f"{d.train}: the valid split is empty (needed for val/loss, the best "
            "checkpoint and the NaN stop); raise data.valid_frac or add valid rows"
        )
    log.info("data: %s", {k: len(v) for k, v in splits.items()})
    return data, splits


@holds_run_dir
def finetune(cfg: DictConfig) -> dict[str, Any]:
    """Fine-tune ``cfg.base`` on ``cfg.data.train``: :func:`runner.run` with the fine-tuning
    build. Returns its keys (``metrics``: last ``val/*``, and ``test/*`` of the best checkpoint
    when there is a test split; both checkpoints open with ``pp.load``) plus ``splits``,
    ``mode`` and ``trainable_parameters``."""
    if cfg.mode.name not in MODES:
        raise UserError(f"mode={cfg.mode.name!r} is not one of {', '.join(MODES)}")
    return run(cfg, _build)


def _build(cfg: DictConfig) -> Job:
    mode = cfg.mode.name
    data, splits = build_data(cfg)
    backbone, regression = load_base(str(cfg.base))
    t = cfg.task
    head_config = HeadConfig(
        task=t.name, num_outputs=len(data.label_names), labels=list(data.label_names),
        dim=backbone.config.dim, pooling=t.pooling, layer=int(t.layer), hidden=int(t.hidden),
        dropout=float(t.dropout),
    ).validate()  # fmt: skip
    stats = None
    if t.name == "regression" and t.get("standardize", True):
        # The train split's statistics only: valid and test labels never shape the model.
        stats = label_stats(data.subset(splits["train"]).labels)
        log.info("regression targets standardized with the train split's mean %s, std %s",
                 [f"{m:.4g}" for m in stats[0]], [f"{v:.4g}" for v in stats[1]])  # fmt: skip
    gc = cfg.get("gradient_checkpointing", "auto")
    longest = max(len(data.sequences[i]) for i in splits["train"])
    gc = longest > AUTO_CHECKPOINT_LENGTH if gc == "auto" else bool(gc)
    module = FinetuneModule(
        backbone, head_config, mode, lora=cfg.mode.get("lora"),
        optim={**cfg.optim, "lr": cfg.mode.lr, "head_lr": cfg.mode.head_lr},
        gradient_checkpointing=gc, contact_regression=regression, target_stats=stats,
    )  # fmt: skip
    if mode == "frozen":
        # One pass, on the GPU when the run trains on one; the cached features stay in CPU memory.
        gpu = torch.cuda.is_available() and cfg.trainer.get("accelerator") != "cpu"
        backbone.to("cuda" if gpu else "cpu")
        feats = cached_features(backbone, module.head, data.sequences,
                                int(cfg.data.toks_per_batch))  # fmt: skip
        backbone.to("cpu")
        datasets = {s: FeatureDataset([feats[i] for i in idx], data.subset(idx).labels)
                    for s, idx in splits.items()}  # fmt: skip
    else:
        datasets = {s: TokenDataset(data.subset(idx)) for s, idx in splits.items()}
    datamodule = FinetuneDataModule(
        datasets, t.name, int(cfg.data.max_tokens), int(cfg.data.max_batch_size),
        int(cfg.seed or 0),
    )  # fmt: skip
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return Job(
        module, datamodule,
        f"finetune {t.name} ({mode}): {trainable:,} trainable parameters, gradient "
        f"checkpointing {'on' if gc else 'off'}",
        test=bool(cfg.get("test")) and bool(splits["test"]),
        extra={"splits": {k: len(v) for k, v in splits.items()}, "mode": mode,
               "trainable_parameters": trainable},
    )  # fmt: skip


#: ``protein-performer finetune``: the fine-tuning entry on the one launch path. Its paths
#: bypass Hydra's override grammar (direct keys).
FINETUNE_ENTRY = Entry(
    "finetune",
    finetune,
    direct_keys=("base", "data.train", "data.fasta", "ckpt_path"),
    required=("base", "data.train"),
    example="protein-performer finetune base=CKPT data.train=labels.csv task=regression "
    "mode=lora",
    override_example="task=regression mode=lora",
)
