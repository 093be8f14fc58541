"""The Python API for embedding: ``Generator.from_engine(dir).generate(prompts)``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterator

from common.prompts import encode_conversation, encode_prompt
from runtime.backends import open_backend
from runtime.backends.engine import damaged
from runtime.decoding.batch import Decoding
from runtime.decoding.draft_schedule import ADAPTIVE, LoadSchedule, adaptive
from runtime.decoding.stats import PhaseTimes, SpecStats
from runtime.decoding.stop_strings import StopStrings
from runtime.decoding.text_stream import TextStream


@dataclass
class Generation:
    texts: list[str]
    token_ids: list[list[int]]
    stats: SpecStats
    times: PhaseTimes
    trace: list[dict] = field(default_factory=list)   # "sequence" indexes the prompt list

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.token_ids)) / self.times.total if self.times.total else 0.0


# what a model's generation_config.json may set that a server takes as a request's defaults (vLLM's
# ``--generation-config auto``)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class Generator:
    """Speculative generation over one engine directory (or any backend) and its tokenizer;
    ``sampling_defaults``: the model's own (its ``generation_config.json``), for servers."""

    def __init__(self, backend, tokenizer, sampling_defaults: dict | None = None):
        self.backend, self.tokenizer = backend, tokenizer
        self.sampling_defaults = sampling_defaults or {}
        self._adaptive = None

    def draft_schedule(self, schedule: str = ADAPTIVE, flag: str = "--draft-schedule"):
        """The draft schedule ``schedule`` names, for ``decodings``' ``draft_schedule``:
        ``"adaptive"`` (this backend's call costs measured on first use, ~2 s on the demo engine,
        and kept: every decoding of this generator plans with them and with the acceptance seen
        so far), or a fixed ``LoadSchedule`` (``LoadSchedule.parse``, refused in one line
        naming ``flag``). The measurement overwrites the backend's caches: ask for it before a
        decoding whose caches a later one goes on with (``conversation``'s ``after``)."""
        fixed = LoadSchedule.parse(schedule, self.backend.limits.k, flag)
        if fixed is not None:
            return fixed
        if self._adaptive is None:
            self._adaptive = adaptive(self.backend)
        return self._adaptive

    @classmethod
    def from_engine(cls, engine: str | Path, backend: str = "ort", threads: int | None = None):
        from common import manifest as manifest_file

        engine = Path(engine)
        backend = open_backend(engine, backend, threads)
        manifest = getattr(backend, "manifest", None) or manifest_file.read(engine)
        return cls(backend, _tokenizer(engine / manifest["tokenizer"]), _sampling_defaults(engine))

    def encode(self, prompt: str, chat_template: bool = True, system: str | None = None) -> list[int]:
        """Token ids of a user prompt (after a ``system`` message), through the chat template when
        the tokenizer has one."""
        return encode_prompt(self.tokenizer, prompt, chat_template, system)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decodings(self, prompts: list[str], *, chat_template: bool = True,
                  batch_size: int | None = None, system: str | None = None,
                  stop: list[str] | tuple[str, ...] = (), **options) -> list[Decoding]:
        """One ``Decoding`` per batch of at most ``batch_size`` prompts (by default the backend's
        ``hints.default_batch``, else the engine's maximum), none started yet: every batch is checked
        here, so a prompt that does not fit is refused, by number and text, before the first
        batch's work. Options: ``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``, ``speculative``,
        ``confidence_threshold``, ``draft_schedule`` (``draft_schedule()``: adaptive by default, as
        the CLI and the servers verify);
        ``system`` is a system message before each prompt, and a sequence ends at the first of the
        ``stop`` strings, its text before it
        (``Decoding``'s)."""
        max_batch = self.backend.limits.max_batch
        size = batch_size if batch_size is not None else self.backend.hints.default_batch or max_batch
        if not 1 <= size <= max_batch:
            raise ValueError(f"batch_size {batch_size}: expected 1 .. {max_batch} (the engine's "
                             f"--max-batch)")
        ids = [self.encode(p, chat_template, system) for p in prompts]
        names = [f"prompt {i + 1} ({p if len(p) <= 40 else p[:37] + '...'!r})"
                 for i, p in enumerate(prompts)]
        return self._made(lambda chosen: [Decoding(self.backend, ids[begin:begin + size],
                                                   names=names[begin:begin + size],
                                                   stop=self._stop_strings(stop), **chosen)
                                          for begin in range(0, len(ids), size)], options)

    def conversation(self, messages: list[dict[str, str]], stop: list[str] | tuple[str, ...] = (),
                     after: Decoding | None = None, **options) -> Decoding:
        """A ``Decoding`` of the assistant's next turn in ``messages`` (``{"role", "content"}``,
        through the chat template), not started; options as ``decodings``. ``after``: the previous
        turn's, whose caches this one reuses (it prefills only what the conversation added)."""
        if after is not None and options.get("draft_schedule") is None:
            # measuring would overwrite its caches
            options["draft_schedule"] = after.batcher.scheduler.draft_schedule
        ids = encode_conversation(self.tokenizer, messages)
        return self._made(lambda chosen: Decoding(self.backend, [ids], names=["the conversation"],
                                                  stop=self._stop_strings(stop), after=after, **chosen),
                          options)

    def _made(self, make, options: dict):
        """``make(options)``, the options given the engine's EOS ids and, with speculation, adaptive
        verification unless they name a ``draft_schedule`` (what the CLI and the servers run): its
        costs measured (``draft_schedule()``) once a first ``make`` has checked every prompt, so that
        a prompt that does not fit is refused at once."""
        options = {"eos_token_ids": self.backend.limits.eos_token_ids, **options}
        limits = self.backend.limits
        if options.get("speculative", True) and limits.k and options.get("draft_schedule") is None:
            if self._adaptive is None:
                make({**options, "draft_schedule": LoadSchedule.constant(limits.k)})
            options["draft_schedule"] = self.draft_schedule()
        return make(options)

    def _stop_strings(self, stop) -> StopStrings | None:
        return StopStrings(list(stop), self.decode) if stop else None

    def generate(self, prompts: str | list[str], **options) -> Generation:
        """Generate for every prompt; options as ``decodings``."""
        decodings = self.decodings([prompts] if isinstance(prompts, str) else list(prompts), **options)
        for decoding in decodings:
            for _ in decoding:
                pass
        return self.collect(decodings)

    def collect(self, decodings: list[Decoding]) -> Generation:
        """One ``Generation`` from batches run so far (finished or not)."""
        token_ids, texts, trace, times = [], [], [], PhaseTimes()
        stats = SpecStats(k=decodings[0].result.stats.k if decodings else 0)
        for decoding in decodings:
            result = decoding.result
            trace += [{**r, "sequence": r["sequence"] + len(token_ids)} for r in result.trace]
            token_ids += result.token_ids
            texts += [self._text(decoding, ids) for ids in result.token_ids]
            stats.merge(result.stats)
            for f in fields(PhaseTimes):
                setattr(times, f.name, getattr(times, f.name) + getattr(result.times, f.name))
        return Generation(texts, token_ids, stats, times, trace)

    def _text(self, decoding: Decoding, ids: list[int]) -> str:
        return TextStream(self.decode, decoding.stop).text(ids)

    def stream(self, prompt: str, **options) -> Iterator[str]:
        """The text of one prompt's continuation, piece by piece as drafts are accepted (options as
        ``decodings``). For its statistics, stream ``pieces`` of a ``Decoding`` and read its
        ``result``."""
        return self.pieces(self.decodings([prompt], **options)[0])

    def pieces(self, decoding: Decoding) -> Iterator[str]:
        """Run a one-prompt ``Decoding``, yielding its text piece by piece as drafts are accepted;
        ``decoding.result`` (or ``collect``) then holds its statistics, times and trace."""
        stream = TextStream(self.decode, decoding.stop)
        for _ in decoding:
            piece = stream.piece(decoding.result.token_ids[0])
            if piece:
                yield piece
        rest = stream.piece(decoding.result.token_ids[0], final=True)   # what was held back
        if rest:
            yield rest


# tokenizer classes that AutoTokenizer loads as they are, from the tokenizer's own files; naming
# one directly skips AutoTokenizer's look-up, which indexes every model family transformers has
# (about 1 s of the demo engine's 5 s start on a 2-core CPU)
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _sampling_defaults(engine: Path) -> dict:
    """The sampling fields of the engine's ``generation_config.json`` (the target's, which a build
    copies), those it sets explicitly; none without one. A file that cannot be read is named."""
    path = engine / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise damaged(path, "cannot be read", err) from None
    return {name: config[name] for name in SAMPLING_DEFAULTS if config.get(name) is not None}


def _tokenizer(directory: Path):
    """The engine's tokenizer; a missing or unreadable one is named with what to do."""
    import transformers

    if not directory.is_dir():
        raise damaged(directory, "missing")
    try:
        config = directory / "tokenizer_config.json"
        declared = json.loads(config.read_text()) if config.is_file() else {}
        name = declared.get("tokenizer_class") if "auto_map" not in declared else None
        loader = getattr(transformers, name, None) if name in GENERIC_TOKENIZERS else None
        return (loader or transformers.AutoTokenizer).from_pretrained(directory)
    except Exception as err:   # transformers and tokenizers raise many types for a damaged file
        raise damaged(directory, "cannot be loaded", err) from None
