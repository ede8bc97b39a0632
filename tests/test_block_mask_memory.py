"""make_block_mask's eager path at long sequences: tile classification in row chunks.

Unchunked, classifying 8,192 x 8,192 tiles (1M tokens, blocks of 128) held about a dozen
int64 (R, C) tile intermediates: 13.8 GB of host memory for 1.07 GB of tables. In chunks the
peak is the tables plus ~200 MB; the chunked tables are the unchunked ones, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_masks import INNERS, RANDOM_MASKS

import packing.attention._masks as masks
from packing.attention import make_block_mask
from packing.attention._block_tables import block_tables, document_rule

ROOT = Path(__file__).resolve().parents[1]


def test_chunked_tables_equal_unchunked_on_random_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(**RANDOM_MASKS, block=st.sampled_from([1, 3, 16, (16, 32)]), chunk=st.integers(1, 9))
    def check(doc, kv, inner, block, chunk) -> None:
        monkeypatch.setattr(masks, "_CHUNK_TILES", chunk)
        q = torch.tensor(doc, dtype=torch.int32)
        k = None if kv is None else torch.tensor(kv, dtype=torch.int32)
        bm = make_block_mask(q, k, INNERS[inner], block_size=block)
        bq, bkv = bm.BLOCK_SIZE
        rule = document_rule if inner is None else INNERS[inner].block_rule
        want = block_tables(q, q if k is None else k, rule, bq, bkv, k is None)
        for name, t in want._asdict().items():
            assert torch.equal(getattr(bm, name), t), name
        tiles = bm.kv_num_blocks.shape[-1] * bm.kv_indices.shape[-1]
        seen["chunked"] += tiles > chunk
        seen["several chunks"] += tiles > 3 * chunk
        seen["cross"] += kv is not None

    check()
    assert min(seen.values()) >= 20, seen


@pytest.mark.slow
def test_host_memory_at_512k_tokens_stays_near_the_tables() -> None:
    """512K tokens, causal: peak growth was 12x the tables (3.2 GB for 269 MB); now < 3x."""
    code = textwrap.dedent(
        """
        import resource, torch
        from packing.data import layout_from_lengths
        from packing.attention import causal, make_block_mask

        T = 524288
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(500, 9000, (200,), generator=g).tolist()
        while sum(lengths) > T - 9000:
            lengths.pop()
        doc = layout_from_lengths(lengths, lengths, T).doc_ids_T
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        bm = make_block_mask(doc, inner=causal())
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
        names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
        tables = sum(getattr(bm, n).numel() * getattr(bm, n).element_size() for n in names)
        print(grew / tables, len(lengths))
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ratio, episodes = out.stdout.split()
    assert int(episodes) > 50  # many documents: tiles of every class, not one big block
    assert float(ratio) < 3.0, ratio
