"""Tests of tidegate.kernels.cpu."""
