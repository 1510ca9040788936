"""Reading a mig-parted config's YAML text safely: a SafeLoader that refuses a key given twice,
and bounds checked on the event stream before any object is built (no anchors or aliases, a
few hundred bytes of which expand to gigabytes; a bounded size, depth and node count).
PyYAML is imported only here, and only when a config is parsed (it costs RSS otherwise)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from agent.errors import InvalidRequest


def shown(v: object) -> str:
    """A client's value as an error message may show it: a short scalar as written, anything
    else by its kind. The parsed input is never echoed whole (a YAML alias bomb's expansion
    was a 1 GB error message, formatted on the event loop)."""
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, list | tuple):
        return f"a list of {len(v)} item(s)"
    if v is None or isinstance(v, bool | int | float | str):
        text = repr(v)
        return text if len(text) <= 40 else text[:40] + "..."
    return f"a {type(v).__name__}"



def _no_duplicates(loader: Any, node: Any) -> dict[Any, Any]:
    """A mapping constructor that rejects a key given twice (a label written twice would
    otherwise silently lose the first)."""
    import yaml  # noqa: PLC0415 - YAML is needed only to parse a config (saves RSS otherwise)

    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {shown(key)}", key_node.start_mark)
    return dict(loader.construct_mapping(node, deep=True))


@functools.cache
def _loader() -> Any:
    """``yaml.SafeLoader`` with :func:`_no_duplicates` (made on first use)."""
    import yaml  # noqa: PLC0415

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)
    return _Loader


#: Bounds on a config given as text. mig-parted configs are small and flat: the standard set
#: for a GPU model is a few kB, four levels deep, and uses no anchors.
MAX_CONFIG_CHARS = 64 * 1024
MAX_CONFIG_DEPTH = 16
MAX_CONFIG_NODES = 20_000


def _refuse(reason: str) -> InvalidRequest:
    return InvalidRequest(f"config refused: {reason}", errors=[{"field": "config",
                                                                "reason": reason}])


def _check_events(text: str) -> None:
    """Walk the YAML events (no objects are built) and refuse anchors and aliases (a few
    hundred bytes of aliases expand to gigabytes), nesting deeper than
    :data:`MAX_CONFIG_DEPTH` and more than :data:`MAX_CONFIG_NODES` nodes."""
    import yaml  # noqa: PLC0415

    parser = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth = nodes = 0
    events = yaml.parse(text, Loader=parser)
    while True:
        try:
            event = next(events)
        except StopIteration:
            return
        except yaml.YAMLError:
            return  # not YAML: the loader says where and why, in the words the tests know
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            raise _refuse(f"{where}YAML anchors and aliases are not accepted (a mig-parted "
                          "config needs none)")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                raise _refuse(f"nested more than {MAX_CONFIG_DEPTH} deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_CONFIG_NODES:
                raise _refuse(f"more than {MAX_CONFIG_NODES} YAML nodes")


def load_yaml(text: str) -> Any:
    """The document in ``text``, refused (:class:`InvalidRequest` naming the line) when it is
    not YAML, too large or too deep, or uses anchors."""
    import yaml  # noqa: PLC0415

    if len(text) > MAX_CONFIG_CHARS:
        raise _refuse(f"{len(text)} characters (at most {MAX_CONFIG_CHARS})")
    try:
        _check_events(text)
        return yaml.load(text, Loader=_loader())  # a SafeLoader
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = err.problem or err.context or "not YAML"
        reason = f"{where}{problem}"
        raise InvalidRequest(f"config is not valid YAML: {reason}",
                             errors=[{"field": "config", "reason": reason}]) from err
    except yaml.YAMLError as err:
        raise InvalidRequest(f"config is not valid YAML: {err}",
                             errors=[{"field": "config", "reason": str(err)}]) from err
