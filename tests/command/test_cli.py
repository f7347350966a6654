"""The `contextpaw` command line: mitmproxy's own arguments, ContextPaw's, and what wins."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import master, options
from mitmproxy.tools import cmdline

from contextpaw.command import cli

URL = "http://127.0.0.1:11435"


@pytest.fixture
def start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`contextpaw ARGS` through mitmproxy's own start-up (parsing, --set, config.yaml, flags), up to
    where the master would start serving; returns the master's options."""
    started: list[Any] = []

    async def serve(self: master.Master) -> None:
        started.append(self)

    monkeypatch.setattr(master.Master, "run", serve)
    # nothing listens here: the default ports may be another test's, or the machine's, meanwhile
    monkeypatch.setattr(cli, "taken_ports", lambda backends: None)

    def run(*argv: str) -> Any:
        own_confdir = any(a.startswith("confdir=") for a in argv) or "CONTEXTPAW_CONFDIR" in os.environ
        cli.main([*([] if own_confdir else ["--confdir", str(tmp_path)]), *argv])
        return started[-1].options

    yield run


def mitmproxy_parser(web: bool) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """mitmproxy's own parser (mitmdump's or mitmweb's, with every addon's options loaded) and
    `contextpaw`'s, built on the same options."""
    from mitmproxy.tools.dump import DumpMaster
    from mitmproxy.tools.web.master import WebMaster

    from contextpaw.proxy.compose import make_addons

    async def build(confdir: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
        opts = options.Options(confdir=confdir)  # what the addons keep goes here, not to ~/.mitmproxy
        m = WebMaster(opts, with_termlog=False) if web else DumpMaster(opts, with_termlog=False)
        m.addons.add(*make_addons())
        make = cmdline.mitmweb if web else cmdline.mitmdump
        try:
            return make(opts), cli.command_parser(make, opts)
        finally:
            # The master's log handler goes with it: left behind, every later log record of this
            # process (an aiohttp session's "unclosed" on collection) is posted to this closed loop
            # and raises, failing whichever test it lands in.
            await m.done()

    with tempfile.TemporaryDirectory(prefix="contextpaw-cli-") as confdir:
        return asyncio.run(build(confdir))


@pytest.mark.parametrize("web", [False, True], ids=["mitmdump", "mitmweb"])
def test_building_mitmproxys_parser_leaves_no_log_handler_of_its_closed_loop(web: bool) -> None:
    """A log record made later in the process (an unclosed aiohttp session's, on collection) must
    not go to the master made here: its loop is closed, and the record would raise in whatever
    test it lands in (seen in CI)."""
    mitmproxy_parser(web)
    logging.getLogger("contextpaw.tests").error("a record after the parser was built")


def sample(action: argparse.Action) -> list[str]:
    """One use of a mitmproxy argument, with a value of the type it takes."""
    if not action.option_strings:
        return ["~q"]
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return [flag]
    value = str(action.choices[-1]) if action.choices else "7" if action.type is int else "some-value"
    return [flag, value]


def mitmproxy_arguments(web: bool) -> list[tuple[str, list[str]]]:
    parser, _ = mitmproxy_parser(web)
    skip = {"help", "version", "options", "commands"}  # they exit
    return [(a.dest, sample(a)) for a in parser._actions if a.dest not in skip]


@pytest.mark.parametrize("web", [False, True], ids=["mitmdump", "mitmweb"])
def test_every_mitmproxy_argument_parses_as_mitmproxy_parses_it(web: bool) -> None:
    """Against mitmproxy's own list: each argument (its short spelling where it has one) means in
    `contextpaw` what it means to mitmdump/mitmweb, and ContextPaw's early read of its own arguments
    takes none of it."""
    theirs, ours = mitmproxy_parser(web)
    checked = 0
    for action in theirs._actions:
        if action.dest in {"help", "version", "options", "commands"}:
            continue
        argv = sample(action)
        expected = vars(theirs.parse_args(argv))
        got = vars(ours.parse_args(argv))
        assert {k: got[k] for k in expected} == expected, argv
        own, rest = cli.own_parser().parse_known_args(argv)
        assert vars(own) == vars(cli.own_parser().parse_args([])) and rest == argv, argv
        checked += 1
    assert checked > 40  # mitmproxy's addons' arguments are in the list, not just the core options


@pytest.mark.parametrize(
    "argv, option, value",
    [
        (["-w", "flows.mitm"], "save_stream_file", "flows.mitm"),
        (["--flow-detail", "3"], "flow_detail", 3),
        (["--anticache"], "anticache", True),
        (["-q"], "termlog_verbosity", "warn"),  # mitmproxy's -q would hide warnings too
        ([], "flow_detail", 0),  # one line per request, ContextPaw's
        (["-v"], "flow_detail", 2),
        (["~u /api/chat"], "dumper_filter", "~u /api/chat"),
        (["--set", "contextpaw_keep_recent=9"], "contextpaw_keep_recent", 9),
        (["--policy", "strict"], "contextpaw_policy", "strict"),
    ],
)
def test_mitmproxy_habits_reach_the_options(
    start: Callable[..., Any], argv: list[str], option: str, value: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # `-w` opens its file at start
    assert getattr(start("--ollama", URL, *argv), option) == value


def test_a_script_is_loaded(start: Callable[..., Any], tmp_path: Path) -> None:
    script = tmp_path / "extra.py"
    script.write_text("addons = []\n")
    assert start("--ollama", URL, "-s", str(script)).scripts == [str(script)]


@pytest.mark.parametrize(
    "name, value",
    [(name, "1" if isinstance(v, int) and not isinstance(v, bool) else "eager" if name == "connection_strategy" else "true")
     for name, v in cli.PRESETS.items()] + [("confdir", "/tmp/elsewhere"), ("contextpaw_policy", "strict")],
)  # fmt: skip
def test_set_on_the_command_line_wins_over_every_preset(start: Callable[..., Any], name: str, value: str) -> None:
    opts = start("--ollama", URL, "--set", f"{name}={value}")
    assert str(getattr(opts, name)).lower() == value


def test_presets_apply_when_not_set(start: Callable[..., Any], tmp_path: Path) -> None:
    opts = start("--ollama", URL)
    assert {name: getattr(opts, name) for name in cli.PRESETS} == cli.PRESETS
    assert opts.confdir == str(tmp_path)


def test_both_backends_get_a_loopback_reverse_mode_and_are_declared(start: Callable[..., Any]) -> None:
    opts = start("--ollama", URL, "--llamacpp", "http://127.0.0.1:8091", "--llamacpp-port", "9000")
    assert opts.mode == ["reverse:http://127.0.0.1:11435@127.0.0.1:11434", "reverse:http://127.0.0.1:8091@127.0.0.1:9000"]
    assert (opts.contextpaw_ollama, opts.contextpaw_llamacpp) == ([URL], ["http://127.0.0.1:8091"])


def test_a_mode_of_the_users_adds_to_the_backends(start: Callable[..., Any]) -> None:
    opts = start("--ollama", URL, "--mode", "regular@127.0.0.1:8080", "--set", "contextpaw_llamacpp=http://h:1")
    assert opts.mode == ["reverse:http://127.0.0.1:11435@127.0.0.1:11434", "regular@127.0.0.1:8080"]
    assert opts.contextpaw_llamacpp == ["http://h:1"]


def test_web_shows_the_comment_column(start: Callable[..., Any]) -> None:
    assert "comment" in start("--ollama", URL, "--web", "--web-port", "0", "--no-web-open-browser").web_columns


def test_a_url_without_a_scheme_is_plain_http_and_said_so() -> None:
    backends, notes = cli.fronted(cli.own_parser().parse_args(["--ollama", "127.0.0.1:21435"]))
    assert backends[0].url == "http://127.0.0.1:21435"
    assert notes == ["--ollama 127.0.0.1:21435 has no scheme: using http://127.0.0.1:21435 (write https:// for a backend that speaks TLS)"]
    assert cli.mitmproxy_args(backends)[:2] == ["--mode", "reverse:http://127.0.0.1:21435@127.0.0.1:11434"]


@pytest.mark.parametrize(
    "url, said",
    [("ftp://h:1", "write http://HOST:PORT"), ("http://h:port", "the port is not a number"), ("http://h:1/api", "write http://h:1")],
)
def test_a_bad_backend_url_says_what_to_write(url: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--llamacpp", url])
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("unknown", ["--port-x", "--bogus", "--keep-recents=3"])
def test_an_unknown_flag_is_named(unknown: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([unknown])
    assert exited.value.code != 0
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {unknown}" in err
    assert "--ollama URL" not in err


@pytest.mark.parametrize(
    "given, nearest",
    [("contextpaw_polcy=strict", "contextpaw_policy"), ("contextpaw_keep_recnt=3", "contextpaw_keep_recent"),
     ("contextpaw-ollama=http://h:1", "contextpaw_ollama")],
)  # fmt: skip
def test_a_misspelt_contextpaw_option_stops_the_start_naming_the_nearest(
    start: Callable[..., Any], given: str, nearest: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        start("--ollama", URL, "--set", given)
    assert exited.value.code == 1
    assert f"unknown option {given.partition('=')[0]} (did you mean {nearest}?)" in capsys.readouterr().err


def test_a_misspelt_contextpaw_option_in_config_yaml_stops_the_start(
    start: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text("contextpaw_polcy: strict\n")
    with pytest.raises(SystemExit):
        start("--ollama", URL)
    assert "unknown option contextpaw_polcy (did you mean contextpaw_policy?)" in capsys.readouterr().err


def test_a_backend_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([])
    assert "--ollama URL, --llamacpp URL, or both" in capsys.readouterr().err


def test_reading_flows_needs_no_backend(start: Callable[..., Any], tmp_path: Path) -> None:
    flows = tmp_path / "flows.mitm"
    flows.write_bytes(b"")
    assert start("-n", "-r", str(flows)).rfile == str(flows)


def test_help_names_set_health_and_mitmweb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0, "help asked for is no failure (mitmproxy's parser made it exit 1)"
    shown = " ".join(capsys.readouterr().out.split())
    for said in ("--set", "/contextpaw/health", "8081", "?token=", "contextpaw doctor", "contextpaw mcp", "strict: refuse"):
        assert said in shown
    for flag, (option, _, _) in cli.OLD_FLAGS.items():
        assert flag in shown and option in shown


def test_an_unknown_argument_is_a_usage_error_in_contextpaws_words(capsys: pytest.CaptureFixture[str]) -> None:
    """Beside --port, mitmproxy's parser first advised "--port is deprecated. Please use
    `--listen-port` instead", of ContextPaw's own flag, and exited 1."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--ollama", URL, "--port", "9999", "--bogus-flag"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "unrecognized arguments: --bogus-flag" in err and "deprecated" not in err


def test_version_names_contextpaw_and_mitmproxy(capsys: pytest.CaptureFixture[str]) -> None:
    from mitmproxy.version import VERSION

    from contextpaw.ops.admin import package_version

    with pytest.raises(SystemExit) as exited:
        cli.main(["--ollama", URL, "--version"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ContextPaw: {package_version()}"
    assert f"Mitmproxy: {VERSION}" in lines[1]


@pytest.mark.parametrize("web", [False, True], ids=["mitmdump", "mitmweb"])
def test_help_shows_contextpaws_flags_before_mitmproxys(web: bool) -> None:
    _, ours = mitmproxy_parser(web)
    shown = ours.format_help()
    first = shown.index("--ollama URL")
    assert first < shown.index("--keep-recent") < shown.index("--set option")
    assert first < shown.index("-h, --help") and first < shown.index("--listen-port")
    assert shown[:first].count("\n") < 10  # right after the usage and the description


OLD_FLAG_VALUES = {
    "--keep-recent": ("7", 7),
    "--headroom": ("15", "15"),
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


@pytest.mark.parametrize("flag", sorted(cli.OLD_FLAGS))
def test_each_earlier_proxy_flag_sets_its_option(start: Callable[..., Any], flag: str) -> None:
    given, expected = OLD_FLAG_VALUES[flag]
    argv = ["--ollama", URL, "--llamacpp", "http://127.0.0.1:8091", flag, *([given] if given is not None else [])]
    if flag == "--arbitrate":  # it needs the command that starts llama-server
        argv += ["--llamacpp-cmd", f"{sys.executable} -c pass"]
    assert getattr(start(*argv), cli.OLD_FLAGS[flag][0]) == expected


def test_every_earlier_proxy_flag_has_a_value_under_test() -> None:
    assert set(OLD_FLAG_VALUES) == set(cli.OLD_FLAGS)


def test_the_startup_line_names_version_policy_backends_and_mitmweb() -> None:
    opts = argparse.Namespace(
        contextpaw_ollama=[URL], contextpaw_llamacpp=[], contextpaw_policy="strict", listen_host="", listen_port=8080,
        mode=["reverse:http://127.0.0.1:11435@127.0.0.1:11434", "reverse:http://127.0.0.1:8091@127.0.0.1:8092"],
        web_host="127.0.0.1", web_port=8081,
    )  # fmt: skip
    line = cli.startup_line(opts)
    assert line.startswith("contextpaw ") and "policy strict" in line
    assert "ollama http://127.0.0.1:11435 at http://127.0.0.1:11434" in line
    assert "kind found on first contact http://127.0.0.1:8091 at http://127.0.0.1:8092" in line
    assert "mitmweb at http://127.0.0.1:8081/" in line


def test_the_startup_line_without_a_server_names_no_listener() -> None:
    """`contextpaw -n -r flows.mitm`: mitmproxy's default mode is still in the options, but nothing listens."""
    opts = argparse.Namespace(
        contextpaw_ollama=[], contextpaw_llamacpp=[], contextpaw_policy="compact", listen_host="", listen_port=8080,
        mode=["regular"], server=False,
    )  # fmt: skip
    line = cli.startup_line(opts)
    assert line.endswith("policy compact: no proxy server (-n)")
    assert "0.0.0.0" not in line and "health" not in line


def test_a_reverse_mode_that_speaks_tls_to_a_plain_http_backend_is_refused(
    start: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """mitmproxy takes a reverse spec without a scheme for https; ContextPaw's option says http."""
    with pytest.raises(SystemExit):
        start("--mode", "reverse:127.0.0.1:11435@127.0.0.1:0", "--set", f"contextpaw_ollama={URL}")
    assert f"write --mode reverse:{URL}" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def no_contextpaw_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' own environment names none of the command's variables."""
    for name in [n for n in os.environ if n.startswith("CONTEXTPAW_")]:
        monkeypatch.delenv(name)


def test_each_contextpaw_flag_has_a_variable_named_after_it_shown_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    variables = {cli.env_name(a) for a in cli.own_actions(cli.own_parser())}
    assert {"CONTEXTPAW_OLLAMA", "CONTEXTPAW_LLAMACPP", "CONTEXTPAW_PORT", "CONTEXTPAW_LLAMACPP_PORT",
            "CONTEXTPAW_HOST", "CONTEXTPAW_POLICY", "CONTEXTPAW_CONFDIR", "CONTEXTPAW_WEB",
            "CONTEXTPAW_KEEP_RECENT", "CONTEXTPAW_MIN_HOLD"} <= variables  # fmt: skip
    assert len(variables) == len(cli.own_actions(cli.own_parser()))
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for variable in variables:
        assert f"[env {variable}]" in shown


def test_the_environment_names_a_backend_and_where_it_listens(start: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTPAW_LLAMACPP", "127.0.0.1:8091")
    monkeypatch.setenv("CONTEXTPAW_LLAMACPP_PORT", "9001")
    monkeypatch.setenv("CONTEXTPAW_HOST", "127.0.0.2")
    monkeypatch.setenv("CONTEXTPAW_SUMMARIZE", "yes")
    opts = start()
    assert opts.mode == ["reverse:http://127.0.0.1:8091@127.0.0.2:9001"]
    assert opts.contextpaw_llamacpp == ["http://127.0.0.1:8091"] and opts.contextpaw_summarize is True


@pytest.mark.parametrize(
    "in_file, in_env, argv, expected",
    [
        (True, False, [], 5),
        (True, True, [], 6),
        (True, True, ["--set", "contextpaw_keep_recent=7"], 7),
        (True, True, ["--set", "contextpaw_keep_recent=7", "--keep-recent", "8"], 8),
        (False, True, ["--set", "contextpaw_keep_recent=7"], 7),
        (True, False, ["--set", "contextpaw_keep_recent=7"], 7),
        (False, False, [], 4),
    ],
    ids=["file", "env over file", "set over env", "flag over set", "set over env alone", "set over file", "default"],
)
def test_the_command_line_wins_over_the_environment_which_wins_over_config_yaml(
    start: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    in_file: bool, in_env: bool, argv: list[str], expected: int,
) -> None:  # fmt: skip
    if in_file:
        (tmp_path / "config.yaml").write_text("contextpaw_keep_recent: 5\n")
    if in_env:
        monkeypatch.setenv("CONTEXTPAW_KEEP_RECENT", "6")
    assert start("--ollama", URL, *argv).contextpaw_keep_recent == expected


def test_a_set_wins_over_config_yaml_for_any_option(start: Callable[..., Any], tmp_path: Path) -> None:
    """mitmproxy itself reads config.yaml after --set, so the file would win."""
    (tmp_path / "config.yaml").write_text("contextpaw_margin: 80\ncontextpaw_policy: strict\n")
    opts = start("--ollama", URL, "--set", "contextpaw_margin=90")
    assert (opts.contextpaw_margin, opts.contextpaw_policy) == (90, "strict")


def test_the_confdir_from_the_environment_is_where_config_yaml_is_read(
    start: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text("contextpaw_policy: strict\n")
    monkeypatch.setenv("CONTEXTPAW_CONFDIR", str(elsewhere))
    opts = start("--ollama", URL)
    assert (opts.confdir, opts.contextpaw_policy) == (str(elsewhere), "strict")


@pytest.mark.parametrize(
    "variable, value, said",
    [
        ("CONTEXTPAW_LLAMACPP_PORT", "80x", "environment variable CONTEXTPAW_LLAMACPP_PORT: invalid int value: '80x'"),
        ("CONTEXTPAW_POLICY", "strcit", "environment variable CONTEXTPAW_POLICY: invalid choice: 'strcit'"),
        ("CONTEXTPAW_WEB", "maybe", "environment variable CONTEXTPAW_WEB: 'maybe' is not a switch; write 1 or 0"),
        ("CONTEXTPAW_OLLAMA", "ftp://h:1", "CONTEXTPAW_OLLAMA 'ftp://h:1' is not a backend URL"),
        ("CONTEXTPAW_LLAMACPP", "http://h:1/api", "CONTEXTPAW_LLAMACPP 'http://h:1/api': a backend is a server"),
    ],
)
def test_a_bad_value_in_the_environment_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str, said: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        cli.main([] if variable.endswith(("OLLAMA", "LLAMACPP")) else ["--ollama", URL])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_a_flag_wins_over_its_variable(start: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTPAW_OLLAMA", "http://127.0.0.1:1")
    monkeypatch.setenv("CONTEXTPAW_POLICY", "off")
    opts = start("--ollama", URL, "--policy", "strict")
    assert (opts.contextpaw_ollama, opts.contextpaw_policy) == ([URL], "strict")
    assert opts.mode == ["reverse:http://127.0.0.1:11435@127.0.0.1:11434"]


def test_a_backend_in_config_yaml_is_fronted_as_its_flag_would(start: Callable[..., Any], tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("contextpaw_llamacpp: [127.0.0.1:8091]\ncontextpaw_policy: strict\n")
    opts = start("--llamacpp-port", "9002")
    assert opts.mode == ["reverse:http://127.0.0.1:8091@127.0.0.1:9002"]
    assert (opts.contextpaw_llamacpp, opts.contextpaw_policy) == (["http://127.0.0.1:8091"], "strict")


def test_a_backend_in_config_yaml_adds_to_the_other_kinds_flag(start: Callable[..., Any], tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("contextpaw_llamacpp: [http://127.0.0.1:8091]\n")
    opts = start("--ollama", URL)
    assert opts.mode == ["reverse:http://127.0.0.1:11435@127.0.0.1:11434", "reverse:http://127.0.0.1:8091@127.0.0.1:8092"]


@pytest.mark.parametrize("given", [["--ollama", URL], []], ids=["flag", "environment"])
def test_the_flag_or_the_environment_wins_over_a_backend_in_config_yaml(
    start: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: list[str]
) -> None:
    (tmp_path / "config.yaml").write_text("contextpaw_ollama: [http://127.0.0.1:1]\n")
    if not given:
        monkeypatch.setenv("CONTEXTPAW_OLLAMA", URL)
    opts = start(*given)
    assert (opts.mode, opts.contextpaw_ollama) == (["reverse:http://127.0.0.1:11435@127.0.0.1:11434"], [URL])


def test_a_mode_of_the_users_keeps_config_yamls_backend_a_kind_only(start: Callable[..., Any], tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("contextpaw_ollama: [http://127.0.0.1:1]\n")
    opts = start("--mode", "regular@127.0.0.1:8080")
    assert (opts.mode, opts.contextpaw_ollama) == (["regular@127.0.0.1:8080"], ["http://127.0.0.1:1"])


def test_two_backends_of_a_kind_in_config_yaml_need_modes_of_their_own(
    start: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text("contextpaw_ollama: [http://127.0.0.1:1, http://127.0.0.1:2]\n")
    with pytest.raises(SystemExit):
        start()
    assert "contextpaw_ollama names 2 backends" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "said"),
    [("contextpaw_keep_recent: lots", "contextpaw_keep_recent must be a whole number, not a str"),
     ("contextpaw_llamacpp: http://127.0.0.1:9", "contextpaw_llamacpp must be a list ([a, b], or one '- a' a line), not a str")],
)  # fmt: skip
def test_a_config_file_value_of_the_wrong_type_is_one_line_naming_the_option_and_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, said: str
) -> None:
    """mitmproxy reads config.yaml unchecked, and its TypeError came out as a 36-line traceback."""
    (tmp_path / "config.yaml").write_text(line + "\n")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--llamacpp", URL, "--confdir", str(tmp_path), "--port", "0", "--llamacpp-port", "0"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert err.strip() == f"contextpaw: {said}, in {tmp_path / 'config.yaml'}"


def test_flows_read_back_are_shown_a_line_each(tmp_path: Path) -> None:
    """`contextpaw -n -r flows.mitm`, the documented way to read flows back, printed nothing: the
    preset flow_detail=0 (a running proxy's terminal keeps to ContextPaw's lines) hid them."""
    import subprocess
    import sys

    from mitmproxy import io
    from mitmproxy.test import tflow

    flows = tmp_path / "flows.mitm"
    flow = tflow.tflow(resp=True)
    flow.request.path = "/v1/chat/completions/read-back"
    with flows.open("wb") as f:
        io.FlowWriter(f).add(flow)
    done = subprocess.run([sys.executable, "-m", "contextpaw.command.cli", "-n", "-r", str(flows), "--confdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and "/v1/chat/completions/read-back" in done.stdout, done.stdout + done.stderr


def test_the_doctor_without_a_backend_says_it_has_nothing_to_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With no arguments it reported "listens on every interface" of a listener contextpaw never
    opens (without a backend the command does not start), a false PROBLEM and exit 1."""
    assert cli.run_doctor(["--confdir", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "names no backend" in out and "every interface" not in out


def test_the_doctor_without_a_backend_says_which_servers_answer_at_their_default_ports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, llamacpp: Any
) -> None:
    """A user who started llama-server without `--port` and ran the doctor bare is told where it is
    and what to give ContextPaw; a default port nothing answers on is not named."""
    from contextpaw import wire
    from contextpaw.command import doctor

    monkeypatch.setattr(doctor, "DEFAULT_BACKENDS", {wire.Kind.OLLAMA: ("http://127.0.0.1:9", "Ollama's default port"),
                                                     wire.Kind.LLAMACPP: (llamacpp.url, "llama-server's default port")})  # fmt: skip
    assert cli.run_doctor(["--confdir", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert f"--llamacpp {llamacpp.url} (llama-server answers there: llama-server's default port)" in out
    assert "127.0.0.1:9" not in out


def test_the_doctor_reads_the_backends_config_yaml_fronts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The set-up docs/command.md shows (a backend in config.yaml, nothing on the command line) is
    checked as the command runs it: on the loopback, at the kind's port."""
    (tmp_path / "config.yaml").write_text("contextpaw_llamacpp: [http://127.0.0.1:9]\n")
    cli.run_doctor(["--confdir", str(tmp_path), "--timeout", "2"])
    out = capsys.readouterr().out
    assert "ok      listener reverse:http://127.0.0.1:9@127.0.0.1:8092: on the loopback" in out
    assert "every interface" not in out and "http://127.0.0.1:9: does not answer" in out


def test_an_ollama_too_slow_to_list_its_models_is_unchecked_not_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With a short --timeout it said "has no model to check", advised `ollama pull` for a model
    that exists, and ended "no problems found", exit 0."""
    import asyncio

    from aiohttp import web

    from support.common import running

    async def root(request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(4)
        return web.json_response({"models": [{"name": "qwen3:8b"}]})

    app = web.Application()
    app.router.add_get("/", root)
    app.router.add_get("/api/ps", slow)
    app.router.add_get("/api/tags", slow)
    with running(app) as url:
        status = cli.run_doctor(["--ollama", url, "--confdir", str(tmp_path), "--timeout", "1"])
    out = capsys.readouterr().out
    assert status == 3 and "did not list its models within 1 s" in out, out
    assert "ollama pull" not in out and "no problems found" in out and "could not be checked" in out


def test_a_port_another_program_holds_is_said_with_the_flag_that_chose_it(capsys: pytest.CaptureFixture[str]) -> None:
    """mitmproxy said `[Errno 98] reverse proxy to ... failed to listen ... address already in use`."""
    import socket

    from support.common import free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            cli.main(["--llamacpp", URL, "--llamacpp-port", str(port), "--port", str(free_port())])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"port {port} on 127.0.0.1 (--llamacpp-port" in err and "Errno" not in err


def test_mitmwebs_status_bar_names_the_listener_contextpaw_opened() -> None:
    """It showed `*:8080`, mitmproxy's default, for a proxy listening elsewhere: where every mode
    names its own address, the first one's is the options' too; not where the user set them, nor
    where a mode of theirs listens at the options' address."""
    modes = ["reverse:http://127.0.0.1:11435@127.0.0.1:11434", "reverse:http://127.0.0.1:8091@127.0.0.1:8092"]
    assert cli.web_footer(modes, set()) == {"listen_host": "127.0.0.1", "listen_port": 11434}
    assert cli.web_footer(modes, {"listen_port"}) == {}
    assert cli.web_footer([*modes, "regular"], set()) == {}
