"""Protein structures as contact-map targets: parse, pick a chain, align it to a sequence.

What a contact benchmark needs from a structure is a residue x residue truth over the *sequence
the model reads*, plus a mask of what the structure does not tell: unobserved residues (missing
loops, disordered tails, expression tags) are neither contacts nor non-contacts. So a chain's
observed residues are aligned (``Bio.Align.PairwiseAligner``) to that sequence, which is, in
order of preference, a sequence the caller gives (e.g. a FASTA record), the chain's SEQRES
(PDB ``SEQRES`` records, mmCIF ``_pdbx_poly_seq_scheme``), or the observed residues alone (then
a chain break simply joins its two sides, which is what ``shared/data/structures/chains.csv``
counts). Unobserved positions get NaN coordinates and are excluded from every pair.

Contacts follow the usual CASP/ESM definition: Cβ-Cβ < 8 Å (Cα for glycine). A non-glycine
residue without a Cβ falls back to its Cα and is counted (``n_cb_from_ca``), since a truncated
side chain is common in crystal structures and dropping the residue would lose its contacts.
"""

from __future__ import annotations

import gzip
import io
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protein_performer.errors import UserError

log = logging.getLogger(__name__)

#: Cβ-Cβ distance below which two residues are in contact (Å).
CONTACT_THRESHOLD = 8.0
#: Consecutive Cα-Cα distance above which the chain is broken (Å): 3.8 Å plus slack.
BREAK_DISTANCE = 4.2
#: Below these, the structure does not belong to the sequence (wrong chain or file). Identity
#: is over aligned pairs only, and free end gaps let a short chain reach ~60% on an unrelated
#: sequence, so the bar is high; SEQRES vs observed residues is ~100% in practice.
MIN_IDENTITY = 0.8
MIN_COVERAGE = 0.5

_PDB_SUFFIXES = (".pdb", ".ent", ".pdb1")
_CIF_SUFFIXES = (".cif", ".mmcif")


@dataclass
class ChainStructure:
    """The observed residues of one chain, in file order."""

    path: Path
    chain_id: str  # " " for a blank chain id
    residue_ids: list[str]  # author number + insertion code, e.g. "152", "60A"
    sequence: str  # one letter per observed residue (X for unknown)
    cb: np.ndarray  # (N, 3) Cβ, Cα for glycine and for residues without Cβ
    n_cb_from_ca: int  # non-glycine residues whose Cβ is missing (Cα used)
    chain_breaks: int  # consecutive Cα-Cα > BREAK_DISTANCE
    seqres: str | None = None  # the deposited sequence of the chain, when the file has it

    @property
    def name(self) -> str:
        chain = self.chain_id.strip() or "blank"
        return f"{self.path.name}:{chain}"


@dataclass
class ContactTarget:
    """A structure mapped onto the sequence the model reads: truth and mask per position."""

    id: str
    sequence: str  # L residues, the model's input
    cb: np.ndarray  # (L, 3), NaN where the structure has no residue
    structure: ChainStructure
    identity: float  # identity over aligned observed residues
    sequence_source: str  # "given", "seqres" or "observed"
    observed: np.ndarray = field(init=False)  # (L,) bool

    def __post_init__(self) -> None:
        self.observed = ~np.isnan(self.cb).any(-1)

    @property
    def length(self) -> int:
        return len(self.sequence)

    def distances(self) -> np.ndarray:
        """(L, L) Cβ distances, NaN for pairs with an unobserved residue."""
        diff = self.cb[:, None, :] - self.cb[None, :, :]  # (L, L, 3)
        return np.sqrt((diff**2).sum(-1))

    def contacts(self, threshold: float = CONTACT_THRESHOLD) -> np.ndarray:
        """(L, L) bool, False also where unknown (use ``valid`` to tell the two apart)."""
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(self.distances(), nan=np.inf) < threshold

    def valid(self) -> np.ndarray:
        """(L, L) bool: both residues observed, so the pair can be scored."""
        return self.observed[:, None] & self.observed[None, :]


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------
def _open_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: structure file not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the structure file ({exc})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise UserError(f"{path}: corrupt gzip file ({exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        try:
            return raw.decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes any byte
            raise UserError(f"{path}: not a text file; expected PDB or mmCIF") from None


def structure_format(path: Path, text: str) -> str:
    """ "pdb" or "cif", by extension (``.gz`` ignored) or, failing that, by content."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(_PDB_SUFFIXES):
        return "pdb"
    if name.endswith(_CIF_SUFFIXES):
        return "cif"
    head = text[:20000]
    if head.lstrip().startswith("data_") or "_atom_site." in head:
        return "cif"
    if any(
        line.startswith(("ATOM  ", "HETATM", "HEADER", "MODEL ")) for line in head.splitlines()
    ):
        return "pdb"
    raise UserError(
        f"{path}: neither PDB nor mmCIF (no ATOM records, no data_ block); give a .pdb or "
        ".cif file"
    )


def _pdb_seqres(text: str) -> dict[str, list[str]]:
    """Chain id -> residue names from SEQRES records (column 12 holds the chain id)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("SEQRES"):
            chain = line[11] if len(line) > 11 else " "
            out.setdefault(chain, []).extend(line[19:].split())
    return out


def _cif_seqres(handle: io.StringIO) -> dict[str, list[str]]:
    """Author chain id -> residue names from ``_pdbx_poly_seq_scheme`` (absent in minimal
    files)."""
    from Bio.PDB.MMCIF2Dict import MMCIF2Dict

    try:
        data = MMCIF2Dict(handle)
    except Exception:  # noqa: BLE001 - SEQRES is optional; the parser reports real errors
        return {}
    chains = data.get("_pdbx_poly_seq_scheme.pdb_strand_id")
    names = data.get("_pdbx_poly_seq_scheme.mon_id")
    if not chains or not names:
        return {}
    out: dict[str, list[str]] = {}
    for chain, name in zip(chains, names, strict=False):
        out.setdefault(chain, []).append(name)
    return out


def _one_letter(resname: str) -> str | None:
    """Standard and modified amino acids (MSE -> M) to one letter; None for anything else."""
    from Bio.Data.PDBData import protein_letters_3to1_extended

    if resname.upper() == "UNK":
        return "X"
    letter = protein_letters_3to1_extended.get(resname.upper())
    return letter if letter and len(letter) == 1 else None


def _normalize_chain(chain: str | None) -> str | None:
    """ "" / " " / "_" all mean the blank chain id Biopython stores as " "."""
    if chain is None:
        return None
    return " " if chain.strip() in ("", "_") else chain.strip()


def read_chain(path: str | Path, chain: str | None = None) -> ChainStructure:
    """The observed amino-acid residues of ``chain`` (first model; None = first protein chain).

    Raises ``UserError`` for a missing or unparseable file and for a missing chain (naming the
    chains the file has).
    """
    from Bio.PDB import MMCIFParser, PDBParser
    from Bio.PDB.PDBExceptions import PDBConstructionWarning

    path = Path(path).expanduser()
    text = _open_text(path)
    fmt = structure_format(path, text)
    parser = PDBParser(QUIET=True) if fmt == "pdb" else MMCIFParser(QUIET=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PDBConstructionWarning)
            structure = parser.get_structure(path.stem, io.StringIO(text))
    except Exception as exc:  # noqa: BLE001 - Biopython raises many types for bad input
        raise UserError(
            f"{path}: cannot parse as {'PDB' if fmt == 'pdb' else 'mmCIF'} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    models = list(structure)
    if not models:
        raise UserError(f"{path}: no atoms found (not a {fmt.upper()} coordinate file?)")
    model = models[0]

    def residues_of(ch) -> list:
        return [r for r in ch if _one_letter(r.get_resname()) is not None and "CA" in r]

    protein_chains = [ch for ch in model if residues_of(ch)]
    shown = ", ".join(repr(ch.id) for ch in protein_chains) or "none"
    want = _normalize_chain(chain)
    if want is None:
        if not protein_chains:
            raise UserError(f"{path}: no amino-acid residues with a CA atom in the first model")
        picked = protein_chains[0]
        if len(protein_chains) > 1:
            log.info("%s: using the first protein chain %r of %s", path.name, picked.id, shown)
    else:
        matches = [ch for ch in model if ch.id == want]
        if not matches:
            raise UserError(
                f"{path}: no chain {want!r}; protein chains in the file: {shown} "
                "(a blank chain id is given as '' or '_')"
            )
        picked = matches[0]
    residues = residues_of(picked)
    if not residues:
        raise UserError(f"{path}: chain {picked.id!r} has no amino-acid residues with a CA atom")

    coords, ids, letters, fallback = [], [], [], 0
    ca = []
    for res in residues:
        letter = _one_letter(res.get_resname()) or "X"
        ca.append(res["CA"].coord)
        if letter == "G":
            coords.append(res["CA"].coord)
        elif "CB" in res:
            coords.append(res["CB"].coord)
        else:
            coords.append(res["CA"].coord)
            fallback += 1
        _, number, icode = res.id
        ids.append(f"{number}{icode.strip()}")
        letters.append(letter)
    ca_arr = np.asarray(ca, dtype=np.float64)
    steps = np.linalg.norm(np.diff(ca_arr, axis=0), axis=1) if len(ca_arr) > 1 else np.zeros(0)
    if fallback:
        log.warning(
            "%s chain %r: %d residue(s) without CB, using CA", path.name, picked.id, fallback
        )

    seqres_map = _pdb_seqres(text) if fmt == "pdb" else _cif_seqres(io.StringIO(text))
    seqres = None
    if picked.id in seqres_map:
        seqres = "".join(_one_letter(n) or "X" for n in seqres_map[picked.id]) or None
    return ChainStructure(
        path=path,
        chain_id=picked.id,
        residue_ids=ids,
        sequence="".join(letters),
        cb=np.asarray(coords, dtype=np.float64),
        n_cb_from_ca=fallback,
        chain_breaks=int((steps > BREAK_DISTANCE).sum()),
        seqres=seqres,
    )


# --------------------------------------------------------------------------------------------
# Alignment to a sequence
# --------------------------------------------------------------------------------------------
def _aligner():
    """Global alignment with free end gaps: the structure may miss both tails of the sequence
    (or carry a tag the sequence lacks), and an internal gap (a missing loop) costs a little
    more than a mismatch so that a point mutation is not mistaken for an indel."""
    from Bio.Align import PairwiseAligner

    aligner = PairwiseAligner()
    aligner.mode = "global"
    aligner.match_score = 2.0
    aligner.mismatch_score = -1.0
    aligner.open_gap_score = -4.0
    aligner.extend_gap_score = -0.5
    aligner.end_gap_score = 0.0
    return aligner


def align_to_sequence(observed: str, sequence: str) -> tuple[np.ndarray, float, float]:
    """Map observed residues onto ``sequence``: (positions (N,) with -1 = not in the sequence,
    identity over aligned pairs, coverage = aligned / N)."""
    if not sequence:
        raise UserError("cannot align a structure to an empty sequence")
    aln = _aligner().align(sequence.upper(), observed.upper())[0]
    seq_idx, obs_idx = aln.indices  # (n_columns,) each, -1 in gaps
    positions = np.full(len(observed), -1, dtype=np.int64)
    both = (seq_idx >= 0) & (obs_idx >= 0)
    positions[obs_idx[both]] = seq_idx[both]
    n_aligned = int(both.sum())
    pairs = zip(seq_idx[both], obs_idx[both], strict=True)
    same = sum(sequence[s].upper() == observed[o].upper() for s, o in pairs)
    identity = same / n_aligned if n_aligned else 0.0
    return positions, identity, n_aligned / max(len(observed), 1)


def contact_target(
    path: str | Path,
    chain: str | None = None,
    sequence: str | None = None,
    sequence_source: str = "auto",
    target_id: str | None = None,
) -> ContactTarget:
    """Parse ``path`` and map its chain onto the model's sequence.

    ``sequence`` (e.g. a FASTA record) wins; otherwise ``sequence_source`` "auto" takes SEQRES
    when the file has it and the observed residues when not, "seqres" requires SEQRES and
    "observed" always uses the observed residues (chain breaks joined, as chains.csv counts).
    """
    struct = read_chain(path, chain)
    if sequence is not None:
        seq, source = sequence.strip().upper(), "given"
    elif sequence_source == "observed" or (sequence_source == "auto" and not struct.seqres):
        seq, source = struct.sequence, "observed"
    elif sequence_source in ("seqres", "auto"):
        if not struct.seqres:
            raise UserError(
                f"{struct.path}: chain {struct.chain_id!r} has no SEQRES; use "
                "sequence_source observed or give the sequence"
            )
        seq, source = struct.seqres, "seqres"
    else:
        raise UserError(f"unknown sequence source {sequence_source!r}: auto, seqres or observed")
    if source == "observed":
        positions = np.arange(len(seq))
        identity = 1.0
    else:
        positions, identity, coverage = align_to_sequence(struct.sequence, seq)
        if identity < MIN_IDENTITY or coverage < MIN_COVERAGE:
            raise UserError(
                f"{struct.name}: its {len(struct.sequence)} observed residues do not match the "
                f"{source} sequence ({len(seq)} aa): identity {identity:.0%}, coverage "
                f"{coverage:.0%}. Wrong chain or wrong sequence record?"
            )
        if identity < 1.0 or coverage < 1.0:
            log.warning(
                "%s: aligned to the %s sequence with identity %.1f%% and coverage %.1f%%",
                struct.name,
                source,
                100 * identity,
                100 * coverage,
            )
    cb = np.full((len(seq), 3), np.nan)
    keep = positions >= 0
    cb[positions[keep]] = struct.cb[keep]
    default_id = struct.path.stem
    if struct.path.name.lower().endswith(".gz"):
        default_id = Path(struct.path.stem).stem
    return ContactTarget(
        id=target_id or default_id,
        sequence=seq,
        cb=cb,
        structure=struct,
        identity=identity,
        sequence_source=source,
    )
