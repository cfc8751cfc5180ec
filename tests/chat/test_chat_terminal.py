"""`oled chat` in a real terminal (pexpect): streaming, commands, Ctrl+C and Ctrl+D."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pexpect
import pytest

PROMPT = ">>> "
ROOT = Path(__file__).parents[2]


def spawn(model: Path, tmp_path: Path, *args: str) -> pexpect.spawn:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OLED_HOME": str(tmp_path), "TERM": "dumb"}
    cmd = [
        "-m",
        "oled.cli",
        "chat",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        *args,
    ]
    child = pexpect.spawn(sys.executable, cmd, env=env, encoding="utf-8", timeout=60)
    child.expect_exact(PROMPT)
    return child


def ask(child: pexpect.spawn, line: str) -> str:
    child.sendline(line)
    child.expect_exact(PROMPT)
    return child.before


def wait_reading(child: pexpect.spawn, timeout: float = 30.0) -> None:
    """Until the chat blocks reading the terminal. CPython's readline checks signals only when
    its wait for input is interrupted, so a Ctrl+C that lands between the prompt's output and
    that wait is seen at the next key; on a loaded machine the window is wide enough to hit.
    A user waits for the prompt before pressing a key, and so does this test: at the wait."""
    wchan = Path(f"/proc/{child.pid}/wchan")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            where = wchan.read_text()
        except OSError:  # no /proc: a fixed pause instead
            time.sleep(1.0)
            return
        if "select" in where or "poll" in where:
            return
        time.sleep(0.02)
    raise AssertionError(f"the chat did not wait for input within {timeout} s")


def prompt_tokens(stats: str) -> int:
    return int(re.search(r"prompt (\d+) tokens", stats).group(1))


@pytest.fixture()
def child(tiny_dir, tmp_path):
    proc = spawn(tiny_dir, tmp_path, "--block-length", "8", "--max-tokens", "8")
    yield proc
    proc.close(force=True)


def test_conversation_and_commands(child):
    assert "/stats" in ask(child, "/help")
    assert "no reply yet" in ask(child, "/stats")
    first = ask(child, "Hello there")
    assert first.strip().splitlines()[-1].strip()  # the answer was printed
    stats = ask(child, "/stats")
    assert "reply 8 tokens" in stats and "tokens/forward" in stats and "ms/iteration" in stats
    assert "hit rate n/a" in stats and "copies n/a" in stats
    one = prompt_tokens(stats)
    ask(child, "And again")
    two = prompt_tokens(ask(child, "/stats"))
    assert two > one + 8  # the conversation is kept
    assert "conversation cleared" in ask(child, "/clear")
    ask(child, "Hello there")
    assert prompt_tokens(ask(child, "/stats")) == one
    assert "max_tokens = 3" in ask(child, "/set max_tokens=3")
    assert "error" in ask(child, "/set threshold=2")
    refused = ask(child, "/set max_tokens=-1")
    assert "max_tokens must be at least 1" in refused and "max_new_tokens" not in refused
    assert "error" in ask(child, "/set colour=blue")
    assert "threshold=0.95" in ask(child, "/set")
    ask(child, "Short")
    assert "reply 3 tokens" in ask(child, "/stats")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_ctrl_c_stops_a_reply_and_ctrl_d_leaves(tiny_dir, tmp_path):
    child = spawn(
        tiny_dir, tmp_path, "--max-tokens", "3000", "--threshold", "1.0", "--block-length", "8"
    )
    try:
        child.sendline("Tell me a long story")
        child.expect_exact("Tell me a long story\r\n")  # the terminal's echo
        child.expect(r"\S{4,}")  # the first blocks stream in while the reply goes on
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact(PROMPT)
        stats = ask(child, "/stats")
        assert "finish: cancelled" in stats
        assert int(re.search(r"reply (\d+) tokens", stats).group(1)) < 3000
        wait_reading(child)
        child.sendintr()  # at the prompt: a fresh line, still running
        child.expect_exact(PROMPT)
        assert "commands" in ask(child, "/help")
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        child.close(force=True)


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(tiny_dir, tmp_path, errors):
    """Latin-1 bytes piped in, whatever the standard input's own error handling: one error line
    naming the byte, and the next line is answered (nothing after the bad bytes is lost)."""
    import subprocess

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OLED_HOME": str(tmp_path),
        "PYTHONIOENCODING": f"utf-8:{errors}",
    }
    cmd = [
        sys.executable,
        "-m",
        "oled.cli",
        "chat",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-tokens",
        "4",
        "--block-length",
        "8",
    ]
    done = subprocess.run(
        cmd, input=b"caf\xe9 au lait\nHello\n/stats\n", env=env, capture_output=True, timeout=120
    )
    out = done.stdout.decode("utf-8", "replace")
    assert done.returncode == 0, done.stderr.decode()
    assert "error: the line is not valid UTF-8 text (byte 0xe9 at character 3)" in out
    assert "reply 4 tokens" in out  # the next line was answered
