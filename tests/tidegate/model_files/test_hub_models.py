"""Models by Hub id, through huggingface_hub and a Hub of the tests' own (``tests/hub_emulator``):
checkpoints that transformers and gguf-py wrote, served as a safetensors repo (Llama), a sharded
one (Qwen2), a GGUF repo with two quantizations, a gated copy and a second revision. A model
loaded by id generates what transformers does on the same weights; a second start downloads
nothing; offline mode serves the cache; two pulls at once fetch each file once; a cut transfer
resumes; every error reaches the CLI as one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import httpx
import pytest
import torch

from tests.conftest import RedisServer
from tests.hub_emulator import TOKEN, HubEmulator
from tests.ports import free_port
from tests.stack_process import TIDEGATE, stop, wait_until
from tests.worker.hf_oracle import causal_greedy, hf_greedy
from tests.worker.models.family_checkpoints import family_model
from tests.worker.tiny_checkpoints import tiny_hf_model, write_gguf, write_hf_dir
from tidegate.model_files import hub_cache
from tidegate.model_files.hub_spec import choose_files, parse_hub_spec
from tidegate.model_files.model_source import context_length, resolve_model
from tidegate.model_files.tokenizer import byte_level_tokenizer, load_tokenizer
from tidegate.worker.models.loaders.loader import load_model

pytestmark = pytest.mark.slow  # tidegate processes, a stack

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119]  # <s>Hello, w
GGUF_FILES = ("tiny-llama-Q4_0.gguf", "tiny-llama-Q8_0.gguf")


@dataclass
class Hub:
    emulator: HubEmulator
    llama: torch.nn.Module  # transformers' models whose weights the repos hold
    qwen2: torch.nn.Module
    llama_v1: torch.nn.Module
    v1_commit: str
    gguf_dir: Path  # the GGUF files as written, to load by path


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    root = tmp_path_factory.mktemp("hub")
    llama, llama_v1 = tiny_hf_model(tied=False), tiny_hf_model(tied=False, seed=1)
    qwen2 = family_model("qwen2")
    ggufs = root / "gguf"
    ggufs.mkdir()
    write_gguf(llama, ggufs / GGUF_FILES[0], qtype=gguf.GGMLQuantizationType.Q4_0)
    write_gguf(llama, ggufs / GGUF_FILES[1], qtype=gguf.GGMLQuantizationType.Q8_0)
    qwen_dir = root / "qwen2"
    qwen2.save_pretrained(qwen_dir, max_shard_size="100KB")  # an index and its shards
    write_tokenizer(qwen_dir)
    with HubEmulator(free_port()) as emulator:
        llama_dir = write_hf_dir(llama, root / "llama")
        extra = {"README.md": b"# tiny", "original/consolidated.00.pth": b"\0" * 4096}
        emulator.add("org/tiny-llama", {"": llama_dir, **extra})
        v1 = emulator.add("org/tiny-llama", {"": write_hf_dir(llama_v1, root / "v1")},
                          revision="v1")
        emulator.add("org/tiny-qwen2", {"": qwen_dir,
                                        # another layout that the index does not name
                                        "consolidated.safetensors": b"\0" * 8192})
        emulator.add("org/tiny-llama-GGUF", {"": ggufs, "README.md": b"# quants"})
        emulator.add("org/gated-llama", {"": llama_dir}, gated=True)
        emulator.add("org/bin-only", {"config.json": (llama_dir / "config.json").read_bytes(),
                                      "pytorch_model.bin": b"\0" * 64})
        emulator.add("org/huge", {"": llama_dir})
        emulator.repos["org/huge"].stated_sizes["model.safetensors"] = 10**18
        yield Hub(emulator, llama, qwen2, llama_v1, v1, ggufs)


@pytest.fixture
def hf_env(hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fresh Hub cache pointed at the emulator, for this process and the CLI's."""
    env = {"HF_ENDPOINT": hub.emulator.url, "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    hub.emulator.served.clear()
    hub.emulator.requests.clear()
    return env


def tidegate(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TIDEGATE, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def write_tokenizer(path: Path) -> None:
    byte_level_tokenizer(256).backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def greedy_by_id(spec: str, n: int = 8) -> list[int]:
    loaded = load_model(spec)
    return causal_greedy(loaded.model, PROMPT, n, loaded.tokenizer.eos_token_ids)


# ---------------------------------------------------------------- loading by id


@pytest.mark.parametrize("repo", ["org/tiny-llama", "org/tiny-qwen2"])
def test_a_model_pulled_by_id_generates_what_transformers_does(
        hub: Hub, hf_env: dict[str, str], repo: str) -> None:
    out = tidegate("pull", repo)
    assert out.returncode == 0, out.stderr
    assert "100%|" in out.stderr  # huggingface_hub's progress bar
    snapshot = Path(out.stdout.strip().split(": ", 1)[1])
    assert snapshot.parent.parent.name == f"models--{repo.replace('/', '--')}"
    model = hub.llama if repo == "org/tiny-llama" else hub.qwen2
    assert greedy_by_id(repo) == hf_greedy(PROMPT, 8, model)
    fetched = set(hub.emulator.downloads(repo))
    weights = {f for f in fetched if f.endswith(".safetensors")}
    if repo == "org/tiny-qwen2":  # the index's shards only, not the other layout
        index = json.loads((snapshot / "model.safetensors.index.json").read_text())
        assert weights == set(index["weight_map"].values()) and len(weights) > 1
    else:
        assert weights == {"model.safetensors"}
    assert not fetched & {"README.md", "original/consolidated.00.pth"}


def test_a_gguf_repo_serves_the_quantization_named(hub: Hub, hf_env: dict[str, str]) -> None:
    for quant, file in (("q8_0", GGUF_FILES[1]), ("Q4_0", GGUF_FILES[0])):
        spec = f"org/tiny-llama-GGUF:{quant}"
        assert greedy_by_id(spec) == greedy_by_id(str(hub.gguf_dir / file))
        assert hub.emulator.downloads("org/tiny-llama-GGUF")[file] == 1
    # Without one: llama.cpp's choice, Q4_K_M, is absent here, so the repo's first file.
    out = tidegate("pull", "org/tiny-llama-GGUF")
    assert out.returncode == 0 and out.stdout.strip().endswith(GGUF_FILES[0]), out.stderr
    out = tidegate("pull", f"org/tiny-llama-GGUF/{GGUF_FILES[1]}")
    assert out.returncode == 0 and out.stdout.strip().endswith(GGUF_FILES[1]), out.stderr
    assert set(hub.emulator.downloads("org/tiny-llama-GGUF")) == set(GGUF_FILES)


def test_a_revision_is_served_by_branch_tag_or_commit(hub: Hub, hf_env: dict[str, str]) -> None:
    expected = hf_greedy(PROMPT, 8, hub.llama_v1)
    assert expected != hf_greedy(PROMPT, 8, hub.llama)  # the revisions differ
    for revision in ("v1", hub.v1_commit):
        assert greedy_by_id(f"org/tiny-llama@{revision}") == expected
    cache = Path(hf_env["HF_HOME"]) / "hub" / "models--org--tiny-llama"
    assert (cache / "refs" / "v1").read_text() == hub.v1_commit


def test_a_second_start_downloads_nothing_and_offline_mode_serves_the_cache(
        hub: Hub, hf_env: dict[str, str], tmp_path: Path) -> None:
    first = tidegate("pull", "org/tiny-llama")
    assert first.returncode == 0, first.stderr
    served = len(hub.emulator.served)
    again = tidegate("pull", "org/tiny-llama")
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert len(hub.emulator.served) == served  # not one byte of a file again
    # Offline, with the Hub out of reach: the cache serves it, and the model loads.
    dead = f"http://127.0.0.1:{free_port()}"
    offline = tidegate("pull", "org/tiny-llama", HF_HUB_OFFLINE="1", HF_ENDPOINT=dead)
    assert offline.returncode == 0 and offline.stdout == first.stdout, offline.stderr
    text = tmp_path / "text.txt"  # a few windows: the model's source is what is tested
    text.write_text(Path(__file__).read_text()[:2000])
    out = tidegate("eval-ppl", "org/tiny-llama", "--text", str(text), "--context",
                   "64", "--json", HF_HUB_OFFLINE="1", HF_ENDPOINT=dead)
    assert out.returncode == 0 and json.loads(out.stdout)["model"] == "tiny-llama", out.stderr
    written = tidegate("quantize", "org/tiny-llama", str(tmp_path / "int8"), "--method",
                       "rtn-int8", "--json", HF_HUB_OFFLINE="1", HF_ENDPOINT=dead)
    assert written.returncode == 0 and json.loads(written.stdout)["linears"] == 14, written.stderr
    # Unreachable but not offline: the cache too, after the failed look-up.
    unreachable = tidegate("pull", "org/tiny-llama", HF_ENDPOINT=dead)
    assert unreachable.returncode == 0 and unreachable.stdout == first.stdout


def test_a_model_transformers_downloaded_is_served_without_a_download(
        hub: Hub, hf_env: dict[str, str]) -> None:
    fill = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "AutoModelForCausalLM.from_pretrained('org/tiny-llama')\n"
            "AutoTokenizer.from_pretrained('org/tiny-llama')\n")
    out = subprocess.run([sys.executable, "-c", fill], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **hf_env})
    assert out.returncode == 0, out.stderr
    served = len(hub.emulator.served)
    assert served and "model.safetensors" in hub.emulator.downloads("org/tiny-llama")
    for env in ({"HF_HUB_OFFLINE": "1"}, {}):  # from the cache alone, then online
        pulled = tidegate("pull", "org/tiny-llama", **env)
        assert pulled.returncode == 0, pulled.stderr
    assert len(hub.emulator.served) == served  # not one file fetched again
    assert greedy_by_id("org/tiny-llama") == hf_greedy(PROMPT, 8, hub.llama)


def test_the_api_s_share_is_the_tokenizer_and_config(hub: Hub, hf_env: dict[str, str]) -> None:
    out = tidegate("pull", "--tokenizer-only", "org/tiny-qwen2")
    assert out.returncode == 0, out.stderr
    assert set(hub.emulator.downloads("org/tiny-qwen2")) == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    listed = tidegate("models", "--json")
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["name"], row["format"]) == ("org/tiny-qwen2", "tokenizer only")


def test_the_api_reads_a_gguf_s_tokenizer_from_its_header_alone(
        hub: Hub, hf_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_cache, "HEADER_START_BYTES", 1024)  # a few growing ranges
    spec, file = "org/tiny-llama-GGUF:Q8_0", GGUF_FILES[1]
    size = (hub.gguf_dir / file).stat().st_size
    api = resolve_model(spec, "tokenizer")
    served = hub.emulator.served[:]
    assert [s.start for s in served] == [0, 1024, 4096, 16384][:len(served)]
    assert len(served) > 1 and sum(s.sent for s in served) < size  # never the whole file
    assert api.path is not None and api.path.name == file and api.path.stat().st_size < size
    full = resolve_model(str(hub.gguf_dir / file))
    text = "Hello, wörld <|im_start|>"
    assert load_tokenizer(api).encode(text) == load_tokenizer(full).encode(text)
    assert context_length(api) == context_length(full)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the next start: from the header kept
    assert resolve_model(spec, "tokenizer").path == api.path
    assert resolve_model("org/tiny-llama-GGUF/" + file, "tokenizer").path == api.path
    assert len(hub.emulator.served) == len(served)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    worker = resolve_model(spec)  # a worker's need: the whole file, in the Hub's cache
    assert worker.path is not None and worker.path.stat().st_size == size
    assert worker.path.parent.parent.name == "snapshots"
    assert resolve_model(spec, "tokenizer").path == worker.path  # now the file itself


def test_two_pulls_at_once_fetch_each_file_once(hub: Hub, hf_env: dict[str, str]) -> None:
    weights = ("org/tiny-llama", "model.safetensors")
    held = hub.emulator.holds[weights] = threading.Event()
    try:
        pulls = [subprocess.Popen([*TIDEGATE, "pull", "org/tiny-llama"], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(2)]
        head = "HEAD /org/tiny-llama/resolve/"
        # Both are downloading (each asked for the weights' metadata) before the bytes flow.
        wait_until(lambda: sum(n for k, n in hub.emulator.requests.items()
                               if k.startswith(head) and k.endswith("/model.safetensors")) >= 2
                   or any(p.poll() is not None for p in pulls), "both pulls to start", 60)
        held.set()
        outs = [p.communicate(timeout=120) for p in pulls]
    finally:
        held.set()
        del hub.emulator.holds[weights]
    assert [p.returncode for p in pulls] == [0, 0], outs
    assert outs[0][0] == outs[1][0]
    assert set(hub.emulator.downloads("org/tiny-llama").values()) == {1}


def test_a_pull_stopped_midway_keeps_the_files_it_finished(
        hub: Hub, hf_env: dict[str, str]) -> None:
    # huggingface_hub resumes a transfer cut by the network within the call (a Range request);
    # a process stopped midway keeps each file it finished, and the next pull fetches the rest.
    repo = hub.emulator.repos["org/tiny-qwen2"]
    files = repo.commits[repo.refs["main"]]
    shards = sorted(set(json.loads(files["model.safetensors.index.json"])["weight_map"].values()))
    last = ("org/tiny-qwen2", shards[-1])
    held = hub.emulator.holds[last] = threading.Event()
    snapshot = (Path(hf_env["HF_HOME"]) / "hub" / "models--org--tiny-qwen2" / "snapshots"
                / repo.refs["main"])
    pull = subprocess.Popen([*TIDEGATE, "pull", "org/tiny-qwen2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    spec = parse_hub_spec("org/tiny-qwen2")
    assert spec is not None
    finished = [f for f in choose_files(spec, dict.fromkeys(files, 0)).files + tuple(shards)
                if f != shards[-1]]
    try:
        wait_until(lambda: all((snapshot / f).is_file() for f in finished)
                   or pull.poll() is not None, "every file but the held shard", 60)
        pull.kill()  # an evicted pod, a ^C
        pull.wait()
    finally:
        held.set()
        del hub.emulator.holds[last]
    assert pull.returncode == -9 and not (snapshot / shards[-1]).exists()
    def fetches() -> Counter[str]:  # file GETs asked for (a killed one's included)
        return Counter({k.rsplit("/", 1)[1]: n for k, n in hub.emulator.requests.items()
                        if k.startswith("GET /org/tiny-qwen2/resolve/")})

    before = fetches()
    out = tidegate("pull", "org/tiny-qwen2")
    assert out.returncode == 0, out.stderr
    assert fetches() - before == {shards[-1]: 1}
    assert greedy_by_id("org/tiny-qwen2") == hf_greedy(PROMPT, 8, hub.qwen2)


def test_a_transfer_that_keeps_failing_says_to_run_again(
        hub: Hub, hf_env: dict[str, str]) -> None:
    weights = ("org/tiny-llama", "model.safetensors")
    hub.emulator.cuts[weights] = (1000, 1000)  # every GET cut short: huggingface_hub gives up
    try:
        failed = tidegate("pull", "org/tiny-llama")
    finally:
        del hub.emulator.cuts[weights]
    assert failed.returncode == 2, failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith("tidegate: error: model ")
    assert "run it again to resume" in failed.stderr and "Traceback" not in failed.stderr
    assert len([s for s in hub.emulator.served if s.path == "model.safetensors"]) > 1


def test_pull_alone_fetches_every_served_model_and_the_draft(
        hub: Hub, hf_env: dict[str, str]) -> None:
    out = tidegate("pull", TIDEGATE_MODELS="chat=org/tiny-llama,q8=org/tiny-llama-GGUF:Q8_0",
                   TIDEGATE_SPECULATIVE="draft:org/tiny-qwen2")
    assert out.returncode == 0, out.stderr
    assert [line.split(": ")[0] for line in out.stdout.splitlines()] == [
        "org/tiny-llama", "org/tiny-llama-GGUF:Q8_0", "org/tiny-qwen2"]
    assert {r.split("/")[1] for r in hub.emulator.downloads()} == {
        "tiny-llama", "tiny-llama-GGUF", "tiny-qwen2"}


def test_tidegate_models_lists_the_cache(hub: Hub, hf_env: dict[str, str]) -> None:
    empty = tidegate("models")
    assert empty.returncode == 0 and "no models in the Hugging Face cache" in empty.stderr
    for spec in ("org/tiny-llama", "org/tiny-llama@v1", "org/tiny-llama-GGUF:Q8_0",
                 "org/tiny-llama-GGUF:Q4_0"):
        assert tidegate("pull", spec).returncode == 0
    out = tidegate("models")
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "REVISION", "FORMAT", "SIZE"]
    rows = [json.loads(line) for line in tidegate("models", "--json").stdout.splitlines()]
    assert [(r["name"], r["revision"].split(" ")[0], r["format"]) for r in rows] == [
        ("org/tiny-llama", "main", "safetensors"), ("org/tiny-llama", "v1", "safetensors"),
        ("org/tiny-llama-GGUF", "main", "gguf Q4_0, Q8_0")]
    ggufs = sum((hub.gguf_dir / f).stat().st_size for f in GGUF_FILES)
    assert rows[2]["size_bytes"] == ggufs
    assert any(line.startswith("org/tiny-llama-GGUF") and "gguf Q4_0, Q8_0" in line
               for line in lines)


def test_a_gated_repository_needs_a_token(hub: Hub, hf_env: dict[str, str]) -> None:
    refused = tidegate("pull", "org/gated-llama")
    assert refused.returncode == 2 and "is gated" in refused.stderr
    assert "set HF_TOKEN" in refused.stderr
    wrong = tidegate("pull", "org/gated-llama", HF_TOKEN="hf_wrong_token")
    assert wrong.returncode == 2 and "has no access" in wrong.stderr
    assert "hf_wrong_token" not in wrong.stderr + wrong.stdout
    allowed = tidegate("pull", "org/gated-llama", HF_TOKEN=TOKEN)
    assert allowed.returncode == 0, allowed.stderr
    assert TOKEN not in allowed.stderr + allowed.stdout


@pytest.mark.parametrize(("args", "env", "message"), [
    (["pull", "org/no-such-model"], {}, "no repository org/no-such-model on http://127.0.0.1"),
    (["pull", "org/tiny-llama@v9"], {}, "org/tiny-llama has no revision 'v9'"),
    (["pull", "org/tiny-llama-GGUF:Q5_K_M"], {},
     "org/tiny-llama-GGUF has no Q5_K_M file (it has: Q4_0, Q8_0)"),
    (["pull", "org/bin-only"], {},
     "org/bin-only has no weights tidegate can load (found pytorch_model.bin;"),
    (["pull", "org/huge"], {}, "needs 1000000.0 TB in "),
    (["pull", "org/tiny-llama"], {"HF_HUB_OFFLINE": "1"},
     "org/tiny-llama is not in the cache "),
    (["pull", "org/tiny-llama"], {"HF_ENDPOINT": "dead"}, "cannot reach the Hub at"),
    (["worker", "--model", "org/no-such-model"], {}, "no repository org/no-such-model"),
    (["api", "--model", "org/tiny-llama@v9"], {}, "has no revision 'v9'"),
    (["worker", "--model", "random:tiny", "--speculative", "draft:org/gated-llama"], {},
     "org/gated-llama is gated"),
    (["eval-ppl", "org/bin-only", "--text", __file__], {}, "no weights tidegate can load"),
    (["quantize", "org/huge", "/tmp/never", "--method", "rtn-int8"], {}, "needs 1000000.0 TB"),
])
def test_every_hub_error_is_one_line_and_exit_2(
        hf_env: dict[str, str], args: list[str], env: dict[str, str], message: str) -> None:
    if env.get("HF_ENDPOINT") == "dead":
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    out = tidegate(*args, "--redis-url", "redis://127.0.0.1:1/0", **env) \
        if args[0] in ("worker", "api") else tidegate(*args, **env)
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()[-1:]
    assert line.startswith(("tidegate: error: model ", "tidegate: error: --speculative"))
    assert message in line, out.stderr
    assert "Traceback" not in out.stderr
    if "HF_HUB_OFFLINE" in env:
        assert "HF_HUB_OFFLINE=1" in line and "tidegate pull org/tiny-llama" in line
    if "cannot reach" in message:
        assert "HF_HUB_OFFLINE=1" in line


# ---------------------------------------------------------------- the roles


def test_a_stack_serves_a_hub_model_the_api_fetching_only_its_tokenizer(
        hub: Hub, hf_env: dict[str, str], redis_server: RedisServer) -> None:
    redis_server.flush()
    env = {**os.environ, "TIDEGATE_REDIS_URL": redis_server.url,
           "TIDEGATE_LOG_LEVEL": "WARNING", "TIDEGATE_METRICS_PORT": "0",
           "TIDEGATE_KV_CACHE_GB": "0.1"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = [subprocess.Popen([*TIDEGATE, "api", "--model", "org/tiny-llama", "--port",
                               str(port)], env=env, stderr=subprocess.PIPE, text=True)]
    try:
        wait_until(lambda: ready(base) or procs[0].poll() is not None, "the API")
        assert procs[0].poll() is None, procs[0].communicate()[1]
        fetched = set(hub.emulator.downloads("org/tiny-llama"))
        assert "tokenizer.json" in fetched and "model.safetensors" not in fetched
        procs.append(subprocess.Popen([*TIDEGATE, "worker", "--model", "org/tiny-llama"],
                                      env=env, stderr=subprocess.PIPE, text=True))
        job = httpx.post(f"{base}/v1/jobs", json={"prompt": "Hello, w", "max_tokens": 8,
                                                  "model": "org/tiny-llama"}, timeout=30)
        assert job.status_code == 202, job.text
        result: dict = {}

        def finished() -> bool:
            result.update(httpx.get(f"{base}/v1/jobs/{job.json()['id']}", timeout=10).json())
            return result["status"] not in ("queued", "running") or procs[1].poll() is not None

        wait_until(finished, "the job's result")
        assert result["status"] == "done" and result["model"] == "tiny-llama", result
        expected = [t for t in hf_greedy(PROMPT, 8, hub.llama) if t != 257]  # </s>: not text
        assert result["text"] == byte_level_tokenizer(256).decode(expected)
        assert hub.emulator.downloads("org/tiny-llama")["model.safetensors"] == 1
    finally:
        for proc in procs:
            stop(proc)


def ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
