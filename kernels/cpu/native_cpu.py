"""Native CPU kernels: built from ``kernels/cpu/csrc`` with the system C compiler on first use.

The CPU has no Triton; where plain torch must copy data around (the paged decode attention's
K/V gather), a small C kernel reads it in place. The shared object is compiled once per
(source, compiler, CPU) into a cache directory, with ``-march=native`` because it is built
on the machine that runs it, and loaded with ctypes (which releases the GIL during calls).

Choice of implementation (``TIDEGATE_KERNELS``, see ``tidegate.kernels.dispatch``): ``auto`` uses
them where they build, else the plain-torch reference (one warning); ``reference`` and
``triton`` never build them; ``native`` makes a failed build an error.
"""

from __future__ import annotations

import ctypes
import fcntl
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

from tidegate.kernels.dispatch import kernel_mode
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import LANES8, LANES8_ROWS, PackedWeight, Part

log = logging.getLogger("tidegate.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_decode_cpu.c", CSRC / "linear_cpu.c",  # one shared object
           CSRC / "packed_linear_cpu.c", CSRC / "q8_linear_cpu.c", CSRC / "elementwise_cpu.c",
           CSRC / "q8_lanes8_cpu.c", CSRC / "decoder_layer_cpu.c")
# fast-math's parts let the compiler vectorize the reductions (the kernel never sees inf or
# NaN by construction: its exp clamps, its max starts from a real score). Not -ffast-math
# itself: with it, GCC links crtfastmath.o into the shared object, whose loading turns on
# flush-to-zero for the whole process (every subnormal then reads as 0, in torch too).
FAST_MATH = ["-fno-math-errno", "-fno-trapping-math", "-ffinite-math-only", "-fno-signed-zeros",
             "-fassociative-math", "-freciprocal-math"]
FLAGS = ["-O3", "-march=native", *FAST_MATH, "-ffp-contract=fast", "-fopenmp", "-fPIC",
         "-shared", "-std=c11",
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


def build(sources: tuple[Path, ...] = SOURCES, defines: tuple[str, ...] = ()) -> Path:
    """Compile ``sources`` into one shared object unless a build for these sources, compiler,
    CPU and ``defines`` (``-D`` names: the tests force the slower paths with them) is cached."""
    flags = [*FLAGS, *(f"-D{name}" for name in defines)]
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"{cc} --version failed: {exc}") from exc
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
    key = hashlib.sha256("\0".join(
        [*(src.read_text() for src in (*sources, *headers)), " ".join(flags), version,
         _cpu_identity()]
    ).encode()).hexdigest()[:16]
    target = cache_dir() / f"tidegate-cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One compiler run however many processes start together on a fresh machine (a pod's
    # workers, a test run's processes): the others wait on the lock and find the build.
    with open(target.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        # Build beside the target and rename: a process never loads a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp],
                                  capture_output=True, text=True, timeout=300)
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
        fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
                       + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
        fn.restype = ctypes.c_int
        self._paged_decode = fn
        fn = self.lib.tidegate_paged_prefill_f32
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p]
                       + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
        fn.restype = ctypes.c_int
        self._paged_prefill = fn
        fn = self.lib.tidegate_skinny_linear_f32
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_int]
        fn.restype = None
        self._skinny_linear = fn
        fn = self.lib.tidegate_packed_linear_f32
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._packed_linear = fn
        fn = self.lib.tidegate_int_linear_f32
        fn.argtypes = ([ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 6
                       + [ctypes.c_int64] * 5 + [ctypes.c_int])
        fn.restype = ctypes.c_int
        self._int_linear = fn
        fn = self.lib.tidegate_fp8_linear_f32
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fp8_linear = fn
        fn = self.lib.tidegate_dequant_rows
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._dequant_rows = fn
        fn = self.lib.tidegate_rms_norm_f32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        fn.restype = None
        self._rms_norm = fn
        fn = self.lib.tidegate_rotary_store_kv_f32
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 5
                       + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2)
        fn.restype = None
        self._rotary_store_kv = fn
        fn = self.lib.tidegate_decoder_layer_q8
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        # (layer struct, step struct, key cache, value cache, hidden, residual or None, out,
        # out residual, threads): tidegate.kernels.cpu.decoder_layer builds the structs and checks operands.
        self.decoder_layer = fn
        fn = self.lib.tidegate_decoder_layers_q8
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        # (layer struct pointers, layers, step struct, key cache pointers, value cache pointers,
        # hidden, residual or None, out, out residual, threads): every layer of a step.
        self.decoder_layers = fn
        fn = self.lib.tidegate_silu_mul_f32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 2 + [
            ctypes.c_int]
        fn.restype = None
        self._silu_mul = fn
        fn = self.lib.tidegate_quantize_rows_q8
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int]
        fn.restype = None
        self._quantize_rows_q8 = fn
        fn = self.lib.tidegate_q8_packed_linear
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._q8_packed_linear = fn
        fn = self.lib.tidegate_q8_int_linear
        fn.argtypes = ([ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 6
                       + [ctypes.c_int64] * 4 + [ctypes.c_int])
        fn.restype = ctypes.c_int
        self._q8_int_linear = fn
        self.lib.tidegate_q8_row_bytes.argtypes = [ctypes.c_int64]
        self.lib.tidegate_q8_row_bytes.restype = ctypes.c_int64
        # Which path the 8-bit kernels compute with: 2 AVX512-VNNI, 1 AVX2, 0 portable C.
        self.q8_path = int(self.lib.tidegate_q8_path())
        self.lib.tidegate_q8_lanes8_preferred.argtypes = [ctypes.c_int]
        self.lib.tidegate_q8_lanes8_preferred.restype = ctypes.c_int
        fn = self.lib.tidegate_q8_repack_lanes8
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._repack_lanes8 = fn
        fn = self.lib.tidegate_q8_lanes8_rows
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._lanes8_rows = fn
        fn = self.lib.tidegate_q8_lanes8_linear
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._q8_lanes8_linear = fn

    def lanes8_preferred(self, qtype: int) -> bool:
        """Whether this CPU's 8-bit kernels run faster on ``qtype`` matrices repacked to the
        lanes8 layout (``tidegate.kernels.weights.packed_weight``)."""
        return bool(self.lib.tidegate_q8_lanes8_preferred(qtype))

    def repack_lanes8(self, weight: PackedWeight, *, force: bool = False) -> PackedWeight:
        """``weight`` with every part this CPU's 8-bit kernels prefer in the lanes8 layout
        (``force``: every part that has one), the others as they were. Half of the 8-bit
        kernels' instructions at few rows of x (batch-1 decode) on AVX2 and on AMD's AVX-512;
        the same values either way. Parts whose rows are not whole groups of 8, and Q8_0 parts
        holding a code of -128, stay in rows."""
        parts = []
        for part in weight.parts:
            if (part.layout == LANES8 or not weight.takes_int8(part) or part.rows % LANES8_ROWS
                    or not (force or self.lanes8_preferred(part.qtype))):
                parts.append(part)
                continue
            out = torch.empty_like(part.data)
            rc = self._repack_lanes8(part.qtype, part.data.data_ptr(), part.rows,
                                     weight.shape[1], out.data_ptr())
            parts.append(Part(part.qtype, out, LANES8) if rc == 0 else part)
        return PackedWeight(weight.shape, tuple(parts), weight.activations)

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

    def packed_linear(self, x: torch.Tensor, weight: PackedWeight,
                      add: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ dequant(weight) [N, K].T (+ add [M, N]) -> [M, N]; float32 CPU x.
        With ``weight.activations == "int8"`` the quantized parts multiply x rounded to 8-bit
        blocks (``quantize_rows_q8``, once per call)."""
        n, k = weight.shape
        x, out, add = _projection_operands(x, weight.shape, add)
        m = x.shape[0]
        if m == 0:
            return out
        threads = torch.get_num_threads()
        xq = None
        row = 0
        for part in weight.parts:
            y = out.data_ptr() + 4 * row
            a = None if add is None else add.data_ptr() + 4 * row
            if weight.takes_int8(part):
                xq = self.quantize_rows_q8(x) if xq is None else xq
                linear = self._q8_lanes8_linear if part.layout == LANES8 else self._q8_packed_linear
                rc = linear(part.qtype, xq.data_ptr(), part.data.data_ptr(), y, a, m, part.rows, k,
                            n, threads)
            else:
                rc = self._packed_linear(part.qtype, x.data_ptr(), part.data.data_ptr(), y, a, m,
                                         part.rows, k, x.stride(0), n, threads)
            _check_rc(rc, f"packed linear: GGML type {part.qtype} with {k} columns")
            row += part.rows
        return out

    def int_linear(self, x: torch.Tensor, weight: IntWeight,
                   add: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight.dequantize() [N, K].T (+ add [M, N]) -> [M, N]; float32 CPU x.
        Act-order weights read x's columns in their stored order (one gather of x). With
        ``weight.activations == "int8"`` (and K whole blocks of 32, groups whole steps of 16),
        x is rounded to 8-bit blocks first."""
        n, k = weight.shape
        x, out, add = _projection_operands(x, weight.shape, add)
        if weight.perm is not None:
            x = x.index_select(1, weight.perm)
        m = x.shape[0]
        if m == 0:
            return out
        threads = torch.get_num_threads()
        a = None if add is None else add.data_ptr()
        args = (weight.qweight.data_ptr(), weight.scales.data_ptr(), weight.zeros.data_ptr(),
                out.data_ptr(), a, m, n, k)
        if weight.takes_int8:
            xq = self.quantize_rows_q8(x)  # held until the call returns
            rc = self._q8_int_linear(weight.bits, weight.group_size, xq.data_ptr(), *args, n,
                                     threads)
        else:
            rc = self._int_linear(weight.bits, weight.group_size, x.data_ptr(), *args,
                                  x.stride(0), n, threads)
        _check_rc(rc, f"int linear: {weight.bits} bits in groups of {weight.group_size}")
        return out

    def quantize_rows_q8(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 rows x [M, K] (K a multiple of 32) as 8-bit records [M, 1.5 K] uint8 (the
        layout in ``csrc/q8_linear_cpu.c``; ``tidegate.kernels.reference.q8_activations`` is the reference)."""
        m, k = x.shape
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1 or k % 32:
            raise ValueError(f"8-bit rows need float32 CPU rows of whole blocks of 32, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        out = torch.empty(m, self.lib.tidegate_q8_row_bytes(k), dtype=torch.uint8)
        if m:
            self._quantize_rows_q8(x.data_ptr(), x.stride(0), m, k, out.data_ptr(),
                                   torch.get_num_threads())
        return out

    def fp8_linear(self, x: torch.Tensor, weight: Fp8Weight,
                   add: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight.dequantize() [N, K].T (+ add [M, N]) -> [M, N]; float32 CPU x
        (weight-only: the CPU has no FP8 arithmetic, so each strip of rows is widened to
        float32 in cache)."""
        n, k = weight.shape
        x, out, add = _projection_operands(x, weight.shape, add)
        m = x.shape[0]
        if m == 0:
            return out
        if self._fp8_linear(x.data_ptr(), weight.weight.data_ptr(), weight.scales.data_ptr(),
                            out.data_ptr(), None if add is None else add.data_ptr(), m, n, k,
                            x.stride(0), n, torch.get_num_threads()) != 0:
            raise MemoryError("fp8 linear kernel could not allocate its scratch memory")
        return out

    def dequantize_rows(self, weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``weight`` in float32 [len(ids), K] (embedding lookups)."""
        ids = ids.reshape(-1).to(torch.int64)
        n, k = weight.shape
        if len(weight.parts) != 1:  # embeddings are one tensor; stacked matrices go per part
            return weight.dequantize_rows(ids)
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"row ids out of range for {n} rows")
        part = weight.parts[0]
        ids = ids.contiguous()
        if part.layout == LANES8:  # the rows wanted, back in the rows layout
            rows = torch.empty(ids.numel(), part.data.shape[1], dtype=torch.uint8)
            if self._lanes8_rows(part.qtype, part.data.data_ptr(), k, ids.data_ptr(), ids.numel(),
                                 rows.data_ptr()) != 0:
                raise ValueError(f"dequantize rows: GGML type {part.qtype} has no lanes8 layout")
            part, ids = Part(part.qtype, rows), torch.arange(ids.numel())
        if self._dequant_rows(part.qtype, part.data.data_ptr(), k, ids.data_ptr(), ids.numel(),
                              out.data_ptr()) != 0:
            raise ValueError(f"dequantize rows: GGML type {part.qtype} with {k} columns")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tidegate.kernels.reference.rmsnorm.rms_norm_ref`` for 2-D float32 CPU rows (see ``rms_norm_applies``)."""
        m, h = x.shape
        out = torch.empty(m, h)
        new_res = torch.empty(m, h) if residual is not None else x
        if m:
            self._rms_norm(x.data_ptr(), x.stride(0),
                           None if residual is None else residual.data_ptr(),
                           0 if residual is None else residual.stride(0), weight.data_ptr(),
                           float(eps), out.data_ptr(), new_res.data_ptr(), m, h,
                           torch.get_num_threads())
        return out, new_res

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``tidegate.kernels.reference.activation.silu_and_mul_ref`` for 2-D float32 CPU rows (see
        ``silu_and_mul_applies``)."""
        m, two_i = x.shape
        out = torch.empty(m, two_i // 2)
        if m:
            self._silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), m, two_i // 2,
                           torch.get_num_threads())
        return out

    def rotary_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cache: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, slot_mapping: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place and store k, v at their slots (``rotary_store_kv_applies``
        says when); returns (q, k)."""
        t, hq, d = q.shape
        hk = k.shape[1]
        if t:
            positions = positions.to(torch.int64).contiguous()
            slots = slot_mapping.to(torch.int64).contiguous()
            self._rotary_store_kv(
                q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                positions.data_ptr(), cache.data_ptr(), key_cache.data_ptr(),
                value_cache.data_ptr(), slots.data_ptr(), t, hq, hk, d,
                int(key_cache.dtype == torch.int8), torch.get_num_threads())
        return q, k

    def paged_decode(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """Decode attention over the paged cache -> [B, Hq, D]; see the C source for layouts
        (float32 caches, or int8 ones of 8-bit heads: ``tidegate.kernels.cpu.paged_attention.kv_int8``)."""
        b, hq, d = q.shape
        _, block_size, hk, _ = key_cache.shape
        _check_attention_operands(q, key_cache, value_cache)
        if block_tables.shape[0] != b or seq_lens.shape != (b,):
            raise ValueError("block_tables and seq_lens need one row per query")
        q = q.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        rc = self._paged_decode(
            q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), b, hq, hk, d, block_size, tables.shape[1],
            float(scale), int(key_cache.dtype == torch.int8), torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its scratch memory")
        return out

    def paged_prefill(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, start: int, scale: float,
                      out: torch.Tensor) -> None:
        """One sequence's prompt chunk q [T, Hq, D] (positions start .. start+T-1, their keys
        and values stored) attending causally into ``out`` [T, Hq, D] contiguous: each row with
        the decode kernel's arithmetic, so a token gets the same bits either way. Caches and
        q as ``paged_decode`` checks them."""
        t, hq, d = q.shape
        _, block_size, hk, _ = key_cache.shape
        _check_attention_operands(q, key_cache, value_cache)
        if -(-(start + t) // block_size) > block_table.shape[0]:
            raise ValueError(f"block table of {block_table.shape[0]} blocks does not cover "
                             f"{start + t} tokens")
        q = q.contiguous()
        table = block_table.to(torch.int32).contiguous()
        if t and self._paged_prefill(
                q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), table.data_ptr(),
                start, out.data_ptr(), t, hq, hk, d, block_size, float(scale),
                int(key_cache.dtype == torch.int8), torch.get_num_threads()) != 0:
            raise MemoryError("paged prefill kernel could not allocate its scratch memory")


def _check_attention_operands(q: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor) -> None:
    """q [T, Hq, D] float32 against contiguous CPU caches [blocks, bs, Hk, D] float32 or
    [blocks, bs, Hk, D + 4] int8 (8-bit heads and their scales): ValueError naming the misfit."""
    d, (hk, dk) = q.shape[-1], key_cache.shape[2:]
    if q.dtype != torch.float32 or q.device.type != "cpu":
        raise ValueError(f"q must be a float32 CPU tensor, got {q.dtype} on {q.device}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in (torch.float32, torch.int8) or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 or int8 CPU tensor, got {t.dtype} on "
                             f"{t.device}")
        if not t.is_contiguous():
            raise ValueError("caches must be contiguous")
    want = d + 4 if key_cache.dtype == torch.int8 else d
    if (dk != want or q.shape[1] % hk or value_cache.shape != key_cache.shape
            or value_cache.dtype != key_cache.dtype):
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(key_cache.shape)} "
                         f"{key_cache.dtype}")


def _check_rc(rc: int, what: str) -> None:
    """The projection kernels' return codes: -2 out of scratch memory, other non-zero: the
    weight's format or shape is not one the kernel computes."""
    if rc == -2:
        raise MemoryError(f"{what}: the kernel could not allocate its scratch memory")
    if rc != 0:
        raise ValueError(f"{what}: not computed by this kernel")


def _projection_operands(x: torch.Tensor, shape: tuple[int, int], add: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The checked operands of x [M, K] @ W [N, K].T (+ add [M, N]): x with unit column
    stride, the empty output [M, N], and add made contiguous."""
    n, k = shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {shape}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if add is not None:
        if add.shape != (m, n) or add.dtype != torch.float32:
            raise ValueError(f"add {tuple(add.shape)} does not fit the output {(m, n)}")
        add = add.contiguous()
    return x, torch.empty(m, n, dtype=torch.float32), add


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


def use_native_kernels(defines: tuple[str, ...]) -> NativeCpuKernels:
    """Make the kernels built with ``defines`` (``-D`` names forcing slower paths, as the tests
    build them: ``TIDEGATE_NO_AVX512`` gives an AVX2 machine's kernels) this process's native
    kernels, before any model runs on them: benchmarks time another CPU's path on this one."""
    with _lock:
        lib = _loaded["lib"] = NativeCpuKernels(build(defines=defines))
    return lib


def native_decode_applies(q: torch.Tensor) -> bool:
    """Whether the native decode kernel serves this query (float32 on the CPU)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and native_kernels() is not None


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor,
                     residual: torch.Tensor | None) -> bool:
    """Whether the native RMSNorm serves these tensors: float32 CPU rows with unit strides."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.stride(1) == 1 and weight.dtype == torch.float32 and weight.is_contiguous()
            and (residual is None or (residual.dtype == torch.float32
                                      and residual.shape == x.shape and residual.stride(1) == 1))
            and native_kernels() is not None)


def silu_and_mul_applies(x: torch.Tensor) -> bool:
    """Whether the native SwiGLU serves x [T, 2I]: float32 CPU rows with unit column stride."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] % 2 == 0 and x.stride(1) == 1 and native_kernels() is not None)


def rotary_store_kv_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cache: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the native rotary + store serves these: float32 CPU, heads packed per token,
    contiguous float32 rotary cache, contiguous caches (float32, or int8 8-bit heads)."""
    d = q.shape[-1]
    return (q.device.type == "cpu" and q.dim() == 3 and k.dim() == 3 and v.dim() == 3
            and all(t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == d
                    for t in (q, k, v))
            and cache.dtype == torch.float32 and cache.is_contiguous()
            and key_cache.is_contiguous() and (
                key_cache.dtype == torch.float32 and key_cache.shape[-1] == d
                or key_cache.dtype == torch.int8 and key_cache.shape[-1] == d + 4)
            and cache.shape[-1] == d and native_kernels() is not None)
