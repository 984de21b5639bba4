"""The shipped causal demo model, trained on family rows, reads its family context (issue 30).

The model of ``experiment=demo_clm data.layout=family`` (composed by Hydra as users get it:
family rows turn the position memory on, issue 40) trains briefly on
planted families (real demo proteins as ancestors, members at 70% identity), in rows made by
``FamilyDataset`` as training makes them (``data.family_memory_dropout`` as composed); then,
on held-out families, a member's NLL with three homologs before it in the row is compared
with its NLL alone. Each held-out family gives one paired difference; the claim is that their
mean is positive by more than three standard errors (a one-sided t of 3: about 0.3% false
alarms under no effect), a tolerance that comes from the data, not from a tuned threshold.
"""

from __future__ import annotations

import inspect
import random

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from protein_performer.data.datamodule import ProteinDataModule
from protein_performer.data.dataset import InMemorySource, ProteinCollator
from protein_performer.data.family import DEFAULT_MEMORY_DROPOUT, FamilyDataset
from protein_performer.data.fasta import read_fasta
from protein_performer.data.homology import Families
from protein_performer.data.tokenizer import Alphabet
from protein_performer.training.compose import compose_config
from protein_performer.training.settings import check_training_config
from tests.paths import DEMO_DATA

AMINO = "ACDEFGHIKLMNPQRSTVWY"
LENGTH, MEMBERS, STEPS, BATCH = 24, 4, 80, 4


def _families(ancestors: list[str], rng: random.Random) -> list[list[str]]:
    def member(a: str) -> str:
        return "".join(c if rng.random() < 0.7 else rng.choice(AMINO.replace(c, "")) for c in a)

    return [[member(a) for _ in range(MEMBERS)] for a in ancestors]


def _row(members: list[str], alphabet: Alphabet) -> list[int]:
    ids: list[int] = []
    for seq in members:
        ids += [alphabet.cls_idx, *alphabet.encode(seq).tolist(), alphabet.eos_idx]
    return ids


def _last_member_nll(model, ids: list[int]) -> float:
    tokens = torch.tensor([ids])
    logp = model(tokens).logits[0, :-1].log_softmax(-1)
    start = len(ids) - LENGTH - 2  # the last member's <cls>
    gold = tokens[0, start + 1 :]
    return -float(logp[start:].gather(1, gold[:, None]).mean())


def test_single_sequence_experiments_train_plain_favor(tmp_path) -> None:
    """demo_clm and small_clm train on one protein a row: no memory (issue 40); family_clm and
    any family-row run get one slot per member position; an explicit 0 still turns it off."""
    memory = {}
    for overrides in (["experiment=demo_clm"], ["experiment=small_clm"],
                      ["experiment=family_clm"], ["experiment=demo", "data.layout=family"],
                      ["experiment=family_clm", "model.config.position_memory=0"]):
        cfg = compose_config(overrides, output_dir=tmp_path)
        memory[" ".join(overrides)] = (cfg.model.config.position_memory, cfg.data.max_len)
    assert memory == {
        "experiment=demo_clm": (0, 256), "experiment=small_clm": (0, 1024),
        "experiment=family_clm": (1024, 1024), "experiment=demo data.layout=family": (256, 256),
        "experiment=family_clm model.config.position_memory=0": (0, 1024),
    }


def test_family_rows_compose_the_measured_memory_dropout(tmp_path) -> None:
    """family_clm and any data.layout=family run compose data.family_memory_dropout into the
    datamodule: the measured default (0.1, docs/RESULTS.md), the same as the datamodule's own;
    0 turns it off."""
    assert DEFAULT_MEMORY_DROPOUT == 0.1
    for overrides, want in ((["experiment=family_clm"], 0.1),
                            (["experiment=demo_clm", "data.layout=family"], 0.1),
                            (["experiment=family_clm", "data.family_memory_dropout=0"], 0.0)):
        cfg = compose_config(overrides, output_dir=tmp_path)
        check_training_config(cfg)
        kwargs = OmegaConf.to_container(cfg.data, resolve=True)
        kwargs.pop("_target_")
        bound = inspect.signature(ProteinDataModule).bind(**kwargs)  # every key a parameter
        assert bound.arguments["family_memory_dropout"] == want, overrides
    default = inspect.signature(ProteinDataModule).parameters["family_memory_dropout"].default
    assert default == DEFAULT_MEMORY_DROPOUT


def test_demo_clm_model_scores_a_member_better_with_its_family(tmp_path) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    cfg = compose_config(["experiment=demo_clm", "data.layout=family"], output_dir=tmp_path)
    model = instantiate(cfg.model).model
    assert model.config.position_memory == cfg.data.max_len  # the default on family rows
    alphabet = Alphabet()
    proteins = [
        r.sequence[:LENGTH] for r in read_fasta(DEMO_DATA / "train.fasta")
        if len(r.sequence) >= LENGTH and set(r.sequence[:LENGTH]) <= set(AMINO)
    ][:260]
    train, held_out = _families(proteins[:200], rng), _families(proteins[200:], rng)
    optim = torch.optim.AdamW(model.param_groups(0.01), lr=float(cfg.model.optim.lr))
    # the training rows as the data path makes them (members in a random order, each later
    # one hidden from the memory with the composed data.family_memory_dropout)
    rows = FamilyDataset(
        InMemorySource([str(i) for i in range(len(train) * MEMBERS)],
                       [alphabet.encode(seq) for f in train for seq in f]),
        Families.from_lists([list(range(i, i + MEMBERS)) for i in range(0, len(train) * MEMBERS,
                                                                          MEMBERS)]),
        max_len=cfg.data.max_len, row_tokens=cfg.data.family_max_tokens,
        memory_dropout=cfg.data.family_memory_dropout,
    )  # fmt: skip
    collate = ProteinCollator(alphabet)
    model.train()
    for step in range(STEPS):
        batch = collate([rows[(int(i), step)] for i in torch.randint(len(rows), (BATCH,))])
        logits = model(batch["tokens"], coordinates=batch.get("coordinates")).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    with torch.no_grad():
        gains = torch.tensor([
            _last_member_nll(model, _row(f[-1:], alphabet))
            - _last_member_nll(model, _row(f, alphabet))
            for f in held_out
        ])
    sem = gains.std() / len(gains) ** 0.5
    assert gains.mean() > 3 * sem, (float(gains.mean()), float(sem))
