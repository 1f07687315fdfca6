"""Run a script (e.g. a recipe) with accelerate's FSDP forced onto CPU processes (test harness only).

accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \
    tests/scripts/under_fsdp_on_cpu.py recipes/grpo_lora.py --use_cpu true ...

Prints `DISTRIBUTED_TYPE=<accelerate's distributed type>` once the script has run, so a test can tell it ran FSDP.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.fsdp_on_cpu import force_fsdp_on_cpu  # noqa: E402

if __name__ == "__main__":
    force_fsdp_on_cpu()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
    from accelerate.state import PartialState

    print(f"DISTRIBUTED_TYPE={PartialState().distributed_type.value}", flush=True)
