"""A GGUF file's metadata, converted once per version of the file: the Hugging Face config and
tokenizer files, and the list of its tensors.

Converting a GGUF file's header takes seconds at every engine start: transformers reads it for
the config, then again for the tokenizer, which it builds from the vocabulary's tens of
thousands of tokens and merges. The first start saves what
it read as plain files under VLLM_CACHE_ROOT; later starts load those and map the tensors' bytes
straight from the file:

    VLLM_CACHE_ROOT/gguf-metadata/SmolLM2-135M-Instruct.Q4_1-3f2a.../config.json
                                                                   tokenizer.json, ...
                                                                   tensors.json

A directory is keyed by the file's absolute path, size and modification time and by the
versions of transformers and gguf, whose conversions it holds, and names the version of the file
it was made from (source.json). Each conversion removes the directories of files since changed
or deleted, which no start can use any more; those of other transformers or gguf versions stay,
as another environment sharing the cache may be reading them. Where the directory cannot be
written, the callers read the file itself, as on every start before.
"""

import functools
import hashlib
import json
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

from vllm.envs import cache_root
from vllm.logger import init_logger
from vllm.model_executor.model_loader.gguf_header import GGUFIndex, GGUFTensorInfo, read_gguf_index

logger = init_logger(__name__)

_TENSORS = "tensors.json"
_SOURCE = "source.json"


def converted_metadata_dir(directory: str, gguf_file: str) -> str | None:
    """The directory of the files converted from `gguf_file` (in `directory`), converted now if
    they are not there yet (without tokenizer files where transformers cannot convert the
    tokenizer); None where it cannot be written. Errors reading the file or converting its
    config propagate as the gguf package or transformers raise them."""
    target = _target(os.path.join(directory, gguf_file))
    if target.is_dir():
        return str(target)
    try:
        _convert(directory, gguf_file, target)
    except OSError as e:
        logger.info("Cannot keep the metadata converted from %s in %s (%s): it is read from the file each time",
                    gguf_file, target.parent, e)
        return None
    return str(target)


def tensor_index(path: str) -> GGUFIndex:
    """The tensors of the GGUF file at `path`, from the converted metadata where it can be kept."""
    try:
        converted = converted_metadata_dir(os.path.dirname(path), os.path.basename(path))
    except (KeyError, ValueError):  # a config transformers cannot convert: the tensors may still load
        converted = None
    if converted is None or not (Path(converted) / _TENSORS).is_file():
        return _read_index(path)
    data = json.loads((Path(converted) / _TENSORS).read_text())
    return GGUFIndex(data["architecture"],
                     tuple(GGUFTensorInfo(name, type_name, tuple(shape), offset, num_bytes)
                           for name, type_name, shape, offset, num_bytes in data["tensors"]))


def _target(path: str) -> Path:
    path = os.path.abspath(path)
    size, mtime_ns = _file_version(path)
    versions = f"{version('transformers')}|{version('gguf')}"
    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{versions}".encode()).hexdigest()[:16]
    return cache_root() / "gguf-metadata" / f"{Path(path).stem}-{key}"


def _read_index(path: str) -> GGUFIndex:
    return _read_index_of_version(os.path.abspath(path), *_file_version(path))


@functools.lru_cache(maxsize=8)
def _read_index_of_version(path: str, size: int, mtime_ns: int) -> GGUFIndex:
    """Reads the tensor table: once a process per version of a file, where none is kept."""
    try:
        return read_gguf_index(path)
    except ValueError as e:
        raise ValueError(f"cannot read the GGUF file {path}: {e}") from e


def _convert(directory: str, gguf_file: str, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)  # before the work: it may not be writable
    index = _read_index(os.path.join(directory, gguf_file))
    kwargs = {"gguf_file": gguf_file, "local_files_only": True}
    config = AutoConfig.from_pretrained(directory, **kwargs)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, KeyError, ValueError):
        # The model may still run with a tokenizer given apart; load_tokenizer reports this
        # one's error from the file itself.
        tokenizer = None
    # Written beside the target, then renamed: a process starting meanwhile never reads half of it.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        tensors = [[t.name, t.type_name, list(t.shape), t.offset, t.num_bytes] for t in index.tensors]
        (staging / _TENSORS).write_text(json.dumps({"architecture": index.architecture, "tensors": tensors}))
        path = os.path.abspath(os.path.join(directory, gguf_file))
        (staging / _SOURCE).write_text(json.dumps({"path": path, "version": _file_version(path)}))
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # else another process converted it first: theirs is the same
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_stale(target.parent)


def _file_version(path: str) -> list[int]:
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]


def _remove_stale(root: Path) -> None:
    """Removes the converted directories under `root` whose file has changed or gone: no start
    looks them up again. A directory that names no file (staging, or made otherwise) is left
    alone."""
    for kept in root.iterdir():
        try:
            source = json.loads((kept / _SOURCE).read_text())
            path, made_from = source["path"], source["version"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            current = _file_version(path)
        except OSError:  # the file is gone
            current = None
        if current != made_from:
            shutil.rmtree(kept, ignore_errors=True)
