"""Tests of tidegate.kernels.gpu."""
