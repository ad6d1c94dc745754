"""Integrations with training frameworks: callbacks that write format-v1 runs as training goes."""
