"""Lightning's lines that say nothing to this package's users, silenced in one place.

* "💡 Tip: ... litlogger / litmodels": advertisements, printed at every launch;
* "Found N module(s) in eval mode at the start of training": our frozen parts (the
  distillation teacher, a frozen backbone under a fine-tuning head) are in eval mode on
  purpose;
* torch's ``LeafSpec`` deprecation raised from inside Lightning's own pytree helper.

Every other Lightning message (devices, the model summary, real warnings) is kept.
"""

from __future__ import annotations

import logging
import warnings

#: Start of Lightning's advertisement lines.
_TIP = "💡 Tip:"
#: Warning messages (regular expressions, matched at the start) dropped during training.
_WARNINGS = (
    r"Found \d+ module\(s\) in eval mode at the start of training",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)
#: Lightning's loggers that print the tips.
_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP)


_FILTER = _DropTips()


def quiet_lightning() -> None:
    """Install the filters (idempotent): call before building a ``Trainer``."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
