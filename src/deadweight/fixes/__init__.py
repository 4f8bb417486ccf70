"""Fixes deadweight ships: weight-decay groups by meaning, and pinning a parameter safely."""
