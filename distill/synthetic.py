"""More, and more varied, training prompts than the prompt files hold: prompts the target writes
itself in the style of each file (``--synthetic``), from few-shot requests of that file's
training records only (the held-out records never reach them), and second turns on its own
answers (``--follow-ups``): a record's own next turn where it has one (MT-Bench's), else one of
``FOLLOW_UPS``. No reachable package ships prompt sets (looked: ``alpaca-eval`` ships
leaderboards, ``lm-eval`` task definitions, ``datasets`` reads a hub)."""
from __future__ import annotations

import random
import re
from typing import Callable

from common.prompts import encode_conversation, encode_prompt

EXAMPLES = 3                  # training records shown in each request
REQUEST = ("Here are some example questions:\n\n{examples}\n\nWrite one new question of the same kind, "
           "on another subject. Reply with the question only.")
FOLLOW_UPS = ("Can you explain that step by step?", "Why is that?", "Can you say that more briefly?",
              "Can you give another example?", "Are you sure? Please check your answer.",
              "How would you explain this to a child?", "What is the most important point here?",
              "Can you write that as a list?")

Answer = Callable[[list[list[int]], float, int], list[list[int]]]   # (prompts, temperature, seed) -> ids


def written_prompts(answer: Answer, tokenizer, texts: dict[str, list[str]], count: int,
                    seed: int) -> dict[str, list[str]]:
    """``count`` new prompts per file (fewer where the target repeats itself or writes nothing
    usable), each the target's answer at T = 1 to a request showing ``EXAMPLES`` of the file's
    training prompts no longer than its median (so that a request stays about as long as a few
    prompts), drawn with ``seed``: its first paragraph that is not a preamble (ending with a
    colon) and has 16 characters or more, without a list number, kept once."""
    draw = random.Random(seed)
    written = {}
    for index, (name, prompts) in enumerate(texts.items()):
        examples = sorted(prompts, key=len)[:(len(prompts) + 1) // 2]
        drawn = (draw.sample(examples, min(EXAMPLES, len(examples))) for _ in range(count))
        requests = [REQUEST.format(examples="\n\n".join(f"{n + 1}. {text}" for n, text in enumerate(shown)))
                    for shown in drawn]
        replies = answer([encode_prompt(tokenizer, request) for request in requests], 1.0,
                         seed + index * count)
        seen, kept = set(prompts), []
        for reply in replies:
            paragraphs = (re.sub(r"^\d+\.\s*", "", part.strip())
                          for part in tokenizer.decode(reply, skip_special_tokens=True).split("\n\n"))
            text = next((part for part in paragraphs if len(part) >= 16 and not part.endswith(":")), None)
            if text is not None and text not in seen:
                seen.add(text)
                kept.append(text)
        written[name] = kept
    return written


def follow_ups(tokenizer, conversations: list[list[str]], answers: list[list[int]]) -> list[list[int]]:
    """Each conversation's first turn, the target's answer to it, and a second user turn (the
    record's own, else one of ``FOLLOW_UPS`` in turn), as the prompt of the target's next answer."""
    prompts = []
    for index, (turns, reply) in enumerate(zip(conversations, answers)):
        second = turns[1] if len(turns) > 1 else FOLLOW_UPS[index % len(FOLLOW_UPS)]
        messages = [{"role": "user", "content": turns[0]},
                    {"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)},
                    {"role": "user", "content": second}]
        prompts.append(encode_conversation(tokenizer, messages))
    return prompts
