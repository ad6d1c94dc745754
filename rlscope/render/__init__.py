"""Renderers: the Report as a terminal report or a JSON document."""
