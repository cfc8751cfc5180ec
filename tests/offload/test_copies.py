"""Row copies between expert tables (the CPU path; tests/offload/test_gpu.py runs the CUDA one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oled.offload.copies import Rows, launch


def test_rows_copy_into_the_named_slots():
    src = (torch.randn(5, 4, 3), torch.randn(5, 3, 2))
    dst = (torch.zeros(2, 4, 3), torch.zeros(2, 3, 2))
    launch(Rows.of(*src), Rows.of(*dst), [4, 1], [1, 0], None)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, s[[1, 4]])


def test_rows_need_contiguous_tables():
    with pytest.raises(ValueError, match="contiguous"):
        Rows.of(torch.zeros(4, 3, 2).transpose(1, 2), torch.zeros(4, 2, 2))


def test_calibration_measures_the_engine_paths_and_caches(tmp_path, monkeypatch, one_thread):
    from oled.model.experts import ExpertStore
    from oled.offload import calibrate
    from oled.offload.calibrate import calibrated_cost, stored_calibrations

    monkeypatch.setattr(calibrate, "contended", lambda threads, cores, others: False)  # quiet
    store = ExpertStore.empty(  # the tiny model's experts: a per-token cost clear of the noise
        layers=1, experts=8, hidden=256, inter=128, dtype=torch.float32, pin=False
    )
    for w in (*store.w13, *store.w2):
        w.normal_()
    first = calibrated_cost(store, torch.device("cpu"), tmp_path)
    cost = first.cost
    assert cost.copy_ms_per_expert > 0 and cost.cpu_fixed_ms > 0 and cost.gpu_fixed_ms >= 0
    assert list(tmp_path.glob("cost-*")) == [first.file]  # one file, no temporary left
    again = calibrated_cost(store, torch.device("cpu"), tmp_path)
    assert again == first  # read back: the same costs, key and time, so the same decisions
    described = first.describe()
    assert described["source"] == "calibrated" and described["dtype"] == "float32"
    assert described["expert shape"] == "(256, 256)" and described["measured"] == first.measured
    stored = stored_calibrations(tmp_path)
    assert stored == [first]
    first.file.write_text("{not json")  # a damaged file is measured again, not an error
    assert calibrated_cost(store, torch.device("cpu"), tmp_path).cost.copy_ms_per_expert > 0


def test_transfer_without_a_stream_copies_at_once():
    from oled.offload.copies import transfer

    src, dst = torch.arange(6.0).view(2, 3), torch.zeros(2, 3)
    transfer(dst, src, None)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("fail_index", [False, True])
def test_a_batched_launch_names_every_row_of_both_tables(fail_index):
    """cudaMemcpyBatchAsync's arguments: the w13 rows, then the w2 rows, at their addresses;
    CUDA 12.8-12.9's form with a failure index before the stream."""
    from oled.offload import copies

    seen = {}

    def runtime(dsts, srcs, sizes, count, attrs, attr_index, num_attrs, *rest):
        seen.update(dsts=list(dsts), srcs=list(srcs), sizes=list(sizes), count=count, rest=rest)
        seen.update(first=attr_index[0], num_attrs=num_attrs)
        return 0

    src = Rows(views=((), ()), base=(1000, 5000), size=(10, 4), on_cuda=False)
    dst = Rows(views=((), ()), base=(90000, 95000), size=(10, 4), on_cuda=True)
    batch = copies._BatchCopy(runtime, fail_index)
    assert batch(src, dst, np.array([3, 0]), np.array([1, 2]), "stream") == 0
    assert seen["srcs"] == [1030, 1000, 5012, 5000]
    assert seen["dsts"] == [90010, 90020, 95004, 95008]
    assert seen["sizes"] == [10, 10, 4, 4] and seen["count"] == 4
    assert seen["first"] == 0 and seen["num_attrs"] == 1
    assert seen["rest"][-1] == "stream" and len(seen["rest"]) == 1 + fail_index
