"""Old path of `grpo_plus.app.hub`, kept for `from grpo_plus.hub import push_adapter` and the rest of its public names.

Importing it gives the module `grpo_plus.app.hub` itself (not a copy), so monkeypatching and private names work.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("grpo_plus.app.hub")
