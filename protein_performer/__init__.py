"""protein_performer: Performer (FAVOR+) protein language models for long sequences."""

__version__ = "0.1.0"
