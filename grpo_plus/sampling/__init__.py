"""Which prompts a generation batch holds: DAPO dynamic sampling (informative groups, refill rounds) and selective
rollout (GRESO: skip prompts predicted to teach nothing).
"""
