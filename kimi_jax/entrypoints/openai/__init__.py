"""The OpenAI-compatible server: protocol (requests, response bodies), server (aiohttp), metrics."""
