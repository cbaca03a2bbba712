"""Rotary position embedding (non-interleaved halves, as HF Llama) and the frequency scalings
model families name in their configs: Llama 3, linear, dynamic NTK, YaRN and LongRoPE.

Everything ends in one table, ``cos_sin_cache``: a row per position, so a scaling whose
frequencies depend on the position (dynamic, LongRoPE: one set inside the original context,
another past it) or that scales cos and sin (YaRN's and LongRoPE's attention factor) costs the
kernels nothing. Past the original context a sequence's earlier positions keep the frequencies
they were cached with (a paged cache cannot rotate them again), where transformers recomputes
the whole sequence with the long set; inside it the two agree exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Llama3Scaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A non-Llama-3 scaling as transformers' ``rope_parameters`` name it (``kind``: linear,
    dynamic, yarn, longrope); fields a kind does not use keep their defaults."""

    kind: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # LongRoPE: per-frequency divisors inside and past the original context
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "dynamic", "yarn", "longrope"):
            raise ValueError(f"rope_type {self.kind!r}: one of {', '.join(ROPE_TYPES)}")


Scaling = Llama3Scaling | RopeScaling


def _base_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _yarn_frequencies(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: extrapolate the fast dimensions, interpolate (divide by ``factor``) the slow ones,
    a linear ramp between the dimensions turning ``beta_fast`` and ``beta_slow`` times over the
    original context."""
    def dim_of(rotations: float) -> float:
        return (head_dim * math.log(s.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    base = _base_frequencies(head_dim, theta)
    return base / s.factor * ramp + base * (1 - ramp)


def rope_attention_factor(scaling: Scaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's and LongRoPE's attention factor, else 1."""
    if not isinstance(scaling, RopeScaling) or scaling.kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.kind == "longrope":
        original = scaling.original_max_position_embeddings
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
    return mscale(factor)


def inv_frequencies(head_dim: int, theta: float, scaling: Scaling | None,
                    *, long: bool = False) -> torch.Tensor:
    """The rotation frequencies of the head's dimension pairs, float64. ``long``: the set for
    positions past the original context (dynamic NTK, LongRoPE)."""
    inv_freq = _base_frequencies(head_dim, theta)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, RopeScaling):
        if scaling.kind == "linear":
            return inv_freq / scaling.factor
        if scaling.kind == "yarn":
            return _yarn_frequencies(head_dim, theta, scaling)
        if scaling.kind == "longrope":
            factors = scaling.long_factor if long else scaling.short_factor
            if len(factors) != head_dim // 2:
                raise ValueError(f"longrope factors: {len(factors)}, expected {head_dim // 2}")
            return inv_freq / torch.tensor(factors, dtype=torch.float64)
        return inv_freq  # dynamic: cos_sin_cache rescales past the original context
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: Scaling | None
) -> torch.Tensor:
    """[max_positions, head_dim]: cos of the half-dims then sin of the half-dims, float32."""
    positions = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(positions, inv_frequencies(head_dim, theta, scaling))
    if isinstance(scaling, RopeScaling) and scaling.kind in ("dynamic", "longrope"):
        original = scaling.original_max_position_embeddings
        if max_positions > original:
            if scaling.kind == "dynamic":
                # NTK: the base grown for the longest context the table serves.
                grown = theta * ((scaling.factor * max_positions / original)
                                 - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
                long = _base_frequencies(head_dim, grown)
            else:
                long = inv_frequencies(head_dim, theta, scaling, long=True)
            freqs[original:] = torch.outer(positions[original:], long)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(scaling)
    return table.float()


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by their positions [T]; returns new tensors."""
    half = q.shape[-1] // 2
    cs = cache[positions]  # [T, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
