"""``tidegate quantize`` as a user runs it: a tiny HF directory or GGUF in, a compressed-tensors
(or GPTQ) directory out, which tidegate then loads with its integers kept packed. Round to
nearest must give exactly ``IntWeight.quantize`` of the source weights; GPTQ must beat it on
its own calibration text; bad arguments exit 2 with a message. The default model quantized
serves the tokens of its own dequantized weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kernels.int_weight import IntWeight
from tests.worker.tiny_checkpoints import tiny_hf_model, write_gguf, write_hf_dir
from tidegate.protocol import SamplingParams
from worker.engine.engine import Engine, EngineConfig, EngineRequest
from worker.models.llama import CausalAttention
from worker.models.loaders.loader import LoadedModel, load_model

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
    from kernels.int_weight import IntWeight
    from worker.quantization.awq import awq_scales

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


def test_a_gguf_source_keeps_its_tokenizer(tmp_path: Path) -> None:
    gguf = write_gguf(tiny_hf_model(tied=True), tmp_path / "m.gguf",
                      qtype=GGMLQuantizationType.Q8_0)
    out = tmp_path / "q"
    done = quantize(str(gguf), str(out), "--method", "rtn-int8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out} (compressed-tensors, 8-bit")
    loaded, source = load_model(str(out)), load_model(str(gguf))
    chat = [{"role": "user", "content": "hello, tide gate"}]
    assert loaded.tokenizer.encode_prompt(None, chat) == source.tokenizer.encode_prompt(None, chat)
    assert loaded.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    assert rel(logits(loaded), logits(source)) < 0.03


@pytest.mark.parametrize(("args", "message"), [
    (["--method", "gptq-int4"], "calibrates: give --calibration FILE"),
    (["--method", "awq-int4"], "calibrates: give --calibration FILE"),
    (["--method", "rtn-int8", "--format", "awq"], "--format awq holds 4-bit integers"),
    (["--method", "rtn-int4", "--group-size", "48"], "does not divide"),
    (["--method", "rtn-int4", "--group-size", "many"], "--group-size 'many'"),
    (["--method", "rtn-int4", "--act-order"], "--act-order is a GPTQ option"),
    (["--method", "rtn-int4", "--calibration", "/nonexistent"], "cannot read --calibration"),
    (["--method", "fp16"], "invalid choice: 'fp16'"),
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
def test_the_quantized_default_model_serves_its_dequantized_tokens(tmp_path: Path) -> None:
    out = tmp_path / "smollm2-int4"
    done = quantize("smollm2", str(out), "--method", "rtn-int4")
    assert done.returncode == 0, done.stderr
    packed, dequantized = load_model(str(out)), load_model(str(out), packed=False)
    assert packed.packed_types() == ["int4-g64"] and dequantized.packed_types() == []
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "List three prime numbers.", "Why is the sky blue?"]
    want, got = generate(dequantized, prompts), generate(packed, prompts)
    for prompt, a, b in zip(prompts, want, got, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert a == b, f"{prompt!r}: diverges at output token {first}"
    assert "Paris" in packed.tokenizer.decode(got[0])
