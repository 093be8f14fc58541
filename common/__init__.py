"""What export and runtime share: the engine directory's manifest (and its JSON schema), the
one-line errors every CLI prints, the argument parser, prompt files and output paths that are
never overwritten. Imports nothing of this project."""
