"""YAML as a pipeline spec reads it: safe (no tags that build objects or run code), and a key given twice in one
mapping is an error with both lines, where PyYAML would keep the last one silently.

    data = load_yaml(Path("pipelines/promote.yaml"))   # ConfigError naming the file and line on a bad document
"""

from __future__ import annotations

from pathlib import Path

import yaml

from qgate.errors import ConfigError


class _TwiceLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error: PyYAML keeps the last one silently,
    so `kl_p99_max` set twice would gate on whichever came second."""


class _KeyTwice(yaml.constructor.ConstructorError):
    pass


def _mapping_once(loader: _TwiceLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # a merge (`<<: *anchor`) is overridden by the keys beside it, as YAML means it to be
        key = loader.construct_object(key_node)
        if key in first:
            raise _KeyTwice(
                None,
                None,
                f"key {key!r} appears twice in one mapping, first on line {first[key] + 1}",
                key_node.start_mark,
            )
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep)


_TwiceLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_once)


def load_yaml(path: Path):
    """The document in `path`; ConfigError at the line of a key given twice, or for YAML that does not parse (tags
    such as !function included)."""
    try:
        return yaml.load(Path(path).read_text(), Loader=_TwiceLoader)  # noqa: S506 - a SafeLoader
    except _KeyTwice as e:
        where = f"{path}:{e.problem_mark.line + 1}" if e.problem_mark else str(path)
        raise ConfigError(f"{where}: {e.problem}", hint="keep one of them: YAML would silently use the last") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})", hint="tags such as !function are not allowed") from e
