"""A request body parsed once and shared read-only by every plugin that reads it.

Both services parse the body with orjson once, whatever the number of
plugins, and hand each plugin the same parse. Sharing is safe only if no
plugin can change what the next one reads, so the parse is wrapped in
read-only views: ``FrozenDict`` for a JSON object and ``FrozenList`` for an
array. Wrapping happens on access, so viewing a 10 MiB body costs nothing
until a plugin reads into it (most read one field, ``model``). Changing a
view raises ``TypeError``; a plugin that wants a different body builds its
own from a fresh parse.

``dumps`` serialises a view (or anything holding views) at orjson's speed:
it hands orjson the parsed data underneath.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn, final

import orjson


def _refuse(*_args: object, **_kwargs: object) -> NoReturn:
    raise TypeError(
        "the parsed body is shared by all plugins and read-only; change a copy of your own"
    )


def frozen(value: Any) -> Any:
    """``value`` from a JSON parse, with an object or array wrapped in its read-only view."""
    if type(value) is dict:
        return FrozenDict(value)
    if type(value) is list:
        return FrozenList(value)
    return value


@final
class FrozenDict(Mapping[str, Any]):
    """A read-only view of a JSON object; what it returns is read-only too.

    Item assignment and deletion, and dict's mutating methods, raise
    ``TypeError`` saying why. Equal to a dict with the same items.
    """

    __slots__ = ("_data",)

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return frozen(self._data[key])

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse


@final
class FrozenList(Sequence[Any]):
    """A read-only view of a JSON array; ``append`` and friends raise ``TypeError``."""

    __slots__ = ("_data",)

    def __init__(self, data: list[Any]) -> None:
        self._data = data

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return FrozenList(self._data[index])
        return frozen(self._data[index])

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenList | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return f"FrozenList({self._data!r})"

    __setitem__ = __delitem__ = append = clear = extend = insert = pop = remove = _refuse
    reverse = sort = _refuse


def parse_object(raw: bytes) -> dict[str, Any]:
    """Parse ``raw``, which must be a JSON object; ValueError in plain words otherwise."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise ValueError(str(error)) from None
    if type(value) is not dict:
        raise ValueError(f"{'an array' if type(value) is list else 'a scalar'}, not a JSON object")
    return value


def _underneath(value: Any) -> Any:
    if isinstance(value, FrozenDict | FrozenList):
        return value._data
    if isinstance(value, Mapping):  # another read-only mapping: copied, then serialised
        return dict(value)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def dumps(value: Any) -> bytes:
    """``value`` as JSON bytes; read-only views are serialised as the data they wrap, at
    orjson's speed, and any other mapping or sequence as a copy."""
    return orjson.dumps(value, default=_underneath)
