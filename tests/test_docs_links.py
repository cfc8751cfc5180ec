"""Links and path citations in the documentation and the code point at things that exist.

(a) Every relative markdown link in README.md, CHANGELOG.md and docs/*.md names a file or
    folder that exists, and a `#anchor` into a markdown file names one of its headings, by
    GitHub's rules (lowercase; punctuation other than '-' and '_' removed; each space a '-';
    a repeated heading gets '-1', '-2', ...).
(b) Every repository path cited in a comment or docstring under oled/, tools/ and tests/ (a
    token starting with one of the top-level folders and ending in a file extension, or in '/'
    for a folder) exists, relative to the repository root. Tokens with '{', '*', '<' or '$' are
    templates and are skipped.
(c) The same for the paths that README.md and docs/*.md cite in their prose (mostly as code
    spans), except the dated records (CHANGELOG.md, docs/performance-history.md), which cite
    the paths of their time.

Fast and offline: it reads files only.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# -- (a) markdown links ---------------------------------------------------------------------

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(
    r"!?\[(?:[^\[\]\\]|\\.|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [f for f in files if f.exists()]


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark[0] * 3
            elif mark.startswith(fence):
                fence = None
            continue
        if fence is None:
            yield number, line


def heading_text(markdown: str) -> str:
    """A heading's text as rendered: links and images by their text, code spans by their
    content, emphasis marks and HTML tags dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("*", "")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's rendered text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        found.update(HTML_ID.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(heading_text(m.group(2)))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path):
    """(line number, target) of every link and image in a markdown file's prose."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            yield number, m.group(1)
        m = REFERENCE.match(line)
        if m:
            yield number, m.group(1)


def broken_links() -> list[str]:
    cache: dict[Path, set[str]] = {}
    problems = []
    for md in markdown_files():
        where = md.relative_to(ROOT)
        for number, target in links(md):
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            file_part = file_part.split("?", 1)[0]
            dest = (md.parent / file_part).resolve() if file_part else md
            if not dest.exists():
                problems.append(f"{where}:{number}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    problems.append(f"{where}:{number}: {target} (no heading #{anchor})")
    return problems


# -- (b) path citations in code ---------------------------------------------------------------

TOP = ("docs", "tools", "oled", "tests", "recipes", ".ci")
PATH = re.compile(r"(?<![\w./$-])(?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./{}*<>$-]*")
EXTENSION = re.compile(
    r"\.(md|py|c|h|toml|json|jsonl|sh|oledtrace|txt|png|csv|yaml|yml|cfg|ini|safetensors)$"
)
TEMPLATE = set("{*<$")


def code_files() -> list[Path]:
    files: list[Path] = []
    for top in ("oled", "tools", "tests"):
        for ext in ("py", "c", "h", "sh"):
            files += (ROOT / top).rglob(f"*.{ext}")
    return sorted(f for f in files if "__pycache__" not in f.parts)


def python_texts(source: str):
    """(line number, text) of a Python file's comments and docstrings."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                for offset, line in enumerate(body[0].value.value.splitlines()):
                    yield body[0].lineno + offset, line


def c_texts(source: str):
    """(line number, text) of a C file's comments."""
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, flags=re.S):
        first = source.count("\n", 0, m.start()) + 1
        for offset, line in enumerate(m.group(0).splitlines()):
            yield first + offset, line


def shell_texts(source: str):
    """(line number, text) of a shell script's comments (a '#' at a line's start or after a
    space)."""
    for number, line in enumerate(source.splitlines(), 1):
        m = re.search(r"(?:^|\s)#.*", line)
        if m and not line.startswith("#!"):
            yield number, m.group(0)


def cited_paths(path: Path):
    source = path.read_text(encoding="utf-8")
    texts = {".py": python_texts, ".c": c_texts, ".h": c_texts, ".sh": shell_texts}[path.suffix]
    for number, text in texts(source):
        for m in PATH.finditer(text):
            token = m.group(0).rstrip(".,:;'\"`)")
            if TEMPLATE & set(token):
                continue
            yield number, token


def broken_citations() -> list[str]:
    problems = []
    for path in code_files():
        where = path.relative_to(ROOT)
        for number, token in cited_paths(path):
            if EXTENSION.search(token):
                ok = (ROOT / token).exists()
            elif token.endswith("/"):
                ok = (ROOT / token).is_dir()
            else:
                continue  # no extension: a folder if it exists, else not a path
            if not ok:
                problems.append(f"{where}:{number}: {token}")
    return sorted(set(problems))


RECORDS = ("CHANGELOG.md", "performance-history.md")


def broken_doc_citations() -> list[str]:
    problems = []
    for md in markdown_files():
        if md.name in RECORDS:
            continue
        where = md.relative_to(ROOT)
        for number, line in prose_lines(md.read_text(encoding="utf-8")):
            for m in PATH.finditer(line):
                token = m.group(0).rstrip(".,:;'\"`)")
                if TEMPLATE & set(token):
                    continue
                if EXTENSION.search(token):
                    ok = (ROOT / token).exists()
                elif token.endswith("/"):
                    ok = (ROOT / token).is_dir()
                else:
                    continue
                if not ok:
                    problems.append(f"{where}:{number}: {token}")
    return problems


# -- tests ----------------------------------------------------------------------------------


def test_slug_follows_githubs_rules():
    assert slug("Run 13: the layer's launches from C") == "run-13-the-layers-launches-from-c"
    assert (
        slug(
            heading_text(
                "Run 2: every baseline and OLED at 25% and 12.5% (cost model: the `h200` profile)"
            )
        )
        == "run-2-every-baseline-and-oled-at-25-and-125-cost-model-the-h200-profile"
    )
    assert slug("Run 1: first run, 50% / 25% / 12.5%") == "run-1-first-run-50--25--125"
    assert slug("snake_case and dash-words") == "snake_case-and-dash-words"


def test_markdown_links_point_at_existing_files_and_headings():
    problems = broken_links()
    assert not problems, "broken markdown links:\n" + "\n".join(problems)


def test_paths_cited_in_code_exist():
    problems = broken_citations()
    assert not problems, "paths cited in comments and docstrings that do not exist:\n" + "\n".join(
        problems
    )


def test_paths_cited_in_docs_exist():
    problems = broken_doc_citations()
    assert not problems, "paths cited in README.md and docs/*.md that do not exist:\n" + "\n".join(
        problems
    )
