"""``python -m distill``: train a small DSpark draft for a target on the CPU.

The recipe is DeepSpec's (``docs/dspark.md#the-block-backbone``, ``#the-markov-head``), on data the
target writes itself:

1. the target answers prompts greedily (and ``--samples`` times more at T = 1), through an engine
   directory of it (``--engine``: batched, on the weights it serves) or the PyTorch target; those
   sequences are cached in ``OUT/data.pt``;
2. a fresh draft (native DeepSpec config, the target's ``embed_tokens`` / ``lm_head`` copied and
   frozen, its decoder layers started from the target's last ones) learns to continue them: per
   step one sequence runs through the target (teacher forcing) for its taps, anchors are sampled
   in the generated part, and every anchor's block ``[token_p, MASK ...]`` at positions ``p ..``
   attends to the context rows ``< p`` and to its own block, in one dense masked attention for all
   anchors; row ``j`` learns the token at ``p + j + 1`` with the Markov bias of the true
   predecessor ``token_{p + j}``;
3. every ``--save-every`` steps ``OUT`` holds a loadable draft (``config.json`` +
   ``model.safetensors``) and ``trainer.pt`` (fp32 weights, optimizer, step), so rerunning the
   same command resumes.

The files, in the order a run goes through them:

- ``__main__.py``: the command line (flags -> ``DistillSpec``, ``--force``, the printed summary);
- ``options.py``: ``DistillSpec``, the options checked on construction, and the settings a resumed
  run must share with the one that wrote ``OUT``;
- ``run.py``: ``distill()``, the whole run from target to measured draft;
- ``prompts.py``: the tokenizer and the train / held-out split of the prompt files;
- ``data.py``: the target's answers (step 1), cached in ``OUT/data.pt``;
- ``synthetic.py``: prompts the target writes in the style of each file, and second turns;
- ``engine.py``: the target through an engine directory: its answers and its taps;
- ``vocabulary.py``: the ids a reduced draft vocabulary (``--draft-vocab``) keeps;
- ``draft_init.py``: taps, ``config.json`` and the fresh draft's weights;
- ``loss.py``: the teacher-forced block forward for all anchors at once and its loss (step 2);
- ``loop.py``: ``train()``: the optimizer, the schedule, the target's taps, ``DistillResult``;
- ``checkpoint.py``: ``OUT``'s draft and ``trainer.pt``, written atomically, and resuming (step 3);
- ``evaluate.py``: held-out acceptance, teacher-forced during training and decoded at the end;
- ``summary.py``: what the command prints at the end.

Nothing is imported here, so that ``python -m distill --help`` loads neither torch nor the runtime.
"""
