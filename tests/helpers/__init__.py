"""Shared test helpers, by kind: `models` (tiny models, tokenizers, datasets, trainers), `rewards` (reward functions
and the prompts they make dead), `probes` (what observes a run, and the processes that train), `losses` (inputs for the
pure-torch policy loss). tests/ is on the Python path (conftest.py, tests/scripts/*), so they import as `helpers.*`."""
