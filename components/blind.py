"""The "Can you tell?" tab and the leaderboard: a question about a picture or a video is answered
twice, by the full cache and by a method drawn from those that run on the model (its budget drawn
from a few levels, or chosen), shown as A and B in a random order and nothing else. The visitor
votes; only then does the app reveal which was which, the method, its budget, the KV each held
and the time each took. A follow-up continues both conversations and is voted on again.

Nothing sent before the vote names the method, its budget or the side (the progress is one
neutral line, the service's), and each battle's answers arrive with the vote control emptied. The
rates count per visitor (``clients.visitor_of``: an address, never a cookie); the cookie only owns
the battle. Where sign-in is required (on a Space by default), the tab has Gradio's Hugging Face
login button, a vote keeps the account signed in (Gradio injects ``gr.OAuthProfile`` by type),
and the board counts only those votes, the others' number on a line under it.

The events are the API's ``/blind``, ``/vote`` and ``/leaderboard``; the logic, the database and its
rules are the service's (``kv_arena.service.blind``): this module formats and wires.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
from gradio.utils import get_space

from kv_arena import service
from kv_arena.errors import UserError

from . import checked_controls, clients, mcp_calls
from .chat import box_as_sent, parse_message, progress_reporter, refusal, show_examples
from .chat_status import hint_line
from .compare import example_rows
from .outputs import KEEP, Outputs, by_component, components_of
from .plots import fmt_bytes
from .settings import settings_from_named

log = logging.getLogger(__name__)
BOARD_COLUMNS = ["Model", "Method", "Budget", "Votes", "Can't tell", "95% interval", "KV held", "Votes right",
                 "Method right"]
BOARD_WIDTHS = ["13%", "17%", "8%", "7%", "9%", "14%", "9%", "11%", "12%"]
RANDOM = "random"  # the budget drawn at random (the method's draw is service.blind.DRAW)


@dataclass(frozen=True)
class BlindOutputs(Outputs):
    """What the tab's events set (KEEP: left as it is); /blind returns the battle id first, then A and
    B; ``choice`` (the vote control, last) is emptied whenever a battle's answers appear."""

    battle: Any = KEEP
    a: Any = KEEP
    b: Any = KEEP
    status: Any = KEEP
    reveal: Any = KEEP
    textbox: Any = KEEP
    choice: Any = KEEP


@dataclass(frozen=True)
class VoteOutputs(Outputs):
    """What a vote sets: the reveal first (/vote returns it first), the status, the leaderboard."""

    reveal: Any = KEEP
    status: Any = KEEP
    board: Any = KEEP


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def board_rows(rows: list[service.BoardRow]) -> list[list]:
    return [[r.model, r.method_title, f"{r.budget:g}", r.votes, _share(r.cant_tell), f"{r.low:.0%} to {r.high:.0%}",
             f"{r.kv_fraction:.2f}x", _share(r.votes_right), _share(r.method_right)] for r in rows]


def _mark(right: bool | None, truth: str | None) -> str:
    return "" if right is None else "✓ right" if right else f"✗ wrong (true: {truth})"


def reveal_text(r: service.Reveal) -> str:
    """Which answer was which, the method and its budget, the KV each held and the time each took."""
    method_side = "B" if r.full_side == "A" else "A"
    said = {"A": "A is better", "B": "B is better", "same": "the same"}[r.choice]
    verdict = {"full": "the full cache's answer", "method": f"{r.method_title}'s answer (compressed)",
               "same": "neither: you could not tell them apart"}[r.verdict]
    lines = [f"**{r.full_side} was the full cache, {method_side} was {r.method_title} at budget {r.budget:g}** "
             f"(turn {r.turn}). You voted {said}: {verdict}.", "",
             f"| | {r.full_side}: full cache | {method_side}: {r.method_title} |", "|---|---|---|",
             f"| KV held after the prompt | {fmt_bytes(r.full_kv_bytes)} | {fmt_bytes(r.method_kv_bytes)} "
             f"({r.kv_fraction:.2f}x) |",
             f"| the model's time for the answer | {r.full_s:.2f} s | {r.method_s:.2f} s |"]
    if r.full_right is not None:
        lines.append(f"| against the scene's true answer | {_mark(r.full_right, r.truth)} | "
                     f"{_mark(r.method_right, r.truth)} |")
        lines += ["", "Your vote agrees with the truth." if r.right else "Your vote does not agree with the truth."]
    return "\n".join(lines)


BLIND_RETURNS = ("the battle's id (give it to /vote, and to /blind's battle for a follow-up), answer A, answer B "
                 "(the full cache's and a method's, in a random order), the status line, the reveal (empty until "
                 "the vote), the message box, the vote control (emptied: null).")
SIGN_IN = "sign in with Hugging Face (the button above) for your votes to count"
# off a Space there is no button to point at
NO_SIGN_IN = "only signed-in votes count here (KV_ARENA_BLIND_REQUIRE_LOGIN), and this server offers no sign-in"


def blind(message, model, method=service.blind.DRAW, budget=RANDOM, battle="", session=None, request: gr.Request = None,
        progress=gr.Progress()) -> Iterator[BlindOutputs]:
    """Answer a question about a picture or a video twice, with the full cache and with a KV-cache method, shown as A and B in a random order; which is which is revealed by /vote.

    Args:
        message: the question, {"text": the question, "files": images or one video this client uploaded (gradio_client's handle_file)}; a follow-up is text only.
        model: the model's name (`python -m kv_arena.bench --list`); tiny-arena-vl is the offline model, whose scenes know the true answers.
        method: "any" (drawn from the budgeted methods that run on the model) or a method's registry name ("random" is Random eviction).
        budget: "random" (drawn from 0.1, 0.2, 0.3, 0.5) or one of those levels: the fraction of the full cache's KV bytes the method may hold.
        battle: "" for a new battle; the id of a battle this client voted on, to ask a follow-up on both conversations (the same method and budget).
    Returns:
        the battle's id, answer A, answer B, the status line, the reveal (empty until the vote), the message box, the vote control (emptied: null).
    """
    session_hash = getattr(request, "session_hash", None)
    client = clients.client_of(request)
    clients.track(session, request)
    with service.active(session_hash):
        try:
            text, files = parse_message(message)
            if request is not None:  # from a client: only its own uploads (a direct call may name any file)
                service.check_sent_files(files)
            service.check_uploads(session, files)
            settings = settings_from_named({"model": model})
            follow = (battle or "").strip() if isinstance(battle, str) else battle
            if not isinstance(follow, str):
                raise UserError("The battle must be an id (text), or empty for a new battle.")
            yield BlindOutputs(status="Both answering… (the full cache and a method, one after the other)")
            prepared = service.prepare(text, files, settings.num_frames, progress_reporter(progress))
            shown = service.blind.start(session, settings, prepared, method, budget, client, follow,
                                        progress_reporter(progress), _visitor(request))
        except UserError as exc:  # text in every field an API client reads: the battle as sent, no answers
            sent = battle.strip() if isinstance(battle, str) else ""
            yield BlindOutputs(sent, "", "", refusal(exc), "", box_as_sent(message), None)
            return
    hint = f" {hint_line(shown.hint)}" if shown.hint else ""
    yield BlindOutputs(shown.id, shown.a, shown.b, f"Turn {shown.turn}: which answer is better? Vote below; the "
                       f"method is revealed after your vote.{hint}", "", {"text": "", "files": []}, None)


def _visitor(request: gr.Request | None) -> str | None:
    """The visitor the rates count by (None without a request: the service uses the session's)."""
    return clients.visitor_of(request).key if request is not None else None


def vote(battle, choice, session=None, request: gr.Request = None,
         profile: gr.OAuthProfile | None = None) -> VoteOutputs:
    """Vote on a battle /blind showed this client: which answer was better; the reply reveals which was which, the method, its budget, the KV each held and the time each took. One vote per battle.

    Args:
        battle: the battle's id, as /blind returned it.
        choice: "A" (A is better), "B" (B is better) or "same".
    Returns:
        the reveal, the status line, the leaderboard.
    """
    client = clients.client_of(request)
    if session is not None:
        clients.track(session, request)
    account = getattr(profile, "username", None) or None  # Gradio's: None when signed out, or off a Space
    try:
        reveal = service.blind.vote(battle, choice, client, session, _visitor(request), account)
    except UserError as exc:
        return VoteOutputs(status=refusal(exc))
    counted = "" if reveal.counted else \
        f" It is kept but not counted on the leaderboard: {SIGN_IN if login_available() else NO_SIGN_IN}."
    return VoteOutputs(reveal=reveal_text(reveal), status=f"Vote recorded.{counted} Ask a follow-up to continue both "
                       "conversations (it is voted on again), or start a new battle.", board=board())


def board() -> list[list]:
    try:
        return board_rows(service.blind.leaderboard())
    except UserError as exc:
        return [[f"{exc}"] + [""] * (len(BOARD_COLUMNS) - 1)]


def leaderboard() -> list[list]:
    """The votes per model, method and budget level: the share "can't tell" (same, or the compressed answer preferred) with its 95% Wilson interval, the mean KV the method held, and on the offline model's scenes the share of votes that agree with the truth and of the method's answers that were right.

    Returns:
        the table, one row per model, method and budget level.
    """
    return board()


def board_note() -> str:
    """The line under the board: the votes kept but not counted (cast signed out where sign-in is
    required), if any."""
    try:
        apart = service.blind.signed_out_apart()
    except UserError:
        return ""
    return (f"Not counted above: {apart} vote{'s' * (apart != 1)} from visitors not signed in with Hugging Face "
            "(kept; only signed-in votes count).") if apart else ""


def board_and_note() -> tuple[list[list], str]:
    return board(), board_note()


def new_battle() -> BlindOutputs:
    return BlindOutputs("", "", "", "Ask about a picture or a video: a new battle.", "", {"text": "", "files": []},
                        None)


def method_choices() -> list[tuple[str, str]]:
    """The methods a battle may draw (not InfiniPot-V, which holds a picture whole: battles do not stream)."""
    return [("Any (drawn at random)", service.blind.DRAW)] + [
        (title, name) for name, title in service.blind.battle_methods()]


@dataclass
class BlindTab:
    """The tab's components (named as :class:`BlindOutputs`' fields)."""

    battle: gr.Textbox
    a: gr.Textbox
    b: gr.Textbox
    status: gr.Markdown
    reveal: gr.Markdown
    textbox: gr.MultimodalTextbox
    choice: gr.Radio
    board: gr.Dataframe


@dataclass
class Board:
    """The Leaderboard tab's table and the line under it (the votes not counted)."""

    table: gr.Dataframe
    note: gr.Markdown


def build_leaderboard() -> Board:
    gr.Markdown("Votes from the **Can you tell?** tab, per model, method and budget level. *Can't tell*: the share "
                "of votes for \"the same\" or for the compressed answer, with its 95% Wilson interval. *KV held*: "
                "the mean fraction of the full cache's bytes the method really held. On the offline model's "
                "scenes, *Votes right*: votes that agree with the true answer; *Method right*: its answers right.")
    # widths that fit 1280 px whole (the last column was cut); a phone scrolls it sideways, the model
    # and the method pinned on the left
    table = gr.Dataframe(headers=BOARD_COLUMNS, interactive=False, elem_id="blind-board", label="Leaderboard",
                         wrap=True, column_widths=BOARD_WIDTHS, pinned_columns=2)
    note = gr.Markdown(elem_id="blind-board-note")
    refresh = gr.Button("Refresh", elem_id="blind-board-refresh", size="sm")
    refresh.click(leaderboard, None, table, api_name="leaderboard").then(board_note, None, note,
                                                                         api_visibility="private")
    return Board(table, note)


def login_available() -> bool:
    """Whether Gradio's Hugging Face sign-in can run here: on a Space with OAuth on (``hf_oauth: true``
    in the README's header sets ``OAUTH_CLIENT_ID``) and Gradio's OAuth extra (authlib) installed.
    Anywhere else a ``gr.LoginButton`` would stop the app from starting: off a Space Gradio stands in
    with this machine's Hugging Face account, read from the hub when the app is built."""
    return (get_space() is not None and bool(os.environ.get("OAUTH_CLIENT_ID"))
            and importlib.util.find_spec("authlib") is not None)


def private_status_check(button: gr.LoginButton) -> None:
    """The button's page-load check ("Signed in as ...") made private: Gradio attaches it as a public
    endpoint (``/_check_login_status``), and a load event it attaches takes no ``api_visibility``."""
    attached = getattr(button, "load_event_to_attach", None)
    root = gr.context.Context.root_block
    if not attached or root is None:
        return
    button.load_event_to_attach = None
    root.load(attached[0], None, button, api_visibility="private", show_progress="hidden")


def build_login() -> None:
    """Gradio's Hugging Face sign-in, where votes count only signed in (``KV_ARENA_BLIND_REQUIRE_LOGIN``,
    on by default on a Space); where it cannot run, the tab says that votes are kept but not counted."""
    if not service.blind.require_login():
        return
    if login_available():
        private_status_check(gr.LoginButton(elem_id="blind-login"))
        gr.Markdown("Votes count on the leaderboard only from visitors signed in with Hugging Face (a vote cast "
                    "signed out is kept, its number shown under the board).", elem_id="blind-login-note")
        return
    log.warning("KV_ARENA_BLIND_REQUIRE_LOGIN: votes count only signed in, but Hugging Face sign-in is not available "
                "here (a Space with hf_oauth: true and gradio[oauth]): no vote counts on the leaderboard")
    gr.Markdown("Votes count on the leaderboard only from visitors signed in with Hugging Face, and this server "
                "offers no sign-in: your vote is kept, not counted.", elem_id="blind-login-note")


def build_blind(settings, session: gr.State, board: Board, board_tab: gr.Tab) -> BlindTab:
    gr.Markdown("Ask about a picture or a video: the full cache and a KV-cache method both answer, shown as A and B "
                "in a random order. Vote for the better one (or the same); only then is it revealed which was "
                "which, the method and what it saved. The model is the sidebar's.")
    build_login()
    with gr.Row():
        method = checked_controls.Dropdown(method_choices(), value=service.blind.DRAW, label="Method", elem_id="blind-method")
        budget = checked_controls.Dropdown([("Random (drawn)", RANDOM)] + [(f"{b:g}", f"{b:g}") for b in service.blind.LEVELS],
                                           value=RANDOM, label="Budget", elem_id="blind-budget")
        # value "": the API's battle parameter is optional, a new battle without it
        battle = gr.Textbox("", label="Battle (a follow-up continues it)", interactive=False, elem_id="blind-battle")
    textbox = checked_controls.MultimodalTextbox(file_types=["image", "video"], file_count="multiple", submit_btn=False,
                                                 elem_id="blind-input", show_label=False, label="Message",
                                                 placeholder="A question, with a picture or a video…")
    example_sets = []
    for kind in (True, False):  # the offline model's scenes, or general examples for hub models
        with gr.Column(visible=kind == service.is_trained_here(settings.model.value)) as column:
            rows = [row[0] for row in example_rows(kind)]  # the first question with its media
            if rows:
                gr.Examples(rows, inputs=textbox, label="Examples", elem_id="blind-examples" if kind else None,
                            api_visibility="private")
        example_sets.append(column)
    with gr.Row():
        ask_button = gr.Button("Ask", variant="primary", elem_id="blind-ask")
        new_button = gr.Button("New battle", elem_id="blind-new")
    status = gr.Markdown(elem_id="blind-status", label="Status")
    with gr.Row(equal_height=True):
        a = gr.Textbox(label="A", lines=4, interactive=False, elem_id="blind-a", elem_classes=["answer"])
        b = gr.Textbox(label="B", lines=4, interactive=False, elem_id="blind-b", elem_classes=["answer"])
    with gr.Row():
        choice = checked_controls.Radio([("A is better", "A"), ("B is better", "B"), ("The same", "same")],
                                        label="Your vote", elem_id="blind-choice")
        vote_button = gr.Button("Vote", elem_id="blind-vote")
    reveal = gr.Markdown(elem_id="blind-reveal", label="Reveal")
    tab = BlindTab(battle, a, b, status, reveal, textbox, choice, board.table)
    event = by_component(tab, mcp_calls.own_session(blind))  # the function's name is the MCP tool's
    ask_button.click(event, [textbox, settings.model, method, budget, battle, session],
                     components_of(tab, BlindOutputs), api_name="blind", concurrency_id="gpu", concurrency_limit=1)
    vote_button.click(by_component(tab, vote), [battle, choice, session], components_of(tab, VoteOutputs),
                      api_name="vote").then(board_note, None, board.note, api_visibility="private")
    new_button.click(by_component(tab, new_battle), None, components_of(tab, BlindOutputs), api_visibility="private")
    settings.model.change(show_examples, settings.model, example_sets, api_visibility="private")
    # the newest votes, other replicas' too
    board_tab.select(board_and_note, None, [board.table, board.note], api_visibility="private")
    return tab
