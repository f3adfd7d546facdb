"""A tiny byte-level BPE tokenizer with a ChatML chat template, for the demo and tests.

Trained with the `tokenizers` library on a small corpus (the synthetic task).
Digits are split one per token before byte-level encoding, so the model sees
numbers digit by digit (which a ~1M-parameter model needs to learn arithmetic).
The byte-level alphabet is always in the vocabulary, so any text encodes and
decode(encode(x)) == x exactly. Saved with transformers' fast-tokenizer class,
so `AutoTokenizer.from_pretrained(out_dir)` loads it with the chat template.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per turn; the generation prompt
# opens an assistant turn. Whitespace control (-) keeps the template's own
# layout out of the rendered text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- endif -%}"
)

# 256 byte symbols + special tokens is the floor for a byte-level vocabulary.
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def build_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512,
                    added_tokens: tuple[str, ...] = ()) -> Path:
    """Train a byte-level BPE on `texts` and save it (HF format) to `out_dir`; return the path.
    `added_tokens` (e.g. "<tool_call>") become single, non-special tokens, the last ids of the
    `vocab_size`, as Qwen3's tool-call tags are: kept in decoded text, never split."""
    if vocab_size < _MIN_VOCAB + len(added_tokens):
        raise ValueError(f"vocab_size: must be >= {_MIN_VOCAB + len(added_tokens)} (byte alphabet + special and "
                         f"added tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added_tokens),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The role names appear in every chat-formatted sequence; seeding them into
    # the corpus lets BPE merge them even when `texts` holds only contents.
    roles = ["system\n", "user\n", "assistant\n"] * 16
    tok.train_from_iterator(itertools.chain(roles, texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])

    # Imported here: transformers is heavy and only needed to write the HF files.
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    return out
