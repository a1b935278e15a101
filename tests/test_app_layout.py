"""The page's layout in headless Chromium, on a phone (390 x 844) and a laptop (1280 x 800): the
method switch on the first screen (beside the conversation on the laptop, right under it on the
phone), the model's description folded, every tab named; on the laptop the settings stay on the
left. Also what looked broken at 1280 px: the chat's badge over its first line, the leaderboard's
headers broken mid-word, the run history's "[object Object]", "✓" drawn as "√".

Skipped, as the newcomer's browser test (tests/test_app_browser.py) is, without Playwright or
Chromium; one app and one browser for the module.
"""

from __future__ import annotations

import pytest

# its skips too: without Playwright or Chromium this module is skipped with the same words; its
# fixtures too, one app and one browser for this module (pytest finds a fixture imported here)
from tests.test_app_browser import browser, expect, url  # noqa: F401

TABS = ("Chat", "Compare", "Can you tell?", "Leaderboard", "About")
PHONE = {"width": 390, "height": 844}
LAPTOP = {"width": 1280, "height": 800}


@pytest.fixture
def open_page(url, browser):
    pages = []

    def open_at(viewport: dict):
        page = browser.new_page(viewport=viewport)
        page.set_default_timeout(90_000)
        page.goto(url)
        page.locator("#chat-input textarea").wait_for()
        pages.append(page)
        return page

    yield open_at
    for page in pages:
        page.close()


def box(page, selector: str) -> dict:
    return page.locator(selector).first.bounding_box()


def lines_of(elements) -> list[tuple[str, int]]:
    """(text, lines it is drawn on) of each element: its text's boxes, by distinct top."""
    return elements.evaluate_all("""found => found.map(element => {
        const range = document.createRange(); range.selectNodeContents(element);
        return [element.textContent.trim(), new Set([...range.getClientRects()].map(r => Math.round(r.top))).size];
    })""")


def every_tab_is_named_and_opens(page, width: int) -> None:
    """Each tab's name on screen (no "⋯" menu hides one) and a click on it opens it."""
    expect(page.get_by_label("More tabs")).to_have_count(0)
    for name in TABS:
        tab = page.get_by_role("tab", name=name, exact=True)
        expect(tab).to_be_visible()
        where = tab.bounding_box()
        assert where["x"] >= 0 and where["x"] + where["width"] <= width, name  # not cut at the screen's edge
        tab.click()
        expect(tab).to_have_attribute("aria-selected", "true")
        assert box(page, "#main-column")["width"] <= width, name  # a tab's wide table scrolls inside it
    page.get_by_role("tab", name="Chat", exact=True).click()


def bottom(page, selector: str) -> float:
    where = box(page, selector)
    return where["y"] + where["height"]


def test_on_a_phone_the_conversation_comes_first_then_the_method_and_every_tab_is_named(open_page):
    page = open_page(PHONE)
    message = box(page, "#chat-input textarea")
    assert message["y"] + message["height"] <= 2 * PHONE["height"]  # within the first two screens (2,676 px before)
    # the method switch right under the conversation: 3,829 px down when it sat under the model's card
    assert box(page, "#method")["y"] >= message["y"] + message["height"]
    assert bottom(page, "#method") <= 2 * PHONE["height"]
    settings = box(page, "#settings-column")
    assert settings["y"] >= message["y"] + message["height"]  # the other settings fold below the conversation
    assert box(page, "#model")["y"] > box(page, "#chatbot")["y"]
    every_tab_is_named_and_opens(page, PHONE["width"])


def test_on_a_laptop_the_method_switch_is_on_the_first_screen_and_the_settings_on_the_left(open_page):
    page = open_page(LAPTOP)
    settings, main = box(page, "#settings-column"), box(page, "#main-column")
    assert settings["x"] + settings["width"] <= main["x"] and abs(settings["y"] - main["y"]) < 20  # side by side
    message = box(page, "#chat-input textarea")
    assert message["y"] + message["height"] <= LAPTOP["height"]  # the message box on the first screen
    # Method and Budget beside the conversation, within the first screen (they ended at 1,024 and
    # 1,323 px under the model's 600-word description, now folded)
    method, chat = box(page, "#method"), box(page, "#chatbot")
    assert method["x"] >= chat["x"] + chat["width"] and abs(method["y"] - chat["y"]) < 20
    assert bottom(page, "#method") <= LAPTOP["height"] and bottom(page, "#budget") <= LAPTOP["height"]
    expect(page.locator("#model-card")).to_be_hidden()  # folded: opened on demand
    page.locator("#model-about").get_by_text("What this model reads").click()
    expect(page.locator("#model-card")).to_be_visible()
    every_tab_is_named_and_opens(page, LAPTOP["width"])
    # the chat's "Chat" badge has a row of its own: nothing scrolls under it ("Method switched" did)
    badge, messages = box(page, "#chatbot label[data-testid=block-label]"), box(page, "#chatbot .bubble-wrap")
    assert badge["y"] + badge["height"] <= messages["y"]


def test_the_chats_method_shows_on_chat_only(open_page):
    """Compare and "Can you tell?" pick their own methods and budget: the Chat tab's are not on screen there."""
    page = open_page(LAPTOP)
    for name in ("Compare", "Can you tell?", "Leaderboard"):
        page.get_by_role("tab", name=name, exact=True).click()
        expect(page.locator("#method")).to_be_hidden()
    page.get_by_role("tab", name="Chat", exact=True).click()
    expect(page.locator("#method")).to_be_visible()


def test_the_long_video_example_streams_under_its_cap_with_every_frame(open_page):
    """A click on the minute-long example sets the cap and the frames it is sent with; another example
    sets them back."""
    from kv_arena import service

    long = service.long_example()
    page = open_page(LAPTOP)
    cap, frames = page.locator("#stream-cap input"), page.locator("#num-frames input[type=number]")
    page.get_by_text(long.question, exact=True).first.click()
    expect(cap).to_have_value(f"{long.stream_cap_mb:g}")
    expect(frames).to_have_value(str(long.frames))
    page.get_by_text("What is in the picture?", exact=True).first.click()
    expect(cap).to_have_value("0")
    expect(frames).to_have_value(str(service.default_frames(service.ARENA)))


def test_small_things_render_as_meant(open_page, url):
    page = open_page(LAPTOP)
    # no run history: its page showed the panels as raw JSON and "[object Object]"
    assert page.request.get(url.rstrip("/") + "/gradio_api/runs").status == 404
    expect(page.locator("footer")).not_to_contain_text("Runs")
    # "✓" from a font that draws a tick, in the theme's monospace (the tables) and sans alike
    fonts = page.locator("#chat-input").evaluate(
        "element => ['--font', '--font-mono'].map(name => getComputedStyle(element).getPropertyValue(name))")
    assert all(font.strip().startswith('"kv-marks"') for font in fonts), fonts
    # the leaderboard's one-word headers on one line ("Budge|t" broke mid-word)
    page.get_by_role("tab", name="Leaderboard", exact=True).click()
    headers = page.locator("#blind-board th span.header")
    headers.first.wait_for()
    lines = lines_of(headers)
    assert all(count == 1 for text, count in lines if " " not in text), lines
    board = box(page, "#blind-board")  # every column in view at 1280 px (the last one was cut)
    last = page.locator("#blind-board th").last.bounding_box()
    assert last["x"] + last["width"] <= board["x"] + board["width"] + 1


def test_compares_table_reads_on_a_phone_and_a_laptop(open_page):
    """On a phone its numbers stood one character a line ("0.775" five lines tall) and a "not
    marked" reason made a row ~400 px tall; at 1280 px "Turn" broke mid-word. Now a number is on one
    line, a phone scrolls the table sideways (the page stays its width) and "Turn" is one line.
    Before the run: the video example shows its first frame, whether or not the video loads."""
    page = open_page(PHONE)
    page.get_by_role("tab", name="Compare", exact=True).click()
    examples = page.locator("#compare-examples")
    video = examples.locator("video").first
    assert video.evaluate("v => getComputedStyle(v).backgroundImage").startswith('url("data:image/jpeg;base64,')
    examples.get_by_text("What colour is the cross?").first.click()
    page.locator("#compare-input img").first.wait_for()
    page.locator("#compare-run").click()
    page.locator("#compare-status").get_by_text("Done").wait_for(timeout=300_000)
    table = page.locator("#compare-table")
    cells = table.locator('[role=gridcell]:not([data-col="0"]):not([data-col="9"]) span.text')
    expect(cells).to_have_count(10 * 9)  # two turns of the full cache and four methods, nine columns of numbers

    def readable(width: int) -> None:
        texts = lines_of(cells)
        assert all(count <= 1 for _, count in texts), texts  # "" has no line
        heights = table.locator("[role=gridcell]").evaluate_all("cells => cells.map(c => c.getBoundingClientRect().height)")
        assert max(heights) < 80, heights  # a couple of lines at most, whatever a cell holds
        assert box(page, "#main-column")["width"] <= width  # the table scrolls in its box, not the page

    readable(PHONE["width"])
    scroller = table.locator(".upload-container")
    assert scroller.evaluate("e => e.scrollWidth > e.clientWidth + 100")  # sideways, inside the table's box
    page.set_viewport_size(LAPTOP)
    expect(table.locator("th span.header").first).to_be_visible()
    readable(LAPTOP["width"])
    assert scroller.evaluate("e => e.scrollWidth <= e.clientWidth + 1")  # all of it in view
    assert lines_of(table.locator('th[title="Turn"] span.header')) == [["Turn", 1]]
