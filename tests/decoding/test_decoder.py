"""Block diffusion decoding: prefix cache equivalence, threshold semantics, stopping."""

from __future__ import annotations

import re

import pytest
import torch

from oled.decoding import DecodeConfig, DecodeObserver
from oled.decoding.decoder import _commit
from oled.model.model import KVCache
from oled.runtime import load_runtime


@pytest.fixture(scope="module")
def rt(tiny_dir):
    return load_runtime(str(tiny_dir), device="cpu", dtype="float32")


class Recorder(DecodeObserver):
    def __init__(self):
        self.iterations, self.blocks = [], []

    def on_iteration(self, info):
        self.iterations.append(info)

    def on_block_end(self, info):
        self.blocks.append(info)


@pytest.mark.parametrize("prompt_len", [5, 32, 45])
def test_cache_gives_same_logits_as_recompute(rt, prompt_len):
    model, bl = rt.model, 32
    gen = torch.Generator().manual_seed(prompt_len)
    seq = torch.randint(0, 700, (1, 128), generator=gen)
    cache = KVCache(model.config, max_len=128, batch=1, dtype=torch.float32, device="cpu")
    first = (prompt_len // bl) * bl
    with torch.inference_mode():
        for start in range(first, 128, bl):
            past = cache.length
            cached = model(
                seq[:, past : start + bl], start=past, cache=cache, logits_from=start - past
            )
            cache.length = start
            full = model(seq[:, : start + bl], logits_from=start)
            torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_cache_gives_same_tokens(rt):
    for prompt in ["What is the capital of France?", "Once upon a time there was a small robot"]:
        a = rt.generate(prompt, max_new_tokens=70, threshold=0.5)
        b = rt.generate(prompt, max_new_tokens=70, threshold=0.5, use_cache=False)
        assert a.token_ids == b.token_ids
        assert a.stats.iterations == b.stats.iterations


def test_observers_see_every_iteration(rt):
    rec = Recorder()
    ids = rt.prompt_ids("Hello there, how are you today?", chat=True)
    cfg = DecodeConfig(max_new_tokens=64, threshold=0.9)
    blocks = list(rt.stream(ids, decode=cfg, observers=[rec]))
    assert len(rec.iterations) == rt.last_stats.iterations
    assert [b.block for b in blocks] == list(range(len(blocks)))
    for info in rec.iterations:
        assert info.committed.any()  # at least one token per iteration
        assert not (info.committed & ~info.masked).any()  # never commits a fixed position
        assert (info.tokens[info.committed] != rt.tokenizer.mask_id).all()
    # blocks aligned to absolute positions; the first holds the prompt's tail
    assert blocks[0].block_start == (len(ids) // 32) * 32
    steps = [i.step for i in rec.iterations]
    assert steps == list(range(len(steps)))


def test_commit_threshold_and_at_least_one():
    masked = torch.tensor([True, True, False, True])
    conf = torch.tensor([0.2, 0.97, 0.99, 0.96])
    cfg = DecodeConfig(block_length=4, threshold=0.95)
    assert _commit(conf, masked, cfg, 0).tolist() == [False, True, False, True]
    low = torch.tensor([0.2, 0.3, 0.99, 0.1])
    assert _commit(low, masked, cfg, 0).tolist() == [False, True, False, False]


def test_commit_strict_threshold_as_llada2_generate():
    masked = torch.tensor([True, True, True, False])
    conf = torch.tensor([0.95, 0.96, 0.5, 1.0])
    at_or_above = DecodeConfig(block_length=4, threshold=0.95)
    strict = DecodeConfig(block_length=4, threshold=0.95, strict_threshold=True)
    assert _commit(conf, masked, at_or_above, 0).tolist() == [True, True, False, False]
    assert _commit(conf, masked, strict, 0).tolist() == [False, True, False, False]


def test_steps_schedule_as_llada2_generate():
    # block_length 32 in 5 steps: 7, 7, 6, 6, 6 (the remainder in the first iterations)
    cfg = DecodeConfig(block_length=32, steps=5)
    assert [cfg.at_least(i) for i in range(5)] == [7, 7, 6, 6, 6]
    assert [DecodeConfig().at_least(i) for i in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="steps"):
        DecodeConfig(block_length=8, steps=9)
    masked = torch.tensor([True, True, True, False, True])
    conf = torch.tensor([0.1, 0.5, 0.3, 1.0, 0.2])
    three = DecodeConfig(block_length=5, steps=2, threshold=0.95)  # 3 then 2
    assert _commit(conf, masked, three, 0).tolist() == [False, True, True, False, True]
    # at least 3, but only 2 are masked: both, never a fixed position
    two_left = torch.tensor([False, True, False, False, True])
    assert _commit(conf, two_left, three, 0).tolist() == [False, True, False, False, True]


def test_steps_end_every_block_within_steps(rt):
    g = rt.generate("Hi", max_new_tokens=64, threshold=1.0, steps=4)
    assert g.stats.iterations <= g.stats.blocks * 4  # 8 a forward: 4 forwards a block at most
    one_each = rt.generate("Hi", max_new_tokens=64, threshold=1.0)
    assert one_each.stats.iterations > 2 * g.stats.iterations
    # steps = block_length commits at least one a forward: the default's tokens
    assert rt.generate("Hi", max_new_tokens=64, steps=32).token_ids == (
        rt.generate("Hi", max_new_tokens=64).token_ids
    )


def test_threshold_one_commits_one_token_per_iteration(rt):
    g = rt.generate("Hi", max_new_tokens=32, threshold=1.0)
    p = len(rt.prompt_ids("Hi", chat=True))
    assert g.stats.iterations == g.stats.blocks * 32 - p % 32  # one commit per forward


def test_max_tokens_and_eos_stop(rt):
    g = rt.generate("Tell me a story", max_new_tokens=10)
    assert len(g.token_ids) <= 10
    eos = rt.tokenizer.eos_id
    # force EOS: make the lm_head prefer it everywhere
    boost = torch.zeros(rt.config.vocab_size)
    boost[eos] = 1e4
    handle = rt.model.lm_head.register_forward_hook(lambda mod, inp, out: out + boost)
    try:
        g = rt.generate("Tell me a story", max_new_tokens=100)
    finally:
        handle.remove()
    assert g.token_ids == []  # the answer ends before its first token
    assert g.stats.stopped == "stop"
    assert g.stats.blocks == 1


def test_sampling_is_seeded(rt):
    a = rt.generate("Hello", max_new_tokens=32, temperature=1.0, seed=3)
    b = rt.generate("Hello", max_new_tokens=32, temperature=1.0, seed=3)
    c = rt.generate("Hello", max_new_tokens=32, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_cancel_stops_generation(rt):
    calls = []

    def cancelled():
        calls.append(1)
        return len(calls) > 3

    blocks = list(
        rt.stream(
            rt.prompt_ids("Hi", chat=True),
            cancelled=cancelled,
            decode=DecodeConfig(max_new_tokens=128, threshold=1.0),
        )
    )
    assert rt.last_stats.stopped == "cancelled"
    assert rt.last_stats.iterations <= 3
    assert blocks == []


def _generate(rt, prompt, decode, **kw) -> list[int]:
    return [t for block in rt.stream(prompt, decode=decode, **kw) for t in block.new_tokens]


def test_follow_commits_the_recorded_generation(rt):
    """A sampled generation records its commits; a greedy one that follows them does the same
    work (same tokens, same iterations) while its own choices differ."""
    from oled.decoding import Trajectory

    prompt = rt.prompt_ids("Who wrote Hamlet?", chat=True)
    sampled = DecodeConfig(max_new_tokens=48, threshold=0.9, temperature=1.5, seed=7)
    greedy = DecodeConfig(max_new_tokens=48, threshold=0.9)
    trajectory = Trajectory()
    recorded = _generate(rt, prompt, sampled, observers=[trajectory])
    ms_recorded = list(rt.last_stats.iteration_ms)
    own = _generate(rt, prompt, greedy)
    assert own != recorded  # the greedy model would choose otherwise
    followed = _generate(rt, prompt, greedy, follow=trajectory)
    stats = rt.last_stats
    assert followed == recorded and len(stats.iteration_ms) == len(ms_recorded)
    assert stats.followed >= len(recorded) and 0 < stats.agreed < stats.followed
    again = _generate(rt, prompt, sampled, follow=trajectory)  # the same choices: full agreement
    assert again == recorded and rt.last_stats.agreed == rt.last_stats.followed


def test_follow_rejects_another_generation(rt):
    from oled.decoding import Trajectory

    prompt = rt.prompt_ids("Hi", chat=True)
    trajectory = Trajectory()
    _generate(rt, prompt, DecodeConfig(max_new_tokens=8, threshold=1.0), observers=[trajectory])
    with pytest.raises(ValueError, match="ended after"):
        _generate(rt, prompt, DecodeConfig(max_new_tokens=64, threshold=1.0), follow=trajectory)
    with pytest.raises(ValueError, match="blocks of 32 tokens, not 16"):
        _generate(rt, prompt, DecodeConfig(block_length=16, threshold=1.0), follow=trajectory)


def test_agreement_with_the_resident_model(rt):
    """Free running against the reference: equal on the same path (a zero logit difference);
    a small change of the logits shows as the size of the change, and one large enough to flip
    a choice as the first answer position and forward that differ."""
    from oled.decoding.follow import Agreement

    cfg = DecodeConfig(max_new_tokens=40, threshold=0.9)
    prompt = rt.prompt_ids("Who wrote Hamlet?", chat=True)
    reference = rt.reference_ids(prompt, cfg)
    assert reference.tokens and len(reference.logits) == len(reference.steps)
    same = Agreement(reference)
    assert _generate(rt, prompt, cfg, observers=[same]) == reference.tokens
    assert same.result() == {
        "tokens_equal": True,
        "first_divergence": None,
        "diverged_step": None,
        "max_logit_diff": 0.0,
    }

    def shifted(token: int, by: float) -> dict:
        """Agreement of a generation whose logits of `token` are raised by `by`."""
        bias = torch.zeros(rt.config.vocab_size)
        bias[token] = by
        handle = rt.model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
        try:
            agree = Agreement(reference)
            _generate(rt, prompt, cfg, observers=[agree])
        finally:
            handle.remove()
        return agree.result()

    small = shifted(reference.tokens[0], 1e-3)  # too small to change a choice, but measured
    assert small["tokens_equal"] and small["max_logit_diff"] == pytest.approx(1e-3, rel=1e-2)
    result = shifted((reference.tokens[0] + 1) % rt.config.vocab_size, 1e4)  # wins everywhere
    assert not result["tokens_equal"] and result["first_divergence"] is not None
    assert result["diverged_step"] == 0 and result["max_logit_diff"] >= 1e4 * 0.99


class BlockWatch(DecodeObserver):
    """Fails a generation whose block runs past `limit` forwards (instead of hanging)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.forwards, self.most = limit, 0, 0

    def on_iteration(self, info) -> None:
        self.forwards = info.iteration + 1
        self.most = max(self.most, self.forwards)
        if self.forwards > self.limit:
            raise AssertionError(f"block {info.block} ran {self.forwards} forwards")

    def on_batch_iteration(self, info) -> None:
        for row in info.rows:
            self.on_iteration(row)


@pytest.mark.parametrize("steps", [None, 4])
def test_a_committed_mask_id_ends_its_block(mask_wins_dir, steps):
    """The model's top prediction is the mask token itself: it is committed like any token
    (LLaDA2's generate keeps it) and every block ends within block_length forwards (steps)."""
    rt = load_runtime(str(mask_wins_dir), device="cpu", dtype="float32")
    cfg = DecodeConfig(max_new_tokens=70, threshold=0.95, steps=steps)
    watch = BlockWatch(steps or cfg.block_length)
    out = rt.generate("Hello there", decode=cfg, observers=[watch])
    assert out.token_ids and set(out.token_ids) == {rt.tokenizer.mask_id}
    assert out.stats.new_tokens == 70 and out.stats.stopped == "length"
    assert 1 <= watch.most <= (steps or cfg.block_length)
    dec = rt.batch_decoder(2)
    dec.observers.append(watch)
    for prompt in ("Hello there", "A"):
        dec.add(rt.prompt_ids(prompt, chat=True), cfg)
    finished = []
    while dec.busy:
        finished += [ev.stream for ev in dec.step() if ev.finished]
    assert [s.stats.new_tokens for s in finished] == [70, 70]


def test_generate_ends_on_a_model_that_predicts_the_mask(mask_wins_dir):
    """`oled generate` as a user runs it, on the model whose top prediction is the mask id: it
    ends with an empty answer (the mask id decodes to nothing) and its forwards stay within
    one block_length per block."""
    from typer.testing import CliRunner

    from oled.cli import app

    args = ["generate", "Hi", "--model", str(mask_wins_dir), "--max-tokens", "40"]
    out = CliRunner().invoke(app, [*args, "--dtype", "float32", "--block-length", "8"])
    assert out.exit_code == 0, out.output
    forwards = re.search(r"40 tokens, (\d+) forwards", out.output)
    assert forwards and int(forwards[1]) <= 8 * 6, out.output  # 6 blocks of 8 at most
