"""User-facing errors: the CLI prints these as one clear message, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's input (file, flag, config); its message says what to do.

    The CLI catches it, prints ``error: <message>`` and exits with status 2.
    """


def check_format_header(data: object, where: object, name: str, version: int, what: str) -> None:
    """Refuse a JSON file that is not ours (``format`` != ``name``) or is newer than this code.

    Every versioned file this package writes starts with ``format`` and ``format_version``, so
    a wrong or future file fails here with what it is and what to do, not later with a KeyError.
    """
    if not isinstance(data, dict) or data.get("format") != name:
        raise UserError(f"{where}: not a {what} (format != {name})")
    found = data.get("format_version")
    if found is None or not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise UserError(
            f"{where}: format_version is {'missing' if found is None else repr(found)}: the "
            f"file says it is a {what} but its header is damaged or was edited; re-create it"
        )
    if found > version:
        raise UserError(
            f"{where}: {what} format version {found!r} is newer than this protein-performer "
            f"reads ({version}); upgrade protein-performer"
        )
