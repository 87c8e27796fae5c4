"""Passkey-retrieval prompts (the classic long-context probe) and their scoring."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
ASK = "What is the pass key?"
ANSWER_START = "The pass key is"
QUESTION = f"\n{ASK} {ANSWER_START}"


@dataclass(frozen=True)
class PasskeyPrompt:
    text: str
    passkey: str
    depth: float
    num_tokens: int

    def is_correct(self, answer: str) -> bool:
        found = re.findall(r"\d+", answer)
        return bool(found) and found[0] == self.passkey


def make_passkey_prompt(tokenizer, num_tokens: int, depth: float, seed: int,
                        chat: bool = False) -> PasskeyPrompt:
    """A prompt of about ``num_tokens`` tokens with a 5-digit passkey at relative ``depth``.

    ``chat``: wrap the haystack and the question in the tokenizer's chat template (instruction
    models that answer a user turn more reliably than they continue plain text), with the
    assistant's turn opened by "The pass key is".
    """
    rng = random.Random(seed)
    passkey = str(rng.randint(10000, 99999))
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "

    def render(haystack: str) -> str:
        if not chat:
            return haystack + QUESTION
        turn = [{"role": "user", "content": f"{haystack}\n{ASK}"}]
        return tokenizer.apply_chat_template(turn, tokenize=False,
                                             add_generation_prompt=True) + ANSWER_START

    fixed = len(tokenizer.encode(render(INTRO + needle), add_special_tokens=False))
    per_filler = len(tokenizer.encode(FILLER * 8, add_special_tokens=False)) / 8
    n_fill = max(0, int((num_tokens - fixed) / per_filler))
    before = int(round(n_fill * depth))
    text = render(INTRO + FILLER * before + needle + FILLER * (n_fill - before))
    n = len(tokenizer.encode(text))
    return PasskeyPrompt(text, passkey, depth, n)
