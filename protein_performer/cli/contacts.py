"""``protein-performer contacts fit|predict``: contact maps from attention, ESM's recipe.

``contacts fit CKPT STRUCTURE... --out-dir DIR`` fits the logistic regression on structures and
reports its precision next to a shuffled null; ``contacts predict CKPT FASTA OUT`` applies a
regression (the model's own or a fitted one) to sequences without a structure.
"""

from __future__ import annotations

import argparse

from protein_performer.cli._args import (
    FASTA_HELP,
    add_ckpt,
    add_ckpt_fasta_out,
    add_command,
    add_model_options,
    add_no_progress,
    add_on_invalid,
    add_seed,
)
from protein_performer.cli._lifetime import check_output, join_ranks, rank_line
from protein_performer.cli._model import load_lm
from protein_performer.cli._wrote import say_wrote

HELP = "contact maps from attention: `fit` a regression on structures, `predict` from FASTA"
DESCRIPTION = """\
Contact prediction from attention maps (ESM's recipe: every layer x head map, symmetrized and
APC-corrected, into an L1 logistic regression), in two steps:

  fit      fit the regression on PDB/mmCIF structures and report its precision vs a null
  predict  contact probabilities of every record of a FASTA file, no structure needed

`protein-performer contacts fit --help` and `contacts predict --help` say more.
"""
EPILOG = """\
examples:
  protein-performer contacts fit last.ckpt structures/*.pdb --out-dir runs/c
  protein-performer contacts predict last.ckpt proteins.fasta contacts.h5 \\
      --regression runs/c/contact_regression.json
"""

FIT_HELP = "contact precision (P@L, L/2, L/5) from attention maps vs a shuffled null"
FIT_DESCRIPTION = """\
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

Writes to --out-dir: precision.csv (one row per protein and a 'mean' row: P@L, P@L/2, P@L/5 for
short 6-11, medium 12-23, long >=24 separations, each followed by its null_ column) and, when
a regression was fitted, contact_regression.json (coefficients, intercept, layers, heads, the
attention layout it reads and the SHA-256 of the weights it was fitted on; plain JSON, no
pickle), which `contacts predict --regression` applies to new sequences.
"""

FIT_EPILOG = """\
examples:
  protein-performer contacts fit last.ckpt structures/*.pdb --out-dir runs/contacts
  protein-performer contacts fit last.ckpt test/*.pdb --fit-on train/*.pdb --out-dir runs/c \\
      --save-beside
  protein-performer contacts fit model_dir 1abc.cif:B \\
      --regression runs/c/contact_regression.json --out-dir runs/c_1abc
"""


PREDICT_HELP = "contact probabilities of every FASTA record into one HDF5 file (any length)"
PREDICT_DESCRIPTION = """\
Predict residue-residue contact probabilities for every record of a FASTA file (no structure
needed) and write them to one HDF5 file, written atomically.

The probabilities come from a logistic regression over the model's attention maps (every
layer x head map, symmetrized and APC-corrected, ESM's recipe): the model's own (a model
converted from ESM-2 by `convert-esm` carries ESM-2's contact head; `contacts fit --save-beside`
stores a fitted one with the checkpoint) or the one given by --regression (a
contact_regression.json written by `protein-performer contacts fit`).

Up to --dense-max-length residues a record gets its whole (L, L) map (residues only, no
BOS/EOS). Longer records get the top k*L pairs (i < j, j - i >= --min-separation), computed
window by window from the (FAVOR+ implied) attention without ever forming an L x L array, so
memory stays O(window x L).
"""

PREDICT_EPILOG = """\
output layout (h5py; one array per field, records in FASTA order):
  f["ids"], f["lengths"]                  (N,) record id, length L (FASTA order)
  f["header_offsets"]                      (N+1,) record n's FASTA header is
      f["header_bytes"][o[n]:o[n+1]].tobytes().decode()
  f["dense_offsets"]                       (N+1,) record n's map is
      f["dense_values"][o[n]:o[n+1]].reshape(L, L)   (empty for sparse records)
  f["pair_offsets"]                        (N+1,) record n's top pairs are
      f["pair_i"], f["pair_j"], f["pair_p"] [o[n]:o[n+1]]   0-based i < j, most probable first
  f.attrs                                  checkpoint, model_sha256, regression (JSON), dtype,
                                           dense_max_length, top_k_per_length, min_separation
  Python: protein_performer.contacts.predict.read_contacts(path, ids=None)

examples:
  protein-performer contacts predict esm2_8M_exact proteins.fasta contacts.h5
  protein-performer contacts predict last.ckpt titin.fasta titin.h5 --top-k-per-length 5 \\
      --regression runs/contacts/contact_regression.json
"""


#: The library's defaults (``contacts.predict``/``contacts.fit``), spelled out here so that
#: ``--help`` does not import torch; ``tests/contacts/test_contact_maps.py`` checks they agree.
DEFAULT_DENSE_MAX_LENGTH = 4096
DEFAULT_TOP_K_PER_LENGTH = 2.0
DEFAULT_MIN_SEPARATION = 6
DTYPE_CHOICES = ("float16", "float32")


#: The arguments naming what this command writes (per subcommand), each claimed under the
#: output policy (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: dict[str, tuple[str, ...]] = {"fit": ("out_dir",), "predict": ("out",)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "contacts", HELP, DESCRIPTION, EPILOG)
    steps = p.add_subparsers(dest="step", metavar="STEP", required=True)
    add_fit_parser(steps)
    add_predict_parser(steps)


def add_fit_parser(steps: argparse._SubParsersAction) -> None:
    p = add_command(steps, "fit", FIT_HELP, FIT_DESCRIPTION, FIT_EPILOG)
    add_ckpt(p)
    p.add_argument(
        "structures", metavar="STRUCTURE", nargs="+", help="PDB/mmCIF files, FILE[:CHAIN]"
    )
    p.add_argument("--out-dir", required=True, metavar="DIR", help="output directory")
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
        help="sequences keyed by structure file stem (e.g. chains.fasta with 1GBT_A; - reads "
        "standard input)",
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
    add_seed(p, "seed of the null permutations and fit")
    add_model_options(p, "the files in --out-dir")
    p.set_defaults(func=run_fit)


def add_predict_parser(steps: argparse._SubParsersAction) -> None:
    p = add_command(steps, "predict", PREDICT_HELP, PREDICT_DESCRIPTION, PREDICT_EPILOG)
    add_ckpt_fasta_out(p, "output HDF5 file, e.g. contacts.h5", FASTA_HELP)
    p.add_argument(
        "--regression",
        metavar="PATH",
        default=None,
        help="a contact_regression.json (default: the model's own)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="float16",
        help="stored probabilities (default: float16)",
    )
    p.add_argument(
        "--dense-max-length",
        type=int,
        default=DEFAULT_DENSE_MAX_LENGTH,
        metavar="L",
        help=f"longest record stored as a full map (default: {DEFAULT_DENSE_MAX_LENGTH})",
    )
    p.add_argument(
        "--top-k-per-length",
        type=float,
        default=DEFAULT_TOP_K_PER_LENGTH,
        metavar="K",
        help=f"longer records keep the top K*L pairs (default: {DEFAULT_TOP_K_PER_LENGTH:g})",
    )
    p.add_argument(
        "--min-separation",
        type=int,
        default=DEFAULT_MIN_SEPARATION,
        metavar="S",
        help=f"top pairs have j - i >= S (default: {DEFAULT_MIN_SEPARATION})",
    )
    add_on_invalid(p)
    add_no_progress(p)
    add_model_options(p)
    p.set_defaults(func=run_predict)


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

        sequences = {r.id: r.sequence for r in read_records(fasta, "error")}
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


def run_fit(args: argparse.Namespace) -> int:
    from protein_performer.contacts.fit import DEFAULT_C, format_summary
    from protein_performer.model.contact_head import ContactRegression

    inputs = [args.ckpt, args.regression, args.fasta, *args.structures, *(args.fit_on or [])]
    check_output(args.out_dir, [split_chain(s, None)[0] for s in inputs if s], args.overwrite)
    targets = load_targets(args.structures, args.chain, args.fasta, args.sequence_source)
    fit_targets = (
        load_targets(args.fit_on, args.chain, args.fasta, args.sequence_source)
        if args.fit_on
        else None
    )
    regression = ContactRegression.load(args.regression) if args.regression else None
    result = load_lm(args).fit_contacts(
        targets,
        args.out_dir,
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
    say_wrote(args.out_dir, f"{len(result.files)} file(s): {', '.join(result.files)}")
    return 0


def run_predict(args: argparse.Namespace) -> int:
    from protein_performer.jobs.contacts import predict_contacts_fasta

    join_ranks(args)
    check_output(args.out, [args.ckpt, args.fasta, args.regression], args.overwrite)
    summary = predict_contacts_fasta(
        load_lm(args),
        args.fasta,
        args.out,
        args.regression,
        dtype=args.dtype,
        dense_max_length=args.dense_max_length,
        top_k_per_length=args.top_k_per_length,
        min_separation=args.min_separation,
        on_invalid=args.on_invalid,
        progress=not args.no_progress,
        regression_source=str(args.regression or "the model's own"),
    )
    if rank_line(summary.dense + summary.sparse, "predicted the contacts of"):
        return 0
    say_wrote(
        summary.path,
        f"contacts of {summary.num_records} record(s) ({summary.dense} dense, {summary.sparse} "
        "top pairs)",
    )
    return 0
