"""The demo / app kit: what the recipes, the `grpo-plus` command and the benchmarks use, not what a TRL user imports.

recipe (the recipes' shared steps), tasks (the built-in arithmetic task and its rewards), real_tasks (GSM8K- and
MATH-format data, reasoning-gym tasks, each with its verifier), embedded (the embedded SmolLM2-135M-Instruct), hub
(access check, model card, adapter push, merge), plotting, compare (`grpo-plus compare`), cli (`grpo-plus`) and testing
(tiny local models, rewards and probes that the test suite and the benchmarks share).
The layering rule: this package may import the library (`grpo_plus.*`); the library never imports it.
"""
