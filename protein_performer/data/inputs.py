"""What the inference commands read: the records of a FASTA file or a preprocessed store, in
order, whichever the user gives (``embed``, ``score``, ``score-variants``, ``contacts``,
``eval``, ``visualize``). ``-`` is standard input (read as FASTA, see ``data.fasta``). The
homologs of a family context (``--context``, ``lm.context``): :func:`read_homologs`, FASTA or an
MSA. And what the Python API takes (:func:`as_records`): strings or (id, sequence) pairs,
checked."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from protein_performer.data.hits import hit_coordinates
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError, shown

if TYPE_CHECKING:
    from protein_performer.data.store import TokenStore

log = logging.getLogger(__name__)


class InputRecord(NamedTuple):
    """What the writers need of a record, whether it came from FASTA or from a store."""

    id: str
    description: str
    sequence: str
    number: int  # 1-based position in its file or store


#: What the Python API takes as sequences: strings, or (id, sequence) pairs.
Records = Iterable[str] | Iterable[tuple[str, str]]
#: Letters of DNA/RNA: an input made only of these is most likely not protein.
NUCLEOTIDES = "ACGTUN"


def _note_nucleotides(records: Iterator[Any], source: object) -> Iterator[Any]:
    """``records`` unchanged; once they are all read, one warning when every one holds only
    A/C/G/T/U/N (DNA or RNA, which would be scored as protein without a word)."""
    count, nucleotides = 0, True
    for r in records:
        count += 1
        nucleotides = nucleotides and not r.sequence.upper().strip(NUCLEOTIDES)
        yield r
    if count and nucleotides:
        log.warning(
            "%s: all %d record(s) hold only A/C/G/T/U/N: this looks like DNA or RNA, read as "
            "protein (A, C, G, T as amino acids); translate it first if it is",
            source,
            count,
        )


def input_records(
    path: str | os.PathLike[str], on_invalid: str = "error"
) -> Iterator[InputRecord]:
    """Stream the records of a FASTA file or of a preprocessed store directory, in order
    (a DNA/RNA-looking input gets a warning at its end: :func:`_note_nucleotides`).

    A store (``protein-performer preprocess``) is read record by record from its memory maps
    (lengths known, O(1) access), so very large inputs cost no parsing and constant memory.
    """
    return _note_nucleotides(_input_records(path, on_invalid), path)


@dataclass(frozen=True)
class Input:
    """A command's input, opened: a preprocessed store directory (``store`` set), a FASTA file
    (plain or gzip, told apart by its bytes when read) or standard input (``path`` is ``-``)."""

    path: Path | str  # the expanded path, or STDIN
    store: TokenStore | None = None

    def records(self, on_invalid: str = "error") -> Iterator[InputRecord]:
        """Every record in order: a store's from its memory maps, a FASTA's parsed."""
        from protein_performer.data.fasta import read_fasta

        if self.store is not None:
            store = self.store
            for i in range(len(store)):
                yield InputRecord(store.id(i), store.description(i), store.sequence(i), i + 1)
            return
        for r in read_fasta(self.path, on_invalid=on_invalid):  # type: ignore[arg-type]
            yield InputRecord(r.id, r.description, r.sequence, r.number)

    def totals(self) -> tuple[int, int] | None:
        """(records, residues): a store's from its metadata, a FASTA file's by a byte scan;
        None for standard input (read once)."""
        from protein_performer.data.fasta import count_records_and_residues
        from protein_performer.data.stdin import STDIN

        if self.store is not None:
            return len(self.store), int(self.store.meta["num_residues"])
        return None if self.path == STDIN else count_records_and_residues(Path(self.path))


#: What a missing input is told to give, by whether a store is read there.
_GIVE = {True: "a FASTA file or a store directory from `protein-performer preprocess`",
         False: "a FASTA file"}  # fmt: skip


def open_input(
    path: str | os.PathLike[str], *, store: bool = True, give: str | None = None
) -> Input:
    """The one answer to "store or FASTA?" for every reader: ``-`` is standard input (FASTA),
    a directory a store (refused in one line, saying how to make one, when it is not), anything
    else a FASTA file (plain or gzip: the FASTA reader tells them apart by their bytes), which
    must exist. ``store=False`` where only a FASTA is read (a query, homologs, a table's
    sequences): a directory is then refused as a missing file is, saying to ``give`` one."""
    from protein_performer.data.stdin import STDIN
    from protein_performer.data.store import TokenStore

    if os.fspath(path) == STDIN:
        return Input(STDIN)
    src = Path(path).expanduser()
    if store and src.is_dir():
        return Input(src, TokenStore(src))
    if not src.is_file():
        raise UserError(f"{src} does not exist or is not a file; give {give or _GIVE[store]}")
    return Input(src)


def _input_records(path: str | os.PathLike[str], on_invalid: str) -> Iterator[InputRecord]:
    yield from open_input(path).records(on_invalid)


def input_totals(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(records, residues) of what :func:`input_records` reads, for a progress total (None
    when unknown: standard input, or an input that cannot be opened, whose reader says why)."""
    try:
        return open_input(path).totals()
    except UserError:
        return None


def total_in_background(bar: Any, path: str | os.PathLike[str], kind: str) -> None:  # noqa: ANN401
    """Give a command's ``bar`` the input's records or residues (``kind``) as its total, from a
    scan in the background (:func:`input_totals`); not under torchrun/srun, where each rank
    does a share."""
    from protein_performer.io.progress import total_later
    from protein_performer.io.ranks import detect_ranks

    if detect_ranks().distributed:
        return
    index = {"records": 0, "residues": 1}[kind]

    def count() -> int | None:
        totals = input_totals(path)
        return None if totals is None else totals[index]

    total_later(bar, count)


def read_records(fasta: str | os.PathLike[str], on_invalid: str = "error") -> list:
    """All FASTA records in file order (``FastaRecord``; ``-``: standard input); errors name
    file, record and line."""
    from protein_performer.data.fasta import read_fasta
    from protein_performer.data.stdin import display_name

    path = open_input(fasta, store=False).path
    records = list(_note_nucleotides(read_fasta(path, on_invalid=on_invalid), fasta))  # type: ignore[arg-type]
    if not records:
        raise UserError(f"{display_name(path)}: no valid records to process")
    return records


def read_homologs(path: str | os.PathLike[str]) -> tuple[Any, list]:
    """The reference (an MSA's first row, at its coordinates; None for a FASTA) and the
    homologs of a family-context file, in order (:class:`~protein_performer.data.msa.Member`:
    id, residues, coordinates or None); ``-``: standard input. One opener for every kind the
    field writes:

    * an MSA (``data.msa``): Stockholm (by its name or its first line), or an A2M/A3M (by its
      name, or a FASTA file with gaps ``-``/``.``): gaps never become tokens, the first row is
      the reference, each homolog residue carries its reference coordinate;
    * the FASTA ``protein-performer homologs`` writes: each hit placed on its query by the
      alignment in its header (``cigar=`` and the aligned ranges:
      :func:`~protein_performer.data.hits.hit_coordinates`; all hits of one query; of
      several, none is placed);
    * any other FASTA: homologs without coordinates (upper-cased as every FASTA read).
    """
    from protein_performer.data.fasta import read_fasta
    from protein_performer.data.msa import (
        Member,
        a2m_members,
        is_aligned,
        msa_format,
        read_stockholm,
    )
    from protein_performer.data.stdin import display_name

    src = open_input(path, store=False, give="a FASTA file or an MSA").path
    fmt = msa_format(src)
    if fmt == "stockholm":
        return read_stockholm(src)
    reader = read_fasta(src, aligned=True, check_duplicates=False)  # type: ignore[arg-type]
    records = list(_note_nucleotides(reader, display_name(src)))
    if not records:
        raise UserError(f"{display_name(src)}: no valid records to process")
    if fmt in ("a2m", "a3m") or is_aligned([r.sequence for r in records]):
        return a2m_members(records, display_name(src))
    members = [Member(r.id, r.sequence.upper()) for r in records]
    placed = [hit_coordinates(r.description, len(r.sequence)) for r in records]
    queries = {p[0] for p in placed if p is not None}
    if len(queries) > 1:
        log.warning(
            "%s: hits of %d queries (%s); their ranges place them on different sequences, so "
            "they are read without coordinates (give one query's hits to place them)",
            display_name(src), len(queries), ", ".join(sorted(queries)[:3]),
        )  # fmt: skip
        return None, members
    return None, [
        m if p is None else Member(m.id, m.sequence, p[1])
        for m, p in zip(members, placed, strict=True)
    ]


def find_record(records: Sequence[Any], want: str | None, source: str | os.PathLike[str]) -> Any:
    """The record whose id, UniProt accession or entry name is ``want`` (the first record when
    ``want`` is None); a miss is one error naming ``source`` and the first ids."""
    from protein_performer.data.headers import IdLookup
    from protein_performer.data.stdin import display_name

    if want is None:
        return records[0]
    found = IdLookup(r.id for r in records).find(want)
    if found is not None:
        return records[found]
    listed = ", ".join(shown(r.id) for r in records[:5])
    raise UserError(
        f"{display_name(source)}: no record {want!r} (by id, accession or entry name; ids "
        f"start: {listed}, ...)"
    )


def as_records(seqs: Records | str) -> Iterator[tuple[str, str]]:
    """Strings or (id, sequence) pairs -> validated (id, SEQUENCE); a bad one names its index."""
    if isinstance(seqs, str):
        seqs = [seqs]
    alphabet = Alphabet()
    for i, item in enumerate(seqs):
        where = f"sequence {i} (0-based index in the list)"
        if isinstance(item, str):
            rid, seq = str(i), item
        elif isinstance(item, tuple) and len(item) == 2:
            rid, seq = str(item[0]), item[1]
            where = f"sequence {i} (id {shown(rid)})"
        elif hasattr(item, "id") and hasattr(item, "sequence"):  # a FastaRecord
            rid, seq = item.id, item.sequence
            where = f"sequence {i} (id {shown(rid)})"
        else:
            raise UserError(
                f"{where}: expected a string or an (id, sequence) pair, got {type(item).__name__}"
            )
        if not isinstance(seq, str):
            raise UserError(f"{where}: expected a string, got {type(seq).__name__}")
        seq = seq.strip().upper()
        if not seq:
            raise UserError(f"{where} is empty")
        alphabet.check_residues(seq, where)
        yield rid, seq
