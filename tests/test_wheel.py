"""A wheel built with ``pip wheel`` works outside the repository (issue 31, item 6).

Fast: the package-data globs cover every config and demo file. Slow: the wheel is built from
the files a clone holds (``git ls-files``: no stale ``build/``), installed without
dependencies into a fresh venv whose dependencies come from the running interpreter's
site-packages (a ``.pth`` line: the same torch, no download), and run from a directory that is
not the repository with ``PYTHONPATH`` unset: ``train --help`` lists the shipped configs,
``train experiment=demo`` trains on the shipped demo data and ``finetune`` fine-tunes its
checkpoint; run directories land under the launch directory or ``$PROTEIN_PERFORMER_ROOT``.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGE = REPO / "protein_performer"

#: The demo, as short as a run that writes a checkpoint can be.
TINY_DEMO = [
    "experiment=demo", "trainer.max_steps=2", "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1", "data.num_workers=0", "run_name=wheel",
]  # fmt: skip


def test_package_data_ships_every_config_and_demo_file() -> None:
    """pyproject's package-data globs (as setuptools applies them) cover every file under
    conf/ and data/demo/: a config added one folder deeper would otherwise be left out."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = meta["tool"]["setuptools"]["package-data"]["protein_performer"]
    shipped = {p for pattern in patterns for p in PACKAGE.glob(pattern) if p.is_file()}
    wanted = {
        p
        for folder in ("conf", "data/demo")
        for p in (PACKAGE / folder).rglob("*")
        if p.is_file() and p.suffix != ".pyc" and p.name != "__init__.py"
    }
    assert wanted and wanted <= shipped, sorted(map(str, wanted - shipped))


def _clone_files(dest: Path) -> None:
    """The files a clone of the repository holds (tracked, plus new ones not ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
            capture_output=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not available to list the repository's files")
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _labels_csv(path: Path, n: int = 40) -> Path:
    """A small regression table (seeded): label = the sequence's share of K and R."""
    rng = random.Random(0)
    rows = ["sequence,label"]
    for _ in range(n):
        seq = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(20, 40)))
        rows.append(f"{seq},{sum(c in 'KR' for c in seq) / len(seq):.4f}")
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    src, dist, env_dir = base / "src", base / "dist", base / "venv"
    _clone_files(src)
    # No PYTHONPATH: a checkout on it would count as protein_performer already installed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip"]
    # Build isolation, as `pip wheel .` does: the backend pyproject.toml asks for, not whatever
    # setuptools the test's environment happens to hold.
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "-q", "-w", str(dist)], check=True,
                   cwd=base, env=env)  # fmt: skip
    (wheel,) = dist.glob("protein_performer-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, cwd=base, env=env)  # fmt: skip
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site.stdout.strip()) / "outer_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return env_dir


def _run(venv: Path, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k != "PYTHONPATH" and not k.startswith("PROTEIN_PERFORMER_")}  # fmt: skip
    clean.update(env)
    return subprocess.run(
        [str(venv / "bin" / "protein-performer"), *args], cwd=cwd, env=clean,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_the_installed_wheel_trains_and_finetunes_outside_the_repository(
    venv: Path, tmp_path: Path
) -> None:
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import protein_performer; print(protein_performer"
         ".__file__)"], cwd=tmp_path, capture_output=True, text=True, check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(venv)

    helped = _run(venv, ["train", "--help"], tmp_path)
    assert helped.returncode == 0, helped.stderr
    lines = helped.stdout.splitlines()
    groups = next(line for line in lines if line.startswith("config groups (from"))
    assert str(venv) in groups and "demo, demo_clm" in helped.stdout

    trained = _run(venv, ["train", *TINY_DEMO], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    last = tmp_path / "outputs" / "demo" / "wheel" / "checkpoints" / "last.ckpt"
    assert last.is_file() and f"last checkpoint: {last}" in trained.stdout

    # issue 45 #1: with no --data, linearize fits on the demo set shipped inside the wheel
    linear = _run(venv, ["linearize", str(last), "lin", "--steps", "1", "--max-len", "64",
                         "--no-progress"], tmp_path)
    assert linear.returncode == 0, linear.stderr[-3000:]
    assert (tmp_path / "lin" / "config.json").is_file()

    root = tmp_path / "root"
    labels = _labels_csv(tmp_path / "labels.csv")
    tuned = _run(
        venv, ["finetune", f"base={last}", f"data.train={labels}", "task=regression",
               "mode=frozen", "trainer.max_epochs=1", "run_name=ft"],
        tmp_path, PROTEIN_PERFORMER_ROOT=str(root),
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert (root / "outputs" / "finetune" / "ft" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "outputs" / "finetune").exists()
