#!/usr/bin/env python
"""Are a refactoring's computed outputs unchanged? Run the inference commands of two checkouts on
the same tiny models and compare every output file, dataset by dataset.

Three tiny random models (FAVOR+ MLM, FAVOR+ CLM, exact MLM) are exported once by the OLDER
checkout (`--models`, with its package, 0.4.0 or later, first on PYTHONPATH: newer versions read
older exports, not the other way round). Each checkout's commands (`--run PYTHONPATH OUT`, the
CLI of 0.3.0 and later) then embed, score, score variants, generate, fit and predict contacts,
export to Hugging Face, evaluate and run the two-assay ProteinGym benchmark on the bundled data;
`--compare A B` lists every file or HDF5 dataset that differs (HDF5 attributes are shown apart:
they carry versions).

    PYTHONPATH=/path/to/old/checkout python scripts/compare_outputs.py --models /tmp/cmp/models
    python scripts/compare_outputs.py --run /path/to/old/checkout /tmp/cmp/old
    python scripts/compare_outputs.py --run . /tmp/cmp/new
    python scripts/compare_outputs.py --compare /tmp/cmp/old /tmp/cmp/new
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import _checks

DEMO = _checks.REPO / "protein_performer" / "data" / "demo" / "some_proteins.fasta"
DMS = _checks.REPO.parent / "shared" / "data" / "dms"
STRUCTURES = _checks.REPO.parent / "shared" / "data" / "structures"
PROTEINGYM = _checks.REPO / "data" / "proteingym"


def make_models(out: Path) -> None:
    """Export the three models with the package on the path (seeded; ``from_dict`` fills the
    keys it is not given as that version's checkpoints without them read)."""
    from protein_performer.model.config import PerformerConfig

    base = {"dim": 32, "depth": 2, "heads": 4, "ff_dim": 64}
    kinds = {"mlm": {}, "clm": {"objective": "clm"}, "exact": {"attention": "exact"}}
    for name, kw in kinds.items():
        _checks.tiny_export(out / name, PerformerConfig.from_dict({**base, **kw}))


def commands(models: Path) -> list[list[object]]:
    """The inference commands."""
    mlm, clm, exact = (models / k for k in ("mlm", "clm", "exact"))
    one = ["--threads", "1"]
    quiet = [*one, "--no-progress"]
    return [["embed", mlm, DEMO, "e.h5", "--repr-layers", "0", "-1", "--include", "mean",
             "per_tok", "bos", *quiet],
            ["embed", exact, DEMO, "ex.h5", "--include", "mean", *quiet],
            ["score", mlm, DEMO, "s.csv", "--strategy", "pseudo-ppl", *quiet],
            ["score", clm, DEMO, "c.csv", "--strategy", "causal", *quiet],
            ["score", clm, DEMO, "c.tsv", "--strategy", "causal", *quiet],
            ["score-variants", mlm, DMS / "BLAT_ECOLX_wt_offset24.fasta",
             DMS / "BLAT_ECOLX_Ranganathan2015.csv", "v.csv", "--offset", "24", "--label-col",
             "2500", "--limit-rows", "30", *one],
            ["generate", clm, "g.fasta", "--num", "3", "--max-length", "40", "--seed", "0",
             *one],
            ["contacts", "fit", mlm, *sorted(STRUCTURES.glob("*.pdb"))[:3], "--out-dir", "cdir"],
            ["contacts", "predict", mlm, DEMO, "p.h5", "--regression",
             "cdir/contact_regression.json", *one],
            ["eval", mlm, DEMO, "--out-dir", "evaldir"],
            ["benchmark", "proteingym", PROTEINGYM / "reference_two_assays.csv", PROTEINGYM,
             "pg", mlm, *quiet],
            ["export", mlm, "hf", "--format", "hf", "--as-exact"]]  # fmt: skip


def run(checkout: Path, out: Path, models: Path) -> int:
    """Run every command with ``checkout``'s package first on the path; returns the failures."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**_checks.ENV, "PYTHONPATH": str(checkout.resolve())}
    failed = 0
    with open(out / "log.txt", "w") as log:
        for argv in commands(models):
            rc = subprocess.run(_checks.cli(*argv), cwd=out, env=env, stdout=log, stderr=log)
            print(f"rc={rc.returncode}: {' '.join(map(str, argv[:2]))}")
            failed += rc.returncode != 0
    return failed


def _digest(value: object) -> str:
    import numpy as np

    kind = getattr(getattr(value, "dtype", None), "kind", "")
    data = repr(value.tolist()) if kind == "O" else value
    raw = data.encode() if isinstance(data, str) else np.ascontiguousarray(data).tobytes()
    return hashlib.sha256(raw).hexdigest()


def _h5(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    import h5py

    names: list[str] = []
    with h5py.File(path, "r") as f:
        f.visit(names.append)
        data = {n: _digest(f[n][()]) for n in names if isinstance(f[n], h5py.Dataset)}
        return data, {k: str(v) for k, v in f.attrs.items()}


def compare(a: Path, b: Path) -> int:
    """Print what differs between two run folders; returns the number of differing data."""
    bad = 0
    files = sorted(p for p in a.rglob("*") if p.is_file() and p.name != "log.txt")
    if not files:
        print(f"{a} holds no outputs: did its run fail? (see {a / 'log.txt'})")
        return 1
    for pa in files:
        rel = pa.relative_to(a)
        pb = b / rel
        if not pb.is_file():
            print(f"missing in {b}: {rel}")
            bad += 1
        elif pa.suffix == ".h5":
            (da, aa), (db, ab) = _h5(pa), _h5(pb)
            for key in sorted(set(da) | set(db)):
                if da.get(key) != db.get(key):
                    print(f"data differ: {rel}:{key}")
                    bad += 1
            for key in sorted(k for k in set(aa) | set(ab) if aa.get(k) != ab.get(k)):
                print(f"attribute differs (versions, new config keys): {rel}@{key}")
        elif pa.read_bytes() != pb.read_bytes():
            print(f"bytes differ: {rel}")
            bad += 1
    print(f"{bad} differing file(s) or dataset(s) among {len(files)} file(s)")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=Path("/tmp/cmp/models"), help="model folder")
    p.add_argument("--run", nargs=2, metavar=("CHECKOUT", "OUT"), help="run a checkout's CLI")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare runs")
    args = p.parse_args(argv)
    if args.compare:
        return int(compare(*args.compare) > 0)
    if args.run:
        return int(run(Path(args.run[0]), Path(args.run[1]), args.models) > 0)
    make_models(args.models)
    print(f"models -> {args.models}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
