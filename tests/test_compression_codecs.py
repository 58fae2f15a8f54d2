"""The codecs of compressed rounds, alone (no process group): round trips within their stated error bounds.

Each codec's docstring states its bound; these tests check it on random data of sizes that are not multiples of
the block or chunk, on empty input, on bf16 and fp32 input, and check the payload's size and layout.
"""

from __future__ import annotations

import pytest
import torch

from hieravg_optim.compression import Int8Block, TopK

SIZES = [0, 1, 7, 255, 256, 257, 1000, 4097]


def _roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_nbytes(x.numel())
    assert payload.numel() % 8 == 0
    out = torch.zeros(codec.padded_numel(x.numel()))
    codec.decode_add_(payload, out)
    assert not out[x.numel() :].any(), "the padding decodes to zeros"
    return out[: x.numel()]


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    padded = torch.zeros(-(-x.numel() // width) * width)
    padded[: x.numel()] = x.float()
    return padded.view(-1, width)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block", [1, 5, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_within_bound(numel, block, dtype):
    torch.manual_seed(numel + block)
    x = (torch.randn(numel) * torch.logspace(-3, 3, max(numel, 1))[:numel]).to(dtype)
    codec = Int8Block(block)
    y = _roundtrip(codec, x)
    rows = _rows(x, block)
    # Stated bound: absmax(block) / 254, times 1 + 2**-14 for the fp32 roundings.
    bound = (rows.abs().amax(dim=1, keepdim=True) / 254 * (1 + 2**-14)).expand_as(rows).reshape(-1)[:numel]
    err = (y - x.float()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert codec.payload_nbytes(numel) >= numel + 4 * (-(-numel // block))


def test_int8_exact_cases_and_size():
    codec = Int8Block(4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 127.0, -127.0, 1.0, 2.0, 3.0])
    y = _roundtrip(codec, x)
    assert torch.equal(y[:4], torch.zeros(4)), "a zero block decodes to zeros"
    assert torch.equal(y[4:8], x[4:8]), "integers up to 127 in a block of absmax 127 are exact"
    assert y[8] == 3.0
    # 256 int8 values and one fp32 scale per block of 256: 0.254x of fp32.
    assert Int8Block().payload_nbytes(256 * 1000) == 260 * 1000


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("values", ["int8", "float32", "bfloat16", "float16"])
def test_topk_within_bound(numel, values):
    torch.manual_seed(numel)
    x = torch.randn(numel)
    codec = TopK(density=0.1, chunk=64, values=values)
    y = _roundtrip(codec, x)
    rows = _rows(x, 64)
    kth = rows.abs().topk(codec.k, dim=1).values[:, -1:]  # the k-th largest magnitude of each chunk
    kept = (y != 0).float()
    flat_kth = kth.expand_as(rows).reshape(-1)[:numel]
    absmax = rows.abs().amax(dim=1, keepdim=True).expand_as(rows).reshape(-1)[:numel]
    err = (y - x).abs()
    # Not kept: the element itself, at most the k-th largest magnitude of its chunk.
    assert bool((err[kept == 0] <= flat_kth[kept == 0]).all())
    # Kept: the value's rounding (int8: absmax / 254; a float dtype: half an ulp, relative 2**-8 for bf16).
    rel = {"int8": None, "float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11}[values]
    if rel is None:
        ok = err <= absmax / 254 * (1 + 2**-14)
    else:
        ok = err <= x.abs() * rel
    assert bool(ok[kept == 1].all())
    per_chunk = (y.numel() and _rows(y, 64).ne(0).sum(dim=1)) if numel else torch.zeros(0)
    if numel:
        assert int(per_chunk.max()) <= codec.k


def test_topk_keeps_the_largest_and_counts_bytes():
    codec = TopK(density=0.25, chunk=8, values="float32")
    x = torch.tensor([1.0, -9.0, 2.0, 8.0, 0.5, 0.0, -3.0, 0.1, 4.0])
    y = _roundtrip(codec, x)
    # k = 2 per chunk of 8: -9 and 8 in the first, 4 alone in the second (padded) chunk.
    assert torch.equal(y, torch.tensor([0.0, -9.0, 0.0, 8.0, 0.0, 0.0, 0.0, 0.0, 4.0]))
    # 1% of chunks of 4096 with int8 values: 41 int16 indices, 41 int8 values, one fp32 scale per chunk.
    big = TopK(density=0.01)
    assert big.k == 41 and big.payload_nbytes(4096 * 100) == 12704  # 100 * (4 + 41 * 2 + 41), padded to 8 bytes
    assert big.payload_nbytes(4096 * 100) / (4 * 4096 * 100) < 0.008
    assert TopK(density=0.5, chunk=65536)._index_dtype() == torch.int32


def test_full_density_float32_is_lossless():
    torch.manual_seed(0)
    x = torch.randn(1000)
    assert torch.equal(_roundtrip(TopK(density=1.0, chunk=16, values="float32"), x), x)


def test_decode_adds_in_place():
    codec = Int8Block(8)
    x = torch.arange(16, dtype=torch.float32)
    out = torch.ones(16)
    codec.decode_add_(codec.encode(x), out)
    torch.testing.assert_close(out, x + 1, atol=15 / 254 + 1e-6, rtol=0)


def test_vectorized_no_python_loop_per_block():
    # A million elements in blocks of 1: a Python loop per block would take many seconds here.
    import time

    x = torch.randn(1_000_000)
    start = time.perf_counter()
    for codec in (Int8Block(1), TopK(density=0.5, chunk=2)):
        codec.decode_add_(codec.encode(x), torch.zeros(codec.padded_numel(x.numel())))
    assert time.perf_counter() - start < 20


@pytest.mark.parametrize(
    "codec",
    [Int8Block(256), Int8Block(3000), TopK(density=0.01), TopK(density=0.1, chunk=3000, values="bfloat16")],
    ids=["int8", "int8-3000", "topk", "topk-3000-bf16"],
)
def test_slabs_equal_one_pass(codec, monkeypatch):
    # On the CPU the codecs work in slabs of rows (cache-sized temporaries); slab edges must change no bit: the
    # same payload and the same decoded sum as one pass over every row (the path of other devices).
    from hieravg_optim.compression import codecs

    x = torch.randn(700_001, generator=torch.Generator().manual_seed(3)) * torch.rand(700_001).pow(4)
    x[:5000] = 0  # whole zero blocks and chunks
    slabbed = codec.encode(x)
    out = torch.ones(codec.padded_numel(x.numel()))
    codec.decode_add_(slabbed, out)
    assert len(codecs._slabs(-(-x.numel() // 3000), 3000, x.device)) > 1
    monkeypatch.setattr(codecs, "_SLAB", 1 << 30)
    one_pass = codec.encode(x)
    expected = torch.ones(codec.padded_numel(x.numel()))
    codec.decode_add_(one_pass, expected)
    assert torch.equal(slabbed, one_pass)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Int8Block(0), "positive integer"),
        (lambda: Int8Block(2.5), "positive integer"),
        (lambda: TopK(density=0.0), r"\(0, 1\]"),
        (lambda: TopK(density=1.5), r"\(0, 1\]"),
        (lambda: TopK(density=1e-4, chunk=64), "keeps no element"),
        (lambda: TopK(density=0.1, chunk=-1), "positive integer"),
        (lambda: TopK(density=0.1, values="int4"), "values must be one of"),
    ],
)
def test_bad_specs(make, match):
    with pytest.raises(ValueError, match=match):
        make()
