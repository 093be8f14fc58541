"""Checkpoint -> PyTorch modules: config parsing and weight loading, one file per model family
(``registry`` maps a checkpoint's architecture to it), the layers they share (``decoder``), the
DSpark draft (``draft``), the pair both make (``pair``), and fixture checkpoints (``fixtures``,
``demo_pair``). Imports ``common`` and ``plugins`` (the ops the modules call)."""
