"""The OpenAI-compatible chat endpoint: agents' requests stitched into token-exact episodes (server.py)."""
