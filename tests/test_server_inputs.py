"""The HTTP server against malformed, slow and vanishing clients: a real server, real sockets.

The fast cases run the server in this process (no model: a malformed request never reaches the
rank loop); the slow one loads the tiny model once and covers the requests that do run (a client
gone mid-generation, SIGTERM while a request runs)."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from generation import ROOT
from harness.multirank import free_port
from http_client import health, post
from utils.runtime.requests.image_requests import ImageRequest, RequestChecker
from utils.runtime.http.image_server import ImageServer

DEFAULTS = ImageRequest(prompt="", seed=None, image_size="64x64", diff_infer_steps=2)


@pytest.fixture(scope="module")
def server(tiny_model):
    lines = []
    srv = ImageServer("127.0.0.1", 0, DEFAULTS, RequestChecker(tiny_model), 2, 2, lines.append, client_timeout=1.0)
    srv.lines = lines
    srv.loaded.set()
    srv.start()
    yield srv
    srv.close()


def exchange(server, raw: bytes, timeout=10):
    """Send raw bytes on a fresh connection; (status, JSON body) of the answer."""
    host, port = server.server_address
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = response.read()
    return response.status, json.loads(body), dict(response.getheaders())


def post_raw(body: bytes, extra_headers=b"") -> bytes:
    return (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra_headers
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


MALFORMED = {
    "garbage_request_line": (b"\x16\x03\x01 garbage \xff\xfe\r\n\r\n", 400, None),
    "two_word_request_line": (b"HELLO THERE\r\n\r\n", 400, None),
    "http_version_2": (b"GET /health HTTP/2.0\r\n\r\n", 400, None),
    "put": (b"PUT /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, None),
    "delete": (b"DELETE /health HTTP/1.1\r\nHost: x\r\n\r\n", 405, None),
    "unknown_method": (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 405, None),
    "content_length_superscript_two": (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: \xc2\xb2"
                                       b"\r\n\r\n{}", 400, None),
    "content_length_negative": (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                                400, None),
    "no_content_length": (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n\r\n", 411, None),
    "json_nested_200000_deep": (post_raw(b"[" * 200000 + b"]" * 200000), 400, None),
    "json_object_nested_deep": (post_raw(b'{"a":' * 100000 + b"1" + b"}" * 100000), 400, None),
    "lone_surrogate_prompt": (post_raw(b'{"prompt": "a fox \\ud800"}'), 400, "prompt"),
    "body_not_utf8": (post_raw(b'{"prompt": "caf\xe9"}'), 400, None),
    "body_a_list": (post_raw(b"[1, 2]"), 400, "body"),
    "steps_a_billion": (post_raw(b'{"prompt": "x", "steps": 1000000000}'), 400, "steps"),
    "seed_a_float": (post_raw(b'{"prompt": "x", "seed": 1.5}'), 400, "seed"),
    "step_cache_unknown_mode": (post_raw(b'{"prompt": "x", "step_cache": "fast"}'), 400, "step_cache.mode"),
    "step_cache_interval_zero": (post_raw(b'{"prompt": "x", "step_cache": {"mode": "taylor", "interval": 0}}'), 400,
                                 "step_cache.interval"),
    "size_too_large": (post_raw(b'{"prompt": "x", "size": "99999x99999"}'), 400, "size"),
    "unknown_path": (b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n", 404, None),
    "headers_over_32_kib": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", 431, None),
    "no_host_header": (b"GET /health HTTP/1.1\r\n\r\n", 400, None),                   # RFC 9112 3.2
    "header_value_with_nul": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Note: a\x00b\r\n\r\n", 400, None),   # RFC 9110 5.5
    "authorization_with_nul": (post_raw(b'{"prompt": "x"}', b"Authorization: Bearer k\x00ey\r\n"), 400, None),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_malformed_request_gets_a_json_4xx_and_serving_goes_on(server, case, capfd):
    raw, status, param = MALFORMED[case]
    code, payload, _ = exchange(server, raw)
    assert code == status and 400 <= code < 500, (code, payload)
    assert set(payload["error"]) >= {"message", "type", "param", "code"} and payload["error"]["code"] == code
    if param is not None:           # a schema refusal: field, problem and fix, apart and as one message
        error = payload["error"]
        assert error["param"] == param and error["message"] == f"{param}: {error['problem']}; {error['fix']}", error
    code, payload, _ = exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 200 and payload["status"] == "ok"
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("path", ["/", "/page.js", "/health", "/v1/models", "/metrics", "/admin"])
def test_head_answers_as_get_does_without_the_body(server, path):
    """HEAD wherever GET is served (RFC 9110 9.3.2): GET's status and headers, Content-Length
    included, and no body; then the connection serves the next request as usual."""
    host, port = server.server_address
    with socket.create_connection((host, port), timeout=60) as sock:
        answers = []
        for method in ("HEAD", "GET"):
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            response = http.client.HTTPResponse(sock, method=method)
            response.begin()
            answers.append((response.status, response.getheader("Content-Type"),
                            int(response.getheader("Content-Length")), response.read()))
    (head_status, head_type, head_length, head_body), (status, content_type, length, body) = answers
    if path == "/metrics":      # process_cpu_seconds and the GC counts move between the two answers
        assert abs(head_length - len(body)) <= 64, answers
        head_length = len(body)
    assert (head_status, head_type, head_length, head_body) == (status, content_type, len(body), b""), answers
    assert (status == 404) == (path == "/admin")


def test_slow_and_half_open_clients_are_timed_out_in_one_line_each(server, capfd):
    host, port = server.server_address
    before = len(server.lines)
    half_open = []
    for i in range(20):
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\n" if i % 2 else
                     b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        half_open.append(sock)
    code, payload, _ = exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 200 and payload["status"] == "ok"          # served beside them: they hold no lock, no model
    for sock in half_open:             # each is dropped after --client-timeout (1 s here)
        sock.settimeout(10)
        assert sock.recv(65536) is not None
        sock.close()
    deadline = time.monotonic() + 10
    while len(server.lines) - before < 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    new = server.lines[before:]
    dropped = [line for line in new if "timed out" in line or "client gone" in line or "dropped" in line]
    assert len(dropped) >= 20, new
    assert all("\n" not in line for line in new)
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_that_disconnects_mid_body_is_one_line(server, capfd):
    host, port = server.server_address
    before = len(server.lines)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"pro")
    deadline = time.monotonic() + 10
    while len(server.lines) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(server.lines) > before and "Traceback" not in capfd.readouterr().err
    code, _, _ = exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 200


def serving(model, tmp_path, *flags) -> tuple:
    """(the process, its port, its log) of `run_image_gen.py --serve` on `model` in a session of its own,
    once /health says it is loaded."""
    port = free_port()
    cmd = [sys.executable, "run_image_gen.py", "--serve", "--port", str(port), *flags,
           "--model-id", str(model), "--device", "cpu", "--image-size", "64x64", "--diff-infer-steps", "2"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while health(f"http://127.0.0.1:{port}")[0] != 200:
        if server.poll() is not None or time.time() > deadline:
            server.kill()
            raise AssertionError(log_path.read_text()[-3000:])
        time.sleep(0.5)
    return server, port, log_path


@pytest.mark.slow
def test_real_server_survives_vanishing_clients_and_answers_the_running_request_on_sigterm(tiny_model, tmp_path):
    """One rank, one load: a client gone mid-generation costs one log line; SIGTERM while a request
    runs still answers it with 200, then the server exits 0; no traceback anywhere in its output."""
    server, port, log_path = serving(tiny_model, tmp_path, "--client-timeout", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        half_open = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for sock in half_open:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\n")
        code, payload = post(url, {"prompt": "a fox", "seed": 1})
        assert code == 200 and payload["data"][0]["size"] == "64x64", payload

        with socket.create_connection(("127.0.0.1", port)) as gone:       # asks for an image, then leaves
            body = json.dumps({"prompt": "a cat", "seed": 2}).encode()
            gone.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            while not health(url)[1].get("busy"):
                time.sleep(0.02)
        for sock in half_open:
            sock.close()
        code, payload = post(url, {"prompt": "a bird", "seed": 3})
        assert code == 200, payload

        running = []
        thread = threading.Thread(target=lambda: running.append(post(url, {"prompt": "last", "seed": 4})))
        thread.start()
        while not health(url)[1].get("busy"):
            time.sleep(0.02)
        os.killpg(server.pid, signal.SIGTERM)
        thread.join(120)
        assert running and running[0][0] == 200, running
        assert server.wait(120) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert "Traceback" not in text and "server stopped" in text, text[-3000:]


@pytest.mark.slow
def test_sigterm_stops_accepting_and_exits_within_the_shutdown_timeout(tiny_model, tmp_path):
    """A request of 1000 steps runs and another waits when SIGTERM comes: the waiting one gets 503 at
    once, no new connection is taken, the running one is cancelled --shutdown-timeout (1 s) later and
    answered 503, and the server exits 0 within seconds, not after the 1000 steps."""
    server, port, log_path = serving(tiny_model, tmp_path, "--shutdown-timeout", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        answers = {}
        long = threading.Thread(target=lambda: answers.update(long=post(url, {"prompt": "long", "steps": 1000})))
        long.start()
        while not health(url)[1].get("busy"):
            time.sleep(0.02)
        queued = threading.Thread(target=lambda: answers.update(queued=post(url, {"prompt": "next"})))
        queued.start()
        while health(url)[1].get("queue_depth") != 1:
            time.sleep(0.02)
        stopped_at = time.monotonic()
        os.killpg(server.pid, signal.SIGTERM)
        queued.join(30)
        assert answers["queued"][0] == 503, answers
        with pytest.raises(ConnectionRefusedError):                # the listening socket is closed
            socket.create_connection(("127.0.0.1", port), timeout=5)
        long.join(60)
        assert answers["long"][0] == 503 and "shutting down" in answers["long"][1]["error"]["message"], answers
        assert server.wait(60) == 0
        assert time.monotonic() - stopped_at < 30, "the server outlived its shutdown timeout by far"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert "Traceback" not in text and "cancelled at its next denoising step" in text, text[-3000:]
