"""`python -m grpo_plus.fit --budget BYTES` < spec.json: the trainer's fit check, counted in a child process (and one
side of `grpo-plus fit`'s report with `--side-report SIDE`). The counting code loads here, in the child, never in the
trainer's process (`grpo_plus.fit.check`)."""

import argparse
import base64
import json
import pickle
import sys

from .check import FRAGMENTATION, report_of
from .count import estimate, quiet, remembered_counts
from .search import REPORT_PARTS, _side_report, automatic_options, suggestions
from .spec import SIDES, FitSpec


def child_main(argv: list[str]) -> int:
    """The trainer's count, one JSON line on stdout (`check.report_of`); with `--side-report SIDE`, that side's part
    of `grpo-plus fit`'s report instead (`search._both_sides`)."""
    parser = argparse.ArgumentParser(prog="python -m grpo_plus.fit")
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--auto", action="store_true", help="also the options fit_check='auto' would turn on")
    parser.add_argument("--side-report", choices=SIDES, help="one side's part of `grpo-plus fit`'s report (pickled)")
    parser.add_argument("--parts", nargs="+", choices=REPORT_PARTS, default=list(REPORT_PARTS),
                        help="with --side-report: which parts of it (the worst step, fixes, longest completion; the "
                        "largest G)")  # fmt: skip
    args = parser.parse_args(argv)
    spec = FitSpec.from_json(sys.stdin.read())
    if args.side_report:  # the child of grpo_plus.fit.search._both_sides: same library, so a pickle is read back
        with quiet():
            part = _side_report(spec, args.side_report, args.budget, tuple(args.parts))
        print(base64.b64encode(pickle.dumps(part)).decode())
        return 0
    budget = int(args.budget / (1 + FRAGMENTATION))
    automatic, fixes = None, []
    with quiet(), remembered_counts():
        result = estimate(spec, "grpo_plus")
        found = automatic_options(spec, budget) if args.auto else None
        if found is not None and found[0]:
            automatic = dict(report_of(found[1]), options=found[0])
        elif result.total > budget and found is None:
            fixes = suggestions(spec, "grpo_plus", budget)
    print(json.dumps(dict(report_of(result), suggestions=fixes, automatic=automatic)))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
