"""`python -m grpo_plus.fit --budget BYTES` < spec.json: the trainer's fit check, counted in a child process."""

import sys

from .check import child_main

if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
