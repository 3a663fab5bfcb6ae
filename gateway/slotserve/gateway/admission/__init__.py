"""Admission: who gets an engine slot and when (the front, its ledger and recovery, the shared
backends and their Lua scripts, drain, fair share, tenants and their quotas)."""
