"""One small generic registry: name -> callable, with aliases and "did you mean" errors."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def closest_name(value: object, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice most similar to `value`, or None when none is close enough."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(value: object, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """' Did you mean 'x'?' for the closest of `choices`, or '' when none is close."""
    close = closest_name(value, choices, cutoff)
    return f" Did you mean {close!r}?" if close else ""


def quoted_with_hint(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """The unknown `name` quoted, with "(did you mean '<prefix><closest>'?)" when one of `choices` is close."""
    close = closest_name(name, choices)
    return f"'{prefix}{name}'" + (f" (did you mean '{prefix}{close}'?)" if close else "")


@dataclass(frozen=True)
class Entry(Generic[F]):
    """A registered callable plus the metadata its registrar declared."""

    name: str
    fn: F
    aliases: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    doc: str = ""
    # Properties the registrar declared about `fn` that callers may rely on, by name (read with `trait`).
    traits: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def trait(self, name: str, default: Any = None) -> Any:
        """A declared property of the registered callable, or `default` when the registrar did not declare it."""
        return self.traits.get(name, default)


@dataclass
class Registry(Generic[F]):
    """Maps names (and aliases) to callables; `field` is the config field whose values it holds."""

    kind: str
    field: str
    _entries: dict[str, Entry[F]] = field(default_factory=dict)
    _aliases: dict[str, str] = field(default_factory=dict)

    def register(
        self,
        name: str,
        fn: F | None = None,
        *,
        aliases: Iterable[str] = (),
        requires: Iterable[str] = (),
        override: bool = False,
        traits: Mapping[str, Any] | None = None,
    ) -> Callable[[F], F] | F:
        """Register `fn` under `name` (usable as a decorator). Re-registering needs `override=True`.

        `traits` are properties the registrar declares about `fn` (see `Entry.trait`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        aliases = tuple(aliases)

        def decorator(func: F) -> F:
            if not callable(func):
                raise TypeError(f"{self.kind} {name!r} must be callable, got {type(func).__name__}.")
            taken = [key for key in (name, *aliases) if key in self]
            if taken and not override:
                raise ValueError(
                    f"{self.kind} name(s) {', '.join(map(repr, taken))} already registered; "
                    "pass override=True to replace."
                )
            self._drop(name)
            for alias in aliases:
                self._drop(alias)  # an alias may replace a whole entry (override=True): drop it, not shadow it
                self._aliases[alias] = name
            doc = (func.__doc__ or "").strip()
            declared = MappingProxyType(dict(traits or {}))
            self._entries[name] = Entry(name, func, aliases, tuple(requires), doc, declared)
            return func

        return decorator(fn) if fn is not None else decorator

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            for alias in entry.aliases:
                self._aliases.pop(alias, None)
        self._aliases.pop(name, None)

    def unregister(self, name: str) -> None:
        """Remove a registered name and its aliases (mainly for tests and plugin reloads)."""
        self._drop(self.resolve(name))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._aliases)

    def names(self, with_aliases: bool = False) -> list[str]:
        """Registered canonical names (plus aliases if asked), sorted."""
        return sorted([*self._entries, *self._aliases]) if with_aliases else sorted(self._entries)

    def resolve(self, name: str) -> str:
        """Canonical name for `name` or an alias; raises ValueError listing what is allowed (`check`)."""
        return self.check(name)

    def check(self, value: object, *, also: Iterable[str] = (), error: type[ValueError] = ValueError) -> str:
        """The canonical name of `value` (a registered name or alias), or `value` itself when it is one of `also`
        (names something else handles, e.g. TRL's own loss types); anything else raises `error` naming the field,
        the closest allowed name and every allowed one. The one check of a name, wherever it is given."""
        if isinstance(value, str) and value in self._entries:
            return value
        if isinstance(value, str) and value in self._aliases:
            return self._aliases[value]
        also = tuple(also)
        if isinstance(value, str) and value in also:
            return value
        raise error(self.unknown_message(value, also))

    def snapshot(self) -> tuple[dict[str, Entry[F]], dict[str, str]]:
        """What is registered now (for `restore`): tests and plugin reloads put a registry back as it was."""
        return dict(self._entries), dict(self._aliases)

    def restore(self, snapshot: tuple[dict[str, Entry[F]], dict[str, str]]) -> None:
        """Put back what `snapshot()` saw: names registered since are gone, names removed since are back."""
        entries, aliases = snapshot
        self._entries.clear(), self._entries.update(entries)
        self._aliases.clear(), self._aliases.update(aliases)

    def entries(self) -> list[Entry[F]]:
        """Every registered entry, sorted by name."""
        return [self._entries[name] for name in self.names()]

    def entry(self, name: str) -> Entry[F]:
        return self._entries[self.resolve(name)]

    def get(self, name: str) -> F:
        return self.entry(name).fn

    def unknown_message(self, name: object, also: Iterable[str] = ()) -> str:
        allowed = [*self.names(with_aliases=True), *also]
        hint = did_you_mean(name, allowed, cutoff=0.5)
        register = f"grpo_plus.register_{self.kind.replace(' ', '_')}"
        return (
            f"{self.field}={name!r} is not registered.{hint} Allowed: {', '.join(allowed)}. Register your own with "
            f"{register}(name) (import its module first, or list it in the config's `plugins`)."
        )
