"""Integer weights for the quantized-checkpoint tests, the tiny float checkpoint they start from
and the edits that break a written one, and each format's dequantization written from the
format's own definition (numpy, field by field), not from our reader: a packing bug in the reader
or the writer cannot cancel out against the same bug here.

The definitions, as AutoGPTQ, AutoAWQ and compressed-tensors 0.20 pack them: a word's field i sits
at bits i*b .. i*b + b - 1 (b bits a value, 32/b values a word).
* GPTQ: qweight [K/p, N], input column k in field k % p of row k // p; qzeros [K/G, N/p] along N,
  v1 storing zero - 1; W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n].
* AWQ GEMM: qweight [K, N/8] and qzeros [K/G, N/8]; field i of word c holds column 8c + ORDER[i].
* compressed-tensors pack-quantized: weight_packed [N, K*b/32] along K, zero points [N*b/32, K/G]
  along N, both storing signed value + 2**(b-1); int-quantized: int8 weight, signed zero points.
* FP8 (float-quantized, quant_method fp8): e4m3fn bytes, sign, 4 exponent bits (bias 7) and 3
  mantissa bits, exponent 0 subnormal (m/8 * 2^-6), S.1111.111 NaN; times ``weight_scale``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from tests.worker.tiny_checkpoints import tiny_hf_model, write_hf_dir
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.models.loaders.quantized.quantized_safetensors import QuantizedSafetensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: field i <- column 8c + AWQ_ORDER[i]


@dataclasses.dataclass
class Tiny:
    hf: LlamaForCausalLM
    dir: Path  # the float checkpoint (config.json, tokenizer)
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def tiny_checkpoint(path: Path) -> Tiny:
    """The tiny untied float model, written to ``path`` with its tokenizer."""
    hf = tiny_hf_model(tied=False)
    write_hf_dir(hf, path)
    return Tiny(hf, path, json.loads((path / "config.json").read_text()), hf.state_dict())


def stored(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def edit_config(path: Path, **changes: Any) -> None:
    """Set ``changes`` in config.json's quantization_config."""
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    t = stored(path)
    change(t)
    save_file(t, path / "model.safetensors")


def refused(path: Path, match: str) -> None:
    """Reading the checkpoint at ``path``, every linear, raises ModelLoadError matching
    ``match``."""
    with pytest.raises(ModelLoadError, match=match):
        reader = QuantizedSafetensors(path)
        for name in reader.quantized:
            reader.quantized_weight(name)


def linear_names(tensors: Mapping[str, torch.Tensor], *, lm_head: bool = False) -> list[str]:
    """The projections' HF weight names (and lm_head's)."""
    return [n for n in tensors if n.endswith("_proj.weight") or (lm_head and n == "lm_head.weight")]


def random_int_weights(tensors: Mapping[str, torch.Tensor], bits: int, group_size: int | None, *,
                       symmetric: bool, act_order: bool = False, lowest_zero: int = 0,
                       lm_head: bool = False, seed: int = 0) -> dict[str, IntWeight]:
    """Random integers over the whole range for every linear of ``tensors``' shapes, positive
    scales, random zeros (symmetric: the midpoint) and, for act-order, one random column order
    per set of inputs (q/k/v share theirs, gate/up theirs), as GPTQ's calibration gives."""
    gen = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    perms: dict[str, torch.Tensor] = {}
    out = {}
    for name in linear_names(tensors, lm_head=lm_head):
        n, k = tensors[name].shape
        g = k if group_size is None else group_size
        q = torch.randint(0, top + 1, (n, k), generator=gen)
        scales = torch.rand(n, k // g, generator=gen) * 0.02 + 0.002
        zeros = (torch.full((n, k // g), 1 << (bits - 1)) if symmetric
                 else torch.randint(lowest_zero, top + 1, (n, k // g), generator=gen))
        perm = None
        if act_order:
            inputs = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            inputs = inputs.replace("up_proj", "gate_proj")
            perm = perms.setdefault(inputs, torch.randperm(k, generator=gen))
        out[name] = IntWeight.from_ints(q, scales, zeros, bits, perm=perm)
    return out


def with_scales_as(weight: IntWeight, dtype: torch.dtype) -> IntWeight:
    """``weight`` with its scales rounded to ``dtype``, as a checkpoint stores them."""
    return dataclasses.replace(weight, scales=weight.scales.to(dtype).float())


def fields(words: torch.Tensor, bits: int) -> np.ndarray:
    """Each int32 word's fields, lowest bits first: shape [..., 32 / bits], unsigned."""
    unsigned = words.numpy().astype(np.int64) & 0xFFFFFFFF
    return (unsigned[..., None] >> np.arange(0, 32, bits)) & ((1 << bits) - 1)


def gptq_dequantize(t: Mapping[str, torch.Tensor], module: str, bits: int,
                    v1: bool = True) -> torch.Tensor:
    rows = fields(t[f"{module}.qweight"], bits)  # [K/p, N, p]
    q = rows.transpose(0, 2, 1).reshape(-1, rows.shape[1])  # [K, N]
    zeros = fields(t[f"{module}.qzeros"], bits)  # [K/G, N/p, p]
    zeros = zeros.reshape(zeros.shape[0], -1) + (1 if v1 else 0)  # [K/G, N]
    scales = t[f"{module}.scales"].float().numpy()
    g = t[f"{module}.g_idx"].numpy()
    return _float32((q - zeros[g]).astype(np.float32) * scales[g]).t()


def awq_dequantize(t: Mapping[str, torch.Tensor], module: str) -> torch.Tensor:
    q = _awq_columns(t[f"{module}.qweight"])  # [K, N]
    zeros = _awq_columns(t[f"{module}.qzeros"])  # [K/G, N]
    scales = t[f"{module}.scales"].float().numpy()
    g = np.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
    return _float32((q - zeros[g]).astype(np.float32) * scales[g]).t()


def compressed_tensors_dequantize(t: Mapping[str, torch.Tensor], module: str, bits: int,
                                  symmetric: bool) -> torch.Tensor:
    """pack-quantized (``weight_packed``) or int-quantized (int8 ``weight``)."""
    offset = 1 << (bits - 1)
    scales = np.atleast_2d(t[f"{module}.weight_scale"].float().numpy())  # [N or 1, K/G]
    if f"{module}.weight_packed" in t:
        n, k = t[f"{module}.weight_shape"].tolist()
        q = fields(t[f"{module}.weight_packed"], bits).reshape(n, -1)[:, :k] - offset
    else:
        q = t[f"{module}.weight"].numpy().astype(np.int64)
        n, k = q.shape
    zp: np.ndarray | int = 0
    if not symmetric:
        stored = t[f"{module}.weight_zero_point"]
        if stored.dtype == torch.int32 and stored.shape[0] != n:  # packed along N
            words = fields(stored, bits)  # [N/p, K/G, p]
            zp = words.transpose(0, 2, 1).reshape(-1, stored.shape[1])[:n] - offset
        else:
            zp = stored.numpy().astype(np.int64)
    groups = scales.shape[1]
    scales = np.broadcast_to(scales, (n, groups))
    zp = np.broadcast_to(np.atleast_2d(zp), (n, groups))
    g = (t[f"{module}.weight_g_idx"].numpy() if f"{module}.weight_g_idx" in t
         else np.arange(k) // (k // groups))
    return _float32((q - zp[:, g]).astype(np.float32) * scales[:, g])


def fp8_dequantize(t: Mapping[str, torch.Tensor], module: str) -> torch.Tensor:
    """``weight`` e4m3fn bytes decoded bit by bit, times ``weight_scale`` (per tensor or row),
    multiplied in float32 as the format's readers do."""
    b = t[f"{module}.weight"].view(torch.uint8).numpy().astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    magnitude = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    values = np.where(b & 0x80, -magnitude, magnitude)
    values[(b & 0x7F) == 0x7F] = np.nan
    scale = t[f"{module}.weight_scale"].float().numpy().reshape(-1, 1)  # [N or 1, 1]
    return _float32(values.astype(np.float32) * scale)


def _awq_columns(words: torch.Tensor) -> np.ndarray:
    f = fields(words, 4)  # [R, N/8, 8]
    columns = np.empty_like(f)
    columns[:, :, list(AWQ_ORDER)] = f  # column 8c + ORDER[i] <- field i
    return columns.reshape(f.shape[0], -1)


def _float32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def load_exact_model(spec: str, **kwargs: object) -> LoadedModel:
    """``load_model`` on the CPU's float-activation path, for the tests that compare a
    checkpoint's model with its dequantized reference exactly (the 8-bit path has its own)."""
    return load_model(spec, cpu_activations="float", **kwargs)  # type: ignore[arg-type]
