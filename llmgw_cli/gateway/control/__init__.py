"""What keeps the fleet as the cluster file says: the gateway's live state and its
background work, the model controller, where replicas are learnt from, the fleet's
view, coordination between gateway processes (members, leadership, fencing), the
worker supervisor and what the gateway shares with systemd.
"""
