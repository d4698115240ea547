"""The built-in chat page (GET /) in headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): it lists the served model, types a message, waits for the streamed answer from SmolLM2
(real weights), checks it against the server's own non-streamed greedy answer to the same
conversation, regenerates, and saves a screenshot. `--no-webui` turns the page off."""
import os
import shutil
import time

import pytest

from server_util import SMOLLM2, Server

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="set ATOMC_SMOLLM2 to the SmolLM2-135M-Instruct GGUF")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SHOT_DIR = os.environ.get("ATOMC_WEBUI_SHOTS", "build/webui")


@pytest.fixture(scope="module")
def server():
    s = Server(SMOLLM2, "--max-model-len", "1024", "--served-model-name", "smol")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip("chromium / chromium-driver not installed (scripts/setup.sh --test installs them)")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,900"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield d
    d.quit()


def wait_for(fn, timeout=60, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_page_is_served_with_a_strict_policy(server):
    status, headers, body = server.request("GET", "/", auth=False)
    assert status == 200
    h = {k.lower(): v for k, v in headers.items()}
    assert h["content-type"].startswith("text/html")
    assert "default-src 'self'" in h["content-security-policy"]
    page = body.decode()
    assert "/v1/chat/completions" in page and "<script" in page
    assert 'src="http' not in page and 'href="http' not in page and "@import" not in page  # nothing from elsewhere


def test_chat_in_headless_chromium(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    d = browser
    d.get(server.base + "/")
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "#model option"), what="the model list")
    assert d.find_element(By.CSS_SELECTOR, "#model option").get_attribute("value") == "smol"
    # Greedy, so the page's streamed answer must equal the API's own non-streamed answer.
    temp = d.find_element(By.ID, "temperature")
    temp.clear()
    temp.send_keys("0")
    mt = d.find_element(By.ID, "max_tokens")
    mt.clear()
    mt.send_keys("24")
    question = "What is the capital of France?"
    box = d.find_element(By.ID, "input")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state='done']"), what="the streamed answer")
    answer = d.find_element(By.CSS_SELECTOR, ".msg.assistant .body").text.strip()
    assert d.find_element(By.CSS_SELECTOR, ".msg.user .body").text == question
    status, ref = server.json("POST", "/v1/chat/completions", {
        "model": "smol", "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 24})
    assert status == 200
    expected = ref["choices"][0]["message"]["content"].strip()
    assert answer and " ".join(answer.split()) == " ".join(expected.split()), (answer, expected)
    assert "tok/s" in d.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text
    os.makedirs(SHOT_DIR, exist_ok=True)
    d.save_screenshot(os.path.join(SHOT_DIR, "chat.png"))
    assert os.path.getsize(os.path.join(SHOT_DIR, "chat.png")) > 10000
    # Regenerate replaces the last answer (greedy: the same text again), keeping one assistant turn.
    d.find_element(By.ID, "regen").click()
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state='done']"), what="the regenerated answer")
    msgs = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    assert len(msgs) == 1 and " ".join(msgs[0].find_element(By.CSS_SELECTOR, ".body").text.split()) == " ".join(expected.split())
    # Stop: a long answer aborted mid-stream ends the turn (the server frees the request).
    mt.clear()
    mt.send_keys("400")
    box.send_keys("Write a long story about a dragon.")
    box.send_keys(Keys.ENTER)
    wait_for(lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2 and
             d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1].find_element(By.CSS_SELECTOR, ".body").text,
             what="the second answer to start")
    d.find_element(By.ID, "stop").click()
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1].get_attribute("data-state") == "done",
             what="the stopped answer")
    wait_for(lambda: server.metric("vllm:num_requests_running") == 0, what="the aborted request to end")


def test_markdown_is_rendered_and_escaped(server, browser):
    # The page's renderer on fixed text: code fences, lists, and model output that tries to inject markup.
    d = browser
    d.get(server.base + "/")
    html = d.execute_script("return renderMarkdown(arguments[0]);",
                            "# Title\n\n- **bold** item\n- `x<y`\n\n```c\nint a = 1 < 2;\n```\n<img src=x onerror=alert(1)>")
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html and "<code>x&lt;y</code>" in html
    assert '<pre><code class="language-c">int a = 1 &lt; 2;</code></pre>' in html
    assert "<img" not in html and "&lt;img" in html


def test_no_webui_turns_it_off():
    s = Server(SMOLLM2, "--max-model-len", "256", "--no-webui")
    try:
        status, _, _ = s.request("GET", "/", auth=False)
        assert status == 404
    finally:
        s.stop()
