"""The server's key, its page, /v1/models and the edits body: a real server in this process, real sockets.

No model runs here (nothing reaches the rank loop): what a request that runs gets is in
test_server_page.py (a browser against run.sh) and test_server_ranks.py (two ranks)."""
import base64
import http.client
import io
import json
import re
import socket
import uuid

import pytest
from PIL import Image

from utils.runtime.requests.api_key import ApiKey, bearer
from utils.runtime.http.http_api import ROUTES, WEB
from utils.runtime.requests.image_requests import ImageRequest, RequestChecker
from utils.runtime.http.image_server import ImageServer

KEY = "test-key-7f3a9c"
DEFAULTS = ImageRequest(prompt="", seed=None, image_size="64x64", diff_infer_steps=2)


@pytest.fixture(scope="module")
def keyed(tiny_model):
    lines = []
    srv = ImageServer("127.0.0.1", 0, DEFAULTS, RequestChecker(tiny_model), 2, 2, lines.append, client_timeout=2.0,
                      api_key=ApiKey(KEY))
    srv.lines = lines
    srv.loaded.set()
    srv.start()
    yield srv
    srv.close()


def call(server, method, path, body=None, headers=None):
    host, port = server.server_address
    connection = http.client.HTTPConnection(host, port, timeout=10)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers=headers or {})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    is_json = response.getheader("Content-Type", "").startswith("application/json")
    return response.status, json.loads(payload) if is_json else payload, response.headers     # names: any case


KEYED = sorted((method, path) for (method, path), (_, needs_key) in ROUTES.items() if needs_key)


def test_every_api_endpoint_needs_the_key(keyed):
    assert KEYED == [("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
                     ("POST", "/v1/images/edits"), ("POST", "/v1/images/generations")]
    for method, path in KEYED:
        path = path.replace("{model_id}", "tiny")
        body = {"prompt": "a fox"} if method == "POST" else None
        for headers, problem in (({}, "no API key sent"), ({"Authorization": "Bearer wrong"}, "wrong API key"),
                                 ({"Authorization": KEY}, "no API key sent"),            # no Bearer scheme
                                 ({"Authorization": f"Basic {KEY}"}, "no API key sent")):
            code, payload, answer_headers = call(keyed, method, path, body, headers)
            assert code == 401, (method, path, headers, payload)
            error = payload["error"]
            assert error["type"] == "authentication_error" and error["code"] == 401 and error["param"] is None
            assert error["message"].startswith(problem) and "Authorization: Bearer" in error["message"]
            assert answer_headers["WWW-Authenticate"].startswith("Bearer")


def test_with_the_key_the_endpoints_answer(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(keyed, "GET", "/metrics", headers=auth)[0] == 200
    code, card, _ = call(keyed, "GET", "/v1/models", headers={"Authorization": f"bearer  {KEY} "})
    assert code == 200 and card["object"] == "list"
    # past the key: the body's own checks answer (a request that runs is test_server_page.py's)
    code, payload, _ = call(keyed, "POST", "/v1/images/generations", {"prompt": "x", "seed": -1}, auth)
    assert code == 400 and payload["error"]["param"] == "seed"
    code, payload, _ = call(keyed, "POST", "/v1/images/edits", {"prompt": "x", "image": "???"}, auth)
    assert code == 400 and payload["error"]["param"] == "image[1]"


def test_health_and_the_page_need_no_key(keyed):
    assert call(keyed, "GET", "/health")[0] == 200
    for path in ("/", "/page.js", "/page.css"):
        code, body, headers = call(keyed, "GET", path)
        assert code == 200 and body, path
        assert "default-src 'self'" in headers["Content-Security-Policy"]


def test_the_key_is_in_no_log_line(keyed):
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        call(keyed, "GET", "/v1/models", headers=headers)
        call(keyed, "POST", "/v1/images/generations", {"prompt": "x", "n": 99}, headers)
    assert keyed.lines and not [line for line in keyed.lines if KEY in line]
    assert KEY not in repr(keyed.api_key) and KEY not in str(keyed.api_key)
    assert KEY not in keyed.metrics.prometheus(0, False)


def test_bearer_and_constant_time_compare():
    assert bearer(f"Bearer {KEY}") == KEY and bearer(f"BEARER {KEY}") == KEY
    assert bearer(None) is None and bearer("Bearer ") is None and bearer(KEY) is None
    key = ApiKey(KEY)
    assert key.matches(KEY) and not key.matches(KEY[:-1]) and not key.matches(None) and not key.matches("é" * 9)


def test_the_page_loads_nothing_from_elsewhere():
    for path in WEB.iterdir():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), path.name
        assert "<script>" not in text and "onclick=" not in text, path.name       # the CSP forbids inline script
    assert "@import" not in (WEB / "page.css").read_text()


def test_models_says_what_the_checkpoint_takes(keyed):
    code, card, _ = call(keyed, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    model = card["data"][0]
    capabilities = model["capabilities"]
    assert model["object"] == "model" and model["id"] == "tiny" and "/" not in model["id"]
    assert capabilities["sizes"][0] == "auto" and "64x64" in capabilities["sizes"]
    assert "32x128" in capabilities["sizes"] and "128x32" in capabilities["sizes"]      # WIDTHxHEIGHT both ways
    assert capabilities["default_size"] == "64x64"
    assert capabilities["steps"] == {"min": 1, "max": 1000, "default": 2}
    assert capabilities["bot_tasks"] == ["image", "auto"]               # the tiny checkpoint's template is pretrain
    assert capabilities["step_cache"] == ["none", "taylor", "adaptive"]
    assert capabilities["conditioning_images"] == 0 and capabilities["max_n"] == 2


def png(width=16, height=16, color=(200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims width x height (a decompression bomb's first bytes)."""
    import struct
    import zlib
    data = bytearray(png(1, 1))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def multipart(fields: dict, files: list) -> tuple:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="f{i}.png"\r\n'
              f'Content-Type: image/png\r\n\r\n'.encode() + data + b"\r\n" for i, (name, data) in enumerate(files)]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


EDITS = {   # body (JSON dict, or (form fields, files)) -> (param, words of the problem)
    "base_checkpoint_json": ({"prompt": "make it blue", "image": base64.b64encode(png()).decode()},
                             ("image", "this checkpoint (HunyuanImage-3.0, text to image) takes no conditioning images")),
    "base_checkpoint_form": (({"prompt": "make it blue", "steps": "2"}, [("image[]", png()), ("image[]", png())]),
                             ("image", "takes no conditioning images")),
    "data_url": ({"prompt": "x", "image": ["data:image/png;base64," + base64.b64encode(png()).decode()]},
                 ("image", "takes no conditioning images")),
    "no_image": ({"prompt": "x"}, ("image", "0 images")),
    "four_images": ({"prompt": "x", "image": [base64.b64encode(png()).decode()] * 4}, ("image", "4 images")),
    "form_four_images": (({"prompt": "x"}, [("image", png())] * 4), ("image", "4 images")),
    "not_base64": ({"prompt": "x", "image": "not base64!"}, ("image[1]", "is not base64")),
    "not_an_image": ({"prompt": "x", "image": [base64.b64encode(png()).decode(), base64.b64encode(b"GIF89a?").decode()]},
                     ("image[2]", "is not an image")),
    "truncated_png": (({"prompt": "x"}, [("image[]", png(64, 64)[:60])]), ("image[1]", "is not an image")),
    "too_many_pixels": ({"prompt": "x", "image": base64.b64encode(png_claiming(9000, 8000)).decode()},
                        ("image[1]", "9000x8000 pixels")),
    "image_a_number": ({"prompt": "x", "image": [5]}, ("image[1]", "not base64 text")),
    "mask": ({"prompt": "x", "image": base64.b64encode(png()).decode(), "mask": "x"}, ("mask", "is not supported")),
    "form_bad_seed": (({"prompt": "x", "seed": "-3"}, [("image[]", png())]), ("seed", "is not an integer")),
    "form_stream_yes": (({"prompt": "x", "stream": "yes"}, [("image[]", png())]), ("stream", "is not true or false")),
    "form_other_file": (({"prompt": "x"}, [("prompt", png())]), ("prompt", "only image / image[] may be files")),
    "form_no_boundary": ((None, None), ("body", "multipart/form-data")),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_edits_body_is_parsed_and_checked(keyed, case):
    body, (param, words) = EDITS[case]
    headers = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, tuple):
        fields, files = body
        data, content_type = (b"--x--", "multipart/form-data") if fields is None else multipart(fields, files)
        headers["Content-Type"] = content_type
    else:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    code, payload, _ = call(keyed, "POST", "/v1/images/edits", data, headers)
    error = payload["error"]
    assert code == 400 and error["param"] == param and words in error["message"], error


def test_stream_must_be_a_boolean(keyed):
    code, payload, _ = call(keyed, "POST", "/v1/images/generations", {"prompt": "x", "stream": "yes"},
                            {"Authorization": f"Bearer {KEY}"})
    assert code == 400 and payload["error"]["param"] == "stream"


def test_a_client_that_leaves_its_queued_request_cancels_it(tiny_model):
    """Nothing pulls from this server's queue: a request waits there until its client closes the
    connection, then leaves the queue (never to run) and frees its place."""
    lines = []
    srv = ImageServer("127.0.0.1", 0, DEFAULTS, RequestChecker(tiny_model), 1, 2, lines.append, client_timeout=5.0)
    srv.loaded.set()
    srv.start()
    try:
        body = json.dumps({"prompt": "a fox", "seed": 1, "stream": True}).encode()
        sock = socket.create_connection(srv.server_address, timeout=10)
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = sock.recv(65536).decode()
        while "event: queued" not in head:
            head += sock.recv(65536).decode()
        assert "text/event-stream" in head and '"position": 1' in head, head
        assert srv.jobs.qsize() == 1
        code, payload, _ = call(srv, "POST", "/v1/images/generations", {"prompt": "x"})
        assert code == 503 and "queue full" in payload["error"]["message"]
        sock.close()
        for _ in range(100):
            if srv.jobs.qsize() == 0:
                break
            import time
            time.sleep(0.05)
        assert srv.jobs.qsize() == 0 and any("client left" in line for line in lines), lines
    finally:
        srv.close()


BAD_KEY = "bad key 9f8e7d"


@pytest.mark.parametrize("argv, env, message", [
    (["--serve", "--api-key", BAD_KEY], {}, "error: api-key: is not 1 to 4096 visible ASCII characters"),
    (["--serve", "--api-key-env", "PAGE_KEY"], {"PAGE_KEY": BAD_KEY}, "error: api-key-env: the key is not 1 to 4096"),
    (["--serve", "--api-key-env", "NO_SUCH_KEY_VAR"], {}, "error: api-key-env: NO_SUCH_KEY_VAR is not set or empty"),
    (["--serve", "--api-key-env", "NOT-A-NAME"], {}, "error: api-key-env: 'NOT-A-NAME' is not an environment variable"),
    (["--serve", "--api-key", "k3y", "--api-key-env", "PAGE_KEY"], {"PAGE_KEY": "k3y"}, "error: api-key: given twice"),
    (["--prompt", "a fox", "--api-key", "k3y"], {}, "error: api-key: only with --serve"),
])
def test_key_refusals_are_one_line_that_never_shows_the_key(tiny_model, argv, env, message):
    from generation import run_cli_in_process
    proc = run_cli_in_process([*argv, "--model-id", tiny_model, "--device", "cpu"], env=env)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and BAD_KEY not in proc.stderr + proc.stdout


def launcher(tmp_path, model_args: dict, env_vars=None, *options):
    import contextlib
    import io
    from utils.launcher import launch
    from generation import ROOT
    config = {"world_size": 1, "master_port": 29619, "entry_script": "run_image_gen.py",
              "env_vars": env_vars or {}, "model_args": {"serve": True, "device": "cpu", **model_args}}
    (tmp_path / "job.yaml").write_text(json.dumps(config))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = launch.main([str(tmp_path / "job.yaml"), "--dry-run", "--no-plan", *options])
    return code, out.getvalue(), err.getvalue()


def test_a_yaml_key_reaches_the_ranks_in_the_environment_never_on_the_command_line(tiny_model, tmp_path):
    code, out, err = launcher(tmp_path, {"model-id": str(tiny_model), "api-key": "yaml-key-31337"})
    assert code == 0 and "--api-key-env HUNYUAN_API_KEY" in out and "yaml-key-31337" not in out + err, out + err
    assert "note: api-key: handed to the ranks in the environment variable HUNYUAN_API_KEY" in err
    code, out, err = launcher(tmp_path, {"model-id": str(tiny_model), "api-key-env": "SERVE_KEY"},
                              {"SERVE_KEY": "env-key-31337"})
    assert code == 0 and "SERVE_KEY=<hidden>" in out and "--api-key-env SERVE_KEY" in out and "31337" not in out


@pytest.mark.parametrize("model_args, message", [
    ({"api-key": 987654321}, "error: model_args.api-key: is not 1 to 4096 visible ASCII characters"),
    ({"api-key": "k3y", "api-key-env": "SERVE_KEY"}, "error: model_args.api-key: given with api-key-env"),
    ({"api-key-env": "NO_SUCH_KEY_VAR"}, "error: model_args.api-key-env: NO_SUCH_KEY_VAR is not set"),
    ({"serve": False, "prompt": "x", "api-key": "k3y-abcdef"}, "error: model_args.api-key: only with --serve; "),
])
def test_yaml_key_refusals(tiny_model, tmp_path, model_args, message):
    code, out, err = launcher(tmp_path, {"model-id": str(tiny_model), **model_args})
    assert code == 2 and err.startswith(message) and "987654321" not in err, err


@pytest.mark.parametrize("host, key, line", [
    ("0.0.0.0", None, "warning: listening on 0.0.0.0 with no API key: anyone who reaches port"),
    ("0.0.0.0", ApiKey(KEY), "note: listening on 0.0.0.0: reachable from other machines; every API call needs the key"),
    ("127.0.0.2", None, None),
])
def test_binding_beyond_loopback_without_a_key_warns_at_start(tiny_model, host, key, line):
    import run_image_gen
    from utils.runtime.engine.many_images import start_server
    args = run_image_gen.parse_args(["--serve", "--model-id", str(tiny_model), "--host", host, "--port", "0"])
    args.api_key = key
    import signal
    lines, handlers = [], {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = start_server(args, lines.append)
        server.close()
    finally:
        for sig, handler in handlers.items():          # start_server installs the server's own
            signal.signal(sig, handler)
    found = [text for text in lines if text.startswith(("warning:", "note:"))]
    assert (found == []) if line is None else (len(found) == 1 and found[0].startswith(line)), lines
    assert not any(KEY in text for text in lines)


def test_the_openai_client_after_a_401_and_a_404_on_one_client_object(keyed):
    """The real OpenAI client, one object: a wrong key (401) and an unknown model (404) refused, then the
    same object lists and retrieves the model (GET /v1/models, /v1/models/{id})."""
    from openai import AuthenticationError, NotFoundError, OpenAI
    client = OpenAI(base_url="http://{}:{}/v1".format(*keyed.server_address), api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(AuthenticationError) as refused:
        client.models.list(extra_headers={"Authorization": "Bearer wrong"})
    assert refused.value.status_code == 401 and "wrong API key" in refused.value.message
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-image-1")
    assert client.models.retrieve("tiny").id == "tiny"
