"""Print constraints pinning every runtime dependency in pyproject.toml to its lower bound (`name>=X` -> `name==X`).

`make test-matrix` installs the "oldest" environment with these, so each lower bound the package declares is one
that has been installed and tested. torch is left out: every environment installs the machine's own torch first.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib  # Python 3.11+, which every matrix environment runs (the local CPU torch wheel is cp311)

INSTALLED_SEPARATELY = {"torch"}


def lower_bound_pins(pyproject: Path) -> list[str]:
    pins = []
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)[^;]*?>=\s*([^,;\s]+)", requirement)
        if match is None:
            raise SystemExit(f"{requirement!r} in {pyproject} has no lower bound (>=); every dependency needs one.")
        if match[1] not in INSTALLED_SEPARATELY:
            pins.append(f"{match[1]}=={match[2]}")
    return pins


if __name__ == "__main__":
    print("\n".join(lower_bound_pins(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
