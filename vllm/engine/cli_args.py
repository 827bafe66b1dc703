"""Command-line flags derived from a dataclass of arguments (the engine's, the async engine's).

Each field becomes `--field-name` with the field's default, its type read from the annotation and
its help from `field(metadata={"help": ...})`, so an argument is defined once, beside its help,
and `LLM(...)`, `vllm serve` and the benchmarks take the same names:

    bool          --flag / --no-flag            (argparse.BooleanOptionalAction)
    int, float    --flag N                      (`X | None` fields default to None)
    str           --flag S                      (metadata "choices" restricts it)
    dict          --flag '{"json": "object"}'
"""

import argparse
import dataclasses
import json
import types
import typing
from typing import Any


def arg(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field carrying its command-line help; `cli` may hold "choices" and "aliases"
    (extra flag spellings, e.g. ["-tp"])."""
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata={"help": help, **cli})
    return dataclasses.field(default=default, metadata={"help": help, **cli})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _base_type(annotation: Any) -> type:
    """`int | None` -> int; `bool` -> bool; a plain class -> itself."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"cannot derive a flag type from {annotation}")
        annotation = args[0]
    return typing.get_origin(annotation) or annotation


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type,
                       fields: list[dataclasses.Field] | None = None,
                       title: str | None = None) -> argparse.ArgumentParser:
    """Adds one flag per field of `cls` (or of `fields`), in one argument group."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title or cls.__name__, cls.__doc__)
    for f in fields if fields is not None else dataclasses.fields(cls):
        meta = f.metadata
        names = [flag_name(f.name), *meta.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta.get("help")}
        kind = _base_type(hints[f.name])
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is dict:
            kwargs["type"] = _json_object
        elif kind in (int, float, str):
            kwargs["type"] = kind
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag type for {hints[f.name]}")
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        group.add_argument(*names, **kwargs)
    return parser


def from_namespace(cls: type, namespace: argparse.Namespace) -> Any:
    """`cls` built from the parsed flags of its fields (other attributes are ignored)."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    return cls(**{name: getattr(namespace, name) for name in names if hasattr(namespace, name)})
