"""What `grpo-plus fit` answers beyond the config's own step: the longest completion and the largest group that fit a
budget, the settings that would make an over-budget config fit, and the report it prints."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .count import estimate, remembered_counts
from .results import GIB, StepEstimate
from .spec import SIDES, TILED_MLP_TOKENS, FitSpec, for_side, offloading_uncountable, with_memory_options

LENGTH_STEP = 128  # completion lengths are searched in multiples of this
GROUP_LIMIT = 512  # the largest group the search tries


def largest_within(cost, budget: int, low: int, high: int) -> int:
    """The largest n in [low, high] with cost(n) <= budget, for a cost that grows with n and is close to affine or
    quadratic (the terms of a step's peak are linear in the completion length or in the rows; a padding mask is
    quadratic in the length); low - 1 when cost(low) > budget. Exact for any increasing cost: it returns n only once
    cost(n) <= budget < cost(n + 1) (or n = `high`) has been counted.

    A count costs about in proportion to n (a VLM's count at G = 65 takes a minute and a half), so the search counts
    small n first: `low`, then n a sixteenth of the way up, then where the line through the lowest count and the
    largest that fits says the budget is reached (an affine cost: four counts, two of them small), again from each
    guess that fits (a cost that bends down, e.g. shared prompts, is followed up in a few jumps; a guess's neighbour is
    counted only when the line points at it). Once a count is over the budget, the parabola through the counts around
    the answer closes in (a quadratic cost: a guess or two), each guess counted with its neighbour."""
    values: dict[int, float] = {}

    def at(n: int) -> float:
        if n not in values:
            values[n] = cost(n)
        return values[n]

    if at(low) > budget:
        return low - 1
    fit, over = low, None  # cost(fit) <= budget; cost(over) > budget once one is known
    start = low + max((high - low) // 16, 1)  # well inside the range: cheaper to count than the top
    if start < high:
        fit, over = (start, None) if at(start) <= budget else (low, start)
    while over is None or over - fit > 1:
        if over is None:  # the line through the lowest count and the largest that fits
            slope = (at(fit) - at(low)) / (fit - low) if fit > low else 0.0
            guess = fit + int((budget - at(fit)) / slope) if slope > 0 else high
            guess = min(max(guess, fit + 1), high)
            if at(guess) > budget:
                over = guess  # a line overshoots a cost that bends up: the parabola takes it from here
            else:
                fit = guess
                if fit == high:
                    return high
            continue
        guess = _interpolate(values, budget, fit, over)
        if at(guess) > budget:
            over = guess
            if guess - 1 > fit and at(guess - 1) <= budget:
                fit = guess - 1
            continue
        fit = guess
        if fit + 1 < over and at(fit + 1) > budget:  # the guess's neighbour: where an exact guess is proven
            over = fit + 1
    return fit


def _interpolate(values: dict[int, float], budget: float, fit: int, over: int) -> int:
    """A guess in (fit, over) for where the cost reaches `budget`: the parabola through `fit`, `over` and the count
    nearest to them (a quadratic term, e.g. a padding mask, is then met exactly), else the secant."""
    guess = None
    others = [n for n in values if n not in (fit, over)]
    if others:
        third = min(others, key=lambda n: min(abs(n - fit), abs(n - over)))
        guess = _parabola_crossing([(n, values[n]) for n in (third, fit, over)], budget, fit, over)
    if guess is None:
        slope = (values[over] - values[fit]) / (over - fit)
        guess = fit + int((budget - values[fit]) / slope) if slope > 0 else (fit + over) // 2
    return min(max(guess, fit + 1), over - 1)


def _parabola_crossing(points: list[tuple[int, float]], budget: float, fit: int, over: int) -> int | None:
    """The largest integer n in [fit, over) at which the parabola through `points` is at most `budget`, or None when
    it does not cross `budget` once, upward, in that interval."""
    (x0, y0), (x1, y1), (x2, y2) = points
    # Newton's form: y = y0 + d1 (x - x0) + d2 (x - x0)(x - x1)
    d1 = (y1 - y0) / (x1 - x0)
    d2 = ((y2 - y1) / (x2 - x1) - d1) / (x2 - x0)
    a, b, c = d2, d1 - d2 * (x0 + x1), y0 - d1 * x0 + d2 * x0 * x1 - budget
    if abs(a) < 1e-12 * max(abs(b), 1.0):
        return None
    disc = b * b - 4 * a * c
    if disc < 0:
        return None
    roots = [(-b + sign * disc**0.5) / (2 * a) for sign in (1, -1)]
    inside = [r for r in roots if fit <= r < over and 2 * a * r + b > 0]  # rising through the budget
    return int(inside[0]) if len(inside) == 1 else None


def longest_completion(spec: FitSpec, side: str, budget: int) -> int:
    """The longest completion (a multiple of LENGTH_STEP, within the context window) whose worst step fits `budget`
    bytes at the spec's batch settings; 0 when not even LENGTH_STEP tokens fit."""
    window = spec.context_window or 2**17
    limit = max((window - spec.prompt_length) // LENGTH_STEP, 1)

    def cost(steps: int) -> int:
        return estimate(spec.replace(completion_tokens=steps * LENGTH_STEP), side).total

    return LENGTH_STEP * max(largest_within(cost, budget, 1, limit), 0)


def largest_group(spec: FitSpec, side: str, budget: int) -> int:
    """The largest G trained as one micro-batch (per_device_train_batch_size = G, one group generated at a time) whose
    worst step fits `budget` at the spec's completion length; 1 when not even G = 2 fits."""

    def cost(group: int) -> int:
        return estimate(spec.replace(rows=group, num_generations=group, generation_rows=group), side).total

    return largest_within(cost, budget, 2, GROUP_LIMIT)


def suggestions(spec: FitSpec, side: str, budget: int) -> list[str]:
    """Settings that would make `spec` fit `budget` on `side`, each checked by a count, cheapest change first."""
    candidates: list[tuple[str, FitSpec]] = []
    if not spec.gradient_checkpointing:
        candidates.append(("gradient_checkpointing=True", spec.replace(gradient_checkpointing=True)))
    if not spec.offloaded_kv_cache:
        candidates.append(('generation_kwargs={"cache_implementation": "offloaded"}',
                           spec.replace(offloaded_kv_cache=True)))  # fmt: skip
    if side == "grpo_plus":
        if not spec.activation_offloading and offloading_uncountable() is None:
            candidates.append(("activation_offloading=True", spec.replace(activation_offloading=True)))
        if not spec.tiled_mlp_tokens:
            candidates.append(
                (f"tiled_mlp_tokens={TILED_MLP_TOKENS}", spec.replace(tiled_mlp_tokens=TILED_MLP_TOKENS))
            )
    found, combined, names = [], spec, []
    for name, changed in candidates:
        if estimate(changed, side).total <= budget:
            found.append(name)
            return found
    for name, _ in candidates:  # all of them together
        names.append(name)
    if candidates:
        combined = with_memory_options(spec, side)
        if estimate(combined, side).total <= budget:
            return [" + ".join(names)]
    for rows in _halvings(spec.rows):
        fewer = combined.replace(rows=rows, generation_rows=max(rows, spec.generation_rows * rows // spec.rows))
        if estimate(fewer, side).total <= budget:
            prefix = " + ".join(names) + " + " if names else ""
            return [f"{prefix}per_device_train_batch_size={rows} (gradient_accumulation_steps x{spec.rows // rows})"]
    longest = longest_completion(combined, side, budget)
    if longest:
        return [f"max_completion_length={longest}" + (" with " + " + ".join(names) if names else "")]
    return []


# What fit_check="auto" may turn on by itself: grpo_plus's own memory options, which keep TRL's gradient (up to float
# rounding: the tiled MLP's slices) and change nothing the user trains; cheapest in time first (the tiled MLP: one more
# MLP forward, <= 5% of a step where measured; activation offloading: host transfers), then both.
AUTOMATIC_OPTIONS = (
    {"tiled_mlp_tokens": TILED_MLP_TOKENS},
    {"activation_offloading": True},
    {"tiled_mlp_tokens": TILED_MLP_TOKENS, "activation_offloading": True},
)


def automatic_options(spec: FitSpec, budget: int) -> tuple[dict, StepEstimate] | None:
    """What fit_check="auto" turns on: nothing when grpo_plus's worst step fits `budget` as configured, else the first
    of AUTOMATIC_OPTIONS (less what `spec` already has on) with which it fits; with that step. None when none does."""
    result = estimate(spec, "grpo_plus")
    if result.total <= budget:
        return {}, result
    for options in AUTOMATIC_OPTIONS:
        if options.get("activation_offloading") and offloading_uncountable() is not None:
            continue  # not counted here: not turned on blind
        changes = {name: value for name, value in options.items() if getattr(spec, name) != value}
        if not changes:
            continue
        result = estimate(spec.replace(**changes), "grpo_plus")
        if result.total <= budget:
            return changes, result
    return None


def _halvings(rows: int) -> list[int]:
    out = []
    while rows > 1:
        rows //= 2
        out.append(rows)
    return out


# ---- the report (grpo-plus fit) ---------------------------------------------------------------------------------------


@dataclass
class FitReport:
    """What `grpo-plus fit` prints: per side, the worst step at the config's settings, the settings that would make it
    fit when it does not, and with every memory option the longest completion and the largest G that fit."""

    spec: FitSpec
    budget: int
    at_settings: dict[str, StepEstimate]
    fixes: dict[str, list[str]]
    longest: dict[str, int]
    largest_group: dict[str, int | None]
    seconds: float

    @property
    def length_limit(self) -> int | None:
        window = self.spec.context_window
        return None if window is None else (window - self.spec.prompt_length) // LENGTH_STEP * LENGTH_STEP


def fit_report(spec: FitSpec, budget: int, groups: bool = True, parallel: bool = True) -> FitReport:
    """Count everything `grpo-plus fit` prints (module docstring); `groups=False` skips the largest-G searches.
    `parallel`: TRL's side is counted in a child process while this one counts grpo_plus's (`_both_sides`)."""
    if spec.activation_offloading and (reason := offloading_uncountable()) is not None:
        raise ValueError(
            f"grpo-plus fit cannot count activation_offloading=True here: {reason}. Count it on the CUDA machine, "
            "with TRL >= 1.16, or without activation_offloading"
        )
    started = time.perf_counter()
    by_side = _both_sides(spec, budget, groups, parallel)
    at_settings, fixes, longest, largest = ({side: by_side[side][part] for side in SIDES} for part in range(4))
    return FitReport(spec, budget, at_settings, fixes, longest, largest, time.perf_counter() - started)


REPORT_PARTS = ("settings", "groups")  # the worst step, its fixes and the longest completion; the largest G


def _side_report(spec: FitSpec, side: str, budget: int, parts: tuple[str, ...] = REPORT_PARTS) -> tuple:
    """One side's part of the report: (the worst step at the config's settings, the fixes when it is over `budget`,
    the longest completion, the largest G with every memory option), None for what `parts` leaves out ("settings":
    the first three, "groups": the last)."""
    at_settings = fixes = longest = largest = None
    with remembered_counts():
        if "settings" in parts:
            at_settings = estimate(spec, side)
            fixes = suggestions(for_side(spec, side), side, budget) if at_settings.total > budget else []
            longest = longest_completion(with_memory_options(spec, side), side, budget)
        if "groups" in parts:
            largest = largest_group(with_memory_options(spec, side), side, budget)
    return at_settings, fixes, longest, largest


def _both_sides(spec: FitSpec, budget: int, groups: bool, parallel: bool) -> dict[str, tuple]:
    """`_side_report` of each side. The sides share no count, and on a large config each search is up to minutes of
    single-threaded Python (a VLM's largest-G search encodes G pictures per count), so with `parallel` (and more than one
    CPU) they are counted in child processes (`python -m grpo_plus.fit --side-report SIDE --parts PART ...`): with two
    or three CPUs TRL's side in one child while this process counts grpo_plus's, with four or more each side's worst
    step and longest completion, and its largest G, as four jobs (three children). The report takes the slowest job's
    time, or the jobs' total over the CPUs (plus the children's imports), not the sum. Fresh processes, not forks:
    autograd refuses to run in a child forked after a backward (any count is one)."""
    import os

    parts = REPORT_PARTS if groups else ("settings",)
    cpus = os.cpu_count() or 1
    if not parallel or cpus < 2:
        return {side: _side_report(spec, side, budget, parts) for side in SIDES}
    # Each child costs its imports (~7 s of CPU): with fewer than four CPUs a side is one job (TRL's in a child, all of
    # grpo_plus's here); measured on two cores, four jobs made the text recipes' reports 5-23 s slower.
    per_job = [parts] if cpus < 4 else [(part,) for part in parts]
    here = ("grpo_plus", per_job[0])
    jobs = [(side, job) for side in SIDES for job in per_job if (side, job) != here]
    children = [_start_side_report(spec, budget, side, job) for side, job in jobs]
    try:
        fed = [_feed(child.stdin, spec.to_json().encode()) for child, _ in children]  # every child, before counting
        ours = _side_report(spec, here[0], budget, here[1]) if all(fed) else None
        answers = [
            _side_report_of(child, stderr, side) for (child, stderr), (side, _) in zip(children, jobs, strict=True)
        ]
    finally:
        for child, stderr in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            stderr.close()
    merged = {side: [None, None, None, None] for side in SIDES}
    for (side, _), answer in [*zip(jobs, answers, strict=True), (here, ours)]:
        if answer is None:  # a child ended before it read the config (and still answered: cannot happen)
            raise RuntimeError("counting a side of the report in a child process failed before it read the config")
        merged[side] = [
            mine if mine is not None else theirs for mine, theirs in zip(merged[side], answer, strict=True)
        ]
    return {side: tuple(merged[side]) for side in SIDES}


def _start_side_report(spec: FitSpec, budget: int, side: str, parts: tuple[str, ...]):
    """A child process counting `parts` of `side`'s report (`python -m grpo_plus.fit --side-report`), and the file its
    stderr goes to (a file, not a pipe: a child's warnings never fill a buffer and stall it)."""
    import os
    import subprocess
    import sys
    import tempfile

    command = [
        sys.executable,
        "-m",
        "grpo_plus.fit",
        "--side-report",
        side,
        "--parts",
        *parts,
        "--budget",
        str(budget),
    ]
    # The child imports this very grpo_plus (its folder first on the path), whatever put it on the parent's path.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    stderr = tempfile.TemporaryFile()
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env)
    return child, stderr


def _side_report_of(child, stderr, side: str) -> tuple:
    """What a `_start_side_report` child answered (its pickled `_side_report`); raises with its stderr's tail when it
    failed."""
    import base64
    import pickle

    output = child.stdout.read()
    child.wait()
    if child.returncode != 0 or not output.strip():
        stderr.seek(0)
        tail = stderr.read().decode(errors="replace").strip().splitlines()[-20:]
        who = "TRL" if side == "trl" else side
        raise RuntimeError(f"counting {who}'s side in a child process failed (exit {child.returncode}):\n"
                           + "\n".join(tail))  # fmt: skip
    return pickle.loads(base64.b64decode(output.strip().splitlines()[-1]))


def _feed(stdin, data: bytes) -> bool:
    """Write `data` to a child's stdin and close it; False when the child ended before it read it (its exit code then
    says why)."""
    try:
        stdin.write(data)
        stdin.close()
        return True
    except BrokenPipeError:
        try:
            stdin.close()
        except BrokenPipeError:  # the unflushed rest has nowhere to go
            pass
        return False


def format_report(report: FitReport, source: str = "") -> str:
    """The report as `grpo-plus fit` prints it; the last line reads
    `longest completion: TRL N tokens, grpo_plus M tokens (M/N x)`."""
    spec = report.spec
    config = spec.config()
    lora = f"LoRA r={spec.lora['r']}" if spec.lora else "every weight trains"
    lines = [
        f"grpo-plus fit{': ' + source if source else ''} ({report.budget / GIB:.2f} GiB for tensors)",
        f"model: {config.model_type}, {spec.layers} layers, hidden {config.get_text_config().hidden_size}, "
        f"{spec.weights_dtype}{' in 4 bits (nf4)' if spec.four_bit else ''}, {lora}; {spec.rows} rows per "
        f"micro-batch, G = {spec.num_generations}, {spec.generation_rows} rows generated at once; "
        f"{spec.prompt_length} prompt + {spec.completion_tokens} completion tokens "
        f"({'prompts of different lengths' if spec.padded_prompts else 'prompts of one length'}); "
        f"gradient checkpointing {'on' if spec.gradient_checkpointing else 'off'}",
    ]  # fmt: skip
    if spec.images_per_prompt:
        height, width = spec.image_grid
        lines.append(
            f"pictures: {spec.images_per_prompt} per prompt, {spec.image_size[0]}x{spec.image_size[1]} pixels, "
            f"{height * width} vision patches and {spec.image_tokens} image tokens each (in the prompt's tokens); "
            f"vision tower {config.vision_config.depth} blocks, hidden {config.vision_config.hidden_size}; TRL "
            f"encodes each picture G times per pass, grpo_plus once per group"
        )
    lines += [
        "",
        f"worst step at the config's settings (GiB)       {'TRL':>9} {'grpo_plus':>10}",
    ]  # fmt: skip
    parts = {side: report.at_settings[side].parts() for side in SIDES}
    for name in parts["trl"]:
        lines.append(f"  {name:<45} {parts['trl'][name] / GIB:>9.2f} {parts['grpo_plus'][name] / GIB:>10.2f}")
    verdict = {side: "fits" if report.at_settings[side].total <= report.budget else "OVER" for side in SIDES}
    lines.append(f"  {'fits ' + format(report.budget / GIB, '.2f') + ' GiB':<45} {verdict['trl']:>9} "
                 f"{verdict['grpo_plus']:>10}")  # fmt: skip
    for side in SIDES:
        if report.at_settings[side].total > report.budget:
            fixes = report.fixes[side]
            lines.append(f"  settings that would make it fit with {'TRL' if side == 'trl' else 'grpo_plus'}: "
                         + ("; or ".join(fixes) if fixes else "none (a smaller model, fewer tokens, a larger GPU)"))  # fmt: skip
    offloading = "activation_offloading + " if offloading_uncountable() is None else ""
    options = (f"TRL: gradient_checkpointing + generation_kwargs cache_implementation='offloaded'; grpo_plus: also "
               f"{offloading}tiled_mlp_tokens={spec.tiled_mlp_tokens or TILED_MLP_TOKENS}")  # fmt: skip
    lines += ["", f"with every memory option ({options}), at the config's batch settings:"]
    if not offloading:
        lines.append(f"  (activation_offloading left out: {offloading_uncountable()})")
    limit = report.length_limit
    marks = {side: " (context window)" if limit and report.longest[side] >= limit else "" for side in SIDES}
    lines.append(f"  {'longest completion that fits (tokens)':<45} {str(report.longest['trl']) + marks['trl']:>9} "
                 f"{str(report.longest['grpo_plus']) + marks['grpo_plus']:>10}")  # fmt: skip
    if report.largest_group["trl"] is not None:
        groups = {side: (f">= {GROUP_LIMIT}" if report.largest_group[side] >= GROUP_LIMIT else
                         str(report.largest_group[side])) for side in SIDES}  # fmt: skip
        lines.append(f"  {'largest G in one micro-batch (at ' + str(spec.completion_tokens) + ' tokens)':<45} "
                     f"{groups['trl']:>9} {groups['grpo_plus']:>10}")  # fmt: skip
    if any(marks.values()):
        lines.append(f"  (context window: the model's max_position_embeddings {spec.context_window} less the "
                     f"{spec.prompt_length}-token prompt binds first)")  # fmt: skip
    lines.append(f"  counted in {report.seconds:.0f} s; not counted: CUDA context, kernel workspaces, allocator "
                 "fragmentation (kept outside the budget)")  # fmt: skip
    trl, ours = report.longest["trl"], report.longest["grpo_plus"]
    ratio = f"{ours / trl:.2f}x" if trl else "TRL fits none"
    lines += ["", f"longest completion: TRL {trl} tokens, grpo_plus {ours} tokens ({ratio})"]
    return "\n".join(lines)
