"""The `contextpaw` command line: what it asks mitmproxy for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mitmproxy.test import taddons

from contextpaw.compose import make_addons
from contextpaw.cli import OLD_FLAGS, main, mitmproxy_args, parser


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


OLD_FLAG_VALUES = {
    "--keep-recent": ("7", 7),
    "--default-ctx": ("8192", 8192),
    "--margin": ("96", 96),
    "--tokenizer": (__file__, __file__),
    "--summarize": (None, True),
    "--summarizer-model": ("qwen3:0.6b", "qwen3:0.6b"),
    "--summarizer-url": ("http://127.0.0.1:11436", "http://127.0.0.1:11436"),
    "--arbitrate": (None, True),
    "--llamacpp-cmd": ("llama-server -m m.gguf --port 8091", "llama-server -m m.gguf --port 8091"),
    "--min-hold": ("45", 45),
}


@pytest.mark.parametrize("flag", sorted(OLD_FLAGS))
def test_each_earlier_proxy_flag_sets_its_option_in_mitmproxy(flag: str) -> None:
    """The flag becomes `--set option=value`, and mitmproxy, with ContextPaw's addons loaded,
    parses that into the option's own type."""
    given, expected = OLD_FLAG_VALUES[flag]
    argv = ["--ollama", "http://127.0.0.1:11435", "--llamacpp", "http://127.0.0.1:8091"]
    argv += [flag, *([given] if given is not None else [])]
    if flag == "--arbitrate":  # it needs the command that starts llama-server
        argv += ["--llamacpp-cmd", f"{sys.executable} -c pass"]
    sets = pairs(args_for(*argv), "--set")
    option = OLD_FLAGS[flag][0]
    assert [s for s in sets if s.startswith(f"{option}=")], sets
    with taddons.context(*make_addons()) as tctx:
        tctx.options.set(*(s for s in sets if s.startswith("contextpaw_")))
        assert getattr(tctx.options, option) == expected


def test_every_earlier_proxy_flag_has_a_value_under_test() -> None:
    assert set(OLD_FLAG_VALUES) == set(OLD_FLAGS)


def test_earlier_proxy_flags_are_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    shown = capsys.readouterr().out
    for flag, (option, _, _) in OLD_FLAGS.items():
        assert flag in shown and option in shown


def test_unset_earlier_flags_leave_their_options_alone() -> None:
    sets = pairs(args_for("--ollama", "http://h:1"), "--set")
    assert not [s for s in sets for option, _, _ in OLD_FLAGS.values() if s.startswith(f"{option}=")]


@pytest.mark.parametrize("unknown", ["--port-x", "--bogus", "--keep-recents=3"])
def test_an_unknown_flag_is_a_plain_usage_error(unknown: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--ollama", "http://127.0.0.1:11435", unknown])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {unknown}" in err
    assert "deprecated" not in err
