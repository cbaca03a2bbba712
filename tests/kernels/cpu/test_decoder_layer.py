"""The one-call decoder layer and layer stack (``tidegate.kernels.cpu.decoder_layer``, ``csrc/decoder_layer_cpu.c``) against the
op-by-op path it replaces: the engine's hidden states bit for bit, over prompt chunks and decode
steps of several sequences (prompts of different lengths, chunked), for GGUF blocks and for
integer weights, with a float32 and an int8 KV cache, with GGUF blocks in the rows layout and
repacked to lanes8; and it steps aside where it does not serve."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.worker.tiny_checkpoints import tiny_hf_model, write_gguf
from tidegate.kernels import ops
from tidegate.kernels.cpu.native_cpu import native_kernels
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import LANES8, ROWS, PackedWeight
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.models.packed_modules import PackedEmbedding, PackedLinear

T = GGMLQuantizationType
PROMPTS = [[5, 9, 13], list(range(20, 47)), [7] * 12]


@pytest.fixture
def gguf_path(tmp_path: Path) -> Path:
    return write_gguf(tiny_hf_model(tied=True), tmp_path / "q.gguf", qtype=T.Q4_1,
                      qtypes={"token_embd": T.Q8_0})


def hidden_states(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, *, path: str,
                  kv: str = "auto") -> tuple[list[torch.Tensor], int]:
    """Every step's final hidden states of a greedy run of PROMPTS (16 tokens a step: prompts in
    chunks beside decodes), and how many steps with prompt chunks ``path`` ran in one call:
    "stack" (every layer in one call), "layer" (a call per layer) or "ops" (op by op)."""
    calls = 0
    real_stack, real_layer = ops.decoder_layers, ops.decoder_layer

    def counted(real: Callable[..., object], on: bool) -> Callable[..., object]:
        def call(*args: object) -> object:
            nonlocal calls
            done = real(*args) if on else None
            hidden = args[0]
            calls += done is not None and hidden.shape[0] > len(PROMPTS)  # type: ignore[attr-defined]
            return done
        return call

    seen: list[torch.Tensor] = []
    logits = loaded.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.clone())
        return logits(hidden)

    with monkeypatch.context() as patch:
        patch.setattr(ops, "decoder_layers", counted(real_stack, path == "stack"))
        patch.setattr(ops, "decoder_layer", counted(real_layer, path == "layer"))
        patch.setattr(loaded.model, "compute_logits", capture)
        engine = Engine(loaded.model, loaded.tokenizer,
                        EngineConfig(max_model_len=256, num_blocks=64, block_size=4,
                                     max_num_seqs=4, max_num_batched_tokens=16,
                                     kv_cache_dtype=kv))
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(EngineRequest(str(i), prompt, SamplingParams(
                max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
    return seen, calls


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_gguf_layers_in_one_call_give_the_op_by_op_bits(
        gguf_path: Path, monkeypatch: pytest.MonkeyPatch, kv: str) -> None:
    loaded = load_model(str(gguf_path), cpu_activations="int8")
    stack, stacked = hidden_states(loaded, monkeypatch, path="stack", kv=kv)
    one, calls = hidden_states(loaded, monkeypatch, path="layer", kv=kv)
    by_op, none = hidden_states(loaded, monkeypatch, path="ops", kv=kv)
    # A step with prompt chunks is one call for the stack, one per layer layer by layer.
    assert stacked > 0 and calls == stacked * len(loaded.model.layers) and none == 0
    assert all(torch.equal(a, b) for a, b in zip(one, by_op, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(stack, by_op, strict=True))


def test_integer_layers_in_one_call_give_the_op_by_op_bits(
        gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(gguf_path), cpu_activations="int8")
    for group, layer in zip((32, 16), loaded.model.layers, strict=False):
        for module in layer.modules():
            if isinstance(module, PackedLinear):
                module.weight = IntWeight.quantize(module.weight.dequantize(), 4, group,
                                                   symmetric=False).with_activations("int8")
    stack, stacked = hidden_states(loaded, monkeypatch, path="stack")
    one, calls = hidden_states(loaded, monkeypatch, path="layer")
    by_op, _ = hidden_states(loaded, monkeypatch, path="ops")
    assert stacked > 0 and calls > 0
    assert all(torch.equal(a, b) for a, b in zip(one, by_op, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(stack, by_op, strict=True))


def test_float_activations_and_the_reference_mode_go_op_by_op(
        gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    floats = load_model(str(gguf_path), cpu_activations="float")
    for path in ("stack", "layer"):
        assert hidden_states(floats, monkeypatch, path=path)[1] == 0
    loaded = load_model(str(gguf_path), cpu_activations="int8")
    monkeypatch.setenv("TIDEGATE_KERNELS", "reference")
    for path in ("stack", "layer"):
        assert hidden_states(loaded, monkeypatch, path=path)[1] == 0


def _layouts(loaded: LoadedModel) -> dict[str, tuple[str, bool]]:
    """Each packed matrix's (layout, whether it can be repacked: rows in whole groups of 8 and
    a type this CPU's kernels prefer lanes8 for)."""
    native = native_kernels()
    assert native is not None
    return {name: (m.weight.parts[0].layout, m.weight.shape[0] % 8 == 0
                   and native.lanes8_preferred(m.weight.parts[0].qtype))
            for name, m in loaded.model.named_modules()
            if isinstance(m, PackedLinear | PackedEmbedding) and isinstance(m.weight, PackedWeight)}


def test_repacked_blocks_give_the_rows_layouts_bits(
        gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader repacks Q4_1 and Q8_0 matrices to lanes8 where this CPU's kernels prefer it
    (not the tied embedding here: 260 rows are not whole groups of 8); forced into either
    layout, a model's every step is the same."""
    native = native_kernels()
    assert native is not None
    loaded = load_model(str(gguf_path), cpu_activations="int8")
    assert all(layout == (LANES8 if preferred else ROWS)
               for layout, preferred in _layouts(loaded).values())
    with monkeypatch.context() as patch:
        patch.setattr(ops, "cpu_layout", lambda w: native.repack_lanes8(w, force=True))
        lanes = load_model(str(gguf_path), cpu_activations="int8")
        patch.setattr(ops, "cpu_layout", lambda w: w)
        rows = load_model(str(gguf_path), cpu_activations="int8")
    assert all(layout == LANES8 for name, (layout, _) in _layouts(lanes).items()
               if name != "embed_tokens")
    assert {layout for layout, _ in _layouts(rows).values()} == {ROWS}
    by_rows, _ = hidden_states(rows, monkeypatch, path="stack")
    for path in ("stack", "ops"):
        by_lanes, _ = hidden_states(lanes, monkeypatch, path=path)
        assert all(torch.equal(a, b) for a, b in zip(by_lanes, by_rows, strict=True)), path
