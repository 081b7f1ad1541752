"""Reading a job spec file (``onpolicy submit job.yaml``) with bounds: at most ``MAX_SPEC_BYTES``
read (a larger file is refused before it is parsed), YAML nested at most ``MAX_SPEC_DEPTH`` levels
(deeper is refused with its line and column, never a ``RecursionError``), no aliases (``*name``: a
few lines of nested aliases expand to millions of nodes), and a key given twice in one mapping
refused with the line and column of its second occurrence — never "the last one wins".

Every refusal is a ``SpecError`` on the field ``file`` whose one-line message names the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .spec import JobSpec, SpecError, parse_spec

#: The largest spec file (and SubmitJob spec message) accepted: specs are a few KiB.
MAX_SPEC_BYTES = 1 << 20
#: The deepest YAML nesting accepted (a spec nests about 4 levels).
MAX_SPEC_DEPTH = 64


class _SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with a nesting bound, aliases and duplicate keys refused."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_SPEC_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_SPEC_DEPTH} levels",
                                                  self.peek_event().start_mark)
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted in a job spec",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: refused by the constructor below
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                            key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_spec_text(path: str | Path) -> str:
    """The text of the spec file at ``path`` (``SpecError`` on ``file`` when it is missing, not a
    regular file, larger than ``MAX_SPEC_BYTES``, unreadable or not UTF-8)."""
    p = Path(path)
    if not p.is_file():
        raise SpecError([("file", f"{path}: no such file")])
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError([("file", f"{path}: unreadable ({e.strerror or e})")]) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError([("file", f"{path}: larger than {MAX_SPEC_BYTES >> 20} MiB, the most a job spec may be")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError([("file", f"{path}: not UTF-8 text")]) from None


def load_yaml(text: str, path: str | Path) -> Any:
    """The YAML document ``text`` (``SpecError`` on ``file`` naming the line and column)."""
    loader = _SpecLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or e.__class__.__name__
        raise SpecError([("file", f"{path}: not valid YAML{where}: {problem}")]) from None
    except RecursionError:  # a bound of the composer missed: still one line
        raise SpecError([("file", f"{path}: not valid YAML: nested too deeply")]) from None
    finally:
        loader.dispose()


def load_spec_file(path: str | Path) -> JobSpec:
    """The validated ``JobSpec`` in the YAML file at ``path``."""
    return parse_spec(load_yaml(read_spec_text(path), path))
