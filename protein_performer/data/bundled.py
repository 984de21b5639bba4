"""Files shipped inside the package (the demo's data, the configs), found through the import
system rather than a path counted up from a module, so a wheel installed anywhere finds them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from protein_performer.errors import UserError

#: The bundled demo training set (2,000 proteins): what smoke runs fit on when given no data.
DEMO_TRAIN = "data/demo/train.fasta"


def package_root() -> Path:
    """The installed package's folder (where its ``conf/`` and ``data/demo/`` are)."""
    return Path(str(resources.files("protein_performer")))


def bundled_path(relative: str) -> Path:
    """``relative`` (``data/demo/train.fasta``) inside the installed package, as a real path."""
    path = package_root() / relative
    if not path.exists():
        raise UserError(
            f"the package's bundled {relative} is missing at {path}; reinstall protein_performer"
        )
    return path
