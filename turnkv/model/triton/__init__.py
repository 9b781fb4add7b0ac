"""Triton kernels for the decoder's own ops (not attention): the skinny matmul of decode's projections
and the fused elementwise steps between them. turnkv/model/ops.py picks them on CUDA and keeps the
torch ops elsewhere; the tests run them on CPU under TRITON_INTERPRET=1 at small shapes."""
