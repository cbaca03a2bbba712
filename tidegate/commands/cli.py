"""The `tidegate` command: run any role, the whole stack, submit a job, or inspect the queue.

Bad input exits with code 2 and one line naming what is wrong; a job that fails exits 1.
Roles are imported inside their commands so `tidegate submit` stays light.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence

from tidegate import __version__
from tidegate.keys import WORKER_HEARTBEAT_TTL_S
from tidegate.log_redactor import REDACTOR

TRACE_LOG_LEVEL = 5  # uvicorn's name for it, given before uvicorn is imported

EXIT_USAGE = 2
EXIT_FAILED = 1


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# Flags that set a setting (a flag's dest -> the setting's name), on every command but those
# in OWN_OPTIONS. --model and --lora (repeatable) are lists: None when not given.
SETTING_FLAGS: dict[str, str] = {
    **{f: f for f in (
        "redis_url", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gb",
        "kv_cache_dtype", "cuda_graphs", "weights", "quantize", "cpu_activations", "host",
        "port", "log_level", "models_file", "max_loras", "max_lora_rank",
        "tensor_parallel_size", "pipeline_parallel_size", "speculative",
        "num_speculative_tokens", "speculative_max_batch", "prefix_routing", "steal_delay_ms",
        "max_step_ms")},
    "model": "models", "lora": "loras"}
# Commands whose flags are their own (a request's fields, a tool's options), not settings.
OWN_OPTIONS = frozenset({"submit", "eval-ppl", "quantize", "models"})


def _settings(args: argparse.Namespace):  # -> Settings
    from pydantic import ValidationError

    from tidegate.settings import load_settings

    overrides = {setting: getattr(args, flag, None) for flag, setting in SETTING_FLAGS.items()}
    for flag in ("model", "lora"):
        overrides[SETTING_FLAGS[flag]] = overrides[SETTING_FLAGS[flag]] or None
    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CliError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _check_keys_file(path: str | None) -> None:
    """A keys file that cannot be read or has a malformed line: a message, not a traceback."""
    from tidegate.http.key_file import KeyFileError, read_key_file

    if path is None:
        return
    try:
        read_key_file(path)
    except KeyFileError as exc:
        raise CliError(f"{path}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read the keys file {path}: {exc}") from None


def _check_models(settings, *, engine: bool = False) -> list:  # noqa: ANN001 - lazily typed
    """The served models (``--model``, ``--models-file``, ``--lora``), each spec found (a Hub
    id fetched: all of it for a worker, ``engine``; its tokenizer and config for the API) and,
    with ``engine``, each one's engine options checked against the device."""
    from tidegate.model_files.model_source import ModelLoadError, resolve_model
    from tidegate.model_files.served_model import ServedModelError, served_models

    try:
        models = served_models(settings)
        for model in models:
            resolve_model(model.spec, "weights" if engine else "tokenizer")
            if engine:
                _check_engine(model.settings(settings))
    except (ModelLoadError, ServedModelError) as exc:
        raise CliError(str(exc)) from None
    parallel = [m.name for m in models if engine and _world(m.settings(settings)) > 1]
    if len(parallel) > 1:
        raise CliError(f"models {', '.join(parallel)}: a worker process runs one tensor- or "
                       "pipeline-parallel model; start a worker for each")
    return models


def _world(settings) -> int:  # noqa: ANN001 - Settings, imported lazily
    return settings.tensor_parallel_size * settings.pipeline_parallel_size


def cmd_up(args: argparse.Namespace) -> int:
    from tidegate.commands.launcher import run_up

    settings = _settings(args)
    _check_keys_file(settings.api_keys_file)
    _check_models(settings, engine=True)
    explicit = args.redis_url or os.environ.get("TIDEGATE_REDIS_URL") or os.environ.get("REDIS_URL")
    return run_up(settings, explicit)


def _check_engine(settings) -> None:  # noqa: ANN001 - Settings, imported lazily
    from tidegate.model_files.model_source import resolve_model

    _check_device(settings.device)
    _check_parallel(settings)
    from tidegate.model_files.model_source import ModelLoadError

    if settings.speculative.startswith("draft:"):
        try:
            resolve_model(settings.speculative.removeprefix("draft:"))
        except ModelLoadError as exc:
            raise CliError(f"--speculative {settings.speculative}: {exc}") from None
    if settings.kv_cache_dtype == "fp8" and not settings.device.startswith("cuda"):
        raise CliError(f"--kv-cache-dtype fp8: the FP8 cache needs --device cuda, not "
                       f"{settings.device}")
    if (settings.quantize != "none" and not settings.device.startswith("cuda")
            and settings.dtype not in ("auto", "float32")):
        raise CliError(f"--quantize {settings.quantize}: on the CPU the quantized kernels take "
                       f"float32, not --dtype {settings.dtype}")
    if settings.kv_cache_dtype == "int8" and settings.device != "cpu":
        raise CliError(f"--kv-cache-dtype int8: the 8-bit cache is the CPU's, not "
                       f"{settings.device}'s")


def _check_parallel(settings) -> None:  # noqa: ANN001 - Settings, imported lazily
    """A tensor- or pipeline-parallel worker: the devices, the model's shape, no adapters."""
    if _world(settings) == 1:
        return
    if settings.speculative != "none":
        raise CliError("--speculative: not served by tensor- or pipeline-parallel workers yet")
    from tidegate.model_files.model_source import ModelLoadError
    from tidegate.worker.models.loaders.loader import check_layout
    from tidegate.worker.parallel.layout import LayoutError, ParallelLayout
    from tidegate.worker.parallel.rank_processes import ParallelStartError, check_devices

    if settings.loras:
        raise CliError("--lora: LoRA adapters are not served by tensor- or pipeline-parallel "
                       "workers")
    try:
        layout = ParallelLayout(settings.tensor_parallel_size, settings.pipeline_parallel_size)
        check_devices(layout, settings.device)
        check_layout(settings.model, layout)
    except (LayoutError, ParallelStartError, ModelLoadError) as exc:
        raise CliError(str(exc)) from None


def _check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise CliError(f"--device {device}: no CUDA device is visible to torch "
                       f"{torch.__version__} (a CPU build, or no driver)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise CliError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")


def cmd_worker(args: argparse.Namespace) -> int:
    from tidegate.model_files.model_source import ModelLoadError

    settings = _settings(args)
    _check_models(settings, engine=True)
    # torch (~1.2 s of CPU) only once the arguments are known good: a mistyped flag is
    # answered at once.
    from tidegate.worker.service.adapter_loader import AdapterLoadError
    from tidegate.worker.service.service import serve

    try:
        return asyncio.run(serve(settings))
    except (ModelLoadError, AdapterLoadError) as exc:  # found while loading: a tensor, a
        raise CliError(str(exc)) from None  # format, --quantize, a --lora directory


def cmd_api(args: argparse.Namespace) -> int:
    from tidegate.http.server_options import serve_asgi
    from tidegate.producer.api import create_app

    settings = _settings(args)
    _check_keys_file(settings.api_keys_file)
    _check_models(settings)
    # No access log line per request unless asked for: at thousands of submits/s uvicorn's
    # access log (and the credential filter on it) took ~7% of the API's CPU.
    return serve_asgi(create_app(settings), settings, access_log=args.access_log)


def cmd_gateway(args: argparse.Namespace) -> int:
    from tidegate.http.server_options import serve_asgi
    from tidegate.streaming.gateway import create_app

    settings = _settings(args)
    _check_keys_file(settings.api_keys_file)
    return serve_asgi(create_app(settings), settings)


def cmd_submit(args: argparse.Namespace) -> int:
    from tidegate.producer.errors import InvalidRequest, TidegateError

    try:
        return asyncio.run(_submit(args))
    except InvalidRequest as exc:
        raise CliError("invalid request: " + "; ".join(
            f"{f['field']}: {f['reason']}" for f in exc.fields)) from None
    except TidegateError as exc:
        raise CliError(str(exc), EXIT_FAILED) from None


async def _submit(args: argparse.Namespace) -> int:
    from tidegate.producer.client import Client

    messages = None
    prompt: str | None = args.prompt
    if not args.raw:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = None
    params = {k: v for k, v in {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "stop": args.stop or None,
        "timeout_s": args.timeout, "lane": args.lane, "model": args.model, "lora": args.lora,
    }.items() if v is not None}
    # The key comes from the environment only: argv is visible to every user of the machine.
    async with Client(args.url, api_key=os.environ.get("TIDEGATE_API_KEY") or None) as client:
        handle = await client.submit(prompt, messages=messages, **params)
        if args.stream:
            async for event in handle.events():
                if event.type == "token":
                    print(event.text, end="", flush=True)
            print()
        result = await handle.result()
    if args.json:
        print(result.model_dump_json(indent=2))
    elif not args.stream:
        print(result.text or "")
    if result.status != "done":
        detail = result.error or {}
        print(f"job {result.status}: {detail.get('code', '')} {detail.get('message', '')}",
              file=sys.stderr)
        return EXIT_FAILED
    return 0


def _progress_bar(args: argparse.Namespace, prefix: str, done: int, total: int,
                  unit: str) -> None:
    """One redrawn line on stderr: on a terminal unless --json, or wherever --progress."""
    if not args.json and sys.stderr.isatty() or args.progress:
        width = 30
        bar = "#" * (width * done // total) + "." * (width - width * done // total)
        print(f"\r{prefix}[{bar}] {done}/{total}{unit}", end="" if done < total else "\n",
              file=sys.stderr, flush=True)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from tidegate.model_files.model_source import ModelLoadError

    try:
        text = open(args.text, encoding="utf-8").read()  # noqa: SIM115 - read at once
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read --text {args.text}: {exc}") from None
    if args.context < 2:
        raise CliError("--context must be at least 2 tokens")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise CliError(f"--device {args.device!r}: cpu or cuda[:N]")
    _check_device(args.device)
    from tidegate.model_files.model_source import resolve_model

    try:  # a Hub id is fetched here, before torch is imported
        source = resolve_model(args.model)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    import torch  # after the checks above, as in cmd_worker

    from tidegate.worker.models.loaders.loader import load_model
    from tidegate.worker.models.perplexity import perplexity

    dtype = None if args.dtype in (None, "auto") else getattr(torch, args.dtype, None)
    if args.dtype not in (None, "auto") and not isinstance(dtype, torch.dtype):
        raise CliError(f"--dtype {args.dtype!r}: float32, bfloat16, float16 or auto")
    packed = {"auto": None, "packed": True, "dequantized": False}[args.weights]
    try:
        loaded = load_model(source, device=args.device, dtype=dtype, packed=packed,
                            cpu_activations=args.cpu_activations)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    ids = loaded.tokenizer.encode(text)
    if len(ids) < 2:
        raise CliError(f"--text {args.text} has fewer than 2 tokens: nothing to score")

    def progress(done: int, total: int) -> None:
        _progress_bar(args, "", done, total, " windows")

    result = perplexity(loaded.model, ids, context=args.context, progress=progress)
    types = loaded.packed_types()
    report = {"model": loaded.source.name, "weights": "packed " + "+".join(types) if types
              else f"{next(loaded.model.parameters()).dtype}".removeprefix("torch."),
              "activations": loaded.activations(),
              "weight_mb": round(loaded.weight_bytes() / 1e6, 1), "ppl": result.ppl,
              "nll": result.nll, "tokens_scored": result.tokens_scored,
              "windows": result.windows, "context": result.context,
              "seconds": round(result.seconds, 2)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"perplexity {result.ppl:.4f} over {result.tokens_scored} tokens "
              f"({result.windows} windows of {result.context}; {report['weights']}"
              + (f", {report['activations']} activations" if report["activations"] else "")
              + f", {report['weight_mb']} MB; {result.seconds:.1f} s)")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tidegate.worker.quantization.quantize_options import (
        QuantizeError,
        QuantizeOptions,
        check_options,
    )

    calibration = None
    if args.calibration is not None:
        try:
            calibration = open(args.calibration, encoding="utf-8").read()  # noqa: SIM115
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read --calibration {args.calibration}: {exc}") from None
    group: int | str | None = "auto"
    if args.group_size != "auto":
        try:
            group = int(args.group_size)
        except ValueError:
            raise CliError(f"--group-size {args.group_size!r}: a number, -1 or auto") from None
    if args.context < 2:
        raise CliError("--context must be at least 2 tokens")
    if args.max_windows < 1:
        raise CliError("--max-windows must be at least 1")
    options = QuantizeOptions(method=args.method, group_size=group,
                              symmetric=not args.asymmetric, act_order=args.act_order,
                              format=args.format, calibration=calibration,
                              context=args.context, max_windows=args.max_windows)
    try:
        check_options(options, Path(args.out))
    except QuantizeError as exc:  # before torch is imported, as in cmd_worker
        raise CliError(str(exc)) from None
    from tidegate.worker.quantization.quantize import quantize_model

    def progress(stage: str, done: int, total: int) -> None:
        _progress_bar(args, f"{stage} ", done, total, "")

    try:
        report = quantize_model(args.src, Path(args.out), options, progress)
    except QuantizeError as exc:
        raise CliError(str(exc)) from None
    summary = {"source": report.source, "out": str(report.out), "method": report.method,
               "format": report.format, "bits": report.bits, "group_size": report.group_size,
               "symmetric": report.symmetric, "act_order": report.act_order,
               "linears": report.linears, "calibration_tokens": report.calibration_tokens,
               "mb_written": round(report.bytes_written / 1e6, 1),
               "seconds": round(report.seconds, 1)}
    if args.json:
        print(json.dumps(summary))
    else:
        group_text = "one group per row" if report.group_size == -1 else (
            f"groups of {report.group_size}")
        values = ("fp8 e4m3, a scale per channel" if report.method == "fp8"
                  else f"{report.bits}-bit, {group_text}")
        print(f"wrote {report.out} ({report.format}, {values}, {report.linears} linears, "
              f"{summary['mb_written']} MB, {summary['seconds']} s)")
    return 0


def _add_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="[NAME=]SPEC",
                   help="a model to serve: smollm2 (default) | HF directory | .gguf | Hub "
                        "id (org/name[@REVISION][:QUANT], org/name/FILE.gguf; fetched into "
                        "the Hugging Face cache) | random:<preset>, optionally named "
                        "(NAME=SPEC); repeat it to serve "
                        "several, the first being the default (env TIDEGATE_MODELS, comma list)")
    p.add_argument("--models-file", help="a TOML or JSON file of models to serve, each "
                                         "{name?, spec, aliases?, engine?, loras?} (overrides "
                                         "--model)")


def _add_common(p: argparse.ArgumentParser, *, model: bool = True, serve: bool = True) -> None:
    p.add_argument("--redis-url", help="Redis URL (env TIDEGATE_REDIS_URL or REDIS_URL)")
    if model:
        _add_models(p)
        p.add_argument("--prefix-routing", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="send each job to the worker whose prefix cache holds most of its "
                            "prompt (API), announce the cache and read a stream of its own "
                            "(worker); default on (env TIDEGATE_PREFIX_ROUTING)")
        p.add_argument("--steal-delay-ms", type=int, metavar="MS",
                       help="a worker with a free seat takes jobs that waited this long on "
                            "another worker's stream (default 200)")
    if serve:
        p.add_argument("--host", help="bind address (default 127.0.0.1)")
        p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")


def _add_cpu_activations(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--cpu-activations", choices=["auto", "float", "int8"], default=default,
                   help="what the CPU multiplies packed matrices with: int8 (activations "
                        "rounded per row to 8-bit blocks, integer dot products: llama.cpp's "
                        "numerics, 2-3x faster projections), float (float32: exactly the "
                        "dequantized model's outputs); auto (default): int8")


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--dtype", help="auto (default: float32 on cpu, bfloat16 on cuda), float32, "
                                   "bfloat16, float16")
    p.add_argument("--weights", choices=["auto", "packed", "dequantized"],
                   help="quantized matrices (GGUF; GPTQ, AWQ, compressed-tensors directories): "
                        "kept packed and read by the kernels (auto: GGUF on the CPU, integer "
                        "checkpoints on the CPU and CUDA), or dequantized to --dtype")
    p.add_argument("--quantize", choices=["none", "fp8", "rtn-int8", "rtn-int4"],
                   help="round a float model's projections at load (no calibration; "
                        "`tidegate quantize` writes calibrated checkpoints): fp8 (e4m3, a scale "
                        "per channel; W8A8 on cuda), rtn-int8, rtn-int4 (groups of 128)")
    _add_cpu_activations(p, default=None)
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="split each layer over N processes and devices of this host "
                        "(cuda:0..N-1, or CPU processes; default 1)")
    p.add_argument("--pipeline-parallel-size", type=int, metavar="N",
                   help="split the layers into N stages, each its own processes and devices "
                        "(default 1)")
    p.add_argument("--speculative", metavar="none|ngram|draft:MODEL",
                   help="speculative decoding, verified in the batch: ngram drafts tokens "
                        "from the request's own prompt and output (prompt lookup), "
                        "draft:MODEL with a smaller model that shares the tokenizer (a spec "
                        "as --model takes); default none")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="tokens drafted per request and step (default 4)")
    p.add_argument("--speculative-max-batch", type=int, metavar="N",
                   help="speculate in steps of at most N running requests (default: wherever "
                        "the worker measures it faster than plain decoding)")
    p.add_argument("--max-num-seqs", type=int,
                   help="requests batched at once (default 32 on cpu, 1024 on cuda)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per engine step: decodes plus prompt chunks (default 512 on "
                        "cpu, 8192 on cuda)")
    p.add_argument("--max-step-ms", type=float, metavar="MS",
                   help="a step that decodes takes about this long at most: prompt chunks "
                        "beside its decodes sized to fit (default: off)")
    p.add_argument("--kv-cache-gb", type=float,
                   help="KV cache size (default 2 GiB on cpu, 90%% of free memory on cuda)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"],
                   help="KV cache element: auto (the model's dtype), fp8 (e4m3, cuda: twice "
                        "the tokens in the same memory) or int8 (cpu: 8-bit heads with a "
                        "scale each, 3.8x float32's tokens, a third of the attention's reads)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False,
                   help="cuda: run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--lora", action="append", metavar="NAME=PATH",
                   help="a LoRA adapter (PEFT directory) of the first model, loaded at start "
                        "and registered for the API (repeatable)")
    p.add_argument("--max-loras", type=int,
                   help="LoRA adapters resident on the device at once (default 4; 0: off)")
    p.add_argument("--max-lora-rank", type=int, help="the largest adapter rank, 1..64 "
                                                     "(default 16)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidegate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tidegate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("up", help="run Redis, a worker, the API and the gateway locally")
    _add_common(p)
    _add_engine(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("worker", help="pull jobs from Redis and generate")
    _add_common(p, serve=False)
    _add_engine(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("api", help="serve the HTTP API")
    _add_common(p)
    p.add_argument("--access-log", action="store_true",
                   help="log one line per request (uvicorn's access log; off by default)")
    p.set_defaults(func=cmd_api)

    p = sub.add_parser("gateway", help="serve the WebSocket gateway")
    _add_common(p, model=False)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("submit", help="submit a job and print its answer")
    p.add_argument("prompt", help="the user message (or the raw prompt with --raw)")
    p.add_argument("--url", default=os.environ.get("TIDEGATE_URL", "http://127.0.0.1:8000"),
                   help="the API's base URL (env TIDEGATE_URL); API key: env TIDEGATE_API_KEY")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--raw", action="store_true", help="send a plain prompt, no chat template")
    p.add_argument("--system", help="a system message")
    p.add_argument("--max-tokens", type=int, help="the most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, help="0 (default): greedy; up to 2")
    p.add_argument("--top-p", type=float, help="nucleus sampling's probability mass (default 1)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default 0: "
                                             "off)")
    p.add_argument("--seed", type=int, help="the sampler's random seed")
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--timeout", type=float, help="seconds until the job's deadline")
    p.add_argument("--lane", choices=["interactive", "batch"],
                   help="the lane it waits in (default interactive)")
    p.add_argument("--model", help="a served model's name or alias, or BASE:ADAPTER "
                                   "(default: the deployment's first model)")
    p.add_argument("--lora", help="a LoRA adapter registered on the model")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("queue", help="inspect the job queue")
    queue_sub = p.add_subparsers(dest="queue_command", required=True, metavar="SUBCOMMAND")
    q = queue_sub.add_parser(
        "stats", help="per model and lane: length, lag, pending, consumers, oldest job; "
                      "live workers and their models")
    q.add_argument("--redis-url", help="default: env TIDEGATE_REDIS_URL or REDIS_URL, "
                                      "else redis://127.0.0.1:6379/0")
    q.add_argument("--partitions", type=int,
                   help="lane partitions to read (default: TIDEGATE_LANE_PARTITIONS, 1)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=cmd_queue_stats)

    p = sub.add_parser("batch", help="offline batches: JSONL in, JSONL out")
    batch_sub = p.add_subparsers(dest="batch_command", required=True, metavar="SUBCOMMAND")
    b = batch_sub.add_parser("submit", help="submit a JSONL file of requests; prints its id")
    b.add_argument("file", help="OpenAI Batch-style lines: {custom_id, body}; - for stdin")
    b = batch_sub.add_parser("status", help="progress of a batch")
    b.add_argument("batch_id", help="the id batch submit printed")
    b.add_argument("--wait", action="store_true", help="follow the progress bar to the end")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b = batch_sub.add_parser("results", help="one output line per input line, in input order")
    b.add_argument("batch_id", help="the id batch submit printed")
    b.add_argument("-o", "--output", help="file to write (default: stdout)")
    b = batch_sub.add_parser("cancel", help="cancel a batch's unfinished lines")
    b.add_argument("batch_id", help="the id batch submit printed")
    for b in batch_sub.choices.values():
        b.add_argument("--redis-url", help="default: env TIDEGATE_REDIS_URL or REDIS_URL")
        b.set_defaults(func=cmd_batch)

    p = sub.add_parser("eval-ppl", help="perplexity of a model over a text file")
    p.add_argument("model", help="smollm2 | HF directory | .gguf | Hub id | random:<preset>")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--context", type=int, default=512,
                   help="tokens per window; the second half of each is scored (default 512)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", help="auto (default), float32, bfloat16, float16")
    p.add_argument("--weights", choices=["auto", "packed", "dequantized"], default="auto",
                   help="quantized matrices packed (auto: where a kernel reads them) or "
                        "dequantized")
    _add_cpu_activations(p, default="auto")
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    p.add_argument("--progress", action="store_true", help="a progress bar even off a terminal")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=cmd_eval_ppl)

    p = sub.add_parser("quantize", help="write a quantized checkpoint of a model")
    p.add_argument("src", help="HF model directory | .gguf | Hub id | smollm2")
    p.add_argument("out", help="directory to write (new or empty)")
    p.add_argument("--method", required=True,
                   choices=["rtn-int8", "rtn-int4", "gptq-int8", "gptq-int4", "awq-int4", "fp8"],
                   help="rtn: round to nearest; gptq, awq: GPTQ or AWQ on --calibration text; "
                        "fp8: e4m3 with a scale per channel (compressed-tensors float-quantized, "
                        "activations per token at run time)")
    p.add_argument("--format", choices=["compressed-tensors", "gptq", "awq"],
                   default="compressed-tensors",
                   help="checkpoint layout (default compressed-tensors: pack-quantized, or "
                        "float-quantized for fp8; awq: AutoAWQ's GEMM layout, 4-bit groups)")
    p.add_argument("--group-size", default="auto",
                   help="columns per scale: auto (int4: 128, 64 or 32, whichever divides "
                        "every projection; int8: per channel), N, or -1 (per channel)")
    p.add_argument("--asymmetric", action="store_true", help="zero points (default symmetric)")
    p.add_argument("--act-order", action="store_true",
                   help="GPTQ: quantize the most active columns first (needs --format gptq)")
    p.add_argument("--calibration", help="UTF-8 text file (gptq and awq methods)")
    p.add_argument("--context", type=int, default=512, help="calibration window (tokens)")
    p.add_argument("--max-windows", type=int, default=64, help="calibration windows at most")
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    p.add_argument("--progress", action="store_true", help="a progress bar even off a terminal")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("pull", help="fetch models from the Hugging Face Hub into its cache "
                                    "(ahead of a start: images, init containers)")
    p.add_argument("specs", nargs="*", metavar="MODEL",
                   help="Hub ids (org/name[@REVISION][:QUANT], org/name/FILE.gguf) or any "
                        "--model spec; none: every model --model, --models-file, "
                        "TIDEGATE_MODELS or TIDEGATE_MODEL serve, and a draft model")
    _add_models(p)
    p.add_argument("--tokenizer-only", action="store_true",
                   help="only what the API reads: tokenizer and config (a GGUF: its header)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("models", help="the models in the Hugging Face cache: name, revision, "
                                      "format, size on disk")
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("batch-worker", help="run batches (an arq worker; needs a real Redis)")
    p.add_argument("--redis-url", help="default: env TIDEGATE_REDIS_URL or REDIS_URL")
    p.add_argument("--status-port", type=int, default=9401,
                   help="/healthz and /readyz on TIDEGATE_HOST (default 9401; 0: off)")
    _add_models(p)
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=cmd_batch_worker)
    return parser


def cmd_pull(args: argparse.Namespace) -> int:
    from tidegate.model_files.model_source import ModelLoadError, resolve_model
    from tidegate.model_files.served_model import ServedModelError, served_models

    specs = list(args.specs)
    if not specs:
        settings = _settings(args)
        try:
            specs = [m.spec for m in served_models(settings)]
        except ServedModelError as exc:
            raise CliError(str(exc)) from None
        if settings.speculative.startswith("draft:"):
            specs.append(settings.speculative.removeprefix("draft:"))
    need = "tokenizer" if args.tokenizer_only else "weights"
    for spec in dict.fromkeys(specs):
        try:
            source = resolve_model(spec, need)
        except ModelLoadError as exc:
            raise CliError(str(exc)) from None
        print(f"{spec}: {source.path if source.path is not None else source.name}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from tidegate.model_files.hub_cache import cache_dir, cached_models, human_size

    models = cached_models()
    if args.json:
        for m in models:
            print(json.dumps({"name": m.repo_id, "revision": m.revision, "format": m.format,
                              "size_bytes": m.size_bytes, "path": str(m.path)}))
        return 0
    if not models:
        print(f"no models in the Hugging Face cache {cache_dir()}", file=sys.stderr)
        return 0
    rows = [("NAME", "REVISION", "FORMAT", "SIZE")] + [
        (m.repo_id, m.revision, m.format, human_size(m.size_bytes)) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
              + "   " + row[3])
    return 0


def cmd_queue_stats(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from tidegate.operations.queue_stats import ROUTED, queue_stats
    from tidegate.redis_conn import connect

    settings = _settings(args)
    partitions = args.partitions if args.partitions is not None else settings.lane_partitions
    if partitions < 1:
        raise CliError(f"--partitions: must be at least 1, got {partitions}")

    async def snapshot() -> dict:
        redis = connect(settings.redis_url)
        try:  # the models Redis names: no model file is needed to look at the queue
            return (await queue_stats(redis, partitions)).to_dict()
        finally:
            await redis.aclose()

    try:
        stats = asyncio.run(snapshot())
    except (RedisError, OSError) as exc:
        raise _redis_failure(settings, exc, "cannot read the queue from Redis") from None
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    now_ms = stats["taken_ms"]
    width = max([len(lane["model"]) for lane in stats["lanes"]] + [5])
    print(f"{'model':<{width}} {'lane':<12} {'part':>4} {'length':>7} {'lag':>6} {'pending':>7} "
          f"{'consumers':>9}  oldest waiting")
    for lane in stats["lanes"]:
        oldest = lane["oldest_waiting_s"]
        part = "rtd" if lane["partition"] == ROUTED else lane["partition"]
        print(f"{lane['model']:<{width}} {lane['lane']:<12} {part:>4} "
              f"{lane['length']:>7} {lane['lag']:>6} {lane['pending']:>7} "
              f"{lane['consumers']:>9}  {'-' if oldest is None else f'{oldest:.1f} s'}")
    workers = stats["workers"]
    print(f"\nworkers: {len(workers)} live (heartbeat within the last "
          f"{WORKER_HEARTBEAT_TTL_S} s)")
    if workers:
        print(f"{'worker':<28} {'model':<{width}} {'running':>7} {'waiting':>7} {'tok/s':>8} "
              f"{'KV used':>8} {'prefix hits':>11}  adapters")
        for w in workers:
            print(f"{w['worker_id']:<28} {w['model'] or '-':<{width}} {w['running']:>7} "
                  f"{w['waiting']:>7} {w['tokens_per_s']:>8.1f} {100 * w['kv_usage']:>7.0f}% "
                  f"{100 * w['prefix_hit_rate']:>10.0f}%  {', '.join(w['adapters']) or '-'}")
    print(f"total: {stats['running']} running, {stats['tokens_per_s']} tok/s "
          f"(at {time.strftime('%H:%M:%S', time.localtime(now_ms / 1000))})")
    return 0


def _batch_redis(args: argparse.Namespace):  # -> (Settings, redis)
    from tidegate.redis_conn import connect

    settings = _settings(args)
    return settings, connect(settings.redis_url)


def _redis_failure(settings, exc: Exception, what: str = "cannot reach Redis") -> CliError:  # noqa: ANN001
    """Exit 1 naming the host and port only: the URL may hold a password."""
    netloc = settings.redis_url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    where = netloc if ":" in netloc or "," in netloc else f"{netloc}:6379"
    return CliError(f"{what} at {where} ({type(exc).__name__}: {exc})", EXIT_FAILED)


def _batch_id(raw: str) -> str:
    from tidegate.keys import BATCH_ID_RE

    if not BATCH_ID_RE.match(raw):
        raise CliError(f"batch id: {raw!r} is not a batch id (batch_ and 32 hex digits)")
    return raw


def cmd_batch(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from tidegate.producer.batches import batch

    settings, redis = _batch_redis(args)

    async def run() -> int:
        try:
            return await _batch_command(args, redis, batch)
        finally:
            await redis.aclose()

    try:
        return asyncio.run(run())
    except batch.BatchInputError as exc:
        raise CliError(f"{args.file}: {exc}") from None
    except (RedisError, OSError) as exc:
        raise _redis_failure(settings, exc) from None


async def _batch_command(args: argparse.Namespace, redis, batch) -> int:  # noqa: ANN001
    if args.batch_command == "submit":
        try:
            text = sys.stdin.read() if args.file == "-" else open(args.file).read()  # noqa: SIM115
        except OSError as exc:
            raise CliError(f"{args.file}: {exc.strerror}") from None
        batch_id = await batch.submit(redis, text)
        print(batch_id)
        return 0
    batch_id = _batch_id(args.batch_id)
    if args.batch_command == "cancel":
        state = await batch.cancel(redis, batch_id)
    else:
        state = await batch.status(redis, batch_id)
    if state is None:
        raise CliError(f"batch {batch_id} not found (unknown, or past its retention)",
                       EXIT_FAILED)
    if args.batch_command == "results":
        try:
            lines = await batch.results(redis, batch_id)
        except RuntimeError as exc:
            raise CliError(str(exc), EXIT_FAILED) from None
        text = "".join(line + "\n" for line in lines)
        if args.output in (None, "-"):
            sys.stdout.write(text)
        else:
            with open(args.output, "w") as out:
                out.write(text)
            print(f"{len(lines)} lines ({state.failed} errors) -> {args.output}",
                  file=sys.stderr)
        return 0
    quiet = getattr(args, "json", False)  # --json --wait: only the final object
    while args.batch_command == "status" and args.wait and state.status not in (
            "completed", "cancelled"):
        if not quiet:
            _progress(state, end="\r")
        await asyncio.sleep(0.5)
        state = await batch.status(redis, batch_id) or state
    if getattr(args, "json", False):
        print(json.dumps(state.to_dict()))
    else:
        _progress(state)
    return 0


def _progress(state, end: str = "\n") -> None:  # noqa: ANN001
    width = 30
    filled = width * state.done // max(state.total, 1)
    bar = "#" * filled + "-" * (width - filled)
    print(f"{state.batch_id} [{bar}] {state.done}/{state.total} "
          f"({state.failed} failed) {state.status}", end=end, flush=True)


def cmd_batch_worker(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from tidegate.model_files.model_catalog import ModelCatalog
    from tidegate.operations.status_server import StatusServer
    from tidegate.producer.batches.batch_worker import make_worker, redis_check

    settings = _settings(args)
    catalog = ModelCatalog(_check_models(settings))
    status = None
    if args.status_port:  # /healthz, /readyz (Redis answers) for probes
        status = StatusServer(settings.host, args.status_port,
                              check=redis_check(settings.redis_url))
        if not status.start():
            status = None
    try:
        while True:
            try:
                make_worker(settings.redis_url, catalog,  # returns on SIGTERM / SIGINT
                            partitions=settings.lane_partitions).run()
                return 0
            except (RedisError, OSError) as exc:
                # arq's worker ends when its Redis connection breaks (a Redis restart): start a
                # new one; unfinished steps are rerun from the queue.
                logging.getLogger("tidegate.batch").warning(
                    "batch worker lost Redis (%s); starting again in 1 s", type(exc).__name__)
                time.sleep(1.0)
    finally:
        if status is not None:
            status.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = (getattr(args, "log_level", None) or os.environ.get("TIDEGATE_LOG_LEVEL", "INFO"))
    REDACTOR.install()  # before the first record: no key or token reaches any log
    REDACTOR.install_excepthooks()
    if level.upper() == "TRACE":  # uvicorn's protocol traces, below DEBUG
        logging.addLevelName(TRACE_LOG_LEVEL, "TRACE")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2"):  # one line per request is noise here (httpx2: the Hub)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)  # warnings too go through the handlers, so the redactor
    try:
        return args.func(args)
    except CliError as exc:
        print(f"tidegate: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tidegate queue stats --json | head`: the reader left
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - nothing more may reach the pipe
        return 0


if __name__ == "__main__":
    sys.exit(main())
