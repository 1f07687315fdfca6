"""`python -m grpo_plus.fit --budget BYTES` < spec.json: the trainer's fit check, counted in a child process (and one
side of `grpo-plus fit`'s report with `--side-report SIDE`)."""

import sys

from .check import child_main

if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
