"""Tandem engine/models."""
