"""Gradio's upload folder, and this app process's own inside it.

Gradio keeps every upload under its folder (``GRADIO_TEMP_DIR``, else ``<temp>/gradio``), named by
a hash of its bytes. Two app processes sharing the host's temp folder (replicas, or a restart) would
share that folder, while each knows only its own uploads. So ``python app.py`` gives Gradio a folder
of its own before it builds anything (:func:`use_own_upload_folder`):
``<Gradio's folder>/kv-arena-uploads/<instance>/``, locked while the process lives
(:mod:`.instance`); at start the folders of gone processes, a previous run's included, are swept
with every upload in them. :func:`host_folder` is Gradio's folder as the host set it: a file under
it that this process holds no record of is no one's to read (:func:`.uploads.may_read`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .instance import NAMED, own_folder, sweep_gone

UPLOADS = "kv-arena-uploads"  # under Gradio's folder: one folder per app process


def upload_dir() -> Path:
    """Where Gradio keeps uploads now (its own rule: ``GRADIO_TEMP_DIR``, else <temp>/gradio)."""
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()


def host_folder() -> Path:
    """Gradio's folder as the host set it: the one above every app process's own upload folder
    (Gradio's folder itself where no process took one, as in a test launching the app in-process)."""
    here = upload_dir()
    return here.parents[1] if here.parent.name == UPLOADS and NAMED.fullmatch(here.name) else here


def use_own_upload_folder() -> Path:
    """At the app's start, before Gradio is built: Gradio's upload folder becomes this process's
    own, and the folders of processes that are gone (their uploads, private files) are removed."""
    parent = host_folder() / UPLOADS
    sweep_gone(parent)
    own = own_folder(parent)
    os.environ["GRADIO_TEMP_DIR"] = str(own)  # Gradio reads it when the app is built and launched
    return own
