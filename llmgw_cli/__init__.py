"""llmgw: run a catalog of LLMs on your own GPU servers over SSH and systemd."""

__version__ = "0.1.0"
