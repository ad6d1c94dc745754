"""Findings: rules that turn metric series into diagnoses (run by rlscope.evaluation)."""
