"""Character-level tokenizer for the tiny local policy.

Why it exists: no tokenizer can be downloaded here, and a character vocabulary makes every
digit its own token, so the addition task's reward depends only on the model and never on
how a BPE happened to merge "57". It is a real `tokenizers` tokenizer wrapped as a
`PreTrainedTokenizerFast`, saved next to the model with `save_pretrained`, so the generator,
the trainer and the vLLM backend load it with `rlbus.services.policy.load.load_tokenizer(path)` (not
`AutoTokenizer` alone, which swaps in Qwen2's own class for this folder and drops spaces when
encoding; vLLM's own detokenizer uses that class, which is harmless: ids reach vLLM as ids, and
decoding maps each id to its character either way).

Contract: `decode(encode(text)) == text` for any text over the vocabulary; `encode` never
adds `<bos>`/`<eos>` (callers decide, see `encode_prompt`); `<pad>` is id 0.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Order is part of the model: ids are positions in this string. Append, never reorder.
CHARACTERS: str = string.digits + "+-*=()" + " " + string.ascii_lowercase + string.ascii_uppercase + ".,:?!"


def char_vocab() -> dict[str, int]:
    """Token → id: special tokens first (so `<pad>` is 0), then one id per character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer; deterministic, no files needed."""
    vocab = char_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # No normalizer: a normalizer (lower-casing, NFKC, strip) would break exact round trips.
    # Each character is its own pre-token; WordLevel then maps it to its id.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # The default decoder joins tokens with spaces; Fuse concatenates them, so spaces in the
    # text come back only from the space token itself.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    # No post-processor: encode() must not add <bos>/<eos> behind the caller's back.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        padding_side="right",
        model_max_length=64,
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Prompt ids as the policy sees them: `<bos>` then the prompt's characters."""
    if tokenizer.bos_token_id is None:
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    return [int(tokenizer.bos_token_id), *tokenizer.encode(prompt, add_special_tokens=False)]
