"""The keys file: the old one-key-a-line form unchanged, per-key limits after the key, bad
lines refused naming the line and never the key, and the limits reaching ``Auth`` by tenant."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidegate.http.auth import Auth, tenant_of
from tidegate.http.key_file import UNLIMITED, KeyEntry, KeyFileError, KeyLimits, parse_key_lines
from tidegate.producer.submit.rate_limit import RateLimiter, TenantLimits
from tidegate.settings import Settings


def test_a_file_of_bare_keys_reads_as_it_always_did() -> None:
    text = "# the ops team\nk3\n\n   k4  \n  # k5 is retired\n"
    assert parse_key_lines(text) == [KeyEntry("k3"), KeyEntry("k4")]


def test_limits_follow_the_key_as_name_value_words() -> None:
    text = ("alpha requests_per_s=5 tokens_per_min=40000\n"
            "bravo\ttokens_per_min=unlimited\n"
            "charlie requests_per_s=0.5\n")
    assert parse_key_lines(text) == [
        KeyEntry("alpha", KeyLimits(requests_per_s=5, tokens_per_min=40_000)),
        KeyEntry("bravo", KeyLimits(tokens_per_min=UNLIMITED)),
        KeyEntry("charlie", KeyLimits(requests_per_s=0.5))]


@pytest.mark.parametrize(("line", "says"), [
    ("sk-secret-1 requests_per_s=0", "requests_per_s must be a number > 0"),
    ("sk-secret-1 requests_per_s=-3", "requests_per_s must be a number > 0"),
    ("sk-secret-1 tokens_per_min=lots", "tokens_per_min must be a number > 0"),
    ("sk-secret-1 tokens_per_min=inf", "tokens_per_min must be a number > 0"),
    ("sk-secret-1 burst=4", "word 2: after the key only"),
    ("sk-secret-1 part-two-of-the-key", "word 2: after the key only"),
    ("sk-secret-1 requests_per_s=1 requests_per_s=2", "requests_per_s is given twice"),
])
def test_a_bad_line_is_refused_naming_the_line_not_the_key(line: str, says: str) -> None:
    with pytest.raises(KeyFileError) as refused:
        parse_key_lines(f"# keys\n{line}\n")
    assert str(refused.value).startswith("keys file line 2")
    assert says in str(refused.value)
    assert "secret" not in str(refused.value) and "part-two" not in str(refused.value)


def test_an_entry_never_shows_its_key() -> None:
    assert "sk-secret" not in repr(KeyEntry("sk-secret-1", KeyLimits(requests_per_s=1)))


def test_limits_from_the_file_reach_the_rate_limiter_by_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("a requests_per_s=5\nb tokens_per_min=unlimited\nc\n")
    settings = Settings(api_keys=["d"], api_keys_file=str(path), rate_limit_tokens_per_min=900)
    auth = Auth.from_settings(settings)
    assert [auth.tenant(f"Bearer {k}") for k in "abcd"] == [tenant_of(k) for k in "abcd"]
    limiter = RateLimiter.from_settings(settings, auth)
    assert limiter.limits(tenant_of("a")) == TenantLimits(5, 900)
    assert limiter.limits(tenant_of("b")) == TenantLimits(UNLIMITED, UNLIMITED)
    assert limiter.limits(tenant_of("c")) == limiter.limits(tenant_of("d")) == TenantLimits(
        UNLIMITED, 900)
    assert limiter.limits("anonymous") == limiter.defaults  # auth off: the defaults


def test_the_default_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_RATE_LIMIT_REQUESTS_PER_S", "2.5")
    monkeypatch.setenv("TIDEGATE_RATE_LIMIT_TOKENS_PER_MIN", "60000")
    settings = Settings()
    assert (settings.rate_limit_requests_per_s, settings.rate_limit_tokens_per_min) == (2.5, 60_000)
    assert RateLimiter.from_settings(settings, Auth()).defaults == TenantLimits(2.5, 60_000)
    monkeypatch.delenv("TIDEGATE_RATE_LIMIT_REQUESTS_PER_S")
    monkeypatch.delenv("TIDEGATE_RATE_LIMIT_TOKENS_PER_MIN")
    assert RateLimiter.from_settings(Settings(), Auth()).defaults.unlimited  # unset: unlimited


@pytest.mark.parametrize("command", ["api", "gateway", "up"])
def test_a_bad_keys_file_stops_the_servers_with_a_message_and_exit_2(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from tidegate.commands.cli import main

    path = tmp_path / "keys.txt"
    path.write_text("sk-secret-1 requests_per_s=fast\n")
    monkeypatch.setenv("TIDEGATE_API_KEYS_FILE", str(path))
    monkeypatch.setenv("TIDEGATE_MODEL", "random:tiny")
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tidegate: error: ") and "line 1: requests_per_s" in err
    assert "sk-secret" not in err and "Traceback" not in err
    path.unlink()
    assert main([command]) == 2
    assert "cannot read the keys file" in capsys.readouterr().err
