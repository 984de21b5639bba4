"""``protein-performer contacts CKPT STRUCTURE... --out DIR``: contact precision vs a null."""

from __future__ import annotations

import argparse

from protein_performer.cli._common import (
    add_ckpt,
    add_command,
    add_device,
    add_overwrite,
    add_threads,
    check_output,
    load_checkpoint,
)

HELP = "contact precision (P@L, L/2, L/5) from attention maps vs a shuffled null"
DESCRIPTION = """\
Contact prediction from attention maps (ESM's recipe: every layer x head map, symmetrized and
APC-corrected, into an L1 logistic regression) and its precision on structures, with a null
baseline beside it: the same maps with rows and columns shuffled by one seeded permutation.

CKPT is a .ckpt from `protein-performer train` or an exported model directory. A STRUCTURE is a
PDB or mmCIF file (.gz accepted); append :CHAIN to pick a chain per file (FILE:A; FILE:_ for
a blank chain id), or give --chain for all files. Contacts: C-beta < 8 A (C-alpha for glycine),
pairs with both residues observed. The sequence the model reads is, in order: the --fasta
record whose id equals the file's stem (e.g. 1GBT_A), the file's SEQRES, else its observed
residues (chain breaks joined; see --sequence-source).

Where the regression comes from (pick one):
  --regression PATH   apply a fitted regression (JSON) to every STRUCTURE
  --fit-on S...       fit on these structures, evaluate on STRUCTURE...
  (neither)           cross-fitting over STRUCTURE...: each structure is scored by a fit on the
                      others (leave-one-out by default; --folds K for K round-robin folds in
                      the given order); then a final fit on all of them is saved for new
                      proteins. Needs at least 2 structures.

Writes to --out: precision.csv (one row per protein and a 'mean' row: P@L, P@L/2, P@L/5 for
short 6-11, medium 12-23, long >=24 separations, each followed by its null_ column) and, when
a regression was fitted, contact_regression.json (coefficients, intercept, layers, heads, the
attention layout it reads and the SHA-256 of the weights it was fitted on; plain JSON, no
pickle), which `predict-contacts --regression` applies to new sequences.
"""

EPILOG = """\
examples:
  protein-performer contacts last.ckpt ../shared/data/structures/*.pdb --out runs/contacts
  protein-performer contacts last.ckpt test/*.pdb --fit-on train/*.pdb --out runs/c --save-beside
  protein-performer contacts model_dir 1abc.cif:B --regression runs/c/contact_regression.json \\
      --out runs/c_1abc
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "contacts", HELP, DESCRIPTION, EPILOG)
    add_ckpt(p)
    p.add_argument(
        "structures", metavar="STRUCTURE", nargs="+", help="PDB/mmCIF files, FILE[:CHAIN]"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    add_overwrite(p, "the files in --out")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--fit-on", nargs="+", metavar="STRUCTURE", help="fit the regression on these structures"
    )
    source.add_argument("--regression", metavar="PATH", help="a fitted regression JSON to apply")
    p.add_argument(
        "--chain",
        default=None,
        help="chain id for every structure without :CHAIN (default: the first protein chain)",
    )
    p.add_argument(
        "--fasta",
        default=None,
        metavar="FASTA",
        help="sequences keyed by structure file stem (e.g. chains.fasta with 1GBT_A)",
    )
    p.add_argument(
        "--sequence-source",
        choices=("auto", "seqres", "observed"),
        default="auto",
        help="without a --fasta record: SEQRES if present (auto, default), or observed residues",
    )
    p.add_argument(
        "--folds", type=int, default=None, help="cross-fitting folds (default: leave-one-out)"
    )
    p.add_argument(
        "--C", dest="C", type=float, default=None, help="inverse L1 strength (default: 0.15)"
    )
    p.add_argument(
        "--class-weight",
        choices=("none", "balanced"),
        default="none",
        help="logistic regression class weights (default: none, calibrated probabilities)",
    )
    p.add_argument(
        "--save-beside",
        action="store_true",
        help="also write the fitted regression beside the checkpoint (visualize picks it up)",
    )
    add_device(p)
    add_threads(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the null permutations and fit")
    p.set_defaults(func=run)


def split_chain(spec: str, default_chain: str | None) -> tuple[str, str | None]:
    """``FILE:CHAIN`` -> (FILE, CHAIN) when FILE exists and FILE:CHAIN does not."""
    from pathlib import Path

    path, sep, chain = spec.rpartition(":")
    if sep and path and not Path(spec).exists() and Path(path).exists() and len(chain) <= 4:
        return path, chain
    return spec, default_chain


def load_targets(
    specs: list[str], chain: str | None, fasta: str | None, sequence_source: str
) -> list:
    """Parse and align every ``FILE[:CHAIN]``; ids are file stems (plus :CHAIN if given)."""
    from pathlib import Path

    from protein_performer.contacts.structures import contact_target

    sequences: dict[str, str] = {}
    if fasta:
        from protein_performer.data.inputs import read_records

        sequences = {r.id: r.sequence for r in read_records(Path(fasta), "error")}
    targets = []
    for spec in specs:
        path, ch = split_chain(spec, chain)
        stem = Path(path).name.split(".")[0]
        target_id = stem if ch is None or spec == path else f"{stem}:{ch}"
        targets.append(
            contact_target(
                path,
                chain=ch,
                sequence=sequences.get(stem),
                sequence_source=sequence_source,
                target_id=target_id,
            )
        )
    return targets


def run(args: argparse.Namespace) -> int:
    from protein_performer.contacts.fit import (
        DEFAULT_C,
        benchmark,
        format_summary,
    )
    from protein_performer.model.contact_head import ContactRegression

    inputs = [args.ckpt, args.regression, args.fasta, *args.structures, *(args.fit_on or [])]
    check_output(args.out, [split_chain(s, None)[0] for s in inputs if s], args.overwrite)
    targets = load_targets(args.structures, args.chain, args.fasta, args.sequence_source)
    fit_targets = (
        load_targets(args.fit_on, args.chain, args.fasta, args.sequence_source)
        if args.fit_on
        else None
    )
    regression = ContactRegression.load(args.regression) if args.regression else None
    loaded = load_checkpoint(args)
    result = benchmark(
        loaded,
        targets,
        args.out,
        fit_targets=fit_targets,
        regression=regression,
        folds=args.folds,
        C=DEFAULT_C if args.C is None else args.C,
        class_weight=None if args.class_weight == "none" else args.class_weight,
        seed=args.seed,
        save_beside=args.save_beside,
    )
    print(format_summary(result))
    for name, path in result.files.items():
        print(f"{name}: {path}")
    return 0
