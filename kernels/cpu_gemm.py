"""Small-batch float32 matrix products on x86-64 CPUs: an XLA FFI custom call (``cpu_gemm.cc``).

A verify pass multiplies the few rows of a draft (2-64 tree nodes or block positions, times the
batch) by every weight matrix of the target. On XLA:CPU a product of 2-64 rows streams the
weights at about half the speed of the one-row product, so a 2-node pass of SmolLM2-135M cost
about 1.6 plain decoding steps and a 16-node pass about 2.5 (``specjax calibrate``, the README's
performance notes), whatever the drafter. The kernel
reads each weight row once for all rows, with register tiles and XLA's intra-op threads
(``cpu_gemm.cc`` says how).

``gemm_nt(x, w)`` computes ``x @ w.T`` for ``x`` [M, K] float32 and ``w`` [N, K] (the weight
stored one row per output, the layout of :mod:`specjax.io.layout`'s one-row copies and of a
tied head's embedding table), float32 or bfloat16. Bfloat16 weights are widened to float32
exactly as they are loaded: the product equals the float32 product of the widened weights bit
for bit and streams half the bytes (a drafter's copies of bfloat16 checkpoint weights).
``gemm_nt_reference`` is the definition and what runs where the kernel cannot: another backend
(the choice is made at lowering, per platform), another CPU, no C++ compiler, or
``SPECJAX_CPU_GEMM=0``. Every output element is computed in the same order wherever it falls,
so a row's result never depends on the rows beside it: row i of an M-row product equals the
one-row product of row i, bit for bit.

The library is compiled on first use with the system's C++ compiler (``$CXX``, else ``g++``;
about 5 seconds) against the XLA FFI headers that jaxlib ships, and kept under
``$SPECJAX_CACHE_DIR/kernels`` (default ``~/.cache/specjax/kernels``), named by a digest of the
source, the flags and the jaxlib version; a file lock keeps concurrent processes from building
it twice.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

TARGET = "specjax_gemm_nt"  # float32 weights; TARGET + "_bf16" takes bfloat16 ones
SOURCE = Path(__file__).with_name("cpu_gemm.cc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build_dir() -> Path:
    """Where built libraries are kept (the rule of :func:`specjax.io.gguf.cache_dir`, which
    this package cannot import)."""
    if os.environ.get("SPECJAX_CACHE_DIR"):
        root = Path(os.environ["SPECJAX_CACHE_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]) / "specjax"
    else:
        root = Path.home() / ".cache" / "specjax"
    return root / "kernels"


def compiler() -> list[str]:
    """The C++ compiler command: ``$CXX`` split as a shell would (``ccache g++`` works), else
    ``g++``."""
    return shlex.split(os.environ.get("CXX") or "g++")


def _build() -> Path:
    """Compiles ``cpu_gemm.cc`` unless a build of this source and toolchain is kept; returns
    the library's path.

    Raises:
      RuntimeError: the compiler failed or ran for more than two minutes (its message
        included).
    """
    import filelock
    import jaxlib

    cxx = compiler()
    include = jax.ffi.include_dir()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(
        (*cxx, *FLAGS, jaxlib.__version__, platform.machine())).encode()).hexdigest()[:16]
    out = _build_dir() / f"cpu_gemm-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(out) + ".lock"):
        if out.exists():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [*cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n"
                                   f"{proc.stderr[-2000:]}")
            os.replace(tmp, out)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"building {SOURCE.name} took over {e.timeout} s") from e
        finally:
            tmp.unlink(missing_ok=True)
    return out


@functools.cache
def available() -> bool:
    """Whether :func:`gemm_nt` runs the kernel: JAX's default backend is the CPU, an x86-64
    Linux CPU with AVX2 and FMA, a C++ compiler (:func:`compiler`), a successful build and
    registration, and ``SPECJAX_CPU_GEMM`` not ``0``.

    Read once per process; a failed build warns once and the reference runs instead.
    """
    if os.environ.get("SPECJAX_CPU_GEMM", "1") == "0" or jax.default_backend() != "cpu":
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not {"avx2", "fma"} <= _cpu_flags():
        return False
    if shutil.which(compiler()[0]) is None:
        warnings.warn(f"the CPU matrix-product kernel needs a C++ compiler ({compiler()[0]} "
                      "not found; set $CXX), using XLA's product", stacklevel=2)
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SpecjaxGemmNT),
                                    platform="cpu")
        jax.ffi.register_ffi_target(f"{TARGET}_bf16",
                                    jax.ffi.pycapsule(library.SpecjaxGemmNTBF16), platform="cpu")
    except Exception as e:  # noqa: BLE001 -- any failure leaves XLA's product in place
        warnings.warn(f"the CPU matrix-product kernel is unavailable, using XLA's ({e})",
                      stacklevel=2)
        return False
    return True


def gemm_nt_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x`` [M, K] times ``w`` [N, K] (widened to float32) transposed: [M, N] float32, XLA's
    product."""
    return jnp.einsum("mk,nk->mn", x, w.astype(jnp.float32), preferred_element_type=jnp.float32)


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    target = TARGET if w.dtype == jnp.float32 else f"{TARGET}_bf16"
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)


@jax.custom_vjp
def gemm_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x`` [M, K] float32 times ``w`` [N, K] float32 or bfloat16 transposed: [M, N] float32.

    On CPU where :func:`available`, the kernel (module docstring); elsewhere, and on other
    backends, :func:`gemm_nt_reference`. Differentiable (the gradients are XLA's products, the
    weights' in their dtype).

    Raises:
      ValueError: not two matrices with the same K, ``x`` float32 and ``w`` float32 or
        bfloat16.
    """
    if (x.ndim, w.ndim) != (2, 2) or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_nt expects x [M, K] and w [N, K], got {x.shape} and {w.shape}")
    if x.dtype != jnp.float32 or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"gemm_nt takes x float32 and w float32 or bfloat16, got {x.dtype} "
                         f"and {w.dtype}")
    if not available():
        return gemm_nt_reference(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_kernel, default=gemm_nt_reference)


def _forward(x, w):
    return gemm_nt(x, w), (x, w)


def _backward(residuals, dy):
    x, w = residuals
    return dy @ w.astype(jnp.float32), (dy.T @ x).astype(w.dtype)


gemm_nt.defvjp(_forward, _backward)
