"""packing.train._profile: per-micro-step records, the grouped kernel table, and off means off."""

from __future__ import annotations

import json
import time

import pytest
import torch

from packing.data import PackedBatch, StreamLayout
from packing.train._profile import (
    CATEGORIES,
    KernelRow,
    KernelTable,
    StepProfiler,
    classify_kernel,
    profiling,
)


def _batch(lengths: list[int], padded: int) -> PackedBatch:
    """A PackedBatch built by hand (no collate needed): lengths [2, 4, 3] padded to 12 gives
    doc_ids 0 0 1 1 1 1 2 2 2 -1 -1 -1."""
    doc = torch.full((padded,), -1, dtype=torch.int32)
    pos = torch.zeros(padded, dtype=torch.int32)
    cu = [0]
    for k, n in enumerate(lengths):
        doc[cu[-1] : cu[-1] + n] = k
        pos[cu[-1] : cu[-1] + n] = torch.arange(n, dtype=torch.int32)
        cu.append(cu[-1] + n)
    lay = StreamLayout(
        doc_ids_T=doc,
        position_ids_T=pos,
        cu_seqlens_K1=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(lengths),
        lengths_K=tuple(lengths),
        steps_K=tuple(lengths),
    )
    x = torch.randn(padded, 4)
    return PackedBatch(
        streams={"x": x},
        layouts={"x": lay},
        per_episode={"episode_index": torch.arange(len(lengths))},
        primary="x",
    )


def _tiny_step(batch: PackedBatch, model: torch.nn.Module) -> None:
    loss = model(batch["x"]).square().sum()
    loss.backward()


def test_records_tokens_padding_documents_per_micro_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    prof = StepProfiler(enabled=True)
    batches = [_batch([2, 4, 3], 12), _batch([232, 1, 129], 384), _batch([7], 128)]
    for i, b in enumerate(batches):
        with prof.micro_step(b):
            _tiny_step(b, model)
        if i == 1:
            prof.optimizer_step()
    recs = prof.records
    assert [(r.tokens, r.padded_tokens, r.padding, r.documents) for r in recs] == [
        (9, 12, 3, 3),
        (362, 384, 22, 3),
        (7, 128, 121, 1),
    ]
    assert [(r.step, r.micro_step) for r in recs] == [(0, 0), (0, 1), (1, 0)]
    assert recs[0].efficiency == pytest.approx(0.75)
    assert all(r.ms > 0 for r in recs)
    assert all(r.peak_memory_bytes == 0 for r in recs)  # CPU: no device peak to read
    table = prof.table()
    assert table.count("\n") == 1 + len(recs)
    assert "| 0 | 0 | 3 | 9 | 12 | 75.0% |" in table


def test_wall_time_is_the_time_inside_the_block() -> None:
    prof = StepProfiler(enabled=True)
    outer_ms = []
    for work in (lambda: time.sleep(0.1), lambda: None):  # 100 ms: far past a busy CPU's jitter
        t0 = time.perf_counter()
        with prof.micro_step(tokens=10):
            work()
        outer_ms.append(1e3 * (time.perf_counter() - t0))
    slow, fast = prof.records
    # Inside the block: at least the sleep, at most the time around the `with`, and the
    # empty block's own time (not the time since the profiler started or the last block).
    assert 99.0 <= slow.ms <= outer_ms[0]
    assert fast.ms <= outer_ms[1] and fast.ms < slow.ms
    assert slow.padded_tokens == 10 and slow.documents == 0


def test_off_by_default_records_nothing_and_touches_nothing(monkeypatch) -> None:
    monkeypatch.delenv("PACKING_PROFILE", raising=False)
    prof = StepProfiler()
    assert prof.enabled is False

    class Exploding:
        def layout(self):  # would be called if the profiler looked at the batch
            raise AssertionError("a disabled profiler must not read the batch")

    ctx = prof.micro_step(Exploding())
    with ctx:
        pass
    assert prof.micro_step(Exploding()) is ctx  # one shared null context: no allocation
    prof.optimizer_step()
    assert prof.records == [] and prof.kernel_table is None


def test_env_var_turns_it_on_and_picks_the_kernel_step(monkeypatch) -> None:
    monkeypatch.setenv("PACKING_PROFILE", "1")
    monkeypatch.setenv("PACKING_PROFILE_KERNEL_STEP", "1")
    prof = StepProfiler()
    assert prof.enabled is True and prof.kernel_step == 1
    monkeypatch.setenv("PACKING_PROFILE_KERNEL_STEP", "three")
    with pytest.raises(ValueError, match="PACKING_PROFILE_KERNEL_STEP='three' is not an integer"):
        StepProfiler()


def test_negative_kernel_step_is_refused() -> None:
    with pytest.raises(ValueError, match="kernel_step=-1 must be >= 0"):
        StepProfiler(enabled=True, kernel_step=-1)


def test_unknown_batch_type_names_the_fix() -> None:
    prof = StepProfiler(enabled=True)
    with pytest.raises(TypeError, match=r"micro_step\(tokens=\.\.\."), prof.micro_step([1, 2]):
        pass


def test_plain_mapping_counts_from_doc_ids() -> None:
    b = _batch([2, 4, 3], 12)
    plain = {"doc_ids": b["doc_ids"], "cu_seqlens": b["cu_seqlens"]}
    prof = StepProfiler(enabled=True)
    with prof.micro_step(plain):
        pass
    (r,) = prof.records
    assert (r.tokens, r.padded_tokens, r.documents) == (9, 12, 3)


def test_kernel_table_on_the_chosen_micro_step_only() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 4))
    prof = StepProfiler(enabled=True, kernel_step=1)
    b = _batch([200, 56], 256)
    x = torch.randn(256, 64)
    for _ in range(3):
        with prof.micro_step(b):
            q = x.view(1, 1, 256, 64)
            attn = torch.nn.functional.scaled_dot_product_attention(q, q, q).view(256, 64)
            model(attn).square().mean().backward()
    kt = prof.kernel_table
    assert kt is not None and kt.micro_step == 1 and kt.device_time is False
    groups = kt.by_category
    assert set(groups) == set(CATEGORIES)
    # The step did attention, matmuls and pointwise work: each group must have been seen,
    # or the grouping silently puts everything in "other".
    assert groups["attention"] > 0 and groups["gemm"] > 0 and groups["elementwise"] > 0
    assert sum(kt.shares().values()) == pytest.approx(1.0)
    md = kt.markdown()
    assert "| attention |" in md and "| gemm |" in md
    assert len(prof.records) == 3


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("triton_tem_fused_flex_attention_0", "attention"),
        ("flash_attn_varlen_fwd_kernel", "attention"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
        ("kernel_cutlass_FlashAttentionForwardSm90_0", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("triton_tem_fused_mm_3", "gemm"),
        ("aten::addmm", "gemm"),
        ("triton_poi_fused_add_mul_silu_0", "elementwise"),
        ("triton_red_fused_native_layer_norm_1", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
        ("aten::mul", "elementwise"),
        ("Memset (Device)", "other"),
        ("ncclDevKernel_AllGather_RING_LL", "other"),
    ],
)
def test_classify_kernel(name: str, group: str) -> None:
    assert classify_kernel(name) == group


def test_kernel_table_json_and_context_manager(tmp_path) -> None:
    kt = KernelTable(
        step=0,
        micro_step=2,
        device_time=True,
        rows=(
            KernelRow(name="flash_fwd", category="attention", ms=3.0, calls=4),
            KernelRow(name="nvjet_x", category="gemm", ms=1.0, calls=8),
        ),
    )
    assert kt.total_ms == 4.0 and kt.shares()["attention"] == 0.75
    with profiling() as prof:
        assert prof.enabled is True
        with prof.micro_step(tokens=5, padded_tokens=8, documents=2):
            pass
    prof.kernel_table = kt
    path = prof.write_json(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["records"][0]["padding"] == 3
    assert data["kernel_table"]["by_category_ms"]["attention"] == 3.0
