"""Structured fields from FASTA header lines (UniProtKB and UniRef conventions).

The split into train/valid/test hashes the UniRef cluster id when there is one, and the
preprocessed store keeps organism/taxid/gene for analysis, so headers are parsed once here.
Parsing is deliberately forgiving: any header yields at least ``id`` and ``description``; fields
that do not match a known convention are left as ``None`` instead of raising, because a bad
header must never stop a 60-million-record preprocessing run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

# " KEY=" starts a field; the value runs to the next " KEY=" (values such as OS contain spaces).
_KEY_SPLIT = re.compile(r"\s+([A-Za-z][A-Za-z0-9_]*)=")
_UNIREF_ID = re.compile(r"^(UniRef(?:50|90|100))_(\S+)$")
_UNIPROT_DBS = frozenset({"sp", "tr"})

# header key -> (HeaderInfo field, converter)
_STR_KEYS = {"OS": "organism", "Tax": "organism", "GN": "gene", "RepID": "rep_id"}
_INT_KEYS = {"OX": "taxid", "TaxID": "taxid", "PE": "pe", "SV": "sv", "n": "n_members"}


@dataclass(frozen=True)
class HeaderInfo:
    """One parsed header; ``None`` means the header does not carry that field."""

    id: str  # first whitespace-delimited word of the header (without '>')
    description: str  # the rest of the header line (may be "")
    db: str | None = None  # "sp", "tr" or "uniref"
    accession: str | None = None  # P69905; for UniRef the member part (A0A5A9P0L4)
    entry_name: str | None = None  # HBA_HUMAN
    protein_name: str | None = None  # description text before the first KEY= field
    organism: str | None = None  # OS= or Tax=
    taxid: int | None = None  # OX= or TaxID=
    gene: str | None = None  # GN=
    pe: int | None = None  # protein existence level, PE=
    sv: int | None = None  # sequence version, SV=
    cluster_id: str | None = None  # UniRef cluster id, e.g. "UniRef50_A0A5A9P0L4"
    n_members: int | None = None  # n=
    rep_id: str | None = None  # RepID=

    def to_dict(self) -> dict:
        """JSON-serialisable dict without the ``None`` fields (keeps stored metadata small)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out


def _to_int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


def parse_header(title: str) -> HeaderInfo:
    """Parse a header line (with or without the leading '>'); never raises on odd input."""
    if title.startswith(">"):
        title = title[1:]
    parts = title.split(None, 1)
    if not parts:
        return HeaderInfo(id="", description="")
    ident = parts[0]
    description = parts[1].strip() if len(parts) > 1 else ""
    kw: dict[str, object] = {}

    if "|" in ident:
        pieces = ident.split("|")
        if pieces[0] in _UNIPROT_DBS and len(pieces) >= 2 and pieces[1]:
            kw["db"] = pieces[0]
            kw["accession"] = pieces[1]
            if len(pieces) >= 3 and pieces[2]:
                kw["entry_name"] = pieces[2]
    elif ident.startswith("UniRef"):
        m = _UNIREF_ID.match(ident)
        if m:
            kw["db"] = "uniref"
            kw["cluster_id"] = ident
            kw["accession"] = m.group(2)

    if description:
        # ["protein name", key1, value1, key2, value2, ...]
        split = _KEY_SPLIT.split(" " + description)
        name = split[0].strip()
        if name:
            kw["protein_name"] = name
        for i in range(1, len(split) - 1, 2):
            key, value = split[i], split[i + 1].strip()
            if key in _STR_KEYS:
                if value:
                    kw.setdefault(_STR_KEYS[key], value)
            elif key in _INT_KEYS:
                number = _to_int(value)
                if number is not None:
                    kw.setdefault(_INT_KEYS[key], number)
    return HeaderInfo(id=ident, description=description, **kw)  # type: ignore[arg-type]


class IdLookup:
    """Find records by what a user calls them: the id as written, else its UniProt accession
    (``Q197F8`` for ``sp|Q197F8|002R_IIV3``, the member of ``UniRef50_Q197F8``) or entry name
    (``002R_IIV3``). One matcher for every command and reader that takes ids, so
    ``visualize --record`` and ``read_embeddings(ids=...)`` agree. An exact id wins; otherwise
    the first record carrying the accession or entry name."""

    def __init__(self, ids: Iterable[str]) -> None:
        self.ids = list(ids)
        self.exact: dict[str, int] = {}
        for n, rid in enumerate(self.ids):
            self.exact.setdefault(rid, n)
        self.alias: dict[str, int] | None = None  # parsed on the first miss only

    def find(self, want: str) -> int | None:
        """The position of the record ``want`` names, None when none does."""
        if want in self.exact:
            return self.exact[want]
        if self.alias is None:
            self.alias = {}
            for n, rid in enumerate(self.ids):
                info = parse_header(rid)
                for key in (info.accession, info.entry_name):
                    if key:
                        self.alias.setdefault(key, n)
        return self.alias.get(want)
