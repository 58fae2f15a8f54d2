"""The reusable buckets, and the chunking, packing and unpacking of tensors through them."""

from __future__ import annotations

import torch

__all__ = ["DIRECT_MIN_BYTES", "BucketPool", "flat_pieces", "pack", "unpack"]

DIRECT_MIN_BYTES = {"cpu": 4 << 20, "cuda": 1 << 20}
"""Per device type: tensors of their wire dtype of at least this many bytes are all-reduced in place (no copy
into a bucket); measured with ``bench/averaging.py`` (gloo, 2 and 4 ranks) and ``bench/gpu_averaging.py``."""


class BucketPool:
    """Reusable communication buckets, one per (device, wire dtype).

    A bucket is allocated on first use with ``min(cap, elements needed)`` elements
    and grows, never beyond the cap, when a later round needs more.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(key, None)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held by all buckets."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Free every bucket."""
        self._buffers.clear()


def flat_pieces(
    packed: list[tuple[torch.Tensor, torch.dtype]], cap: int
) -> list[list[tuple[torch.Tensor, int, int, torch.Tensor | None, torch.Tensor]]]:
    """Split ``packed`` (tensor, wire dtype) into chunks of at most ``cap`` elements.

    Returns per chunk a list of ``(destination, offset, numel, copy_back_to, source)``; a tensor that fits
    in a chunk is its own destination (any strides: copies handle them), a tensor that straddles chunks
    is cut into flat slices of itself, or of one temporary contiguous copy when it is not contiguous
    (``copy_back_to`` is then the tensor, set on its last piece). The cut depends only on the sizes,
    which the ranks agreed on, never on the strides.
    """
    chunks: list[list] = [[]]
    used = 0
    for t, _ in packed:
        n = t.numel()
        if used + n <= cap:
            chunks[-1].append((t, used, n, None, t))
            used += n
            continue
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)
        start = 0
        while start < n:
            if used == cap:
                chunks.append([])
                used = 0
            take = min(n - start, cap - used)
            last = start + take == n
            back = t if last and flat.data_ptr() != t.data_ptr() else None
            chunks[-1].append((flat[start : start + take], used, take, back, flat))
            used += take
            start += take
    return chunks


def pack(chunk: list, bucket: torch.Tensor) -> None:
    dsts = [bucket[o : o + n].view(d.shape) for d, o, n, _, _ in chunk]
    torch._foreach_copy_(dsts, [d for d, _, _, _, _ in chunk])


def unpack(chunk: list, bucket: torch.Tensor, divisor: float | None) -> None:
    """Copy a reduced chunk back with one foreach copy, dividing by ``divisor`` in the wider of the two dtypes.

    Pieces whose dtype is at most as wide as the wire dtype are divided in the bucket, before the copy
    (one rounding); wider ones (float32 masters sent as bfloat16) after it, in their own dtype.
    """
    views = [bucket[o : o + n].view(d.shape) for d, o, n, _, _ in chunk]
    dsts = [d for d, _, _, _, _ in chunk]
    if divisor is not None:
        narrow = [v for v, d in zip(views, dsts) if d.element_size() <= bucket.element_size()]
        if len(narrow) == len(views):
            bucket.div_(divisor)
        elif narrow:
            torch._foreach_div_(narrow, divisor)
    torch._foreach_copy_(dsts, views)
    if divisor is not None:
        wide = [d for d in dsts if d.element_size() > bucket.element_size()]
        if wide:
            torch._foreach_div_(wide, divisor)
    for _, _, _, back, src in chunk:
        if back is not None:
            back.copy_(src.view(back.shape))
