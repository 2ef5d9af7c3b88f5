"""Tandem router."""
