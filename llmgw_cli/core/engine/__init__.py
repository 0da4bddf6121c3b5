"""What a replica runs: engine command lines and their systemd units, the flags each
engine version accepts (tables in ``engine_flags/``, package data) and the plan's check
against them, the engine programs and secrets a unit needs, the rendered templates and
``llmgw render commands``.
"""
