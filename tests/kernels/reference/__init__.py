"""Tests of tidegate.kernels.reference."""
