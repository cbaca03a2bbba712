"""compressed-tensors checkpoints (llm-compressor), as version 0.20 writes them:
``CompressedTensorsFormat`` matches each linear to its ``config_groups`` scheme and reads the
``pack-quantized`` or ``int-quantized`` / ``naive-quantized`` tensors into an ``IntWeight``, and
FP8 ``float-quantized`` ones into an ``Fp8Weight`` (``float_format``)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.loaders.quantized.checkpoint_tensors import (
    FLOATS,
    INTS,
    CheckpointTensors,
    act_order,
    check_divides,
    unpack_words,
)
from tidegate.worker.models.loaders.quantized.float_format import fp8_scheme, read_fp8


class CompressedTensorsFormat:
    """compressed-tensors (llm-compressor), as version 0.20 writes it. Each ``config_groups``
    scheme names its ``targets`` (``Linear``, a module name, or ``re:`` a regex), ``ignore`` takes
    modules back out. Values are signed, q - 2**(bits-1) (unsigned here: add it back). Formats:

    * ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 [N, K*bits/32], packed along K
      (field i of a word at bits i*bits, unsigned); ``weight_scale`` [N, K/G] (channel: [N, 1]);
      ``weight_shape`` [2]; asymmetric: ``weight_zero_point`` int32 [N*bits/32, K/G], the unsigned
      zeros packed the same way but along N (older files: signed int8 [N, K/G]); optional
      ``weight_g_idx`` [K] (act-order, as GPTQ's g_idx);
    * ``int-quantized`` / ``naive-quantized`` (W8A8 INT8): ``weight`` int8 [N, K], signed, with
      ``weight_scale`` [N, 1] (or [N, K/G], or [1]) and an optional signed ``weight_zero_point``.
      Activation quantization is not applied: the weights are served with float activations.
    * ``float-quantized`` (FP8, FP8_DYNAMIC; weight-only FP8 is ``naive-quantized``): ``weight``
      float8_e4m3fn [N, K] with ``weight_scale`` per tensor or channel (``float_format``).
    """

    name = "compressed-tensors"
    owned = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
             "weight_g_idx", "input_scale", "input_zero_point")
    markers = (".weight_packed", ".weight_scale")
    FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        self.where = where
        self._refuse_extras(config)
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ModelLoadError(f"{where}: compressed-tensors quantization_config has no "
                                 "config_groups")
        self.schemes = [self._scheme(name, body, config.get("format"))
                        for name, body in groups.items()]
        self.ignore = tuple(config.get("ignore") or ())

    def scheme(self, module: str) -> dict[str, Any] | None:
        """The weight scheme (format, type, bits, strategy, group_size, symmetric, act_order) that
        quantizes ``module``, or None where it stays float."""
        if any(_targets(module, t) for t in self.ignore):
            return None
        return next((s for s in self.schemes if any(_targets(module, t) for t in s["targets"])),
                    None)

    def quantized(self, module: str, tensors: CheckpointTensors) -> bool:
        scheme = self.scheme(module)
        if scheme is None:
            return False
        stored = "weight_packed" if scheme["format"] == "pack-quantized" else "weight_scale"
        if not tensors.has(f"{module}.{stored}"):
            raise ModelLoadError(f"{tensors.raw.path}: tensor {module}.{stored} "
                                 f"({scheme['format']}) is missing: the config quantizes "
                                 f"{module} and does not ignore it")
        return True

    def read(self, module: str, shape: tuple[int, int], tensors: CheckpointTensors
             ) -> IntWeight | Fp8Weight:
        scheme = self.scheme(module)
        assert scheme is not None
        if scheme["type"] == "float":
            return read_fp8(module, shape, tensors, scheme["strategy"], self.name)
        n, k = shape
        bits, fmt = scheme["bits"], scheme["format"]
        g = scheme["group_size"] if scheme["strategy"] == "group" else k
        where = f"{tensors.raw.path}: {module} ({fmt})"
        check_divides(where, shape, g, 1)
        if fmt == "pack-quantized":
            packed = tensors.get(f"{module}.weight_packed", (torch.int32,),
                                 (n, math.ceil(k * bits / 32)))
            q = unpack_words(packed, bits, dim=1)[:, :k]
            if tensors.has(f"{module}.weight_shape"):
                stored = tensors.get(f"{module}.weight_shape", INTS, (2,))
                if stored.tolist() != [n, k]:
                    raise ModelLoadError(f"{where}: weight_shape {stored.tolist()}, expected "
                                         f"{[n, k]}")
        else:
            q = tensors.get(f"{module}.weight", (torch.int8,), (n, k)).to(torch.int32)
            q = q + (1 << (bits - 1))
        scales = tensors.get(f"{module}.weight_scale", FLOATS, (n, k // g), *_whole(k // g))
        zeros = self._zeros(module, shape, k // g, scheme, tensors)
        perm = None
        if tensors.has(f"{module}.weight_g_idx"):
            g_idx = tensors.get(f"{module}.weight_g_idx", (torch.int32, torch.int64), (k,))
            perm = act_order(g_idx, g, f"{tensors.raw.path}: tensor {module}.weight_g_idx")
        elif scheme["act_order"] and k // g > 1:
            raise ModelLoadError(f"{where}: tensor {module}.weight_g_idx is missing and "
                                 "actorder is 'group'")
        if perm is not None:
            q = q[:, perm]
        return IntWeight.from_ints(q.contiguous(), scales.float().expand(n, k // g), zeros,
                                   bits, perm=perm, format="compressed-tensors")

    def _zeros(self, module: str, shape: tuple[int, int], groups: int, scheme: dict[str, Any],
               tensors: CheckpointTensors) -> torch.Tensor:
        """Unsigned zero points [N, K/G]: the midpoint when symmetric."""
        n, _ = shape
        bits, mid = scheme["bits"], 1 << (scheme["bits"] - 1)
        name = f"{module}.weight_zero_point"
        if scheme["symmetric"]:
            return torch.full((n, groups), mid, dtype=torch.int32)
        packed_shape = (math.ceil(n * bits / 32), groups)
        zp = tensors.get(name, INTS, packed_shape, (n, groups), *_whole(groups))
        if zp.dtype == torch.int32 and tuple(zp.shape) == packed_shape:
            return unpack_words(zp.t(), bits, dim=1)[:, :n].t().contiguous()
        return (zp.to(torch.int32) + mid).expand(n, groups).contiguous()

    def _scheme(self, name: str, body: Any, default_format: Any) -> dict[str, Any]:
        where = f"{self.where}: compressed-tensors config_groups.{name}"
        if not isinstance(body, dict):
            raise ModelLoadError(f"{where} is not an object")
        fmt = body.get("format") or default_format
        if fmt not in self.FORMATS:
            raise ModelLoadError(f"{where}: format {fmt!r} is not supported "
                                 f"({', '.join(self.FORMATS)})")
        weights = body.get("weights")
        if not isinstance(weights, dict):
            raise ModelLoadError(f"{where} ({fmt}) quantizes no weights")
        if body.get("output_activations"):
            raise ModelLoadError(f"{where} ({fmt}): output_activations are not supported")
        inputs = body.get("input_activations")
        if str(weights.get("type", "int")) == "float":
            args = fp8_scheme(weights, inputs, f"{where}.weights ({fmt})", fmt)
        elif inputs and str(inputs.get("type", "int")) != "int":
            raise ModelLoadError(f"{where} ({fmt}): float input_activations with int weights "
                                 "(W4AFP8) are not supported")
        else:
            args = self._weight_args(weights, f"{where}.weights ({fmt})", fmt)
        return {"format": fmt, "targets": tuple(body.get("targets") or ()), **args}

    def _weight_args(self, w: dict[str, Any], where: str, fmt: str) -> dict[str, Any]:
        if str(w.get("type", "int")) != "int":
            raise ModelLoadError(f"{where}: type {w.get('type')!r} is not supported (int, "
                                 "float)")
        if fmt == "float-quantized":
            raise ModelLoadError(f"{where}: int weights in format 'float-quantized' are not "
                                 "supported (float)")
        bits = int(w.get("num_bits", 8))
        allowed = (8,) if fmt == "int-quantized" else (4, 8)
        if bits not in allowed:
            raise ModelLoadError(f"{where}: num_bits {bits} is not supported "
                                 f"({', '.join(map(str, allowed))})")
        if w.get("dynamic") not in (False, None):
            raise ModelLoadError(f"{where}: dynamic weight quantization is not supported")
        group_size = w.get("group_size")
        strategy = w.get("strategy") or ("tensor" if group_size is None else
                                         "channel" if group_size == -1 else "group")
        if strategy not in ("group", "channel", "tensor"):
            raise ModelLoadError(f"{where}: strategy {strategy!r} is not supported "
                                 "(group, channel, tensor)")
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise ModelLoadError(f"{where}: strategy 'group' needs a positive group_size")
        actorder = w.get("actorder")
        if actorder not in (None, False, "weight", "static", "group", "dynamic"):
            raise ModelLoadError(f"{where}: actorder {actorder!r} is not supported")
        return {"type": "int", "bits": bits, "strategy": strategy, "group_size": group_size,
                "symmetric": bool(w.get("symmetric", True)),
                "act_order": actorder in ("group", "dynamic")}

    def _refuse_extras(self, config: Mapping[str, Any]) -> None:
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ModelLoadError(f"{self.where}: compressed-tensors quantization_status "
                                 f"{status!r} is not supported (compressed)")
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise ModelLoadError(f"{self.where}: compressed-tensors sparsity format "
                                 f"{sparsity['format']!r} is not supported")
        if config.get("transform_config"):
            raise ModelLoadError(f"{self.where}: compressed-tensors transform_config (rotated "
                                 "weights) is not supported")
        if config.get("kv_cache_scheme"):
            raise ModelLoadError(f"{self.where}: compressed-tensors kv_cache_scheme is not "
                                 "supported")


def _targets(module: str, target: str) -> bool:
    """Whether a compressed-tensors target or ignore entry names linear ``module``."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target in (module, "Linear")


def _whole(groups: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of one value for a whole tensor (strategy 'tensor'), when there is one group."""
    return ((1,), (1, 1)) if groups == 1 else ()
