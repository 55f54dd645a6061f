"""The page in a real headless browser (Debian's chromium, driven by Selenium through Debian's
chromedriver) against a real server on the tiny model, started by run.sh from a YAML with a key.

One server start for every check: the page without the key is refused (and a wrong key too), with it
the form fills from GET /v1/models; a bad seed shows the server's error beside the seed field;
Ctrl+Enter generates with progress shown, and the image equals the API's image for the same request
(decoded pixels), its PNG download carries the settings; Esc cancels a long one; a narrow window
needs no sideways scrolling. At the end the key is in no line of any log the run wrote.
`UPDATE_PAGE_SCREENSHOT=1` also writes docs/page.png from this run."""
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np
import pytest
from PIL import Image

from browser import chromium, wait_for
from generation import ROOT
from harness.multirank import free_port
from http_client import health, steps_before_cancel

pytestmark = pytest.mark.slow
KEY = "page-test-key-" + uuid.uuid4().hex[:12]
STEPS = 30


def api_image(url, body):
    request = urllib.request.Request(url + "/v1/images/generations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200
        return json.loads(response.read())["data"][0]


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


class Served:
    """run.sh serving the tiny model on one CPU rank, from a YAML with model_args.api-key."""

    def __init__(self, model, tmp):
        port = free_port()
        self.url, self.name, self.console = f"http://127.0.0.1:{port}", f"page_test_{uuid.uuid4().hex[:8]}", tmp / "console.txt"
        (tmp / "serve.yaml").write_text(json.dumps({
            "world_size": 1, "master_port": free_port(), "entry_script": "run_image_gen.py", "model_name": self.name,
            "env_vars": {"OMP_NUM_THREADS": 1},
            "model_args": {"serve": True, "port": port, "model-id": str(model), "device": "cpu",
                           "diff-infer-steps": 3, "image-size": "64x64", "api-key": KEY}}))
        with open(self.console, "w") as out:
            self.proc = subprocess.Popen(["bash", "run.sh", str(tmp / "serve.yaml"), "--no-plan"], cwd=ROOT,
                                         env={**os.environ, "PYTHON": sys.executable}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self):
        deadline = time.time() + 300
        while health(self.url)[0] != 200:
            assert self.proc.poll() is None and time.time() < deadline, self.console.read_text()[-3000:]
            time.sleep(0.5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(120)

    def logs(self) -> dict:
        """{path: text} of everything the run wrote: the console, the job log, every rank's log."""
        texts = {str(self.console): self.console.read_text(errors="replace")}
        for path in sorted((ROOT / "res").glob(f"*/{self.name}/**/*")):
            if path.is_file():
                texts[str(path)] = path.read_text(errors="replace")
        return texts

    def remove(self):
        """After a failed test too: SIGTERM through run.sh (it forwards it to torchrun, which lives in a
        session of its own); if that does not end it, SIGKILL to every process under it."""
        if self.proc.poll() is None:
            from utils.launcher.launch import child_processes, kill_leftovers
            tree, todo = [], child_processes(self.proc.pid)
            while todo:
                tree.append(todo.pop())
                todo += child_processes(tree[-1][0])
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                kill_leftovers(tree)        # those still the same process: a pid may be reused in 120 s
                self.proc.wait(30)
        for folder in (ROOT / "res").glob(f"*/{self.name}"):
            shutil.rmtree(folder)
            if not any(folder.parent.iterdir()):
                folder.parent.rmdir()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    server = Served(tiny_model, tmp_path_factory.mktemp("page"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def test_the_page_generates_with_progress_cancels_and_keeps_its_key(served, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    url = served.url
    find = lambda element_id: browser.find_element(By.ID, element_id)    # noqa: E731

    # Without the key: refused, the form is not shown; a wrong key is refused with the server's words.
    browser.get(url + "/")
    wait_for(browser, lambda: find("key-form").is_displayed(), what="the key form")
    assert not find("app").is_displayed()
    find("api-key").send_keys("not-the-key", Keys.ENTER)
    wait_for(browser, lambda: "wrong API key" in find("err-key").text, what="the wrong key's error")
    find("api-key").send_keys(KEY, Keys.ENTER)
    wait_for(browser, lambda: find("app").is_displayed(), what="the form")
    assert find("model-name").text == "tiny"
    sizes = [o.get_attribute("value") for o in find("size").find_elements(By.TAG_NAME, "option")]
    assert sizes[0] == "auto" and "64x64" in sizes and find("size").get_attribute("value") == "64x64"

    # A bad seed: the server's one-line error beside the seed field.
    find("prompt").send_keys("a red fox in the snow")
    find("seed").clear()
    find("seed").send_keys("-5")
    find("generate").click()
    wait_for(browser, lambda: find("err-seed").text, what="the seed's error")
    assert find("err-seed").text.startswith("seed: -5 is not an integer in 0..4294967295")
    assert find("seed").get_attribute("aria-invalid") == "true" and not find("err-general").text

    # Ctrl+Enter: progress shown step by step, then the image, equal to the API's for the same request.
    browser.execute_script("""window.statuses = [];
        new MutationObserver(() => window.statuses.push(document.getElementById('status-text').textContent))
            .observe(document.getElementById('status-text'), {childList: true, characterData: true, subtree: true});""")
    find("seed").clear()
    find("seed").send_keys("7")
    find("steps").clear()
    find("steps").send_keys(str(STEPS))
    find("prompt").send_keys(Keys.CONTROL, Keys.ENTER)
    wait_for(browser, lambda: find("status-text").text.startswith("Done"), 120, "the image")
    statuses = browser.execute_script("return window.statuses")
    assert any(s.startswith(f"denoising step") and s.endswith(f"of {STEPS}") for s in statuses), statuses
    assert not find("err-seed").text and find("seed").get_attribute("aria-invalid") is None
    shown = base64.b64decode(find("result-image").get_attribute("src").split(",", 1)[1])
    reference = api_image(url, {"prompt": "a red fox in the snow", "seed": 7, "steps": STEPS, "size": "64x64"})
    assert np.array_equal(pixels(shown), pixels(base64.b64decode(reference["b64_json"])))
    info = find("result-info").text
    assert "seed\n7" in info and "size\n64x64" in info, info

    # The gallery's PNG download: the same pixels, with the settings inside.
    link = browser.find_element(By.CSS_SELECTOR, "#gallery li a[download$='.png']")
    assert link.get_attribute("download").startswith("hunyuan_7_a-red-fox-in-the-snow")
    downloaded = browser.execute_async_script("""const done = arguments[arguments.length - 1];
        fetch(arguments[0]).then(r => r.arrayBuffer()).then(b => {
            let s = ''; new Uint8Array(b).forEach(c => s += String.fromCharCode(c)); done(btoa(s));
        }).catch(e => done('error: ' + e));""",
                                              link.get_attribute("href"))
    png = Image.open(io.BytesIO(base64.b64decode(downloaded)))
    assert np.array_equal(np.asarray(png.convert("RGB")), pixels(shown))
    saved = json.loads(png.info["parameters"])
    assert (saved["prompt"], saved["seed"], saved["steps"], saved["size"]) == ("a red fox in the snow", 7, STEPS, "64x64")
    browser.save_screenshot(str(tmp_path / "page.png"))
    if os.environ.get("UPDATE_PAGE_SCREENSHOT") == "1":        # cropped to the page's content
        from PIL import ImageChops
        shot = Image.open(tmp_path / "page.png").convert("RGB")
        content = ImageChops.difference(shot, Image.new("RGB", shot.size, shot.getpixel((2, shot.height - 2))))
        box = content.getbbox()
        shot.crop((0, 0, shot.width, min(shot.height, box[3] + 12))).save(ROOT / "docs" / "page.png", optimize=True)

    # Esc cancels a long request: the page says so, and the rank stopped early (its own count of the
    # steps it ran, in the server's log), whatever the machine's speed.
    find("steps").clear()
    find("steps").send_keys("1000")
    find("prompt").send_keys(Keys.CONTROL, Keys.ENTER)
    wait_for(browser, lambda: "denoising step" in find("status-text").text, 60, "a running request")
    find("prompt").send_keys(Keys.ESCAPE)
    wait_for(browser, lambda: find("status-text").text == "Cancelled", 10, "the cancel")
    wait_for(browser, lambda: not health(url)[1].get("busy") and steps_before_cancel(served.console.read_text()),
             120, "the server to be free, the cancel logged")
    stopped = steps_before_cancel(served.console.read_text())
    assert len(stopped) == 1 and list(stopped[0]) == [0] and stopped[0][0] < 1000, stopped

    # A narrow window: one column, nothing to scroll sideways.
    browser.set_window_size(380, 900)
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    browser.set_window_size(1200, 1100)


def test_the_key_is_in_no_log_the_run_wrote(served, browser):
    """After the page test (same server): stopped by SIGTERM through run.sh, then every log it wrote is read."""
    assert served.stop() == 128 + signal.SIGTERM
    texts = served.logs()
    assert len(texts) >= 3, sorted(texts)                                  # console, job log, rank 0's log
    everything = "".join(texts.values())
    assert "http 127.0.0.1" in everything and "server stopped" in everything      # the access log is in there
    assert "--api-key-env HUNYUAN_API_KEY" in everything                   # the command, without the key
    leaked = [path for path, text in texts.items() if KEY in text]
    assert not leaked, leaked
