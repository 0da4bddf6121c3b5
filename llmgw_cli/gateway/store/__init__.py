"""What the gateway processes of one cluster share, kept in SQLite (one host: ``sqlite``,
which also declares the ``Store`` protocol and opens the configured store) or
PostgreSQL (several hosts: ``postgres``), the values both write, and the usage totals
counted in memory and written to the store in batches.
"""
