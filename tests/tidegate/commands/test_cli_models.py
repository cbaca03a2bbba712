"""The CLI's served models: a bad --model, --models-file or --lora exits 2 with one line naming
what is wrong, before any model loads or any Redis is reached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack_process import cli


@pytest.mark.parametrize(("args", "message"), [
    (["worker", "--model", "a=random:tiny", "--model", "a=random:tiny"], "given to two models"),
    (["api", "--model", "random:no-such-preset"], "no-such-preset"),
    (["worker", "--model", "random:tiny", "--lora", "oops"], "--lora 'oops': expected NAME=PATH"),
    (["up", "--model", "random:tiny", "--max-lora-rank", "65"], "max_lora_rank"),
    (["worker", "--model", "random:tiny", "--steal-delay-ms", "-1"], "steal_delay_ms"),
])
def test_bad_models_exit_2_naming_the_problem(args: list[str], message: str) -> None:
    out = cli(*args, "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("tidegate: error:") and message in out.stderr
    assert "Traceback" not in out.stderr


def test_a_bad_models_file_exits_2_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text("[[models]]\nspec = 'random:tiny'\nengine = { max_num_seqz = 4 }\n")
    out = cli("api", "--models-file", str(path), "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2 and str(path) in out.stderr
    assert "unknown engine option 'max_num_seqz'" in out.stderr
    out = cli("worker", "--models-file", str(tmp_path / "absent.json"))
    assert out.returncode == 2 and "cannot read the models file" in out.stderr


@pytest.mark.parametrize("args", [
    ["worker", "--device", "gpu"],
    ["worker", "--model", "random:tiny", "--lora", "oops"],
    ["worker", "--kv-cache-dtype", "fp8"],
    ["eval-ppl", "random:tiny", "--text", "/no/such/text.txt"],
    ["quantize", "random:tiny", "/tmp/q", "--method", "gptq-int4"],
    ["quantize", "random:tiny", "/tmp/q", "--method", "fp8", "--asymmetric"],
])
def test_a_bad_flag_is_refused_before_torch_is_imported(args: list[str]) -> None:
    # The message comes at once, not after ~1.2 s of importing torch (and every test or
    # operator typo used to pay that).
    probe = ("import sys\nfrom tidegate.commands.cli import main\n"
             f"code = main({args!r})\n"
             "sys.exit(10 + code if 'torch' in sys.modules else code)\n")
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("tidegate: error:") and "Traceback" not in out.stderr
