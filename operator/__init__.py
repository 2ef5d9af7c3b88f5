"""Tandem operator."""
