"""The codecs of compressed rounds: int8 blockwise absmax and chunked top-k, on flat fp32 tensors.

A codec turns a flat tensor of ``numel`` elements into one ``uint8`` payload whose size depends on
``numel`` only (:meth:`payload_nbytes`), so that the payloads of a group's ranks all-gather into one
buffer, and back: :meth:`decode_add_` adds a payload's values into an fp32 accumulator. Every operation is a
handful of vectorized torch ops on the tensor's device (no Python loop per block or chunk): on the CPU over
slabs of many blocks (about 1 MiB of fp32 each, so that the temporaries stay in cache and none is as large as
the tensor), elsewhere over the whole tensor at once; rows are independent, so slabs change no bit. Decoding is
elementwise or a scatter of distinct indices, so the same payload decodes to the same bits on every rank.

Payload layout: the sections (scales, indices, values) one after the other, each starting at a multiple of
its element size, the whole padded to a multiple of 8 bytes, so that each section of a payload inside a
gathered buffer is viewed in its dtype without a copy.

The specs are frozen dataclasses: the canonical, hashable form of one level's ``compress`` setting
(:attr:`hieravg_optim.AveragingConfig.compress`), compared across ranks by the config's agreement.
Everything here is local (no collective).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Union

import torch

__all__ = ["VALUE_DTYPES", "Codec", "Int8Block", "TopK", "payload_sections"]

VALUE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""What the kept values of :class:`TopK` travel as: ``"int8"`` (one fp32 scale per chunk) or a float dtype."""

_INT8_MAX = 127.0
_MAX_WIDTH = 2**24
"""The largest block or chunk, in elements."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _align(offset: int, size: int) -> int:
    return -(-offset // size) * size


def payload_sections(parts: list[tuple[str, torch.dtype, int]]) -> tuple[dict[str, tuple[int, torch.dtype, int]], int]:
    """Byte offsets of ``parts`` (``(name, dtype, numel)``) in one payload, each aligned to its element size.

    Returns:
        ``({name: (offset, dtype, numel)}, total bytes)``, the total a multiple of 8.
    """
    offset = 0
    where = {}
    for name, dtype, numel in parts:
        size = torch.empty((), dtype=dtype).element_size()
        offset = _align(offset, size)
        where[name] = (offset, dtype, numel)
        offset += numel * size
    return where, _align(offset, 8)


def _section(payload: torch.Tensor, where: tuple[int, torch.dtype, int]) -> torch.Tensor:
    """The section ``where`` of a ``uint8`` ``payload`` as a tensor of its dtype (a view, no copy)."""
    offset, dtype, numel = where
    size = torch.empty((), dtype=dtype).element_size()
    return payload[offset : offset + numel * size].view(dtype)


_SLAB = 1 << 18
"""Elements per slab on the CPU (1 MiB of fp32): a slab's temporaries stay in cache."""


def _slabs(rows: int, width: int, device: torch.device) -> list[tuple[int, int]]:
    """The ``(first, end)`` row ranges that an operation over ``rows`` rows of ``width`` elements runs in.

    On the CPU, slabs of about :data:`_SLAB` elements (at least one row), so that every temporary stays in cache
    and no full-size temporary is allocated (the loop is per slab of many blocks, not per block); on another
    device, one slab of every row (one kernel per operation)."""
    per = max(1, _SLAB // width) if device.type == "cpu" else max(1, rows)
    return [(first, min(rows, first + per)) for first in range(0, rows, per)]


def _rows_into(work: torch.Tensor, flat: torch.Tensor, first: int, end: int, width: int) -> torch.Tensor:
    """Rows ``first..end`` of ``flat`` (1-D) cut into rows of ``width``, the last one padded with zeros: copied
    into the fp32 buffer ``work`` and returned as a ``[end - first, width]`` view of it."""
    lo, hi = first * width, min(flat.numel(), end * width)
    out = work[: (end - first) * width]
    out[: hi - lo].copy_(flat[lo:hi])
    if hi - lo < out.numel():
        out[hi - lo :].zero_()
    return out.view(end - first, width)


def _work(rows: int, width: int, slabs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """One fp32 buffer for the largest slab of ``slabs``."""
    return torch.empty(max(e - f for f, e in slabs) * width, dtype=torch.float32, device=device)


@dataclass(frozen=True, slots=True)
class Int8Block:
    """Blockwise absmax int8 (INTELLECT-1, https://arxiv.org/abs/2412.01152; bitsandbytes' blockwise quantization).

    The flat tensor is cut into blocks of :attr:`block` elements (the last one padded with zeros); each block
    travels as :attr:`block` int8 values ``q = round(x / s)`` and one fp32 scale ``s = absmax(block) / 127``.
    Decoded, ``q * s``.

    Error bound: per element, ``|x - decode(encode(x))| <= absmax(block) / 254 * (1 + 2**-14)`` (half a
    quantization step ``s / 2``, plus the fp32 rounding of ``x / s`` and ``q * s``, at most ``127 * 2**-24``
    steps); zero blocks decode exactly to zero, and integers of a block whose absmax is 127 exactly.

    Bytes: ``block + 4`` per block of ``block`` fp32 elements (``4 * block`` bytes): 0.254x of fp32 for the
    default block of 256.
    """

    block: int = 256
    """Elements per scale; a positive integer."""

    kind: ClassVar[str] = "int8"

    def __post_init__(self) -> None:
        if not _is_int(self.block) or not 0 < self.block <= _MAX_WIDTH:
            raise ValueError(
                f'compress: the int8 block must be a positive integer number of elements (at most {_MAX_WIDTH}), got '
                f'{self.block!r}: pass e.g. {{"type": "int8", "block": 256}}.'
            )

    def describe(self) -> dict[str, object]:
        """The spec in its user form (``{"type": "int8", "block": 256}``)."""
        return {"type": self.kind, "block": self.block}

    def _layout(self, numel: int) -> tuple[dict[str, tuple[int, torch.dtype, int]], int, int]:
        blocks = -(-numel // self.block)
        where, total = payload_sections([("scales", torch.float32, blocks), ("q", torch.int8, blocks * self.block)])
        return where, total, blocks

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of the payload of ``numel`` elements."""
        return self._layout(numel)[1]

    def padded_numel(self, numel: int) -> int:
        """Elements of the accumulator :meth:`decode_add_` adds into: ``numel`` rounded up to whole blocks."""
        return -(-numel // self.block) * self.block

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The ``uint8`` payload of ``flat`` (1-D, floating point, finite; computed in fp32)."""
        where, total, _ = self._layout(flat.numel())
        payload = torch.zeros(total, dtype=torch.uint8, device=flat.device)
        if flat.numel() == 0:
            return payload
        flat = flat.detach().reshape(-1)
        blocks = -(-flat.numel() // self.block)
        scales, q = _section(payload, where["scales"]), _section(payload, where["q"])
        slabs = _slabs(blocks, self.block, flat.device)
        work = _work(blocks, self.block, slabs, flat.device)
        for first, end in slabs:
            rows = _rows_into(work, flat, first, end, self.block)
            s = torch.linalg.vector_norm(rows, float("inf"), dim=1).div_(_INT8_MAX)
            scales[first:end].copy_(s)
            # A zero block has scale 0: divide by 1 instead (its values are 0 anyway).
            rows.div_(torch.where(s > 0, s, 1.0).unsqueeze(1)).round_().clamp_(-_INT8_MAX, _INT8_MAX)
            q[first * self.block : end * self.block].copy_(rows.view(-1))
        return payload

    def decode_add_(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Add the values of ``payload`` to ``out`` (fp32, 1-D, :meth:`padded_numel` elements), in place."""
        blocks = out.numel() // self.block
        where, _, _ = self._layout(out.numel())
        if blocks == 0:
            return
        scales = _section(payload, where["scales"])
        q = _section(payload, where["q"]).view(blocks, self.block)
        rows = out.view(blocks, self.block)
        for first, end in _slabs(blocks, self.block, out.device):
            rows[first:end].addcmul_(q[first:end].to(torch.float32), scales[first:end].unsqueeze(1))


@dataclass(frozen=True, slots=True)
class TopK:
    """Chunked top-k: per chunk of :attr:`chunk` elements, the ``k = round(density * chunk)`` of largest magnitude.

    SparseLoCo (https://arxiv.org/abs/2508.15706) sends such a chunked top-k of 1-3% with error feedback;
    MuLoCo (https://arxiv.org/abs/2505.23725) top-k 10%. The flat tensor is cut into chunks (the last one padded
    with zeros); each chunk travels as ``k`` chunk-local indices (int16 for chunks of at most 32768 elements,
    else int32) and ``k`` values in :attr:`values`: ``"int8"`` with one fp32 scale per chunk
    (``absmax(kept) / 127``), or a float dtype. Decoded, the kept values at their indices, zeros elsewhere.

    Error bound: per element, ``|x - decode(encode(x))|`` is ``|x|`` for an element not kept, which is at most
    the ``k``-th largest magnitude of its chunk; for a kept element, the rounding of its value: with ``"int8"``
    at most ``absmax(kept) / 254 * (1 + 2**-14)`` (as :class:`Int8Block`), with a float dtype half an ulp of it
    there (exact in float32).

    Bytes per chunk: ``k`` indices plus ``k`` values (plus 4 for the int8 scale): with density 0.01, chunk 4096
    and int8 values, 41 * 3 + 4 = 127 bytes for 16384 bytes of fp32, 0.0078x.
    """

    density: float
    """Fraction of each chunk kept, in ``(0, 1]``, at least one element per chunk."""
    chunk: int = 4096
    """Elements per chunk; a positive integer (SparseLoCo's 64 x 64 chunks: 4096)."""
    values: str = "int8"
    """The dtype of the kept values: a key of :data:`VALUE_DTYPES`."""

    kind: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        example = '{"type": "topk", "density": 0.01, "chunk": 4096, "values": "int8"}'
        if not _is_int(self.chunk) or not 0 < self.chunk <= _MAX_WIDTH:
            raise ValueError(
                f"compress: the top-k chunk must be a positive integer number of elements (at most {_MAX_WIDTH}), got "
                f"{self.chunk!r}: pass e.g. {example}."
            )
        if not isinstance(self.density, float) or not 0 < self.density <= 1:
            raise ValueError(
                f"compress: the top-k density must be a number in (0, 1] (the fraction of each chunk kept), got "
                f"{self.density!r}: pass e.g. {example}."
            )
        if self.density * self.chunk < 0.5:
            raise ValueError(
                f"compress: top-k density {self.density!r} keeps no element of a chunk of {self.chunk} "
                f"(density * chunk = {self.density * self.chunk:.3g} rounds to 0): raise the chunk to at least "
                f"{math.ceil(0.5 / self.density)} elements, or the density."
            )
        if self.values not in VALUE_DTYPES:
            raise ValueError(
                f"compress: the top-k values must be one of {list(VALUE_DTYPES)}, got {self.values!r}: pass e.g. "
                f"{example}."
            )

    @property
    def k(self) -> int:
        """Elements kept per chunk."""
        return max(1, min(self.chunk, round(self.density * self.chunk)))

    def describe(self) -> dict[str, object]:
        """The spec in its user form."""
        return {"type": self.kind, "density": self.density, "chunk": self.chunk, "values": self.values}

    def _index_dtype(self) -> torch.dtype:
        return torch.int16 if self.chunk <= 32768 else torch.int32

    def _layout(self, numel: int) -> tuple[dict[str, tuple[int, torch.dtype, int]], int, int]:
        chunks = -(-numel // self.chunk)
        kept = chunks * self.k if numel else 0
        parts = [("index", self._index_dtype(), kept), ("values", VALUE_DTYPES[self.values], kept)]
        if self.values == "int8":
            parts.insert(0, ("scales", torch.float32, chunks))
        # Largest elements first: every section stays aligned to its element size with no padding but the last.
        parts.sort(key=lambda p: -torch.empty((), dtype=p[1]).element_size())
        where, total = payload_sections(parts)
        return where, total, chunks

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of the payload of ``numel`` elements."""
        return self._layout(numel)[1]

    def padded_numel(self, numel: int) -> int:
        """Elements of the accumulator :meth:`decode_add_` adds into: ``numel`` rounded up to whole chunks."""
        return -(-numel // self.chunk) * self.chunk

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The ``uint8`` payload of ``flat`` (1-D, floating point, finite; computed in fp32)."""
        where, total, _ = self._layout(flat.numel())
        payload = torch.zeros(total, dtype=torch.uint8, device=flat.device)
        if flat.numel() == 0:
            return payload
        flat = flat.detach().reshape(-1)
        chunks, k = -(-flat.numel() // self.chunk), self.k
        index_out, values_out = _section(payload, where["index"]), _section(payload, where["values"])
        slabs = _slabs(chunks, self.chunk, flat.device)
        work = _work(chunks, self.chunk, slabs, flat.device)
        for first, end in slabs:
            rows = _rows_into(work, flat, first, end, self.chunk)
            index = rows.abs().topk(k, dim=1, sorted=False).indices
            kept = rows.gather(1, index)
            if self.values == "int8":
                scales = kept.abs().amax(dim=1) / _INT8_MAX
                kept = kept.div_(torch.where(scales > 0, scales, 1.0).unsqueeze(1)).round_()
                kept.clamp_(-_INT8_MAX, _INT8_MAX)
                _section(payload, where["scales"])[first:end].copy_(scales)
            index_out[first * k : end * k].copy_(index.view(-1))
            values_out[first * k : end * k].copy_(kept.view(-1))
        return payload

    def decode_add_(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Add the values of ``payload`` to ``out`` (fp32, 1-D, :meth:`padded_numel` elements), in place.

        The indices of one chunk are distinct, so the scatter adds each value once, in any order: the result
        is the same bits on every rank and device."""
        chunks = out.numel() // self.chunk
        if chunks == 0:
            return
        where, _, _ = self._layout(out.numel())
        index = _section(payload, where["index"]).view(chunks, self.k).to(torch.int64)
        kept = _section(payload, where["values"]).view(chunks, self.k).to(torch.float32)
        if self.values == "int8":
            kept = kept * _section(payload, where["scales"]).unsqueeze(1)
        out.view(chunks, self.chunk).scatter_add_(1, index, kept)


Codec = Union[Int8Block, TopK]
"""The spec of one compressed level."""
