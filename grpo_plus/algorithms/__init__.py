"""The published algorithms in a trainer: which estimator, policy loss and KL estimator a config names, a round's
advantages, the adaptive KL coefficient, verl's rollout correction of the sampler/trainer mismatch, the loss metrics.
"""
