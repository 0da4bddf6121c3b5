"""What answers clients: the listeners and their signals (``server``), the OpenAI API
(authenticate, admit, route, relay, meter), the engines' HTTP client, request bodies,
answer streams, OpenAI-format errors, the access log, and the admin pages with the
metrics they and ``/metrics`` export (``admin``, ``metrics``, ``recent``: they serve a
listener and only read what control/ and store/ keep).
"""
