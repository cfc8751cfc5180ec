"""Block diffusion decoding: prefix cache equivalence, threshold semantics, stopping."""

from __future__ import annotations

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
    assert _commit(conf, masked, 0.95).tolist() == [False, True, False, True]
    low = torch.tensor([0.2, 0.3, 0.99, 0.1])
    assert _commit(low, masked, 0.95).tolist() == [False, True, False, False]


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
