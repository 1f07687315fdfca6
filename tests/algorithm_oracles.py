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
