"""Training adapters: how to load, strip, route and LoRA-wrap one model architecture for one stage.

`OmniModelBase` is a registry keyed by (architecture, training stage), as in VeRL-Omni: the
architecture is `config.architectures[0]` (or the pipeline file's, for diffusion folders) and the
stage names the part that is trained: `thinker`, `talker` or `all` (the whole model, the default).
An adapter also has a short `name` for pipeline files (`adapter: qwen3_omni_thinker`).

Built in:
| name                 | (architecture, stage)                                     | loads                       |
|----------------------|-----------------------------------------------------------|-----------------------------|
| `causal_lm`          | (`*ForCausalLM`, all)                                     | (model, tokenizer)          |
| `qwen3_omni`         | (`Qwen3OmniMoeForConditionalGeneration`, all)             | (full model, processor)     |
| `qwen3_omni_thinker` | (`Qwen3OmniMoeForConditionalGeneration`, thinker)         | (thinker-only, processor)   |
| `sd3`                | (`SD3Transformer2DModel`, all)                            | (`SD3Model`, tokenizer)     |

A new model is one subclass: decorate it with `@OmniModelBase.register(architecture, stage, name=...)`
and implement `load_pretrained`; override the other hooks where the defaults do not fit. Its
`model_kind` and `known_models` (URIs that load with it) go into the config's model-kind table
(omni_core.config.algorithms), which checks a stage's model against its algorithm without loading
anything: this module imports no torch (a built-in plugin, omni_core.plugins).
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from omni_core.config.algorithms import DIFFUSION_MODEL, LANGUAGE_MODEL, register_model_kind
from omni_core.errors import ModelError

if TYPE_CHECKING:
    from omni_core.models.lora import LoraSpec

DEFAULT_STAGE = "all"
Source = str | Path  # a local directory, or a hub id when not local_only


class OmniModelBase(ABC):
    """Plug-in base class of training adapters (classmethods only: an adapter holds no state)."""

    name: ClassVar[str]
    architecture: ClassVar[str]  # exact, or an fnmatch pattern such as "*ForCausalLM"
    stage: ClassVar[str]
    # LoRA targets when the spec names none: module-name suffixes, or one full-name regex.
    lora_targets: ClassVar[list[str] | str] = []
    # Full fine-tuning (no LoRA) trains the parameters under these module prefixes; () = all.
    trainable_modules: ClassVar[tuple[str, ...]] = ()
    model_kind: ClassVar[str] = LANGUAGE_MODEL  # what an algorithm must train to train it
    known_models: ClassVar[tuple[str, ...]] = ()  # model URIs known to load with this adapter (tiny://...)

    _registry: ClassVar[dict[tuple[str, str], type[OmniModelBase]]] = {}

    # ---- registry ----------------------------------------------------------------------------

    @classmethod
    def register(cls, architecture: str, stage: str = DEFAULT_STAGE, *, name: str) -> Callable:
        """Class decorator: register an adapter for (architecture, stage) under `name`."""

        def decorator(subclass: type[OmniModelBase]) -> type[OmniModelBase]:
            key = (architecture, stage)
            clash = cls._registry.get(key) or next(
                (a for a in cls._registry.values() if a.name == name), None
            )
            if clash is not None and clash is not subclass:
                raise ValueError(f"adapter {key} / {name!r} is already registered as {clash.__qualname__}")
            subclass.architecture, subclass.stage, subclass.name = architecture, stage, name
            cls._registry[key] = subclass
            register_model_kind("adapter", name, subclass.model_kind)
            for uri in subclass.known_models:
                register_model_kind("model", uri, subclass.model_kind)
            return subclass

        return decorator

    @classmethod
    def registered(cls) -> dict[tuple[str, str], type[OmniModelBase]]:
        return dict(cls._registry)

    @classmethod
    def get_class(cls, architecture: str, stage: str = DEFAULT_STAGE) -> type[OmniModelBase]:
        """The adapter for (architecture, stage): an exact registration first, then patterns."""
        if (architecture, stage) in cls._registry:
            return cls._registry[(architecture, stage)]
        for (pattern, st), adapter in cls._registry.items():
            if st == stage and fnmatch.fnmatchcase(architecture, pattern):
                return adapter
        known = ", ".join(f"({a}, {s})" for a, s in sorted(cls._registry))
        raise ModelError(
            f"no adapter for architecture {architecture!r} and stage {stage!r}; registered: {known}. "
            "Register one with @OmniModelBase.register(architecture, stage, name=...)"
        )

    @classmethod
    def by_name(cls, name: str) -> type[OmniModelBase]:
        for adapter in cls._registry.values():
            if adapter.name == name:
                return adapter
        names = ", ".join(sorted(a.name for a in cls._registry.values()))
        raise ModelError(f"unknown adapter {name!r}; known adapters: {names}")

    @classmethod
    def matches(cls, architecture: str) -> bool:
        return fnmatch.fnmatchcase(architecture, cls.architecture)

    # ---- hooks -------------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def load_pretrained(cls, source: Source, *, local_only: bool) -> Any:
        """The model as saved (all of it), float32-or-as-saved."""

    @classmethod
    def get_strip_modules(cls) -> list[str]:
        """Sub-module attribute names deleted before training (parts this stage never uses)."""
        return []

    @classmethod
    def configure_model(cls, model: Any) -> Any:
        """Prepare the loaded model for this stage; by default, delete `get_strip_modules()`."""
        for attr in cls.get_strip_modules():
            if hasattr(model, attr):
                delattr(model, attr)
        return model

    @classmethod
    def configure_tokenizer(cls, source: Source, *, local_only: bool) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=local_only)

    @classmethod
    def configure_processor(cls, source: Source, *, local_only: bool) -> Any | None:
        """The multimodal processor, or None for text-only models."""
        return None

    @classmethod
    def text_io(cls, model: Any, source: Source, *, local_only: bool) -> Any:
        """What turns text (and media) into model inputs: the processor if any, else the tokenizer."""
        processor = cls.configure_processor(source, local_only=local_only)
        return processor if processor is not None else cls.configure_tokenizer(source, local_only=local_only)

    @classmethod
    def set_trainable(cls, model: Any) -> None:
        """requires_grad on the parameters under `trainable_modules` (all when it is empty), off elsewhere."""
        prefixes = tuple(p + "." for p in cls.trainable_modules)
        for name, param in model.named_parameters():
            param.requires_grad_(not prefixes or name.startswith(prefixes))

    @classmethod
    def apply_lora(cls, model: Any, spec: LoraSpec) -> Any:
        """Wrap the model with LoRA (peft); only the adapter weights stay trainable."""
        from omni_core.models.lora import apply_lora

        return apply_lora(model, spec, cls.lora_targets)

    # ---- the whole flow ----------------------------------------------------------------------

    @classmethod
    def load(
        cls, source: Source, *, local_only: bool = True, lora: LoraSpec | dict | None = None
    ) -> tuple[Any, Any]:
        """Load, configure for the stage, set what trains (LoRA or `trainable_modules`); eval mode."""
        from omni_core.models.lora import LoraSpec

        spec = LoraSpec.parse(lora) if lora is not None else None
        model = cls.configure_model(cls.load_pretrained(source, local_only=local_only))
        if spec is None:
            cls.set_trainable(model)
        else:
            model = cls.apply_lora(model, spec)
        model.eval()
        return model, cls.text_io(model, source, local_only=local_only)


def resolve_adapter(
    architecture: str, *, adapter: str | type[OmniModelBase] | None = None, stage: str | None = None
) -> type[OmniModelBase]:
    """The adapter for a model: the one named (checked against the architecture and stage), else
    the one registered for (architecture, stage or "all")."""
    if adapter is None:
        return OmniModelBase.get_class(architecture, stage or DEFAULT_STAGE)
    cls = adapter if isinstance(adapter, type) else OmniModelBase.by_name(adapter)
    if not cls.matches(architecture):
        raise ModelError(
            f"adapter {cls.name!r} is for {cls.architecture} models, but this model is a {architecture}; "
            f"drop `adapter:` or pick one registered for {architecture}"
        )
    if stage is not None and stage != cls.stage:
        raise ModelError(f"adapter {cls.name!r} trains stage {cls.stage!r}, not {stage!r}")
    return cls


# ---- causal LMs ----------------------------------------------------------------------------------


@OmniModelBase.register("*ForCausalLM", "all", name="causal_lm")
class CausalLMAdapter(OmniModelBase):
    """Any transformers causal LM: nothing stripped, everything trained, LoRA on all linear layers
    of the decoder blocks (Llama/Qwen names)."""

    known_models = ("tiny://lm",)

    lora_targets: ClassVar[list[str] | str] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]

    @classmethod
    def load_pretrained(cls, source: Source, *, local_only: bool) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(source, local_files_only=local_only)


# ---- Qwen3-Omni ----------------------------------------------------------------------------------

QWEN3_OMNI = "Qwen3OmniMoeForConditionalGeneration"
_ATTN = r"layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"


class _Qwen3OmniBase(OmniModelBase):
    """Loading shared by the Qwen3-Omni stages: the model class and its processor."""

    @classmethod
    def load_pretrained(cls, source: Source, *, local_only: bool) -> Any:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(source, local_files_only=local_only)

    @classmethod
    def configure_processor(cls, source: Source, *, local_only: bool) -> Any:
        from omni_core.models.omni_processor import load_omni_processor

        return load_omni_processor(source, local_only=local_only)


@OmniModelBase.register(QWEN3_OMNI, "all", name="qwen3_omni")
class Qwen3OmniAdapter(_Qwen3OmniBase):
    """The whole Qwen3-Omni (thinker, talker, code2wav), as saved. LoRA on the attention of the
    thinker's and the talker's decoders."""

    known_models = ("tiny://qwen3-omni",)

    lora_targets: ClassVar[list[str] | str] = rf"(thinker\.model\.language_model|talker\.model)\.{_ATTN}"


@OmniModelBase.register(QWEN3_OMNI, "thinker", name="qwen3_omni_thinker")
class Qwen3OmniThinkerAdapter(_Qwen3OmniBase):
    """Thinker-only training: the talker, code2wav and code predictor are deleted, and the model's
    `forward`, `generate` and embedding accessors go to the thinker (so the top-level module keeps
    the checkpoint's `thinker.*` parameter names, as VeRL-Omni's adapter does).

    Full fine-tuning trains the thinker's text decoder and LM head (the vision and audio towers
    stay frozen). LoRA goes on the text decoder's attention projections by default: its experts are
    fused 3-D parameters, not linear layers (name them in `target_modules` via peft's own syntax
    only if your peft supports it).
    """

    lora_targets: ClassVar[list[str] | str] = rf"thinker\.model\.language_model\.{_ATTN}"
    trainable_modules: ClassVar[tuple[str, ...]] = ("thinker.model.language_model", "thinker.lm_head")

    @classmethod
    def get_strip_modules(cls) -> list[str]:
        return ["talker", "code2wav", "code_predictor"]

    @classmethod
    def configure_model(cls, model: Any) -> Any:
        model = super().configure_model(model)
        model.has_talker = False
        model.config.enable_audio_output = False  # a saved copy reloads without a talker
        thinker = model.thinker
        model.forward = thinker.forward
        model.generate = thinker.generate
        model.get_input_embeddings = thinker.get_input_embeddings
        model.set_input_embeddings = thinker.set_input_embeddings
        model.get_output_embeddings = thinker.get_output_embeddings
        model._no_split_modules = ["Qwen3OmniMoeThinkerTextDecoderLayer"]
        return model


# ---- SD3 (diffusion) -----------------------------------------------------------------------------


@OmniModelBase.register("SD3Transformer2DModel", "all", name="sd3")
class SD3DiffusionAdapter(OmniModelBase):
    """An `SD3Model` folder (see `omni_core.models.diffusion`): the transformer is trained, the text
    encoder is frozen. LoRA targets are flow_grpo's for SD3.5 (joint attention, both streams)."""

    model_kind = DIFFUSION_MODEL
    known_models = ("tiny://sd3",)

    lora_targets: ClassVar[list[str] | str] = [
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ]

    @classmethod
    def load_pretrained(cls, source: Source, *, local_only: bool) -> Any:
        from omni_core.models.diffusion import load_sd3

        if not Path(source).is_dir():
            raise ModelError(f"SD3 models load from a local component folder, not {source!r}")
        return load_sd3(source)

    @classmethod
    def text_io(cls, model: Any, source: Source, *, local_only: bool) -> Any:
        return model.tokenizer

    @classmethod
    def set_trainable(cls, model: Any) -> None:
        model.transformer.requires_grad_(True)
        model.text_encoder.requires_grad_(False)

    @classmethod
    def apply_lora(cls, model: Any, spec: LoraSpec) -> Any:
        from omni_core.models.lora import apply_lora

        model.text_encoder.requires_grad_(False)
        model.transformer = apply_lora(model.transformer, spec, cls.lora_targets)
        return model


def parameter_count(module: Any, *, trainable_only: bool = False) -> int:
    """Number of parameters (each shared tensor once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
