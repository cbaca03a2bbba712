"""Perplexity (``tidegate.worker.models.perplexity`` and ``tidegate eval-ppl``): the windows' scored
halves against a direct computation from the model's logits; packed and dequantized weights of
one quantized GGUF agree to float rounding; bad input is refused with exit code 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.worker.hf_oracle import causal_logits
from tests.worker.tiny_checkpoints import tiny_hf_model, write_gguf
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.models.perplexity import perplexity

TEXT = ("The tide came in over the flats, slowly at first and then all at once; the gate "
        "keeper counted the waves and wrote each one down. ") * 6


def direct_nll(model, ids: list[int], context: int) -> tuple[float, int]:  # noqa: ANN001
    total, count = 0.0, 0
    for w in range(len(ids) // context):
        window = ids[w * context:(w + 1) * context]
        logp = torch.log_softmax(causal_logits(model, window).double(), dim=-1)
        for pos in range(context // 2, context - 1):
            total -= logp[pos, window[pos + 1]].item()
            count += 1
    return total, count


def test_windows_score_their_second_half(tmp_path: Path) -> None:
    loaded = load_model(str(write_gguf(tiny_hf_model(tied=False), tmp_path / "m.gguf")))
    ids = loaded.tokenizer.encode(TEXT)
    result = perplexity(loaded.model, ids, context=64)
    total, count = direct_nll(loaded.model, ids, 64)
    assert (result.windows, result.tokens_scored) == (len(ids) // 64, count)
    assert result.nll == pytest.approx(total / count, rel=1e-6)
    assert result.ppl == pytest.approx(math.exp(total / count), rel=1e-6)
    short = perplexity(loaded.model, ids[:10], context=64)  # one window of its own length
    assert (short.windows, short.context, short.tokens_scored) == (1, 10, 4)
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        perplexity(loaded.model, ids[:1])


def test_packed_and_dequantized_weights_score_alike(tmp_path: Path) -> None:
    path = write_gguf(tiny_hf_model(tied=True), tmp_path / "q.gguf",
                      qtype=GGMLQuantizationType.Q4_1,
                      qtypes={"token_embd": GGMLQuantizationType.Q8_0})
    packed = load_model(str(path), cpu_activations="float")
    dequantized = load_model(str(path), packed=False)
    int8 = load_model(str(path))  # auto: 8-bit activations
    assert packed.packed_types() == ["Q4_1", "Q8_0"]
    assert (packed.activations(), int8.activations(), dequantized.activations()) == (
        "float", "int8", None)
    ids = packed.tokenizer.encode(TEXT)
    a = perplexity(packed.model, ids, context=64)
    b = perplexity(dequantized.model, ids, context=64)
    assert a.ppl == pytest.approx(b.ppl, rel=1e-5)  # the condition: float rounding
    c = perplexity(int8.model, ids, context=64)
    assert c.ppl == pytest.approx(b.ppl, rel=0.02)  # rounded activations: close, not equal


def eval_ppl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidegate", "eval-ppl", *args],
                          capture_output=True, text=True, timeout=120)


def test_the_command_reports_perplexity(tmp_path: Path) -> None:
    model = write_gguf(tiny_hf_model(tied=False), tmp_path / "m.gguf",
                       qtype=GGMLQuantizationType.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    done = eval_ppl(str(model), "--text", str(text), "--context", "64", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    loaded = load_model(str(model))
    want = perplexity(loaded.model, loaded.tokenizer.encode(TEXT), context=64)
    assert report["ppl"] == pytest.approx(want.ppl, rel=1e-9)
    assert report["weights"] == "packed Q8_0" and report["tokens_scored"] == want.tokens_scored
    assert report["activations"] == "int8"
    exact = eval_ppl(str(model), "--text", str(text), "--context", "64", "--json",
                     "--cpu-activations", "float")
    floats = load_model(str(model), cpu_activations="float")
    assert json.loads(exact.stdout)["ppl"] == pytest.approx(
        perplexity(floats.model, floats.tokenizer.encode(TEXT), context=64).ppl, rel=1e-9)
    plain = eval_ppl(str(model), "--text", str(text), "--context", "64", "--weights",
                     "dequantized")
    assert plain.returncode == 0 and plain.stdout.startswith("perplexity ")
    assert "float32" in plain.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--text", "/nonexistent/file.txt"], "cannot read --text /nonexistent/file.txt"),
    (["--text", "TEXT", "--context", "1"], "--context must be at least 2 tokens"),
    (["--text", "TEXT", "--device", "gpu"], "--device 'gpu': cpu or cuda[:N]"),
    (["--text", "EMPTY"], "has fewer than 2 tokens"),
])
def test_bad_input_exits_2_with_a_message(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "e.txt").write_text("")
    args = [str(tmp_path / "t.txt") if a == "TEXT" else str(tmp_path / "e.txt") if a == "EMPTY"
            else a for a in args]
    done = eval_ppl("random:tiny", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_a_missing_model_exits_2(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text(TEXT)
    done = eval_ppl(str(tmp_path / "none.gguf"), "--text", str(tmp_path / "t.txt"))
    assert done.returncode == 2 and "does not exist" in done.stderr
