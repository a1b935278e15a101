"""End to end in headless Chromium (Debian's package, driven by Playwright): send a message with an
image, wait for the streamed answer and the plots, switch method, run a comparison, save screenshots.

Skipped when Playwright or Chromium is absent. Screenshots go to ``outputs/``; with
``KV_ARENA_UPDATE_SCREENSHOT=1`` the chat screenshot also replaces ``assets/screenshot.png``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/lib/chromium/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
EXAMPLE = ROOT / "assets" / "shapes.png"

sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def url():
    from app import build_demo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = build_demo()
    _, local_url, _ = demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield local_url
    demo.close()


@pytest.fixture(scope="module")
def page(url):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1440, "height": 1100})
        page.set_default_timeout(90_000)
        page.goto(url)
        page.locator("#chat-input textarea").wait_for()
        yield page
        browser.close()


def pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def send(page, box: str, text: str, image: Path) -> None:
    with page.expect_file_chooser() as chooser:
        page.locator(f"#{box} [data-testid=upload-button]").click()
    chooser.value.set_files(str(image))
    page.locator(f"#{box} img").first.wait_for()  # the upload's thumbnail: the file reached the server
    page.locator(f"#{box} textarea").fill(text)


def save(page, name: str) -> Path:
    out = ROOT / "outputs"
    out.mkdir(exist_ok=True)
    path = out / name
    page.screenshot(path=str(path), full_page=True)
    return path


def test_chat_switch_method_and_compare(page):
    # 1. a message with an image, answered with the full cache: streamed answer and live plots
    send(page, "chat-input", "What shapes do you see?", EXAMPLE)
    page.locator("#chat-input [data-testid=submit-button]").click()
    page.get_by_test_id("bot").first.wait_for()
    page.locator("#chat-status").get_by_text("tokens/s").wait_for()
    page.locator("#memory-plot .js-plotly-plot").wait_for()
    page.locator("#speed-plot .js-plotly-plot").wait_for()
    page.locator("#overlay img").first.wait_for()  # drawn once the answer is complete: the box takes a message again
    assert page.get_by_test_id("user").count() >= 1

    # 2. switch method: the next message starts a new conversation and the panels show the saving
    pick(page, "method", "StreamingLLM")
    send(page, "chat-input", "And now?", EXAMPLE)
    page.locator("#chat-input [data-testid=submit-button]").click()
    page.locator("#chat-status").get_by_text("match the full cache").wait_for()  # the answer is complete
    page.locator("#memory-plot").get_by_text("saved").first.wait_for()
    page.locator("#overlay img").first.wait_for()
    assert page.get_by_text("New conversation").count() >= 1
    chat_shot = save(page, "app_chat.png")

    # 3. a comparison on the Compare tab: the full cache and StreamingLLM, one after another
    page.get_by_role("tab", name="Compare").click()
    methods = page.locator("#compare-methods")
    for box in methods.get_by_role("checkbox").all():
        box.set_checked(False)
    methods.get_by_label("StreamingLLM", exact=True).set_checked(True)
    send(page, "compare-input", "Describe the picture.", EXAMPLE)
    page.locator("#compare-run").click()
    page.locator("#compare-status").get_by_text("Done").wait_for()
    table = page.locator("#compare-table")
    assert table.get_by_text("Full cache").count() >= 1 and table.get_by_text("StreamingLLM").count() >= 1
    save(page, "app_compare.png")

    with Image.open(chat_shot) as shot:
        assert shot.width >= 1000 and shot.height >= 800
        if os.environ.get("KV_ARENA_UPDATE_SCREENSHOT") == "1":  # the README's, kept small
            small = shot.convert("RGB").resize((shot.width * 3 // 4, shot.height * 3 // 4), Image.LANCZOS)
            small.quantize(colors=256).save(ROOT / "assets" / "screenshot.png", optimize=True)
