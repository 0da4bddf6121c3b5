"""The OpenAI-compatible gateway daemon (`llmgw gateway run`): aiohttp server and client."""
