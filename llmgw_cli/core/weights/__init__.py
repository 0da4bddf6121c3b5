"""Which weights go where and from whom: repository snapshots and their pinned commits,
the fetch plan across nodes and peers, path sources checked in place, and a fetch's
progress as one line of text.
"""
