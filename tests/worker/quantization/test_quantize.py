"""``tidegate quantize`` as a user runs it: a tiny HF directory or GGUF in, a compressed-tensors
(or GPTQ) directory out, which tidegate then loads with its integers (or FP8 values) kept
packed. Round to nearest must give exactly ``IntWeight.quantize`` (``Fp8Weight.quantize``) of the
source weights; GPTQ must beat it on its own calibration text; bad arguments exit 2 with a
message. The default model quantized serves the tokens of its own dequantized weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.worker.quantized_checkpoints import load_exact_model as load_model
from tests.worker.tiny_checkpoints import tiny_hf_model, write_gguf, write_hf_dir
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.decoder import CausalAttention
from tidegate.worker.models.loaders.loader import LoadedModel
from tidegate.worker.models.online_quantization import quantize_loaded
from tidegate.worker.models.packed_modules import PackedLinear

TEXT = ("The tide came in over the flats, slowly at first and then all at once; the gate "
        "keeper counted the waves and wrote each one down. ") * 8


def quantize(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidegate", "quantize", *args],
                          capture_output=True, text=True, timeout=240)


def logits(loaded: LoadedModel, text: str = TEXT) -> torch.Tensor:
    ids = torch.tensor(loaded.tokenizer.encode(text)[:96])
    hidden = loaded.model(ids, torch.arange(ids.numel()), CausalAttention())
    return loaded.model.compute_logits(hidden)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_dir(tiny_hf_model(tied=False), tmp_path_factory.mktemp("hf") / "m")


@pytest.mark.parametrize(("method", "bits", "group", "kind"), [
    ("rtn-int4", 4, 32, "int4-g32"), ("rtn-int8", 8, None, "int8-channel")])
def test_round_to_nearest_writes_what_int_weight_quantize_gives(
        hf_dir: Path, tmp_path: Path, method: str, bits: int, group: int | None,
        kind: str) -> None:
    out = tmp_path / "q"
    done = quantize(str(hf_dir), str(out), "--method", method, "--group-size", "32"
                    if group else "-1", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["bits"], report["format"], report["linears"]) == (bits, "compressed-tensors",
                                                                      14)
    loaded = load_model(str(out))
    assert loaded.packed_types() == [kind]
    source = load_model(str(hf_dir))
    layer = loaded.model.layers[1]
    for attr in ("qkv_proj", "gate_up_proj", "down_proj"):
        want = IntWeight.quantize(getattr(source.model.layers[1], attr).weight.data, bits, group)
        assert torch.equal(getattr(layer, attr).weight.dequantize(), want.dequantize())
    # The same model, float: what the integers cost is a small error, not a different model.
    assert rel(logits(loaded), logits(source)) < (0.4 if bits == 4 else 0.03)


def test_fp8_writes_what_fp8_weight_quantize_gives(hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    done = quantize(str(hf_dir), str(out), "--method", "fp8", "--json", "--progress")
    assert done.returncode == 0, done.stderr
    assert done.stderr.endswith("quantize [" + "#" * 30 + "] 14/14\n")
    report = json.loads(done.stdout)
    assert (report["method"], report["format"], report["linears"]) == ("fp8",
                                                                        "compressed-tensors", 14)
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == "float-quantized"
    loaded = load_model(str(out))
    assert loaded.packed_types() == ["fp8-e4m3-channel"]
    source = load_model(str(hf_dir))
    for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        got = getattr(loaded.model.layers[1], attr).weight
        want = Fp8Weight.quantize(getattr(source.model.layers[1], attr).weight.data)
        assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))
        assert torch.equal(got.scales, want.scales)
    # e4m3 keeps 3 mantissa bits: each weight within 1/16 of itself (int8 per channel is finer
    # on Gaussian weights); on this random model the logits move ~8%, not a different model.
    assert rel(logits(loaded), logits(source)) < 0.15


def test_quantize_loaded_swaps_every_projection_for_fp8() -> None:
    """The in-memory quantizer of the GPU benchmarks, on a random model where it lies."""
    loaded = load_model("random:tiny")
    attrs = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    floats = [{a: getattr(layer, a).weight.detach().clone() for a in attrs}
              for layer in loaded.model.layers]
    with pytest.raises(ValueError, match="fp8 has one symmetric scale per output channel"):
        quantize_loaded(loaded.model, "fp8", group_size=32)
    assert quantize_loaded(loaded.model, "fp8") == 4 * len(floats)
    assert loaded.packed_types() == ["fp8-e4m3-channel"]
    for layer, before in zip(loaded.model.layers, floats, strict=True):
        for attr in attrs:
            module = getattr(layer, attr)
            assert isinstance(module, PackedLinear) and module.weight.device.type == "cpu"
            assert torch.equal(module.weight.dequantize(),
                               Fp8Weight.quantize(before[attr]).dequantize())
    assert quantize_loaded(loaded.model, "fp8") == 0  # already quantized: left as they are


def test_gptq_beats_round_to_nearest_on_its_calibration_text(hf_dir: Path,
                                                            tmp_path: Path) -> None:
    calibration = tmp_path / "calib.txt"
    calibration.write_text(TEXT)
    rtn_dir, gptq_dir, act_dir = tmp_path / "rtn", tmp_path / "gptq", tmp_path / "act"
    assert quantize(str(hf_dir), str(rtn_dir), "--method", "rtn-int4", "--group-size",
                    "32").returncode == 0
    done = quantize(str(hf_dir), str(gptq_dir), "--method", "gptq-int4", "--group-size", "32",
                    "--calibration", str(calibration), "--context", "64", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["calibration_tokens"] >= 64
    done = quantize(str(hf_dir), str(act_dir), "--method", "gptq-int4", "--group-size", "32",
                    "--calibration", str(calibration), "--context", "64", "--act-order",
                    "--format", "gptq")
    assert done.returncode == 0, done.stderr
    source = logits(load_model(str(hf_dir)))
    rtn_err = rel(logits(load_model(str(rtn_dir))), source)
    gptq_err = rel(logits(load_model(str(gptq_dir))), source)
    act = load_model(str(act_dir))
    assert act.packed_types() == ["int4-g32-act"]
    assert gptq_err < rtn_err and rel(logits(act), source) < rtn_err


def test_awq_folds_its_scales_and_writes_autoawq_layout(hf_dir: Path,
                                                             tmp_path: Path) -> None:
    calibration = tmp_path / "calib.txt"
    calibration.write_text(TEXT)
    common = ["--group-size", "32", "--asymmetric"]
    assert quantize(str(hf_dir), str(tmp_path / "rtn"), "--method", "rtn-int4",
                    *common).returncode == 0
    for fmt in ("compressed-tensors", "awq"):
        done = quantize(str(hf_dir), str(tmp_path / fmt), "--method", "awq-int4", *common,
                        "--calibration", str(calibration), "--context", "64", "--format", fmt)
        assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    source = logits(load_model(str(hf_dir)))
    rtn_err = rel(logits(load_model(str(tmp_path / "rtn"))), source)
    awq = load_model(str(tmp_path / "compressed-tensors"))
    # Each projection's output error is smaller than round to nearest's
    # (test_awq_scales_favour_the_loud_channels); end to end on this random model the two are
    # alike (AWQ's gain is on trained models' salient channels: benchmarks/results/
    # quantize_ppl.md). A wrong fold of the scales into the norms would be far off.
    assert rel(logits(awq), source) < 1.5 * rtn_err
    # Both layouts hold the same integers and the same folded norms (AWQ's scales in float16).
    assert rel(logits(load_model(str(tmp_path / "awq"))), logits(awq)) < 2e-3
    assert not torch.equal(awq.model.layers[0].input_norm,
                           load_model(str(hf_dir)).model.layers[0].input_norm)


def test_awq_scales_favour_the_loud_channels() -> None:
    from tidegate.kernels.weights.int_weight import IntWeight
    from tidegate.worker.quantization.awq import awq_scales

    torch.manual_seed(0)
    w = torch.randn(48, 64)
    x = torch.randn(512, 64)
    x[:, :4] *= 30.0  # four loud input channels
    s = awq_scales([w], x, 4, 32, symmetric=False)
    assert s[:4].min() > s[4:].max()
    err = lambda q: (x @ (q - w).t()).pow(2).mean().item()  # noqa: E731
    rtn = IntWeight.quantize(w, 4, 32, symmetric=False).dequantize()
    scaled = IntWeight.quantize(w * s, 4, 32, symmetric=False).dequantize() / s
    assert err(scaled) < err(rtn)


@pytest.mark.parametrize(("method", "values", "error"), [("rtn-int8", "8-bit", 0.03),
                                                         ("fp8", "fp8 e4m3", 0.15)])
def test_a_gguf_source_keeps_its_tokenizer(tmp_path: Path, method: str, values: str,
                                           error: float) -> None:
    gguf = write_gguf(tiny_hf_model(tied=True), tmp_path / "m.gguf",
                      qtype=GGMLQuantizationType.Q8_0)
    out = tmp_path / "q"
    done = quantize(str(gguf), str(out), "--method", method)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out} (compressed-tensors, {values}")
    loaded, source = load_model(str(out)), load_model(str(gguf))
    chat = [{"role": "user", "content": "hello, tide gate"}]
    assert loaded.tokenizer.encode_prompt(None, chat) == source.tokenizer.encode_prompt(None, chat)
    assert loaded.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    assert rel(logits(loaded), logits(source)) < error


@pytest.mark.parametrize(("args", "message"), [
    (["--method", "gptq-int4"], "calibrates: give --calibration FILE"),
    (["--method", "awq-int4"], "calibrates: give --calibration FILE"),
    (["--method", "rtn-int8", "--format", "awq"], "--format awq holds 4-bit integers"),
    (["--method", "rtn-int4", "--group-size", "48"], "does not divide"),
    (["--method", "rtn-int4", "--group-size", "many"], "--group-size 'many'"),
    (["--method", "rtn-int4", "--act-order"], "--act-order is a GPTQ option"),
    (["--method", "rtn-int4", "--calibration", "/nonexistent"], "cannot read --calibration"),
    (["--method", "fp16"], "invalid choice: 'fp16'"),
    (["--method", "fp8", "--format", "gptq"],
     "--method fp8 writes compressed-tensors float-quantized, not --format gptq"),
    (["--method", "fp8", "--asymmetric"], "--asymmetric: FP8 weights are symmetric"),
    (["--method", "fp8", "--group-size", "32"],
     "--group-size 32: --method fp8 has one scale per channel"),
])
def test_bad_arguments_exit_2(hf_dir: Path, tmp_path: Path, args: list[str],
                              message: str) -> None:
    done = quantize(str(hf_dir), str(tmp_path / "q"), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_bad_sources_and_targets_exit_2(hf_dir: Path, tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    for src, out, message in [
        (str(hf_dir), str(taken), "exists and is not empty"),
        ("random:tiny", str(tmp_path / "a"), "quantize reads a model file"),
        (str(tmp_path / "none.gguf"), str(tmp_path / "b"), "does not exist"),
    ]:
        done = quantize(src, out, "--method", "rtn-int8")
        assert done.returncode == 2 and message in done.stderr, done.stderr
    first = tmp_path / "q"
    assert quantize(str(hf_dir), str(first), "--method", "rtn-int8").returncode == 0
    again = quantize(str(first), str(tmp_path / "qq"), "--method", "rtn-int8")
    assert again.returncode == 2 and "already quantized" in again.stderr


def generate(loaded: LoadedModel, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(max_model_len=1024, num_blocks=256, max_num_seqs=8))
    for i, prompt in enumerate(prompts):
        ids = loaded.tokenizer.encode_prompt(None, [{"role": "user", "content": prompt}])
        engine.add_request(EngineRequest(str(i), ids, SamplingParams(max_tokens=max_tokens)))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "kind"), [("rtn-int4", "int4-g64"),
                                              ("fp8", "fp8-e4m3-channel")])
def test_the_quantized_default_model_serves_its_dequantized_tokens(tmp_path: Path, method: str,
                                                                   kind: str) -> None:
    """Kept packed (the native kernel) or dequantized at load: the same greedy tokens."""
    out = tmp_path / f"smollm2-{method}"
    done = quantize("smollm2", str(out), "--method", method)
    assert done.returncode == 0, done.stderr
    packed, dequantized = load_model(str(out)), load_model(str(out), packed=False)
    assert packed.packed_types() == [kind] and dequantized.packed_types() == []
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "List three prime numbers.", "Why is the sky blue?"]
    want, got = generate(dequantized, prompts), generate(packed, prompts)
    for prompt, a, b in zip(prompts, want, got, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert a == b, f"{prompt!r}: diverges at output token {first}"
    assert "Paris" in packed.tokenizer.decode(got[0])


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_other_families_keep_their_config_and_compute_close(tmp_path: Path,
                                                            family: str) -> None:
    from tests.worker.models.family_checkpoints import write_family

    _, src = write_family(family, tmp_path / "src")
    done = quantize(str(src), str(tmp_path / "q"), "--method", "rtn-int8")
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "q" / "config.json").read_text())
    assert written["model_type"] == json.loads((src / "config.json").read_text())["model_type"]
    loaded, source = load_model(str(tmp_path / "q")), load_model(str(src))
    assert loaded.config.family == family and loaded.packed_types() == ["int8-channel"]
    assert rel(logits(loaded), logits(source)) < 0.03


@pytest.mark.parametrize(("family", "method", "says"), [
    ("phi3", "rtn-int8", "phi3 stores them otherwise"),
    ("mixtral", "rtn-int4", "mixtral stores them otherwise"),
])
def test_families_quantize_cannot_round_are_refused_by_name(
        tmp_path: Path, family: str, method: str, says: str) -> None:
    from tests.worker.models.family_checkpoints import write_family

    _, src = write_family(family, tmp_path / "src")
    done = quantize(str(src), str(tmp_path / "q"), "--method", method)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
