"""Tandem engine."""
