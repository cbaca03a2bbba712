"""Few-row projections on the GPU: the skinny Triton kernel's tiles against cuBLAS, one call.

Batch-1 decode of an 8B model is a stream over 15 GB of weights, ~130 projections a step; this
script finds the tile per projection shape and shows what a whole step's projections cost:

  ceilings  device-to-device copy (bytes read + written) and a read-only stream (Triton sum).
  probe     whether a kernel launched with programmatic dependent launch (PDL) starts before
            the one ahead of it ends (global-timer stamps), eagerly and in a graph.
  sweep     at one row, with PDL: every tile of ``grid_for`` on each projection shape (qkv with
            its norm, o_proj, gate_up with norm and SiLU, down_proj, the LM head), beside
            F.linear (cuBLAS) with the separate RMSNorm / SiLU kernels; ``--shapes`` picks some.
  chain     32 layers of Llama-3-8B projections (distinct weights, 14 GB) plus the LM head, in
            one CUDA graph, as a batch-1 decode step runs them: cuBLAS with the separate
            RMSNorm and SiLU kernels, against the fused kernels with the default tiles (PDL),
            and with the sweep's best tiles without and with PDL.

Every timing replays a CUDA graph of calls on rotating weight copies (more bytes than the 60 MB
L2), so launch gaps inside a graph count and the L2 serves no weights.

    python -m tidegate.benchmarks.kernels.gemv_sweep --out $OUT/gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.kernels.gpu.activation_triton import silu_and_mul_triton  # noqa: E402
from tidegate.kernels.gpu.linear_triton import SkinnyConfig, skinny_linear_triton  # noqa: E402
from tidegate.kernels.gpu.rmsnorm_triton import rms_norm_triton  # noqa: E402

H, INTER, HQ, HK, D, V, LAYERS = 4096, 14336, 32, 8, 128, 128256, 32
SHAPES = {  # name: (N, K, silu, norm)
    "qkv": ((HQ + 2 * HK) * D, H, False, True),
    "o": (H, HQ * D, False, False),
    "gate_up": (2 * INTER, H, True, True),
    "down": (H, INTER, False, False),
    "lm_head": (V, H, False, False),
    # Diagnostics only (stage 1): gate_up without its norm prologue, and without SiLU too.
    "gate_up_plain": (2 * INTER, H, True, False),
    "up_plain": (2 * INTER, H, False, False),
}
MODEL_SHAPES = ("qkv", "o", "gate_up", "down", "lm_head")
BF = torch.bfloat16


def graph_time_us(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Median time per call of ``calls`` captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    del graph
    return statistics.median(times) / len(calls)


@triton.jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid * BLOCK * ITERS
    for i in range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def ceilings() -> dict[str, object]:
    n = 1 << 31  # 4 GiB of bf16
    src = torch.empty(n, dtype=BF, device="cuda").normal_()
    dst = torch.empty(n // 2, dtype=BF, device="cuda")
    half = src[: n // 2]
    copy_us = graph_time_us([lambda: dst.copy_(half)])
    res: dict[str, object] = {"copy_TBps": 2 * half.numel() * 2 / copy_us / 1e6}
    dst = half = None  # the 4 GiB copy target goes back before the reads
    reads = {}
    for block, iters, warps in itertools.product((2048, 4096, 8192), (16, 64), (4, 8, 16)):
        progs = n // (block * iters)
        out = torch.empty(progs, dtype=torch.float32, device="cuda")
        us = graph_time_us([lambda p=progs, o=out, b=block, i=iters, w=warps: _read_kernel[(p,)](
            src, o, BLOCK=b, ITERS=i, num_warps=w)], replays=5)
        reads[f"{block}x{iters} w{warps}"] = n * 2 / us / 1e6
    best = max(reads, key=reads.get)
    res.update(read_TBps=reads[best], read_config=best, read_all=reads)
    return res


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, ns):
    start = _globaltimer()
    now = start
    while now - start < ns:
        now = _globaltimer()
    tl.store(out_ptr, now)


@triton.jit
def _probe_kernel(out_ptr, PDL: tl.constexpr):
    if PDL:
        tl.store(out_ptr + 1, _globaltimer())
        gdc_wait()
    tl.store(out_ptr + 2, _globaltimer())


def pdl_probe() -> dict[str, object]:
    """Whether a PDL launch starts before the kernel ahead of it ends, eagerly and in a graph:
    the probe stamps the global timer before and after its wait; the spinner stamps its end."""
    res = {}
    for mode in ("eager", "graph"):
        t = torch.zeros(3, dtype=torch.int64, device="cuda")

        def run(t: torch.Tensor = t) -> None:
            _spin_kernel[(1,)](t, 50_000)
            _probe_kernel[(1,)](t, PDL=True, launch_pdl=True)
        if mode == "eager":
            run()
            run()
        else:
            graph_time_us([run], replays=2)
        torch.cuda.synchronize()
        spin_end, before, after = t.tolist()
        res[mode] = {"probe_start_minus_spin_end_us": (before - spin_end) / 1e3,
                     "after_wait_minus_spin_end_us": (after - spin_end) / 1e3}
    return res


class Problem:
    """Rotating weight copies of one projection shape, at ``m`` rows."""

    def __init__(self, name: str, m: int, min_bytes: int = 400 << 20) -> None:
        n, k, self.silu, self.norm = SHAPES[name]
        self.name, self.m, self.n, self.k = name, m, n, k
        copies = max(2, -(-min_bytes // (n * k * 2)))
        self.ws = [torch.empty(n, k, dtype=BF, device="cuda").normal_(std=0.02)
                   for _ in range(copies)]
        self.x = torch.randn(m, k, dtype=BF, device="cuda")
        self.nw = torch.ones(k, dtype=BF, device="cuda")
        self.bytes = n * k * 2

    def skinny(self, cfg: SkinnyConfig, pdl: bool) -> list[Callable[[], object]]:
        kw = {"norm_weight": self.nw} if self.norm else {}
        return [lambda w=w: skinny_linear_triton(self.x, w, silu=self.silu, pdl=pdl, config=cfg,
                                                 **kw) for w in self.ws]

    def cublas(self) -> list[Callable[[], object]]:
        def call(w: torch.Tensor) -> object:
            x = rms_norm_triton(self.x, self.nw, 1e-5)[0] if self.norm else self.x
            y = F.linear(x, w)
            return silu_and_mul_triton(y) if self.silu else y
        return [lambda w=w: call(w) for w in self.ws]

    def check(self, cfg: SkinnyConfig) -> float:
        got = self.skinny(cfg, False)[0]().float()
        want = self.cublas()[0]().float()
        return ((got - want).norm() / want.norm()).item()

    def tbps(self, us: float) -> float:
        return self.bytes / us / 1e6


def grid_for(k: int) -> list[SkinnyConfig]:
    """Tiles tried at one row for a depth K: the plain grid's best three from earlier sweeps,
    then persistent programs (1-4 per SM) over blocks of 1-4 rows."""
    one_shot = triton.next_power_of_2(k) <= 4096
    plain = [SkinnyConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=1, dot=False)
             for bn, bk in ((2, 4096), (4, 4096), (8, 2048)) if bk >= k or bk < 4096]
    if not one_shot:  # long rows: whole rows per program need 8-16 warps to hold them
        return plain + [
            SkinnyConfig(block_n=bn, block_k=triton.next_power_of_2(k), num_warps=w,
                         num_stages=1, dot=False, persistent=p)
            for bn in (1, 2) for w in (8, 16) for p in (1, 2)] + [
            SkinnyConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=1, dot=False)
            for bn in (8, 16) for bk in (1024, 4096)]
    return plain + [
        SkinnyConfig(block_n=bn, block_k=triton.next_power_of_2(k), num_warps=w, num_stages=1,
                     dot=False, persistent=p)
        for bn in (1, 2, 4) for w in (4, 8) for p in (1, 2, 3, 4)]


def label(c: SkinnyConfig) -> str:
    kind = "dot" if c.dot else ("fma3" if c.acc3 else "fma")
    return (f"{kind} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages} p{c.prefetch}"
            f" x{c.persistent}")


def sweep(shapes: list[str]) -> dict[str, object]:
    """One row, PDL on: every tile of ``grid_for`` on each projection shape, beside cuBLAS."""
    out: dict[str, object] = {}
    best: dict[str, SkinnyConfig] = {}
    for name in shapes:
        p = Problem(name, 1)
        rows = []
        for cfg in grid_for(p.k):
            try:
                us = graph_time_us(p.skinny(cfg, True), replays=5)
            except Exception as e:  # a tile that does not compile (registers, shared memory)
                rows.append((label(cfg), None, repr(e)[:160]))
                continue
            rows.append((label(cfg), p.tbps(us), us))
        ok = sorted((r for r in rows if r[1] is not None), key=lambda r: -r[1])
        cublas = p.tbps(graph_time_us(p.cublas()))
        best[name] = next(c for c in grid_for(p.k) if label(c) == ok[0][0])
        out[name] = {"cublas_TBps": cublas, "rows": rows,
                     "best": ok[0][0], "rel_err_vs_cublas": p.check(best[name])}
        print(f"{name}: cuBLAS {cublas:.2f} TB/s; best (err {out[name]['rel_err_vs_cublas']:.1e}):")
        for r in ok[:6]:
            print(f"   {r[0]:36s} {r[1]:.2f} TB/s {r[2]:.1f} us")
        errors = [r for r in rows if r[1] is None]
        if errors:
            print(f"   {len(errors)} failed, e.g. {errors[0]}")
        del p
        torch.cuda.empty_cache()
    out["best"] = {k: label(v) for k, v in best.items()}
    out["_configs"] = best
    return out


def chain(configs: dict[str, SkinnyConfig] | None) -> dict[str, object]:
    """A decode step's projections, 32 layers + LM head, in one graph, at one row."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return torch.empty(n, k, dtype=BF, device="cuda").normal_(std=0.02, generator=g)

    layers = [{name: w(SHAPES[name][0], SHAPES[name][1]) for name in ("qkv", "o", "gate_up",
                                                                      "down")}
              for _ in range(LAYERS)]
    lm = w(V, H)
    nbytes = sum(t.numel() * 2 for ly in layers for t in ly.values()) + lm.numel() * 2
    norm = torch.ones(H, dtype=BF, device="cuda")
    h0 = torch.randn(1, H, dtype=BF, device="cuda")
    cfg = configs or {}

    def cublas_step() -> None:
        hidden, res = h0, None
        for ly in layers:
            x, res = rms_norm_triton(hidden, norm, 1e-5, res)
            qkv = F.linear(x, ly["qkv"])
            o = F.linear(qkv[:, : HQ * D], ly["o"])
            x, res = rms_norm_triton(o, norm, 1e-5, res)
            hidden = F.linear(silu_and_mul_triton(F.linear(x, ly["gate_up"])), ly["down"])
        x, _ = rms_norm_triton(hidden, norm, 1e-5, res)
        F.linear(x, lm)

    def skinny_step(pdl: bool, configs: dict[str, SkinnyConfig]) -> None:
        hidden = h0
        for ly in layers:
            qkv = skinny_linear_triton(hidden, ly["qkv"], norm_weight=norm, pdl=pdl,
                                       config=configs.get("qkv"))
            hidden = skinny_linear_triton(qkv[:, : HQ * D], ly["o"], add=hidden, pdl=pdl,
                                          config=configs.get("o"))
            act = skinny_linear_triton(hidden, ly["gate_up"], norm_weight=norm, silu=True,
                                       pdl=pdl, config=configs.get("gate_up"))
            hidden = skinny_linear_triton(act, ly["down"], add=hidden, pdl=pdl,
                                          config=configs.get("down"))
        x, _ = rms_norm_triton(hidden, norm, 1e-5)
        skinny_linear_triton(x, lm, pdl=pdl, config=configs.get("lm_head"))

    res: dict[str, object] = {"bytes": nbytes}
    for name, fn in (("cublas", cublas_step),
                     ("skinny_default_pdl", lambda: skinny_step(True, {})),
                     ("skinny_best", lambda: skinny_step(False, cfg)),
                     ("skinny_best_pdl", lambda: skinny_step(True, cfg))):
        try:
            us = graph_time_us([fn], replays=10)
        except Exception as e:
            res[name] = repr(e)[:200]
            continue
        res[name] = {"us": us, "TBps": nbytes / us / 1e6}
        print(f"chain {name:11s} {us / 1e3:.3f} ms  {nbytes / us / 1e6:.2f} TB/s")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["probe", "ceilings", "sweep", "chain"])
    ap.add_argument("--out", type=Path, default=Path("gemv.json"))
    ap.add_argument("--shapes", nargs="*", default=list(MODEL_SHAPES))
    args = ap.parse_args()
    result: dict[str, object] = {**record.record(), "device": torch.cuda.get_device_name(),
                                 "torch": torch.__version__, "triton": triton.__version__}
    t0 = time.time()
    for section in args.only:
        if section == "probe":
            result["pdl_probe"] = pdl_probe()
            print("PDL probe", result["pdl_probe"])
        elif section == "ceilings":
            result["ceilings"] = ceilings()
            print({k: v for k, v in result["ceilings"].items() if k != "read_all"})
        elif section == "sweep":
            result["sweep"] = sweep(args.shapes)
        elif section == "chain":
            best = result.get("sweep", {}).pop("_configs", None)
            result["chain_configs"] = {k: label(v) for k, v in (best or {}).items()}
            result["chain"] = chain(best)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        print(f"[{section} done at {time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
