"""The embedded default model's tokenizer: a byte-level BPE trained on the corpus, saved as transformers loads it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
# The model continues text and knows no roles: a conversation is its messages' text in one paragraph, after <s>, so
# that a chat of one message gets the same tokens (and reply) as a completion of that text.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if not loop.first %} {% endif %}"
                 "{{ message['content'] }}{% endfor %}")


def train_tokenizer(paragraphs: Sequence[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (``tokenizers.Tokenizer``) that prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(list(paragraphs), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def save_tokenizer(tok, base_dir: Path, model_max_length: int) -> None:
    """Save tokenizer.json + tokenizer_config.json through transformers' fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=model_max_length)
    fast.save_pretrained(str(base_dir))
    # transformers 5 records its own backend class name; the portable name loads in 4.x and 5.x alike.
    config_path = base_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def token_stream(tok, paragraphs: Sequence[str]) -> torch.Tensor:
    """All paragraphs as one id stream: ``<s> paragraph </s>`` each."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(list(paragraphs)):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
