"""A run from start to end: what a resume needs (state, checkpoints, crashes), the training-health guard, the inputs
and launch checked before step 1.
"""
