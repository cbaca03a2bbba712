"""The log redactor: records as uvicorn, websockets and our code log them, through real
formatters, come out whole and without a key, a token or anything derived from them."""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator

import pytest
from uvicorn.logging import AccessFormatter, DefaultFormatter
from websockets.frames import Frame, Opcode

from tidegate.http.auth import Auth, new_stream_token, tenant_of, token_hash
from tidegate.log_redactor import REDACTED, REDACTOR

KEY = "tg-alpha-3f9c1e7a5b2d4f6081a9c3e5"
OTHER = "tg-bravo-8d2b6f0a4c1e3b5d7f9a0c2e"
WRONG = "tg-nobody-0000000000000000000000"  # configured nowhere: only patterns can hide it


@pytest.fixture(autouse=True)
def redacting() -> None:
    REDACTOR.install()  # what every tidegate process does first
    Auth([KEY, OTHER])  # what an API or gateway does with its keys


@pytest.fixture
def output() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger named like uvicorn's error log, with uvicorn's formatter, into a string."""
    yield from _logger("uvicorn.error", DefaultFormatter("%(message)s", use_colors=False))


def _logger(name: str, formatter: logging.Formatter,
            ) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    logger, stream = logging.getLogger(name), io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def pieces(secret: str, n: int = 8) -> list[str]:
    """Every run of ``n`` characters of ``secret``: none may show, not just the whole."""
    return [secret[i:i + n] for i in range(len(secret) - n + 1)]


def test_an_access_line_with_a_token_is_kept_and_the_token_hidden() -> None:
    # uvicorn's access formatter unpacks the record's five arguments: a redactor that
    # rewrote the message and dropped them lost the line ("not enough values to unpack").
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", stderr)  # where logging reports a record it failed to format
        for logger, stream in _logger("uvicorn.access", AccessFormatter(
                '%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False)):
            logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5050", "GET",
                        "/v1/jobs/abc/events?token=tok-1234567890abcdef&last_event_id=2",
                        "1.1", 200)
            line = stream.getvalue()
    assert line == ('127.0.0.1:5050 - "GET /v1/jobs/abc/events?token=[redacted]&last_event_id=2 '
                    'HTTP/1.1" 200 OK\n')
    assert stderr.getvalue() == ""


@pytest.mark.parametrize("path", [
    "/v1/jobs/abc/events?last_event_id=7&token=",  # empty: the next word looks like its value
    f"/v1/jobs/abc/events?token= {KEY}",
    "/v1/jobs/abc/events?token=%20tok-1234567890abcdef",
])
def test_an_access_line_whose_token_spans_its_arguments_is_kept_hidden(path: str) -> None:
    # Found by the fuzzer: scrubbing the whole line hid more than scrubbing each argument
    # (``token=`` then ``HTTP/1.1``), and the fallback dropped the arguments uvicorn unpacks.
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", stderr)
        for logger, stream in _logger("uvicorn.access", AccessFormatter(
                '%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False)):
            logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5050", "GET", path, "1.1", 403)
            line = stream.getvalue()
    assert stderr.getvalue() == ""
    assert line.endswith('" 403 Forbidden\n') and KEY not in line and "tok-1234" not in line


@pytest.mark.parametrize("value", [
    f"Bearer {KEY}", f"bearer {WRONG}", f"Basic {base64.b64encode(f'me:{WRONG}'.encode()).decode()}",
    f"Token {WRONG}", f"Bearer {KEY},{WRONG}", f"Bearer {KEY} {WRONG}", WRONG])
@pytest.mark.parametrize("header", ["Authorization", "authorization", "X-Api-Key",
                                    "Proxy-Authorization", "Sec-WebSocket-Protocol"])
def test_a_handshake_header_shows_no_credential_of_any_scheme(
        output: tuple[logging.Logger, io.StringIO], header: str, value: str) -> None:
    logger, stream = output
    logger.debug("< %s: %s", header, value)  # as websockets logs a handshake at DEBUG
    assert stream.getvalue() == f"< {header}: {REDACTED}\n"


@pytest.mark.parametrize("frame", [
    {"type": "generate", "api_key": WRONG, "request": {"prompt": "hi"}},
    {"type": "resume", "job_id": "a" * 32, "token": WRONG},
    # long: websockets shows the start and the end, and the key sits at the end
    {"type": "generate", "request": {"prompt": "x" * 500}, "api_key": WRONG},
    {"type": "accepted", "id": "a" * 32, "status": "queued", "stream_token": WRONG},
])
def test_a_logged_websocket_frame_shows_no_part_of_a_key_or_token(
        output: tuple[logging.Logger, io.StringIO], frame: dict) -> None:
    logger, stream = output
    logger.debug("< %s", Frame(Opcode.TEXT, json.dumps(frame).encode()))
    line = stream.getvalue()
    assert line.startswith("< TEXT ") and REDACTED in line
    assert [p for p in pieces(WRONG) if p in line] == []


def test_a_fragment_of_a_message_is_not_shown(output: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = output
    # the key is split across two frames: neither half carries a name a pattern could find
    message = json.dumps({"type": "generate", "api_key": WRONG}).encode()
    logger.debug("< %s", Frame(Opcode.TEXT, message[:40], fin=False))
    assert [p for p in pieces(WRONG) if p in stream.getvalue()] == []
    assert "a fragment: not shown" in stream.getvalue()


def test_known_keys_and_tokens_are_hidden_wherever_they_appear(
        output: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = output
    token = new_stream_token()
    basic = base64.b64encode(f"someone:{KEY}".encode()).decode()
    secrets = [KEY, OTHER, token, token_hash(token), tenant_of(KEY), tenant_of(OTHER)]
    logger.info("keys %s %r, token %s (hash %s), tenants %s/%s, basic %s", KEY, [OTHER],
                token, token_hash(token), tenant_of(KEY), tenant_of(OTHER), basic)
    try:
        raise ValueError(f"no such key: {KEY!r} (credentials {basic})")
    except ValueError:
        logger.exception("request failed")
    text = stream.getvalue()
    assert [s for s in secrets if s in text] == []
    # Inside base64 ("user:key" in a Basic header logged raw): what is left around the hidden
    # middle is the user and at most the key's two first and last characters.
    before, after = re.search(r"basic (\S*)\[redacted\](\S*)", text).groups()  # type: ignore[union-attr]
    assert base64.b64decode(before).startswith(b"someone:") and len(before) <= 12
    assert len(base64.b64decode(after)) <= 2
    assert "request failed\nTraceback" in text and "ValueError: no such key" in text


def test_a_key_is_hidden_in_every_escaping_and_beside_a_longer_one(
        output: tuple[logging.Logger, io.StringIO]) -> None:
    odd, short, longer = 'tg-"odd\\key/é 1', "tg-shared-prefix-01", "tg-shared-prefix-01-and-more"
    Auth([odd, short, longer])
    logger, stream = output
    logger.info("%s | %r | %s | %s | %s", json.dumps({"k": odd}), {"k": odd},
                urllib.parse.quote(odd, safe=""), longer, short)
    text = stream.getvalue()
    assert text == " | ".join([f'{{"k": "{REDACTED}"}}', f"{{'k': '{REDACTED}'}}", REDACTED,
                               REDACTED, REDACTED]) + "\n"


def test_arguments_keep_their_number_and_their_repr(
        output: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = output
    logger.debug("headers %r, status %d", [(b"authorization", f"Basic {WRONG}".encode())], 401)
    assert stream.getvalue() == f"headers [(b'authorization', b'{REDACTED}')], status 401\n"
    record = logging.getLogRecordFactory()("x", logging.INFO, __file__, 1, "%s %d", ("a", 1), None)
    assert (record.msg, record.args) == ("%s %d", ("a", 1))  # nothing to hide: untouched


def test_offered_subprotocols_are_hidden(output: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = output
    logger.debug("ASGI [1] Started scope=%s", {"type": "websocket", "path": "/v1/stream",
                                                "subprotocols": ["tidegate", WRONG]})
    assert stream.getvalue() == ("ASGI [1] Started scope={'type': 'websocket', 'path': "
                                 f"'/v1/stream', 'subprotocols': [{REDACTED}]}}\n")


def test_a_secret_spread_over_format_and_argument_is_hidden(
        output: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = output
    logger.warning("GET /stream?token=%s refused", WRONG)
    logger.warning("redis at %s", "redis://user:hunter2-pw@cache:6379/0")
    assert stream.getvalue() == (f"GET /stream?token={REDACTED} refused\n"
                                 f"redis at redis://user:{REDACTED}@cache:6379/0\n")


def test_an_uncaught_exception_shows_no_key() -> None:
    program = ("from tidegate.log_redactor import REDACTOR; REDACTOR.install_excepthooks(); "
               f"REDACTOR.add_secret({KEY!r}); import threading; "
               f"t = threading.Thread(target=lambda: 1 / 0 if False else int({KEY!r})); "
               f"t.start(); t.join(); raise RuntimeError('authorization: Bearer {WRONG}')")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1
    assert "Exception in thread" in done.stderr and "RuntimeError: authorization:" in done.stderr
    assert KEY not in done.stderr and WRONG not in done.stderr
