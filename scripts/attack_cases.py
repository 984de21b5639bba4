#!/usr/bin/env python
"""Crafted inputs of the attack runs (issues 34 and 42), run through the real CLI.

``fault_injection.py`` kills commands inside their writes; this sibling hands them hostile
files instead, so the next attack round starts from these cases. Each case builds its files
from one tiny export (MLM and CLM), runs one command in a fresh process under a timeout and
checks the promised outcome: one ``error:`` line with exit status 2 (and no traceback), or
exit 0 with the documented warning or escape.

    python scripts/attack_cases.py                       # every case (a few minutes)
    python scripts/attack_cases.py --only h5-external report-script --out /tmp/attack

Prints one line per case (ok / FAIL, exit status, the line that decided) and writes
``report.json``; exits 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: The repository checkout this script belongs to.
REPO = Path(__file__).resolve().parents[1]
SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQ"
HOSTILE_ID = "</script><script>alert(1)</script>"


@dataclass
class Case:
    """One command on crafted files and what it must do."""

    name: str
    argv: list[str]
    want: str  # "error": exit 2 and one error line; "ok": exit 0
    says: str  # text the error line (or, for "ok", stderr) must hold
    check: Callable[[], str | None] | None = None  # more to check after the run (any outcome)
    shell_closes_stdout: bool = False
    stdin: bytes | None = None  # fed to the command's standard input (default: none, closed)


def _cli(*args: str | Path) -> list[str]:
    """``protein-performer ARGS`` with this interpreter (paths as they are spelled)."""
    return [sys.executable, "-m", "protein_performer.cli.main", *map(str, args)]


def _write(path: Path, data: str | bytes) -> Path:
    """``path`` holding ``data`` (text or bytes)."""
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def _tiny(work: Path, **config: object) -> object:
    """A tiny seeded ``LoadedModel`` of ``PerformerConfig(dim=16, heads=2, ff_dim=32,
    **config)``."""
    import torch

    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(0)
    cfg = PerformerConfig(**{"dim": 16, "depth": 2, "heads": 2, "ff_dim": 32, **config})
    return LoadedModel(PerformerLM(cfg).eval(), cfg, Alphabet(), work, torch.device("cpu"),
                       "export")


def _export(work: Path, name: str, **config: object) -> Path:
    """:func:`_tiny` exported to ``work/name``."""
    from protein_performer.interop.export import export_model

    return export_model(_tiny(work, **config), work / name)


def _models(work: Path) -> tuple[Path, Path]:
    """Tiny MLM and CLM exports (seeded)."""
    return tuple(  # type: ignore[return-value]
        _export(work, objective, nb_features=8, objective=objective)
        for objective in ("mlm", "clm")
    )


def _edit_config(model: Path, dest: Path, **edits: object) -> Path:
    shutil.copytree(model, dest)
    meta = json.loads((dest / "config.json").read_text())
    meta["config"].update(edits)
    (dest / "config.json").write_text(json.dumps(meta))
    return dest


def _lying_dtype(model: Path, dest: Path) -> Path:
    """The first float tensor's safetensors header says I32 (same size, other meaning)."""
    shutil.copytree(model, dest)
    weights = dest / "model.safetensors"
    data = weights.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "I32"
    weights.write_bytes(data[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(n)
                        + data[8 + n :])  # fmt: skip
    return dest


def _embedded(model: Path, fasta: Path, out: Path) -> Path:
    subprocess.run(_cli("embed", model, fasta, out, "--no-progress"),
                   check=True, capture_output=True)  # fmt: skip
    return out


def _crafted_h5(model: Path, fasta: Path, work: Path, how: str) -> Path:
    """A finished embed output with its mean array made to read elsewhere or declare more."""
    import h5py
    import numpy as np

    out = _embedded(model, fasta, work / f"{how}.h5")
    secret = _write(work / "secret.bin", np.arange(64, dtype=np.float32).tobytes())
    with h5py.File(out, "r+") as h5:
        name = f"mean/{int(h5.attrs['repr_layers'][-1])}"
        n, dim = h5[name].shape
        del h5[name]
        if how == "external":
            h5.create_dataset(name, (n, dim), np.float32, external=[(str(secret), 0, 4 * n * dim)])
        elif how == "soft-link":
            h5["elsewhere"] = np.zeros((n, dim), np.float32)
            h5[name] = h5py.SoftLink("/elsewhere")
        else:  # a billion rows declared, none stored
            h5.create_dataset(name, (10**9, dim), np.float32, chunks=(64, dim))
    return out


def _checkpoint(work: Path, name: str, state: dict) -> Path:
    import torch

    path = work / name
    torch.save({"state_dict": state}, path)
    return path


def _zip_bomb(work: Path) -> Path:
    """A torch checkpoint re-zipped with deflate: 40 MB of pickle in well under 1 MB."""
    import zipfile

    import torch

    plain = work / "plain.ckpt"
    torch.save({"state_dict": {}, "pad": "a" * (40 << 20)}, plain)
    bomb = work / "bomb.ckpt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    plain.unlink()
    return bomb


def _regression(model: Path, work: Path, name: str, **edits: object) -> Path:
    """A valid contact regression of ``model``, then edited."""
    from protein_performer.interop.identity import model_identity
    from protein_performer.interop.loading import load_model
    from protein_performer.model.contact_head import ContactRegression

    loaded = load_model(model, "cpu")
    reg = ContactRegression([0.5, -0.5, 0.25, 0.0], -1.0, [1, 2], [0, 1], **model_identity(loaded))
    path = work / f"{name}.json"
    path.write_text(json.dumps({**reg.to_dict(), **edits}))
    return path


def _report_check(path: Path) -> Callable[[], str | None]:
    def check() -> str | None:
        import re

        text = path.read_text(encoding="utf-8")
        meta = re.search(r"<script type='application/json' id='report-meta'>(.*?)</script>", text)
        if meta is None or json.loads(meta.group(1))["name"] != HOSTILE_ID:
            return "the metadata JSON does not parse back to the record id"
        return "the id closed a script block" if "<script>alert" in text else None

    return check


def _png_check(out_dir: Path) -> Callable[[], str | None]:
    def check() -> str | None:
        from PIL import Image

        sizes = [Image.open(p).size for p in out_dir.glob("*.png")]
        if not sizes:
            return "no PNG written"
        return None if max(max(s) for s in sizes) < 8000 else f"a figure of {max(sizes)} px"

    return check


def build(work: Path) -> list[Case]:
    """Every case's files under ``work``, and the cases."""
    mlm, clm = _models(work)
    fasta = _write(work / "in.fasta", f">a one\n{SEQ}\n>b two\n{SEQ[::-1]}\n")
    changed = _write(work / "changed.fasta", f">a one\n{SEQ[::-1]}\n>b two\n{SEQ}\n")
    hostile = _write(work / "hostile.fasta", f">{HOSTILE_ID}\n{SEQ}\n")
    dna = _write(work / "dna.fasta", ">d\nACGTACGTACGTNNACGT\n>r\nACGUACGUAGCU\n")
    stale = _embedded(mlm, fasta, work / "stale.h5")
    import torch

    view = torch.full((1,), float("nan")).expand(10**6, 10**6)
    cases = [
        Case("report-script", _cli("visualize", mlm, hostile, "--device", "cpu",
             "--html", work / "r.html"), "ok", "", _report_check(work / "r.html")),
        *(
            Case(f"h5-{how}", _cli("embed", mlm, fasta,
                 _crafted_h5(mlm, fasta, work, how), "--resume", "--no-progress"),
                 "error", says)
            for how, says in (("external", "stored externally"), ("soft-link", "is a SoftLink"),
                              ("declared-1e9", "declares shape (1000000000"))
        ),
        Case("resume-stale", _cli("embed", mlm, changed, stale, "--resume",
             "--no-progress"), "error", "with another sequence than"),
        *(
            Case(f"regression-{name}", _cli("contacts", "predict", mlm, fasta,
                 work / f"c-{name}.h5", "--regression",
                 _regression(mlm, work, name, **edit), "--no-progress"), "error", says)
            for name, edit, says in (
                ("nan", {"coef": [float("nan"), 0, 0, 0]}, "must be finite"),
                ("inf-intercept", {"intercept": float("inf")}, "must be finite"),
                ("1e308", {"coef": [1e308] * 4}, "at most"),
                ("bad-heads", {"heads": [-1, 0]}, "out of range"))
        ),
        Case("safetensors-dtype", _cli("embed", _lying_dtype(mlm, work / "lies"),
             fasta, work / "l.h5"), "error", "torch.int32 vs model"),
        Case("zero-stride-view", _cli("embed", _checkpoint(work, "view.ckpt",
             {"model.embed_tokens.weight": view}), fasta, work / "v.h5"), "error",
             "not finite"),
        Case("zip-bomb", _cli("embed", _zip_bomb(work), fasta, work / "z.h5"),
             "error", "inflate to"),
        *(
            Case(f"config-{key}", _cli("embed", _edit_config(mlm, work / key, **{key: value}),
                 fasta, work / f"{key}.h5"), "error", key)
            for key, value in (("favor_chunk_size", 10**9), ("rotary_base", 1e308),
                               ("layer_norm_eps", 1e308))
        ),
        Case("stdout-closed", _cli("generate", clm, "-", "--num", "1", "--max-length", "8"),
             "error", "standard output is closed", shell_closes_stdout=True),
        Case("dna-input", _cli("score", mlm, dna, work / "dna.csv",
             "--no-progress"), "ok", "looks like DNA or RNA"),
        Case("output-dir-slash", _cli("score", mlm, fasta, f"{work}/not_yet/"),
             "error", "is a directory"),
    ]  # fmt: skip
    labels = _write(work / "labels.csv", b"sequence,label\nMKT,1\nMA\xffG,2\n")
    cases.append(Case("labels-not-utf8", _cli("finetune", f"base={mlm}", f"data.train={labels}",
                      f"paths.output_dir={work / 'ft'}"), "error", "is not UTF-8"))  # fmt: skip
    for tag, rid in (("mathtext", "$\\foo{$"), ("100kB", "x" * 100_000)):
        one = work / f"id-{tag}.fasta"
        one.write_text(f">{rid}\n{SEQ}\n")
        out = work / f"png-{tag}"
        cases.append(Case(f"png-id-{tag}", _cli("visualize", mlm, one, "--device",
                          "cpu", "--out-dir", out), "ok", "", _png_check(out)))  # fmt: skip
    cases += lifecycle_cases(work, mlm, clm, fasta)
    cases += policy_cases(work, mlm, clm, fasta)
    return cases


# --------------------------------------------------------------------------------------------
# Issue 42, the output policy (locks, outputs vs inputs, sidecars, benchmark, cells, escapes).


def _unchanged(*paths: Path) -> Callable[[], str | None]:
    """A check that ``paths`` keep the bytes they had when the case was built."""
    before = {p: p.read_bytes() for p in paths}

    def check() -> str | None:
        changed = [str(p) for p, data in before.items()
                   if not p.is_file() or p.read_bytes() != data]  # fmt: skip
        return f"changed: {', '.join(changed)}" if changed else None

    return check


def _absent(*paths: Path) -> Callable[[], str | None]:
    def check() -> str | None:
        there = [str(p) for p in paths if p.exists() or p.is_symlink()]
        return f"written: {', '.join(there)}" if there else None

    return check


def reference_file(path: Path, dms_id: str, target_seq: str | None = None) -> Path:
    """A one-assay ProteinGym reference (the repository's TEM-1 scan) with ``dms_id``."""
    import csv

    with open(REPO / "data" / "proteingym" / "reference_two_assays.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    row["DMS_id"] = dms_id
    if target_seq is not None:
        row["target_seq"] = target_seq
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    return path


def _cells_check(path: Path, column: int, want: str) -> Callable[[], str | None]:
    """A check that the table's cells in ``column`` start with ``'`` where they start with a
    formula prefix and the score column (the last) stays numbers."""
    import csv

    def check() -> str | None:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
        cells = [r[column] for r in rows]
        if want not in cells:
            return f"no cell {want!r} in column {column}: {cells[:4]}"
        if any(c[:1] in "=+@" for c in cells):
            return f"a formula cell: {cells[:4]}"
        try:
            [float(r[-1]) for r in rows[1:]]
        except ValueError:
            return "the score column is not numbers"
        return None

    return check


def policy_cases(work: Path, mlm: Path, clm: Path, fasta: Path) -> list[Case]:
    """The issue-42 cases of the output policy (built under ``work/policy``)."""
    w = work / "policy"
    w.mkdir()
    pg = REPO / "data" / "proteingym"
    cases: list[Case] = []
    # A lock planted as a symlink to the user's file: refused, the file untouched.
    victim = _write(w / "victim.txt", "precious\n")
    (w / "shared").mkdir()
    os.symlink(victim, w / "shared" / ".out.csv.lock")
    cases.append(Case("lock-symlink", _cli("score", mlm, fasta, w / "shared" /
                      "out.csv"), "error", "symbolic link", _unchanged(victim)))  # fmt: skip
    # DMS_id used as a path.
    for tag, dms_id in (("abs", str(w / "PWNED")), ("dotdot", "../../dms/assay")):
        ref = reference_file(w / f"ref-{tag}.csv", dms_id)
        cases.append(Case(f"dms-id-{tag}", _cli("benchmark", "proteingym", ref, pg,
                          w / f"pg-{tag}", mlm), "error", "cannot name a file",
                          _absent(w / "PWNED.csv", w / f"pg-{tag}")))  # fmt: skip
    # OUT_DIR == DMS_DIR, and OUT_DIR holding the DMS folder.
    o2 = w / "o2"
    (o2 / "scores").mkdir(parents=True)
    assay = o2 / "scores" / "BLAT_ECOLX_Stiffler_2015.csv"
    shutil.copy(pg / assay.name, assay)
    ref = reference_file(w / "ref.csv", "BLAT_ECOLX_Stiffler_2015")
    for tag, out in (("equal", o2 / "scores"), ("holding", o2)):
        cases.append(Case(f"benchmark-out-{tag}", _cli("benchmark", "proteingym", ref,
                          o2 / "scores", out, mlm, "--overwrite"), "error",
                          "never replaces an input", _unchanged(assay)))  # fmt: skip
    # A kill between scores/<id>.csv and its .json: another model's table under the run file.
    run = _cli("benchmark", "proteingym", ref, pg, w / "pg", mlm,
               "--no-progress")  # fmt: skip
    subprocess.run(run, check=True, capture_output=True)
    scores = w / "pg" / "scores" / "BLAT_ECOLX_Stiffler_2015.csv"
    good = scores.read_bytes()
    subprocess.run(_cli("benchmark", "proteingym", ref, pg, w / "pg-clm", clm,
                        "--no-progress"), check=True, capture_output=True)  # fmt: skip
    other = (w / "pg-clm" / "scores" / scores.name).read_bytes()
    for tag, target in (("kill", None), ("target-seq", "M" + SEQ)):
        dest = w / f"pg-{tag}"
        shutil.copytree(w / "pg", dest)
        if target is None:
            (dest / "scores" / scores.name).write_bytes(other)
            argv = [*run[:-3], str(dest), str(mlm), "--no-progress"]
            cases.append(Case("benchmark-reuse-kill", argv, "ok", "a run stopped between them",
                              lambda d=dest: None if (d / "scores" / scores.name).read_bytes()
                              == good else "the table is not this model's scores"))  # fmt: skip
        else:
            changed = reference_file(w / "ref-changed.csv", "BLAT_ECOLX_Stiffler_2015", target)
            cases.append(Case("benchmark-target-seq", _cli("benchmark", "proteingym",
                              changed, pg, dest, mlm), "error",
                              "differs: target_seq_sha256",
                              _unchanged(dest / "scores" / scores.name)))  # fmt: skip
    cases.append(Case("benchmark-model-name-mutant", _cli("benchmark", "proteingym", ref,
                      pg, w / "pg-m", mlm, "--model-name", "mutant"), "error",
                      "column the tables already have", _absent(w / "pg-m")))  # fmt: skip
    cases.append(Case("benchmark-model-name-formula", _cli("benchmark", "proteingym", ref,
                      pg, w / "pg-f", mlm, "--model-name", "=1+2",
                      "--no-progress"), "ok", "",
                      _cells_check(w / "pg-f" / "scores" / scores.name, 3, "'=1+2")))  # fmt: skip
    # Formula ids in score's table (the negative scores stay numbers).
    evil = w / "evil.fasta"
    evil.write_text(f">=HYPERLINK(\"http://x\",\"y\")\n{SEQ}\n>+cmd|' /C calc'!A0\n{SEQ}\n")
    cases.append(Case("csv-formula-ids", _cli("score", mlm, evil, w / "evil.csv",
                      "--no-progress"), "ok", "", _cells_check(w / "evil.csv", 0,
                      "'=HYPERLINK(\"http://x\",\"y\")")))  # fmt: skip
    # Terminal escapes in an id listed by visualize --record.
    esc = _write(w / "esc.fasta", f">\x1b[2J\x1b]0;pwned\x07x\n{SEQ}\n")
    cases.append(Case("record-id-escapes", _cli("visualize", mlm, esc, "--record",
                      "nope", "--out-dir", w / "viz"), "error", "'\\x1b[2J"))  # fmt: skip
    # Outputs inside input directories.
    cases.append(Case("embed-into-export", _cli("embed", mlm, fasta,
                      mlm / "model.safetensors", "--overwrite"), "error",
                      "inside the input directory", _unchanged(mlm / "model.safetensors")))
    store = w / "store"
    subprocess.run(_cli("preprocess", fasta, "--out", store, "--no-progress"),
                   check=True, capture_output=True)  # fmt: skip
    cases.append(Case("score-into-store", _cli("score", mlm, store,
                      store / "tokens.bin", "--overwrite"), "error",
                      "inside the input directory", _unchanged(store / "tokens.bin")))
    cases.append(Case("train-into-store", _cli("train", f"data.path={store}",
                      f"paths.output_dir={store / 'run'}"), "error",
                      "inside the input directory", _absent(store / "run")))  # fmt: skip
    # --context: - reads standard input; a missing name is an error, never a sequence.
    homologs = f">h1\n{SEQ}\n>h2\n{SEQ[::-1]}\n".encode()
    cases.append(Case("context-stdin", _cli("score", clm, fasta, w / "ctx.csv",
                      "--context", "-", "--no-progress"), "ok", "read 2 of 2 homolog(s)",
                      stdin=homologs))  # fmt: skip
    cases.append(Case("context-missing-name", _cli("score", clm, fasta,
                      w / "ctx2.csv", "--context", "MKTAYIAK"), "error",
                      "MKTAYIAK does not exist", _absent(w / "ctx2.csv")))  # fmt: skip
    # The OUT.context.json sidecar: never replaced without --overwrite; a run without
    # --context removes a stale one.
    wt = _write(w / "wt.fasta", f">wt\n{SEQ}\n")
    dms = _write(w / "dms.csv", "mutant\nK2R\nT3S\n")
    mine = _write(w / "sv.csv.context.json", "the user's own notes\n")
    cases.append(Case("sidecar-exists", _cli("score-variants", clm, wt, dms,
                      w / "sv.csv"), "error", "sv.csv.context.json already exists",
                      _unchanged(mine)))  # fmt: skip
    (w / "stale.csv").write_text("old\n")
    (w / "stale.csv.context.json").write_text("{}\n")
    cases.append(Case("sidecar-stale", _cli("score-variants", clm, wt, dms,
                      w / "stale.csv", "--overwrite", "--no-progress"), "ok", "",
                      _absent(w / "stale.csv.context.json")))  # fmt: skip
    return cases


# --------------------------------------------------------------------------------------------
# Issue 42, the lifecycle half (configs that build only what their group is for, trust
# boundaries checked when opened, bounds, child processes); the output-policy half is its own
# block. Each case is also a regression test in tests/ (named in the case's comment).
# --------------------------------------------------------------------------------------------
def _crafted_store(work: Path, fasta: Path, name: str, file: str, edit: Callable) -> Path:
    """A preprocessed store with one of its files rewritten (sizes kept)."""
    store = work / name
    subprocess.run(_cli("preprocess", fasta, "--out", store, "--no-progress"),
                   check=True, capture_output=True)  # fmt: skip
    path = store / file
    path.write_bytes(edit(path.read_bytes()))
    return store


def _finetuned(work: Path, **lora: object) -> Path:
    """A tiny fine-tuned checkpoint (LoRA r=2, an MLP head) with its ``lora`` dict edited."""
    import torch

    from protein_performer.interop.finetuned import add_lora, finetuned_checkpoint
    from protein_performer.model.task_heads import HeadConfig, TaskHead

    loaded = _tiny(work, depth=1, nb_features=8)
    loaded.kind, loaded.lora = "finetuned", {"r": 2}
    loaded.adapters = add_lora(loaded.model, {"r": 2})
    loaded.task = TaskHead(HeadConfig(dim=16, hidden=4))
    ckpt = finetuned_checkpoint(loaded)
    ckpt["lora"] = {**ckpt["lora"], **lora}
    path = work / f"ft-{'-'.join(map(str, lora.values()))}.ckpt"
    torch.save(ckpt, path)
    return path


def _intact(path: Path, text: str) -> Callable[[], str | None]:
    return lambda: None if path.read_text() == text else f"{path} was changed"


def lifecycle_cases(work: Path, mlm: Path, clm: Path, fasta: Path) -> list[Case]:
    """The lifecycle half of issue 42's cases."""
    victim = _write(work / "victim.txt", "keep me")
    afile = _write(work / "a-file", "not a directory")
    exact = _export(work, "exact", depth=1, attention="exact")
    homologs = _write(work / "homologs.fasta", f">h1\n{SEQ}\n>h2\n{SEQ[::-1]}\n")
    wt = _write(work / "wt.fasta", f">wt\n{SEQ}\n")
    mutations = _write(work / "mutations.csv", "mutant\nM1A\n")
    swap = lambda d: d[:8] + d[16:24] + d[8:16] + d[24:]  # noqa: E731 - offsets 1 and 2
    train = ("train", "experiment=demo_clm", "trainer.max_steps=1", f"paths.root_dir={work}")
    return [
        # tests/training/test_targets.py
        Case("config-target-open", _cli(*train, "+callbacks.evil._target_=builtins.open",
             f"+callbacks.evil._args_=[{victim},w]"), "error", "callbacks.evil._target_",
             _intact(victim, "keep me")),
        Case("config-hydra-callback", _cli(*train,
             "+hydra.callbacks.x._target_=pathlib.Path.write_text"), "error",
             "hydra.callbacks.x._target_"),
        # tests/data/test_store.py
        Case("store-lying-id-offsets", _cli("stats", _crafted_store(
             work, fasta, "lying-ids", "ids.offsets.bin", swap)), "error", "ids.offsets.bin"),
        Case("store-newline-description", _cli("stats", _crafted_store(
             work, fasta, "nl-desc", "descriptions.txt", lambda d: d.replace(b"one", b"\n>x"))),
             "error", "line break"),
        # tests/io/test_threads.py
        Case("threads-100000", _cli("score", mlm, fasta, work / "t.csv",
             "--threads", "100000", "--no-progress"), "ok", "is more than the"),
        # tests/inference/test_generation.py
        Case("generate-num-0", _cli("generate", clm, work / "g0.fasta", "--num", "0",
             "--max-length", "8"), "error", "--num must be at least 1"),
        # tests/interop/test_finetuned.py
        Case("finetuned-lora-r-1e9", _cli("embed", _finetuned(work, r=10**9), fasta,
             work / "ft.h5"), "error", "exceeds the model width"),
        Case("finetuned-lora-r-text", _cli("embed", _finetuned(work, r="8"), fasta,
             work / "ft2.h5"), "error", "r must be a positive integer"),
        # tests/training/test_linearize.py
        Case("linearize-lora-rank-1e8", _cli("linearize", exact, work / "lin1",
             "--data", fasta, "--lora-rank", "100000000", "--lora-steps", "1",
             "--no-progress"), "error", "exceeds the model width"),
        Case("linearize-max-len-1e12", _cli("linearize", exact, work / "lin2",
             "--data", fasta, "--max-len", "1000000000000", "--no-progress"), "error",
             "max_len must be in"),
        # tests/inference/test_ensemble.py
        Case("context-orders-1e8", _cli("score-variants", clm, wt, mutations,
             work / "o.csv", "--context", homologs, "--context-orders", "100000000"),
             "error", "more than 1024"),
        # tests/training/test_runner.py
        Case("run-dir-is-a-file", _cli(*train, f"paths.output_dir={afile}"), "error",
             "is a file, not a directory", _intact(afile, "not a directory")),
    ]  # fmt: skip


def run_case(case: Case, timeout: float) -> dict[str, object]:
    """Run one case; its row of the report."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    argv = case.argv
    if case.shell_closes_stdout:  # the command starts with file descriptor 1 closed
        argv = ["sh", "-c", 'exec "$@" >&-', "sh", *argv]
    try:
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              input=case.stdin, env=env, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"case": case.name, "ok": False, "rc": None, "said": f"timed out after {timeout} s"}
    err = (proc.stderr or b"").decode("utf-8", errors="replace")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if case.want == "error":
        ok = proc.returncode == 2 and len(errors) == 1 and case.says in errors[0]
        ok = ok and "Traceback" not in err
        said = errors[0] if errors else err.strip()[-300:]
        problem = case.check() if ok and case.check else None
        ok, said = ok and problem is None, problem or said
    else:
        problem = case.check() if proc.returncode == 0 and case.check else None
        ok = proc.returncode == 0 and case.says in err and problem is None
        said = problem or (err.strip().splitlines() or [""])[-1][:300]
    return {"case": case.name, "ok": ok, "rc": proc.returncode, "said": said}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these cases")
    p.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per case (default 120)")
    args = p.parse_args(argv)
    work = args.out or Path(tempfile.mkdtemp(prefix="pp_attack_"))
    work.mkdir(parents=True, exist_ok=True)
    cases = build(work)
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in cases})
        if unknown:
            p.error(f"no case {', '.join(unknown)}; cases: {', '.join(c.name for c in cases)}")
        cases = [c for c in cases if c.name in args.only]
    rows = []
    for case in cases:
        row = run_case(case, args.timeout)
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {case.name:22s} exit {row['rc']}  {row['said']}")
    (work / "report.json").write_text(json.dumps({"cases": rows}, indent=1))
    failed = [r["case"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} case(s) ok; report: {work / 'report.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
