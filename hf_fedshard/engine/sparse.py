"""The sparse payload (``fed_sync_dtype topk``): in each chunk of a tensor, its k largest values, low-bit.

Rule, for one flat fp32 tensor x (a rank's local shard of Δ plus its error feedback), cut from its start into chunks
of ``chunk`` values (the last may be shorter), for a chunk c of n values::

    k      = min(n, max(1, ⌈density · n⌉))
    S      = the k indices of c's largest |x_i| (ties: the lower index first)
    s      = max_{i ∈ S} |x_i| / L,   L = 2^(bits − 1) − 1                 (one fp32 scale per chunk)
    q_i    = round(x_i / s) ∈ [−L, L]  for i ∈ S   (s = 0: q_i = 0)
    D(E(x))_i = q_i · s  for i ∈ S,  0 elsewhere

On the wire a chunk is its k codes q_i + L of ``bits`` bits (packed, 8/bits per byte), its k chunk-local indices in
the smallest unsigned integer type that holds ``chunk`` − 1 (uint8, uint16, else int32) and its scale. Chunks start
at each tensor's first value, so the encoding of a tensor is the same whichever buckets or replica parts carry it:
every rank can compute what it sent (`roundtrip`) without the exchange's help, which error feedback
(`hf_fedshard.engine.feedback`) needs. With 2 bits, L = 1: each value sent is its sign times the chunk's largest
magnitude, or 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_fedshard.errors import ConfigError

SPARSE = "topk"
SPARSE_BITS = (2, 4, 8)


@dataclass(frozen=True)
class SparseCodec:
    """``fed_sync_density``, ``fed_sync_bits`` and ``fed_sync_chunk``: the rule of the module docstring."""

    density: float = 0.01
    bits: int = 2
    chunk: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ConfigError(
                f"fed_sync_density={self.density}: it must be in (0, 1], the fraction of each chunk's values sent. "
                "Set --fed_sync_density to e.g. 0.01."
            )
        if self.bits not in SPARSE_BITS:
            raise ConfigError(
                f"fed_sync_bits={self.bits}: a sent value takes 2, 4 or 8 bits. Set --fed_sync_bits to one of them."
            )
        if not 1 <= self.chunk <= 2**31 - 1:
            raise ConfigError(
                f"fed_sync_chunk={self.chunk}: it must be a positive number of values. Set --fed_sync_chunk to e.g. "
                "4096."
            )

    @property
    def levels(self) -> int:
        """L: codes are q + L ∈ [0, 2L]."""
        return 2 ** (self.bits - 1) - 1

    @property
    def index_dtype(self) -> torch.dtype:
        """The smallest integer type that holds a chunk-local index."""
        if self.chunk <= 2**8:
            return torch.uint8
        return torch.uint16 if self.chunk <= 2**16 else torch.int32

    def k(self, n: int) -> int:
        """Values sent of a chunk of ``n``."""
        return min(n, max(1, math.ceil(self.density * n)))

    def _counts(self, numel: int) -> tuple[int, int]:
        """(whole chunks, length of the short last chunk or 0) of a tensor of ``numel`` values."""
        return numel // self.chunk, numel % self.chunk

    def nbytes(self, numel: int) -> int:
        """Bytes of the encoding of a tensor of ``numel`` values: codes, indices, scales."""
        whole, tail = self._counts(numel)
        sent = whole * self.k(self.chunk) + (self.k(tail) if tail else 0)
        chunks = whole + (1 if tail else 0)
        return math.ceil(sent * self.bits / 8) + sent * self.index_dtype.itemsize + 4 * chunks

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The bytes (uint8, `nbytes` of them) that stand for flat fp32 ``x``."""
        indices, codes, scales = [], [], []
        for (start, stop, n), k in self._blocks(x.numel()):
            block = x[start:stop].float().view(-1, n)
            order = torch.sort(block.abs(), dim=1, descending=True, stable=True).indices[:, :k]
            picked = block.gather(1, order)
            scale = picked.abs().amax(dim=1) / self.levels
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(picked / safe[:, None]).clamp_(-self.levels, self.levels)
            indices.append(order.reshape(-1))
            codes.append((q + self.levels).to(torch.uint8).reshape(-1))
            scales.append(scale)
        if not indices:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        packed = _pack(torch.cat(codes), self.bits)
        index_bytes = torch.cat(indices).to(self.index_dtype).view(torch.uint8)
        return torch.cat([packed, index_bytes, torch.cat(scales).view(torch.uint8)])

    @torch.no_grad()
    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values (``numel`` of them) that `encode`'s bytes ``data`` stand for."""
        out = torch.zeros(numel, dtype=torch.float32, device=data.device)
        blocks = self._blocks(numel)
        sent = sum((b - a) // n * k for (a, b, n), k in blocks)
        code_bytes = math.ceil(sent * self.bits / 8)
        index_end = code_bytes + sent * self.index_dtype.itemsize
        codes = _unpack(data[:code_bytes], self.bits, sent).float() - self.levels
        indices = data[code_bytes:index_end].clone().view(self.index_dtype).to(torch.int64)
        scales = data[index_end:].clone().view(torch.float32)
        at = chunk = 0
        for (start, stop, n), k in blocks:
            rows = (stop - start) // n
            values = codes[at : at + rows * k].view(rows, k) * scales[chunk : chunk + rows, None]
            where = indices[at : at + rows * k].view(rows, k) + torch.arange(rows, device=data.device)[:, None] * n
            out[start:stop].scatter_(0, where.reshape(-1), values.reshape(-1))
            at, chunk = at + rows * k, chunk + rows
        return out

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """D(E(x)): the values a rank sends for ``x``, as every peer decodes them."""
        return self.decode(self.encode(x), x.numel())

    def _blocks(self, numel: int) -> list[tuple[tuple[int, int, int], int]]:
        """((start, stop, chunk length), k) of the whole chunks, then of the short last one."""
        whole, tail = self._counts(numel)
        blocks = [((0, whole * self.chunk, self.chunk), self.k(self.chunk))] if whole else []
        if tail:
            blocks.append(((whole * self.chunk, numel, tail), self.k(tail)))
        return blocks


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes below 2^bits, 8/bits to a byte (the first in the low bits), the last byte padded with zeros."""
    per = 8 // bits
    rows = F.pad(codes, (0, -codes.numel() % per)).view(-1, per).to(torch.int32)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (rows << shifts).sum(dim=1).to(torch.uint8)


def _unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """`_pack`'s inverse: the first ``count`` codes of ``data``."""
    per = 8 // bits
    shifts = torch.arange(per, device=data.device, dtype=torch.int32) * bits
    codes = (data.to(torch.int32)[:, None] >> shifts) & (2**bits - 1)
    return codes.reshape(-1)[:count]
