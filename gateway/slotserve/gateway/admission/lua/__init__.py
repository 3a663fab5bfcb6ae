"""The Lua scripts of the Redis backends: admission's check-then-act steps and the tenant quotas."""
