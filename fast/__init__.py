"""Optimized Triton / CUDA-stream versions with the same public API as ref/ (each file stands alone)."""
