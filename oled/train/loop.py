"""The training run: data, model, the step loop with evaluations, progress and exports.

Writes into `cfg.out`: train_config.json (the configuration, the model and the run's figures),
history.json (a row per evaluation), train.log and checkpoint/; with `stop_minutes` or `resume`
also state.pt (weights, optimizer, generators and history), from which `--resume` continues the
same run in another process, step for step as if it had not stopped.
"""

from __future__ import annotations

import json
import math
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
    `save_every_minutes` and at the end; after `stop_minutes` the state is saved and the
    process ends (or at `stop_step`), for `--resume` to continue."""
    cfg, device = run.cfg, run.device
    gens = Generators(
        torch.Generator(device=device).manual_seed(cfg.seed + 1),
        torch.Generator().manual_seed(cfg.seed + 2),
    )
    sched = Schedule(cfg)
    step = resume(run, sched, gens) if cfg.resume else 0
    keep_state = cfg.resume or cfg.stop_minutes > 0 or cfg.stop_step > 0
    stop_at = time.time() + cfg.stop_minutes * 60 if cfg.stop_minutes > 0 else math.inf
    last_save = time.time()
    train_gen, data_gen = gens.train, gens.data
    while step < sched.total:
        if time.time() > stop_at or step == cfg.stop_step > 0:
            save_state(run, sched, step, gens)
            log(run.out, f"stopped at step {step} of {sched.total}: --resume continues")
            return
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
            if keep_state:
                save_state(run, sched, step, gens)
            last_save = time.time()
    _finish(run, sched, step)
    if keep_state:
        save_state(run, sched, step, gens)


@dataclass
class Generators:
    """The random streams a run draws from: the objective's (on the device) and the data's."""

    train: torch.Generator
    data: torch.Generator


STATE = "state.pt"
# flags that may change between a run and its resumption: they do not change what is computed
RESUMABLE_FLAGS = (
    "out",
    "resume",
    "stop_minutes",
    "stop_step",
    "save_every_minutes",
    "cache",
    "threads",
)


def save_state(run: Run, sched: Schedule, step: int, gens: Generators) -> None:
    """Everything `resume` needs, written beside `out`/state.pt and then moved over it."""
    m = run.learner
    state = {
        "config": _fixed_flags(run.cfg),
        "step": step,
        "total": sched.total,
        "minutes": sched.minutes(),
        "model": m.model.state_dict(),
        "w13": [w.detach() for w in m.experts.w13],
        "w2": [w.detach() for w in m.experts.w2],
        "load": m.experts.load,
        "opt": m.opt.state_dict(),
        "train_gen": gens.train.get_state(),
        "data_gen": gens.data.get_state(),
        "history": run.history,
    }
    tmp = run.out / (STATE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(run.out / STATE)


def resume(run: Run, sched: Schedule, gens: Generators) -> int:
    """Load `out`/state.pt into the run (a new run if there is none); the step to go on from.
    ValueError if it was saved with other training flags."""
    path = run.out / STATE
    if not path.exists():
        log(run.out, f"no {STATE} in {run.out}: a new run")
        return 0
    state = torch.load(path, map_location=run.device, weights_only=True)
    changed = {
        k: (v, state["config"].get(k))
        for k, v in _fixed_flags(run.cfg).items()
        if state["config"].get(k) != v
    }
    if changed:
        diff = ", ".join(f"{k}: {old!r} then, {new!r} now" for k, (new, old) in changed.items())
        raise ValueError(f"{path} was saved by a run with other flags ({diff})")
    m = run.learner
    m.model.load_state_dict(state["model"])
    with torch.no_grad():
        mine = [*m.experts.w13, *m.experts.w2]
        for w, saved in zip(mine, [*state["w13"], *state["w2"]], strict=True):
            w.copy_(saved)
    m.experts.load.copy_(state["load"])
    m.opt.load_state_dict(state["opt"])
    gens.train.set_state(state["train_gen"].cpu())
    gens.data.set_state(state["data_gen"].cpu())
    run.history[:] = state["history"]
    sched.resume(state["step"], state["total"], state["minutes"])
    log(run.out, f"resumed at step {state['step']} of {state['total']} from {path}")
    return int(state["step"])


def _fixed_flags(cfg: TrainConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_FLAGS}


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
