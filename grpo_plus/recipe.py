"""Old path of `grpo_plus.app.recipe`, kept for `from grpo_plus.recipe import ...` in copies of the recipes.

Importing it gives the module `grpo_plus.app.recipe` itself (not a copy), so monkeypatching and private names work.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("grpo_plus.app.recipe")
