"""A deterministic, dependency-free stand-in tokenizer, and the simulator's fixed output words.

Prefix caching works on token ids, so the simulator needs ids, not only
counts, and equal text must give equal ids on every replica and in every
process. The rule is deliberately simple:

- each run of letters, digits and underscores is one token, each other
  non-space character is one token (``"Hello, world!"`` is 4 tokens);
- a token's id is ``zlib.crc32`` of its UTF-8 text modulo ``VOCAB_SIZE``
  (Llama 3's vocabulary size), which is stable across processes, unlike
  Python's salted ``hash`` of a string.

Whitespace never becomes a token, so ``tokenize(a + " " + b) ==
tokenize(a) + tokenize(b)``: text made of whole words concatenates at the
token level. ``text_block`` builds workload text on that property: a block
of ``n`` pseudo-random one-token words that ends with a space, so shared
prefixes of a workload are shared token prefixes.

**Characters per token.** The engine counts tokens, but a router that does
not tokenize counts characters: the prefix-cache scorer hashes the prompt
text in blocks of ``4 × blockSizeTokens`` characters and caps how many it
matches, on the rule of thumb that BPE tokenizers give about 4 characters
of English text per token. So the length of workload words matters: it
sets how many engine tokens such a router's window covers. ``text_block``
words are 2 to 4 lowercase letters (3 on average) plus a space, 4.0
characters per token on average (``CHARS_PER_TOKEN``), like English text;
a scorer that matches 4,096 characters then sees about 1,000 of these
tokens, as it would of real text.

The output is a fixed word cycle (``output_token``), so equal requests get
equal answers from every replica and the ids of generated tokens are known
(``output_token_id``): the engine hashes blocks that hold generated tokens
exactly as vLLM does.
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Final

VOCAB_SIZE: Final = 128_256
"""Token ids lie in ``range(VOCAB_SIZE)``: Llama 3's vocabulary size (its tokenizer config)."""

CHARS_PER_TOKEN: Final = 4.0
"""Characters per token of ``text_block`` text on average, the space included (module docstring)."""

_TOKEN: Final = re.compile(r"\w+|[^\w\s]")
_WORDS: Final = ("the", "quick", "simulated", "model", "answers", "every", "request", "in", "kind")


def _token_id(text: str) -> int:
    return zlib.crc32(text.encode()) % VOCAB_SIZE


_WORD_IDS: Final = tuple(_token_id(word) for word in _WORDS)


def tokenize(text: str) -> list[int]:
    """The token ids of ``text``: one per word run or symbol, each a stable hash of its text."""
    return [zlib.crc32(token.encode()) % VOCAB_SIZE for token in _TOKEN.findall(text)]


def count_tokens(text: str) -> int:
    """Tokens in ``text`` (``len(tokenize(text))`` without computing the ids).

    ``"Hello, world!"`` is 4 tokens.
    """
    return len(_TOKEN.findall(text))


_LETTERS: Final = "abcdefghijklmnopqrstuvwxyz"


def _words(seed: int, tokens: int) -> list[str]:
    """``tokens`` pseudo-random one-token words: a fixed function of ``(seed, tokens)``.

    Each word is 2, 3 or 4 lowercase letters (equally likely), so it is one
    run of word characters and, with its space, 4 characters on average.
    About 470,000 words are possible: two equal words are common, but two
    equal runs of words are not, so different blocks stay different (a
    16-token KV block carries about 250 random bits).
    """
    rng = random.Random(seed)
    bits = rng.getrandbits
    letters = _LETTERS
    words = []
    for _ in range(tokens):
        draw = bits(32)
        length = 2 + draw % 3
        draw //= 3
        word = ""
        for _ in range(length):
            draw, letter = divmod(draw, 26)
            word += letters[letter]
        words.append(word)
    return words


def text_block(seed: int, tokens: int) -> str:
    """``tokens`` pseudo-random words, each one token, each followed by a space.

    Blocks concatenate at the token level: ``tokenize(a + b) == tokenize(a) +
    tokenize(b)`` for any two blocks, so a workload can build prompts from a
    shared block and a private one and know exactly which tokens they share.
    The same ``seed`` gives the same words (``text_block(s, n)`` is a prefix
    of ``text_block(s, m)`` for ``n <= m``).
    """
    return "".join(word + " " for word in _words(seed, tokens))


def token_block(seed: int, tokens: int) -> list[int]:
    """``tokenize(text_block(seed, tokens))``, without building and scanning the text."""
    return [zlib.crc32(word.encode()) % VOCAB_SIZE for word in _words(seed, tokens)]


def output_token(index: int) -> str:
    """The text of output token ``index``: a fixed word cycle, space-separated.

    Joining tokens 0..n-1 gives a text that ``count_tokens`` counts as n.
    """
    word = _WORDS[index % len(_WORDS)]
    return word if index == 0 else f" {word}"


def output_token_id(index: int) -> int:
    """The token id of output token ``index`` (``tokenize(output_token(index))[0]``)."""
    return _WORD_IDS[index % len(_WORD_IDS)]


def output_token_ids(start: int, end: int) -> tuple[int, ...]:
    """The ids of output tokens ``start`` to ``end - 1``: a slice of the repeated word cycle."""
    cycle = len(_WORD_IDS)
    offset = start % cycle
    repeats = (offset + end - start) // cycle + 1
    return (_WORD_IDS * repeats)[offset : offset + end - start]
