"""Ranges and bounds of everything that reaches an agent from the wire."""
