"""Metric declarations, one module per layer."""
