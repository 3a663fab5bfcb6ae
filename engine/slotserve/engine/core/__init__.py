"""The engine core: scheduler, KV cache, model runner and sampling (no HTTP)."""
