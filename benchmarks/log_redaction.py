"""What the log redactor costs per record: the lines a gateway and an API write, without and with it.

Each line kind is logged ``--records`` times through a real handler (``tidegate.cli``'s format,
into memory), best of ``--repeats`` runs; first with the standard record factory, then with
``tidegate.log_redactor`` installed (two configured keys and 16,384 remembered stream tokens,
as a busy API holds). Kinds: what the gateway logs at INFO for every WebSocket watcher (uvicorn's
``[accepted]`` line, with and without a ``?token=``, and ``connection open``), an access line,
and a DEBUG frame line with an ``api_key`` (websockets' frame log).

    python benchmarks/log_redaction.py                      # prints a Markdown table
    python benchmarks/log_redaction.py --records 20000 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import time

from websockets.frames import Frame, Opcode

JOB = "34a705a1089b40838dd808648fa64ec6"
TOKEN = "X40jRy92J_cYeatXA50wUWkEh6DisWTnghdcrlgkHCQ"
LINES: dict[str, tuple[str, tuple[object, ...]]] = {
    "accepted, ?token=": ('%s - "WebSocket %s" [accepted]',
                          ("127.0.0.1:50500", f"/v1/jobs/{JOB}/stream?token={TOKEN}")),
    "accepted, header key": ('%s - "WebSocket %s" [accepted]',
                             ("127.0.0.1:50500", f"/v1/jobs/{JOB}/stream")),
    "connection open": ("connection open", ()),
    "access line": ('%s - "%s %s HTTP/%s" %d', ("127.0.0.1:50500", "GET", f"/v1/jobs/{JOB}",
                                               "1.1", 200)),
    "DEBUG frame with api_key": ("< %s", (Frame(Opcode.TEXT, json.dumps(
        {"type": "generate", "request": {"prompt": "hi"}, "api_key": "tg-k-" + "0" * 27}
    ).encode()),)),
}


def per_record_us(logger: logging.Logger, line: tuple[str, tuple[object, ...]], records: int,
                  repeats: int) -> float:
    fmt, args = line
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(records):
            logger.info(fmt, *args)
        best = min(best, time.perf_counter() - start)
    return best / records * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logger = logging.getLogger("bench.uvicorn.error")
    logger.propagate = False
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    off = {k: per_record_us(logger, v, args.records, args.repeats) for k, v in LINES.items()}

    from tidegate.auth import Auth, new_stream_token
    from tidegate.log_redactor import RECENT_MAX, REDACTOR

    REDACTOR.install()
    Auth(["tg-alpha-3f9c1e7a5b2d4f6081a9c3e5", "tg-bravo-8d2b6f0a4c1e3b5d7f9a0c2e"])
    for _ in range(RECENT_MAX):
        new_stream_token()
    on = {k: per_record_us(logger, v, args.records, args.repeats) for k, v in LINES.items()}
    print("| line | without (us/record) | with the redactor (us/record) | added (us) |")
    print("|---|---:|---:|---:|")
    for kind in LINES:
        print(f"| {kind} | {off[kind]:.1f} | {on[kind]:.1f} | {on[kind] - off[kind]:.1f} |")


if __name__ == "__main__":
    main()
