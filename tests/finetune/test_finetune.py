"""Fine-tuning (issue 24): heads and losses, data and splits, frozen/LoRA/full runs, merge,
predict on long sequences, resume. Tiny models; the end-to-end resume run is ``slow``."""

from __future__ import annotations

import csv
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from pytorch_lightning.callbacks import Callback

import protein_performer as pp
from protein_performer.cli.main import main
from protein_performer.errors import UserError
from protein_performer.finetune.data import assign_splits, collate, read_labels
from protein_performer.finetune.module import task_metrics
from protein_performer.finetune.train import finetune
from protein_performer.interop.export import export_model
from protein_performer.io.checkpoints import safe_load
from protein_performer.model.task_heads import HeadConfig, TaskHead, TaskModel, head_loss
from protein_performer.training.compose import compose_config
from tests.inference.test_embedding import tiny_loaded
from tests.paths import REPO, SHARED

AA = "ACDEFGHIKLMNPQRSTVWY"
QUIET = [
    "trainer.enable_progress_bar=false",
    "~callbacks.progress_bar",
    "~callbacks.training_curve",
    "trainer.enable_model_summary=false",
    "logger=csv",
]


def random_seqs(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(AA), int(rng.integers(lo, hi)))) for _ in range(n)]


def write_table(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with open(path, "w", newline="") as fh:
        delimiter = "\t" if path.suffix == ".tsv" else ","
        csv.writer(fh, delimiter=delimiter).writerows([header, *rows])
    return path


def ft_config(base: Path, table: Path, out: Path, *overrides: str):
    return compose_config(
        [f"base={base}", f"data.train={table}", f"paths.output_dir={out}", *QUIET, *overrides],
        name="finetune",
        direct_keys=("base", "data.train"),
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model(tiny_loaded(), tmp_path_factory.mktemp("base") / "tiny")


@pytest.fixture(scope="module")
def fitness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Regression labels: the fraction of K, a signal the sequence carries."""
    seqs = random_seqs(40, 15, 30)
    rows = [[f"s{i}", s, f"{s.count('K') / len(s):.4f}"] for i, s in enumerate(seqs)]
    return write_table(
        tmp_path_factory.mktemp("data") / "fit.csv", ["id", "sequence", "label"], rows
    )


@pytest.fixture(scope="module")
def lora_run(base: Path, fitness: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lora")
    cfg = ft_config(base, fitness, out, "mode=lora", "trainer.max_epochs=1", "test=false")
    cfg.mode.lora.lora_dropout = 0.0
    return finetune(cfg)


# ----------------------------------------------------------------------------- heads
@pytest.mark.parametrize(
    "task, k, pooling",
    [
        ("regression", 1, "mean"),
        ("regression", 3, "attention"),
        ("classification", 2, "cls"),
        ("classification", 4, "attention"),
        ("residue_classification", 3, "mean"),
    ],
)
def test_head_shapes_and_losses(task: str, k: int, pooling: str) -> None:
    torch.manual_seed(0)
    backbone = tiny_loaded().model
    head = TaskHead(HeadConfig(task, k, [str(i) for i in range(k)], 16, pooling, dropout=0.0))
    model = TaskModel(backbone, head)
    tokens = tiny_loaded().alphabet.encode_batch(["MKTAYIAK", "MLL"])  # (2, 10), padded
    out = model(tokens)
    per_res = task == "residue_classification"
    assert out.shape == ((2, 10, k) if per_res else (2, k))
    if task == "regression":
        labels = torch.randn(2, k)
        expected = torch.nn.functional.mse_loss(out, labels)
    elif task == "classification":
        labels = torch.tensor([1, 0])
        expected = torch.nn.functional.cross_entropy(out, labels)
    else:
        labels = torch.full((2, 10), -100)
        labels[0, 1:9] = torch.arange(8) % k
        labels[1, 1:4] = torch.tensor([0, 1, 2]) % k
        keep = labels != -100
        expected = torch.nn.functional.cross_entropy(out[keep], labels[keep])
    loss = head_loss(task, out, labels)
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    assert head.out.weight.grad is not None and head.out.weight.grad.abs().sum() > 0


def test_padding_does_not_change_a_sequence_prediction() -> None:
    torch.manual_seed(0)
    for pooling in ("mean", "cls", "attention"):
        head = TaskHead(HeadConfig("regression", 1, ["y"], 16, pooling)).eval()
        model = TaskModel(tiny_loaded().model, head)
        alone = model(tiny_loaded().alphabet.encode_batch(["MKT"]))
        padded = model(tiny_loaded().alphabet.encode_batch(["MKT", "MKTAYIAKQR"]))[:1]
        assert torch.allclose(alone, padded, atol=1e-5), pooling


def test_regression_loss_ignores_missing_targets() -> None:
    out = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    labels = torch.tensor([[0.0, float("nan")], [3.0, 2.0]])
    assert float(head_loss("regression", out, labels)) == pytest.approx((1 + 0 + 4) / 3)


def test_metrics() -> None:
    y = np.array([[0.1], [0.5], [0.9], [0.3]], np.float32)
    m = task_metrics("regression", y * 2, y)
    assert m["spearman"] == pytest.approx(1.0) and m["mse"] > 0
    logits = np.array([[2.0, 0.0], [0.0, 2.0], [0.0, 1.0]], np.float32)
    m = task_metrics("classification", logits, np.array([0, 1, 1]))
    assert m["acc"] == 1.0 and m["auroc"] == 1.0 and m["mcc"] == pytest.approx(1.0)
    m = task_metrics("residue_classification", logits, np.array([0, 1, 0]))
    assert m["acc"] == pytest.approx(2 / 3) and 0 < m["f1"] < 1


# ----------------------------------------------------------------------------- data
def test_read_labels_tasks_and_nan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = write_table(
        tmp_path / "t.csv",
        ["sequence", "a", "b", "cls", "ss", "split"],
        [
            ["MKT", "1.5", "", "yes", "HHC", "train"],
            ["mll", "nan", "NA", "no", "[0, 1, 1]", "val"],
            ["MAG", "2", "3", "no", "C E H", "test"],
        ],
    )
    reg = read_labels(t, "regression", ["a", "b"])
    assert reg.skipped == 1 and reg.sequences == ["MKT", "MAG"] and reg.rows == [2, 4]
    assert np.isnan(reg.labels[0, 1]) and reg.labels[1].tolist() == [2.0, 3.0]
    assert reg.splits == ["train", "test"]
    assert "1 row(s) without a label skipped (rows 3)" in caplog.text
    with pytest.raises(UserError, match=r"t.csv: row 3 \(2\): no label"):
        read_labels(t, "regression", ["a", "b"], on_nan="error")
    cls = read_labels(t, "classification", ["cls"])
    assert cls.label_names == ["no", "yes"] and cls.labels.tolist() == [1, 0, 0]
    res = read_labels(t, "residue_classification", ["ss"])
    assert res.label_names == ["0", "1", "C", "E", "H"]
    assert [x.tolist() for x in res.labels] == [[4, 4, 2], [0, 1, 1], [2, 3, 4]]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"sequence,label\nMKT,1\nMA\xffG,2\n", r"line 3 is not UTF-8 text \(byte 0xff"),
        (b"sequence,label\nMKT,1\nMAG,2" + b"0" * 140_000 + b"\n", r"line 3: field larger"),
    ],
    ids=["not-utf8", "huge-field"],
)
def test_unreadable_label_tables_are_one_error(tmp_path: Path, data: bytes, match: str) -> None:
    table = tmp_path / "t.csv"
    table.write_bytes(data)
    with pytest.raises(UserError, match=match):
        read_labels(table)


@pytest.mark.parametrize(
    "rows, task, match",
    [
        ([["MKT", "HH", "train"]], "residue_classification", r"row 2: 2 residue labels for a "
         "sequence of 3 residues"),
        ([["MKT", "HHC", "dev"]], "residue_classification", r"row 2 \(1\): unknown split 'dev'"),
        ([["MKT", "x", "train"]], "regression", r"row 2: label y='x' is not a number"),
        ([["MJT", "1", "train"]], "regression", r"row 2 \(1\): invalid residue 'J'"),
        ([["MKT", "1"]], "regression", r"row 2 has 2 fields, the header 3"),
    ],
)  # fmt: skip
def test_bad_tables_name_file_and_row(tmp_path: Path, rows: list, task: str, match: str) -> None:
    t = write_table(tmp_path / "bad.csv", ["sequence", "y", "split"], rows)
    with pytest.raises(UserError, match=r"bad.csv: " + match):
        read_labels(t, task, ["y"])


def test_fasta_plus_labels(tmp_path: Path) -> None:
    fa = tmp_path / "s.fasta"
    fa.write_text(">a\nMKT\n>b\nMLLA\n")
    t = write_table(tmp_path / "l.tsv", ["id", "y"], [["b", "1"], ["a", "2"]])
    data = read_labels(t, "regression", ["y"], fasta=fa)
    assert data.sequences == ["MLLA", "MKT"]
    t2 = write_table(tmp_path / "l2.csv", ["id", "y"], [["c", "1"]])
    with pytest.raises(UserError, match=r"row 2: id 'c' is not in"):
        read_labels(t2, "regression", ["y"], fasta=fa)


def test_random_split_is_seeded_and_sized(tmp_path: Path) -> None:
    t = write_table(tmp_path / "t.csv", ["sequence", "y"], [[s, 1] for s in random_seqs(50, 5, 9)])
    data = read_labels(t, "regression", ["y"])
    a = assign_splits(data, None, 0.2, 0.1, seed=3)
    assert a == assign_splits(data, "random", 0.2, 0.1, seed=3)
    assert (len(a["train"]), len(a["valid"]), len(a["test"])) == (35, 10, 5)
    assert sorted(a["train"] + a["valid"] + a["test"]) == list(range(50))


@pytest.mark.slow  # the default suite's time budget (make test <= 2 min)
@pytest.mark.skipif(shutil.which("mmseqs") is None, reason="MMseqs2 is not installed")
def test_cluster_split_keeps_clusters_together(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    parents = random_seqs(12, 80, 120, seed=1)
    rows, family = [], []
    for f, p in enumerate(parents):
        for _ in range(5):  # near-identical variants: 2 point mutations each
            s = list(p)
            for pos in rng.choice(len(s), 2, replace=False):
                s[pos] = AA[int(rng.integers(20))]
            rows.append(["".join(s), 1.0])
            family.append(f)
    data = read_labels(
        write_table(tmp_path / "v.csv", ["sequence", "y"], rows), "regression", ["y"]
    )
    splits = assign_splits(data, "cluster", 0.2, 0.2, seed=0, identity=0.9)
    where = {i: s for s, idx in splits.items() for i in idx}
    for f in range(len(parents)):
        assert len({where[i] for i, g in enumerate(family) if g == f}) == 1, f
    assert all(splits[s] for s in ("train", "valid", "test"))
    # the random split of the same rows does separate families (the point of clustering)
    rand = assign_splits(data, "random", 0.2, 0.2, seed=0)
    where = {i: s for s, idx in rand.items() for i in idx}
    assert any(len({where[i] for i, g in enumerate(family) if g == f}) > 1 for f in range(12))


def test_collate_aligns_residue_labels_with_tokens() -> None:
    from protein_performer.data.tokenizer import Alphabet

    a = Alphabet()
    items = [(a.encode_with_specials("MKT"), np.array([0, 1, 2])), (a.encode_with_specials("M"),
             np.array([1]))]  # fmt: skip
    batch = collate(items, "residue_classification")
    assert batch["tokens"].shape == (2, 5)
    assert batch["labels"].tolist() == [[-100, 0, 1, 2, -100], [-100, 1, -100, -100, -100]]


# ----------------------------------------------------------------------------- runs
def _planted(
    tmp_path: Path, base: Path, shuffle: bool, offset: float = 0.0, scale: float = 1.0
) -> tuple[dict, list[str], np.ndarray]:
    """A frozen probe on labels that are an exact linear function of the mean embeddings
    (z-scored, then ``* scale + offset``): the run's result, the sequences and the labels."""
    seqs = random_seqs(160, 10, 40, seed=5)
    lm = pp.load(base, "cpu")
    emb = lm.embed(seqs)
    w = np.random.default_rng(0).normal(size=emb.shape[1])
    y = emb @ w
    y = (y - y.mean()) / y.std() * scale + offset
    if shuffle:
        y = np.random.default_rng(1).permutation(y)
    rows = [[s, f"{v:.6f}"] for s, v in zip(seqs, y, strict=True)]
    name = f"{shuffle}_{offset:g}"
    table = write_table(tmp_path / f"planted_{name}.csv", ["sequence", "label"], rows)
    cfg = ft_config(
        base, table, tmp_path / f"out_{name}", "mode=frozen", "mode.head_lr=0.1",
        "task.dropout=0.0", "trainer.max_epochs=20", "data.valid_frac=0.25", "data.test_frac=0",
        "optim.weight_decay=0",
    )  # fmt: skip
    return finetune(cfg), seqs, y


def test_frozen_probe_recovers_a_planted_signal_and_not_shuffled_labels(
    tmp_path: Path, base: Path
) -> None:
    assert _planted(tmp_path, base, shuffle=False)[0]["metrics"]["val/spearman"] > 0.9
    assert abs(_planted(tmp_path, base, shuffle=True)[0]["metrics"]["val/spearman"]) < 0.5


def test_regression_predictions_come_back_in_label_units(tmp_path: Path, base: Path) -> None:
    """Targets are standardized for training (raw, the head would need ~1000 Adam steps of
    lr 0.1 to reach the offset); the checkpoint predicts in the labels' units."""
    result, seqs, y = _planted(tmp_path, base, shuffle=False, offset=1000.0, scale=50.0)
    pred = pp.load(result["best_checkpoint"], "cpu").predict(seqs)
    assert np.corrcoef(pred, y)[0, 1] > 0.9
    assert abs(pred.mean() - 1000.0) < 10.0 and 35.0 < pred.std() < 65.0
    assert np.sqrt(result["metrics"]["val/mse"]) < 25.0  # label units: half a std
    assert result["metrics"]["val/loss"] < 0.25  # z-units
    stats = safe_load(result["best_checkpoint"])["finetune"]  # the train split's
    assert stats["target_mean"][0] == pytest.approx(1000.0, abs=15.0)
    assert stats["target_std"][0] == pytest.approx(50.0, rel=0.2)


def test_target_statistics_fold_into_the_head_and_back(base: Path) -> None:
    from protein_performer.finetune.module import FinetuneModule, label_stats

    labels = np.array([[1.0, np.nan], [3.0, 5.0], [5.0, 5.0]], np.float32)
    mean, std = label_stats(labels)
    assert mean == pytest.approx([3.0, 5.0]) and std == pytest.approx([np.sqrt(8 / 3), 1.0])
    head = HeadConfig("regression", 2, ["a", "b"], 16, dropout=0.0)
    module = FinetuneModule(pp.load(base, "cpu").model, head, "frozen", target_stats=(mean, std))
    feats = torch.randn(4, 16)
    z = module({"features": feats}).detach()
    ckpt = {"state_dict": {k: v.clone() for k, v in module.state_dict().items()}}
    module.on_save_checkpoint(ckpt)
    assert ckpt["finetune"]["target_mean"] == pytest.approx(mean)
    folded = torch.nn.functional.linear(
        feats, ckpt["state_dict"]["head.out.weight"], ckpt["state_dict"]["head.out.bias"]
    )
    assert torch.allclose(folded, z * torch.tensor(std) + torch.tensor(mean), atol=1e-5)
    fresh = FinetuneModule(pp.load(base, "cpu").model, head, "frozen")  # mean 0, std 1
    fresh.on_load_checkpoint(ckpt)  # the checkpoint's statistics win
    fresh.load_state_dict(ckpt["state_dict"])
    assert torch.allclose(fresh.target_mean, torch.tensor(mean))
    assert torch.allclose(fresh({"features": feats}), z, atol=1e-5)
    old = {"state_dict": {k: v.clone() for k, v in module.state_dict().items()}}
    module.on_load_checkpoint(old)  # written before the statistics existed: raw labels
    assert module.target_mean.tolist() == [0.0, 0.0] and module.target_std.tolist() == [1, 1]
    assert torch.equal(old["state_dict"]["head.out.weight"], module.head.out.weight)


def test_lora_changes_only_adapter_weights(lora_run: dict, base: Path) -> None:
    ckpt = safe_load(lora_run["last_checkpoint"])
    assert ckpt["lora"]["r"] == 8 and ckpt["task_head"]["task"] == "regression"
    state = ckpt["state_dict"]
    original = pp.load(base, "cpu").model.state_dict()
    adapters = [k for k in state if ".lora_" in k]
    assert len(adapters) == 2 * 6 * 2  # A and B for q,k,v,out,fc1,fc2 in 2 blocks
    changed = [k for k in adapters if "lora_B" in k and state[k].abs().sum() > 0]
    assert changed, "LoRA's B matrices start at zero and must have trained"
    for key, value in state.items():
        if not key.startswith("model.") or ".lora_" in key:
            continue
        name = key.removeprefix("model.").replace(".base_layer.", ".")
        assert torch.equal(value, original[name]), f"{key} changed"


def test_merge_gives_identical_predictions(lora_run: dict, tmp_path: Path) -> None:
    seqs = random_seqs(6, 5, 60, seed=9)
    lm = pp.load(lora_run["last_checkpoint"], "cpu")
    assert lm.loaded.lora is not None and lm.task_labels == ["label"]
    before = lm.predict(seqs)
    assert before.shape == (6,)
    out = tmp_path / "merged.ckpt"
    assert main(["export", lora_run["last_checkpoint"], str(out), "--merge"]) == 0
    merged = pp.load(out, "cpu")
    assert merged.loaded.lora is None
    assert not any(".lora_" in k for k in safe_load(out)["state_dict"])
    assert np.abs(merged.predict(seqs) - before).max() <= 1e-5


def test_export_without_merge_is_refused(lora_run: dict, tmp_path: Path, capsys) -> None:
    assert main(["export", lora_run["last_checkpoint"], str(tmp_path / "x")]) == 2
    assert "pass --merge" in capsys.readouterr().err


def test_predict_cli_and_a_5000_residue_sequence(lora_run: dict, tmp_path: Path) -> None:
    long = random_seqs(1, 5000, 5001, seed=2)[0]
    fa = tmp_path / "in.fasta"
    fa.write_text(f">long\n{long}\n>short\nMKTAYIAK\n")
    out = tmp_path / "pred.csv"
    assert main(["predict", lora_run["last_checkpoint"], str(fa), str(out), "--no-progress"]) == 0
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["id", "length", "label"]
    assert [r[:2] for r in rows[1:]] == [["long", "5000"], ["short", "8"]]
    lm = pp.load(lora_run["last_checkpoint"], "cpu")
    assert float(rows[1][2]) == pytest.approx(float(lm.predict([long])[0]), rel=1e-4, abs=1e-5)


def test_predict_refuses_a_model_without_head(base: Path, tmp_path: Path, capsys) -> None:
    fa = tmp_path / "in.fasta"
    fa.write_text(">a\nMKT\n")
    assert main(["predict", str(base), str(fa), str(tmp_path / "o.csv")]) == 2
    assert "has no task head" in capsys.readouterr().err
    with pytest.raises(UserError, match="no task head"):
        pp.load(base, "cpu").predict(["MKT"])


def test_cli_finetune_residue_frozen_and_errors(base: Path, tmp_path: Path, capsys) -> None:
    seqs = random_seqs(30, 10, 20, seed=4)
    rows = [[s, "".join("H" if c in "AELK" else "C" for c in s)] for s in seqs]
    t = write_table(tmp_path / "ss.csv", ["sequence", "ss"], rows)
    args = ["finetune", f"base={base}", f"data.train={t}", "task=residue_classification",
            "mode=frozen", "data.labels=[ss]", "trainer.max_epochs=2",
            f"hydra.run.dir={tmp_path / 'o'}", *QUIET]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "val/acc=" in printed and "val/f1=" in printed and "last checkpoint:" in printed
    wrote = [x for x in printed.splitlines() if x.startswith("wrote ")]  # issue 45 #6
    assert len(wrote) == 1 and str(tmp_path / "o") in wrote[0] and "checkpoint(s)" in wrote[0]
    # hydra.run.dir places the run as it places train's: log and composed config beside it.
    assert (tmp_path / "o" / ".hydra" / "config.yaml").is_file()
    assert (tmp_path / "o" / "finetune.log").is_file()
    lm = pp.load(tmp_path / "o" / "checkpoints" / "last.ckpt", "cpu")
    probs = lm.predict(["MKTA", "MLLAVLE"])
    assert [p.shape for p in probs] == [(4, 2), (7, 2)] and lm.task_labels == ["C", "H"]
    bad = write_table(tmp_path / "bad.csv", ["sequence", "ss"], [["MKT", "HH"]])
    assert main(args) == 2  # the same run directory again: refused, nothing overwritten
    assert "already holds a run" in capsys.readouterr().err
    rest = [a for a in args[3:] if not a.startswith("hydra.run.dir")]
    assert main([*args[:2], f"data.train={bad}", f"hydra.run.dir={tmp_path / 'o2'}", *rest]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "bad.csv: row 2" in err[0]
    assert main(["finetune", f"base={base}"]) == 2
    assert "finetune needs data.train=" in capsys.readouterr().err


def test_cli_finetune_cfg_job_prints_the_config_with_its_paths(tmp_path, monkeypatch, capsys):
    """Hydra's own flags pass through the one launch path, direct keys included."""
    monkeypatch.chdir(tmp_path)
    assert main(["finetune", "base=m.ckpt", "data.train=a=b.csv", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert "base: m.ckpt" in out and "train: a=b.csv" in out
    assert not (tmp_path / "outputs").exists()


def test_cli_finetune_run_name_lands_under_the_root(
    base: Path, fitness: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run-directory keys mean what they mean for train: <root>/outputs/finetune/<run_name>,
    the root being $PROTEIN_PERFORMER_ROOT (else the launch directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PROTEIN_PERFORMER_ROOT", str(tmp_path / "root"))
    args = ["finetune", f"base={base}", f"data.train={fitness}", "mode=frozen",
            "trainer.max_epochs=1", "run_name=r1", *QUIET]  # fmt: skip
    assert main(args) == 0
    run = tmp_path / "root" / "outputs" / "finetune" / "r1"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / ".hydra").is_dir()
    assert not (tmp_path / "outputs").exists()


# ----------------------------------------------------------------------------- resume
class KillAt(Callback):
    """SIGTERM at global step ``step`` of the first run (what a scheduler's preemption does)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
        if trainer.global_step == self.step and not os.environ.get("PP_RESUMED"):
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_resume_after_kill_equals_an_uninterrupted_run(
    base: Path, fitness: Path, tmp_path: Path, monkeypatch, mode: str
) -> None:
    common = [
        f"mode={mode}",
        "trainer.max_epochs=3",
        "data.max_batch_size=4",
        "test=false",
    ]  # the default dropout: the checkpoint carries the random states it draws from
    whole = finetune(ft_config(base, fitness, tmp_path / "whole", *common))
    kill = [
        "+callbacks.kill._target_=tests.finetune.test_finetune.KillAt",
        "+callbacks.kill.step=11",
    ]
    with pytest.raises(SystemExit) as stop:
        finetune(ft_config(base, fitness, tmp_path / "cut", *common, *kill))
    assert stop.value.code == 143
    assert safe_load(tmp_path / "cut" / "checkpoints" / "last.ckpt")["global_step"] == 11
    monkeypatch.setenv("PP_RESUMED", "1")
    resumed = finetune(
        ft_config(base, fitness, tmp_path / "cut", *common, *kill,
                  f"ckpt_path={tmp_path / 'cut' / 'checkpoints' / 'last.ckpt'}")
    )  # fmt: skip
    a = safe_load(whole["last_checkpoint"])["state_dict"]
    b = safe_load(resumed["last_checkpoint"])["state_dict"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k

    def curve(run: dict) -> dict[int, float]:  # logged train/loss by step
        text = (Path(run["output_dir"]) / "csv" / "metrics.csv").read_text()
        rows = csv.DictReader(text.splitlines())
        return {int(r["step"]): float(r["train/loss"]) for r in rows if r["train/loss"]}

    after = {step: loss for step, loss in curve(whole).items() if step > 11}
    assert after and all(
        curve(resumed)[step] == pytest.approx(loss, rel=1e-5) for step, loss in after.items()
    )  # the resumed curve is the uninterrupted one from the first resumed step on


# ----------------------------------------------------------------------------- benchmark
def test_every_finetune_experiment_composes(base: Path, fitness: Path, tmp_path: Path) -> None:
    from protein_performer.cli.finetune import overrides_of

    conf = REPO / "protein_performer" / "conf" / "finetune_experiment"
    names = sorted(p.stem for p in conf.glob("*.yaml"))
    assert names == ["classification", "regression", "residue_classification"]
    for name in names:
        args = type("A", (), {"overrides": [f"experiment={name}"], "split_by": "random"})()
        cfg = ft_config(base, fitness, tmp_path, *overrides_of(args))
        assert cfg.task.name == name and cfg.data.split_by == "random"
        assert cfg.trainer.use_distributed_sampler is False


@pytest.mark.slow
@pytest.mark.skipif(
    not (SHARED / "data" / "dms").is_dir(),
    reason="../shared/data/dms is not checked out",
)
def test_benchmark_quick(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    script = REPO / "scripts" / "studies" / "finetune_benchmark.py"
    out = tmp_path / "b.json"
    cmd = [sys.executable, str(script), "--quick", "--limit", "100", "--folds", "2",
           "--threads", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows][:2] == ["one-hot ridge", "frozen ridge (tiny random)"]
    assert all(np.isfinite([r["random"], r["position"], r["cpu_s"]]).all() for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(
    not (SHARED / "data" / "structures" / "chains.csv").is_file(),
    reason="../shared/data/structures is not checked out",
)
def test_benchmark_residue_quick(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    script = REPO / "scripts" / "studies" / "finetune_benchmark.py"
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(script), "--residue", "--quick", "--folds", "2", "--lrs",
           "1e-3,1e-2", "--threads", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "15 chains, 3015 residues" in proc.stdout  # every bundled chain, every residue
    rows = json.loads(out.read_text())["residue_rows"]
    assert [r["method"] for r in rows] == [
        "majority class", "amino-acid identity", "frozen (tiny random)", "lora (tiny random)",
    ]  # fmt: skip
    assert rows[0]["mcc"] == 0.0 and 0.45 < rows[0]["acc"] < 0.6  # buried = above the median
    assert all(np.isfinite([r["acc"], r["f1"], r["mcc"]]).all() for r in rows)
    for r in rows[2:]:  # an LR picked per fold, from the inner split's two candidates
        assert len(r["lrs"]) == 2 and all(set(f["inner"]) == {"0.001", "0.01"} for f in r["lrs"])


def test_a_diverging_run_stops_with_one_error(base: Path, fitness: Path, tmp_path: Path) -> None:
    cfg = ft_config(base, fitness, tmp_path, "mode=frozen", "mode.head_lr=1e20",
                    "optim.warmup_ratio=0", "trainer.gradient_clip_val=null")  # fmt: skip
    with pytest.raises(UserError, match=r"training stopped at step \d+: .* is (nan|inf)"):
        finetune(cfg)
    assert not list((tmp_path / "checkpoints").glob("*.ckpt"))  # nothing non-finite written


def test_test_rows_repeating_training_sequences_are_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = write_table(
        tmp_path / "t.csv",
        ["sequence", "label", "split"],
        [["MKT", 1, "train"], ["MAG", 2, "train"], ["MKT", 3, "test"], ["MLL", 4, "test"],
         ["MAG", 5, "valid"], ["MVV", 6, "valid"]],
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="protein_performer.finetune.data"):
        splits = assign_splits(read_labels(t))
    assert {k: len(v) for k, v in splits.items()} == {"train": 2, "valid": 2, "test": 2}
    assert "1 of 2 valid row(s) and 1 of 2 test row(s) repeat a training sequence" in caplog.text
