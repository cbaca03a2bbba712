"""A step's decoder layers in one native call on the CPU (``csrc/decoder_layer_cpu.c``): the
whole stack at once (``LayerCall.stack``) where every layer would be one call, else a call per
layer.

At one row per sequence a layer's kernels take less time than the Python around them (dispatch,
ctypes, allocation: about a third of a 20 ms step of the default model over ~10 calls per
layer). When every projection of a layer multiplies 8-bit activations (``tidegate.kernels.reference.q8_activations``)
the whole layer is one call into C, which runs the same kernels in the same order as the
op-by-op path: a row gets the same bits either way. Prompt chunks go the same way, each token a
query row of the attention kernel with its sequence's block table and its own context length.
Anything else (GPU, float activations, act-order or multi-part matrices) goes op by op.

The C side reads two structs: the layer's (shapes, norms, the four projections' bytes), built
once per set of weights and kept, and the step's rows (positions, slots, each row's block table
and context length), built once per step and shared by its layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tidegate.kernels.cpu.native_cpu import NativeCpuKernels
from tidegate.kernels.cpu.paged_attention import PagedLayer, PagedStack, kv_int8
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import LANES8, PackedWeight

# Layer structs kept (each holds its weights alive): a few models' worth.
MAX_LAYERS = 1024


@dataclass(frozen=True, slots=True, eq=False)
class DecoderWeights:
    """A Llama decoder layer's parameters, as a whole-layer kernel reads them."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: torch.Tensor | PackedWeight | IntWeight  # [(Hq + 2 Hk) D, H]
    o: torch.Tensor | PackedWeight | IntWeight  # [H, Hq D]
    gate_up: torch.Tensor | PackedWeight | IntWeight  # [2 I, H]
    down: torch.Tensor | PackedWeight | IntWeight  # [H, I]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    def projections(self) -> tuple[torch.Tensor | PackedWeight | IntWeight, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


class _Projection(ctypes.Structure):
    _fields_ = [("ggml_type", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("group", ctypes.c_int64), ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("rows", ctypes.c_int64), ("lanes8", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("eps", ctypes.c_double),
                ("scale", ctypes.c_double), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection)]


class _Rows(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("table_width", ctypes.c_int64), ("kv_int8", ctypes.c_int64),
                ("positions", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
                ("seq_lens", ctypes.c_void_p), ("rope", ctypes.c_void_p)]


def takes_int8(weight: torch.Tensor | PackedWeight | IntWeight) -> bool:
    """Whether the layer kernel computes ``weight``: one packed part, or integers in their
    input order, multiplied with 8-bit activations."""
    if isinstance(weight, PackedWeight):
        return len(weight.parts) == 1 and weight.takes_int8(weight.parts[0])
    return isinstance(weight, IntWeight) and weight.takes_int8 and weight.perm is None


def _projection(weight: PackedWeight | IntWeight) -> _Projection:
    if isinstance(weight, PackedWeight):
        part = weight.parts[0]
        return _Projection(part.qtype, 0, 0, part.data.data_ptr(), None, None, part.rows,
                           part.layout == LANES8)
    return _Projection(-1, weight.bits, weight.group_size, weight.qweight.data_ptr(),
                       weight.scales.data_ptr(), weight.zeros.data_ptr(), weight.shape[0], 0)


def _check(rc: int) -> None:
    """The layer kernels' return code: 0, or -1 (a format refused) / -2 (no scratch memory)."""
    if rc == -2:
        raise MemoryError("decoder layer kernel could not allocate its scratch memory")
    if rc != 0:
        raise ValueError("decoder layer kernel: a projection's format is not one it computes")


class LayerCall:
    """The whole-layer call with its structs: one per process (``tidegate.kernels.ops`` holds it)."""

    def __init__(self, native: NativeCpuKernels) -> None:
        self.native = native
        # Layer structs by the identity of the weights they point into (kept alive here, so an
        # id is never reused while its entry stands).
        self._layers: dict[tuple[int, ...], tuple[_Layer, DecoderWeights]] = {}
        # The step's rows struct: (meta, positions, rope, struct, the tensors it points into).
        self._step: tuple[object, ...] | None = None
        # Layer stacks: the array of their structs' addresses, by the identity of the weights.
        self._stacks: dict[tuple[int, ...], tuple[ctypes.Array, list[DecoderWeights]]] = {}
        # The KV cache's per-layer addresses: (key, key pointers, value pointers, the cache).
        self._pointers: tuple[tuple[int, ...], ctypes.Array, ctypes.Array, torch.Tensor] | None = None

    def applies(self, hidden: torch.Tensor, weights: DecoderWeights, paged: PagedLayer) -> bool:
        return (hidden.device.type == "cpu" and hidden.dtype == torch.float32
                and hidden.dim() == 2 and hidden.is_contiguous()
                and all(takes_int8(w) for w in weights.projections())
                and paged.key_cache.dtype in (torch.float32, torch.int8)
                and paged.key_cache.is_contiguous() and paged.value_cache.is_contiguous())

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 weights: DecoderWeights, positions: torch.Tensor, rope_cache: torch.Tensor,
                 paged: PagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the layer, as ``DecoderLayer.forward`` returns them."""
        m, h = hidden.shape
        layer = self._layer(weights, h, paged.scale)
        step = self._rows(paged, positions, rope_cache, m)
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        out, out_residual = torch.empty(m, h), torch.empty(m, h)
        rc = self.native.decoder_layer(
            ctypes.byref(layer), ctypes.byref(step), paged.key_cache.data_ptr(),
            paged.value_cache.data_ptr(), hidden.data_ptr(),
            None if residual is None else residual.data_ptr(), out.data_ptr(),
            out_residual.data_ptr(), torch.get_num_threads())
        _check(rc)
        return out, out_residual

    def stack(self, hidden: torch.Tensor, weights: list[DecoderWeights], positions: torch.Tensor,
              rope_cache: torch.Tensor, paged: PagedStack
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer of a step in one call (``tidegate_decoder_layers_q8``): (hidden,
        residual) after the last, as ``__call__`` layer by layer gives them; None where a
        layer's call would not serve."""
        kv = paged.kv_cache
        if not weights or not (
                hidden.device.type == "cpu" and hidden.dtype == torch.float32
                and hidden.dim() == 2 and hidden.is_contiguous()
                and kv.dtype in (torch.float32, torch.int8) and kv.is_contiguous()
                and kv.shape[0] >= len(weights)):
            return None
        m, h = hidden.shape
        layers = self._stack_of(weights, h, paged.scale)
        if layers is None:
            return None
        step = self._rows(paged.layer(0), positions, rope_cache, m)
        keys, values = self._cache_pointers(kv, len(weights))
        out, out_residual = torch.empty(m, h), torch.empty(m, h)
        rc = self.native.decoder_layers(
            layers, len(weights), ctypes.byref(step), keys, values, hidden.data_ptr(), None,
            out.data_ptr(), out_residual.data_ptr(), torch.get_num_threads())
        _check(rc)
        return out, out_residual

    def _stack_of(self, weights: list[DecoderWeights], hidden: int, scale: float
                  ) -> ctypes.Array | None:
        """The layers' structs as the array of pointers the C side walks (kept per set of
        weights); None if a layer's weights are not ones the layer kernel computes."""
        key = tuple(id(t) for w in weights for t in (w.input_norm, w.post_norm,
                                                     *w.projections()))
        entry = self._stacks.get(key)
        if entry is None:
            if not all(takes_int8(p) for w in weights for p in w.projections()) or any(
                    n.dtype != torch.float32 or not n.is_contiguous()
                    for w in weights for n in (w.input_norm, w.post_norm)):
                return None
            if len(self._stacks) >= MAX_LAYERS:
                self._stacks.clear()
            structs = [self._layer(w, hidden, scale) for w in weights]
            array = (ctypes.POINTER(_Layer) * len(structs))(
                *(ctypes.pointer(struct) for struct in structs))
            entry = self._stacks[key] = (array, weights)  # the weights kept alive with it
        return entry[0]

    def _cache_pointers(self, kv: torch.Tensor, n: int) -> tuple[ctypes.Array, ctypes.Array]:
        """Each layer's key and value cache addresses in ``kv`` [L, 2, ...] (kept per cache)."""
        key = (kv.data_ptr(), n, kv.stride(0), kv.stride(1), kv.element_size())
        if self._pointers is None or self._pointers[0] != key:
            base, layer, half = kv.data_ptr(), kv.stride(0) * kv.element_size(), (
                kv.stride(1) * kv.element_size())
            keys = (ctypes.c_void_p * n)(*(base + i * layer for i in range(n)))
            values = (ctypes.c_void_p * n)(*(base + i * layer + half for i in range(n)))
            self._pointers = (key, keys, values, kv)  # the cache kept alive with its addresses
        return self._pointers[1], self._pointers[2]

    def _layer(self, weights: DecoderWeights, hidden: int, scale: float) -> _Layer:
        key = (id(weights.input_norm), id(weights.post_norm),
               *(id(w) for w in weights.projections()))
        entry = self._layers.get(key)
        if entry is None:
            if len(self._layers) >= MAX_LAYERS:  # models come and go (tests, reloads)
                self._layers.clear()
            norms = (weights.input_norm, weights.post_norm)
            if any(n.dtype != torch.float32 or not n.is_contiguous() for n in norms):
                raise ValueError("the layer kernel reads float32 contiguous norm weights")
            struct = _Layer(hidden, weights.down.shape[1], weights.heads, weights.kv_heads,
                            weights.head_dim, weights.eps, scale, norms[0].data_ptr(),
                            norms[1].data_ptr(),
                            *(_projection(w) for w in weights.projections()))  # type: ignore[arg-type]
            entry = self._layers[key] = (struct, weights)
        return entry[0]

    def _rows(self, paged: PagedLayer, positions: torch.Tensor, rope_cache: torch.Tensor,
              rows: int) -> _Rows:
        step = self._step
        if step is not None and step[0] is paged.meta and step[1] is positions and (
                step[2] is rope_cache):
            return step[3]  # type: ignore[return-value]
        meta, given = paged.meta, positions
        positions = positions.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32)
        if meta.num_decodes != len(meta.seq_lens_host):  # prompt chunks: a table per token
            tables = tables.index_select(0, torch.repeat_interleave(
                torch.arange(len(meta.seq_lens_host)), torch.tensor(meta.query_lens_host)))
        held = (positions, meta.slot_mapping.contiguous(), tables.contiguous(),
                (positions + 1).to(torch.int32), rope_cache.float().contiguous())
        if held[0].shape != (rows,) or held[2].shape[0] != rows:
            raise ValueError(f"a step of {rows} rows needs one position and one block table "
                             "row per row")
        struct = _Rows(rows, paged.key_cache.shape[1], held[2].shape[1],
                       int(kv_int8(paged.key_cache)), *(t.data_ptr() for t in held))
        self._step = (meta, given, rope_cache, struct, held)
        return struct
