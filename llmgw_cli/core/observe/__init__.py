"""What the nodes are and how their replicas fare, read from what they print: the probe's
parsers, the frozen facts, GPU classes and fabrics, a replica's health from systemd's
view, and the engines' journal as an operator reads it. Text in, facts out.
"""
