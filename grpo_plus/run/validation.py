"""What the user hands the trainer, checked: the train dataset when the trainer is built, every reward function's
output when it is called. A mistake names the dataset column or the reward function and what is allowed.

Each check refuses only what stock TRL would fail on too (then at its first step, or with a less telling error):
a dataset without a 'prompt' column trains in TRL when an `environment_factory` supplies the prompt from `reset()`,
and a reward function may return any iterable TRL can turn into a list of numbers.

A reward function that raises keeps its exception type (stock TRL raises the original, and scripts catch it by type):
the error is re-raised as a subclass of both its own type and `RewardFunctionError`, with the function's name and the
completion it failed on added as a note.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)
_NOT_DATASET_COLUMNS = ("trainer_state", "log_extra", "log_metric", "completion_ids", "environments")


class RewardFunctionError(RuntimeError):
    """A user reward function failed. What it raised is raised as a subclass of its own type and this one, so both
    `except ValueError` (as with stock TRL) and `except RewardFunctionError` catch it."""


class RewardOutputError(RewardFunctionError, TypeError, ValueError):
    """A reward function returned something other than one number (or None) per completion."""


class DatasetError(ValueError):
    """The train dataset cannot be trained on (no 'prompt' column, no 'environment' column to route rows, no rows)."""


# ---- dataset ---------------------------------------------------------------------------------------------------------


def check_dataset(
    dataset: Any,
    name: str = "train_dataset",
    *,
    prompt_required: bool = True,
    environment_names: Sequence[Any] | None = None,
) -> None:
    """Raise DatasetError where TRL could not train on `dataset` (when the columns are known): no 'prompt' column
    while `prompt_required` (no `environment_factory`: TRL reads `row["prompt"]`), no 'environment' column while
    `environment_names` lists the environments of a dict `environment_factory` (TRL routes every row by it), or no
    rows (TRL would run zero steps without a word)."""
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)  # None for an IterableDataset of unknown features
    if columns is not None and prompt_required and "prompt" not in columns:
        raise DatasetError(
            f"{name} has no 'prompt' column (columns: {list(columns)}). GRPO needs one: a string, or a list of chat "
            "messages [{'role': 'user', 'content': ...}]. Rename your column, e.g. "
            "dataset.rename_column('question', 'prompt'), or pass an environment_factory whose reset() returns the "
            "prompt."
        )
    routed = environment_names is not None and None not in environment_names
    if columns is not None and routed and "environment" not in columns:
        raise DatasetError(
            f"{name} has no 'environment' column (columns: {list(columns)}). With a dict environment_factory, every "
            f"row names its environment there: one of {list(environment_names)}."
        )
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise DatasetError(f"{name} is empty (0 rows): there is nothing to train on.")


# ---- reward functions ------------------------------------------------------------------------------------------------


def guard_reward_funcs(funcs: list[Any], names: list[str], is_async: Callable[[Any], bool]) -> list[Any]:
    """Wrap every plain synchronous reward function (not a reward model, not async) in a `GuardedReward`."""
    return [
        GuardedReward(func, name) if callable(func) and not isinstance(func, torch.nn.Module) and not is_async(func)
        else func
        for func, name in zip(funcs, names, strict=True)
    ]  # fmt: skip


class GuardedReward:
    """A reward function whose failure names it and its inputs, and whose output is checked.

    The wrapper keeps the wrapped function's call contract: it passes on exactly the arguments it was called with
    (TRL calls reward functions with `prompts`, `completions`, ... by keyword; TRL's environment rewards and users'
    own code call them with other arguments), and checks the output against the completions only where
    `completions` was passed. `__wrapped__` makes `inspect.signature` read the function's own signature."""

    def __init__(self, func: Callable[..., Any], name: str, warn_non_finite: bool = True):
        self.func, self.__wrapped__, self.__name__ = func, func, name
        self._warned_non_finite = not warn_non_finite  # the reward runner's workers leave the warning to the trainer

    def __call__(self, *args, **kwargs):
        try:
            rewards = self.func(*args, **kwargs)
        except Exception as error:
            raise self.failure(error, kwargs) from error.__cause__
        if "completions" not in kwargs:  # not a scoring call of TRL's: there is no count to check against
            return rewards
        return self.check_output(rewards, kwargs["completions"])

    def failure(self, error: Exception, kwargs: Mapping[str, Any]) -> Exception:
        """`error`, raised by the function called with `kwargs`, as this wrapper raises it: its own type and
        RewardFunctionError, with a note naming the function and the first completion."""
        completions = kwargs.get("completions")
        return _keeping_type(error, self._context(error, completions, kwargs))

    def _context(self, error: Exception, completions, kwargs) -> str:
        columns = sorted(k for k in kwargs if k not in _NOT_DATASET_COLUMNS)
        first = completions[0] if completions else None
        return (
            f"Reward function {self.__name__!r} raised {type(error).__name__}, called with {len(completions or [])} "
            f"completions; the first was {str(first)[:200]!r}. Keyword arguments: prompts, completions, completion_ids, "
            f"{', '.join(columns)} (every dataset column is passed; accept **kwargs for the ones you do not use)."
        )

    def check_output(self, rewards: Any, completions: Sequence[Any] | None) -> Any:
        """`rewards` as TRL will read them (an iterator, which TRL reads once, as a list); raises what TRL cannot
        turn into one number (or None) per completion."""
        expected = len(completions or [])
        what = f"Reward function {self.__name__!r} must return a list of {expected} rewards (one float or None per "
        returned = rewards
        if isinstance(rewards, torch.Tensor):
            rewards = rewards.tolist() if rewards.dim() == 1 else rewards
        elif isinstance(rewards, Iterable) and not isinstance(
            rewards, (str, bytes, Mapping, Sequence, _ndarray_type())
        ):
            returned = rewards = list(rewards)  # a generator, a pandas Series, ...: TRL iterates it into a list
        if isinstance(rewards, (str, bytes, Mapping)) or not isinstance(rewards, (Sequence, _ndarray_type())):
            raise RewardOutputError(f"{what}completion); it returned {_describe(rewards)}.")
        if len(rewards) != expected:
            raise RewardOutputError(f"{what}completion); it returned {len(rewards)}.")
        bad = next(((i, r) for i, r in enumerate(rewards) if not _is_reward(r)), None)
        if bad is not None:
            raise RewardOutputError(f"{what}completion); item {bad[0]} is {_describe(bad[1])}.")
        non_finite = sum(1 for r in rewards if r is not None and math.isinf(float(r)))
        if non_finite and not self._warned_non_finite:
            self._warned_non_finite = True
            logger.warning(
                "Reward function %r returned +-inf for %d of %d completions. grpo_plus treats a non-finite reward "
                "like None: that completion gets advantage 0, and a step in which no completion has a finite reward "
                "trains nothing (loss 0). Return finite numbers (or None for 'cannot score'). Said once per run.",
                self.__name__,
                non_finite,
                expected,
            )
        return returned


def _is_reward(value: Any) -> bool:
    if value is None or (isinstance(value, numbers.Real)):
        return True
    return isinstance(value, (torch.Tensor, _ndarray_type())) and value.ndim == 0 and not value.dtype == object


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


@functools.cache
def _ndarray_type() -> type:
    import numpy as np

    return np.ndarray


def _keeping_type(error: Exception, note: str) -> Exception:
    """`error` as an instance of a subclass of its own type and RewardFunctionError, with `note` added; `error`
    itself with the note when its type cannot be combined or copied faithfully."""
    combined = _combined_type(type(error))
    wrapped = error
    if combined is not None:
        try:
            candidate = combined.__new__(combined, *error.args)
            _copy_fields(error, candidate)
            if str(candidate) == str(error):
                wrapped = candidate
        except Exception:  # a type whose instances need more than their args (C-level fields)
            pass
    if hasattr(wrapped, "add_note"):
        wrapped.add_note(note)
    else:  # Python 3.10: no notes in tracebacks; _combined_type's __str__ appends them
        wrapped.__notes__ = [*getattr(wrapped, "__notes__", []), note]
    return wrapped.with_traceback(error.__traceback__)


_NOT_COPIED = frozenset(
    {
        "__class__",
        "__dict__",
        "__weakref__",
        "args",
        "__traceback__",
        "__context__",
        "__cause__",
        "__suppress_context__",
    }
)


def _copy_fields(source: BaseException, target: BaseException) -> None:
    """Instance attributes and the C-level fields of built-in exceptions (OSError.filename, KeyError's args, ...)."""
    target.__dict__.update(source.__dict__)
    for klass in type(source).__mro__:
        for name, attribute in vars(klass).items():
            if name not in _NOT_COPIED and isinstance(
                attribute, (types.MemberDescriptorType, types.GetSetDescriptorType)
            ):
                with contextlib.suppress(AttributeError, TypeError, ValueError):
                    value = getattr(source, name)
                    if value is not None:  # an unset C field reads as None; setting None is not unsetting
                        setattr(target, name, value)


@functools.cache
def _combined_type(original: type[Exception]) -> type[Exception] | None:
    if issubclass(original, RewardFunctionError):
        return None
    namespace: dict[str, Any] = {"__module__": original.__module__, "__qualname__": original.__qualname__}
    if sys.version_info < (3, 11):
        namespace["__str__"] = lambda self: "\n".join([original.__str__(self), *getattr(self, "__notes__", [])])
    try:
        return type(original.__name__, (original, RewardFunctionError), namespace)
    except TypeError:  # e.g. a final type or an incompatible instance layout
        return None
