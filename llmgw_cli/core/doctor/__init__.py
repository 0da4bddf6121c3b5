"""`llmgw doctor`: what stops a node from serving, found before a replica fails on it.

Pure: ``collect`` holds the doctor's part of the node script and its parser, ``checks``
turns one node's facts into findings, ``cluster`` the findings that need more than one
node (clock skew) or only the cluster file (gateway timeouts). ``diagnose`` runs them all.
"""

from llmgw_cli.core.doctor.cluster import diagnose
from llmgw_cli.core.doctor.facts import Collected, DoctorFacts, Finding, Severity

__all__ = ["Collected", "DoctorFacts", "Finding", "Severity", "diagnose"]
