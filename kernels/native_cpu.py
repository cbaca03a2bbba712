"""Native CPU kernels: built from ``kernels/csrc`` with the system C compiler on first use.

The CPU has no Triton; where plain torch must copy data around (the paged decode attention's
K/V gather), a small C kernel reads it in place. The shared object is compiled once per
(source, compiler, CPU) into a cache directory, with ``-march=native`` because it is built
on the machine that runs it, and loaded with ctypes (which releases the GIL during calls).

Choice of implementation (``TIDEGATE_KERNELS``, see ``kernels.dispatch``): ``auto`` uses
them where they build, else the plain-torch reference (one warning); ``reference`` and
``triton`` never build them; ``native`` makes a failed build an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels.dispatch import kernel_mode

log = logging.getLogger("tidegate.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_decode_cpu.c", CSRC / "linear_cpu.c")  # one shared object
# fast-math's parts let the compiler vectorize the reductions (the kernel never sees inf or
# NaN by construction: its exp clamps, its max starts from a real score). Not -ffast-math
# itself: with it, GCC links crtfastmath.o into the shared object, whose loading turns on
# flush-to-zero for the whole process (every subnormal then reads as 0, in torch too).
FAST_MATH = ["-fno-math-errno", "-fno-trapping-math", "-ffinite-math-only", "-fno-signed-zeros",
             "-fassociative-math", "-freciprocal-math"]
FLAGS = ["-O3", "-march=native", *FAST_MATH, "-fopenmp", "-fPIC", "-shared", "-std=c11",
         # 512-bit vectors where the CPU has them (compilers default to 256 on AVX-512 parts).
         *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else [])]


class NativeBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    explicit = os.environ.get("TIDEGATE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tidegate" / "kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    lines = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in wanted]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NativeBuildError("no C compiler (cc or gcc) on the PATH")
    return cc


def build(sources: tuple[Path, ...] = SOURCES) -> Path:
    """Compile ``sources`` into one shared object unless a build for these sources, compiler
    and CPU is cached."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"{cc} --version failed: {exc}") from exc
    key = hashlib.sha256("\0".join(
        [*(src.read_text() for src in sources), " ".join(FLAGS), version, _cpu_identity()]
    ).encode()).hexdigest()[:16]
    target = cache_dir() / f"tidegate-cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, *map(str, sources), "-o", tmp], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            names = ", ".join(src.name for src in sources)
            raise NativeBuildError(f"{cc} failed on {names}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class NativeCpuKernels:
    """The loaded shared object with typed entry points."""

    def __init__(self, path: Path) -> None:
        # torch is imported first, so its OpenMP runtime (soname libgomp.so.1) is the one the
        # library binds to: one thread pool for torch and these kernels.
        self.lib = ctypes.CDLL(str(path))
        fn = self.lib.tidegate_paged_decode_f32
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._paged_decode = fn
        fn = self.lib.tidegate_skinny_linear_f32
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_int]
        fn.restype = None
        self._skinny_linear = fn

    def skinny_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight[N, K].T -> [M, N] for few rows (decode steps); float32 CPU."""
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
        for name, t in (("x", x), ("weight", weight)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if x.stride(1) != 1:
            x = x.contiguous()
        weight = weight.contiguous()  # a no-op for model weights
        m, k = x.shape
        out = torch.empty(m, weight.shape[0], dtype=torch.float32)
        if m:
            self._skinny_linear(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m,
                                weight.shape[0], k, x.stride(0), out.stride(0),
                                torch.get_num_threads())
        return out

    def paged_decode(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """Decode attention over the paged cache -> [B, Hq, D]; see the C source for layouts."""
        b, hq, d = q.shape
        _, block_size, hk, dk = key_cache.shape
        for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if dk != d or hq % hk or value_cache.shape != key_cache.shape:
            raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(key_cache.shape)}")
        if block_tables.shape[0] != b or seq_lens.shape != (b,):
            raise ValueError("block_tables and seq_lens need one row per query")
        q = q.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("caches must be contiguous")
        out = torch.empty_like(q)
        rc = self._paged_decode(
            q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), b, hq, hk, d, block_size, tables.shape[1],
            float(scale), torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its scratch memory")
        return out


_lock = threading.Lock()
_loaded: dict[str, NativeCpuKernels | None] = {}


def native_kernels() -> NativeCpuKernels | None:
    """The native kernels if ``TIDEGATE_KERNELS`` allows them and they build, else None."""
    mode = kernel_mode()
    if mode in ("reference", "triton"):
        return None
    with _lock:
        if "lib" not in _loaded:
            try:
                _loaded["lib"] = NativeCpuKernels(build())
            except (NativeBuildError, OSError) as exc:
                if mode == "native":
                    raise
                log.warning("native CPU kernels unavailable, using plain torch: %s", exc)
                _loaded["lib"] = None
        lib = _loaded["lib"]
    if lib is None and mode == "native":
        raise NativeBuildError("native CPU kernels are unavailable (see the earlier warning)")
    return lib


def native_decode_applies(q: torch.Tensor) -> bool:
    """Whether the native decode kernel serves this query (float32 on the CPU)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and native_kernels() is not None
