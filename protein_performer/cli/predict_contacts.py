"""``protein-performer predict-contacts CKPT FASTA OUT``: contact maps of every record as data."""

from __future__ import annotations

import argparse

from protein_performer.cli._common import (
    add_ckpt,
    add_command,
    add_device,
    add_no_progress,
    add_on_invalid,
    add_overwrite,
    add_precision_threads,
    check_output,
    load_lm,
)

HELP = "contact probabilities of every FASTA record into one HDF5 file (any length)"
DESCRIPTION = """\
Predict residue-residue contact probabilities for every record of a FASTA file (no structure
needed) and write them to one HDF5 file, written atomically.

The probabilities come from a logistic regression over the model's attention maps (every
layer x head map, symmetrized and APC-corrected, ESM's recipe): the model's own (a model
converted from ESM-2 by `convert-esm` carries ESM-2's contact head; `contacts --save-beside`
stores a fitted one with the checkpoint) or the one given by --regression (a
contact_regression.json written by `protein-performer contacts`).

Up to --dense-max-length residues a record gets its whole (L, L) map (residues only, no
BOS/EOS). Longer records get the top k*L pairs (i < j, j - i >= --min-separation), computed
window by window from the (FAVOR+ implied) attention without ever forming an L x L array, so
memory stays O(window x L).
"""

EPILOG = """\
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
  protein-performer predict-contacts esm2_8M_exact proteins.fasta contacts.h5
  protein-performer predict-contacts last.ckpt titin.fasta titin.h5 --top-k-per-length 5 \\
      --regression runs/contacts/contact_regression.json
"""


#: The library's defaults (``inference.contact_maps``/``contacts``), spelled out here so that
#: ``--help`` does not import torch; ``tests/test_contact_maps.py`` checks they agree.
DEFAULT_DENSE_MAX_LENGTH = 4096
DEFAULT_TOP_K_PER_LENGTH = 2.0
DEFAULT_MIN_SEPARATION = 6
DTYPE_CHOICES = ("float16", "float32")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "predict-contacts", HELP, DESCRIPTION, EPILOG)
    add_ckpt(p)
    p.add_argument("fasta", metavar="FASTA", help="input FASTA(.gz)")
    p.add_argument("out", metavar="OUT", help="output HDF5 file, e.g. contacts.h5")
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
    add_device(p)
    add_precision_threads(p)
    add_on_invalid(p)
    add_no_progress(p)
    add_overwrite(p, "OUT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.contacts.predict import find_regression, predict_contacts_fasta

    check_output(args.out, [args.ckpt, args.fasta, args.regression], args.overwrite)
    loaded = load_lm(args).loaded
    regression = find_regression(loaded, args.regression)
    summary = predict_contacts_fasta(
        loaded,
        args.fasta,
        args.out,
        regression,
        dtype=args.dtype,
        dense_max_length=args.dense_max_length,
        top_k_per_length=args.top_k_per_length,
        min_separation=args.min_separation,
        on_invalid=args.on_invalid,
        progress=not args.no_progress,
        regression_source=str(args.regression or "the model's own"),
    )
    print(
        f"contacts of {summary.num_records} record(s) ({summary.dense} dense, {summary.sparse} "
        f"top pairs) -> {summary.path}"
    )
    return 0
