"""Models by short name: offline tiny built-ins, hub checkpoints, and same-architecture random
variants of the hub models built from configs the project ships (``kv_arena/runtime/configs``)."""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..tiny.builtin import byte_tokenizer, tiny_config, tiny_image_processor
from .attention import ATTENTION_NAME  # importing it registers the attention function
from .inputs import ADAPTERS, ChatAdapter
from .mrope_positions import rule_of
from .vision_attention import vision_attention

CONFIG_DIR = Path(__file__).parent / "configs"
ARENA = "tiny-arena-vl"  # trained by training/train_arena.py (v2) or train_arena_v3.py, weights in assets/tiny-arena-vl
# what it is; :func:`describe` adds what the served generation reads
ARENA_DESCRIPTION = "Tiny Qwen2.5-VL trained here (offline, under two million parameters) on simple drawn scenes like its Examples"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, llava, llava_next, llava_onevision
    source: str  # "builtin" (tiny, random), "trained" (tiny, weights in assets/), "hub" or "random"
    repo: str | None = None
    description: str = ""

    @property
    def needs_download(self) -> bool:
        return self.source == "hub"

    @property
    def random_weights(self) -> bool:
        return self.source in ("builtin", "random")

    @property
    def small(self) -> bool:
        """Small enough to stay loaded next to another model."""
        return self.source in ("builtin", "trained")

    def to_dict(self) -> dict:
        return {"name": self.name, "architecture": self.family, "source": self.source,
                "needs_download": self.needs_download, "repo": self.repo, "description": self.description}


HUB = {
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2_vl",
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen3-VL-2B-Instruct": "qwen3_vl",
    "Qwen/Qwen3-VL-4B-Instruct": "qwen3_vl",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_moe",
    "llava-hf/llava-1.5-7b-hf": "llava",
    "llava-hf/llava-v1.6-mistral-7b-hf": "llava_next",
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": "llava_onevision",
}

_SPECS = [
    ModelSpec("tiny-qwen2-vl", "qwen2_vl", "builtin", description="Tiny random Qwen2-VL (offline, M-RoPE, native video)"),
    ModelSpec("tiny-qwen2.5-vl", "qwen2_5_vl", "builtin", description="Tiny random Qwen2.5-VL (offline, windowed vision)"),
    ModelSpec("tiny-qwen3-vl", "qwen3_vl", "builtin",
              description="Tiny random Qwen3-VL (offline, interleaved M-RoPE, DeepStack, timestamped video)"),
    ModelSpec("tiny-llava", "llava", "builtin", description="Tiny random LLaVA-1.5 shape (offline, Llama decoder, 1-D RoPE)"),
    ModelSpec(ARENA, "qwen2_5_vl", "trained", description=ARENA_DESCRIPTION),
]
_SPECS += [ModelSpec(repo, fam, "hub", repo, f"{repo} from the Hugging Face Hub") for repo, fam in HUB.items()]
_SPECS += [ModelSpec("random:" + repo, fam, "random", repo, f"{repo} architecture, random weights (no download)")
           for repo, fam in HUB.items()]
MODELS: dict[str, ModelSpec] = {s.name: s for s in _SPECS}
DEFAULT_MODEL = "tiny-qwen2-vl"


def model_spec(name: str) -> ModelSpec:
    if name in MODELS:
        return MODELS[name]
    raise UserError(f"unknown model '{name}'; choose from: {', '.join(MODELS)}")


def describe(name: str) -> str:
    """What the model ``name`` is; the trained one's says which generation its weights are and what
    that generation reads (an unknown one says why it cannot load)."""
    spec = model_spec(name)
    if spec.source != "trained":
        return spec.description
    from ..tiny import generations

    try:
        generation = generations.of()
    except UserError as exc:
        return f"{spec.description}. {exc}"
    return f"{spec.description} (generation {generation.number}). {generation.reads}"


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: torch.nn.Module
    adapter: ChatAdapter
    dtype: torch.dtype
    device: torch.device

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def max_context(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 32768))

    def language_model(self):
        return self.model.model.language_model

    def on_device(self, model_kwargs: dict) -> dict:
        """A processor's model inputs on the model's device, pixels in the model's dtype."""
        kwargs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in model_kwargs.items()}
        if "pixel_values" in kwargs and kwargs["pixel_values"].is_floating_point():
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.dtype)
        return kwargs

    def vision_modules(self) -> list[torch.nn.Module]:
        """What turns pixels into visual embeddings: the vision encoder (and LLaVA's projector)."""
        inner = self.model.model
        return [m for m in (getattr(inner, n, None) for n in ("visual", "vision_tower", "multi_modal_projector"))
                if m is not None]


def model_class(family: str):
    """The transformers class that loads a model of ``family``."""
    import transformers as tf

    return {
        "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": tf.Qwen3VLMoeForConditionalGeneration,
        "llava": tf.LlavaForConditionalGeneration,
        "llava_next": tf.LlavaNextForConditionalGeneration,
        "llava_onevision": tf.LlavaOnevisionForConditionalGeneration,
    }[family]


def shipped_config(repo: str, num_layers: int | None = None):
    """The config of ``repo`` as the project ships it, optionally with fewer decoder layers."""
    from transformers import AutoConfig

    path = CONFIG_DIR / (repo.replace("/", "__") + ".json")
    data = json.loads(path.read_text())
    if num_layers:
        data.setdefault("text_config", {})["num_hidden_layers"] = int(num_layers)
        if "layer_types" in data["text_config"]:
            data["text_config"]["layer_types"] = data["text_config"]["layer_types"][: int(num_layers)]
    return AutoConfig.for_model(**data)


def model_config(name: str):
    """The config of the model ``name`` as :func:`load_model` builds it, without its weights or a
    download (a hub model's as the project ships it)."""
    spec = model_spec(name)
    if spec.source == "trained":
        from ..tiny import generations

        return generations.of().config()
    return tiny_config(spec.family) if spec.source == "builtin" else shipped_config(spec.repo)


def shrink_vision(config, layers: int) -> None:
    """Cut the vision encoder of ``config`` to its first ``layers`` blocks (random weights on a CPU:
    a full-depth tower dominates every figure). Qwen2.5-VL keeps a full-attention block among them."""
    vision = config.vision_config
    if layers < 1:
        raise UserError("--vision-layers must be at least 1")
    if hasattr(vision, "depth"):  # Qwen2-VL, Qwen2.5-VL
        if layers > vision.depth:
            raise UserError(f"--vision-layers {layers} exceeds the vision encoder's {vision.depth} blocks")
        vision.depth = layers
        if getattr(vision, "fullatt_block_indexes", None):
            vision.fullatt_block_indexes = [i for i in vision.fullatt_block_indexes if i < layers] or [layers - 1]
        return
    if layers > vision.num_hidden_layers:  # CLIP, SigLIP
        raise UserError(f"--vision-layers {layers} exceeds the vision encoder's {vision.num_hidden_layers} layers")
    picked = getattr(config, "vision_feature_layer", -1)
    if any(i >= layers or i < -(layers + 1) for i in (picked if isinstance(picked, list) else [picked])):
        raise UserError(f"--vision-layers {layers} drops the layer the projector reads ({picked})")
    vision.num_hidden_layers = layers


def _offline_processors(family: str, config):
    """Tokenizer, image processor and (LLaVA) processor, all made in code."""
    tokenizer = byte_tokenizer("qwen" if family.startswith("qwen") else "llava")
    image_processor = tiny_image_processor(family)
    processor = None
    if family == "llava":
        from transformers import LlavaProcessor

        processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                   vision_feature_select_strategy="default", image_token="<image>",
                                   num_additional_image_tokens=1)
    return tokenizer, image_processor, processor


def _retarget_special_ids(config, tokenizer) -> None:
    """Random-weight variants use the byte tokenizer: point the config's special ids at its tokens."""
    names = {"image_token_id": ["<|image_pad|>", "<image>"], "video_token_id": ["<|video_pad|>", "<video>"],
             "image_token_index": ["<image>"], "video_token_index": ["<video>"],
             "vision_start_token_id": ["<|vision_start|>"], "vision_end_token_id": ["<|vision_end|>"]}
    vocab = tokenizer.get_vocab()
    for attr, tokens in names.items():
        for token in tokens:
            if hasattr(config, attr) and token in vocab:
                setattr(config, attr, vocab[token])
                break
    text = config.get_text_config()
    text.eos_token_id = tokenizer.eos_token_id


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(name: str | None, device: torch.device) -> tuple[str, torch.dtype]:
    """(name, dtype) for ``name``, else bfloat16 on CUDA and float32 elsewhere."""
    name = name or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)
    if dtype is None:
        raise UserError(f"unknown dtype '{name}'; use float32, bfloat16 or float16")
    return name, dtype


def load_model(name: str = DEFAULT_MODEL, *, device: str | None = None, dtype: str | None = None,
               num_layers: int | None = None, quantization: str | None = None, seed: int = 0,
               progress=None, vision_layers: int | None = None) -> LoadedModel:
    """Load a model by registry name. ``quantization``: None, "8bit" or "4bit" (hub models, CUDA).
    ``num_layers`` / ``vision_layers`` cut the decoder / vision encoder of a random-weight model."""
    spec = model_spec(name)
    if vision_layers and spec.source in ("hub", "trained"):
        raise UserError(f"--vision-layers cuts random-weight models only, not '{name}'")
    dev = pick_device(device)
    _, torch_dtype = pick_dtype(dtype, dev)
    say = progress or (lambda fraction, text: None)
    cls = model_class(spec.family)
    if spec.source == "hub":
        say(0.1, f"Fetching {spec.repo} (weights are cached after the first download)...")
        model, tokenizer, image_processor, processor = _load_hub(spec, cls, dev, torch_dtype, quantization)
    elif spec.source == "trained":
        say(0.1, f"Loading {spec.name}'s trained weights from assets/...")
        model, tokenizer, image_processor, processor = _load_arena(dev, torch_dtype)
    else:
        say(0.1, f"Building {spec.name} with random weights (seed {seed})...")
        if spec.source == "builtin":
            config = tiny_config(spec.family)
            if num_layers:
                config.get_text_config().num_hidden_layers = int(num_layers)
        else:
            config = shipped_config(spec.repo, num_layers)
        if vision_layers:
            shrink_vision(config, int(vision_layers))
        tokenizer, image_processor, processor = _offline_processors(spec.family, config)
        if spec.source == "random":
            _retarget_special_ids(config, tokenizer)
            if spec.family != "llava" and not spec.family.startswith("qwen"):
                processor = _generic_processor(spec.family, image_processor, tokenizer, config)
        model = random_model(cls, config, dev, torch_dtype, seed)
    model.eval()
    model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": vision_attention(spec.family)})
    say(0.9, "Model ready.")
    adapter = ADAPTERS[spec.family](model, tokenizer, image_processor, processor)
    return LoadedModel(spec, model, adapter, torch_dtype, dev)


def _load_arena(dev, dtype):
    """The trained tiny model: its config and tokenizer are made in code for the generation its
    config.json names (:mod:`..tiny.generations`), its weights are in assets/tiny-arena-vl, or in
    ``KV_ARENA_TINY_DIR`` (a training run's folder)."""
    from ..tiny import generations
    from ..tiny.arena_model import ROPE_RULE_KEY, arena_dir, build_arena_model, load_arena_weights, trained_rope_rule

    directory = arena_dir()
    generation = generations.of(directory)
    config = generation.config()
    setattr(config, ROPE_RULE_KEY, trained_rope_rule(directory))  # placed as it was trained (mrope_positions)
    rule_of(config)  # a rule this engine does not know: refused now, in one line
    model = build_arena_model(0, config)
    load_arena_weights(model, directory)
    return model.to(device=dev, dtype=dtype), generation.tokenizer(), generation.image_processor(), None


def random_model(cls, config, dev, dtype, seed: int):
    """Seeded random weights, drawn tensor by tensor (the per-module initialisers take minutes at
    7B size on a CPU). Norm weights are ones, biases zero, matrices N(0, initializer_range)."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(dev):
        model = cls(config)
    generator = torch.Generator(device=dev).manual_seed(seed)
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name or name.endswith("weight") else 0.0)
            else:
                param.normal_(0.0, std, generator=generator)
    return model.to(dtype)


def _generic_processor(family, image_processor, tokenizer, config):
    """LLaVA-NeXT / OneVision random variants: their processor around our byte tokenizer."""
    from transformers import LlavaNextProcessor, LlavaOnevisionProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    if family == "llava_next":
        ip = LlavaNextImageProcessorPil(image_grid_pinpoints=config.image_grid_pinpoints, size={"shortest_edge": 336},
                                        crop_size={"height": 336, "width": 336})
        return LlavaNextProcessor(image_processor=ip, tokenizer=tokenizer, patch_size=14, image_token="<image>",
                                  num_additional_image_tokens=1,
                                  vision_feature_select_strategy=config.vision_feature_select_strategy)
    ip = LlavaOnevisionImageProcessorPil(image_grid_pinpoints=config.image_grid_pinpoints)
    try:
        return LlavaOnevisionProcessor(image_processor=ip, tokenizer=tokenizer, image_token="<image>",
                                       video_token="<video>", vision_feature_select_strategy=config.vision_feature_select_strategy,
                                       num_image_tokens=729)
    except (AttributeError, ImportError):  # its video processor needs torchvision
        raise UserError("LLaVA-OneVision's processor needs torchvision, which this machine lacks; "
                        "use a Qwen-VL or LLaVA-1.5 model here.") from None


def hub_reachable(timeout: float = 1.5) -> bool:
    """Whether the Hugging Face Hub (``HF_ENDPOINT``) accepts a connection within ``timeout``
    seconds, name lookup included (never with ``HF_HUB_OFFLINE``)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlparse(constants.ENDPOINT)
    answer: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                     timeout=timeout).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # a name lookup can outlast the socket's timeout
    thread.start()
    thread.join(timeout)
    return bool(answer and answer[0])


def _in_hub_cache(repo: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, "config.json"), str)


def local_dir_variable(repo: str) -> str:
    """The environment variable that names a local folder to load hub model ``repo`` from instead
    (a ``save_pretrained`` checkpoint): KV_ARENA_LOCAL_Qwen__Qwen2_VL_2B_Instruct for Qwen/Qwen2-VL-2B-Instruct."""
    return "KV_ARENA_LOCAL_" + repo.replace("/", "__").replace("-", "_").replace(".", "_")


def _load_hub(spec: ModelSpec, cls, dev, torch_dtype, quantization):
    """The real loading path: weights, tokenizer and PIL image processor from the hub (or a local dir)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    kwargs: dict = {"dtype": torch_dtype}
    if quantization:
        if quantization not in ("4bit", "8bit"):
            raise UserError("quantization must be '4bit' or '8bit'")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=quantization == "4bit", load_in_8bit=quantization == "8bit",
            bnb_4bit_compute_dtype=torch_dtype)
        kwargs["device_map"] = "auto"
    elif dev.type == "cuda":
        kwargs["device_map"] = "auto"  # accelerate places layers, spilling to CPU if the GPU is small
    repo = os.environ.get(local_dir_variable(spec.repo), spec.repo)
    local = {}
    if not os.path.isdir(repo) and not hub_reachable():  # say so now, not after the hub client's retries
        if not _in_hub_cache(repo):
            raise UserError(f"{spec.repo} must be downloaded from the Hugging Face Hub, which this server cannot "
                            "reach; pick an offline model such as 'tiny-arena-vl'.")
        local = {"local_files_only": True}  # downloaded before: load it from the cache, asking nothing
    try:
        model = cls.from_pretrained(repo, **kwargs, **local)
        if "device_map" not in kwargs:
            model = model.to(dev)
        tokenizer = AutoTokenizer.from_pretrained(repo, **local)
        image_processor = AutoImageProcessor.from_pretrained(repo, backend="pil", **local)
        processor = None
        if not spec.family.startswith("qwen"):
            processor = AutoProcessor.from_pretrained(repo, image_processor=image_processor, tokenizer=tokenizer, **local)
    except OSError as exc:
        raise UserError(f"Could not fetch '{spec.repo}': {str(exc).splitlines()[0]} "
                        "Check the network (or HF_TOKEN), or pick an offline model such as 'tiny-qwen2-vl'.") from None
    return model, tokenizer, image_processor, processor


@functools.lru_cache(maxsize=32)
def parameter_count(name: str) -> int:
    """The parameters of a ``random:`` architecture or a built-in tiny model (vision tower included),
    counted on the meta device: no memory is allocated, so a 30B model costs nothing to measure."""
    spec = model_spec(name)
    if spec.source not in ("random", "builtin"):
        raise ValueError(f"parameter_count measures random: architectures and built-in tiny models only, not '{name}'")
    with torch.device("meta"):
        model = model_class(spec.family)(model_config(name))
    return sum(p.numel() for p in model.parameters())


def list_models() -> list[dict]:
    return [s.to_dict() | {"description": describe(s.name)} for s in MODELS.values()]
