"""Rotary position embeddings of a ModelConfig: inverse frequencies with linear, llama3 or YaRN scaling,
YaRN's attention factor, and the cos/sin cache the attention kernels read. Pure functions of the config.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from worker.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] (float64), with linear, llama3 or YaRN scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(inv_freq, factor, scaling, config)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])  # tokens
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    blended = torch.where(wavelen > old_context / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_context / high, inv_freq, blended)


def _yarn_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: dict, config: ModelConfig) -> torch.Tensor:
    """YaRN (arXiv:2309.00071): a frequency that turns fewer than ``beta_slow`` times over the
    pretraining context is divided by ``factor`` (interpolated), one that turns more than
    ``beta_fast`` times is kept (extrapolated), and between them the two blend linearly in the
    dimension index, the bounds rounded outwards unless ``truncate`` is false (as transformers does)."""
    d, base = config.head_dim, config.rope_theta
    old_context = float(scaling["original_max_position_embeddings"])  # tokens

    def dim_of(turns: float) -> float:  # the dimension index whose frequency turns ``turns`` times
        return d * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(float(scaling.get("beta_fast") or 32)), dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    span = high - low if high != low else 1e-3  # NOTE: as transformers guards it
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / span).clamp(0.0, 1.0)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(config: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (so every attention score by its square): its
    ``attention_factor``, else 0.1 ln(factor) + 1, or that with DeepSeek's ``mscale`` /
    ``mscale_all_dim`` weights (a ratio); 1 for the other RoPE types."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def rope_cos_sin_cache(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """[max_context, D] float32: cos in [:, :D/2], sin in [:, D/2:] (kernels.reference layout), both
    times rope_attention_factor. A config with ``local_rope_theta`` set to a base gives its sliding
    layers' cache: default RoPE of that base (see local_rope_config)."""
    positions = torch.arange(config.max_context, dtype=torch.float64)
    freqs = torch.outer(positions, rope_inv_freq(config))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(config)
    return cos_sin.float().to(device)


def local_rope_config(config: ModelConfig) -> ModelConfig:
    """The config whose RoPE is that of the sliding layers (Gemma 3: default RoPE of local_rope_theta)."""
    return dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
