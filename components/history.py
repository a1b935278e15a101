"""A chat history as the Chatbot holds it (or a client sends it), read: each turn's question, files
and answer since the last new-conversation marker, and the files a history sent back names.

:func:`transcript` is what the model must remember for a message sent after a chat to continue its
conversation; :func:`sent_turns` is the same with the files each turn names, which the app re-reads
when the history is not the session's conversation (``chat.respond``).
"""

from __future__ import annotations

from kv_arena import service
from kv_arena.errors import UserError

from . import checked_controls

NEW_CONVERSATION = "New conversation"  # the title of the marker a new conversation gets in the chat
SWITCHED = "Method switched"  # the title of the line a conversation re-read by another method gets
REREAD = "History re-read"  # the title of the line a history sent (not the session's) gets once re-read
NOTES = (SWITCHED, REREAD)  # lines of the app's own inside a conversation: not turns
UNHELD = "unheld"  # marks the text standing for a returned file this server holds no copy of


def said(content) -> tuple[str, int]:
    """A chat message's (text, attached files), whatever form Gradio or a client gives it in."""
    text, files = _read(content)
    return text, len(files)


def _read(content) -> tuple[str, list[str | None]]:
    """A chat message's text and its files' paths (None: a block naming no file this server holds:
    a returned file without a copy here, a component)."""
    blocks = content if isinstance(content, list) else [content]
    text, files = [], []
    for block in blocks:
        if isinstance(block, str):
            text.append(block)
        elif isinstance(block, dict) and block.get(UNHELD):
            files.append(None)
        elif isinstance(block, dict) and (block.get("type") == "text" or "text" in block):
            text.append(block.get("text") or "")
        elif block is not None:  # {"path": ...}, {"type": "file", "file": {...}}, a component
            files.append(_path(block))
    return " ".join(text).strip(), files


def _path(block) -> str | None:
    if not isinstance(block, dict) or block.get(checked_controls.RETURNED):
        return None
    inner = block.get("file") if block.get("type") == "file" else block
    path = inner.get("path") if isinstance(inner, dict) else None
    return path if isinstance(path, str) else None


def sent_turns(history: list) -> list[tuple[str, list[str | None], str]]:
    """(question, files' paths, answer) of each turn a chat shows since its last new-conversation
    marker (a path is None where the history names no file this server holds)."""
    turns, question, files = [], [], []
    for message in history or []:
        title = (message.get("metadata") or {}).get("title")
        if title == NEW_CONVERSATION:
            turns, question, files = [], [], []
            continue
        if title in NOTES:  # the same conversation, held by another method from here on
            continue
        text, attached = _read(message.get("content"))
        if message.get("role") == "user":
            question.append(text)
            files += attached
        else:
            turns.append((" ".join(t for t in question if t), files, "" if text == "…" else text))
            question, files = [], []
    return turns


def transcript(history: list) -> list[tuple[str, int, str]]:
    """(question, attachments, answer) of each turn a chat shows since its last new-conversation
    marker: what the model must remember for a message sent after it to continue its conversation."""
    return [(question, len(files), answer) for question, files, answer in sent_turns(history)]


def with_own_files(history: list, session: service.Session) -> list:
    """A history sent back as ``/chat`` returned it: each file block gradio_client downloaded
    (``checked_controls.RETURNED``, a path of the client's) becomes this server's copy, matched from
    the newest file of the session's conversation backwards; one the conversation does not hold
    becomes a line saying so (marked ``UNHELD``: a history that must be re-read with it is refused)."""
    own = [f for p in session.history for f in p.files]
    out = []
    for message in reversed(history):
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get(checked_controls.RETURNED) for b in content):
            blocks = []
            for block in reversed(content):
                if isinstance(block, dict) and block.get(checked_controls.RETURNED):
                    block = ({"type": "file", "file": {"path": own.pop()}} if own else
                             {"type": "text", "text": "(a file)", UNHELD: True})
                blocks.append(block)
            message = message | {"content": blocks[::-1]}
        out.append(message)
    return out[::-1]


def rereadable_turns(history: list, from_client: bool) -> list[tuple[str, list[str], str]]:
    """The turns of a history to re-read, each file one this client may use (``from_client``: sent
    through a request, so each must be an upload or a shipped example), or a UserError of one line."""
    turns = sent_turns(history)
    for _, files, _ in turns:
        if None in files:
            raise UserError("The history sent names a file this server holds no copy of for this session (one "
                            "gradio_client downloaded, or not a file): send each file again with handle_file, or "
                            "send [] to start a new conversation.")
        if from_client:
            service.check_sent_files(files)
    return turns
