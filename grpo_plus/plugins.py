"""Load user modes: modules named in the config (`plugins`) and third-party packages' `grpo_plus.plugins` entry points."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType

from .settings import SettingsGroup, not_allowed, setting

ENTRY_POINT_GROUP = "grpo_plus.plugins"
logger = logging.getLogger(__name__)
_loaded_entry_points: set[str] = set()


class PluginError(ImportError):
    """A plugin module or entry point could not be loaded."""


def load_entry_point_plugins() -> list[str]:
    """Import every `grpo_plus.plugins` entry point once; a callable entry point is called with no arguments.

    A package declares one in its pyproject.toml:
        [project.entry-points."grpo_plus.plugins"]
        my_modes = "my_package.modes"           # importing registers its modes
    """
    loaded = []
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        key = f"{entry_point.name}={entry_point.value}"
        if key in _loaded_entry_points:
            continue
        try:
            target = entry_point.load()
        except Exception as error:
            raise PluginError(
                f"grpo_plus plugin entry point {entry_point.name!r} ({entry_point.value}) failed to load: {error}"
            ) from error
        if callable(target):
            target()
        _loaded_entry_points.add(key)
        loaded.append(entry_point.name)
        logger.info("Loaded grpo_plus plugin %s", key)
    return loaded


def import_user_module(name: str) -> ModuleType:
    """Import a user's module (plugins, reward functions), also from the working directory: `python recipes/x.py`
    puts the script's folder on sys.path, not the folder it is run from, where the user's modules usually are."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        cwd = os.getcwd()
        if error.name != name.split(".")[0] or any(os.path.abspath(p or ".") == cwd for p in sys.path):
            raise
    sys.path.append(cwd)  # appended: an installed module of the same name still wins
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        sys.path.remove(cwd)
        raise


def import_plugin_modules(modules: Iterable[str]) -> None:
    """Import modules that register modes (the config's `plugins` field: `--plugins my_modes`)."""
    for module in modules:
        try:
            import_user_module(module)
        except ImportError as error:
            raise PluginError(
                f"plugins: could not import {module!r} ({error}). Give an importable module name (in the working "
                "directory, on PYTHONPATH or installed) whose import registers your modes."
            ) from error


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Entry-point plugins first, then the explicitly named modules."""
    load_entry_point_plugins()
    import_plugin_modules(modules)


@dataclass(frozen=True)
class PluginSettings(SettingsGroup):
    """GRPOConfig's `plugins`, declared here, beside the loader, and not in a concern's folder: it belongs to no concern
    (the modules it names may register names in any registry: loss types, estimators, rejection criteria), and it is
    the one field read before every other group is built, whose names it may make valid."""

    # A tuple here; GRPOConfig's field is the list TRL's parser fills.
    plugins: tuple[str, ...] = setting(
        None,
        "Python modules to import before the config is validated, so modes they register can be named "
        "in `loss_type`, `importance_sampling_level`, `scale_rewards`, `advantage_estimator`, `policy_loss` or "
        "`kl_estimator` (e.g. from a YAML config). Packages can "
        "instead declare a `grpo_plus.plugins` entry point, which is loaded automatically.",
        config_type=list[str] | None,
    )

    def __post_init__(self) -> None:
        modules = self.plugins
        modules = (modules,) if isinstance(modules, str) else tuple(modules or ())  # one module given as a string
        if not all(isinstance(module, str) and module for module in modules):
            raise not_allowed("plugins", list(modules), "a list of importable module names")
        self._set("plugins", modules)
