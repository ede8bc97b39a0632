"""Regenerate the pictures of docs/masks.md: python docs/img/make_mask_pictures.py"""

from pathlib import Path

import torch

from packing.attention import ascii_blocks, dense_mask, frame_causal, make_block_mask, save_png

HERE = Path(__file__).parent


def doc_ids(lengths: list[int], total: int) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(lengths)])
    return torch.nn.functional.pad(ids, (0, total - len(ids)), value=-1)


video = doc_ids([40, 24, 48], 128)  # three episodes + 16 padding tokens, tiles of 16
text = doc_ids([10, 6, 12], 32)  # their text tokens, for cross-attention

for name, kv, inner, block, title in [
    ("document_mask", None, None, 16, "document mask: episodes [40, 24, 48] + 16 pad"),
    ("frame_causal", None, frame_causal(8), 16, "document + frame_causal(8)"),
    ("cross_attention", text, None, (16, 8), "cross: video [40, 24, 48] -> text [10, 6, 12]"),
]:
    bm = make_block_mask(video, kv, inner, block_size=block)
    save_png(
        HERE / f"{name}.png",
        dense_mask(video, kv, inner),
        block_mask=bm,
        doc_ids=video,
        title=title,
    )
    print(f"{name}:\n{ascii_blocks(bm)}\n")
