"""The two block layouts a DSpark draft is declared with (``docs/dspark.md#block-layouts-and-k``):
``anchor-first`` (block ``[anchor, MASK...]``, row ``j`` predicts position ``p_anchor + j + 1``,
``block_size`` drafts) and ``bonus-anchor`` (row 0 is not sampled, row ``j`` predicts ``p_anchor +
j``, ``block_size - 1`` drafts)."""

ANCHOR_FIRST = "anchor-first"
BONUS_ANCHOR = "bonus-anchor"
LAYOUTS = (ANCHOR_FIRST, BONUS_ANCHOR)


def max_drafts(block_size: int, layout: str) -> int:
    """Drafts one block proposes: every position (anchor-first) or every one but the anchor's."""
    return block_size if layout == ANCHOR_FIRST else block_size - 1


def check_k(k: int, block_size: int, layout: str) -> None:
    """More drafts than a block proposes are refused: rows past the block were never trained
    (``docs/dspark.md#block-layouts-and-k``)."""
    if k < 1:
        raise ValueError(f"--k {k}: expected at least 1 draft per step")
    if k > max_drafts(block_size, layout):
        raise ValueError(f"--k {k}: the draft was trained with block_size {block_size} ({layout}) and "
                         f"proposes at most {max_drafts(block_size, layout)} per step")


def trained_block(raw: dict) -> tuple[int, str] | None:
    """``(block_size, layout)`` as a DSpark draft's config.json ``raw`` declares them (native
    DeepSpec or Speculators, read as ``draft_config`` reads them), or None where those fields are
    missing or malformed; for checking ``--k`` before anything loads."""
    speculators = "speculators_model_type" in raw
    size = raw.get("block_size", 8 if speculators else None)
    anchor = raw.get("sample_from_anchor", True)
    bonus = raw.get("dspark_bonus_anchor", not anchor) if not speculators else not anchor
    if not (type(size) is int and size >= 2 and isinstance(anchor, bool) and isinstance(bonus, bool)):
        return None
    return size, BONUS_ANCHOR if bonus else ANCHOR_FIRST
