"""examples/tokenmill.service: systemd accepts it (`systemd-analyze verify`, which warns about any key or
value it would ignore), `tokenmill serve` accepts its flags, a stop leaves the drain its time, and it sits
where the nginx example expects it."""
from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.entrypoints.cli import build_parser
from tokenmill.entrypoints.engine_args import engine_config_from_args
from tokenmill.entrypoints.openai.cli_args import server_config_from_args

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UNIT = EXAMPLES / "tokenmill.service"
# What the server does after its drain before it exits (stopping the engine core): well under this.
ENGINE_SHUTDOWN_MARGIN_S = 15


def read_unit(text: str) -> configparser.ConfigParser:
    """The unit as sections of keys; systemd's backslash-continued lines joined first."""
    parser = configparser.ConfigParser(interpolation=None, strict=False, delimiters=("=",))
    parser.optionxform = str  # systemd's keys are case-sensitive
    parser.read_string(re.sub(r"\\\n\s*", " ", text))
    return parser


@pytest.fixture(scope="module")
def unit() -> configparser.ConfigParser:
    return read_unit(UNIT.read_text())


def exec_start(unit) -> list[str]:
    return shlex.split(unit["Service"]["ExecStart"])


def test_systemd_accepts_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package; `make test` installs it)")
    # verify checks that ExecStart's program exists: point it at this environment's tokenmill.
    program = Path(sys.executable).with_name("tokenmill")
    assert program.exists(), f"{program}: tokenmill's console script (pip install -e .)"
    text = UNIT.read_text()
    assert text.count("/opt/tokenmill/bin/tokenmill ") == 1
    copy = tmp_path / "tokenmill.service"
    copy.write_text(text.replace("/opt/tokenmill/bin/tokenmill ", f"{program} "))
    result = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # A key systemd does not know, or a value it cannot parse, is only a warning: none is allowed.
    assert (result.stdout + result.stderr).strip() == ""


def test_tokenmill_serve_accepts_the_flags(unit):
    argv = exec_start(unit)
    assert argv[0].endswith("/tokenmill") and argv[1] == "serve"
    args = build_parser().parse_args(argv[1:])  # a flag it does not know exits here (status 2)
    server = server_config_from_args(args)
    engine = engine_config_from_args(args)
    assert engine.model == "/models/model.gguf"
    # Behind the proxy: on the loopback, at the nginx example's upstream.
    assert (server.host, server.port) == ("127.0.0.1", 8000)
    assert "server 127.0.0.1:8000;" in (EXAMPLES / "nginx-tokenmill.conf").read_text()
    assert server.api_keys_file == "/etc/tokenmill/keys.json"


def test_a_stop_drains_before_systemd_kills(unit):
    service = unit["Service"]
    server = server_config_from_args(build_parser().parse_args(exec_start(unit)[1:]))
    assert service["KillSignal"] == "SIGTERM"
    # SIGTERM to the server alone: the engine core must outlive the drain, and the server stops it.
    assert service["KillMode"] == "mixed"
    stop_s = float(service["TimeoutStopSec"].removesuffix("s"))
    assert stop_s >= server.shutdown_timeout + ENGINE_SHUTDOWN_MARGIN_S
    # The proxy waits for a request at least as long as tokenmill may take over it.
    proxy_read_s = float(re.search(r"proxy_read_timeout (\d+)s;", (EXAMPLES / "nginx-tokenmill.conf").read_text())[1])
    assert server.request_timeout is not None and proxy_read_s > server.request_timeout


def test_it_runs_unprivileged_and_restarts_after_an_engine_failure(unit):
    service = unit["Service"]
    assert service["User"] not in ("", "root") and service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert service["CapabilityBoundingSet"] == ""
    # The API key comes from a file systemd reads, not from the command line (visible in ps).
    assert service["EnvironmentFile"].startswith("/etc/")
    assert "--api-key" not in exec_start(unit)
    assert unit["Install"]["WantedBy"] == "multi-user.target"
