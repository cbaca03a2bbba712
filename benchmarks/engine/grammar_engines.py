"""llguidance against xgrammar as the grammar engine, measured the way the choice is made.

The engine that enforces ``response_format`` is picked by its per-token mask cost at batch 256
and its schema coverage, and it must not pull in another torch. Both engines run on the default
model's tokenizer (SmolLM2, 49152 tokens) over the JSON schema fixtures
(``tests/fixtures/json_schemas.json``), each compiled to compact JSON (``", "`` and ``": "``, no
other whitespace: ``tidegate.structured.grammar.JSON_OPTIONS``):

  coverage      which schemas compile (failures with the engine's error); which fixtures'
                examples, written compactly and tokenized as a request would be, the engine
                accepts token by token; and how many invalid instances it still accepts whole:
                "schema", the example mutated (strings lengthened or near-missed, numbers
                pushed out of range or off a multipleOf, an extra key, an array overfilled, a
                value nulled or dropped; kept where jsonschema rejects them), i.e. keywords it
                compiles but does not enforce; "json", a raw control character inside one of
                the example's strings, which is not JSON at all.
  compile       cold compile per schema (schema -> a matcher ready to run; xgrammar's cache
                off) and cold compile plus the first mask, median and max.
  batch 256     256 matchers over a mix of the schemas every engine compiles, accepts and
                enforces, teacher-forced with the fixtures' example tokens and then the stop
                token; a row whose example is spent restarts on the next fixture (a new
                request: not timed). Each step times filling the [256, words] int32 bitmask and
                advancing the 256 matchers one token. "pool": the engines' batched calls on
                their thread pools (llguidance: ``LLExecutor`` + ``fill_next_token_bitmask_par``
                and ``consume_token_par``; xgrammar: ``BatchGrammarMatcher``'s
                ``batch_fill_next_token_bitmask`` and ``batch_accept_token``); "1 thread": one
                matcher after the other on the calling thread. Median and p99 per step and per
                row. Every forced token is checked against its row's mask.
  batch 1       the same with one matcher: "direct", the matcher's own call; "pool", through
                the batched call (what a server that always batches pays at batch 1).
  agreement     at every teacher-forced step of every example, whether the two engines' masks
                are equal, and what differs where they are not.

xgrammar is installed for this benchmark only, never as a dependency of tidegate: it declares
torch, transformers and triton as requirements and imports torch and transformers when it is
imported (the results list what each engine's import loads); ``--no-deps`` keeps pip from
touching the installed torch:

  .venv/bin/pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi

The engines take turns (``--rounds``) so that a shared machine's drift hits both alike; the
load average at the start and end is in the results.

Usage:  .venv/bin/python -m tidegate.benchmarks.engine.grammar_engines
            [--out benchmarks/results/engine/grammar_engines_cpu.json] [--threads N (all CPUs)]
            [--steps 600] [--steps-batch1 3000] [--batch 256] [--rounds 3] [--warmup 5]
            [--engines llguidance,xgrammar]
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np

from tidegate.benchmarks.harness.measure import record
from tidegate.model_files.model_source import resolve_model
from tidegate.model_files.tokenizer import Tokenizer, load_tokenizer
from tidegate.structured.grammar import json_schema_grammar

# Large packages an engine may drag into the worker when imported.
HEAVY_MODULES = ("torch", "transformers", "triton", "tvm_ffi", "tiktoken", "sentencepiece")
# llguidance is imported above, xgrammar only when its engine is built.
_LOADED_WITH_LLGUIDANCE = [m for m in HEAVY_MODULES if m in sys.modules]
ROOT = Path(__file__).resolve().parents[2]
FIXTURES_PATH = ROOT / "tests" / "fixtures" / "json_schemas.json"
SEPARATORS = (", ", ": ")  # JSON_OPTIONS' item and key separators


class CompileError(Exception):
    """The engine refused a schema."""


class Engine(Protocol):
    """What the benchmark needs of a grammar engine; matchers are the engine's own objects."""

    name: str
    version: str
    setup_s: float  # building its view of the tokenizer
    import_loads: list[str]  # HEAVY_MODULES its import loaded

    def compile(self, schema: dict[str, Any]) -> Any:
        """A template matcher or compiled grammar for the schema; raises ``CompileError``."""

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the start of the compiled grammar."""

    def consume(self, matcher: Any, token: int) -> bool: ...

    def is_accepting(self, matcher: Any) -> bool:
        """The input so far is a complete instance (the stop token may come next)."""

    def fill(self, matchers: Sequence[Any], bitmask: np.ndarray) -> None:
        """Row i of ``bitmask`` gets matcher i's next-token mask, the rows in parallel (the
        engine's thread pool)."""

    def fill_one(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        """One matcher's mask into one row, on the calling thread."""

    def advance(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        """Each matcher takes its token, in the engine's batched call."""


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        self.version = llguidance.__version__
        self.import_loads = _LOADED_WITH_LLGUIDANCE
        started = time.perf_counter()
        # As worker/engine/grammar_masks.py builds it: the backend's own JSON, so special
        # tokens are known as such and never allowed inside the JSON text.
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
            eos_token=sorted(tokenizer.eos_token_ids))
        self.setup_s = time.perf_counter() - started
        self._executor = llguidance.LLExecutor(threads)

    def compile(self, schema: dict[str, Any]) -> llguidance.LLMatcher:
        try:
            grammar = json_schema_grammar(schema)
        except ValueError as exc:
            raise CompileError(str(exc)) from exc
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise CompileError(matcher.get_error())
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher) -> llguidance.LLMatcher:
        return compiled.deep_copy()

    def consume(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        return matcher.consume_token(token)

    def is_accepting(self, matcher: llguidance.LLMatcher) -> bool:
        return matcher.is_accepting()

    def fill(self, matchers: Sequence[llguidance.LLMatcher], bitmask: np.ndarray) -> None:
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_one(self, matcher: llguidance.LLMatcher, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)

    def advance(self, matchers: Sequence[llguidance.LLMatcher],
                tokens: Sequence[int]) -> list[bool]:
        return self._executor.consume_token_par(list(zip(matchers, tokens, strict=True)))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        before = set(sys.modules)
        import xgrammar  # benchmark-only; imported here so llguidance runs without it

        self.import_loads = [m for m in HEAVY_MODULES if m in set(sys.modules) - before]
        self._xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        started = time.perf_counter()
        # TokenizerInfo.from_huggingface wants a transformers tokenizer; this is what it builds
        # from one (the vocabulary by id, byte-level, no prefix space), except that special
        # tokens are left empty: xgrammar marks only empty entries special, and a special token
        # spelled out ("<filename>") would otherwise be allowed inside JSON strings.
        vocab = [""] * tokenizer.vocab_size
        for text, token in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            vocab[token] = text
        for token, added in tokenizer.backend.get_added_tokens_decoder().items():
            if added.special:
                vocab[token] = ""
        self._info = xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size,
            stop_token_ids=sorted(tokenizer.eos_token_ids), add_prefix_space=False)
        self.setup_s = time.perf_counter() - started
        # No cache: every compile is cold, as a schema's first request finds it.
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=threads,
                                                  cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher(threads)
        self._stop = sorted(tokenizer.eos_token_ids)[0]

    def compile(self, schema: dict[str, Any]) -> Any:
        try:
            # strict_mode=False: JSON Schema's own defaults (unlisted properties allowed where
            # the schema does not forbid them), as llguidance reads a schema.
            return self._compiler.compile_json_schema(
                schema, any_whitespace=False, separators=SEPARATORS, strict_mode=False)
        except Exception as exc:  # xgrammar raises RuntimeError and its own error types
            raise CompileError(f"{type(exc).__name__}: {exc}") from exc

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def is_accepting(self, matcher: Any) -> bool:
        return matcher.is_completed()

    def fill(self, matchers: Sequence[Any], bitmask: np.ndarray) -> None:
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)

    def fill_one(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        return self._xgr.BatchGrammarMatcher.batch_accept_token(list(matchers), list(tokens))


ENGINES: dict[str, Callable[[Tokenizer, int], Engine]] = {
    "llguidance": LLGuidance, "xgrammar": XGrammar}


@dataclass(slots=True)
class Fixture:
    name: str
    schema: dict[str, Any]
    example: Any
    tokens: list[int]  # the compact example's tokens


@dataclass(slots=True)
class EngineReport:
    name: str
    version: str
    setup_s: float
    import_loads: list[str]
    compiled: dict[str, Any] = field(default_factory=dict)  # fixture name -> compiled grammar
    compile_failures: dict[str, str] = field(default_factory=dict)
    compile_ms: list[float] = field(default_factory=list)
    first_mask_ms: list[float] = field(default_factory=list)
    slowest: tuple[str, float] = ("", 0.0)
    example_failures: dict[str, str] = field(default_factory=dict)
    invalid_accepted: list[dict[str, str]] = field(default_factory=list)
    invalid_probes: dict[str, int] = field(default_factory=dict)  # kind -> instances tried
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)


def compact(value: Any) -> str:
    return json.dumps(value, separators=SEPARATORS, ensure_ascii=False)


def load_fixtures(tokenizer: Tokenizer) -> list[Fixture]:
    raw = json.loads(FIXTURES_PATH.read_text(encoding="utf-8"))
    return [Fixture(f["name"], f["schema"], f["example"],
                    tokenizer.backend.encode(compact(f["example"]), add_special_tokens=False).ids)
            for f in raw]


def allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p99": percentile(values, 99),
            "mean": statistics.fmean(values), "max": max(values)} if values else {}


# --- coverage --------------------------------------------------------------------------------

def measure_compile(engine: Engine, fixtures: Sequence[Fixture], words: int,
                    report: EngineReport) -> None:
    """Cold compile of every schema, then its first mask; failures kept with their error."""
    bitmask = np.zeros((1, words), dtype=np.int32)
    engine.compile({"type": "boolean"})  # one-time initialisation is not the first schema's
    for fixture in fixtures:
        started = time.perf_counter()
        try:
            compiled = engine.compile(fixture.schema)
        except CompileError as exc:
            report.compile_failures[fixture.name] = str(exc)
            continue
        matcher = engine.matcher(compiled)
        compiled_at = time.perf_counter()
        engine.fill([matcher], bitmask)
        done = time.perf_counter()
        report.compiled[fixture.name] = compiled
        report.compile_ms.append((compiled_at - started) * 1e3)
        report.first_mask_ms.append((done - started) * 1e3)
        if done - started > report.slowest[1]:
            report.slowest = (fixture.name, done - started)


def check_examples(engine: Engine, fixtures: Sequence[Fixture], eos: int,
                   report: EngineReport) -> None:
    """Every compiled fixture's example, token by token, then the stop token."""
    for fixture in fixtures:
        compiled = report.compiled.get(fixture.name)
        if compiled is None:
            continue
        matcher = engine.matcher(compiled)
        refused = next((k for k, t in enumerate(fixture.tokens)
                        if not engine.consume(matcher, t)), None)
        if refused is not None:
            report.example_failures[fixture.name] = f"token {refused} refused"
        elif not engine.is_accepting(matcher) or not engine.consume(matcher, eos):
            report.example_failures[fixture.name] = "incomplete at the end"


def mutations(value: Any) -> Iterator[Any]:
    """Variants of ``value`` with one part broken the way a free model breaks it."""
    if isinstance(value, bool) or value is None:
        yield "yes"
    elif isinstance(value, int):
        yield value + 10_000_000
        yield value + 0.5
        yield value + 1
    elif isinstance(value, float):
        yield value + 10_000_000.0
        yield -value - 10_000_000.0
        yield value + 0.1  # off a multipleOf
    elif isinstance(value, str):
        yield value + "x" * 41
        yield "!" + value
        yield 12
        # Near misses of patterns and formats: a digit too many, a leading zero, a character
        # short, a separator dropped.
        middle = len(value) // 2
        yield value[:middle] + "0" + value[middle:]
        yield "0" + value
        yield value[:-1]
        separator = next((k for k, c in enumerate(value) if not c.isalnum()), None)
        if separator is not None:
            yield value[:separator] + value[separator + 1:]
    elif isinstance(value, list):
        yield value + [value[-1] if value else 0] * 6
        yield []
        for i, item in enumerate(value):
            for variant in mutations(item):
                yield value[:i] + [variant] + value[i + 1:]
    elif isinstance(value, dict):
        yield {**value, "zz_extra": 1}
        for key, item in value.items():
            trimmed = {k: v for k, v in value.items() if k != key}
            yield trimmed
            for variant in [None, *mutations(item)]:
                changed = copy.copy(value)
                changed[key] = variant
                yield changed


def with_each_string(value: Any, change: Callable[[str], str]) -> Iterator[Any]:
    """Copies of ``value`` with one string (not a key) changed."""
    if isinstance(value, str):
        yield change(value)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            for variant in with_each_string(item, change):
                yield value[:i] + [variant] + value[i + 1:]
    elif isinstance(value, dict):
        for key, item in value.items():
            for variant in with_each_string(item, change):
                yield {**value, key: variant}


def invalid_variants(fixture: Fixture) -> list[tuple[str, str]]:
    """Invalid instances near the example, as (kind, text): "schema", its mutations that
    jsonschema (formats checked where it can) rejects; "json", a raw tab inside one of its
    strings, which no JSON parser takes (control characters must be escaped)."""
    validator_class = jsonschema.Draft202012Validator
    validator = validator_class(fixture.schema, format_checker=validator_class.FORMAT_CHECKER)
    out = {("schema", compact(v)) for v in mutations(fixture.example) if not validator.is_valid(v)}
    for variant in with_each_string(fixture.example, lambda s: s[:1] + "\x01" + s[1:]):
        # json.dumps escapes the control character; put the raw one in its place.
        text = compact(variant).replace("\\u0001", "\t")
        out.add(("json", text))
    return sorted(out)


def check_invalid(engine: Engine, fixtures: Sequence[Fixture], tokenizer: Tokenizer,
                  variants: dict[str, list[tuple[str, str]]], report: EngineReport) -> None:
    """Invalid instances the engine lets through whole: keywords compiled but not enforced."""
    for fixture in fixtures:
        compiled = report.compiled.get(fixture.name)
        if compiled is None:
            continue
        for kind, text in variants[fixture.name]:
            report.invalid_probes[kind] = report.invalid_probes.get(kind, 0) + 1
            matcher = engine.matcher(compiled)
            ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
            if all(engine.consume(matcher, t) for t in ids) and engine.is_accepting(matcher):
                report.invalid_accepted.append({"fixture": fixture.name, "kind": kind,
                                                "instance": text})


# --- mask cost -------------------------------------------------------------------------------

@dataclass(slots=True)
class Run:
    """One engine's timed steps at one batch size, pooled over rounds."""

    batch: int
    pooled: bool  # the engine's batched calls (its thread pool), or one matcher at a time
    fill_s: list[float] = field(default_factory=list)
    advance_s: list[float] = field(default_factory=list)
    restarts: int = 0
    outside_mask: int = 0  # forced tokens the mask did not allow: a wrong mask
    refused: int = 0  # forced tokens the matcher refused

    def result(self, warmup: int, rounds: int) -> dict[str, Any]:
        step_s = [f + a for f, a in zip(self.fill_s, self.advance_s, strict=True)]
        return {
            "batch": self.batch, "calls": "batched, the engine's thread pool" if self.pooled
            else "one matcher at a time, this thread", "steps": len(step_s), "rounds": rounds,
            "warmup_steps_per_round": warmup, "restarts": self.restarts,
            "step_ms": {k: v * 1e3 for k, v in summary(step_s).items()},
            "fill_ms": {k: v * 1e3 for k, v in summary(self.fill_s).items()},
            "advance_ms": {k: v * 1e3 for k, v in summary(self.advance_s).items()},
            "per_row_us": {k: v * 1e6 / self.batch for k, v in summary(step_s).items()},
            "forced_tokens_outside_mask": self.outside_mask,
            "forced_tokens_refused": self.refused,
        }


def run_batch(engine: Engine, report: EngineReport, mix: Sequence[Fixture], run: Run, *,
              steps: int, warmup: int, words: int, eos: int) -> None:
    """``run.batch`` rows teacher-forced through the mix; each step timed as fill + advance."""
    batch = run.batch
    bitmask = np.zeros((batch, words), dtype=np.int32)
    sequences = [f.tokens + [eos] for f in mix]
    templates = [report.compiled[f.name] for f in mix]
    next_fixture = 0

    def start() -> tuple[Any, int, int]:
        nonlocal next_fixture
        index = next_fixture % len(mix)
        next_fixture += 1
        return engine.matcher(templates[index]), index, 0

    rows = [start() for _ in range(batch)]
    # Stagger the rows so that they are not all at a document's first token at once.
    for r, (matcher, index, _) in enumerate(rows):
        skip = (r * 7) % len(mix[index].tokens)
        for token in sequences[index][:skip]:
            engine.consume(matcher, token)
        rows[r] = (matcher, index, skip)
    for step in range(warmup + steps):
        matchers = [m for m, _, _ in rows]
        tokens = [sequences[i][p] for _, i, p in rows]
        started = time.perf_counter()
        if run.pooled:
            engine.fill(matchers, bitmask)
        else:
            for r, matcher in enumerate(matchers):
                engine.fill_one(matcher, bitmask, r)
        filled = time.perf_counter()
        if run.pooled:
            accepted = engine.advance(matchers, tokens)
        else:
            accepted = [engine.consume(m, t) for m, t in zip(matchers, tokens, strict=True)]
        advanced = time.perf_counter()
        if step >= warmup:
            run.fill_s.append(filled - started)
            run.advance_s.append(advanced - filled)
        run.outside_mask += sum(not allowed(bitmask, r, t) for r, t in enumerate(tokens))
        run.refused += sum(not ok for ok in accepted)
        for r, (matcher, index, position) in enumerate(rows):
            if position + 1 < len(sequences[index]):
                rows[r] = (matcher, index, position + 1)
            else:  # the request ended: a new one takes the row
                rows[r] = start()
                run.restarts += 1


def mask_agreement(engines: Sequence[Engine], reports: Sequence[EngineReport],
                   mix: Sequence[Fixture], tokenizer: Tokenizer,
                   token_bytes: Callable[[int], bytes], words: int, eos: int) -> dict[str, Any]:
    """Step by step along every example, where the two engines' masks differ: how often, which
    tokens one allows and the other does not (as bytes), and a first example of each kind."""
    steps = differing = 0
    only: list[Counter[str]] = [Counter(), Counter()]
    categories: list[Counter[str]] = [Counter(), Counter()]
    steps_only = [0, 0]
    examples: dict[tuple[str, ...], dict[str, Any]] = {}
    masks = [np.zeros((1, words), dtype=np.int32) for _ in engines]
    for fixture in mix:
        matchers = [e.matcher(r.compiled[fixture.name])
                    for e, r in zip(engines, reports, strict=True)]
        for position, token in enumerate([*fixture.tokens, eos]):
            for engine, matcher, mask in zip(engines, matchers, masks, strict=True):
                engine.fill([matcher], mask)
            steps += 1
            if not np.array_equal(masks[0], masks[1]):
                differing += 1
                sides = [_tokens_only(masks[0], masks[1]), _tokens_only(masks[1], masks[0])]
                raw = [[token_bytes(t) for t in side] for side in sides]
                shown = [[repr(b) for b in side] for side in raw]
                for k in range(2):
                    steps_only[k] += bool(sides[k])
                    only[k].update(shown[k])
                    categories[k].update(byte_category(b) for b in raw[k])
                kind = (*shown[0][:3], "|", *shown[1][:3])
                if kind not in examples and len(examples) < 20:
                    examples[kind] = {
                        "fixture": fixture.name,
                        "after": tokenizer.backend.decode(fixture.tokens[:position]),
                        **{f"only_{e.name}": s[:8] for e, s in zip(engines, shown, strict=True)},
                        **{f"only_{e.name}_count": len(s)
                           for e, s in zip(engines, sides, strict=True)}}
            for engine, matcher in zip(engines, matchers, strict=True):
                engine.consume(matcher, token)
    return {
        "steps": steps, "steps_differing": differing,
        **{f"steps_only_{e.name}_allows_some": n for e, n in zip(engines, steps_only,
                                                                  strict=True)},
        **{f"token_steps_only_{e.name}_by_kind": dict(c.most_common())
           for e, c in zip(engines, categories, strict=True)},
        **{f"most_often_only_{e.name}": dict(c.most_common(12))
           for e, c in zip(engines, only, strict=True)},
        "examples": list(examples.values()),
    }


def byte_category(text: bytes) -> str:
    """What kind of token one engine allows and the other does not."""
    if any(c < 0x20 for c in text):
        return "raw control character"
    if b"\x7f" in text:
        return "DEL"
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return "partial UTF-8"
    return "backslash (escape)" if b"\\" in text else "other"


def _tokens_only(mask: np.ndarray, other: np.ndarray) -> list[int]:
    bits = np.unpackbits((mask & ~other).view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits)]


# --- driver ----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--steps", type=int, default=600,
                        help="timed steps at the large batch, over all rounds")
    parser.add_argument("--steps-batch1", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3,
                        help="the engines take turns this many times (drift hits both alike)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps each round")
    parser.add_argument("--engines", default="llguidance,xgrammar")
    args = parser.parse_args()
    names = [n.strip() for n in args.engines.split(",") if n.strip()]

    started = time.perf_counter()
    load_at_start = os.getloadavg()  # a shared machine's other work shows in the timings
    tokenizer = load_tokenizer(resolve_model())
    eos = sorted(tokenizer.eos_token_ids)[0]
    words = (tokenizer.vocab_size + 31) // 32
    fixtures = load_fixtures(tokenizer)
    variants = {f.name: invalid_variants(f) for f in fixtures}
    engines: list[Engine] = []
    reports: list[EngineReport] = []
    for name in names:
        engine = ENGINES[name](tokenizer, args.threads)
        report = EngineReport(engine.name, engine.version, engine.setup_s, engine.import_loads)
        measure_compile(engine, fixtures, words, report)
        check_examples(engine, fixtures, eos, report)
        check_invalid(engine, fixtures, tokenizer, variants, report)
        engines.append(engine)
        reports.append(report)
        print(f"{name} {engine.version}: {len(report.compiled)}/{len(fixtures)} compile",
              file=sys.stderr)

    # The same work for every engine: the fixtures all of them compile, accept and enforce (a
    # schema an engine reads more loosely, say allOf as "any JSON", is another grammar).
    excluded: dict[str, str] = {}
    for report in reports:
        for name in report.compile_failures:
            excluded.setdefault(name, f"{report.name} does not compile it")
        for name in report.example_failures:
            excluded.setdefault(name, f"{report.name} refuses its example")
        for probe in report.invalid_accepted:
            if probe["kind"] == "schema":
                excluded.setdefault(probe["fixture"], f"{report.name} does not enforce it")
    mix = [f for f in fixtures if f.name not in excluded]
    # label -> (rows, batched calls?, timed steps over all rounds)
    sizes = {"batch": (args.batch, True, args.steps),
             "batch_one_thread": (args.batch, False, args.steps),
             "batch1": (1, False, args.steps_batch1),
             "batch1_pool": (1, True, args.steps_batch1)}
    runs = [{label: Run(batch, pooled) for label, (batch, pooled, _) in sizes.items()}
            for _ in engines]
    for _ in range(args.rounds):
        for engine, report, engine_runs in zip(engines, reports, runs, strict=True):
            for label, (_, _, steps) in sizes.items():
                run_batch(engine, report, mix, engine_runs[label], steps=steps // args.rounds,
                          warmup=args.warmup, words=words, eos=eos)
    for report, engine_runs in zip(reports, runs, strict=True):
        report.runs = {label: run.result(args.warmup, args.rounds)
                       for label, run in engine_runs.items()}
    # A token's bytes, as llguidance reads them (decoding to text hides partial UTF-8).
    bytes_of = LLGuidance(tokenizer, 1).tokenizer.decode_bytes
    agreement = (mask_agreement(engines, reports, mix, tokenizer, lambda t: bytes_of([t]), words,
                                eos) if len(engines) == 2 else None)

    results = {
        "benchmark": "grammar_engines",
        **record.record(),
        "machine": {**record.machine(), "processor": platform.processor(),
                    "numpy": np.__version__, "loadavg_at_start": load_at_start,
                    "loadavg_at_end": os.getloadavg()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "tokenizer": {"model": "smollm2 (default)", "vocab_size": tokenizer.vocab_size,
                      "eos": eos},
        "fixtures": len(fixtures), "mix": len(mix), "mix_excluded": excluded,
        "invalid_variants": {kind: sum(k == kind for v in variants.values() for k, _ in v)
                             for kind in ("schema", "json")},
        "engines": {r.name: _engine_result(r, len(fixtures)) for r in reports},
        "mask_agreement": agreement,
        "wall_s": time.perf_counter() - started,
    }
    print_table(results)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")


def _engine_result(report: EngineReport, total: int) -> dict[str, Any]:
    return {
        "version": report.version,
        "import_loads": report.import_loads,
        "tokenizer_setup_s": report.setup_s,
        "coverage": {
            "compiled": len(report.compiled), "total": total,
            "compile_failures": report.compile_failures,
            "examples_accepted": len(report.compiled) - len(report.example_failures),
            "example_failures": report.example_failures,
            "invalid_probes": report.invalid_probes,
            "invalid_accepted": {kind: sum(i["kind"] == kind for i in report.invalid_accepted)
                                 for kind in report.invalid_probes},
            "invalid_accepted_fixtures": {
                kind: sorted({i["fixture"] for i in report.invalid_accepted if i["kind"] == kind})
                for kind in report.invalid_probes},
            "invalid_accepted_examples": _a_few_each(report.invalid_accepted),
        },
        "compile_ms": {"median": statistics.median(report.compile_ms),
                       "max": max(report.compile_ms)} if report.compile_ms else {},
        "compile_and_first_mask_ms": {"median": statistics.median(report.first_mask_ms),
                                      "max": max(report.first_mask_ms),
                                      "slowest": report.slowest[0]}
        if report.first_mask_ms else {},
        **report.runs,
    }


def _a_few_each(probes: Sequence[dict[str, str]], each: int = 3) -> list[dict[str, str]]:
    """At most ``each`` accepted invalid instances per fixture and kind."""
    seen: Counter[tuple[str, str]] = Counter()
    out = []
    for probe in probes:
        key = (probe["fixture"], probe["kind"])
        seen[key] += 1
        if seen[key] <= each:
            out.append(probe)
    return out


def print_table(results: dict[str, Any]) -> None:
    batch = results["args"]["batch"]
    print(f"{'':<18}{'':>9}{'':>9}{'invalid accepted':>20}{'cold ms, median/max':>24}"
          f"{f'ms/step at batch {batch}':>28}{'ms/step at batch 1':>28}")
    print(f"{'engine':<18}{'compiled':>9}{'examples':>9}{'schema':>11}{'json':>9}"
          f"{'compile':>12}{'+1st mask':>12}{'pool':>14}{'1 thread':>14}{'direct':>14}"
          f"{'pool':>14}")
    for name, r in results["engines"].items():
        cov = r["coverage"]
        bad = [f"{cov['invalid_accepted'].get(k, 0)}/{cov['invalid_probes'].get(k, 0)}"
               for k in ("schema", "json")]
        cells = [f"{r[key]['median']:.2f}/{r[key]['max']:.0f}"
                 for key in ("compile_ms", "compile_and_first_mask_ms")]
        cells += [f"{r[label]['step_ms']['median']:.3f}/{r[label]['step_ms']['p99']:.2f}"
                  for label in ("batch", "batch_one_thread", "batch1", "batch1_pool")]
        print(f"{name + ' ' + r['version']:<18}{cov['compiled']:>5}/{cov['total']:<3}"
              f"{cov['examples_accepted']:>9}{bad[0]:>11}{bad[1]:>9}"
              + "".join(f"{c:>{12 if k < 2 else 14}}" for k, c in enumerate(cells)))
    print(f"(steps: median/p99 ms of mask fill + advance; rows at batch {batch} cost the median "
          "step / batch each; 'json': a raw control character inside a string)")
    agreement = results["mask_agreement"]
    if agreement:
        print(f"masks differ at {agreement['steps_differing']} of {agreement['steps']} "
              f"teacher-forced steps")
    machine = results["machine"]
    print(f"({machine['cpus']} CPUs, load {machine['loadavg_at_start'][0]:.1f} at the start, "
          f"{results['args']['threads']} threads, {results['wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
