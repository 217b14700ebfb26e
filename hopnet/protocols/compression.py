"""The codecs a protocol's ``--compress`` can name (pipe-sgd, diloco)."""

from __future__ import annotations

COMPRESSIONS = ("none", "trunc16", "int8")
"""What :func:`hopnet.collectives.compression.make_codec` knows, named here without importing it
(it needs torch); tests/test_cli_imports.py keeps the two the same."""

__all__ = ["COMPRESSIONS"]
