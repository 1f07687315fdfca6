"""Oracles written from the papers' formulas, independent of grpo_plus's code: plain Python over groups and tokens.

Conventions they share with grpo_plus's documented behaviour (not with any one framework): a NaN reward is an
unscorable completion, left out of every baseline and statistic, advantage 0; a group with fewer than two scorable
completions carries no signal (advantage 0); a completion with no loss token (length 0) gets advantage 0 from the
length-aware estimators. Advantages come back as a flat list, one per completion.
"""

from __future__ import annotations

import math

import torch

NAN = float("nan")


def _groups(rewards, num_generations):
    values = [float(r) for r in rewards]
    return [values[i : i + num_generations] for i in range(0, len(values), num_generations)]


def _scorable(values):
    return [v for v in values if not math.isnan(v)]


def _mean(values):
    return sum(values) / len(values)


def _std(values):
    """Bessel-corrected; NaN for fewer than two values."""
    if len(values) < 2:
        return NAN
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _scale(advantages, rewards, num_generations, scale, eps):
    """Divide by the std scale_rewards names: group (per prompt), batch (all scorable rewards), none."""
    if scale == "none":
        return advantages
    groups = _groups(rewards, num_generations)
    out = []
    for g, group in enumerate(groups):
        std = _std(_scorable(group)) if scale == "group" else _std(_scorable([r for grp in groups for r in grp]))
        for a in advantages[g * num_generations : (g + 1) * num_generations]:
            out.append(0.0 if math.isnan(std) or a == 0 else a / (std + eps))
    return out


def rloo(rewards, num_generations, scale="none", eps=1e-4):
    """A_i = r_i - mean of the other scorable rewards of its group (Ahmadian et al. 2024, eq. for RLOO)."""
    out = []
    for group in _groups(rewards, num_generations):
        scorable = _scorable(group)
        for r in group:
            if math.isnan(r) or len(scorable) < 2:
                out.append(0.0)
            else:
                others = list(scorable)
                others.remove(r)
                out.append(r - _mean(others))
    return _scale(out, rewards, num_generations, scale, eps)


def _whiten(values, lengths):
    """(v - mu) / sqrt(var + 1e-8), mu and the unbiased var over tokens (each value counted once per token)."""
    tokens = [v for v, n in zip(values, lengths, strict=True) if not math.isnan(v) for _ in range(int(n))]
    if len(tokens) < 2:
        return [0.0] * len(values)
    mu = _mean(tokens)
    var = sum((t - mu) ** 2 for t in tokens) / (len(tokens) - 1)
    return [
        0.0 if math.isnan(v) or n == 0 else (v - mu) / math.sqrt(var + 1e-8)
        for v, n in zip(values, lengths, strict=True)
    ]


def reinforce_plus_plus(rewards, lengths):
    """REINFORCE++ (Hu 2025, eq. 5 with gamma = 1): the outcome return at every token, whitened over the batch."""
    return _whiten([float(r) for r in rewards], lengths)


def reinforce_plus_plus_baseline(rewards, num_generations, lengths):
    """REINFORCE++-baseline: r_i - mean_group(r), then whitened over the batch's tokens."""
    centered = []
    for group in _groups(rewards, num_generations):
        scorable = _scorable(group)
        centered += [NAN if math.isnan(r) else r - _mean(scorable) for r in group]
    return _whiten(centered, lengths)


def grpo_passk(rewards, num_generations, scale="none", eps=1e-4):
    """Pass@k training (Chen et al. 2025): the group's best completion gets r_max - r_second, the others 0."""
    out = []
    for group in _groups(rewards, num_generations):
        advantages = [0.0] * len(group)
        ranked = sorted((r, i) for i, r in enumerate(group) if not math.isnan(r))
        if len(ranked) >= 2:
            best_value, second_value = ranked[-1][0], ranked[-2][0]
            best = min(i for r, i in ranked if r == best_value)
            advantages[best] = best_value - second_value
        out += advantages
    return _scale(out, rewards, num_generations, scale, eps)


def opo(rewards, num_generations, lengths, scale="none", eps=1e-4):
    """OPO (Hao et al. 2025): b = sum_j |o_j| r_j / sum_j |o_j| over the group; A_i = r_i - b."""
    out = []
    for g, group in enumerate(_groups(rewards, num_generations)):
        group_lengths = lengths[g * num_generations : (g + 1) * num_generations]
        pairs = [(r, n) for r, n in zip(group, group_lengths, strict=True) if not math.isnan(r)]
        total = sum(n for _, n in pairs)
        baseline = sum(r * n for r, n in pairs) / total if total else NAN
        out += [
            0.0 if math.isnan(r) or n == 0 or not total else r - baseline
            for r, n in zip(group, group_lengths, strict=True)
        ]
    return _scale(out, rewards, num_generations, scale, eps)


def gpg(rewards, num_generations, scale="none", eps=1e-4):
    """GPG as verl computes it: alpha = B / #(r != 0) over the batch's scorable rewards; A_i = alpha (r_i - mean_g)."""
    scorable = [float(r) for r in rewards if not math.isnan(float(r))]
    alpha = len(scorable) / max(1, sum(1 for r in scorable if r != 0))
    out = []
    for group in _groups(rewards, num_generations):
        kept = _scorable(group)
        out += [0.0 if math.isnan(r) or len(kept) < 2 else alpha * (r - _mean(kept)) for r in group]
    return _scale(out, rewards, num_generations, scale, eps)


def remax(rewards, num_generations, baselines, scale="none", eps=1e-4):
    """ReMax (Li et al. 2024): A_i = r_i - r(greedy completion of its prompt)."""
    out = []
    for g, group in enumerate(_groups(rewards, num_generations)):
        b = float(baselines[g])
        out += [0.0 if math.isnan(r) or math.isnan(b) else r - b for r in group]
    return _scale(out, rewards, num_generations, scale, eps)


# ---- policy losses: per-token loss l[i][t] (a torch scalar, so autograd gives the oracle's gradient) ----------------


def aggregate(per_token, mask, loss_type):
    """grpo: mean over sequences of the token mean; dapo: token mean over the batch (one process, one step)."""
    rows = [[per_token[i][t] for t in range(len(mask[i])) if mask[i][t]] for i in range(len(mask))]
    if loss_type == "grpo":
        return sum(sum(row) / max(1, len(row)) for row in rows) / len(rows)
    tokens = [x for row in rows for x in row]
    return sum(tokens) / max(1, len(tokens))


def gmpo(logps, old_logps, advantages, mask, epsilon, epsilon_high):
    """GMPO (Zhao et al. 2025): l_i = -A_i (prod_t clip-min ratio_t)^(1/|o_i|): for A > 0 a token's log-ratio is capped
    at epsilon_high, for A < 0 floored at -epsilon (the side that limits the update), then the geometric mean."""
    out = []
    for i in range(len(mask)):
        tokens = [t for t in range(len(mask[i])) if mask[i][t]]
        a = advantages[i]
        if not tokens:
            out.append([torch.zeros((), dtype=logps.dtype)] * len(mask[i]))
            continue
        clipped = []
        for t in tokens:
            d = logps[i, t] - old_logps[i, t]
            clipped.append(
                torch.clamp(d, max=epsilon_high) if a > 0 else torch.clamp(d, min=-epsilon) if a < 0 else 0 * d
            )
        ratio = torch.exp(sum(clipped) / len(tokens))
        out.append([-a * ratio] * len(mask[i]))
    return out


def gpg_loss(logps, advantages, mask):
    """GPG: l = -A logp."""
    return [[-advantages[i] * logps[i, t] for t in range(len(mask[i]))] for i in range(len(mask))]


def kl_cov(logps, old_logps, advantages, mask, ratio, coef):
    """KL-Cov (Cui et al. 2025): l = -A w; the k = max(1, floor(n ratio)) tokens of largest
    cov = (A - mean A)(logp - mean logp) over the n loss tokens get + coef |logp - old_logp|."""
    valid = [(i, t) for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t]]
    mean_a = sum(float(advantages[i]) for i, _ in valid) / len(valid)
    mean_l = sum(float(logps[i, t].detach()) for i, t in valid) / len(valid)
    cov = {(i, t): (float(advantages[i]) - mean_a) * (float(logps[i, t].detach()) - mean_l) for i, t in valid}
    k = max(1, int(len(valid) * ratio))
    chosen = set(sorted(valid, key=lambda p: cov[p], reverse=True)[:k])
    out = []
    for i in range(len(mask)):
        row = []
        for t in range(len(mask[i])):
            w = torch.exp(logps[i, t] - old_logps[i, t])
            loss = -advantages[i] * w
            if (i, t) in chosen:
                loss = loss + coef * (logps[i, t] - old_logps[i, t]).abs()
            row.append(loss)
        out.append(row)
    return out, chosen


def clip_cov_candidates(logps, old_logps, advantages, mask, epsilon, epsilon_high, lb, ub):
    """Clip-Cov (Cui et al. 2025): the tokens whose gradient may be cut: loss tokens the ratio clip leaves alone, with
    cov = (A - mean A)(logp - mean logp) strictly inside (lb, ub); and how many are cut, max(1, floor(r n))."""
    valid = [(i, t) for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t]]
    mean_a = sum(float(advantages[i]) for i, _ in valid) / len(valid)
    mean_l = sum(float(logps[i, t].detach()) for i, t in valid) / len(valid)
    candidates = set()
    for i, t in valid:
        w = math.exp(float((logps[i, t] - old_logps[i, t]).detach()))
        a = float(advantages[i])
        ratio_clipped = -a * min(max(w, 1 - epsilon), 1 + epsilon_high) > -a * w
        cov = (a - mean_a) * (float(logps[i, t].detach()) - mean_l)
        if not ratio_clipped and lb < cov < ub:
            candidates.add((i, t))
    return candidates, len(valid)


def ppo_clip(logps, old_logps, advantages, mask, epsilon, epsilon_high):
    """PPO: l = -min(w A, clip(w, 1 - eps, 1 + eps_high) A)."""
    out = []
    for i in range(len(mask)):
        row = []
        for t in range(len(mask[i])):
            w = torch.exp(logps[i, t] - old_logps[i, t])
            a = advantages[i]
            row.append(-torch.min(w * a, torch.clamp(w, 1 - epsilon, 1 + epsilon_high) * a))
        out.append(row)
    return out


# ---- KL estimators (Schulman, "Approximating KL divergence"), per token --------------------------------------------


def kl(name, logp, ref):
    """The estimator's value for one token; logp, ref floats."""
    d = logp - ref  # log(pi / pi_ref)
    if name == "k1":
        return d
    if name == "k2":
        return d * d / 2
    if name == "k3":
        return math.exp(-d) + d - 1  # r - log r - 1 with r = pi_ref / pi
    if name == "abs":
        return abs(d)
    if name == "low_var_kl":
        x = min(max(-d, -20.0), 20.0)
        return min(max(math.exp(x) - x - 1, -10.0), 10.0)
    raise KeyError(name)


def adaptive_kl(beta, target, horizon, steps):
    """PPO's adaptive coefficient (Ziegler et al. 2019, section 2.2): e = clip(KL / target - 1, -0.2, 0.2),
    beta <- beta (1 + e n / horizon) after each step of n samples; `steps`: [(KL, n), ...]; every beta after a step."""
    values = []
    for current, n in steps:
        error = min(max(current / target - 1, -0.2), 0.2)
        beta = beta * (1 + error * n / horizon)
        values.append(beta)
    return values


# ---- verl's rollout correction, from docs/algo/rollout_corr.md ------------------------------------------------------
# Conventions the docs leave open, as verl's code has them: a row without tokens has mean log-prob 0 (perplexity 1) and
# IS row-mean 0; the sequence-level IS extremes and threshold shares count every row; the final
# rollout_rs_seq_masked_fraction divides by every row; a two-sided (k1) threshold given as one value u means 1/u_u.

BOUND = 20.0


def _clip(x):
    return min(max(x, -BOUND), BOUND)


def _avg(values):
    return sum(values) / len(values) if values else 0.0


def _sample_std(values):
    return _std(values) if len(values) > 1 else 0.0


def _spread(values):
    """sqrt(max(E[v^2] - E[v]^2, 0)) (population), 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    return math.sqrt(max(_avg([v * v for v in values]) - _avg(values) ** 2, 0.0))


def _row_stats(prefix, rows, upper, lower, ideal):
    stats = {
        f"{prefix}_mean": _avg(rows),
        f"{prefix}_std": _sample_std(rows),
        f"{prefix}_max": max(rows),
        f"{prefix}_min": min(rows),
        f"{prefix}_max_deviation": max(abs(v - ideal) for v in rows),
        f"{prefix}_fraction_high": _avg([float(v > upper) for v in rows]),
    }
    if lower is not None:
        stats[f"{prefix}_fraction_low"] = _avg([float(v < lower) for v in rows])
    return stats


def _is_weights(log_ratio, tokens, level, threshold, normalize):
    """Stage 1-4 of the docs' "How IS weights are processed", with the IS metrics (taken before truncation)."""
    rows = range(len(log_ratio))
    sums = [sum(log_ratio[i][t] for t in tokens[i]) for i in rows]
    raw = [{t: math.exp(_clip(log_ratio[i][t] if level == "token" else sums[i])) for t in tokens[i]} for i in rows]
    flat = [w for row in raw for w in row.values()]
    lower = 1.0 / threshold
    metrics = {"rollout_is_mean": _avg(flat)}
    if level == "sequence":  # from the log-space sums, over every row
        metrics["rollout_is_max"] = math.exp(min(max(sums), BOUND))
        metrics["rollout_is_min"] = math.exp(min(sums))
        metrics["rollout_is_ratio_fraction_high"] = _avg([float(s > math.log(threshold)) for s in sums])
        metrics["rollout_is_ratio_fraction_low"] = _avg([float(s < math.log(lower)) for s in sums])
    else:
        metrics["rollout_is_max"], metrics["rollout_is_min"] = max(flat), min(flat)
        metrics["rollout_is_ratio_fraction_high"] = _avg([float(w > threshold) for w in flat])
        metrics["rollout_is_ratio_fraction_low"] = _avg([float(w < lower) for w in flat])
    clamped = [min(max(w, lower), threshold) for w in flat]
    metrics["rollout_is_std"] = _spread(clamped)
    mean_clamped = _avg(clamped)
    metrics["rollout_is_eff_sample_size"] = 1.0 / _avg([(c / mean_clamped) ** 2 for c in clamped])
    row_means = [_avg(list(row.values())) for row in raw]
    metrics.update(_row_stats("rollout_is_seq", row_means, threshold, lower, 1.0))
    weights = [{t: min(w, threshold) for t, w in row.items()} for row in raw]
    if normalize:
        if level == "token":
            mean = _avg([w for row in weights for w in row.values()])
        else:
            mean = _avg([_avg(list(row.values())) for row in weights if row])
        factor = mean if mean > 1e-8 else 1.0
        weights = [{t: w / factor for t, w in row.items()} for row in weights]
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _divergence(kind, x):
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[kind]


def _thresholds(names, spec):
    entries = [part.strip() for part in str(spec).split(",") if part.strip()]
    entries = entries * len(names) if len(entries) == 1 else entries
    bounds = {}
    for name, entry in zip(names, entries, strict=True):
        if name.endswith("k1"):
            low, high = (float(v) for v in entry.split("_")) if "_" in entry else (1.0 / float(entry), float(entry))
            bounds[name] = (math.log(low), math.log(high))
        else:
            bounds[name] = (None, float(entry))
    return bounds


def _rejection(log_ratio, tokens, rollout_rs, spec):
    """Every criterion of `rollout_rs` must pass; per token, or one verdict per sequence of its sum / mean / max."""
    names = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    bounds = _thresholds(names, spec)
    rows = range(len(log_ratio))
    with_tokens = [i for i in rows if tokens[i]]
    rejected_by_any = [set() for _ in rows]
    metrics = {}
    for name in names:
        aggregation, kind = name.rsplit("_", 1)
        lower, upper = bounds[name]
        per_token = [{t: _divergence(kind, _clip(log_ratio[i][t])) for t in tokens[i]} for i in rows]
        if aggregation == "token":
            stat = per_token
            row_values = [_avg(list(stat[i].values())) for i in with_tokens]
        else:
            reduce = {"seq_sum": sum, "seq_mean": _avg, "seq_max": lambda v: max(v) if v else 0.0}[aggregation]
            per_row = [reduce(list(per_token[i].values())) for i in rows]
            stat = [{t: per_row[i] for t in tokens[i]} for i in rows]
            row_values = [per_row[i] for i in with_tokens]

        def outside(v, lower=lower, upper=upper):
            return v > upper or (lower is not None and v < lower)

        rejected = [{t for t, v in stat[i].items() if outside(v)} for i in rows]
        values = [v for row in stat for v in row.values()]
        prefix = f"rollout_rs_{name}"
        metrics[f"{prefix}_mean"] = _avg(values)
        compared = values if aggregation == "token" else row_values
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = max(compared), min(compared)
        metrics[f"{prefix}_fraction_high"] = _avg([float(v > upper) for v in compared])
        metrics[f"{prefix}_fraction_low"] = 0.0 if lower is None else _avg([float(v < lower) for v in compared])
        low_clamp = 0.0 if lower is None else lower
        metrics[f"{prefix}_std"] = _spread([min(max(v, low_clamp), upper) for v in values])
        metrics.update(_row_stats(f"{prefix}_seq", row_values, upper, lower, 0.0))
        metrics[f"{prefix}_masked_fraction"] = sum(len(r) for r in rejected) / len(values)
        metrics[f"{prefix}_seq_masked_fraction"] = _avg([float(bool(rejected[i])) for i in with_tokens])
        for i in rows:
            rejected_by_any[i] |= rejected[i]
    total = sum(len(t) for t in tokens)
    metrics["rollout_rs_masked_fraction"] = sum(len(r) for r in rejected_by_any) / total
    metrics["rollout_rs_seq_masked_fraction"] = _avg([float(bool(r)) for r in rejected_by_any])
    return rejected_by_any, metrics


def _mismatch(old, rollout, tokens):
    """The off-policy metrics: KL(rollout || old), k3, perplexities, log-perplexity gaps, chi^2 (token, sequence)."""
    rows = range(len(old))
    old_mean = [_avg([old[i][t] for t in tokens[i]]) for i in rows]
    rollout_mean = [_avg([rollout[i][t] for t in tokens[i]]) for i in rows]
    log_ratio = [(old[i][t] - rollout[i][t], i) for i in rows for t in tokens[i]]
    gaps = [r - o for r, o in zip(rollout_mean, old_mean, strict=True)]
    return {
        "training_ppl": _avg([math.exp(-m) for m in old_mean]),
        "training_log_ppl": _avg([-m for m in old_mean]),
        "kl": _avg([-x for x, _ in log_ratio]),
        "k3_kl": _avg([math.exp(x) - x - 1 for x, _ in log_ratio]),
        "rollout_ppl": _avg([math.exp(-m) for m in rollout_mean]),
        "rollout_log_ppl": _avg([-m for m in rollout_mean]),
        "log_ppl_diff": _avg(gaps),
        "log_ppl_abs_diff": _avg([abs(g) for g in gaps]),
        "log_ppl_diff_max": max(gaps),
        "log_ppl_diff_min": min(gaps),
        "ppl_ratio": _avg([math.exp(g) for g in gaps]),
        "chi2_token": _avg([math.exp(_clip(x)) ** 2 for x, _ in log_ratio]) - 1.0,
        "chi2_seq": _avg([math.exp(2 * _clip(sum(x for x, j in log_ratio if j == i))) for i in rows]) - 1.0,
    }


def rollout_correction(
    old, rollout, mask, rollout_is=None, threshold=2.0, normalize=False, rollout_rs=None, spec=None
):
    """(IS weights as lists or None, the mask after rejection as lists, metrics prefixed rollout_corr/), from lists."""
    tokens = [[t for t, m in enumerate(row) if m] for row in mask]
    log_ratio = [[o - r for o, r in zip(o_row, r_row, strict=True)] for o_row, r_row in zip(old, rollout, strict=True)]
    metrics, weights = {}, None
    if rollout_is is not None:
        by_token, is_metrics = _is_weights(log_ratio, tokens, rollout_is, threshold, normalize)
        weights = [[row.get(t, 0.0) for t in range(len(mask[0]))] for row in by_token]
        metrics.update(is_metrics)
    kept = [list(map(int, row)) for row in mask]
    if rollout_rs is not None:
        rejected, rs_metrics = _rejection(log_ratio, tokens, rollout_rs, spec)
        kept = [[0 if t in rejected[i] else m for t, m in enumerate(row)] for i, row in enumerate(kept)]
        metrics.update(rs_metrics)
    metrics.update(_mismatch(old, rollout, tokens))
    return weights, kept, {f"rollout_corr/{name}": value for name, value in metrics.items()}
