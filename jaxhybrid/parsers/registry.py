"""Looking a parser class up by its flag name."""

from collections.abc import Mapping


def lookup[T](registry: Mapping[str, T], name: str, kind: str) -> T:
    """`registry[name]`; a ValueError that names the valid names when there is none."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(registry)}") from None
