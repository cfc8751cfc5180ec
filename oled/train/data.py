"""Training batches: plain-text windows and chat samples, with the positions noise may mask."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.types import Device

from oled.model.tokenizer import ROLE_END, Tokenizer
from oled.train.config import TrainConfig
from oled.train.corpus import chat_pairs, plain_documents


@dataclass
class Batch:
    tokens: Tensor  # [B, L] clean ids
    maskable: Tensor  # [B, L] bool: positions the noise may mask (answers and plain text)

    def to(self, device: Device) -> Batch:
        return Batch(self.tokens.to(device), self.maskable.to(device))


class Data:
    """Plain-text windows and chat samples, both L = blocks * block_length tokens long."""

    def __init__(
        self,
        cfg: TrainConfig,
        tok: Tokenizer,
        plays: dict[str, str],
        verses: list[dict],
        rng: random.Random,
    ) -> None:
        self.L = cfg.blocks * cfg.block_length
        self.cfg = cfg
        docs = plain_documents(plays, verses)
        ids: list[int] = []
        for enc in tok.inner.encode_batch(docs, add_special_tokens=False):
            ids += enc.ids + [tok.eos_id]
        stream = torch.tensor(ids, dtype=torch.long)
        cut = int(len(stream) * 0.99)
        self.train_stream, self.val_stream = stream[:cut], stream[cut:]
        self.stream_tokens = len(stream)
        pairs = chat_pairs(plays, verses, rng, 24_000)
        chat = self._chat_tensors(tok, pairs)
        self.val_chat = tuple(t[:1000] for t in chat)
        self.train_chat = tuple(t[1000:] for t in chat)

    def _chat_tensors(self, tok: Tokenizer, pairs: list[tuple[str, str]]) -> tuple[Tensor, Tensor]:
        """Prompt then answer per row, EOS after; only the answer maskable. Prompts too long
        to leave room for an answer are dropped."""
        role_end = tok.role_end_id
        if role_end is None:
            raise ValueError(f"chat samples need the tokenizer's {ROLE_END} token")
        prompts = [tok.render_chat([{"role": "user", "content": q}]) for q, _ in pairs]
        p_ids = tok.inner.encode_batch(prompts, add_special_tokens=False)
        a_ids = tok.inner.encode_batch([a + ROLE_END for _, a in pairs], add_special_tokens=False)
        toks = torch.full((len(pairs), self.L), tok.eos_id, dtype=torch.long)  # [N, L]
        maskable = torch.zeros((len(pairs), self.L), dtype=torch.bool)  # [N, L]
        keep: list[int] = []
        for i, (p_enc, a_enc) in enumerate(zip(p_ids, a_ids, strict=True)):
            p, a = p_enc.ids, a_enc.ids
            if len(p) > self.L - 8:
                continue
            a = a[: self.L - len(p)]
            if a[-1] != role_end and len(a) < self.L - len(p):
                a.append(role_end)
            toks[i, : len(p)] = torch.tensor(p)
            toks[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            maskable[i, len(p) :] = True
            keep.append(i)
        return toks[keep], maskable[keep]

    def _windows(self, stream: Tensor, n: int, gen: torch.Generator) -> Tensor:
        starts = torch.randint(0, len(stream) - self.L, (n,), generator=gen)
        return torch.stack([stream[s : s + self.L] for s in starts.tolist()])  # [n, L]

    def batch(self, n: int, gen: torch.Generator, *, val: bool = False) -> Batch:
        """`n` rows: text windows first, then a `chat_frac` share of chat samples."""
        n_chat = int(round(n * self.cfg.chat_frac))
        stream = self.val_stream if val else self.train_stream
        chat_t, chat_m = self.val_chat if val else self.train_chat
        text = self._windows(stream, n - n_chat, gen)
        pick = torch.randint(0, len(chat_t), (n_chat,), generator=gen)
        tokens = torch.cat([text, chat_t[pick]])
        maskable = torch.cat([torch.ones_like(text, dtype=torch.bool), chat_m[pick]])
        return Batch(tokens, maskable)
