"""llama.cpp's ``convert_hf_to_gguf.py``, run with its pre-tokenizer pinned where its table does not
know the tokenizer: ``python -m bench.llama_cpp_convert LLAMA_CPP_DIR PRE [converter arguments]``.

The converter names a BPE tokenizer's pre-tokenizer by a hash of how the tokenizer splits a fixed
text, and refuses a hash it has not recorded. The random-weight pairs of ``make-tiny --preset`` carry a
character tokenizer that no release has, so their GGUF files are written with ``PRE`` (``qwen2``, the
releases' own) instead; the benchmarks send token ids, so the pre-tokenizer's splitting of text
never decides what is timed. ``PRE`` ``-`` pins nothing: the converter as it ships.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    root, pre, arguments = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    if pre != "-":
        from conversion.base import TextModel

        TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [str(root / "convert_hf_to_gguf.py"), *arguments]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
