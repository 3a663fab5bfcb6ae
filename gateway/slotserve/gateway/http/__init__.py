"""The gateway's HTTP layer: the app, its endpoints, the proxy to the engines and its limits."""
