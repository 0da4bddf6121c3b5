"""The cluster file: its frozen model (``spec``), the checked strings, durations and
sizes it is written with, the loader that locates every problem at its line, the
checks across its objects, and the reference and JSON Schema generated from it.
What a file means is decided here and nowhere else.
"""
