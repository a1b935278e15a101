"""A still preview of each example video: its first frame, drawn behind the example's video element.

An example's picture shows as a thumbnail; its video as a ``<video>`` element with no poster
(Gradio sets none), which a browser that loads no video until it is played (Safari on a phone, a
data saver) leaves empty: the video example had no preview. The first frame is drawn as the
element's CSS background, so it shows until (and unless) the browser paints the video's own frame
over it; inlined in the page's CSS (a few kB), so nothing more is served.
"""

from __future__ import annotations

import base64
import io
import logging
import re
from functools import lru_cache
from pathlib import Path

from kv_arena import service
from kv_arena.errors import UserError

log = logging.getLogger(__name__)
# an example's cell in any tab's Examples (Chat, Compare, "Can you tell?"), where Gradio draws its video
CELL = '[data-testid^="dataset-cell"]'


@lru_cache(maxsize=None)
def poster(path: str) -> str:
    """The video's first frame as a data URL (JPEG); "" when it cannot be read (no decord, say)."""
    try:
        frame = service.first_frame(path)
    except UserError as exc:
        log.info("no preview for %s: %s", Path(path).name, exc)
        return ""
    out = io.BytesIO()
    frame.convert("RGB").save(out, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def rule(path: str) -> str:
    """The CSS that draws ``path``'s first frame behind an example's video of that file: Gradio
    serves an example from its cache under the file's own name, which ends the element's src."""
    name, url = Path(path).name, poster(path)
    if not url or not re.fullmatch(r"[\w.-]+", name):  # a name CSS would need escaped: no preview, no risk
        return ""
    return f'{CELL} video[src$="/{name}"] {{ background: url("{url}") center / contain no-repeat; }}\n'


def css(videos: list[str]) -> str:
    """The previews of these example videos (each once)."""
    return "".join(rule(path) for path in dict.fromkeys(videos))


def videos_of(rows: list[list]) -> list[str]:
    """The video files of example rows whose first value is a message ({"text", "files"})."""
    return [f for row in rows for f in row[0]["files"] if service.is_video(f)]
