"""Pools: what the gateway serves, where their engines are, and how loaded each one is."""
