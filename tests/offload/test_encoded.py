"""Encoded expert rows (oled.model.codec, oled.offload.encoded): the lossless codec round-trips
every bf16 bit pattern, the GPU decoder (here under the Triton interpreter) matches the torch
reference, and a runtime whose misses travel encoded gives the resident tokens (lossless) or
those of the resident model with its experts round-tripped through the codec (fp8, int4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oled import kernels
from oled.model import codec
from oled.offload.budget import Budget
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.runtime import build_runtime, load_runtime

PROMPTS = ["What is the capital of France?", "Once upon a time there was a small robot"]


def weights(*shape: int, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).bfloat16()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_lossless_round_trips_every_bit_pattern():
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)  # all 65536
    table = every.view(torch.bfloat16).view(2, 256, 128)  # inf, nan, subnormals, -0 included
    rows = codec.encode(table, "lossless")
    assert torch.equal(bits(codec.decode(rows, 256 * 128)), bits(table.reshape(2, -1)))


@pytest.mark.parametrize("shape", [(3, 64, 96), (5, 40, 24), (2, 512, 128)])
def test_lossless_moves_under_70_percent_of_normal_weights(shape):
    table = weights(*shape)
    rows = codec.encode(table, "lossless", group=2)  # groups with their own layouts
    n = table[0].numel()
    assert torch.equal(bits(codec.decode(rows, n)), bits(table.reshape(shape[0], -1)))
    if n >= 8 * codec.CHUNK:  # the header and chunk table weigh on tiny rows only
        assert rows.shape[1] / (2 * n) < 0.70


def test_rows_of_different_layouts_decode_together():
    a, b = weights(2, 64, 64, seed=1), weights(2, 64, 64, seed=2, std=3.0)
    rows_a, rows_b = codec.encode(a, "lossless"), codec.encode(b, "lossless")
    width = max(rows_a.shape[1], rows_b.shape[1])
    rows = torch.zeros(4, width, dtype=torch.uint8)
    rows[:2, : rows_a.shape[1]], rows[2:, : rows_b.shape[1]] = rows_a, rows_b
    expect = torch.cat([a.reshape(2, -1), b.reshape(2, -1)])
    assert torch.equal(bits(codec.decode(rows, 64 * 64)), bits(expect))


@pytest.mark.parametrize(("name", "share", "error"), [("fp8", 0.6, 0.05), ("int4", 0.3, 0.15)])
def test_lossy_codecs_are_close_and_refuse_non_finite_weights(name, share, error):
    table = weights(3, 32, 256)
    rows = codec.encode(table, name)
    assert rows.shape[1] == codec.encoded_size((32, 256), name)
    assert rows.shape[1] / (2 * 32 * 256) < share
    back = codec.decode(rows, 32 * 256).view(table.shape).float()
    rel = (back - table.float()).norm() / table.float().norm()
    assert 0 < rel < error  # e4m3 keeps 3 mantissa bits, int4 15 levels a group: lossy, close
    table[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="inf or nan"):
        codec.encode(table, name)


def test_int4_puts_each_weight_on_its_groups_grid():
    """Each run of 128 weights of a channel on the grid of its absolute maximum / 7, at most
    half a step from the weight; 4 + 32/128 bits a weight (header and padding aside)."""
    table = weights(3, 16, 256, seed=5)
    out = codec.lossy_copy(table, "int4")
    groups = table.float().reshape(3, 16, 2, 128)
    step = groups.abs().amax(-1, keepdim=True) / 7  # [E, rows, groups, 1]
    err = (out.float().reshape(groups.shape) - groups).abs()
    rounding = groups.abs() * 2**-8  # the result is bf16
    assert (err <= step / 2 + rounding).all() and (err > 0).any()
    levels = out.float().reshape(groups.shape) / step
    assert (levels - levels.round()).abs().max() < 0.02  # on the grid (to bf16's rounding)
    n = 2048 * 512
    assert codec.encoded_size((2048, 512), "int4") / (2 * n) == pytest.approx(4.25 / 16, 1e-3)


def test_int4_needs_channels_that_split_into_groups():
    assert codec.int4_group(2048) == 128 and codec.int4_group(96) == 96
    for cols in (200, 33):
        with pytest.raises(ValueError, match=f"channels of {cols} weights"):
            codec.encode(weights(2, 4, cols), "int4")


def test_check_codec_names_the_choices_and_the_dtype():
    with pytest.raises(ValueError, match="plain, lossless, fp8"):
        codec.check_codec("zstd", torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        codec.check_codec("lossless", torch.float32)
    assert codec.describe("fp8") == "fp8 (lossy)" and codec.describe("lossless") == "lossless"


@pytest.mark.skipif(not kernels.triton_available(), reason="needs triton (its interpreter here)")
@pytest.mark.parametrize("name", ["lossless", "fp8", "int4"])
def test_the_gpu_decoder_matches_the_reference(name):
    if not kernels.interpreting() and not torch.cuda.is_available():
        pytest.skip("triton needs CUDA outside its interpreter")
    from oled.kernels.codec import decode_listed

    dev = "cuda" if not kernels.interpreting() else "cpu"
    w13, w2 = weights(3, 64, 96, seed=3).to(dev), weights(3, 96, 32, seed=4).to(dev)
    w13[0, 0, :4] = torch.tensor([-0.0, 0.0, -1e-9, 1e-9])  # signed zeros (fp8: also -1e-9)
    rows13, rows2 = codec.encode(w13, name), codec.encode(w2, name)
    landing = torch.zeros(2, 6, max(rows13.shape[1], rows2.shape[1]), dtype=torch.uint8, device=dev)
    landing[0, :3, : rows13.shape[1]], landing[1, :3, : rows2.shape[1]] = rows13, rows2
    out13 = torch.zeros(4, 64 * 96, dtype=torch.bfloat16, device=dev)
    out2 = torch.zeros(4, 96 * 32, dtype=torch.bfloat16, device=dev)
    order = [2, 0, 3]  # decoded into other rows than they landed in
    sources = [landing[0, i] for i in range(3)] + [landing[1, i] for i in range(3)]
    targets = [out13[j] for j in order] + [out2[j] for j in order]
    desc = describe_rows(sources, targets, landing)
    with kernels.serial():
        decode_listed(codec.TAGS[name], desc, landing, rows=8, chunks=-(-64 * 96 // codec.CHUNK))
    assert torch.equal(bits(out13[order]), bits(codec.decode(rows13, 64 * 96)))
    assert torch.equal(bits(out2[order]), bits(codec.decode(rows2, 96 * 32)))
    assert not out13[1].any()  # a row nobody listed stays as it was


@pytest.mark.skipif(not kernels.interpreting(), reason="the Triton interpreter decodes on the CPU")
def test_a_landing_parts_descriptor_decodes_its_rows_into_their_slots(tiny_dir):
    """The engine's descriptor for landing part 1 (oled.offload.encoded: what drive.c writes
    too) names that part's rows: decoded through it, the slots hold the experts exactly."""
    from oled.kernels.codec import decode_listed
    from oled.offload.copies import Rows, launch
    from oled.offload.encoded import LANDING, PARTS

    enc = offloaded(tiny_dir, "lossless").executor.encoded
    store = offloaded(tiny_dir, "plain").executor.store
    experts, slots = np.array([3, 0, 5]), np.array([1, 2, 0])
    w13 = torch.zeros(4, *store.w13[0].shape[1:], dtype=torch.bfloat16)
    w2 = torch.zeros(4, *store.w2[0].shape[1:], dtype=torch.bfloat16)
    assert PARTS > 1
    launch(enc.rows[1], enc.landing, experts, LANDING + np.arange(3), None)  # into part 1
    desc = torch.from_numpy(enc._descriptor(1, slots, Rows.of(w13, w2)))
    with kernels.serial():
        decode_listed(codec.LOSSLESS, desc, enc.land13, 2 * LANDING, -(-max(enc.n) // codec.CHUNK))
    assert torch.equal(bits(w13[slots]), bits(store.w13[1][experts]))
    assert torch.equal(bits(w2[slots]), bits(store.w2[1][experts]))
    assert not w13[3].any()


def describe_rows(sources: list[torch.Tensor], targets: list[torch.Tensor], base: torch.Tensor):
    """The decoder's descriptor [1 + 2M] int64 of rows (encoded source, destination) from `base`
    (what oled.offload.encoded writes from the engine's tables)."""
    desc = [len(sources)]
    for s, t in zip(sources, targets, strict=True):
        desc += [s.data_ptr() - base.data_ptr(), t.data_ptr() - base.data_ptr()]
    return torch.tensor(desc, dtype=torch.int64, device=base.device)


def answers(rt) -> list[list[int]]:
    return [rt.generate(p, max_new_tokens=24, threshold=0.6).token_ids for p in PROMPTS]


def offloaded(tiny_dir, transfer: str, compensation=None, **policies):
    policies.setdefault("retention", R.LRURetention())
    return build_runtime(
        model=str(tiny_dir),
        device="cpu",
        dtype="bfloat16",
        cost="cpu-ci",
        budget=Budget("expert_fraction", 0.25),
        compensation=compensation or C.TransferOnly(),
        stage_capacity=2,
        transfer=transfer,
        **policies,
    )


@pytest.fixture(scope="module")
def resident(tiny_dir):
    return answers(load_runtime(str(tiny_dir), device="cpu", dtype="bfloat16"))


@pytest.mark.parametrize("compensation", [C.TransferOnly, C.MakespanCompensation])
def test_lossless_transfers_give_the_resident_tokens_with_fewer_bytes(
    tiny_dir, resident, compensation
):
    plain = offloaded(tiny_dir, "plain", compensation())
    lossless = offloaded(tiny_dir, "lossless", compensation())
    assert answers(lossless) == resident == answers(plain)
    a, b = plain.stats(), lossless.stats()
    if compensation is C.TransferOnly:  # every miss copied: the same copies (Makespan prices
        assert a["copies"] == b["copies"]  # the cheaper copies and may copy more)
    assert b["copies"] > 0 and b["copy_bytes"] / b["copies"] < a["copy_bytes"] / a["copies"]
    assert lossless.executor.encoded.ratio < 1


def test_oleds_policies_with_lossless_copies_give_the_resident_tokens(tiny_dir, resident):
    """OLED's own policies (adaptive allocation, confidence retention, CPU experts computed
    from the bf16 host tables beside the encoded copies): the resident tokens."""
    from oled.policies import allocation as A

    rt = offloaded(
        tiny_dir,
        "lossless",
        C.CooperativeCompensation(),
        allocation=A.AdaptiveAllocation(),
        retention=R.ConfidenceRetention(),
    )
    assert answers(rt) == resident
    assert rt.stats()["copies"] > 0 and rt.stats()["cpu_experts"] > 0


def lossy_resident(model, codec_name: str, **kwargs):
    """The resident model with every expert round-tripped through a lossy codec: the function
    an offload engine computes when that codec carries every miss."""
    rt = load_runtime(str(model), dtype="bfloat16", **kwargs)
    table = rt.executor.table
    table.w13[:] = [codec.lossy_copy(w, codec_name) for w in table.w13]
    table.w2[:] = [codec.lossy_copy(w, codec_name) for w in table.w2]
    return rt


def logits(rt) -> list[torch.Tensor]:
    """The largest logits of every forward of the first prompt's generation."""
    from oled.decoding.follow import Trajectory

    seen = Trajectory(top_logits=8)
    rt.generate(PROMPTS[0], max_new_tokens=24, threshold=0.6, observers=[seen])
    return [values for values, _ in seen.logits]


@pytest.mark.parametrize(("transfer", "share"), [("fp8", 0.6), ("int4", 0.35)])
def test_lossy_transfers_compute_the_round_tripped_model(tiny_dir, resident, transfer, share):
    """Every miss copied through a lossy codec: the logits and tokens of the resident model
    whose experts went through it, bit for bit (not the bf16 model's), with a share of the
    bytes."""
    rt, model = offloaded(tiny_dir, transfer), lossy_resident(tiny_dir, transfer, device="cpu")
    got, want = logits(rt), logits(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    bf16 = logits(load_runtime(str(tiny_dir), device="cpu", dtype="bfloat16"))
    assert not torch.equal(got[0], bf16[0])
    assert answers(rt) == answers(model)
    assert rt.executor.encoded.ratio < share and rt.stats()["copies"] > 0


@pytest.mark.parametrize("transfer", ["lossless", "fp8", "int4"])
def test_the_decisions_price_a_copy_by_the_bytes_it_moves(tiny_dir, transfer):
    """The copy-or-CPU decisions see an encoded copy's share of the bytes (the compiled
    planner too), and the reports say so."""
    from oled.policies.base import CostModel

    rt = offloaded(tiny_dir, transfer, C.MakespanCompensation())
    share, planner = rt.executor.encoded.ratio, rt.executor.planner
    base = CostModel.profile("cpu-ci")
    assert planner.cost.copy_ms_per_expert == pytest.approx(base.copy_ms_per_expert * share)
    assert planner.cost.copy_fixed_ms == base.copy_fixed_ms
    if planner.compiled:
        assert planner.native.bind.copy_per == pytest.approx(planner.cost.copy_ms_per_expert)
    costs = rt.decisions()["costs"]
    assert costs["transfer"] == transfer and costs["copy_share"] == share
    assert costs["copy_ms_per_expert"] == planner.cost.copy_ms_per_expert
    plain = offloaded(tiny_dir, "plain", C.MakespanCompensation()).executor.planner.cost
    assert plain == base


def test_a_transfer_needs_bfloat16_and_a_known_name(tiny_dir):
    with pytest.raises(ValueError, match="bfloat16"):
        build_runtime(
            model=str(tiny_dir),
            device="cpu",
            dtype="float32",
            budget=Budget("expert_fraction", 0.25),
            transfer="lossless",
        )
    with pytest.raises(ValueError, match="unknown transfer"):
        build_runtime(model=str(tiny_dir), device="cpu", transfer="zip")


def test_too_little_host_memory_is_said_before_encoding():
    from oled.offload.encoded import check_host_memory

    check_host_memory(2**30, "lossless", available=2**31)
    with pytest.raises(ValueError, match=r"4.0 GiB needed, 1.0 GiB available"):
        check_host_memory(4 * 2**30, "lossless", available=2**30)


def test_the_quality_tool_measures_the_real_int4_codec(tmp_path):
    """tools/lossy_quality.py on the trained default: int4's bytes are the encoded rows',
    lossless changes nothing, and the offload engine with every miss copied through int4 gives
    the round-tripped model's tokens."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "lossy_quality.py"
    spec = importlib.util.spec_from_file_location("lossy_quality", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Who wrote Hamlet?"}\n{"prompt": "What is love?"}\n')
    out = tmp_path / "quality.json"
    tool.main(
        [
            "--codecs",
            "lossless,int4",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--data",
            "corpus",
            "--corpus-draws",
            "2",
            "--engine-check",
            "1",
            "--json",
            str(out),
        ]
    )
    got = json.loads(out.read_text())["codecs"]
    assert got["lossless"]["bit_exact"] and got["lossless"]["delta_val_loss"] == 0
    int4 = got["int4"]
    assert int4["lossy"] and not int4["bit_exact"] and 0.26 < int4["bytes_share"] < 0.28
    assert 0 < int4["weight_rel_rms"] < 0.15 and int4["delta_val_loss"] != 0
    assert int4["engine_check"]["identical"]
