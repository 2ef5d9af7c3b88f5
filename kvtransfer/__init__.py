"""Tandem kvtransfer."""
