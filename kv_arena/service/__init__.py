"""What the app asks of the runtime, in plain Python values: the UI (``components/``) never sees a
tensor and never imports torch. The app imports this package only; its modules, by job:

* :mod:`.app_state` and :mod:`.current`: the application's state, one object per job (the model
  pool, the sessions, the store, the uploads' ledger, the drawn scenes); ``app.py`` opens its own
  (:func:`open_app`), a test uses its own for a block (:func:`using_app`); on import the package
  opens one with defaults (library use, benches, a forked GPU worker).
* :mod:`.model_picker`: the model the app starts with (a GPU and a network probe decide), the
  picker's choices, and what each model is.
* :mod:`.model_pool`: models load once and are shared between sessions (read-only weights); at
  most one hub model stays loaded.
* :mod:`.inputs`: the controls' :class:`Settings` (a model's video frames by default: :func:`default_frames`)
  and a message decoded and checked (:func:`prepare`).
* :mod:`.plan`: a turn's settings resolved once (:func:`plan_turn`): the method built, the cap it
  streams under, the generation arguments.
* :mod:`.sessions`: :class:`Session` is one browser tab: its conversation (the compressed cache
  carried from turn to turn), the media it uploaded, and its full-cache references. Nothing in it
  is shared.
* :mod:`.state`: what a session hands a GPU function and gets back (:mod:`.zerogpu`). The
  full-cache reference for a given input is computed once per session and reused; every view says
  whether its reference came from that cache (its timings are then from the earlier run).
* :mod:`.resent`: a history a client sent that is not the session's conversation becomes it
  (:func:`take_history`), for the turn's method to re-read as a switch re-reads.
* :mod:`.turns`: :func:`chat_turn` answers one message, yielding a view (answer so far, meters,
  per-layer figures, kept visual tokens at the end) after every token; :func:`compare` runs the
  full cache and up to four methods one after another on one input.
* :mod:`.streamed`: a message's media streamed under a KV cap, a few frames at a time (progress by
  frames, the cache's bytes after each chunk).
* :mod:`.view_types`: what the facade hands the UI, typed (frozen dataclasses of plain values and
  numpy arrays, no torch): :class:`ChatView`, :class:`CompareView` and their parts.
* :mod:`.views`: the figures the panels draw; :mod:`.at_scale`: what a KV fraction means on the
  real architectures; :mod:`.capacity`: what it leaves room for on the Space's card (frames of
  this video, pictures, tokens).
* :mod:`.store` and :mod:`.mpic`: MPIC's media KV store is one per application, under
  ``KV_ARENA_KV_STORE`` (default: ``kv-arena-mpic`` in the temp directory); each session's entries
  live in a namespace named by the server-side :attr:`Session.id` (never by anything a client
  sends), are stored when an MPIC turn adds media, listed by :func:`media_library` and dropped when
  the session closes or its model changes; :func:`mpic_default_k` suits MPIC-k's k to the model.
* :mod:`.visitors`: who a visitor is (an address behind the trusted proxies, a cookie only a
  sub-key), the one notion every per-visitor limit counts by.
* :mod:`.uploads`: which uploaded files a session may use, and which client may read them;
  :mod:`.upload_caps`: how much of them may wait unused; :mod:`.upload_folder`: each app process's
  own upload folder.
* :mod:`.methods`: the KV-cache methods described in plain values (titles, papers, parameters,
  whether one reuses stored media).
* :mod:`.blind`: the "Can you tell?" tab: the full cache and a method answer blind as A and B, a
  vote reveals which was which; votes in a database (SQLite by default, ``KV_ARENA_DB_URL``),
  migrated by Alembic at start, and the leaderboard with Wilson intervals.
* :mod:`.scenes`: the offline model's scenes with their true answers (examples, "New scene"), so
  answers are marked right or wrong, and the Chat tab's examples for it (:func:`arena_examples`).
"""

from ..media import MAX_VIDEO_BYTES  # the largest upload the app takes
from ..runtime.models import ARENA
from .app_state import AppState
from .current import current_app, open_app, using_app
from .inputs import (DEFAULT_FRAMES, MAX_FRAMES, MAX_STREAMED_FRAMES, Prepared, Settings, checked_text, default_frames,
                     first_frame, is_video, prepare)
from .model_picker import check_model_allowed, default_model, has_random_weights, is_trained_here, model_choices, model_description
from .model_pool import get_model
from .plan import Plan, plan_turn
from .methods import (HOLDS_ALL, budget_spec, checked_params, is_reference, method_spec, method_specs, methods_on, reference_spec,
                      params_owner, refused_methods, reuses_media, shown_title, stacks_of, title_of)
from .scenes import LongExample, Scene, arena_examples, draw_scene, long_example, media_hint, scene_types
from .scenes import examples as scene_examples
from .mpic import media_library, mpic_default_k, mpic_ttft
from .sessions import (Session, active, close_session, expire_idle, open_session, release, start_sweeper,
                       sweep_dead_sessions, track)
from .resent import take_history
from .state import ChatState
from .turns import MAX_COMPARE, chat_on_gpu, chat_turn, compare
from .upload_folder import use_own_upload_folder
from .visitors import Visitor, trusted_hops
from .visitors import from_request as visitor_from_request
from .visitors import from_scope as visitor_from_scope
from .uploads import (check_sent_files, check_uploads, in_upload_dir, may_read, note_served, note_uploads,
                      save_private_images, upload_room)
from . import blind, visitors
from .blind import Battle, BoardRow, Reveal, VotesUnavailable
from .view_types import (
    ChatView,
    CompareRun,
    CompareTurn,
    CompareView,
    KeptVisual,
    LayerFigures,
    LibraryEntry,
    Meters,
    ProgressNote,
    ReferenceView,
    ReuseSummary,
    StreamView,
    SwitchNote,
    TtftView,
)
from .views import kept_visuals

__all__ = [
    "AppState", "current_app", "open_app", "using_app",
    "ARENA", "arena_examples", "long_example", "LongExample", "first_frame", "is_video", "MAX_COMPARE", "DEFAULT_FRAMES", "MAX_FRAMES", "MAX_STREAMED_FRAMES", "MAX_VIDEO_BYTES", "ChatState", "Plan", "Prepared", "Scene", "Session", "Settings",
    "ChatView", "SwitchNote", "CompareRun", "CompareTurn", "CompareView", "KeptVisual", "LayerFigures", "LibraryEntry", "Meters", "ProgressNote",
    "ReferenceView", "ReuseSummary", "StreamView", "TtftView",
    "chat_on_gpu", "draw_scene", "scene_examples", "scene_types",
    "chat_turn", "check_uploads", "close_session", "compare", "default_frames", "default_model", "get_model", "has_random_weights",
    "is_trained_here", "kept_visuals", "may_read", "note_served", "media_hint", "media_library", "method_spec", "method_specs",
    "budget_spec", "is_reference", "methods_on", "reference_spec", "refused_methods", "stacks_of", "model_choices", "model_description", "mpic_default_k", "mpic_ttft", "note_uploads", "plan_turn", "prepare", "release",
    "HOLDS_ALL", "params_owner", "reuses_media", "shown_title", "take_history", "title_of", "track",
    # against hostile visitors (issue 36): inputs checked, private files, idle sessions
    "check_model_allowed", "check_sent_files", "checked_params", "checked_text", "in_upload_dir",
    "save_private_images", "active", "open_session", "expire_idle", "start_sweeper", "sweep_dead_sessions",
    "upload_room", "use_own_upload_folder",
    # one visitor is one visitor (issue 56): every per-visitor limit counts by this
    "Visitor", "trusted_hops", "visitor_from_request", "visitor_from_scope",
    # the "Can you tell?" tab: blind battles, votes and the leaderboard (blind/)
    "blind", "Battle", "BoardRow", "Reveal", "VotesUnavailable",
]

open_app(AppState())  # until app.py (or a test) opens its own
