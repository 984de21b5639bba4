"""The package's floors hold: every import runs downward.

    cli/  (and the package's lazy entry points in __init__.py)
      -> jobs/                              the commands' file drivers, one module per job
      -> inference/api.py                   the API (ProteinLM)
      -> inference/                         its tasks: tensor work on LoadedModel (may draw: viz/)
      -> finetune/                          (fine-tuning: above training, below cli only)
      -> contacts/   training/              (siblings: neither imports the other)
      -> interop/                           weights in and out (one loader, ESM-2, HF)
      -> model/                             the architecture only
      -> data/
      -> io/                                atomic writes, safe checkpoints, columns, ranks
      -> errors, _version                   the low floor
    viz/ beside them: it draws figures from arrays (errors, io, numpy, matplotlib, BLOSUM62,
    plotly for the HTML report).

Every import counts, at module level, inside a function (a lazy import) or under
``TYPE_CHECKING``. Parsed with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGE = "protein_performer"
ROOT = REPO / PACKAGE
#: Top-level modules that form the low floor (below io/); conf/ holds the Hydra YAML, no code.
LOW = {"errors", "conf", "_version"}
_BASE = ["low", "io", "data", "model", "interop"]
#: floor -> the floors it may import (its own included).
ALLOWED: dict[str, set[str]] = {
    "low": {"low"},
    "io": {"low", "io"},
    "data": {"low", "io", "data"},
    "model": {"low", "io", "data", "model"},
    "interop": {*_BASE},
    "training": {*_BASE, "training"},
    "contacts": {*_BASE, "contacts"},
    "finetune": {*_BASE, "training", "finetune"},
    "inference": {*_BASE, "contacts", "inference", "viz"},  # viz: the report's views draw
    "api": {*_BASE, "contacts", "inference", "viz", "api"},
    "jobs": {*_BASE, "contacts", "inference", "api", "jobs"},
    "viz": {"low", "io", "viz"},
    "cli": {*_BASE, "training", "finetune", "contacts", "inference", "api", "jobs", "viz", "cli",
            "package"},
    "package": {*_BASE, "training", "finetune", "contacts", "inference", "api", "jobs", "viz",
                "cli", "package"},
}  # fmt: skip
#: What viz/ may import besides the standard library and the low floor.
VIZ_THIRD_PARTY = {"numpy", "matplotlib", "Bio", "plotly"}


#: Modules that are a floor of their own inside a folder: the API sits above its tasks.
OWN_FLOOR = {f"{PACKAGE}.inference.api": "api"}


def floor_of(module: str) -> str:
    """The floor of a ``protein_performer`` module name (dotted)."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return "package"
    if module in OWN_FLOOR:
        return OWN_FLOOR[module]
    if parts[1] in LOW:
        return "low"
    if parts[1] in ALLOWED and parts[1] not in ("low", "package"):
        return parts[1]
    raise AssertionError(f"{module}: no floor for {parts[1]!r}; add it to LOW or to ALLOWED")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def from_target(module: str, node: ast.ImportFrom, is_package: bool = False) -> str:
    """The module a ``from ... import`` in ``module`` names (a relative one resolved against
    ``module``'s package)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = from_target(module, node, is_package)
            found.append((node.lineno, target))
            # ``from protein_performer import inference`` (or ``from ...inference import api``)
            # names a submodule; ``__version__`` is the package's own attribute (its __init__
            # is loaded before any submodule)
            if target.split(".")[0] == PACKAGE:
                folder = ROOT.parent.joinpath(*target.split("."))
                found += [
                    (node.lineno, f"{target}.{alias.name}")
                    for alias in node.names
                    if (folder / alias.name).is_dir() or (folder / f"{alias.name}.py").is_file()
                ]
    return found


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports of ``module`` that cross a floor upward (or sideways between siblings)."""
    floor = floor_of(module)
    bad: list[str] = []
    for line, target in imports(module, source, is_package):
        top = target.split(".")[0]
        if top == PACKAGE:
            if target == PACKAGE:
                continue  # its attributes; submodules named in it are checked one by one
            if floor_of(target) not in ALLOWED[floor]:
                bad.append(f"{module}:{line} ({floor}) imports {target} ({floor_of(target)})")
        elif floor == "viz" and top not in sys.stdlib_module_names | VIZ_THIRD_PARTY:
            bad.append(f"{module}:{line} (viz draws arrays) imports {target}")
    return bad


def package_modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_floor() -> None:
    assert len(package_modules()) > 60
    for path in package_modules():
        floor_of(module_name(path))


def test_imports_run_downward() -> None:
    bad: list[str] = []
    for path in package_modules():
        name = module_name(path)
        bad += violations(name, path.read_text(encoding="utf-8"), path.name == "__init__.py")
    assert not bad, "imports crossing a floor:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    "module, source",
    [
        ("protein_performer.data.dataset", "from protein_performer.model.config import X"),
        ("protein_performer.interop.loading", "import protein_performer.inference.api"),
        ("protein_performer.training.distill", "def f():\n    from protein_performer import viz"),
        ("protein_performer.inference.api", "from protein_performer.training import train"),
        ("protein_performer.contacts.fit", "from protein_performer.viz.plots import save_figure"),
        ("protein_performer.viz.plots", "from protein_performer.model import X"),
        ("protein_performer.contacts.fit", "from protein_performer.inference.api import load"),
        ("protein_performer.training.train", "from protein_performer.contacts import fit"),
        ("protein_performer.model.performer", "from protein_performer.interop import loading"),
        ("protein_performer.io.atomic", "from protein_performer.data.fasta import read_fasta"),
        ("protein_performer.viz.plots", "import torch"),
        ("protein_performer.io.checkpoints", "from protein_performer.model.performer import X"),
        ("protein_performer.interop.loading", "from ..training import init_weights"),
        ("protein_performer.data.fasta", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
         "    from protein_performer.cli import main"),
        ("protein_performer.inference.scoring", "from typing import TYPE_CHECKING\n"
         "if TYPE_CHECKING:\n    from protein_performer.inference.api import ProteinLM"),
        ("protein_performer.inference.context", "from protein_performer.inference import api"),
        ("protein_performer.inference.embedding", "from .api import ProteinLM"),
        ("protein_performer.inference.embedding", "from protein_performer.jobs.embed import a"),
        ("protein_performer.inference.api", "from protein_performer.jobs.score import a"),
        ("protein_performer.jobs.score", "from protein_performer.cli._model import load_lm"),
        ("protein_performer.jobs.embed", "from protein_performer.training import train"),
        ("protein_performer.contacts.map_columns", "from protein_performer.jobs import embed"),
        ("protein_performer.data.stdin", "from protein_performer.model.config import X"),
    ],
)  # fmt: skip
def test_a_crossed_floor_is_reported(module: str, source: str) -> None:
    assert violations(module, source), f"{module}: {source!r} should cross a floor"


@pytest.mark.parametrize(
    "module, source",
    [
        ("protein_performer.cli.visualize", "from protein_performer.viz import plots"),
        ("protein_performer.inference.api", "from protein_performer.interop.loading import X"),
        (
            "protein_performer.interop.convert_esm",
            "from protein_performer.data.tokenizer import A",
        ),
        ("protein_performer.viz.plots", "import numpy\nfrom protein_performer.io.atomic import a"),
        ("protein_performer.interop.loading", "from protein_performer import __version__"),
        ("protein_performer.inference.api", "from protein_performer.contacts import predict"),
        ("protein_performer", "from protein_performer.inference.api import load"),
        ("protein_performer.jobs.score", "from protein_performer.inference.api import ProteinLM"),
        ("protein_performer.jobs.embed", "from protein_performer.inference.embedding import a"),
        ("protein_performer.cli.embed", "from protein_performer.jobs.embed import embed_fasta"),
        ("protein_performer.jobs.contacts", "from protein_performer.inference.api import X"),
        ("protein_performer.jobs.embed", "from protein_performer.jobs.embeddings_file import a"),
        ("protein_performer.jobs.embeddings_file", "from protein_performer.contacts import a"),
        ("protein_performer.data.fasta", "from protein_performer.data.stdin import STDIN"),
        ("protein_performer.inference.api", "from protein_performer.inference.scoring import a"),
    ],
)
def test_a_downward_import_is_allowed(module: str, source: str) -> None:
    assert not violations(module, source)


def test_cli_and_jobs_hold_the_facade_not_the_loaded_record() -> None:
    """Issue 44: commands and their file drivers use ``ProteinLM``'s public methods; reaching
    under it (``lm.loaded``) is how a second code path starts. Read with ``ast``, not run."""
    reached: list[str] = []
    for folder in ("cli", "jobs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and node.attr == "loaded":
                    reached.append(f"{module_name(path)}:{node.lineno}")
    assert not reached, "reaches lm.loaded: " + ", ".join(reached)
