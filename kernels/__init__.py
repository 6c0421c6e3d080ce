"""Attention kernels for specjax, installed as ``specjax.kernels``.

Each kernel lives beside its plain-``jnp`` reference, which is the definition of what the kernel
computes and what runs wherever the kernel cannot (CPU, unsupported shapes). This package
imports nothing from the rest of specjax, so the kernels can be tested and reused on their own.

It is a top-level folder of the repository but never a top-level import named ``kernels``:
transformers probes for a PyPI distribution of that name at import time, and a foreign
``kernels`` module on the path would be imported by it.
"""
