"""`oled chat`: a terminal conversation that streams every finished block.

Commands: /help, /stats, /set key=value, /clear, /exit. Ctrl+C stops a reply (the generation is
cancelled through `Runtime.stream(cancelled=...)`) without leaving; Ctrl+D leaves.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from oled.decoding import DecodeConfig, GenerationStats
from oled.decoding.decoder import median_p90
from oled.model.tokenizer import check_text
from oled.paths import cache_home
from oled.runtime import Runtime, offload_stats

PROMPT = ">>> "
SETTABLE = {
    "block_length": int,
    "threshold": float,
    "max_tokens": int,
    "temperature": float,
    "seed": int,
}
HELP = """commands:
  /help              this list
  /stats             figures of the last reply (hit rate, copies, tokens per forward, latency)
  /set key=value     change decoding: block_length, threshold, max_tokens, temperature, seed
  /set               show the current values
  /clear             forget the conversation
  /exit              leave (or Ctrl+D); Ctrl+C stops a reply"""


@dataclass
class LastReply:
    stats: GenerationStats
    seconds: float
    first_block_s: float | None
    offload: dict[str, float] | None = None


@dataclass
class ChatSession:
    """The conversation and the decoding settings; `reply` streams one answer."""

    runtime: Runtime
    decode: DecodeConfig
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    last: LastReply | None = None

    def clear(self) -> None:
        self.messages.clear()

    def set(self, assignment: str) -> str:
        """Apply `key=value`; returns what changed (raises ValueError when invalid)."""
        key, sep, value = assignment.partition("=")
        key = key.strip()
        if not sep or key not in SETTABLE:
            raise ValueError(f"use /set key=value with key in {', '.join(SETTABLE)}")
        try:
            parsed = SETTABLE[key](value.strip())
        except ValueError:
            raise ValueError(f"{key} takes a {SETTABLE[key].__name__}, not {value!r}") from None
        name = "max_new_tokens" if key == "max_tokens" else key
        try:
            self.decode = replace(self.decode, **{name: parsed})
        except ValueError as err:  # the decoder's own check, in the chat's words
            raise ValueError(str(err).replace(name, key)) from None
        return f"{key} = {parsed}"

    def settings(self) -> str:
        d = self.decode
        return (
            f"block_length={d.block_length} threshold={d.threshold} "
            f"max_tokens={d.max_new_tokens} temperature={d.temperature} seed={d.seed}"
        )

    def reply(self, text: str, write: Callable[[str], None], cancelled: Callable[[], bool]) -> str:
        """Stream the answer to `text`; the conversation keeps what was said (also if cut)."""
        turns = [*self.messages, {"role": "user", "content": check_text(text, "the line")}]
        if self.system:
            turns.insert(0, {"role": "system", "content": self.system})
        rt = self.runtime
        ids = rt.tokenizer.encode(rt.tokenizer.render_chat(turns))
        t0, first, answer, sent = time.perf_counter(), None, [], 0
        for block in rt.stream(ids, decode=self.decode, cancelled=cancelled):
            answer += block.new_tokens
            decoded = rt.tokenizer.decode(answer)
            ready = len(decoded.rstrip("\ufffd"))
            if ready > sent:
                write(decoded[sent:ready])
                sent = ready
            first = first if first is not None else time.perf_counter() - t0
        decoded = rt.tokenizer.decode(answer)
        write(decoded[sent:])
        self.messages += [turns[-1], {"role": "assistant", "content": decoded}]
        self.last = LastReply(rt.last_stats, time.perf_counter() - t0, first, offload_stats(rt))
        return decoded


def stats_lines(last: LastReply | None) -> list[str]:
    """What /stats prints."""
    if last is None:
        return ["no reply yet"]
    s = last.stats
    median, p90 = median_p90(s.decode_ms)
    first = f"{1000 * last.first_block_s:.0f} ms" if last.first_block_s is not None else "n/a"
    off = last.offload or {}
    return [
        f"prompt {s.prompt_tokens} tokens; reply {s.new_tokens} tokens in {s.iterations} forwards, "
        f"{s.tokens_per_forward:.2f} tokens/forward, finish: {s.stopped}",
        f"latency: {last.seconds:.2f} s total, first block {first}, "
        f"prompt forward {s.prompt_ms or 0.0:.0f} ms, then {median:.1f} ms/iteration median, "
        f"{p90:.1f} ms p90, "
        f"{s.tokens_per_second:.1f} tokens/s",
        f"offload: hit rate {_pct(off.get('hit_rate'))}, copies {_num(off.get('copies'))}, "
        f"copied {_bytes(off.get('copy_bytes'))}, CPU experts {_num(off.get('cpu_experts'))}",
    ]


def _pct(v: Any) -> str:
    return "n/a" if v is None else f"{100 * float(v):.1f}%"


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _bytes(v: Any) -> str:
    return "n/a" if v is None else f"{float(v) / 2**20:.1f} MiB"


class Interrupts:
    """While active, Ctrl+C sets a flag (the reply stops at the next forward) instead of raising."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    @contextlib.contextmanager
    def catching(self) -> Iterator[Callable[[], bool]]:
        self.flag.clear()
        previous = signal.signal(signal.SIGINT, lambda *_: self.flag.set())
        try:
            yield self.flag.is_set
        finally:
            signal.signal(signal.SIGINT, previous)


def setup_readline() -> None:
    """Line editing and a persistent history, where the platform has readline."""
    try:
        import atexit
        import readline
    except ImportError:
        return
    history = cache_home() / "chat_history"
    with contextlib.suppress(OSError):
        history.parent.mkdir(parents=True, exist_ok=True)
        readline.read_history_file(history)
    readline.set_history_length(1000)
    atexit.register(lambda: _save_history(readline, history))


def _save_history(readline: ModuleType, history: Path) -> None:
    with contextlib.suppress(OSError):
        readline.write_history_file(history)


def run_chat(session: ChatSession, *, out: TextIO | None = None) -> None:
    """The read-reply loop (writing to `out`, by default the standard output of the moment)."""
    interrupts = Interrupts()
    out = out or sys.stdout
    # bytes that are not UTF-8 reach the tokenizer's check, which names them
    reconfigure = getattr(sys.stdin, "reconfigure", None)  # a text stream's (not every stdin's)
    if reconfigure is not None:
        with contextlib.suppress(ValueError):
            reconfigure(errors="surrogateescape")

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    write("type /help for commands; Ctrl+C stops a reply, Ctrl+D leaves\n")
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:
            write("^C\n")
            continue
        except UnicodeDecodeError as err:  # bytes the terminal sent are not UTF-8
            write(
                f"error: the line is not UTF-8 text (byte 0x{err.object[err.start]:02x}); "
                "nothing was sent\n"
            )
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not command(session, line.strip(), write):
                return
            continue
        with interrupts.catching() as cancelled:
            try:
                session.reply(line, write, cancelled)
            except ValueError as err:
                write(f"\nerror: {err}")
        write(" [stopped]\n" if interrupts.flag.is_set() else "\n")


def command(session: ChatSession, line: str, write: Callable[[str], None]) -> bool:
    """Run a slash command; False means leave."""
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        write(HELP + "\n")
    elif name == "/clear":
        session.clear()
        write("conversation cleared\n")
    elif name == "/stats":
        write("\n".join(stats_lines(session.last)) + "\n")
    elif name == "/set":
        try:
            write((session.set(arg) if arg.strip() else session.settings()) + "\n")
        except ValueError as err:
            write(f"error: {err}\n")
    else:
        write(f"unknown command {name}; /help lists them\n")
    return True
