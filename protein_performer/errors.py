"""User-facing errors: the CLI prints these as one clear message, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's input (file, flag, config); its message says what to do.

    The CLI catches it, prints ``error: <message>`` and exits with status 2.
    """
