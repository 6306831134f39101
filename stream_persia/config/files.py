"""Reading a job's files: the YAML of its configs and ``topology.yml``, and its secret
files, each bounded and each error naming the file.

YAML (:func:`parse_yaml`, :func:`read_yaml`): a key given twice in one mapping is refused
(PyYAML keeps the last one silently), and so is a document whose aliases (``*name``)
expand it past :data:`MAX_YAML_VALUES` values (ten lines can stand for a billion: the
"billion laughs"), an alias inside its own anchor (an endless value) and nesting past
:data:`MAX_YAML_DEPTH`, and a zero-padded number (YAML 1.1 reads ``0700`` as octal 448);
at most :data:`MAX_YAML_BYTES` are read, as UTF-8
(:func:`read_text`). Merge keys (``<<: *common``) work as in PyYAML.

Secrets (:func:`read_secret_file`): at most :data:`MAX_SECRET_BYTES`, stripped, not empty.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from stream_persia.errors import ConfigError

__all__ = ["parse_yaml", "read_text", "read_yaml", "read_secret_file", "YamlBoundError",
           "MAX_YAML_BYTES", "MAX_YAML_VALUES", "MAX_YAML_DEPTH", "MAX_SECRET_BYTES"]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # keys merged in with `<<: *anchor` may be overridden on purpose
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable key: let the default constructor report it
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})",
                key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.1 reads a zero-padded number as octal (``capacity: 010000`` is 4096, a
    ``sample_fixed_size: 010`` is 8): refused rather than taken."""
    digits = str(node.value).replace("_", "").lstrip("+-")
    if len(digits) > 1 and digits[0] == "0" and digits.isdigit():
        raise YamlBoundError(f"{node.value!r} at line {node.start_mark.line + 1} starts with "
                             f"0, which YAML reads as an octal number "
                             f"({loader.construct_yaml_int(node)}): write it without the "
                             "leading zeros, or quote it if it is text")
    return loader.construct_yaml_int(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


#: The most bytes read from one YAML file of a job (a config is kilobytes; this stops a
#: wrong path such as ``/dev/zero`` or a data file from filling memory).
MAX_YAML_BYTES = 16 << 20
#: The most values (scalars, lists and mappings) one YAML document may hold once its
#: aliases are expanded: ``*name`` shares a node, so ten lines of aliases can stand for a
#: billion values (the "billion laughs"), which every walk of the data (a ``repr`` in an
#: error message, a digest) would then expand.
MAX_YAML_VALUES = 1 << 20
#: The deepest nesting of lists and mappings accepted (PyYAML recurses per level).
MAX_YAML_DEPTH = 100


class YamlBoundError(yaml.YAMLError):
    """A YAML document past :data:`MAX_YAML_VALUES` or :data:`MAX_YAML_DEPTH`, whose
    alias refers to a node that holds it, or with a zero-padded (octal) number (its
    message says which)."""


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand it past :data:`MAX_YAML_VALUES` values, that
    nests deeper than :data:`MAX_YAML_DEPTH`, or whose alias refers to a node that holds
    it (an endless value). One pass over the distinct nodes (sizes are memoised)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    depth = 0
    while stack:
        node, done = stack.pop()
        key = id(node)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if done:
            on_path.discard(key)
            depth -= 1
            total = 1 + sum(size[id(c)] for c in children)
            if total > MAX_YAML_VALUES:
                raise YamlBoundError(
                    f"the document holds more than {MAX_YAML_VALUES} values once its "
                    f"aliases (*name) are expanded (from line {node.start_mark.line + 1}); "
                    "a config needs far fewer: write the values out, or remove the aliases")
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise YamlBoundError(
                f"an alias at or below line {node.start_mark.line + 1} refers to a node that "
                "contains it: the value would never end")
        if not children:
            size[key] = 1
            continue
        depth += 1
        if depth > MAX_YAML_DEPTH:
            raise YamlBoundError(f"lists and mappings nest more than {MAX_YAML_DEPTH} deep "
                                 f"(at line {node.start_mark.line + 1})")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the
    last one silently), and a document whose aliases expand past
    :data:`MAX_YAML_VALUES` values or that nests past :data:`MAX_YAML_DEPTH`: how every
    file of a job is read (configs, ``topology.yml``).

    Raises:
        yaml.YAMLError: invalid YAML, a duplicate key (its message names the key and both
            lines), or a document past those bounds.
    """
    loader = _StrictLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:   # PyYAML's composer recurses once per nesting level
            raise YamlBoundError(f"lists and mappings nest more than {MAX_YAML_DEPTH} "
                                 "deep") from None
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """The UTF-8 text of a job's YAML file, at most :data:`MAX_YAML_BYTES` bytes.

    Raises:
        ConfigError: naming the file: missing, a directory, unreadable, not UTF-8, or
            larger than the bound.
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{source}: {what} file does not exist", field=source,
                          hint="check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a {what} file", field=source,
                          hint=f"name the {what} file inside it") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {what} file: {exc}", field=source) from None
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{source}: {what} file is larger than {MAX_YAML_BYTES} bytes",
                          field=source, hint=f"is this the {what} file? a config is a few "
                                             "kilobytes of YAML")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{source}: {what} file is not UTF-8 text (byte {exc.start}, line "
                          f"{line}: {raw[exc.start:exc.start + 1]!r})", field=source,
                          hint="save the file as UTF-8") from None


def read_yaml(path: str | os.PathLike[str] | None, what: str, env_var: str
              ) -> tuple[dict, str]:
    """Read ``path`` (or the file named by ``env_var``) as a YAML mapping.

    Returns the mapping and the source name used in error messages.
    """
    origin = ""
    if path is None:
        path = os.environ.get(env_var) or None
        if path is None:
            raise ConfigError(f"no {what} given: pass a path or set {env_var}",
                              field=env_var, hint=f"export {env_var}=/path/to/{what}.yml")
        origin = f" (path from {env_var})"
    source = os.fspath(path)
    if not source:
        raise ConfigError(f"the {what} path is empty", field=what,
                          hint=f"name the {what}.yml file")
    try:
        text = read_text(source, what)
    except ConfigError as err:
        if not origin:
            raise
        raise ConfigError(f"{err.message}{origin}", field=err.field, hint=err.hint) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        if isinstance(exc, YamlBoundError):
            raise ConfigError(f"{source}: refused: {problem}", field=source) from None
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}", field=source,
                          hint="fix the YAML syntax (indentation, ':' after keys)") from None
    if data is None:
        raise ConfigError(f"{source}: {what} file is empty", field=source,
                          hint="it must be a YAML mapping of sections")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a YAML mapping at the top level, got "
                          f"{type(data).__name__}", field=source,
                          hint="the file must hold `key: value` lines")
    return data, source


#: The most bytes read from a secret file (a token, a password, the role secret).
MAX_SECRET_BYTES = 64 << 10


def read_secret_file(path: str, where: str, hint: str = "write the secret into the file"
                     ) -> str:
    """The stripped text of a secret file (``api.token_file``, ``PERSIA_ROLE_SECRET_FILE``,
    ...): at most :data:`MAX_SECRET_BYTES` read, so a wrong path (``/dev/zero``, a data
    file) neither fills memory nor becomes a secret of gigabytes.

    Raises:
        ConfigError: naming ``where``: unreadable, larger than the bound, not UTF-8, empty.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path!r}: {exc.strerror or exc}",
                          field=where) from None
    if len(raw) > MAX_SECRET_BYTES:
        raise ConfigError(f"{where}: {path!r} is larger than {MAX_SECRET_BYTES} bytes: not a "
                          "secret file", field=where, hint="name the file holding the secret")
    try:
        secret = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path!r} is not UTF-8 text", field=where,
                          hint="name the file holding the secret") from None
    if not secret:
        raise ConfigError(f"{where}: {path!r} is empty", field=where, hint=hint)
    return secret
