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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import _checks

SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQ"
HOSTILE_ID = "</script><script>alert(1)</script>"
#: More to check after a case's run: what is wrong, or None.
Check = Callable[[], str | None]


@dataclass
class Case:
    """One command on crafted files and what it must do."""

    name: str
    args: Sequence[object]  # protein-performer's arguments (paths as they are spelled)
    want: str  # "error": exit 2 and one error line; "ok": exit 0
    says: str  # text the error line (or, for "ok", stderr) must hold
    check: Check | None = None  # more to check after the run
    keeps: Sequence[Path] = ()  # files that must keep the bytes they have when the case is built
    absent: Sequence[Path] = ()  # paths the command must not write
    shell_closes_stdout: bool = False
    stdin: bytes | None = None  # fed to the command's standard input (default: none, closed)

    def __post_init__(self) -> None:
        self.kept = {p: p.read_bytes() for p in self.keeps}

    def problem(self) -> str | None:
        """What the run left wrong besides its exit status and message, or None."""
        changed = [str(p) for p, data in self.kept.items()
                   if not p.is_file() or p.read_bytes() != data]  # fmt: skip
        there = [str(p) for p in self.absent if p.exists() or p.is_symlink()]
        if changed or there:
            return f"changed: {', '.join(changed)}" if changed else f"written: {', '.join(there)}"
        return self.check() if self.check else None


def _write(path: Path, data: str | bytes) -> Path:
    """``path`` holding ``data`` (text or bytes)."""
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def _config(**edits: object) -> object:
    """The tiny ``PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, **edits)``."""
    from protein_performer.model.config import PerformerConfig

    return PerformerConfig(**{"dim": 16, "depth": 2, "heads": 2, "ff_dim": 32, **edits})


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


def _crafted_h5(embedded: Path, how: str) -> Path:
    """A copy of a finished embed output with its mean array made to read elsewhere or declare
    more."""
    import h5py
    import numpy as np

    out = Path(shutil.copy(embedded, embedded.with_name(f"{how}.h5")))
    secret = _write(out.with_name("secret.bin"), np.arange(64, dtype=np.float32).tobytes())
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


def _report_check(path: Path) -> Check:
    def check() -> str | None:
        import re

        text = path.read_text(encoding="utf-8")
        meta = re.search(r"<script type='application/json' id='report-meta'>(.*?)</script>", text)
        if meta is None or json.loads(meta.group(1))["name"] != HOSTILE_ID:
            return "the metadata JSON does not parse back to the record id"
        return "the id closed a script block" if "<script>alert" in text else None

    return check


def _png_check(out_dir: Path) -> Check:
    def check() -> str | None:
        from PIL import Image

        sizes = [Image.open(p).size for p in out_dir.glob("*.png")]
        if not sizes:
            return "no PNG written"
        return None if max(max(s) for s in sizes) < 8000 else f"a figure of {max(sizes)} px"

    return check


def build(work: Path) -> list[Case]:
    """Every case's files under ``work``, and the cases."""
    import torch

    mlm, clm = (_checks.tiny_export(work / o, _config(nb_features=8, objective=o))
                for o in ("mlm", "clm"))
    fasta = _write(work / "in.fasta", f">a one\n{SEQ}\n>b two\n{SEQ[::-1]}\n")
    changed = _write(work / "changed.fasta", f">a one\n{SEQ[::-1]}\n>b two\n{SEQ}\n")
    hostile = _write(work / "hostile.fasta", f">{HOSTILE_ID}\n{SEQ}\n")
    dna = _write(work / "dna.fasta", ">d\nACGTACGTACGTNNACGT\n>r\nACGUACGUAGCU\n")
    labels = _write(work / "labels.csv", b"sequence,label\nMKT,1\nMA\xffG,2\n")
    stale = work / "stale.h5"
    _checks.setup("embed", mlm, fasta, stale, "--no-progress")
    view = torch.full((1,), float("nan")).expand(10**6, 10**6)
    torch.save({"state_dict": {"model.embed_tokens.weight": view}}, work / "view.ckpt")
    return [
        Case("report-script", ("visualize", mlm, hostile, "--device", "cpu",
             "--html", work / "r.html"), "ok", "", _report_check(work / "r.html")),
        *(
            Case(f"h5-{how}", ("embed", mlm, fasta, _crafted_h5(stale, how), "--resume",
                 "--no-progress"), "error", says)
            for how, says in (("external", "stored externally"), ("soft-link", "is a SoftLink"),
                              ("declared-1e9", "declares shape (1000000000"))
        ),
        Case("resume-stale", ("embed", mlm, changed, stale, "--resume",
             "--no-progress"), "error", "with another sequence than"),
        *(
            Case(f"regression-{name}", ("contacts", "predict", mlm, fasta,
                 work / f"c-{name}.h5", "--regression",
                 _regression(mlm, work, name, **edit), "--no-progress"), "error", says)
            for name, edit, says in (
                ("nan", {"coef": [float("nan"), 0, 0, 0]}, "must be finite"),
                ("inf-intercept", {"intercept": float("inf")}, "must be finite"),
                ("1e308", {"coef": [1e308] * 4}, "at most"),
                ("bad-heads", {"heads": [-1, 0]}, "out of range"))
        ),
        Case("safetensors-dtype", ("embed", _lying_dtype(mlm, work / "lies"),
             fasta, work / "l.h5"), "error", "torch.int32 vs model"),
        Case("zero-stride-view", ("embed", work / "view.ckpt", fasta, work / "v.h5"), "error",
             "not finite"),
        Case("zip-bomb", ("embed", _zip_bomb(work), fasta, work / "z.h5"),
             "error", "inflate to"),
        *(
            Case(f"config-{key}", ("embed", _edit_config(mlm, work / key, **{key: value}),
                 fasta, work / f"{key}.h5"), "error", key)
            for key, value in (("favor_chunk_size", 10**9), ("rotary_base", 1e308),
                               ("layer_norm_eps", 1e308))
        ),
        Case("stdout-closed", ("generate", clm, "-", "--num", "1", "--max-length", "8"),
             "error", "standard output is closed", shell_closes_stdout=True),
        Case("dna-input", ("score", mlm, dna, work / "dna.csv",
             "--no-progress"), "ok", "looks like DNA or RNA"),
        Case("output-dir-slash", ("score", mlm, fasta, f"{work}/not_yet/"),
             "error", "is a directory"),
        Case("labels-not-utf8", ("finetune", f"base={mlm}", f"data.train={labels}",
             f"paths.output_dir={work / 'ft'}"), "error", "is not UTF-8"),
        *(
            Case(f"png-id-{tag}", ("visualize", mlm, _write(work / f"id-{tag}.fasta",
                 f">{rid}\n{SEQ}\n"), "--device", "cpu", "--out-dir", work / f"png-{tag}"),
                 "ok", "", _png_check(work / f"png-{tag}"))
            for tag, rid in (("mathtext", "$\\foo{$"), ("100kB", "x" * 100_000))
        ),
        *lifecycle_cases(work, mlm, clm, fasta),
        *policy_cases(work, mlm, clm, fasta),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Issue 42, the output policy (locks, outputs vs inputs, sidecars, benchmark, cells, escapes).


def _cells_check(path: Path, column: int, want: str) -> Check:
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
    (w / "shared").mkdir(parents=True)
    pg = _checks.REPO / "data" / "proteingym"
    victim = _write(w / "victim.txt", "precious\n")
    os.symlink(victim, w / "shared" / ".out.csv.lock")
    (w / "o2" / "scores").mkdir(parents=True)
    assay = Path(shutil.copy(pg / "BLAT_ECOLX_Stiffler_2015.csv", w / "o2" / "scores"))
    ref = _checks.reference_file(w / "ref.csv", assay.stem)
    # A kill between scores/<id>.csv and its .json: another model's table under the run file.
    _checks.setup("benchmark", "proteingym", ref, pg, w / "pg", mlm, "--no-progress")
    _checks.setup("benchmark", "proteingym", ref, pg, w / "pg-clm", clm, "--no-progress")
    table = Path("scores") / assay.name
    good = (w / "pg" / table).read_bytes()
    for tag in ("kill", "target-seq"):
        shutil.copytree(w / "pg", w / f"pg-{tag}")
    shutil.copy(w / "pg-clm" / table, w / "pg-kill" / table)
    changed = _checks.reference_file(w / "ref-changed.csv", assay.stem, "M" + SEQ)
    ids = ('=HYPERLINK("http://x","y")', "+cmd|' /C calc'!A0")
    evil = _write(w / "evil.fasta", "".join(f">{rid}\n{SEQ}\n" for rid in ids))
    esc = _write(w / "esc.fasta", f">\x1b[2J\x1b]0;pwned\x07x\n{SEQ}\n")
    store = _store(w / "store", fasta)
    homologs = f">h1\n{SEQ}\n>h2\n{SEQ[::-1]}\n".encode()
    wt = _write(w / "wt.fasta", f">wt\n{SEQ}\n")
    dms = _write(w / "dms.csv", "mutant\nK2R\nT3S\n")
    mine = _write(w / "sv.csv.context.json", "the user's own notes\n")
    _write(w / "stale.csv", "old\n")
    _write(w / "stale.csv.context.json", "{}\n")
    return [
        # A lock planted as a symlink to the user's file: refused, the file untouched.
        Case("lock-symlink", ("score", mlm, fasta, w / "shared" / "out.csv"), "error",
             "symbolic link", keeps=[victim]),
        # DMS_id used as a path.
        *(
            Case(f"dms-id-{tag}", ("benchmark", "proteingym", _checks.reference_file(
                 w / f"ref-{tag}.csv", dms_id), pg, w / f"pg-{tag}", mlm), "error",
                 "cannot name a file", absent=[w / "PWNED.csv", w / f"pg-{tag}"])
            for tag, dms_id in (("abs", str(w / "PWNED")), ("dotdot", "../../dms/assay"))
        ),
        # OUT_DIR == DMS_DIR, and OUT_DIR holding the DMS folder.
        *(
            Case(f"benchmark-out-{tag}", ("benchmark", "proteingym", ref, assay.parent, out,
                 mlm, "--overwrite"), "error", "never replaces an input", keeps=[assay])
            for tag, out in (("equal", assay.parent), ("holding", w / "o2"))
        ),
        Case("benchmark-reuse-kill", ("benchmark", "proteingym", ref, pg, w / "pg-kill", mlm,
             "--no-progress"), "ok", "a run stopped between them",
             lambda: None if (w / "pg-kill" / table).read_bytes() == good
             else "the table is not this model's scores"),
        Case("benchmark-target-seq", ("benchmark", "proteingym", changed, pg,
             w / "pg-target-seq", mlm), "error", "differs: target_seq_sha256",
             keeps=[w / "pg-target-seq" / table]),
        Case("benchmark-model-name-mutant", ("benchmark", "proteingym", ref, pg, w / "pg-m",
             mlm, "--model-name", "mutant"), "error", "column the tables already have",
             absent=[w / "pg-m"]),
        Case("benchmark-model-name-formula", ("benchmark", "proteingym", ref, pg, w / "pg-f",
             mlm, "--model-name", "=1+2", "--no-progress"), "ok", "",
             _cells_check(w / "pg-f" / table, 3, "'=1+2")),
        # Formula ids in score's table (the negative scores stay numbers).
        Case("csv-formula-ids", ("score", mlm, evil, w / "evil.csv", "--no-progress"), "ok",
             "", _cells_check(w / "evil.csv", 0, "'=HYPERLINK(\"http://x\",\"y\")")),
        # Terminal escapes in an id listed by visualize --record.
        Case("record-id-escapes", ("visualize", mlm, esc, "--record", "nope", "--out-dir",
             w / "viz"), "error", "'\\x1b[2J"),
        # Outputs inside input directories.
        Case("embed-into-export", ("embed", mlm, fasta, mlm / "model.safetensors",
             "--overwrite"), "error", "inside the input directory",
             keeps=[mlm / "model.safetensors"]),
        Case("score-into-store", ("score", mlm, store, store / "tokens.bin", "--overwrite"),
             "error", "inside the input directory", keeps=[store / "tokens.bin"]),
        Case("train-into-store", ("train", f"data.path={store}",
             f"paths.output_dir={store / 'run'}"), "error", "inside the input directory",
             absent=[store / "run"]),
        # --context: - reads standard input; a missing name is an error, never a sequence.
        Case("context-stdin", ("score", clm, fasta, w / "ctx.csv", "--context", "-",
             "--no-progress"), "ok", "read 2 of 2 homolog(s)", stdin=homologs),
        Case("context-missing-name", ("score", clm, fasta, w / "ctx2.csv", "--context",
             "MKTAYIAK"), "error", "MKTAYIAK does not exist", absent=[w / "ctx2.csv"]),
        # The OUT.context.json sidecar: never replaced without --overwrite; a run without
        # --context removes a stale one.
        Case("sidecar-exists", ("score-variants", clm, wt, dms, w / "sv.csv"), "error",
             "sv.csv.context.json already exists", keeps=[mine]),
        Case("sidecar-stale", ("score-variants", clm, wt, dms, w / "stale.csv",
             "--overwrite", "--no-progress"), "ok", "", absent=[w / "stale.csv.context.json"]),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Issue 42, the lifecycle half (configs that build only what their group is for, trust
# boundaries checked when opened, bounds, child processes); the output-policy half is its own
# block. Each case is also a regression test in tests/ (named in the case's comment).
# --------------------------------------------------------------------------------------------
def _store(store: Path, fasta: Path, file: str = "", edit: Callable = bytes) -> Path:
    """A preprocessed store of ``fasta``, its ``file`` (if named) rewritten by ``edit``."""
    _checks.setup("preprocess", fasta, "--out", store, "--no-progress")
    if file:
        (store / file).write_bytes(edit((store / file).read_bytes()))
    return store


def _finetuned(work: Path, **lora: object) -> Path:
    """A tiny fine-tuned checkpoint (LoRA r=2, an MLP head) with its ``lora`` dict edited."""
    import torch

    from protein_performer.interop.finetuned import add_lora, finetuned_checkpoint
    from protein_performer.model.task_heads import HeadConfig, TaskHead

    loaded = _checks.tiny_lm(work, _config(depth=1, nb_features=8))
    loaded.kind, loaded.lora = "finetuned", {"r": 2}
    loaded.adapters = add_lora(loaded.model, {"r": 2})
    loaded.task = TaskHead(HeadConfig(dim=16, hidden=4))
    ckpt = finetuned_checkpoint(loaded)
    ckpt["lora"] = {**ckpt["lora"], **lora}
    path = work / f"ft-{'-'.join(map(str, lora.values()))}.ckpt"
    torch.save(ckpt, path)
    return path


def lifecycle_cases(work: Path, mlm: Path, clm: Path, fasta: Path) -> list[Case]:
    """The lifecycle half of issue 42's cases."""
    victim = _write(work / "victim.txt", "keep me")
    afile = _write(work / "a-file", "not a directory")
    exact = _checks.tiny_export(work / "exact", _config(depth=1, attention="exact"))
    homologs = _write(work / "homologs.fasta", f">h1\n{SEQ}\n>h2\n{SEQ[::-1]}\n")
    wt = _write(work / "wt.fasta", f">wt\n{SEQ}\n")
    mutations = _write(work / "mutations.csv", "mutant\nM1A\n")
    swap = lambda d: d[:8] + d[16:24] + d[8:16] + d[24:]  # noqa: E731 - offsets 1 and 2
    train = ("train", "experiment=demo_clm", "trainer.max_steps=1", f"paths.root_dir={work}")
    return [
        # tests/training/test_targets.py
        Case("config-target-open", (*train, "+callbacks.evil._target_=builtins.open",
             f"+callbacks.evil._args_=[{victim},w]"), "error", "callbacks.evil._target_",
             keeps=[victim]),
        Case("config-hydra-callback", (*train,
             "+hydra.callbacks.x._target_=pathlib.Path.write_text"), "error",
             "hydra.callbacks.x._target_"),
        # tests/data/test_store.py
        Case("store-lying-id-offsets", ("stats", _store(
             work / "lying-ids", fasta, "ids.offsets.bin", swap)), "error", "ids.offsets.bin"),
        Case("store-newline-description", ("stats", _store(
             work / "nl-desc", fasta, "descriptions.txt", lambda d: d.replace(b"one", b"\n>x"))),
             "error", "line break"),
        # tests/io/test_threads.py
        Case("threads-100000", ("score", mlm, fasta, work / "t.csv",
             "--threads", "100000", "--no-progress"), "ok", "is more than the"),
        # tests/inference/test_generation.py
        Case("generate-num-0", ("generate", clm, work / "g0.fasta", "--num", "0",
             "--max-length", "8"), "error", "--num must be at least 1"),
        # tests/interop/test_finetuned.py
        Case("finetuned-lora-r-1e9", ("embed", _finetuned(work, r=10**9), fasta,
             work / "ft.h5"), "error", "exceeds the model width"),
        Case("finetuned-lora-r-text", ("embed", _finetuned(work, r="8"), fasta,
             work / "ft2.h5"), "error", "r must be a positive integer"),
        # tests/training/test_linearize.py
        Case("linearize-lora-rank-1e8", ("linearize", exact, work / "lin1",
             "--data", fasta, "--lora-rank", "100000000", "--lora-steps", "1",
             "--no-progress"), "error", "exceeds the model width"),
        Case("linearize-max-len-1e12", ("linearize", exact, work / "lin2",
             "--data", fasta, "--max-len", "1000000000000", "--no-progress"), "error",
             "max_len must be in"),
        # tests/inference/test_ensemble.py
        Case("context-orders-1e8", ("score-variants", clm, wt, mutations,
             work / "o.csv", "--context", homologs, "--context-orders", "100000000"),
             "error", "more than 1024"),
        # tests/training/test_runner.py
        Case("run-dir-is-a-file", (*train, f"paths.output_dir={afile}"), "error",
             "is a file, not a directory", keeps=[afile]),
    ]  # fmt: skip


def run_case(case: Case, timeout: float) -> dict[str, object]:
    """Run one case; its row of the report."""
    argv = _checks.cli(*case.args)
    if case.shell_closes_stdout:  # the command starts with file descriptor 1 closed
        argv = ["sh", "-c", 'exec "$@" >&-', "sh", *argv]
    try:
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              input=case.stdin, env=_checks.ENV, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"case": case.name, "ok": False, "rc": None, "said": f"timed out after {timeout} s"}
    err = proc.stderr.decode("utf-8", errors="replace")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if case.want == "error":
        ok = proc.returncode == 2 and len(errors) == 1 and case.says in errors[0]
        ok = ok and "Traceback" not in err
        said = errors[0] if errors else err.strip()[-300:]
    else:
        ok = proc.returncode == 0 and case.says in err
        said = (err.strip().splitlines() or [""])[-1][:300]
    problem = case.problem() if ok else None
    ok, said = ok and problem is None, problem or said
    return {"case": case.name, "ok": ok, "rc": proc.returncode, "said": said}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these cases")
    p.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per case (default 120)")
    args = p.parse_args(argv)
    work = _checks.work_dir(args.out, "pp_attack_")
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
    _checks.write_report(work, {"cases": rows})
    failed = [r["case"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} case(s) ok; report: {work / 'report.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
