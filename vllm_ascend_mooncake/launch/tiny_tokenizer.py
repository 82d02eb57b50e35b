"""The tiny models' tokenizer: a byte-level BPE trained offline on a generated corpus, with
BOS/EOS/PAD tokens and a plain chat template (for ``/v1/chat/completions``).

Byte-level BPE encodes any text, so prompts never hit an unknown token; a few frequent English
words keep typical test prompts short. ``tokenizers`` is imported when one is trained.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from vllm_ascend_mooncake import deps

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

#: Plain-text roles; enough for vLLM's OpenAI chat endpoint to render a conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Byte-level BPE needs all 256 byte symbols plus the special tokens before any merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` of a tiny model: the special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


# A few frequent English words keep typical test prompts short in tokens; generated
# pseudo-words give the BPE trainer enough distinct pairs to fill any vocabulary size.
_COMMON_WORDS_TEXT = (
    "the of and to a in is you that it he was for on are as with his they I at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part hello "
    "name capital France Paris future model cache prefill decode transfer token layer head"
)
_COMMON_WORDS = tuple(_COMMON_WORDS_TEXT.split())
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_PUNCTUATION = (".", ",", "!", "?", ";", ":")


def _corpus_lines(line_count: int = 4000, seed: int = 1234) -> Iterator[str]:
    """Deterministic training text: common words, pseudo-words, numbers and punctuation."""
    rng = random.Random(seed)
    for _ in range(line_count):
        words = []
        for _ in range(rng.randint(4, 16)):
            roll = rng.random()
            if roll < 0.5:
                word = rng.choice(_COMMON_WORDS)
            elif roll < 0.9:
                word = "".join(
                    rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 4))
                )
            else:
                word = str(rng.randint(0, 99999))
            if rng.random() < 0.1:
                word = word.capitalize()
            words.append(word)
        yield " ".join(words) + rng.choice(_PUNCTUATION)


def train_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` tokens.

    Byte-level BPE encodes any text, so prompts never hit an unknown token. If the corpus runs
    out of merges before the requested size, reserved ``<unused_N>`` tokens fill the rest, so
    every id the model can emit decodes.
    """
    tokenizers = deps.require_tokenizers()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens([f"<unused_{index}>" for index in range(missing)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}"
        )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer
