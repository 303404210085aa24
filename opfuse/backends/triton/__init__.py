"""Triton backend: kernels rendered as @triton.jit functions (GPU, or the CPU interpreter
with TRITON_INTERPRET=1). Imports triton lazily: the package works without it."""
