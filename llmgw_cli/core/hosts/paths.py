"""Fixed paths and names on the nodes and the gateway hosts.

A module that imports nothing: the command line names these in its options' defaults and
help texts, and builds its commands without loading the rest of the core.
"""

from __future__ import annotations

# A node's engine key, root-only, read by systemd before an engine drops privileges.
ENGINE_ENV_FILE = "/etc/llmgw/engine.env"
ENGINE_KEY_VAR = "LLMGW_ENGINE_KEY"
# The engine keys by node (JSON) beside the installed gateway's files (core/hosts/gateway_install.py).
ENGINE_KEYS_FILE = "/etc/llmgw/gateway/engine-keys.json"
# Where a node that declares no weights folder keeps the weights llmgw fetches.
DEFAULT_WEIGHTS = "/var/lib/llmgw/models"
