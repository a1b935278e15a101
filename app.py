"""KV-cache arena: chat with a vision-language model, pick a KV-cache compression method, and watch
what it saves. ``python app.py`` serves it on ``GRADIO_SERVER_NAME``:``GRADIO_SERVER_PORT``
(Gradio's defaults otherwise).

Environment: ``KV_ARENA_MODEL`` (the model picked at start; default: a hub model with a GPU and
network, else the offline ``tiny-arena-vl``), ``KV_ARENA_PRELOAD=0`` (load it on first use instead),
``KV_ARENA_MAX_VIDEO_SECONDS`` / ``KV_ARENA_MAX_VIDEO_MB`` (upload limits), ``KV_ARENA_QUEUE``,
``KV_ARENA_TRUSTED_PROXY_HOPS`` (proxies whose ``X-Forwarded-For`` entries name the visitor: 1 on a
Space, else 0; at 0 the server believes no proxy either), ``KV_ARENA_MAX_QUEUED_PER_VISITOR`` /
``KV_ARENA_MAX_QUEUED_PER_ADDRESS`` (events one person, one address may have waiting or running: 4, 8),
``KV_ARENA_KV_STORE`` / ``KV_ARENA_KV_STORE_MB`` (MPIC's media KV store: directory, disk cap),
``KV_ARENA_SESSION_IDLE_S`` / ``KV_ARENA_SESSION_NO_HEARTBEAT_S`` (a session without a heartbeat open ends
after this long idle; one that never opened one, sooner), ``KV_ARENA_MAX_SESSIONS_PER_VISITOR`` (16),
``KV_ARENA_MAX_SCENES`` (drawn scenes kept on disk), ``KV_ARENA_MAX_UNUSED_UPLOAD_MB`` /
``KV_ARENA_MAX_UNUSED_UPLOADS_MB`` (uploads no event used yet: per visitor, in all; ``_FILES`` and
``_PER_ADDRESS`` too),
``KV_ARENA_RANDOM_MODELS=1`` / ``KV_ARENA_RANDOM_MAX_PARAMS`` (offer ``random:`` architectures, under
that size),
``KV_ARENA_DB_URL`` (the "Can you tell?" tab's votes: any SQLAlchemy URL; default SQLite in
``KV_ARENA_DATA_DIR``), ``KV_ARENA_BLIND_*`` (its expiry and rates, docs/app.md),
``KV_ARENA_MONITORING=1`` (Gradio's ``/monitoring``; off otherwise), ``KV_ARENA_MCP=1`` (``/chat`` and
``/compare`` also as MCP tools at ``/gradio_api/mcp/``; off otherwise, docs/mcp.md says why). See
README.md and docs/.
"""

from __future__ import annotations

import logging
import os

try:  # on a Space, `spaces` comes first: it patches torch before anything touches CUDA (ZeroGPU)
    import spaces  # noqa: F401
except ImportError:
    pass

import gradio as gr

from components.about import build_about
from components.blind import build_blind, build_leaderboard
from components import clients, queue_limit
from components.chat import build_chat
from components.compare import build_compare, example_css
from components.compare_table import TABLE_CSS
from components.settings import build_settings
from kv_arena import service
from kv_arena.errors import UserError

HEADER = """# KV-cache arena
Chat with images and video while a KV-cache method decides what the model remembers: watch the memory
it saves, what it costs in speed, and which image tokens it kept. See **About** for the plain-words tour."""

# On a phone the conversation comes first and the settings fold below it: each column takes the
# row's whole width there (the row wraps them, settings first as written) and the order is swapped.
# Not flex-direction: column, under which a tab's wide table widened the column past the screen.
# At 1280 px the settings stay on the left.
LAYOUT_CSS = """
@media (max-width: 768px) {
  #settings-column, #main-column { min-width: 100% !important; }
  #main-column { order: -1; }
  /* the leaderboard's columns keep a readable width and scroll sideways (not a letter a line) */
  #blind-board .upload-container { overflow-x: auto; }
  #blind-board .virtual-table-viewport { min-width: 760px; }
}
/* the Chatbot's "Chat" badge floated over the scrolling chat and covered what scrolled under it
   ("Method switched"): it gets a row of its own, the messages scroll below it */
#chatbot > .wrapper { display: flex; flex-direction: column; }
#chatbot > .wrapper > label[data-testid=block-label] { position: static; align-self: flex-start; margin: 6px 0 2px 6px; }
#chatbot > .wrapper > .bubble-wrap { flex: 1 1 auto; min-height: 0; }
/* the leaderboard's headers wrap between words only ("Budge|t" broke mid-word): a narrow screen
   scrolls the table sideways instead (not every table: Compare's fixed column widths would clip them) */
#blind-board th span.header { overflow-wrap: normal; word-break: keep-all; }
"""

THEME = gr.themes.Soft()

# "✓" and "✗" from a font that draws a tick: IBM Plex Mono (the theme's monospace) draws "✓" as a
# "√". unicode-range: these two characters only, every other one keeps the theme's fonts; where
# none of these fonts is installed the theme's stack draws them as before.
MARKS_CSS = """
@font-face {
  font-family: "kv-marks";
  src: local("DejaVu Sans"), local("DejaVuSans"), local("Segoe UI Symbol"), local("Apple Symbols"),
       local("Noto Sans Symbols 2"), local("NotoSansSymbols2-Regular");
  unicode-range: U+2713, U+2717;
}
.gradio-container { --font: "kv-marks", FONT; --font-mono: "kv-marks", MONO; }
""".replace("FONT", THEME.font).replace("MONO", THEME.font_mono)

CSS = """
#chat-status, #compare-status { font-size: 0.9em; }
.range-note, #compare-methods-note { color: #b45309; font-size: 0.85em; margin-top: 4px; }
.answer textarea { font-family: "kv-marks", ui-monospace, monospace; font-size: 0.85em; }
/* Compare's examples sit above its question: thumbnails, not pictures, so the question, its button and
   the answers stay near them */
#compare-examples :is(img, video) { max-height: 48px !important; width: auto !important; }
""" + LAYOUT_CSS + MARKS_CSS + TABLE_CSS


def _release(request: gr.Request) -> None:
    service.release(getattr(request, "session_hash", None))  # the tab closed: free its caches now


def _private_session_load(demo: gr.Blocks, session: gr.State) -> None:
    """The API's endpoints are ``/chat`` and ``/compare``; every other event is declared with
    ``api_visibility="private"``, but one cannot be: the load event Gradio adds for a State whose
    value is a callable (each tab's :class:`Session`), which takes no ``api_visibility``
    (``Component.attach_load_event`` in Gradio 6.31). A State without a callable would give API
    clients no Session (Gradio makes one lazily from that callable on their first event), so
    the event is kept and made private here, the one place the app sets a Gradio internal."""
    for fn in demo.fns.values():
        if fn.outputs == [session] and fn.fn is service.Session:
            fn.api_visibility = "private"


def build_demo() -> gr.Blocks:
    # delete_cache: uploads and rendered overlays older than an hour are removed every 30 minutes
    with gr.Blocks(title="KV-cache arena", delete_cache=(1800, 3600)) as demo:
        # one Session per browser tab: its chat, uploads and caches are never shared
        session = gr.State(service.Session, delete_callback=service.close_session)
        gr.Markdown(HEADER)
        with gr.Row(elem_id="layout"):
            with gr.Column(scale=1, min_width=300, elem_id="settings-column"):
                settings = build_settings()
            with gr.Column(scale=3, elem_id="main-column"):
                # "wrap": on a phone the tabs go onto a second row, each named (the default hides
                # those that do not fit behind an unlabelled "⋯")
                with gr.Tabs(elem_id="tabs", overflow_behavior="wrap"):
                    with gr.Tab("Chat", id="chat"):
                        build_chat(settings, session)
                    with gr.Tab("Compare", id="compare"):
                        build_compare(settings, session)
                    blind_tab = gr.Tab("Can you tell?", id="blind")
                    with gr.Tab("Leaderboard", id="leaderboard") as board_tab:
                        board = build_leaderboard()
                    with blind_tab:
                        build_blind(settings, session, board, board_tab)
                    with gr.Tab("About", id="about"):
                        build_about()
        demo.unload(_release)
    _private_session_load(demo, session)
    service.start_sweeper()  # idle sessions without a heartbeat, uploads no session took
    # api_open=False: every event goes through the queue (its size and concurrency limits), none
    # can be posted to /run directly, private ones included
    demo.queue(max_size=queue_limit.queue_size(), api_open=False)
    return demo


# A number typed into a slider's box outside its range is clamped by Gradio's frontend before any
# event sees it; this says so under the settings (capture phase: it runs before the clamp).
RANGE_JS = """
() => document.addEventListener("change", (event) => {
  const box = event.target;
  if (!box.matches || !box.matches(".range-said input[type=number]")) return;
  const value = parseFloat(box.value), low = parseFloat(box.min), high = parseFloat(box.max);
  const block = box.closest(".range-said");
  const label = block.querySelector("[data-testid=block-info]");
  let note = block.querySelector(".range-note");  // said under the box itself, once
  if (!note) {
    note = document.createElement("div");
    note.className = "range-note";
    block.appendChild(note);
  }
  const outside = value < low || value > high || isNaN(value);
  const clamped = isNaN(value) ? low : Math.min(high, Math.max(low, value));
  note.textContent = outside
    ? `${label ? label.textContent : "This value"} must lie between ${low} and ${high}: ${box.value} was set to ${clamped}.`
    : "";
  if (outside) {  // the box shows what was set, not what was typed
    box.value = String(clamped);
    box.dispatchEvent(new Event("input", {bubbles: true}));
  }
}, true)
"""


def launch_options() -> dict:
    """What ``launch()`` takes besides the address (the tests launch with the same look and limits)."""
    # the example videos' previews are read from their files here, not when app.py is imported
    return {"max_file_size": service.MAX_VIDEO_BYTES, "theme": THEME, "css": CSS + example_css(), "js": RANGE_JS,
            # no run history: a run needs its tab's session (the conversation, the uploads), which a
            # stored run cannot bring back, and its page showed the panels as raw JSON and "[object Object]"
            "run_history": False,
            "enable_monitoring": os.environ.get("KV_ARENA_MONITORING") == "1",  # its traffic is no visitor's business
            # off by default: Gradio's MCP bridge sends every tool call through one client of its own, so
            # all MCP callers are one upload owner and one client to the queue limit; each call gets a
            # session of its own (components/mcp_calls.py, docs/mcp.md)
            "mcp_server": os.environ.get("KV_ARENA_MCP") == "1",
            **clients.launch_kwargs(queue_limit.QueueLimit)}


def configure_logging() -> None:
    """The app's own lines on stderr: one line per user error ("user error: ..."), a traceback only
    for an unexpected failure (logged with ``log.exception``); other libraries keep their levels.
    Values Gradio would refuse with a traceback of its own reach the app's checks instead
    (``components/checked_controls.py``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("components", "kv_arena"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)


def main() -> None:
    configure_logging()
    service.open_app(service.AppState())  # this process's models, sessions, store and uploads' ledger
    # before Gradio is built: its uploads go to this process's own folder, an earlier run's are swept
    service.use_own_upload_folder()
    service.sweep_dead_sessions()  # what sessions of an earlier run left on disk
    try:  # the votes database, migrated now: bad settings are one line before anything is served
        votes = service.blind.open_votes()
    except service.VotesUnavailable as exc:
        raise SystemExit(f"error: {exc}") from None
    logging.getLogger("kv_arena").info("votes database: %s", votes.url)
    if os.environ.get("KV_ARENA_PRELOAD", "1") != "0":  # the first visitor should not wait for it
        try:
            service.get_model(service.default_model())
        except UserError as exc:  # still serve: the UI says the same when the model is used
            print(f"warning: {exc}")
    port = os.environ.get("GRADIO_SERVER_PORT")
    build_demo().launch(server_name=os.environ.get("GRADIO_SERVER_NAME"), server_port=int(port) if port else None,
                        **launch_options())


if __name__ == "__main__":
    main()
