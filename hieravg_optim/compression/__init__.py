"""Compressed rounds with error feedback: the codecs, the settings, the round.

A level with ``compress`` sends its pseudo-gradient ``anchor - theta`` (plus the error-feedback residual)
compressed: :mod:`~hieravg_optim.compression.codecs` (int8 blockwise absmax, chunked top-k),
:mod:`~hieravg_optim.compression.settings` (the user forms of ``compress`` and ``ef_decay``) and
:mod:`~hieravg_optim.compression.round` (the round itself). See ``docs/compression.md``.
"""

from .codecs import VALUE_DTYPES, Codec, Int8Block, TopK
from .settings import CompressSpec, parse_compress, parse_ef_decay

__all__ = ["VALUE_DTYPES", "Codec", "CompressSpec", "Int8Block", "TopK", "parse_compress", "parse_ef_decay"]
