"""tidegate against llama.cpp's own server on the CPU, server to server, the comparison users make.

``llama-server`` is built from the llama.cpp source that the llama-cpp-python sdist vendors
(CMake, ``-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON``: the flags the engine-to-engine
check in ``benchmarks/engine/quantized_cpu.py`` builds its binding with; AVX-512 off on a CPU
without it) and cached under ``~/.cache/tidegate/llama-server/<version>/<avx512|avx2>/``. It serves the default GGUF with continuous
batching (``-np`` slots); ``tidegate up`` serves the same file. One at a time on the same cores,
each is driven by the same client over its OpenAI-compatible ``/v1/chat/completions``: the same
chat prompts, greedy, a fixed number of new tokens (``ignore_eos`` on both), at 1 stream and
at 16 concurrent streams. Rounds alternate the servers (the host's speed drifts); each figure is
the median round's. Output tokens/s counts the completion tokens each server reports in its
``usage``, over the wall time of the whole set of requests.

    python -m tidegate.benchmarks.serving.vs_llama_server --threads 2 --repeats 3 \\
        --out benchmarks/results/serving/vs_llama_server.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tidegate.benchmarks.harness.measure import record
from tidegate.benchmarks.harness.run.processes import (
    free_port,
    http_ready,
    log_tail,
    spawn,
    stop_processes,
    tree_cpu_seconds,
)

LLAMA_CPP_PYTHON = "0.3.36"


def cpu_has_avx512() -> bool:
    """Whether this CPU runs AVX-512 (a Zen 3 or an older Intel has AVX2 alone: a build with
    ``-DGGML_AVX512=ON`` stops there on its first illegal instruction)."""
    return "avx512f" in record.cpu_flags()


# The flags, with AVX-512 only where the CPU has it.
CMAKE_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON",
               f"-DGGML_AVX512={'ON' if cpu_has_avx512() else 'OFF'}", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DCMAKE_BUILD_TYPE=Release"]
QUESTIONS = ["What is the capital of France? Answer in one sentence, please.",
             "Name three colours of the rainbow.", "Write a haiku about the sea.",
             "How many legs does a spider have?", "Give me a synonym for 'happy'.",
             "What does a bicycle have two of?", "Say hello in Spanish.",
             "What is two plus two?"]


TOOLS = ("llama-server", "llama-perplexity")


def llama_server(version: str = LLAMA_CPP_PYTHON) -> Path:
    """The cached ``llama-server`` binary (``llama-perplexity`` beside it), built first if
    either is not there."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "tidegate" / "llama-server" / version / ("avx512" if cpu_has_avx512() else "avx2")
    binary = root / "bin" / "llama-server"
    if all((root / "bin" / tool).exists() for tool in TOOLS):
        return binary
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={version}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, "-j",
                        str(os.cpu_count() or 2)], check=True)
        (root / "bin").mkdir(exist_ok=True)
        built = build / "bin"
        for item in built.iterdir():  # the tools and the shared libraries they link
            if item.name in TOOLS or ".so" in item.name:
                shutil.copy2(item, root / "bin" / item.name, follow_symlinks=True)
    return binary


@dataclass
class Round:
    server: str
    streams: int
    requests: int
    completion_tokens: int
    wall_s: float
    cpu_ms_per_token: dict[str, float]  # by process (role), over the round

    @property
    def tok_s(self) -> float:
        return self.completion_tokens / self.wall_s


def role(argv: str) -> str:
    """The part of a server a process plays, from its command line."""
    for needle, name in (("redis-server", "redis-server"), ("tidegate batch-worker", "batch worker"),
                         ("tidegate worker", "worker"), ("tidegate up", "api + gateway (up)"),
                         ("llama-server", "llama-server")):
        if needle in argv:
            return name
    return argv.split(" ", 1)[0]


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                tokens: int) -> dict[str, float]:
    """CPU milliseconds per completion token of each role between two tree readings."""
    spent: dict[str, float] = {}
    for pid, (argv, seconds) in after.items():
        name = role(argv)
        spent[name] = spent.get(name, 0.0) + seconds - before.get(pid, (argv, 0.0))[1]
    return {k: round(1000 * v / max(tokens, 1), 3) for k, v in sorted(spent.items())}


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def drive(base: str, model: str, streams: int, requests: int, max_tokens: int) -> tuple[int, float]:
    """``requests`` chat completions, ``streams`` at a time: (completion tokens, wall s)."""
    def one(i: int) -> int:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
        answer = post_json(f"{base}/v1/chat/completions", body)
        return int(answer["usage"]["completion_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens, time.perf_counter() - start


def wait_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not http_ready(url):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before it was up:"
                               f"\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)


class Server:
    """One server process at a time: started, driven, stopped."""

    def __init__(self, name: str, argv: list[str], health: str, base: str, model: str,
                 env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.health, self.base, self.model = name, argv, health, base, model
        self.env, self.log = env, log

    def __enter__(self) -> Server:
        self.proc = spawn(self.argv, self.env, self.log)
        wait_up(self.health, self.proc, self.log)
        return self

    def __exit__(self, *_exc: object) -> None:
        stop_processes([self.proc])


def perplexity(binary: Path, gguf: Path, text: str, context: int, threads: int) -> dict:
    """Perplexity of the default GGUF over ``text``, windows of ``context`` tokens with the
    second half of each scored, by ``llama-perplexity`` and by ``tidegate eval-ppl`` (its
    default path: packed weights, 8-bit activations), one after the other on the same cores."""
    import re

    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    t0 = time.perf_counter()
    done = subprocess.run([str(binary.parent / "llama-perplexity"), "-m", str(gguf), "-f", text,
                           "-c", str(context), "-t", str(threads), "-b", str(context)],
                          capture_output=True, text=True, env=env, check=False)
    llama_s = time.perf_counter() - t0
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"llama-perplexity failed:\n{(done.stdout + done.stderr)[-3000:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", done.stdout + done.stderr)
    t0 = time.perf_counter()
    ours = subprocess.run([sys.executable, "-m", "tidegate", "eval-ppl", "smollm2", "--text", text,
                           "--context", str(context), "--json"], capture_output=True, text=True,
                          env={**os.environ, "TIDEGATE_TORCH_THREADS": str(threads)}, check=False)
    tidegate_s = time.perf_counter() - t0
    if ours.returncode != 0:
        raise SystemExit(f"tidegate eval-ppl failed:\n{ours.stderr[-3000:]}")
    mine = json.loads(ours.stdout.strip().splitlines()[-1])
    llama_ppl = float(found.group(1))
    return {"text": text, "context": context, "llama_perplexity": llama_ppl,
            "llama_chunks": int(chunks.group(1)) if chunks else None, "llama_s": round(llama_s, 1),
            "tidegate_eval_ppl": mine, "tidegate_s": round(tidegate_s, 1),
            "ratio": round(float(mine["ppl"]) / llama_ppl, 4)}


def summarize(rounds: list[Round], streams: list[int]) -> dict[str, dict[str, object]]:
    """Per stream count: each server's median round (tok/s), its rounds, its median CPU
    milliseconds per token by role, and tidegate's ratio to llama-server."""
    table: dict[str, dict[str, object]] = {}
    for n in streams:
        row: dict[str, object] = {}
        for name in ("llama-server", "tidegate up"):
            runs = [x for x in rounds if x.server == name and x.streams == n]
            row[name] = round(statistics.median(x.tok_s for x in runs), 1)
            row[f"{name} rounds"] = [round(x.tok_s, 1) for x in runs]
            row[f"{name} cpu ms/token"] = {
                k: round(statistics.median(x.cpu_ms_per_token.get(k, 0.0) for x in runs), 3)
                for k in sorted({k for x in runs for k in x.cpu_ms_per_token})}
        row["ratio"] = round(row["tidegate up"] / row["llama-server"], 2)  # type: ignore[operator]
        table[f"{n} stream(s)"] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests-per-stream", type=int, default=2,
                    help="requests per stream in a round (1 stream: at least 4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tidegate-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for `tidegate up` (TIDEGATE_TORCH_THREADS=1, ...)")
    ap.add_argument("--perplexity", metavar="TEXT",
                    help="also score this text with llama-perplexity and tidegate eval-ppl")
    ap.add_argument("--ppl-context", type=int, default=512)
    ap.add_argument("--no-serve", action="store_true", help="only --perplexity")
    ap.add_argument("--logdir", default=None)
    ap.add_argument("--out", default="benchmarks/results/serving/vs_llama_server.json")
    args = ap.parse_args()

    from tidegate.model_files.model_source import resolve_model
    from tidegate.settings import batch_limits

    gguf = resolve_model("smollm2").path
    assert gguf is not None
    binary = llama_server()
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="vs-llama-"))
    logdir.mkdir(parents=True, exist_ok=True)
    slots = max(args.streams)
    seats = batch_limits("cpu").max_num_seqs
    ctx = 1024

    def servers() -> list[Server]:
        lport, tport = free_port(), free_port()
        env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
        llama = Server("llama-server", [
            str(binary), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
            "-np", str(slots), "-c", str(ctx * slots), "--cont-batching", "--host",
            "127.0.0.1", "--port", str(lport)], f"http://127.0.0.1:{lport}/health",
            f"http://127.0.0.1:{lport}", "default", env, logdir / "llama-server.log")
        tidegate = Server("tidegate up", [
            sys.executable, "-m", "tidegate", "up", "--port", str(tport)],
            f"http://127.0.0.1:{tport}/readyz", f"http://127.0.0.1:{tport}", "smollm2",
            {**os.environ, "TIDEGATE_TORCH_THREADS": str(args.threads),
             **dict(kv.split("=", 1) for kv in args.tidegate_env)},
            logdir / "tidegate-up.log")
        return [llama, tidegate]

    ppl = (perplexity(binary, gguf, args.perplexity, args.ppl_context, args.threads)
           if args.perplexity else None)
    if ppl:
        print(f"perplexity: tidegate {ppl['tidegate_eval_ppl']['ppl']}, llama.cpp "
              f"{ppl['llama_perplexity']}: {ppl['ratio']}x", flush=True)
    rounds: list[Round] = []
    for r in range(0 if args.no_serve else args.repeats):
        order = servers() if r % 2 == 0 else servers()[::-1]
        for server in order:
            with server:
                drive(server.base, server.model, 1, 1, 8)  # warm-up, unmeasured
                for streams in args.streams:
                    n = max(4 if streams == 1 else 1, args.requests_per_stream) * streams
                    cpu0 = tree_cpu_seconds(server.proc.pid)
                    tokens, wall = drive(server.base, server.model, streams, n, args.max_tokens)
                    cpu = cpu_by_role(cpu0, tree_cpu_seconds(server.proc.pid), tokens)
                    rounds.append(Round(server.name, streams, n, tokens, wall, cpu))
                    print(f"round {r + 1}: {server.name}, {streams} stream(s): "
                          f"{tokens / wall:.1f} tok/s ({tokens} tokens in {wall:.1f} s); CPU ms "
                          f"per token: {cpu}", flush=True)

    table = summarize(rounds, [] if args.no_serve else args.streams)
    for streams, row in table.items():
        print(f"{streams}: tidegate up {row['tidegate up']} tok/s, llama-server "
              f"{row['llama-server']} tok/s: {row['ratio']}x", flush=True)
    report = {**record.record(),
              "machine": {**record.machine(), "cpu": record.cpu_model(), "threads": args.threads},
              "llama_cpp_python": LLAMA_CPP_PYTHON, "cmake_flags": CMAKE_FLAGS,
              "model": gguf.name, "max_tokens": args.max_tokens, "llama_server_slots": slots,
              "tidegate_seats": seats, "tidegate_env": args.tidegate_env, "table": table,
              "rounds": [asdict(x) for x in rounds], "perplexity": ppl}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
