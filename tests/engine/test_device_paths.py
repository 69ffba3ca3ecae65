"""A CPU-only dry run of the code that only runs with a GPU: placement on the ``meta`` device (a
device that is not the CPU, which torch has everywhere) and torch.cuda's queries monkeypatched, so
that a slip on a CUDA branch fails here rather than on the first GPU lent."""

import types

import pytest
import torch
from torch import nn

from featcal.engine import distributed
from featcal.engine.blocksource import DeviceBlocks, check_device, move_streams, streams_fit
from featcal.model.streams import BlockCall

META = torch.device("meta")
CUDA = torch.device("cuda", 0)  # a torch.device names CUDA without touching a GPU


def _streams(rows: int = 6, width: int = 4):
    """Two tasks' streams, each one call of a decoder-like block: every field of a BlockCall set."""

    def call():
        return BlockCall(
            torch.randn(1, rows, width),
            (torch.zeros(1, rows, rows),),
            {"bias": torch.ones(rows)},
            None,
            torch.ones(1, rows),
            torch.ones(1, 3),
            ("cross.q",),
            ((1, 0),),
        )

    return {t: types.SimpleNamespace(cal=[call()], exp=[call()]) for t in ("a", "b")}


def _bytes(streams) -> int:
    return sum(c.hidden.numel() * c.hidden.element_size() for st in streams.values() for c in st.cal + st.exp)


def test_move_streams_moves_every_tensor_and_keeps_every_field():
    streams = _streams()
    move_streams(streams, META)
    for st in streams.values():
        for c in st.cal + st.exp:
            assert c.hidden.is_meta and c.args[0].is_meta and c.kwargs["bias"].is_meta
            assert c.mask.is_meta and c.memory_mask.is_meta  # the cross-attention's padding goes too
            assert (c.memory_sites, c.carries) == (("cross.q",), ((1, 0),))


def test_streams_stay_on_a_gpu_only_when_they_fit_in_a_quarter_of_its_free_memory(monkeypatch):
    streams = _streams()
    need = _bytes(streams)
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return free, 80 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    free = 4 * need
    assert streams_fit(streams, CUDA)
    free = 4 * need - 4
    assert not streams_fit(streams, CUDA)
    assert streams_fit(streams, CUDA, share=1.0)
    assert asked == [CUDA] * 3
    assert streams_fit(streams, META)  # not CUDA: nothing asked
    assert len(asked) == 3


def test_check_device_names_the_missing_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda' was asked.*use device='cpu'"):
        check_device("cuda")
    assert check_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_device("cuda:0") == CUDA


def _lists():
    torch.manual_seed(0)
    return [nn.ModuleList(nn.Linear(4, 4) for _ in range(3)) for _ in range(3)]


def test_device_blocks_keep_fitting_streams_on_the_device():
    lists = _lists()
    source = DeviceBlocks(META, lists[0], lists[1:])
    streams = source.streams(_streams)
    assert all(c.hidden.is_meta for st in streams.values() for c in st.cal + st.exp)
    assert not source.offload(streams)


def test_device_blocks_send_streams_home_when_they_do_not_fit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 80 * 2**30))
    lists = _lists()
    source = DeviceBlocks(CUDA, lists[0], lists[1:])
    streams = source.streams(_streams)
    assert all(c.hidden.device.type == "cpu" for st in streams.values() for c in st.cal + st.exp)
    assert source.offload(streams)


def test_device_blocks_move_one_block_of_every_model_and_bring_it_home():
    lists = _lists()
    source = DeviceBlocks(META, lists[0], lists[1:])
    source.enter(1)
    for blocks in lists:
        assert blocks[1].weight.is_meta  # block 1 of the calibrated model, the base and the expert
        assert blocks[0].weight.device.type == blocks[2].weight.device.type == "cpu"
    moved_home = []
    for blocks in lists:  # the meta copies have no values to bring back: record the moves instead
        blocks[1].to = lambda device, _m=moved_home: _m.append(device)
    source.leave(1, {}, None)
    assert moved_home == [torch.device("cpu")] * 3
    source.close()  # nothing entered: nothing moves
    assert len(moved_home) == 3


def test_streamed_block_info_reads_the_gpu_peak_on_cuda_only(monkeypatch):
    from featcal.streaming.source import block_info

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**20)
    info = block_info(1.5, CUDA)
    assert info["wall_seconds"] == 1.5 and info["peak_gpu_mb"] == 3.0 and info["peak_rss_mb"] > 0
    assert "peak_gpu_mb" not in block_info(1.5, torch.device("cpu"))


def test_a_launcher_on_cuda_gets_nccl_and_its_local_gpu(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(index))
    assert distributed.init_from_env("cuda")
    assert calls == [1, "nccl"]
    assert distributed.init_from_env("cpu")
    assert calls == [1, "nccl", "gloo"]  # no GPU chosen for a CPU run


@pytest.mark.filterwarnings("ignore:task .* token rows")
def test_t5_one_block_at_a_time_on_another_device_is_the_plain_run():
    """``device="cpu:0"`` is another torch device than the models' ``cpu``: the engine takes the
    accelerator's path (DeviceBlocks: blocks moved there and back, the streams moved once) on the
    CPU. T5's decoder reads the encoder's padding mask and carries its position bias from block to
    block: both must survive the move (they were dropped, and its cross-attention refused the
    decoder's mask)."""
    import tiny
    from featcal import FeatCalConfig, calibrate

    base, experts, merged, data = tiny.text_zoo(tiny.tiny_t5, lambda seed: tiny.t5_batches(seed=seed))
    kw = dict(base=base, experts=experts, calib_data=data, config=FeatCalConfig(stats_dtype=torch.float64))
    plain, _ = calibrate(merged, progress=False, **kw)
    moved, _ = calibrate(merged, progress=False, device="cpu:0", **kw)
    want = plain.state_dict()
    for k, v in moved.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-9, atol=1e-12, msg=k)


def test_the_inference_timer_waits_for_the_gpu_around_the_call(monkeypatch):
    """The trained calibrators' inference timing synchronises CUDA before and after the call
    (else it times the launch, not the work) and nothing on other devices."""
    from featcal.baselines.trained import calibrators

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append("sync"))
    model = nn.Linear(3, 2)
    calibrators._timed(model, torch.zeros(1, 3))
    assert synced == []
    monkeypatch.setattr(calibrators, "device_of", lambda m: CUDA)
    assert calibrators._timed(model, torch.zeros(1, 3)) >= 0
    assert synced == ["sync", "sync"]
