"""Probes measure: they touch the live model and produce plain statistics, no verdicts."""
