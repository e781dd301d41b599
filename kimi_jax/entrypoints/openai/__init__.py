"""The OpenAI-compatible server: protocol (request parsing, response bodies), server (aiohttp),
metrics."""
