"""Tandem decode."""
