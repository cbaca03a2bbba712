"""Keeps secrets out of every log line: API keys, stream tokens and what is derived from them.

``LogRedactor`` rewrites each log record as it is made (a log-record factory), so every handler
sees the redacted record: the root handler, uvicorn's (which replaces its handlers at start-up),
a test's capture, any installed later. Two layers:

* patterns that find a credential by its context, whatever its value, so an unknown or
  malformed key is hidden too: an ``Authorization`` header of any scheme (``Bearer``,
  ``Basic``, ``Token``, several keys, the whole value), ``x-api-key``, ``Cookie``,
  ``Sec-WebSocket-Protocol`` (and the ``subprotocols`` of an ASGI scope), and fields or parameters named ``api_key``, ``token``,
  ``stream_token``, ``password``, ``secret`` (``?token=``, JSON, ``repr()`` of a dict or of
  bytes, escaped quotes), and the password in a Redis URL;
* the known values themselves: the configured keys and what is derived from them (their digest,
  the tenant id), each also as JSON, ``repr()``, URL-quoted and inside base64 (``Basic``
  credentials), kept for the process's life; and the stream tokens this process minted or was
  shown, with their hashes (the most recent ``RECENT_MAX``).

websockets cuts a frame short when it logs one (the start and the end of the payload), which
could leave a piece of a key no pattern recognises: a frame is redacted whole before it is cut,
and a fragment of a message (whose other part is in another frame) is not shown at all.
The entry point (``tidegate.commands.cli``) also sends uncaught exceptions (``sys.excepthook``,
``threading.excepthook``) through the same scrub.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re
import sys
import threading
import traceback
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterable
from types import TracebackType
from typing import Any

REDACTED = "[redacted]"
RECENT_MAX = 16384  # stream tokens and hashes remembered (~3 MB); the patterns cover the rest
RECENT_LEN = (16, 128)  # what a remembered value may measure: a token, a hash (not a word)
MIN_SECRET_LEN = 4  # shorter values would redact ordinary words; no real key is that short

_QUOTE = r"\\*['\"]"  # a quote, escaped any number of times (JSON inside repr inside JSON ...)
# Header-like names: the value is everything up to the end of the line or a closing quote
# (a scheme, then one credential or several, separated by commas or spaces).
_HEADER = re.compile(
    r"(?i)(?<![a-z0-9])((?:proxy-)?authorization|cookie|x-api-key|sec-websocket-protocol)"
    rf"((?:{_QUOTE})?\s*(?:[:=]|,)\s*(?:b?(?P<q>{_QUOTE}))?)(?![\s'\"\\\\b]*\[redacted\])"
    r"(?(q)[^'\"\\\r\n]*|[^'\"\\\r\n]+)")
# Field-like names: the value is one word (up to a quote, a separator or white space).
_FIELD = re.compile(
    r"(?i)(?<![a-z0-9])(api[_-]?key|(?:stream_|access_|refresh_)?token(?:_hash)?|password"
    rf"|secret)((?:{_QUOTE})?\s*[:=]\s*(?:b?(?P<q>{_QUOTE}))?)(?![\s'\"\\\\b]*\[redacted\])"
    r"(?(q)[^'\"\\\r\n]*|[^\s'\"\\&,;)}\]]+)")
# The subprotocols a WebSocket client offered, as a list (uvicorn's ASGI scope at TRACE): a
# browser that cannot set headers may carry a key there.
_SUBPROTOCOLS = re.compile(r"(?i)(subprotocols['\"]?\s*[:=]\s*)\[[^\]\r\n]+\]")
_URL_PASSWORD = re.compile(r"(?i)\b((?:rediss?|unix)://[^:/@\s]*:)[^@\s]+(?=@)")
_KEEP_NAME = rf"\1\2{REDACTED}"
# Every name each pattern looks for contains one of its words (lower case).
_HEADER_WORDS = ("authorization", "cookie", "x-api-key", "sec-websocket-protocol")
_FIELD_WORDS = ("key", "token", "password", "secret")
# Where a remembered token or hash may stand: a word of URL-safe base64 (tokens) or hex.
_WORD = re.compile(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{%d,%d}(?![A-Za-z0-9_-])"  # noqa: UP031
                   % RECENT_LEN)


class LogRedactor:
    """The secrets this process knows and the scrub that hides them, in text and log records."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._secrets: set[str] = set()  # every spelling of every lasting secret
        self._secrets_re: re.Pattern[str] | None = None
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._installed = False

    # ------------------------------------------------------------ what is secret

    def add_secret(self, value: str) -> None:
        """A value hidden for the life of the process (an API key, or what derives from it)."""
        if len(value) < MIN_SECRET_LEN:
            return
        spellings = _spellings(value) - self._secrets
        if spellings:
            with self._lock:
                self._secrets |= spellings
                self._secrets_re = None  # built again at the next scrub (once for many keys)

    def _known(self) -> re.Pattern[str] | None:
        pattern = self._secrets_re
        if pattern is None and self._secrets:
            with self._lock:
                # One trie-shaped pattern: its cost per line hardly grows with the number of
                # keys (an alternation of 4,000 spellings took 330 us a line, this 1.3 us).
                pattern = self._secrets_re = re.compile(_trie_pattern(self._secrets))
        return pattern

    def add_recent(self, value: str) -> None:
        """A stream token or a hash this process minted or was shown (remembered while recent)."""
        if not RECENT_LEN[0] <= len(value) <= RECENT_LEN[1]:
            return
        with self._lock:
            self._recent[value] = None
            self._recent.move_to_end(value)
            while len(self._recent) > RECENT_MAX:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------ scrubbing

    def scrub(self, text: str) -> str:
        """``text`` with every credential it holds replaced by ``[redacted]``."""
        lowered = text.lower()  # most lines name no credential: a few substring tests say so
        if any(word in lowered for word in _HEADER_WORDS):
            text = _HEADER.sub(_KEEP_NAME, text)
        if any(word in lowered for word in _FIELD_WORDS):
            text = _FIELD.sub(_KEEP_NAME, text)
        if "subprotocols" in lowered:
            text = _SUBPROTOCOLS.sub(rf"\1[{REDACTED}]", text)
        if "://" in lowered:
            text = _URL_PASSWORD.sub(rf"\1{REDACTED}", text)
        known = self._known()
        if known is not None:
            text = known.sub(REDACTED, text)
        if self._recent:
            recent = self._recent
            text = _WORD.sub(lambda m: REDACTED if m.group() in recent else m.group(), text)
        return text

    def redact_record(self, record: logging.LogRecord) -> None:
        """Rewrite ``record`` in place so that no handler can print a secret from it."""
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(self._frame(a) if _is_frame(a) else a for a in record.args)
        if not isinstance(record.msg, str):
            record.msg = self._frame(record.msg) if _is_frame(record.msg) else str(record.msg)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: its handler reports it, with what we leave
            message = None
        clean = None if message is None else self.scrub(message)
        if clean is None or clean != message:
            self._redact_message(record, message, clean)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.scrub(_FORMATTER.formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)

    def _redact_message(self, record: logging.LogRecord, message: str | None,
                        clean: str | None) -> None:
        if not record.args:
            record.msg = self.scrub(record.msg) if clean is None else clean
            return
        # Argument by argument first: formatters such as uvicorn's access log unpack the
        # arguments, so their number and order must stay (and the format string's
        # placeholders with them: it is not scrubbed).
        if isinstance(record.args, tuple):
            record.args = tuple(self._arg(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self._arg(v) for k, v in record.args.items()}
        try:
            again = record.getMessage()
        except Exception:  # malformed from the start: keep what it says, as one string
            record.msg, record.args = self.scrub(f"{record.msg} {record.args!r}"), ()
            return
        if clean is None or again == clean or self.scrub(again) == again:
            return
        # The secret's context spans arguments (``token=`` ending one, its value the next) or
        # lies in the format string: the message becomes the scrubbed line, and the arguments
        # stay, hidden unless numbers, for formatters that unpack them (uvicorn's access log
        # builds its line from its five): each is consumed by a ``%.0s`` that prints nothing.
        escaped = clean.replace("%", "%%")
        if isinstance(record.args, tuple):
            record.msg = escaped + "%.0s" * len(record.args)
            record.args = tuple(_hidden(a) for a in record.args)
        elif isinstance(record.args, dict) and all(
                isinstance(k, str) and ")" not in k for k in record.args):
            record.msg = escaped + "".join(f"%({k}).0s" for k in record.args)
            record.args = {k: _hidden(v) for k, v in record.args.items()}
        else:
            record.msg, record.args = clean, ()

    def _arg(self, arg: object) -> object:
        if arg is None or isinstance(arg, (bool, int, float)):
            return arg
        if isinstance(arg, str):
            return self.scrub(arg)
        text, shown = str(arg), repr(arg)
        clean_text, clean_shown = self.scrub(text), self.scrub(shown)
        if clean_text == text and clean_shown == shown:
            return arg
        return _Scrubbed(clean_text, clean_shown)

    def _frame(self, frame: Any) -> str:
        """A websockets frame as websockets prints it, redacted before it is cut short."""
        name = frame.opcode.name
        if name in ("TEXT", "BINARY", "CONT"):
            if name == "CONT" or not frame.fin:
                return f"{name} [{len(frame.data)} bytes, a fragment: not shown]"
            text = bytes(frame.data).decode("utf-8", "replace")
            clean = self.scrub(text)
            if clean != text:
                frame = dataclasses.replace(frame, data=clean.encode())
        return self.scrub(str(frame))

    # ------------------------------------------------------------ the process's logs

    def install(self) -> None:
        """Redact every record this process logs (once)."""
        with self._lock:
            if self._installed:
                return
            self._installed = True
        make = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make(*args, **kwargs)
            try:
                self.redact_record(record)
            except Exception:  # never lose a line to the redactor; never let one through
                record.msg, record.args = "(a log record the redactor could not read)", ()
                record.exc_info, record.exc_text, record.stack_info = None, None, None
            return record

        logging.setLogRecordFactory(factory)

    def install_excepthooks(self) -> None:
        """Redact the tracebacks of uncaught exceptions too: for a process's entry point."""
        sys.excepthook = self._excepthook
        threading.excepthook = self._thread_excepthook

    def _excepthook(self, kind: type[BaseException], exc: BaseException,
                    tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception(kind, exc, tb))
        sys.stderr.write(self.scrub(text))

    def _thread_excepthook(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                  args.exc_traceback))
        sys.stderr.write(self.scrub(f"Exception in thread {name}:\n{text}"))

    def filter_loggers(self, *names: str) -> None:
        """Redact these loggers' records, for a library whose process's logging it does not own
        (the client: websockets logs its handshake headers at DEBUG)."""
        for name in names:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _RedactingFilter) for f in logger.filters):
                logger.addFilter(_RedactingFilter(self))


def _hidden(arg: object) -> object:
    return arg if arg is None or isinstance(arg, (bool, int, float)) else REDACTED


@dataclasses.dataclass(frozen=True, slots=True)
class _Scrubbed:
    """An argument that held a secret, as ``%s`` and ``%r`` print it, redacted."""

    text: str
    shown: str

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.shown


class _RedactingFilter(logging.Filter):
    def __init__(self, redactor: LogRedactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        self.redactor.redact_record(record)
        return True


_FORMATTER = logging.Formatter()


def _is_frame(obj: object) -> bool:
    kind = type(obj)
    return kind.__name__ == "Frame" and kind.__module__.startswith("websockets")


def _spellings(value: str) -> set[str]:
    """How ``value`` may appear in a log line: as is, escaped, quoted, and inside base64."""
    found = {value, json.dumps(value)[1:-1], repr(value)[1:-1],
             urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value)}
    found |= set(_inside_base64(value.encode()))
    return {s for s in found if len(s) >= MIN_SECRET_LEN}


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of ``words`` (the longest where several start at one place), shaped
    as their trie so that a scan looks at each character once, not once per word."""
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here
    return _branches(trie)


def _branches(node: dict[str, dict]) -> str:
    alternatives = []
    for char in sorted(c for c in node if c):
        chain, child = char, node[char]
        while len(child) == 1 and "" not in child:  # no branch: one literal (recursion only
            ((char, child),) = child.items()  # at branches, so its depth stays small)
            chain += char
        rest = "" if list(child) == [""] else _branches(child)
        alternatives.append(re.escape(chain) + rest)
    body = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
    return f"(?:{body})?" if "" in node else body


def _inside_base64(data: bytes) -> Iterable[str]:
    """What base64 of ``anything + data + anything`` always contains, at each of the three
    alignments ``data`` can start at (``user:key`` in a ``Basic`` header, whatever the user)."""
    if len(data) < 9:  # too short to leave a distinctive middle
        return
    for lead in range(3):
        padded = b"\0" * lead + data
        encoded = base64.b64encode(padded[: len(padded) // 3 * 3]).decode()
        # The first group mixes in the unknown prefix; the last whole group is exact.
        start = 4 if lead else 0
        middle = encoded[start:]
        yield from (middle, middle.replace("+", "-").replace("/", "_"))  # and URL-safe


REDACTOR = LogRedactor()  # one per process: logging itself is one per process
