"""Shared test helpers: the counting splitting op and the toy models."""
