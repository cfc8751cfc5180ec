"""Tokenizer: `tokenizer.json` through the `tokenizers` library, plus LLaDA2's prompt format."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

MASK = "<|mask|>"
EOS = "<|endoftext|>"
ROLE_END = "<|role_end|>"
ROLE_OPEN, ROLE_CLOSE = "<role>", "</role>"
SPECIALS = (EOS, MASK, ROLE_OPEN, ROLE_CLOSE, ROLE_END)
ROLES = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}


class TokenizerError(ValueError):
    """A tokenizer file that is missing or lacks a token LLaDA2 needs, or text it cannot encode."""


def check_text(text: str, what: str = "the text") -> str:
    """`text`, checked to be Unicode that UTF-8 can encode; a TokenizerError naming `what` and
    the first bad character otherwise (bytes that are not UTF-8 on the command line reach
    Python as lone surrogates, U+DC80-U+DCFF for bytes 0x80-0xff)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        found = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise TokenizerError(
            f"{what} is not valid UTF-8 text ({found} at character {err.start})"
        ) from None
    return text


class Tokenizer:
    """Encodes and decodes text and renders chat prompts in LLaDA2's format."""

    def __init__(self, inner: HFTokenizer, *, source: str = "tokenizer.json") -> None:
        self.inner = inner
        self.source = source
        self.mask_id = self._require(MASK)
        self.eos_id = self._require(EOS)
        self.role_end_id = self.inner.token_to_id(ROLE_END)

    def _require(self, token: str) -> int:
        tid = self.inner.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"{self.source}: special token {token!r} is missing")
        return tid

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"{file}: no tokenizer.json in the checkpoint directory")
        try:
            return cls(HFTokenizer.from_file(str(file)), source=str(file))
        except Exception as err:  # the library raises plain Exception subclasses
            if isinstance(err, TokenizerError):
                raise
            raise TokenizerError(f"{file}: cannot read tokenizer: {err}") from None

    @property
    def stop_ids(self) -> set[int]:
        """Ids that end an answer: EOS and the role end."""
        return {self.eos_id} | ({self.role_end_id} if self.role_end_id is not None else set())

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(check_text(text), add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(
        self, messages: Sequence[dict[str, str]], *, add_generation: bool = True
    ) -> str:
        """LLaDA2 format: <role>SYSTEM</role>...<|role_end|><role>HUMAN</role>...<|role_end|>..."""
        parts = []
        for i, msg in enumerate(messages):
            role = ROLES.get(msg.get("role", ""))
            if role is None:
                raise ValueError(f"message {i}: role must be one of {sorted(ROLES)}")
            parts.append(f"{ROLE_OPEN}{role}{ROLE_CLOSE}{msg.get('content', '')}{ROLE_END}")
        if add_generation:
            parts.append(f"{ROLE_OPEN}ASSISTANT{ROLE_CLOSE}")
        return "".join(parts)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into a checkpoint directory."""
        path = Path(path)
        self.inner.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS,
            "pad_token": EOS,
            "mask_token": MASK,
            "additional_special_tokens": [ROLE_OPEN, ROLE_CLOSE, ROLE_END],
            "added_tokens_decoder": {
                str(self.inner.token_to_id(tok)): {"content": tok, "special": True}
                for tok in SPECIALS
            },
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def train_byte_bpe(texts: Iterable[str], *, vocab_size: int, specials: dict[str, int]) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens; special tokens at the given ids.

    LLaDA2 keeps its special tokens at fixed ids near the end of the vocabulary; we place them
    the same way, so every id below min(specials) is a BPE token and the gap is unused.
    """
    if vocab_size >= min(specials.values()):
        raise ValueError("the BPE vocabulary must end below the first special id")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    raw = json.loads(tok.to_str())
    raw["model"]["vocab"].update(specials)  # the model vocab fixes the ids of added tokens
    raw["added_tokens"] = [
        {
            "id": tid,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for text, tid in sorted(specials.items(), key=lambda kv: kv[1])
    ]
    return Tokenizer(HFTokenizer.from_str(json.dumps(raw)), source="<trained>")


def special_ids(vocab_size: int) -> dict[str, int]:
    """Special-token ids laid out as in LLaDA2 (EOS at vocab-292, mask at vocab-289, ...)."""
    base = vocab_size - 292
    return {
        EOS: base,
        MASK: base + 3,
        ROLE_OPEN: base + 4,
        ROLE_CLOSE: base + 5,
        ROLE_END: base + 6,
    }
