"""The native CPU decode kernel: exact against dense attention, wired into dispatch, and
falling back (or failing loudly, when asked for) where it cannot be built."""

from __future__ import annotations

import logging
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tidegate.kernels.cpu.native_cpu as native_cpu
from tests.kernels.cpu.test_paged_attention import MIXED, assert_close, make_batch
from tidegate.kernels import ops
from tidegate.kernels.cpu.paged_attention import paged_decode_attention


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Forget any loaded library and build into an empty cache directory."""
    monkeypatch.setattr(native_cpu, "_loaded", {})
    monkeypatch.setenv("TIDEGATE_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def native() -> native_cpu.NativeCpuKernels:
    lib = native_cpu.native_kernels()
    assert lib is not None
    return lib


@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 4, 16), (9, 3, 64), (8, 2, 128), (32, 8, 64)])
@pytest.mark.parametrize("block_size", [16, 4, 1])
def test_decode_kernel_matches_dense_attention(hq: int, hk: int, d: int, block_size: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    rng = random.Random(hq * 1000 + d + block_size)
    # Short and long contexts, one of a single token, one ending exactly on a block boundary.
    seqs = [(1, 1), (block_size * 3, 1)] + [(rng.randint(2, 300), 1) for _ in range(6)]
    b = make_batch(seqs, hq=hq, hk=hk, d=d, block_size=block_size, dtype=torch.float32,
                   seed=block_size)
    meta = b.meta
    out = native().paged_decode(b.q, b.key_cache, b.value_cache, meta.block_tables,
                                meta.seq_lens, b.scale)
    assert_close(out, b.expected, torch.float32)


def test_decode_kernel_is_stable_for_large_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores in the hundreds: a naive exp overflows; the kernel's softmax must not."""
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    b = make_batch([(900, 1), (17, 1)], hq=4, hk=2, d=32, block_size=16,
                   dtype=torch.float32, seed=5)
    q = b.q * 40
    out = native().paged_decode(q, b.key_cache, b.value_cache, b.meta.block_tables,
                                b.meta.seq_lens, b.scale)
    ref = paged_decode_attention(q, b.key_cache, b.value_cache, b.meta.block_tables,
                                 b.meta.seq_lens, b.scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["native", "reference"])
def test_dispatch_gives_the_same_attention_in_either_mode(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", mode)
    b = make_batch(MIXED, hq=9, hk=3, d=64, block_size=16, dtype=torch.float32, share=(4, 7))
    out = ops.paged_attention(b.q, b.key_cache, b.value_cache, b.meta, b.scale)
    assert_close(out, b.expected, torch.float32)


def test_auto_mode_uses_the_native_kernel_for_float32_cpu_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "auto")
    calls: list[int] = []
    lib = native()
    real = lib.paged_decode
    monkeypatch.setattr(lib, "paged_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    b = make_batch(MIXED, hq=9, hk=3, d=16, block_size=4, dtype=torch.float32)
    ops.paged_attention(b.q, b.key_cache, b.value_cache, b.meta, b.scale)
    assert calls == [b.meta.num_decodes]
    # bfloat16 stays on the torch path.
    bb = make_batch(MIXED, hq=9, hk=3, d=16, block_size=4, dtype=torch.bfloat16)
    ops.paged_attention(bb.q, bb.key_cache, bb.value_cache, bb.meta, bb.scale)
    assert calls == [b.meta.num_decodes]


def test_build_is_cached_per_source_and_cpu(fresh_native: Path) -> None:
    first = native_cpu.build()
    assert first.parent == fresh_native and first.suffix == ".so"
    mtime = first.stat().st_mtime_ns
    assert native_cpu.build() == first and first.stat().st_mtime_ns == mtime
    # No temporary left over; the build's lock file stays (removing it could let a process
    # that opened it before lock another file than the next one).
    assert sorted(p.name for p in fresh_native.iterdir()) == [first.with_suffix(".lock").name,
                                                              first.name]


def test_processes_starting_together_compile_once(fresh_native: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight builders at once on an empty cache (a fresh pod's workers): one compiler run, and
    each gets the finished library. flock excludes separately opened files in one process as
    across processes, so threads stand in for processes here."""
    source = fresh_native / "one.c"
    source.write_text("int tidegate_one(void) { return 1; }\n")
    log = fresh_native / "compiles.log"
    cc = fresh_native / "cc"
    cc.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo x >> {log};; esac\n'
                  f'exec {shutil.which("cc") or shutil.which("gcc")} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with ThreadPoolExecutor(max_workers=8) as pool:
        built = list(pool.map(lambda _: native_cpu.build((source,)), range(8)))
    assert len(set(built)) == 1 and built[0].exists()
    assert log.read_text().splitlines() == ["x"]


def test_a_benchmark_can_run_the_kernels_of_a_slower_path(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """``use_native_kernels`` swaps in the kernels built with the given definitions (here the
    portable C path) for what the process runs from then on."""
    monkeypatch.setattr(native_cpu, "_loaded", {})
    forced = native_cpu.use_native_kernels(("TIDEGATE_PORTABLE",))
    assert forced.q8_path == 0 and native_cpu.native_kernels() is forced
    x = torch.randn(3, 64)
    assert torch.equal(ops.rms_norm(x, torch.ones(64), 1e-5)[0],
                       forced.rms_norm(x, torch.ones(64), 1e-5)[0])


def test_without_a_compiler_auto_falls_back_and_native_fails_loudly(
    fresh_native: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(fresh_native / "no-such-cc"))
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    with pytest.raises(native_cpu.NativeBuildError, match="no-such-cc"):
        native_cpu.native_kernels()
    monkeypatch.setenv("TIDEGATE_KERNELS", "auto")
    with caplog.at_level(logging.WARNING, logger="tidegate.kernels"):
        assert native_cpu.native_kernels() is None
    assert "using plain torch" in caplog.text
    b = make_batch(MIXED, hq=4, hk=2, d=16, block_size=4, dtype=torch.float32)
    out = ops.paged_attention(b.q, b.key_cache, b.value_cache, b.meta, b.scale)
    assert_close(out, b.expected, torch.float32)


def test_a_compile_error_is_reported_with_the_compiler_output(
    fresh_native: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = fresh_native / "broken.c"
    broken.write_text("int f( {\n")
    with pytest.raises(native_cpu.NativeBuildError, match="broken.c"):
        native_cpu.build((broken,))
    assert list(fresh_native.glob("*.so")) == []


def test_reference_mode_never_builds(fresh_native: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "reference")
    assert native_cpu.native_kernels() is None
    assert list(fresh_native.iterdir()) == []


def test_an_unknown_mode_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "fast")
    with pytest.raises(ValueError, match="TIDEGATE_KERNELS must be one of"):
        native_cpu.native_kernels()


def test_wrapper_rejects_what_the_kernel_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    b = make_batch([(20, 1)], hq=4, hk=2, d=16, block_size=4, dtype=torch.float32)
    meta = b.meta
    with pytest.raises(ValueError, match="float32"):
        native().paged_decode(b.q.double(), b.key_cache, b.value_cache, meta.block_tables,
                              meta.seq_lens, b.scale)
    with pytest.raises(ValueError, match="does not fit"):
        native().paged_decode(b.q[:, :3], b.key_cache, b.value_cache, meta.block_tables,
                              meta.seq_lens, b.scale)
    with pytest.raises(ValueError, match="one row per query"):
        native().paged_decode(b.q, b.key_cache, b.value_cache, meta.block_tables[:0],
                              meta.seq_lens, b.scale)


def test_loading_the_native_kernels_keeps_subnormal_floats() -> None:
    # Built with -ffast-math, the shared object turned on flush-to-zero for the whole process
    # when loaded (GCC links crtfastmath.o): every subnormal read as 0 afterwards, in torch and
    # NumPy too, and hypothesis refused to run in the same process.
    import numpy as np

    if native_cpu.native_kernels() is None:
        pytest.skip("no C compiler")
    tiny = np.float64(2.2250738585072014e-308)  # the smallest normal double
    assert tiny * np.float64(0.5) > 0
    assert torch.tensor(1e-39, dtype=torch.float32).item() > 0


@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_rms_norm_matches_the_reference(rows: int, with_residual: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    from tidegate.kernels.reference.rmsnorm import rms_norm_ref

    wide = torch.randn(rows, 700)
    x = wide[:, 3:579]  # a strided view, as the residual stream's slices are
    weight = torch.rand(576) + 0.5
    residual = torch.randn(rows, 576) if with_residual else None
    assert native_cpu.rms_norm_applies(x, weight, residual)
    got, got_res = ops.rms_norm(x, weight, 1e-5, residual)
    want, want_res = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_res, want_res)


@pytest.mark.parametrize("tokens", [1, 5, 80])
def test_native_rotary_store_kv_matches_the_reference(tokens: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """In place on q/k views of one fused qkv row, as the model passes them; padding slots
    (-1) are skipped and no other slot is touched."""
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    from tidegate.kernels.cpu.paged_attention import store_kv_ref
    from tidegate.kernels.reference.rotary import cos_sin_cache, rotary_ref

    hq, hk, d = 9, 3, 64
    cache = cos_sin_cache(d, 4096, 10_000.0, None)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    positions = torch.randint(0, 4096, (tokens,))
    slots = torch.randperm(40 * 16)[:tokens]
    slots[0] = -1
    key_cache, value_cache = torch.zeros(40, 16, hk, d), torch.zeros(40, 16, hk, d)
    want_q, want_k = rotary_ref(q, k, positions, cache)
    want_kc, want_vc = key_cache.clone(), value_cache.clone()
    store_kv_ref(want_k, v, want_kc, want_vc, slots)
    assert native_cpu.rotary_store_kv_applies(q, k, v, cache, key_cache)
    got_q, got_k = ops.rotary_store_kv(q, k, v, positions, cache, key_cache, value_cache, slots)
    assert got_q.data_ptr() == q.data_ptr()  # rotated where they lie
    assert torch.allclose(got_q, want_q, atol=1e-5) and torch.allclose(got_k, want_k, atol=1e-5)
    assert torch.allclose(key_cache, want_kc, atol=1e-5) and torch.equal(value_cache, want_vc)


@pytest.mark.parametrize("rows", [1, 7, 70])
def test_native_silu_and_mul_matches_the_reference(rows: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    from tidegate.kernels.reference.activation import silu_and_mul_ref

    wide = torch.randn(rows, 3100) * 6
    x = wide[:, 10:3082]  # a strided view: gate then up, 1536 each
    x[0, 0], x[0, 1] = -200.0, 200.0  # saturated: silu -> 0 and x
    assert native_cpu.silu_and_mul_applies(x)
    got = ops.silu_and_mul(x)
    torch.testing.assert_close(got, silu_and_mul_ref(x), rtol=2e-6, atol=1e-6)
    alone = torch.cat([ops.silu_and_mul(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(alone, got)  # per row, whatever the batch


def test_a_prompt_chunk_attends_with_the_decodes_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of a prompt chunk (after a cached prefix) equals the decode of that token
    over the same cache: a token's attention does not depend on how its step was made up."""
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    batch = make_batch([(50, 13)], hq=9, hk=3, d=64, block_size=16, dtype=torch.float32)
    chunk = ops.paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.meta,
                                batch.scale)
    assert_close(chunk, batch.expected, torch.float32)
    table = batch.meta.block_tables[:1]
    for i in range(13):
        alone = native().paged_decode(batch.q[i:i + 1], batch.key_cache, batch.value_cache,
                                      table, torch.tensor([50 - 13 + i + 1]), batch.scale)
        assert torch.equal(alone[0], chunk[i]), i


def test_an_int8_cache_stores_each_head_rounded_with_its_scale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    from tidegate.kernels.cpu.paged_attention import quantize_kv_ref
    from tidegate.kernels.reference.rotary import cos_sin_cache, rotary_ref

    hq, hk, d, tokens = 9, 3, 64, 7
    cache = cos_sin_cache(d, 4096, 10_000.0, None)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d) * 3
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    v[2, 1] = 0.0  # an all-zero head: scale 0, values 0
    positions = torch.randint(0, 4096, (tokens,))
    slots = torch.tensor([5, -1, 0, 17, 3, 30, 9])
    key_cache = torch.zeros(4, 8, hk, d + 4, dtype=torch.int8)
    value_cache = torch.zeros_like(key_cache)
    want_q, want_k = rotary_ref(q.clone(), k.clone(), positions, cache)
    assert native_cpu.rotary_store_kv_applies(q, k, v, cache, key_cache)
    ops.rotary_store_kv(q, k, v, positions, cache, key_cache, value_cache, slots)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    kept = slots >= 0
    for got, src in ((key_cache, k), (value_cache, v)):
        stored = got.view(-1, hk, d + 4)[slots[kept]]
        assert torch.equal(stored, quantize_kv_ref(src[kept]))  # k as rotated, in place
    assert not key_cache.view(-1, hk, d + 4)[1].any()  # slot -1: nothing written


@pytest.mark.parametrize(("hq", "hk", "d"), [(9, 3, 64), (8, 2, 128)])
def test_attention_over_an_int8_cache_is_attention_over_its_values(
        hq: int, hk: int, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes and prompt chunks (MIXED) against the reference path on the dequantized cache;
    a chunk's rows are the decodes' bits, as with a float cache."""
    from tidegate.kernels.cpu.paged_attention import dequantize_kv_ref, quantize_kv_ref

    b = make_batch(MIXED, hq=hq, hk=hk, d=d, block_size=16, dtype=torch.float32)
    key8, value8 = quantize_kv_ref(b.key_cache), quantize_kv_ref(b.value_cache)
    monkeypatch.setenv("TIDEGATE_KERNELS", "reference")
    want = ops.paged_attention(b.q, dequantize_kv_ref(key8), dequantize_kv_ref(value8), b.meta,
                               b.scale)
    with pytest.raises(ValueError, match="int8 KV cache is read and written by the native"):
        ops.paged_attention(b.q, key8, value8, b.meta, b.scale)
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    got = ops.paged_attention(b.q, key8, value8, b.meta, b.scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    meta, start = b.meta, b.meta.query_start_loc_host
    for row in range(meta.num_decodes, len(meta.seq_lens_host)):  # prompt chunks
        seq_len, q_len = meta.seq_lens_host[row], meta.query_lens_host[row]
        for i in range(q_len):
            alone = native().paged_decode(
                b.q[start[row] + i:start[row] + i + 1], key8, value8,
                meta.block_tables[row:row + 1], torch.tensor([seq_len - q_len + i + 1]), b.scale)
            assert torch.equal(alone[0], got[start[row] + i])
