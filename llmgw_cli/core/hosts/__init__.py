"""What ``apply`` installs on the hosts beside the replicas, and the rules it keeps there:
the node helper and its access (so the gateway needs no root key), the gateway's own
install and units and whether its account can run it, what a unit's sandbox hides,
root's folders, and the fixed paths they all name.
"""
