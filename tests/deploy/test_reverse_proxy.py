"""examples/nginx-tokenmill.conf in front of a live `tokenmill serve` (the tiny random Llama): TLS with a
self-signed certificate, API keys checked by tokenmill through the proxy, streams passed on chunk by chunk,
/health and /metrics reachable, plain HTTP to the TLS port refused, nginx's own refusals in OpenAI's
error shape.

The example runs as it is, with only the ports, the certificate paths and the per-client connection limit
(64 -> 1, so that one open stream reaches it) substituted. nginx runs unprivileged (as `nobody` when the
tests run as root) with its files in a temporary directory. Needs Debian's nginx package (`make test`
installs it); skipped without it.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from proc_util import free_ports, stop_process
from server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nginx-tokenmill.conf"
KEY = "sk-behind-the-proxy"


def nginx_binary() -> str:
    path = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)),
                                         None)
    if path is None:
        pytest.skip("nginx is not installed (Debian's nginx-light package; `make test` installs it)")
    return path


def render(example: str, upstream_port: int, tls_port: int, cert: Path, key: Path) -> str:
    """The example with this test's ports and files; each replaced text must occur exactly once, so an
    edit of the example that this test no longer matches fails here rather than testing something else."""
    replacements = {
        "server 127.0.0.1:8000;": f"server 127.0.0.1:{upstream_port};",
        "listen 443 ssl;": f"listen 127.0.0.1:{tls_port} ssl;",
        "/etc/ssl/tokenmill/fullchain.pem;": f"{cert};",
        "/etc/ssl/tokenmill/privkey.pem;": f"{key};",
        "limit_conn tokenmill_per_client 64;": "limit_conn tokenmill_per_client 1;",
    }
    for old, new in replacements.items():
        assert example.count(old) == 1, f"{old!r} should occur once in {EXAMPLE.name}"
        example = example.replace(old, new)
    return example


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def nginx_conf(directory: Path, site: Path) -> str:
    """A minimal main configuration around the example (Debian's /etc/nginx/nginx.conf plays this part):
    every file nginx writes kept under `directory`."""
    temp = "\n".join(f"    {name}_temp_path {directory / name};"
                     for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"worker_processes 1;\nevents {{ worker_connections 256; }}\nhttp {{\n{temp}\n"
            f"    access_log {directory / 'access.log'};\n    include {site};\n}}\n")


class Nginx:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.error_log = directory / "error.log"
        conf = directory / "nginx.conf"
        cmd = [nginx_binary(), "-p", str(directory), "-c", str(conf), "-e", str(self.error_log),
               "-g", f"daemon off; pid {directory / 'nginx.pid'}; error_log {self.error_log} info;"]
        as_user = {}
        if os.geteuid() == 0:  # never run the proxy as root: it needs no privilege on high ports
            nobody = pwd.getpwnam("nobody")
            for path in (directory, *directory.iterdir()):
                os.chown(path, nobody.pw_uid, nobody.pw_gid)
            as_user = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        check = subprocess.run([*cmd, "-t"], capture_output=True, text=True, timeout=30, **as_user)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **as_user)

    def wait_listening(self, port: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}:\n{self.log()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"nginx is not listening on {port}:\n{self.log()}")

    def log(self) -> str:
        return self.error_log.read_text(errors="replace") if self.error_log.exists() else ""

    def stop(self) -> None:
        stop_process(self.proc, 15, signal.SIGQUIT)  # graceful: workers finish, then the master exits


class Proxy:
    def __init__(self, url: str, tls_port: int, context: ssl.SSLContext, server: ServerProcess, nginx: Nginx) -> None:
        self.url, self.tls_port, self.context, self.server, self.nginx = url, tls_port, context, server, nginx

    def client(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, verify=self.context, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def proxy(tiny_llama_dir) -> Iterator[Proxy]:
    nginx_binary()  # skip before starting anything
    directory = Path(tempfile.mkdtemp(prefix="tokenmill-nginx-"))
    # `tokenmill serve` on the loopback, as the example expects it.
    server = ServerProcess(["--model", str(tiny_llama_dir), "--api-key", KEY, "--max-model-len", "1024",
                            "--num-kv-blocks", "128", "--shutdown-timeout", "5", "--disable-log-stats"],
                           directory, entry=("-m", "tokenmill.entrypoints.cli", "serve"))
    nginx = None
    try:
        cert, key = self_signed_certificate(directory)
        # The server may not have bound its port yet: nginx's must differ from it.
        tls_port = next(port for port in free_ports(2) if port != server.port)
        site = directory / "tokenmill.conf"
        site.write_text(render(EXAMPLE.read_text(), server.port, tls_port, cert, key))
        (directory / "nginx.conf").write_text(nginx_conf(directory, site))
        nginx = Nginx(directory)
        nginx.wait_listening(tls_port)
        server.wait_ready()
        yield Proxy(f"https://127.0.0.1:{tls_port}", tls_port, ssl.create_default_context(cafile=str(cert)),
                    server, nginx)
    finally:
        if nginx is not None:
            nginx.stop()
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_tokenmill_checks_the_key_behind_the_proxy(proxy):
    body = {"prompt": "Hello", "max_tokens": 4}
    with proxy.client() as client:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    for key in (None, "sk-wrong"):
        with proxy.client(key) as client:
            response = client.post("/v1/completions", json=body)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert set(error) == {"message", "type", "param", "code"}
        assert response.headers["www-authenticate"] == "Bearer"


def test_a_stream_arrives_chunk_by_chunk(proxy):
    """Each token's SSE event leaves nginx as it arrives: the first is read in the first half of the
    stream's time (with proxy_buffering on, every event arrives at once when the stream ends)."""
    body = {"prompt": "Hello", "max_tokens": 32, "ignore_eos": True, "stream": True}
    times: list[float] = []  # when each event was read
    events: list[str] = []
    with proxy.client() as client:
        start = time.monotonic()
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            pending = ""
            for text in response.iter_text():
                pending += text
                *complete, pending = pending.split("\n\n")
                for block in complete:
                    if block.startswith("data: "):
                        events.append(block[len("data: "):])
                        times.append(time.monotonic() - start)
    assert events[-1] == "[DONE]" and len(events) >= 16, events
    assert times[0] < 0.5 * times[-1], times
    assert len({round(t, 3) for t in times}) >= 8, times  # read in many pieces, not one block


def test_health_and_metrics_pass_through(proxy):
    with proxy.client(None) as client:  # no key: tokenmill asks for one on /v1/* only
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "tokenmill:" in metrics.text


def test_plain_http_to_the_tls_port_is_refused(proxy):
    response = httpx.get(f"http://127.0.0.1:{proxy.tls_port}/health", timeout=10)
    assert response.status_code == 400 and "plain HTTP request was sent to HTTPS port" in response.text
    # Nor does TLS pass without trusting the certificate.
    with pytest.raises(httpx.ConnectError):
        httpx.get(proxy.url + "/health", timeout=10)


def test_the_proxy_body_limit_is_tokenmills_not_nginxs_default(proxy):
    """2 MiB passes nginx (its default limit is 1 MB) and reaches tokenmill; 17 MiB stops at nginx."""
    json_type = {"content-type": "application/json"}
    with proxy.client() as client:
        passed = client.post("/v1/completions", content=b"{" + b" " * (2 * 1024 * 1024), headers=json_type)
        refused = client.post("/v1/completions", content=b"x" * (17 * 1024 * 1024), headers=json_type)
    assert passed.status_code == 400 and passed.json()["error"]["type"] == "invalid_request_error", passed.text
    assert refused.status_code == 413
    error = refused.json()["error"]
    assert error["code"] == "request_too_large" and "proxy limit" in error["message"]


def test_a_second_connection_over_the_limit_is_429_in_openai_shape(proxy):
    """One stream open from this address holds the (test's) limit of one connection."""
    body = {"prompt": "Hello", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with proxy.client() as client, client.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a discarded iterator would close the stream
        next(lines)  # the stream has started
        with proxy.client() as second:
            refused = second.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    with proxy.client() as client:  # the closed stream freed its connection
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_stopped_server_is_a_502_in_openai_shape(proxy):
    """Runs last in this module: it stops the server behind the proxy."""
    proxy.server.stop()
    with proxy.client() as client:
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"
