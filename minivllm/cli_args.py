"""argparse flags from an args dataclass (EngineArgs, ServerArgs): one --flag per field, its default and help from
the field, grouped by section in --help."""

from __future__ import annotations

import argparse
import dataclasses

_CLI_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float}


def add_dataclass_args(cls: type, parser: argparse.ArgumentParser, positional: str | None = None,
                       sections: dict[str, tuple[str, ...]] | None = None) -> None:
    """One --flag per field of an args dataclass (help in the field's metadata); `positional` names an
    optional positional field instead; `sections` puts each field in an argument group of its section."""
    groups = {section: parser.add_argument_group(f"engine: {section}") for section in sections or {}}
    group_of = {name: groups[section] for section, names in (sections or {}).items() for name in names}
    for f in dataclasses.fields(cls):
        target: argparse._ActionsContainer = group_of.get(f.name, parser)  # the parser or its section's group
        flag = "--" + f.name.replace("_", "-")
        if f.name == positional:
            target.add_argument(f.name, nargs="?", default=f.default, help=f.metadata["help"])
        elif str(f.type) == "list[str] | None":
            target.add_argument(flag, nargs="+", default=f.default, help=f.metadata["help"])
        elif f.type in ("bool", bool):
            target.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            target.add_argument(flag, type=_CLI_TYPES.get(str(f.type), str), default=f.default,
                                help=f.metadata["help"])
