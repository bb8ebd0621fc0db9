"""Triton kernels for the worker; each module imports triton, so import them only where used."""
