"""The gateway's per-request rules, pure so they are tested with plain numbers: which
replica gets a request, the checks on an API key, and the secrets taken out of text
before it leaves the gateway.
"""
