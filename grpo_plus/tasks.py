"""Old path of `grpo_plus.app.tasks`, kept for the README's `grpo_plus.tasks`.

Importing it gives the module `grpo_plus.app.tasks` itself (not a copy), so monkeypatching and private names work.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("grpo_plus.app.tasks")
