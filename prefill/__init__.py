"""Tandem prefill."""
