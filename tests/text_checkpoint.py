"""A tiny checkpoint that speaks text: a transformers model plus a BPE tokenizer trained here.

``make_text_checkpoint(dst)`` saves a random tiny qwen3 (``tests/oracle.py``) with its
vocabulary widened to the tokenizer's, a byte-level BPE tokenizer trained with ``tokenizers``
on a small fixed corpus, a ChatML-style chat template in ``tokenizer_config.json`` (or in
``chat_template.jinja``), and a ``generation_config.json`` naming the stop token.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 384
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Metrale compiles kernel plans for inference, one target at a time.",
    "Hello, world! Tokens in, tokens out: text round-trips through the tokenizer.",
    "A category has objects and arrows; a functor maps both and keeps composition.",
    "Über naïve café — unicode text, emoji 🙂 and numbers 12345 are bytes too.",
    "system user assistant: you are a helpful model. What is two plus two? Four.",
] * 20

CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}{%- set rest = messages %}{%- endif %}\n"
    "{%- for message in rest %}\n"
    "  {%- if message.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles are user and assistant after the system') }}{% endif %}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer():
    """The byte-level BPE tokenizer of the fixture (deterministic: fixed corpus and size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_text_checkpoint(dst: str | Path, *, seed: int = 5, jinja_file: bool = False,
                         arch: str = "qwen3", **overrides) -> Path:
    """Save the fixture's model, tokenizer, template and generation config in ``dst``."""
    from tests.oracle import make_hf_checkpoint

    d = Path(dst)
    tok = train_tokenizer()
    assert tok.get_vocab_size() <= VOCAB
    make_hf_checkpoint(arch, d, seed=seed, vocab_size=VOCAB, **overrides)
    return write_text_files(d, jinja_file=jinja_file, tok=tok)


def write_text_files(d: Path, *, jinja_file: bool = False, tok=None) -> Path:
    """Beside a checkpoint in ``d``: the fixture's tokenizer, chat template and generation
    config (the model's vocabulary may be wider than the tokenizer's: ids past it decode to
    nothing)."""
    tok = tok or train_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096}
    if jinja_file:
        (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    eos = tok.token_to_id("<|endoftext|>")
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "temperature": 0.7, "top_p": 0.9, "do_sample": True}))
    return d
