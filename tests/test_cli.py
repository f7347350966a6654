"""The `contextpaw` command line: what it asks mitmproxy for."""

from __future__ import annotations

from pathlib import Path

import pytest

from contextpaw.cli import main, mitmproxy_args, parser


def args_for(*argv: str) -> list[str]:
    ns, rest = parser().parse_known_args(argv)
    return mitmproxy_args(ns, rest)


def pairs(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_both_backends_get_a_loopback_reverse_mode_and_are_declared() -> None:
    args = args_for("--ollama", "http://127.0.0.1:11435", "--llamacpp", "http://127.0.0.1:8091", "--confdir", "/c")
    assert pairs(args, "--mode") == [
        "reverse:http://127.0.0.1:11435@127.0.0.1:11434",
        "reverse:http://127.0.0.1:8091@127.0.0.1:8092",
    ]
    sets = pairs(args, "--set")
    assert {"contextpaw_ollama=http://127.0.0.1:11435", "contextpaw_llamacpp=http://127.0.0.1:8091"} <= set(sets)
    assert {"connection_strategy=lazy", "onboarding=false", "confdir=/c", "contextpaw_policy=compact"} <= set(sets)
    assert any(s.startswith("tcp_timeout=") and int(s.split("=")[1]) >= 3600 for s in sets)


def test_ports_policy_and_mitmproxy_arguments_are_passed_on() -> None:
    args = args_for("--llamacpp", "http://h:1", "--llamacpp-port", "9000", "--policy", "strict", "--set", "x=1", "-q")
    assert pairs(args, "--mode") == ["reverse:http://h:1@127.0.0.1:9000"]
    assert "contextpaw_policy=strict" in pairs(args, "--set")
    assert args[-3:] == ["--set", "x=1", "-q"]


def test_web_shows_the_comment_column() -> None:
    assert "web_columns=comment" in pairs(args_for("--ollama", "http://h:1", "--web"), "--set")
    assert "web_columns=comment" not in pairs(args_for("--ollama", "http://h:1"), "--set")


def test_a_backend_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([])
    assert "--ollama URL, --llamacpp URL, or both" in capsys.readouterr().err


def test_default_confdir_is_contextpaws_own() -> None:
    assert parser().parse_args([]).confdir == Path.home() / ".contextpaw"
