"""The two block layouts a DSpark draft is declared with (``docs/dspark.md#block-layouts-and-k``):
``anchor-first`` (block ``[anchor, MASK...]``, row ``j`` predicts position ``p_anchor + j + 1``,
``block_size`` drafts) and ``bonus-anchor`` (row 0 is not sampled, row ``j`` predicts ``p_anchor +
j``, ``block_size - 1`` drafts)."""

ANCHOR_FIRST = "anchor-first"
BONUS_ANCHOR = "bonus-anchor"
LAYOUTS = (ANCHOR_FIRST, BONUS_ANCHOR)
