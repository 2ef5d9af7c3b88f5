"""Tandem kernels."""
