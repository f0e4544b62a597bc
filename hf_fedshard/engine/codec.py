"""The payload codec: how a pseudo-gradient is written on the wire (``fed_sync_dtype``); no communication here.

Rule, for a flat fp32 tensor ``x``::

    float32   decode(encode(x)) = x
    bfloat16  decode(encode(x)) = bf16(x)
    int8      decode(encode(x)) = q · s,  q = round(x / s) ∈ [-127, 127],  s = max|x_b| / 127 per block x_b

int8 keeps one fp32 scale per block x_b of `INT8_BLOCK` (256) consecutive values (symmetric, no zero point): a block's
largest value is exact and every other is off by at most s / 2. The scales travel with the values, so an int8
payload is 1 + 4/256 bytes per value, about a quarter of fp32's 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SYNC_DTYPES = ("float32", "bfloat16", "int8", "topk")  # topk: `hf_fedshard.engine.sparse`, its own codec
INT8_BLOCK = 256
_INT8_MAX = 127.0


@dataclass
class Encoded:
    """A payload as it is sent: values in the wire dtype, and the int8 per-block scales (``None`` otherwise)."""

    values: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.values.numel() * self.values.element_size() + scales


def alignment(sync_dtype: str) -> int:
    """Values per indivisible unit of the payload: a chunk boundary must fall on a multiple of it."""
    return INT8_BLOCK if sync_dtype == "int8" else 1


def encode(x: torch.Tensor, sync_dtype: str) -> Encoded:
    """``x`` (flat fp32, a length that is a multiple of `alignment`) in the wire dtype."""
    if sync_dtype == "float32":
        return Encoded(x.float())
    if sync_dtype == "bfloat16":
        return Encoded(x.to(torch.bfloat16))
    blocks = x.float().view(-1, INT8_BLOCK)
    scales = blocks.abs().amax(dim=1) / _INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    values = torch.round(blocks / safe[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return Encoded(values.view(-1), scales)


def decode(payload: Encoded) -> torch.Tensor:
    """The fp32 values a payload stands for (every rank decoding the same bytes gets the same tensor)."""
    if payload.scales is None:
        return payload.values.float()
    blocks = payload.values.view(-1, INT8_BLOCK).float() * payload.scales[:, None]
    return blocks.view(-1)
