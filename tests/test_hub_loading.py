"""The loading path every hub model takes (kv_arena/runtime/models.py, ``_load_hub``: ``from_pretrained``,
``AutoTokenizer``, ``AutoImageProcessor(backend="pil")``, ``AutoProcessor`` for LLaVA), on a tiny
checkpoint of each family written by ``save_pretrained`` (kv_arena.hf.save_offline) into the folder
``KV_ARENA_LOCAL_<repo>`` names: it loads and answers a turn with a picture, so a transformers release
that breaks the path fails here first."""

from __future__ import annotations

import pytest
from tests.support import make_image

import backends
from kv_arena.hf import save_offline
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.models import load_model, local_dir_variable, model_spec

FAMILIES = {  # hub repo -> the offline model of its family saved in its place
    "Qwen/Qwen2-VL-2B-Instruct": "tiny-qwen2-vl",
    "Qwen/Qwen2.5-VL-3B-Instruct": "tiny-qwen2.5-vl",
    "Qwen/Qwen3-VL-2B-Instruct": "tiny-qwen3-vl",
    "llava-hf/llava-1.5-7b-hf": "tiny-llava",
}


def test_the_variable_names_the_repo():
    assert local_dir_variable("Qwen/Qwen2.5-VL-3B-Instruct") == "KV_ARENA_LOCAL_Qwen__Qwen2_5_VL_3B_Instruct"


@pytest.mark.parametrize("repo", FAMILIES)
def test_a_saved_checkpoint_loads_through_the_hub_path_and_answers(models, tmp_path, monkeypatch, repo):
    offline = FAMILIES[repo]
    monkeypatch.setenv(local_dir_variable(repo), save_offline(offline, tmp_path / "checkpoint"))
    loaded = load_model(repo, device="cpu")
    assert loaded.spec == model_spec(repo) and loaded.spec.source == "hub"
    assert type(loaded.model) is type(models(offline).model)
    assert type(loaded.adapter) is type(models(offline).adapter)
    assert (loaded.adapter.processor is None) == repo.startswith("Qwen/")  # LLaVA's processor from AutoProcessor
    message = Message("What is shown?", images=[make_image(0, (112, 112))])
    said = Conversation(loaded, backends.make_backend("full")).ask(message, max_new_tokens=4, ignore_eos=True)
    same = Conversation(models(offline), backends.make_backend("full")).ask(message, max_new_tokens=4, ignore_eos=True)
    assert len(said.token_ids) == 4 and said.token_ids == same.token_ids  # the saved weights, read back whole
