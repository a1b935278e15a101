"""End to end in headless Chromium (Debian's package, driven by Playwright), as a newcomer meets the
app with its default model, at 1280 x 800: a corrupt image (a message, the file cleared), an
example scene answered, the method switched mid-conversation (the new method re-reads it and
answers about the same picture), a comparison; screenshots of each step.

Skipped when Playwright or Chromium is absent. Screenshots go to ``outputs/``; with
``KV_ARENA_UPDATE_SCREENSHOT=1`` the Compare conversation's screenshot also replaces
``assets/screenshot.png``.
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
SCENE = ROOT / "assets" / "scene_shape.png"

sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs Playwright: "
                               "pip install -r requirements-dev.txt")
expect = sync_api.expect
if not Path(CHROMIUM).is_file():
    pytest.skip(f"the browser test needs Chromium, not found at {CHROMIUM}: apt-get install chromium "
                "(Debian, Ubuntu), or set CHROMIUM_PATH to a Chromium binary", allow_module_level=True)


@pytest.fixture(scope="module")
def url():
    from app import build_demo, launch_options

    os.environ.pop("KV_ARENA_MODEL", None)  # what a new user gets: the default model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = build_demo()
    _, local_url, _ = demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                                    **launch_options())
    yield local_url
    demo.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(url, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(90_000)
    page.goto(url)
    page.locator("#chat-input textarea").wait_for()
    yield page
    page.close()


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


def submit(page, box: str = "chat-input") -> None:
    page.locator(f"#{box} [data-testid=submit-button]").click()


def answered(page, turns: int) -> None:
    """Wait until the chat shows ``turns`` answers, complete (the overlay is drawn last)."""
    expect(page.get_by_test_id("bot")).to_have_count(turns)
    page.locator("#chat-status").get_by_text("model time").wait_for()
    page.locator("#overlay img").first.wait_for()


def test_a_newcomer_recovers_from_a_bad_file_then_chats_switches_method_and_compares(page, tmp_path):
    # 1. a corrupt image: one message under the input, the file leaves the box, the text stays
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(b"not a png at all")
    send(page, "chat-input", "What colour is the circle?", corrupt)
    submit(page)
    page.locator("#chat-status").get_by_text("is not a readable image").wait_for()
    expect(page.locator("#chat-input img")).to_have_count(0)
    expect(page.locator("#chat-input textarea")).to_have_value("What colour is the circle?")
    assert page.get_by_test_id("user").count() == 0  # nothing entered the chat
    save(page, "app_error.png")

    # 2. the next send works without clean-up: the default model's example scene, answered
    page.locator("#chat-input textarea").fill("")
    page.get_by_text("What colour is the cross?").first.click()  # an example of the selected model (its colour scene)
    page.locator("#chat-input img").first.wait_for()
    submit(page)
    answered(page, 1)
    page.locator("#memory-plot .js-plotly-plot").wait_for()
    page.locator("#speed-plot .js-plotly-plot").wait_for()

    # 3. the method switched mid-conversation (a typed budget out of range is clamped, and said beside
    # the box): no new conversation, the new method re-reads it, said in the chat on its own line, and
    # answers a question about the same picture from its own cache
    pick(page, "method", "H2O (heavy hitters)")
    budget = page.locator("#budget input[type=number]")
    for typed, note in (("5", "Budget must lie between 0.01 and 1: 5 was set to 1."), ("0.5", "")):
        budget.fill(typed)
        budget.press("Enter")
        expect(page.locator("#budget .range-note")).to_have_text(note)  # under the box itself
        expect(budget).to_have_value("1" if typed == "5" else typed)  # the box shows what was set
    page.locator("#chat-input textarea").fill("Which shape is red?")
    submit(page)
    answered(page, 3)  # the answer, the switch's line, the new answer
    page.get_by_text("re-read the 1 turn above").wait_for()
    assert page.get_by_text("New conversation", exact=True).count() == 0
    expect(page.get_by_test_id("bot").last).to_contain_text("triangle")
    page.locator("#chat-status").get_by_text("right").first.wait_for()
    page.locator("#memory-plot").get_by_text("saved").first.wait_for()
    page.locator("#scale-line").get_by_text("Computed, not measured").first.wait_for()  # the projection, then the room on an A10G
    page.get_by_text("re-read the 1 turn above").scroll_into_view_if_needed()
    page.screenshot(path=str(ROOT / "outputs" / "app_switch_viewport.png"))  # what the 1280 x 800 screen shows
    chat_shot = save(page, "app_chat.png")

    # 5. a comparison on the Compare tab: the full cache and two methods, one after another
    page.get_by_role("tab", name="Compare").click()
    methods = page.locator("#compare-methods")
    for box in methods.get_by_role("checkbox").all():
        box.set_checked(False)
    for name in ("StreamingLLM", "SnapKV"):
        methods.get_by_label(name, exact=True).set_checked(True)
    send(page, "compare-input", "Which shape is yellow?", SCENE)
    page.locator("#compare-run").click()
    page.locator("#compare-status").get_by_text("Done").wait_for()
    table = page.locator("#compare-table")
    assert table.get_by_text("Full cache").count() >= 1 and table.get_by_text("StreamingLLM").count() >= 1
    save(page, "app_compare.png")

    with Image.open(chat_shot) as shot:
        assert shot.width >= 1000 and shot.height >= 800


def test_a_fresh_page_compares_an_example_conversation_with_marks(url, browser):
    """Done when: on a fresh page, one example clicked in Compare (four methods at 0.2 by default)
    shows first and follow-up answers marked right or wrong, and at least two methods differ from
    the full cache on some turn; at 1280 x 800, as a laptop shows it."""
    if True:  # a fresh page of its own
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(90_000)
        page.goto(url)
        page.get_by_role("tab", name="Compare").click()
        expect(page.locator("#compare-budget input[type=number]")).to_have_value("0.2")  # its own, visible
        examples = page.locator("#compare-examples")
        examples.get_by_text("What colour is the cross?").first.click()
        expect(page.locator("#compare-then textarea")).not_to_have_value("")  # the follow-up filled too
        page.locator("#compare-input img").first.wait_for()
        page.locator("#compare-run").click()
        page.locator("#compare-status").get_by_text("Done").wait_for()
        answers = [box.input_value() for box in page.locator(".answer textarea").all() if box.is_visible()]
        assert len(answers) == 5 and all("1. " in a and "2. " in a for a in answers)
        assert all(a.count("✓ right") + a.count("✗ wrong") == 2 for a in answers)

        def said(answer: str) -> list[str]:
            return [line for line in answer.splitlines() if line.startswith("→ ")]

        assert sum(said(a) != said(answers[0]) for a in answers[1:]) >= 2  # the columns differ where the methods do
        page.locator("#compare-quality .js-plotly-plot").wait_for()
        for image in page.locator("#compare-overlay img").all():  # the overlays loaded, for the screenshot
            image.scroll_into_view_if_needed()
            expect(image).to_have_js_property("complete", True)
        page.get_by_role("tab", name="Compare").scroll_into_view_if_needed()
        shot = save(page, "app_compare_conversation.png")
        page.close()
    with Image.open(shot) as image:
        if os.environ.get("KV_ARENA_UPDATE_SCREENSHOT") == "1":  # the README's, kept small
            small = image.convert("RGB").resize((image.width * 3 // 4, image.height * 3 // 4), Image.LANCZOS)
            small.quantize(colors=256).save(ROOT / "assets" / "screenshot.png", optimize=True)


def test_can_you_tell_votes_once_and_sees_the_reveal(url, browser, tmp_path, monkeypatch):
    """The "Can you tell?" tab at 1280 x 800: an example asked, two answers shown as A and B and
    nothing else, one vote, then the reveal (which was the full cache, the method, its budget, the
    KV each held, the time each took), a follow-up's answers shown with no vote ticked, and the leaderboard
    with the vote."""
    from kv_arena import service

    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "data"))  # the salt, and the SQLite file below
    service.blind.open_votes(f"sqlite:///{tmp_path / 'votes.db'}")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(90_000)
    page.goto(url)
    page.get_by_role("tab", name="Can you tell?").click()
    scene = service.scene_examples()[0]  # a picture uploaded (a click on an example posts to /run/predict, refused)
    send(page, "blind-input", scene.questions[0], Path(scene.files[0]))
    page.locator("#blind-ask").click()
    page.locator("#blind-status").get_by_text("which answer is better").wait_for()
    answers = [page.locator(f"#blind-{side} textarea").input_value() for side in "ab"]
    assert all(answers) and page.locator("#blind-reveal").inner_text().strip() == ""  # nothing said yet
    assert "Full cache" not in page.locator("#blind-a").inner_text() + page.locator("#blind-b").inner_text()
    page.locator("#blind-choice").get_by_label("A is better").check()
    page.locator("#blind-vote").click()
    reveal = page.locator("#blind-reveal")
    reveal.get_by_text("was the full cache").wait_for()
    assert "budget" in reveal.inner_text() and "KV held after the prompt" in reveal.inner_text()
    assert "time for the answer" in reveal.inner_text()
    page.locator("#blind-status").get_by_text("Vote recorded").wait_for()
    save(page, "app_blind.png")
    # the next answers (a follow-up: nothing else touches the vote control) come with nothing ticked
    assert page.locator("#blind-choice input:checked").count() == 1
    page.locator("#blind-input textarea").fill(scene.questions[-1])
    page.locator("#blind-ask").click()
    page.locator("#blind-status").get_by_text("Turn 2: which answer is better").wait_for()
    assert page.locator("#blind-choice input:checked").count() == 0
    page.get_by_role("tab", name="Leaderboard").click()
    expect(page.locator("#blind-board")).to_contain_text("tiny-arena-vl")
    page.close()
