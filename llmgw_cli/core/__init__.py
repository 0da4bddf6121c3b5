"""The pure core: values in, values out. No sockets, no asyncio, no rich, no logging."""
