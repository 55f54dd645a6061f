"""The HTTP stack against the clients people use: keep-alive pools, slow and many clients, Prometheus,
CORS, request ids, OpenAPI, and the API's fields. A real server in this process on real sockets (no
model runs: what a running request gets is test_server_openai.py's)."""
import http.client
import io
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
from PIL import Image

from generation import ROOT
from http_client import metric
from utils.runtime.http.api_bodies import (ALIASES, FIELDS, OMNI_IGNORED, OPENAI_IGNORED, REFUSED, AnswerFormat,
                                           BadRequest, encode_image, parse_body)
from utils.runtime.requests.image_requests import ImageRequest, RequestChecker
from utils.runtime.http.image_server import ImageServer

DEFAULTS = ImageRequest(prompt="", seed=None, image_size="64x64", diff_infer_steps=2)
ORIGIN = "https://tools.example.com"
METRIC_NAMES = ("hunyuan_requests_total", "hunyuan_images_total", "hunyuan_denoise_forwards_total",
                "hunyuan_queue_depth", "hunyuan_busy", "hunyuan_request_seconds", "hunyuan_batch_requests",
                "hunyuan_largest_batch")


@pytest.fixture(scope="module")
def server(tiny_model):
    lines = []
    srv = ImageServer("127.0.0.1", 0, DEFAULTS, RequestChecker(tiny_model), 2, 2, lines.append, client_timeout=3.0,
                      allow_origin=ORIGIN)
    srv.lines = lines
    srv.loaded.set()
    srv.start()
    yield srv
    srv.close()


def url_of(server) -> str:
    return "http://{}:{}".format(*server.server_address)


def log_of(server, request_id: str) -> str:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = [line for line in server.lines if f"id={request_id}" in line]
        if found:
            return found[-1]
        time.sleep(0.02)
    raise AssertionError(f"no access-log line for {request_id}")


def test_a_keepalive_client_serves_on_after_each_refusal_on_one_connection(server):
    """httpx with one pooled connection: a chunked body, a body over the limit, an unknown path, a body
    the client abandons mid-way: each refused, and the next request on the pool succeeds; the first
    three leave the connection open (the same client port serves them all)."""
    with httpx.Client(base_url=url_of(server), limits=httpx.Limits(max_connections=1), timeout=30) as client:
        ports = []

        def good(tag):
            answer = client.get("/v1/models", headers={"X-Request-Id": f"good-{tag}"})
            assert answer.status_code == 200 and answer.json()["object"] == "list"
            ports.append(log_of(server, f"good-{tag}").split()[2])

        def chunks():
            yield b'{"prompt": "a fox", '
            yield b'"seed": -1}'
        answer = client.post("/v1/images/generations", content=chunks(), headers={"X-Request-Id": "chunked"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "seed"     # read whole, then checked
        assert "transfer-encoding" not in answer.request.headers or answer.request.headers["transfer-encoding"] == \
            "chunked"
        good("chunked")
        answer = client.post("/v1/images/generations", content=b'{"prompt": "' + b"x" * (2 << 20) + b'"}',
                             headers={"Content-Type": "application/json"})
        assert answer.status_code == 413 and "exceeds" in answer.json()["error"]["message"]
        good("too-big")
        answer = client.post("/v1/responses", json={"model": "x", "input": "hi"})
        assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found"
        good("unknown-path")
        assert len(set(ports)) == 1, ("a refusal closed the pooled connection", ports)

        def cut_off():
            yield b'{"prompt": "a'
            raise ConnectionError("the client gave up")
        with pytest.raises(Exception):
            client.post("/v1/images/generations", content=cut_off())
        good("after-cut-off")


def test_a_slow_client_delays_nobody_and_50_connections_are_all_answered(server):
    host, port = server.server_address
    stop = threading.Event()

    def slow_headers():                       # a byte a second, never finishing within the test
        with socket.create_connection((host, port), timeout=30) as sock:
            for byte in b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n":
                if stop.is_set():
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return                     # dropped after client_timeout: as it should be
                time.sleep(1.0)
    slow = threading.Thread(target=slow_headers, daemon=True)
    slow.start()
    try:
        latencies = []
        for _ in range(10):
            start = time.monotonic()
            with urlopen(f"{url_of(server)}/health") as response:
                assert response.status == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.2)
        assert max(latencies) < 1.0, latencies
        answers = [None] * 50

        def ask(i):
            connection = http.client.HTTPConnection(host, port, timeout=30)
            connection.request("GET", "/health")
            answers[i] = connection.getresponse().status
            connection.close()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert answers == [200] * 50, answers
        deadline = time.monotonic() + 10           # dropped client_timeout (3 s) after it connected
        while not any("headers unfinished" in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("headers unfinished" in line for line in server.lines), "the slow client was never dropped"
    finally:
        stop.set()
    slow.join(10)


def urlopen(url):
    return urllib.request.urlopen(url, timeout=10)


def test_metrics_parse_with_prometheus_clients_parser_and_keep_every_name(server):
    from prometheus_client.parser import text_string_to_metric_families
    with urlopen(f"{url_of(server)}/health"):
        pass
    refused = urllib.request.Request(f"{url_of(server)}/v1/images/generations", method="POST",
                                     data=json.dumps({"prompt": "x", "seed": -1}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError):         # one answered request: the counter by code has a sample
        urllib.request.urlopen(refused, timeout=10)
    with urlopen(f"{url_of(server)}/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    for name in METRIC_NAMES:
        assert name in samples or f"{name}_count" in samples, (name, sorted(samples))
    assert {"process_resident_memory_bytes", "python_gc_collections_total", "python_info"} <= samples
    assert metric(text, "hunyuan_queue_depth") == 0 and metric(text, "hunyuan_busy") == 0


def test_cors_preflight_and_the_request_id(server, tiny_model):
    host, port = server.server_address
    connection = http.client.HTTPConnection(host, port, timeout=10)
    connection.request("OPTIONS", "/v1/images/generations", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    response = connection.getresponse()
    response.read()
    assert response.status == 200 and response.getheader("Access-Control-Allow-Origin") == ORIGIN
    assert "POST" in response.getheader("Access-Control-Allow-Methods")
    connection.request("GET", "/health", headers={"Origin": "https://elsewhere.example"})
    response = connection.getresponse()
    response.read()
    assert response.getheader("Access-Control-Allow-Origin") is None
    made = response.getheader("X-Request-Id")
    assert re.fullmatch(r"[0-9a-f]{32}", made), made
    connection.request("GET", "/health", headers={"X-Request-Id": "trace-42"})
    response = connection.getresponse()
    response.read()
    assert response.getheader("X-Request-Id") == "trace-42"
    line = log_of(server, "trace-42")
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z http 127\.0\.0\.1:\d+ \"GET /health\" 200 [0-9.]+ ms "
                    r"id=trace-42\Z", line), line
    no_cors = ImageServer("127.0.0.1", 0, DEFAULTS, RequestChecker(tiny_model), 2, 2, lambda line: None)
    no_cors.loaded.set()
    no_cors.start()
    try:
        connection = http.client.HTTPConnection(*no_cors.server_address, timeout=10)
        connection.request("OPTIONS", "/v1/images/generations", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        response = connection.getresponse()
        response.read()
        assert response.status == 204 and response.getheader("Access-Control-Allow-Origin") is None
        assert "POST" in response.getheader("Allow")
    finally:
        no_cors.close()


def test_openapi_describes_every_field_the_bodies_take(server):
    with urlopen(f"{url_of(server)}/openapi.json") as response:
        document = json.loads(response.read())
    for path in ("/v1/images/generations", "/v1/images/edits"):
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        taken = set(FIELDS) - set(REFUSED) - ({"image"} if path.endswith("generations") else set())
        assert taken <= set(schema["properties"]), (path, sorted(taken - set(schema["properties"])))
        assert schema["properties"]["steps"]["anyOf"][0]["maximum"] == 1000
    assert "/v1/models/{model_id}" in document["paths"] and "/" not in document["paths"]


def test_the_serving_docs_table_names_every_field():
    text = (ROOT / "docs" / "SERVING.md").read_text(encoding="utf-8")
    table = text.split("## Every field", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z_]+)`", table, re.M))
    assert set(FIELDS) | {"image", "stream"} <= named, sorted(set(FIELDS) - named)


def test_field_rules_aliases_ignored_refused_and_the_model_name(tiny_model):
    checker = RequestChecker(tiny_model)

    def parse(**body):
        return parse_body({"prompt": "a fox", **body}, DEFAULTS, checker, 4)
    assert parse(num_inference_steps=3)[0].diff_infer_steps == 3
    assert parse(steps=3, num_inference_steps=3)[0].diff_infer_steps == 3
    with pytest.raises(BadRequest, match="num_inference_steps: says 3 where steps says 2"):
        parse(steps=2, num_inference_steps=3)
    for name in OPENAI_IGNORED + OMNI_IGNORED:
        assert parse(**{name: "anything"})[0] == parse()[0], name
    for name in REFUSED:
        with pytest.raises(BadRequest) as refused:
            parse(**{name: "x"})
        assert refused.value.param == name
    assert parse(model=Path(tiny_model).name)
    with pytest.raises(BadRequest, match="model: 'gpt-image-1' is not served here; use \"tiny\""):
        parse(model="gpt-image-1")
    with pytest.raises(BadRequest, match="background: 'transparent'"):
        parse(background="transparent")
    with pytest.raises(BadRequest, match="partial_images: 4 is not an integer in 0..3"):
        parse(partial_images=4)
    assert parse(partial_images=2)[0].partial_images == 0                       # not streamed: no previews
    assert parse_body({"prompt": "x", "partial_images": 2}, DEFAULTS, checker, 4, stream=True)[0].partial_images == 2
    assert set(ALIASES) <= set(FIELDS)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_output_formats(fmt):
    image = Image.new("RGB", (64, 48), (200, 30, 40))
    data = encode_image(image, AnswerFormat(fmt, 80))
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == fmt.upper() and decoded.size == (64, 48)
    assert abs(decoded.convert("RGB").getpixel((10, 10))[0] - 200) <= 8
