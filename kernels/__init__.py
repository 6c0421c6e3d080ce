"""Kernels for specjax, installed as ``specjax.kernels``: tree attention and KV injection in
Pallas for NVIDIA GPUs, and a small-batch matrix product for x86-64 CPUs (``cpu_gemm``, an XLA
FFI custom call compiled on first use).

Each kernel lives beside its plain-``jnp`` reference, which is the definition of what the kernel
computes and what runs wherever the kernel cannot (another backend, unsupported shapes). This
package imports nothing from the rest of specjax, so the kernels can be tested and reused on
their own.

It is a top-level folder of the repository but never a top-level import named ``kernels``:
transformers probes for a PyPI distribution of that name at import time, and a foreign
``kernels`` module on the path would be imported by it.
"""
