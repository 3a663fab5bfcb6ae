"""The engine's OpenAI-compatible HTTP layer over the core."""
