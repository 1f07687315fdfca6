"""The base of grpo_plus's settings: the error a bad value raises, and how a group of GRPOConfig fields is declared.

Each concern declares its GRPOConfig fields once, in a settings group beside its code (`grpo_plus/<concern>/
settings.py`), in the style of PEFT's per-method configs: a frozen dataclass whose fields are declared with `setting`
(default, help, choices) and whose values are checked in `__post_init__`, a bad one raising `ConfigError` that names
the GRPOConfig field and what is allowed. From that one declaration come:

- the GRPOConfig field of each setting: the group's `prefix` + the setting's name, or the name given to `setting`;
- `Group.from_config(config)`: the group read from any config; a plain `trl.GRPOConfig`, which lacks the fields, gets
  the declared defaults;
- `config_fields(...)`: the (non-frozen) dataclass of GRPOConfig fields `grpo_plus.config.GRPOConfig` inherits, each
  with its type, default and help, for TRL's parser, YAML configs and `--help`.

A check that needs a TRL field (`per_device_train_batch_size`, `max_completion_length`, `loss_type`, ...) is a method of
the group that takes those values as arguments; `grpo_plus.config` calls it once, when the settings are built.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

# The metadata keys of a setting: TRL's parser (transformers' HfArgumentParser) reads "help" and "choices" (and passes
# every key to argparse, so the GRPOConfig field carries those two only); FIELD names the GRPOConfig field, TYPE
# gives its type where it is not the setting's.
HELP, CHOICES, FIELD, TYPE = "help", "choices", "grpo_plus.field", "grpo_plus.type"


_Group = TypeVar("_Group", bound="SettingsGroup")


class ConfigError(ValueError):
    """A GRPOConfig field has a value that is not allowed."""


def not_allowed(name: str, value: Any, allowed: str) -> ConfigError:
    """ "name=value is not allowed: name must be <allowed>."""
    return ConfigError(f"{name}={value!r} is not allowed: {name} must be {allowed}.")


def setting(
    default: Any,
    help: str,
    *,
    choices: Iterable[Any] | None = None,
    field: str | None = None,
    config_type: Any = None,
) -> Any:
    """A setting of a group, declared once: its default, the help GRPOConfig's field shows (`--help`), the values a
    command line may give (`choices`); `field`, the GRPOConfig field's name where it is not the group's prefix + the
    setting's name; `config_type`, the GRPOConfig field's type where it is not the setting's (a list the parser
    fills, kept as a tuple)."""
    metadata: dict[str, Any] = {HELP: help}
    if choices is not None:
        metadata[CHOICES] = list(choices)
    if field is not None:
        metadata[FIELD] = field
    if config_type is not None:
        metadata[TYPE] = config_type
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class SettingsGroup:
    """A group of GRPOConfig fields (subclass it as a frozen dataclass; declare each field with `setting`).

    `prefix`: what the group's settings are called in GRPOConfig (`health_` + `check` = `health_check`). A dataclass
    field declared without `setting` is no GRPOConfig field: it is given to `from_config` by the caller (a value
    another group holds) or derived there. A subclass checks its values in `__post_init__` (PEFT's way), so a group
    never holds a value it cannot use, and may canonicalize one there (`_set`), as an alias becomes its name."""

    prefix: ClassVar[str] = ""

    def _set(self, name: str, value: Any) -> None:
        """Replace a value while the group is built (frozen afterwards): a canonical name, a parsed number."""
        object.__setattr__(self, name, value)

    @classmethod
    def settings(cls) -> tuple[dataclasses.Field, ...]:
        """The group's settings: its fields that are GRPOConfig fields."""
        return tuple(f for f in dataclasses.fields(cls) if HELP in f.metadata)

    @classmethod
    def field_name(cls, setting: dataclasses.Field | str) -> str:
        """The GRPOConfig field of one of the group's settings (a dataclass field or its name)."""
        if isinstance(setting, str):
            setting = {f.name: f for f in cls.settings()}[setting]
        return setting.metadata.get(FIELD) or cls.prefix + setting.name

    @classmethod
    def field_names(cls) -> dict[str, str]:
        """GRPOConfig field -> the group's setting, for every setting."""
        return {cls.field_name(f): f.name for f in cls.settings()}

    @classmethod
    def from_config(cls: type[_Group], config: Any, **given: Any) -> _Group:
        """The group from `config`'s fields: any object with them as attributes (GRPOConfig, a TRL script's own
        `trl.GRPOConfig`, which has none of them: the declared defaults) or a mapping of them. `given` sets the group's
        fields that are no GRPOConfig field, or replaces a setting's value (a value another setting implies)."""
        read = field_reader(config)
        values = {f.name: read(cls.field_name(f), f.default) for f in cls.settings()}
        return cls(**{**values, **given})

    def config_values(self) -> dict[str, Any]:
        """GRPOConfig field -> this group's value (canonical) as a GRPOConfig holds it (a tuple as a list, an empty one
        as the field's default), for every setting."""
        values = {}
        for f in self.settings():
            value = getattr(self, f.name)
            if TYPE in f.metadata and isinstance(value, tuple):
                value = list(value) if value else f.default
            values[type(self).field_name(f)] = value
        return values


def field_reader(config: Any) -> Callable[[str, Any], Any]:
    """read(name, default): a GRPOConfig field of `config` (an object with the fields as attributes, or a mapping of
    them), `default` where it has none."""
    if isinstance(config, Mapping):
        return config.get
    return lambda name, default: getattr(config, name, default)


def config_fields(name: str, groups: Iterable[type[SettingsGroup]], module: str) -> type:
    """A (non-frozen) dataclass with every setting of `groups` as a GRPOConfig field, in their order: the type, the
    default and the help (and choices) the setting declares, for GRPOConfig to inherit (`module` names where it is
    composed). A GRPOConfig field declared by two settings is an error."""
    specs, owners = [], {}
    for group in groups:
        hints = typing.get_type_hints(group)
        for f in group.settings():
            field_name = group.field_name(f)
            if field_name in owners:
                raise TypeError(
                    f"GRPOConfig field {field_name} is declared by {owners[field_name]} and {group.__name__}"
                )
            owners[field_name] = group.__name__
            metadata = {key: f.metadata[key] for key in (HELP, CHOICES) if key in f.metadata}
            kind = f.metadata.get(TYPE, hints[f.name])
            specs.append((field_name, kind, dataclasses.field(default=f.default, metadata=metadata)))
    fields = dataclasses.make_dataclass(name, specs)
    fields.__module__ = module
    return fields
