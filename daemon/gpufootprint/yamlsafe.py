"""YAML for configuration files, with the parts that let a small file take the daemon down refused.

``yaml.safe_load`` builds no arbitrary objects, but it still expands aliases (a 749-byte
"billion laughs" file grows past gigabytes), recurses once per nesting level (a deep
``[[[[...`` ends in RecursionError) and reads any size. A configuration needs none of
that, so before composing a document this walks PyYAML's event stream (iterative: no
recursion, no expansion) and refuses anchors, aliases, nesting deeper than
``MAX_DEPTH`` and more than ``MAX_NODES`` nodes, each with a one-line error naming the
line. Files larger than ``MAX_BYTES`` are refused before they are read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

import yaml

from gpufootprint.errors import ConfigError

#: Configuration files are a few kilobytes; a megabyte leaves room for long price tables.
MAX_BYTES: Final = 1024 * 1024
MAX_DEPTH: Final = 32
MAX_NODES: Final = 100_000


def read_yaml_file(path: str | Path, what: str = "config") -> Any:
    """The document in ``path``, or ConfigError naming the file (and the line, where there is one)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_BYTES:
                raise ConfigError(f"{path}: {what} file of {size} bytes is larger than the limit of {MAX_BYTES}")
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if len(raw) > MAX_BYTES:  # grew while we read it
        raise ConfigError(f"{path}: {what} file is larger than the limit of {MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: {what} is not UTF-8 text (byte {exc.start})") from None
    return load_yaml(text, str(path))


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)`` once the event stream has passed the checks above."""
    try:
        depth = nodes = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise _refuse(where, event, "anchors and aliases are not accepted in this file")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _refuse(where, event, f"nested deeper than {MAX_DEPTH} levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            if isinstance(event, yaml.NodeEvent):
                nodes += 1
                if nodes > MAX_NODES:
                    raise _refuse(where, event, f"more than {MAX_NODES} values")
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark is not None else where
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{at}: invalid YAML ({problem})") from None
    except RecursionError:  # belt and braces: the depth check above should make this unreachable
        raise ConfigError(f"{where}: invalid YAML (nested too deeply)") from None


def _refuse(where: str, event: yaml.Event, why: str) -> ConfigError:
    mark = event.start_mark
    return ConfigError(f"{where}:{mark.line + 1}: {why}" if mark is not None else f"{where}: {why}")
