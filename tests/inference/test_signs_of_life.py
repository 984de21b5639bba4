"""Signs of life: progress lines inside a window at the interval, the default threads said in
one line, and inference commands that never import Lightning, Hydra or transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protein_performer.io import threads
from tests.paths import REPO

HEAVY = ("pytorch_lightning", "lightning", "hydra", "omegaconf", "transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from protein_performer.interop.export import export_model
    from tests.inference.test_embedding import tiny_loaded

    root = tmp_path_factory.mktemp("models")
    export_model(tiny_loaded(), root / "mlm")
    export_model(tiny_loaded("clm"), root / "clm")
    return root


def _timed_lines(cmd: list[str], env: dict[str, str]) -> tuple[int, list[tuple[float, str]]]:
    """Run ``cmd``; each stderr line with the time it arrived."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for raw in proc.stderr:  # type: ignore[union-attr]
            lines.append((time.monotonic(), raw.decode().rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    rc = proc.wait(timeout=600)
    reader.join()
    return rc, lines


@pytest.mark.slow  # a scoring subprocess
def test_pseudo_ppl_prints_inside_a_window_at_the_interval(models: Path, tmp_path: Path) -> None:
    """One window of two long records (hundreds of masked forwards): the log still gets a line
    about every interval, each saying where in the window the run is, not one at the end."""
    fasta = tmp_path / "x.fasta"
    seq = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQ" * 6
    fasta.write_text(f">a\n{seq}\n>b\n{seq[::-1]}\n")
    every = 0.1  # a fast machine scores the window in about half a second
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PROTEIN_PERFORMER_PROGRESS_INTERVAL": str(every),
    }
    cmd = [sys.executable, "-m", "protein_performer.cli.main", "score", str(models / "mlm"),
           str(fasta), str(tmp_path / "s.csv"), "--toks-per-batch", "2048"]  # fmt: skip
    rc, lines = _timed_lines(cmd, env)
    err = "\n".join(text for _, text in lines)
    assert rc == 0, err
    assert lines[0][1] == "threads: 1 (OMP_NUM_THREADS); change with --threads N", err
    # The residues' bar with its rate and ETA (0.6.0; "masked passes" lines before).
    bars = [(t, text) for t, text in lines if text.startswith("pseudo-ppl:")]
    inside = [(t, text) for t, text in bars if "100%" not in text]
    assert len(inside) >= 3, err  # before: one line, at the end of the window
    times = [t for t, text in lines if text.startswith("pseudo-ppl")]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # The interval plus one batch (a few forwards of a tiny model); generous on a busy machine.
    assert max(gaps) < every + 3.0, (gaps, err)


def test_beat_prints_at_most_every_interval(monkeypatch, capsys) -> None:
    """In process, with a clock that only moves when told: a beat prints only after an
    interval since the last line, with its note; pending start lines come first."""
    from protein_performer.io import progress as prog

    now = [100.0]
    monkeypatch.setattr(prog.time, "monotonic", lambda: now[0])
    monkeypatch.setenv("PROTEIN_PERFORMER_PROGRESS_INTERVAL", "10")
    prog.announce("threads: 3 (test)")
    with prog.progress(None, "seq", "score") as bar:
        prog.beat("1/9 passes")  # too early: only the pending line
        now[0] += 10
        prog.beat("2/9 passes")
        now[0] += 5
        prog.beat("3/9 passes")
        now[0] += 5
        prog.beat("4/9 passes")
        bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "threads: 3 (test)"
    assert [line.split("(")[-1] for line in lines[1:3]] == ["2/9 passes)", "4/9 passes)"]
    assert lines[-1].startswith("score: 1seq") and len(lines) == 4
    prog.beat("no progress open")  # nothing open, nothing pending: silent
    assert capsys.readouterr().err == ""


def test_default_threads_leave_room_for_other_processes(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: set(range(8)))
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: len(cpus))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    for others, want in ((0, 8), (3, 5), (7, 1), (40, 1)):
        monkeypatch.setattr(threads, "running_elsewhere", lambda n=others: n)
        assert threads.default_threads()[0] == want
    monkeypatch.setattr(threads, "running_elsewhere", lambda: None)  # no /proc: all cores
    assert threads.default_threads()[0] == 8
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 64)  # bound to 8 of 64: its own
    assert threads.default_threads() == (8, "the 8 core(s) this process is bound to")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads() == (3, "OMP_NUM_THREADS")


def test_inference_commands_never_import_lightning_hydra_or_transformers(
    models: Path, tmp_path: Path
) -> None:
    """embed / score / generate / export of a few records stay close to `import torch`: the
    training and interop stacks (seconds to import) load only where they are needed. One
    process runs the four commands, then lists what they imported."""
    fasta = tmp_path / "x.fasta"
    fasta.write_text("".join(f">r{i}\nMKTAYIAKQRQISFVKSHFSRQ\n" for i in range(3)))
    mlm, clm = str(models / "mlm"), str(models / "clm")
    commands = [
        ["embed", mlm, str(fasta), str(tmp_path / "e.h5")],
        ["score", mlm, str(fasta), str(tmp_path / "s.csv")],
        ["generate", clm, str(tmp_path / "g.fasta"), "--num", "2", "--max-length", "12"],
        ["export", mlm, str(tmp_path / "exported")],
    ]
    code = (
        "import sys; from protein_performer.cli.main import main; "
        f"rcs = [main(argv) for argv in {commands!r}]; "
        f"print(rcs, sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0] []", (proc.stdout, proc.stderr)
