"""Batched decoding: every stream's tokens are its single-request tokens, whoever it shares
the batch with, whenever it joins; the batch's experts are planned once for all of them."""

from __future__ import annotations

import pytest
import torch

from oled.decoding import DecodeConfig
from oled.decoding.batch import BatchDecoder
from oled.decoding.decoder import _commit, select_commits
from oled.model.layers import block_causal_mask
from oled.model.model import BatchRows
from oled.offload.budget import Budget
from oled.policies import anchor_policies
from oled.runtime import build_runtime, load_runtime

PROMPTS = [
    "ROMEO:",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING HENRY:\nNow",
    "JULIET: " * 30,
    "A",
]


@pytest.fixture(scope="module")
def resident():
    return load_runtime(device="cpu")


def single(rt, ids, cfg) -> list[int]:
    return [t for block in rt.stream(ids, decode=cfg) for t in block.new_tokens]


def batched(
    rt, prompts, cfg, *, max_batch, join_at=2, cfgs=None, prefill_chunk=0
) -> tuple[dict, BatchDecoder]:
    """Half the prompts first, the rest joining after `join_at` forwards (0: all at once)."""
    dec = rt.batch_decoder(max_batch, prefill_chunk=prefill_chunk)
    out = {k: [] for k in range(len(prompts))}
    half = len(prompts) // 2 if join_at else len(prompts)
    for k in range(half):
        dec.add(prompts[k], (cfgs or {}).get(k, cfg), tag=k)
    while dec.busy:
        for ev in dec.step():
            if ev.block is not None:
                out[ev.stream.tag] += ev.block.new_tokens
        if dec.forwards == join_at:
            for k in range(half, len(prompts)):
                dec.add(prompts[k], (cfgs or {}).get(k, cfg), tag=k)
    return out, dec


def test_batch_equals_single_requests(resident):
    rt = resident
    cfg = DecodeConfig(max_new_tokens=48)
    ids = [rt.tokenizer.encode(p) for p in PROMPTS]
    cfgs = {1: DecodeConfig(max_new_tokens=20), 3: DecodeConfig(max_new_tokens=48, steps=8)}
    out, dec = batched(rt, ids, cfg, max_batch=3, cfgs=cfgs)
    for k, prompt in enumerate(ids):
        assert out[k] == single(rt, prompt, cfgs.get(k, cfg)), k
    assert len(out[1]) == 20
    assert not dec.active and dec.cache.k.shape[1] == 3  # three slots shared by five streams


def test_batch_sampling_is_each_streams_own(resident):
    rt = resident
    cfg = DecodeConfig(max_new_tokens=32, temperature=0.8, seed=3)
    ids = [rt.tokenizer.encode(p) for p in PROMPTS[:3]]
    out, _ = batched(rt, ids, cfg, max_batch=4, join_at=1)
    assert [out[k] for k in range(3)] == [single(rt, p, cfg) for p in ids]


@pytest.mark.parametrize("policy", ["lru", "oled"])
def test_offloaded_batch_equals_single_and_shares_copies(policy):
    rt = build_runtime(
        device="cpu", budget=Budget("expert_fraction", 0.25), **anchor_policies(policy)
    )
    cfg = DecodeConfig(max_new_tokens=32)
    ids = [rt.tokenizer.encode(p) for p in PROMPTS[:4]]
    alone, copies_alone = [], 0.0
    for p in ids:
        alone.append(single(rt, p, cfg))
        copies_alone += rt.offload_summary()["copies"]
    out, _ = batched(rt, ids, cfg, max_batch=4, join_at=0)
    assert [out[k] for k in range(4)] == alone
    assert rt.offload_summary()["copies"] < copies_alone  # one copy serves several streams


def test_cancelled_stream_leaves_and_frees_its_slot(resident):
    rt = resident
    cfg = DecodeConfig(max_new_tokens=64)
    ids = [rt.tokenizer.encode(p) for p in PROMPTS[:3]]
    flag = {"stop": False}
    dec = rt.batch_decoder(2)
    first = dec.add(ids[0], cfg, cancelled=lambda: flag["stop"])
    second = dec.add(ids[1], cfg)
    third = dec.add(ids[2], cfg)  # waits for a slot
    dec.step()
    assert dec.active == [first, second] and list(dec.waiting) == [third]
    flag["stop"] = True
    events = dec.step()
    assert events[0].stream is first and events[0].finished and first.stats.stopped == "cancelled"
    assert third in dec.active and third.slot == first.slot
    while dec.busy:
        dec.step()
    assert second.generated == single(rt, ids[1], cfg)
    assert third.generated == single(rt, ids[2], cfg)


def test_bad_streams_are_refused(resident):
    dec = resident.batch_decoder(2)
    with pytest.raises(ValueError, match="empty"):
        dec.add([], DecodeConfig())
    with pytest.raises(ValueError, match="block_length 16 differs"):
        dec.add([1, 2], DecodeConfig(block_length=16))
    with pytest.raises(ValueError, match="positions"):
        dec.add([1, 2], DecodeConfig(max_new_tokens=10**6))
    with pytest.raises(ValueError, match="max_batch"):
        resident.batch_decoder(0)


def test_batch_rows_mask_is_each_sequences_block_causal_mask():
    rows = BatchRows.build([1, 0], [0, 64], [40, 32], [32, 0], keys=128, device="cpu")
    mask = rows.mask(32)  # [B, 1, t_max, S]
    assert mask.shape == (2, 1, 40, 128)
    assert torch.equal(mask[0, 0, :, :40], block_causal_mask(0, 40, 32, "cpu"))
    assert not mask[0, 0, :, 40:].any()
    assert mask[1, 0, :32, :96].all() and not mask[1, 0, :, 96:].any()
    assert rows.logit_rows.tolist() == [*range(32, 40), *range(40, 72)]
    assert rows.shape == (72, 2, 40, 128, 40)
    with pytest.raises(ValueError, match="do not cover"):
        BatchRows.build([0], [100], [32], [0], keys=128, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_graphs_agree_with_single_requests():
    """On CUDA the batch's GEMMs run over more rows than one request's, so its logits match
    only to rounding: the trained default's answers still agree token for token, and the
    batched forwards replay as graphs."""
    rt = load_runtime(device="cuda")
    cfg = DecodeConfig(max_new_tokens=48)
    ids = [rt.tokenizer.encode(p) for p in PROMPTS]
    out, _ = batched(rt, ids, cfg, max_batch=4)
    assert any(key[0] == "batch" for key in rt.forward.captured)  # before a single request's
    # cache (which drops every graph) is made
    agree = sum(out[k] == single(rt, p, cfg) for k, p in enumerate(ids))
    assert agree == len(ids)


def test_long_bf16_generations_equal_single_requests(resident):
    """Hundreds of forwards in bf16, one commit each: attention per stream over exactly its
    keys keeps every rounding a single request makes (padded keys would not)."""
    rt = resident
    cfg = DecodeConfig(max_new_tokens=288, threshold=1.0)
    ids = [rt.tokenizer.encode(p) for p in ["ROMEO:", "KING HENRY:\nNow"]]
    out, _ = batched(rt, ids, cfg, max_batch=2, join_at=5)
    assert [out[0], out[1]] == [single(rt, p, cfg) for p in ids]
    assert len(out[0]) > 256  # past the 256 positions the cache starts with: it grew


def _ranked(conf: list[float], masked: list[bool], cfg: DecodeConfig, it: int) -> list[bool]:
    """The commit rule for one sequence, position by position: open positions at or above
    the threshold (strictly above when strict), and the `at_least` best open ones, the earlier
    position first among equals."""
    n = cfg.at_least(it)
    order = sorted((i for i in range(len(conf)) if masked[i]), key=lambda i: (-conf[i], i))
    best = set(order[:n])
    thr = torch.tensor(cfg.threshold, dtype=torch.float32).item()  # compared in fp32
    return [
        m and (i in best or (c > thr if cfg.strict_threshold else c >= thr))
        for i, (c, m) in enumerate(zip(conf, masked, strict=True))
    ]


def test_batched_commit_equals_each_streams_commit_with_ties():
    """One batched commit step over streams with their own thresholds, strictness and steps
    schedules commits what each stream's own commit does, ties included (the earlier of equal
    confidences first)."""
    gen = torch.Generator().manual_seed(0)
    cfgs = [
        DecodeConfig(block_length=8, threshold=0.95),
        DecodeConfig(block_length=8, threshold=0.5, strict_threshold=True),
        DecodeConfig(block_length=8, threshold=1.0, steps=3),  # 3, 3, 2
        DecodeConfig(block_length=8, threshold=0.9, steps=8),
        DecodeConfig(block_length=8, threshold=1.0),
    ]
    for it in range(4):
        conf = torch.randint(0, 4, (5, 8), generator=gen).float() / 4  # many ties
        conf[1, 2] = 0.5  # on a strict threshold
        masked = torch.rand(5, 8, generator=gen) < 0.7
        masked[:, 0] = True  # every stream has an open position
        batch = select_commits(
            conf,
            masked,
            torch.tensor([[c.threshold] for c in cfgs], dtype=torch.float32),
            torch.tensor([[c.strict_threshold] for c in cfgs]),
            torch.tensor([[c.at_least(it)] for c in cfgs]),
        )
        for b, cfg in enumerate(cfgs):
            alone = _commit(conf[b], masked[b], cfg, it)
            assert (
                batch[b].tolist()
                == alone.tolist()
                == _ranked(conf[b].tolist(), masked[b].tolist(), cfg, it)
            ), (it, b)
            assert batch[b].any()  # at least one commit per stream


def test_tie_commits_the_earlier_position():
    conf = torch.tensor([[0.5, 0.7, 0.7, 0.7]])
    masked = torch.tensor([[True, True, True, True]])
    assert select_commits(conf, masked, 0.95, False, 1).tolist() == [[False, True, False, False]]
    assert select_commits(conf, masked, 0.95, False, 2).tolist() == [[False, True, True, False]]


def test_mixed_rules_in_one_batch_equal_single_requests(resident):
    rt = resident
    ids = [rt.tokenizer.encode(p) for p in PROMPTS[:4]]
    cfgs = {
        0: DecodeConfig(max_new_tokens=40, threshold=0.6),
        1: DecodeConfig(max_new_tokens=40, threshold=0.8, strict_threshold=True),
        2: DecodeConfig(max_new_tokens=40, steps=4, threshold=1.0),
        3: DecodeConfig(max_new_tokens=40),
    }
    out, _ = batched(rt, ids, cfgs[3], max_batch=4, join_at=3, cfgs=cfgs)
    assert [out[k] for k in range(4)] == [single(rt, p, cfgs[k]) for k, p in enumerate(ids)]


@pytest.fixture(scope="module")
def resident_fp32():
    return load_runtime(device="cpu", dtype="float32")


@pytest.mark.parametrize("chunk", [32, 64])
def test_chunked_prefill_equals_unchunked(resident_fp32, chunk):
    """Prompts taken in chunks of whole blocks under a per-forward budget, while other streams
    decode, give the answers of the prompt taken in one forward. In fp32: in bf16 an expert's
    GEMM rounds by how many rows share it, which any other arrangement of rows in forwards
    changes (so batches match single requests only to rounding, as on CUDA)."""
    rt = resident_fp32
    long = rt.tokenizer.encode("JULIET: O Romeo, Romeo, wherefore art thou Romeo? " * 16)
    ids = [rt.tokenizer.encode(PROMPTS[1]), rt.tokenizer.encode(PROMPTS[3]), long, long[:70]]
    assert len(long) > 3 * chunk  # it joins the first two while they decode
    cfg = DecodeConfig(max_new_tokens=40)
    whole, _ = batched(rt, ids, cfg, max_batch=4, join_at=2, prefill_chunk=0)
    out, dec = batched(rt, ids, cfg, max_batch=4, join_at=2, prefill_chunk=chunk)
    assert [out[k] for k in range(4)] == [whole[k] for k in range(4)]
    assert [out[k] for k in range(4)] == [single(rt, p, cfg) for p in ids]
    assert dec.prefill_chunk == chunk


def test_offloaded_chunked_prefill_equals_single_requests():
    """Prompt-only rows reach the offload policies as fixed tokens; the answers hold."""
    rt = build_runtime(
        device="cpu",
        dtype="float32",
        budget=Budget("expert_fraction", 0.25),
        **anchor_policies("oled"),
    )
    long = rt.tokenizer.encode("KING HENRY: Once more unto the breach, dear friends. " * 8)
    ids = [rt.tokenizer.encode(PROMPTS[0]), long, rt.tokenizer.encode(PROMPTS[2])]
    cfg = DecodeConfig(max_new_tokens=24)
    alone = [single(rt, p, cfg) for p in ids]
    out, _ = batched(rt, ids, cfg, max_batch=3, join_at=1, prefill_chunk=32)
    assert [out[k] for k in range(3)] == alone


def test_a_prompt_joining_an_idle_batch_is_taken_whole(resident):
    rt = resident
    long = rt.tokenizer.encode("JULIET: O Romeo, Romeo, wherefore art thou Romeo? " * 16)
    cfg = DecodeConfig(max_new_tokens=40)
    dec = rt.batch_decoder(2, prefill_chunk=32)
    stream = dec.add(long, cfg)
    dec.step()
    assert dec.last.prefill == len(long) // 32 * 32 and stream.decoding  # nobody to wait
    while dec.busy:
        dec.step()
    assert stream.generated == single(rt, long, cfg)


def test_prefill_budget_shares_forwards_with_running_streams(resident):
    rt = resident
    long = rt.tokenizer.encode("KING HENRY: Once more unto the breach, dear friends. " * 6)
    dec = rt.batch_decoder(2, prefill_chunk=40)  # whole blocks: 32 prompt rows a forward
    running = dec.add(rt.tokenizer.encode("ROMEO:"), DecodeConfig(max_new_tokens=64))
    dec.step()
    joining = dec.add(long, DecodeConfig(max_new_tokens=8))
    prefill = []
    while not joining.decoding or dec.last.prefill:
        dec.step()
        prefill.append(dec.last.prefill)
        assert dec.last.running == 1 or not dec.last.prefill  # the running stream decodes
    assert max(prefill) <= 32 and len(prefill) >= len(long) // 32
    while dec.busy:
        dec.step()
    assert running.stats.iterations == dec.forwards  # it ran in every forward
    assert joining.stats.iterations < dec.forwards - 1
    with pytest.raises(ValueError, match="prefill_chunk"):
        rt.batch_decoder(2, prefill_chunk=-1)


def test_steady_forwards_reuse_their_layout(resident):
    """Within blocks the host lays out nothing: a forward's rows are laid out again only when
    a stream joins, leaves, ends a block or has prefix rows pending."""
    rt = resident
    cfg = DecodeConfig(max_new_tokens=64, threshold=1.0)  # one commit a forward
    dec = rt.batch_decoder(2)
    for p in PROMPTS[:2]:
        dec.add(rt.tokenizer.encode(p), cfg)
    layouts = []
    while dec.busy:
        dec.step()
        layouts.append(dec._layout)
    laid_out = len({id(lay) for lay in layouts if lay is not None})
    assert dec.forwards > 4 * laid_out  # 2 streams x 2-3 blocks, ~64 forwards


@pytest.mark.parametrize("exact", [True, False])
def test_a_forward_lays_a_batch_out_as_it_says(resident, exact):
    """EagerForward(exact_batches=False) lays a batch's rows out as the graphed forward does
    (padded query blocks, what `--profile` times on CUDA); the default attends per sequence."""
    from oled.model.graphs import EagerForward

    rt = resident
    dec = BatchDecoder(
        rt.model,
        mask_id=rt.tokenizer.mask_id,
        forward=EagerForward(rt.model, exact_batches=exact),
        max_batch=2,
    )
    for p in PROMPTS[:2]:
        dec.add(rt.tokenizer.encode(p), DecodeConfig(max_new_tokens=8))
    dec.step()
    assert dec._layout is not None
    assert (dec._layout.rows.spans is not None) == exact
