"""The training run: data, model, the step loop with evaluations, progress and exports.

Writes into `cfg.out`: train_config.json (the configuration, the model and the run's figures),
history.json (a row per evaluation), train.log and checkpoint/.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from oled.model.config import ModelConfig
from oled.model.tokenizer import Tokenizer, special_ids, train_byte_bpe
from oled.train.checkpoint import export
from oled.train.config import TrainConfig, parse_config
from oled.train.corpus import PACKAGES, load_texts, plain_documents
from oled.train.data import Data
from oled.train.evaluation import evaluate
from oled.train.schedule import TIMED_STEPS, UNTIMED_STEPS, Schedule, lr_factor
from oled.train.step import Learner, make_learner, train_step


@dataclass
class Run:
    """Everything one training run holds."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    mcfg: ModelConfig
    tok: Tokenizer
    data: Data
    learner: Learner
    record: dict  # train_config.json
    autocast: torch.autocast
    history: list[dict] = field(default_factory=list)  # history.json

    def validate(self) -> dict:
        m = self.learner
        return evaluate(
            m.model, m.experts, self.data, self.cfg, self.tok.mask_id, self.device, self.autocast
        )

    def export(self) -> None:
        export(self.out, self.learner.model, self.learner.experts, self.mcfg, self.tok)

    def write_record(self) -> None:
        (self.out / "train_config.json").write_text(json.dumps(self.record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Train with the flags in `argv` (the command line's without)."""
    train(setup(parse_config(argv)))


def setup(cfg: TrainConfig) -> Run:
    """Seeds, data, tokenizer, model and optimizer; train_config.json written."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    mcfg = cfg.model_config()
    tok, data = _prepare_data(cfg, out, mcfg, random.Random(cfg.seed))
    learner = make_learner(cfg, mcfg, torch.Generator().manual_seed(cfg.seed), device)
    n_params = sum(p.numel() for p in learner.params)
    record = asdict(cfg) | {
        "model": mcfg.to_dict(),
        "params": n_params,
        "data": {"packages": list(PACKAGES), "text_tokens": data.stream_tokens},
        "torch": torch.__version__,
    }
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    run = Run(cfg, out, device, mcfg, tok, data, learner, record, autocast)
    run.write_record()
    log(out, f"model: {n_params / 1e6:.2f}M parameters, device {device}")
    return run


def _prepare_data(
    cfg: TrainConfig, out: Path, mcfg: ModelConfig, rng: random.Random
) -> tuple[Tokenizer, Data]:
    """The texts, a byte-level BPE trained on them, and the batches they make."""
    t_start = time.time()
    plays, verses = load_texts(Path(cfg.cache).expanduser())
    docs = plain_documents(plays, verses)
    tok = train_byte_bpe(docs, vocab_size=cfg.bpe_vocab, specials=special_ids(mcfg.vocab_size))
    data = Data(cfg, tok, plays, verses, rng)
    log(
        out,
        f"data: {len(plays)} Shakespeare works, {len(verses)} KJV verses, "
        f"{data.stream_tokens} text tokens, {len(data.train_chat[0])} chat samples, "
        f"{time.time() - t_start:.0f}s",
    )
    return tok, data


def train(run: Run) -> None:
    """Steps until the schedule's end, evaluating every `eval_every` steps and exporting every
    `save_every_minutes` and at the end."""
    cfg, device = run.cfg, run.device
    train_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    data_gen = torch.Generator().manual_seed(cfg.seed + 2)
    sched = Schedule(cfg)
    last_save = sched.t0
    step = 0
    while step < sched.total:
        if sched.timing(step):
            _time_steps(run, sched, step)
        lr = cfg.lr * lr_factor(step, sched.total, cfg)
        batch = run.data.batch(cfg.batch, data_gen).to(device)
        loss, ce = train_step(run.learner, batch, lr, cfg, run.tok.mask_id, train_gen, run.autocast)
        step += 1
        if step % cfg.eval_every == 0 or step == sched.total:
            _progress(run, sched, step, lr, loss, ce)
        if time.time() - last_save > cfg.save_every_minutes * 60:
            run.export()
            last_save = time.time()
    _finish(run, sched, step)


def _time_steps(run: Run, sched: Schedule, step: int) -> None:
    """Start the timed steps, or end them: time one evaluation too and plan the length."""
    sync(run.device)
    if step == UNTIMED_STEPS:
        sched.t_timed = time.time()
        return
    per_step = (time.time() - sched.t_timed) / TIMED_STEPS
    t_eval = time.time()
    run.validate()
    sync(run.device)
    per_eval = time.time() - t_eval
    sched.fit(step, per_step + per_eval / run.cfg.eval_every)
    log(
        run.out,
        f"{per_step:.3f}s per step, {per_eval:.2f}s per evaluation: "
        f"{sched.total} steps in {run.cfg.minutes} min",
    )
    run.record["steps"] = sched.total
    run.write_record()


def _progress(run: Run, sched: Schedule, step: int, lr: float, loss: Tensor, ce: Tensor) -> None:
    """An evaluation: a row in history.json and the log, then the length planned again."""
    val = run.validate()
    load = run.learner.experts.load
    used = (load > 0).float().sum(1).mean().item()
    row = {
        "step": step,
        "minutes": sched.minutes(),
        "lr": lr,
        "train_loss": loss.item(),
        "train_ce": ce.item(),
        **val,
        "experts_used": used,
        "load_cv": (load.std(1) / load.mean(1)).mean().item(),
    }
    run.history.append(row)
    (run.out / "history.json").write_text(json.dumps(run.history, indent=1) + "\n")
    log(
        run.out,
        " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
    )
    sched.replan(step)


def _finish(run: Run, sched: Schedule, step: int) -> None:
    """The last export and the run's figures in train_config.json."""
    run.export()
    run.record["steps"] = step
    run.record["train_minutes"] = sched.minutes()
    run.record["process_cpu_minutes"] = time.process_time() / 60
    run.record["final"] = run.history[-1] if run.history else {}
    run.write_record()
    log(run.out, f"done: {step} steps in {sched.minutes():.1f} min -> {run.out / 'checkpoint'}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log(out: Path, msg: str) -> None:
    """A timestamped line on stdout and in train.log."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with open(out / "train.log", "a") as f:
        f.write(line + "\n")
