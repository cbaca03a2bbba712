"""What the log redactor costs per record: the lines a gateway and an API write, without and with it.

Each line kind is logged ``--records`` times through a real handler (``tidegate.commands.cli``'s format,
into memory), best of ``--repeats`` runs; first with the standard record factory, then with
``tidegate.log_redactor`` installed (``--keys`` configured keys, two by default, and 16,384
remembered stream tokens, as a busy API holds). Times are CPU time of this process. Kinds: what the gateway logs at INFO for every WebSocket watcher (uvicorn's
``[accepted]`` line, with and without a ``?token=``, and ``connection open``), an access line,
and a DEBUG frame line with an ``api_key`` (websockets' frame log).

    python -m tidegate.benchmarks.serving.log_redaction                      # prints a Markdown table
    python -m tidegate.benchmarks.serving.log_redaction --keys 1000                # a keys file of 1,000 tenants
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import secrets
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
        start = time.process_time()  # CPU time: steadier than wall time on a shared machine
        for _ in range(records):
            logger.info(fmt, *args)
        best = min(best, time.process_time() - start)
    return best / records * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keys", type=int, default=2, help="configured API keys")
    args = parser.parse_args()
    logger = logging.getLogger("bench.uvicorn.error")
    logger.propagate = False
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    off = {k: per_record_us(logger, v, args.records, args.repeats) for k, v in LINES.items()}

    from tidegate.http.auth import Auth, new_stream_token
    from tidegate.log_redactor import RECENT_MAX, REDACTOR

    REDACTOR.install()
    start = time.process_time()
    Auth([f"tg-{n:04d}-{secrets.token_urlsafe(24)}" for n in range(args.keys)])
    REDACTOR.scrub("")  # builds the pattern of every key's spellings
    print(f"{args.keys} keys: pattern built in {time.process_time() - start:.2f} s CPU\n")
    for _ in range(RECENT_MAX):
        new_stream_token()
    on = {k: per_record_us(logger, v, args.records, args.repeats) for k, v in LINES.items()}
    print("| line | without (us/record) | with the redactor (us/record) | added (us) |")
    print("|---|---:|---:|---:|")
    for kind in LINES:
        print(f"| {kind} | {off[kind]:.1f} | {on[kind]:.1f} | {on[kind] - off[kind]:.1f} |")


if __name__ == "__main__":
    main()
