"""Moved: the block classification engine is `packing._block_mask` (internal), and `BlockRule`
is exported from `packing.masks`. These names resolve, with a DeprecationWarning, until the
next release.
"""

from packing._lazy import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "BlockRule": "packing.masks:BlockRule",
        "BlockTables": "packing._block_mask:BlockTables",
        "DocSide": "packing._block_mask:DocSide",
        "block_tables": "packing._block_mask:block_tables",
        "classify_blocks": "packing._block_mask:classify_blocks",
        "doc_side": "packing._block_mask:doc_side",
        "document_rule": "packing._block_mask:document_rule",
        "evaluate_tiles": "packing._block_mask:evaluate_tiles",
        "local_positions": "packing.layout_math:local_positions",
        "tables_from_flags": "packing._block_mask:tables_from_flags",
        "unknown_rule": "packing._block_mask:unknown_rule",
    },
)
