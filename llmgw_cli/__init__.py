"""llmgw: run a catalog of LLMs on your own GPU servers over SSH and systemd."""

import warnings

# cryptography 51 deprecates DSA, and asyncssh (which still offers DSA keys) touches it when
# imported: without this every command would print that warning, which is not llmgw's.
warnings.filterwarnings("ignore", message="DSA is deprecated", category=UserWarning)

__version__ = "0.1.0"
