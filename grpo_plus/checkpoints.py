"""Find the checkpoint to resume from, skipping one a crash left half-written."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# transformers' Trainer writes trainer_state.json last, after weights, optimizer, scheduler and RNG states.
_WRITTEN_LAST = "trainer_state.json"


def is_complete_checkpoint(path: str | Path) -> bool:
    """True when the checkpoint's last-written file exists and parses."""
    state = Path(path) / _WRITTEN_LAST
    try:
        json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(output_dir: str | Path) -> str | None:
    """Newest `checkpoint-N` under `output_dir` that was fully written, or None."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    candidates = sorted(
        (int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))
    )
    for _, path in reversed(candidates):
        if is_complete_checkpoint(path):
            return str(path)
        logger.warning(
            "Skipping incomplete checkpoint %s (no valid %s): the run stopped while saving it.", path, _WRITTEN_LAST
        )
    return None
