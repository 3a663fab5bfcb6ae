"""slotserve operator: turns InferencePool objects into engine Deployments (kopf)."""
