"""Release frees the padded base storage even while views of it are alive,
and the accounting shows the bytes gone."""

import pytest
import torch

from dist_harness import run_ranks


def _release_cases(rank, world):
    import sharc
    from sharc.api import sharded_root

    lin = torch.nn.Linear(5, 3)  # 15 weight elements: padded to 16 on 2 ranks
    sharc.shard(lin)
    rt = sharded_root(lin).runtime
    out = {}

    view = rt.gather(0)
    out["view_shape"] = tuple(view.shape)
    out["bytes_gathered"] = sharc.memory_stats()["gathered_bytes"]
    out["storage_gathered"] = view.untyped_storage().nbytes()
    rt.release(0, "free")
    out["storage_released"] = view.untyped_storage().nbytes()  # stale view still alive
    out["base_released"] = rt.padded_base(0).untyped_storage().nbytes()
    out["bytes_released"] = sharc.memory_stats()["gathered_bytes"]
    out["state_released"] = rt.state(0)

    # Two holds (a parameter used twice): the first release keeps the bytes.
    rt.gather(0)
    rt.gather(0)
    rt.release(0, "free")
    out["after_first_of_two"] = rt.padded_base(0).untyped_storage().nbytes()
    rt.release(0, "free")
    out["after_second_of_two"] = rt.padded_base(0).untyped_storage().nbytes()

    # A persistent parameter keeps the same storage across release.
    rt.set_persistent(0, True)
    ptr = rt.gather(0).untyped_storage().data_ptr()
    rt.release(0, "free")
    out["persistent_bytes"] = rt.padded_base(0).untyped_storage().nbytes()
    out["persistent_same_storage"] = rt.gather(0).untyped_storage().data_ptr() == ptr
    rt.release(0, "free")
    rt.set_persistent(0, False)
    rt.gather(0)
    rt.release(0, "free")

    with pytest.raises(RuntimeError, match="cannot release parameter 'weight': it is released"):
        rt.release(0, "free")
    rt.gather(0)
    with pytest.raises(RuntimeError, match="unknown release mode 'drop'; the modes are "
                                           "'free', 'free_or_hand_over', 'hand_over'"):
        rt.release(0, "drop")
    rt.release(0, "free")
    out["peak"] = sharc.memory_stats()["peak_gathered_bytes"]
    return out


def test_release_frees_base_storage_while_views_live():
    for out in run_ranks(_release_cases, 2):
        full_bytes = 16 * 4
        assert out["view_shape"] == (3, 5)
        assert out["storage_gathered"] == full_bytes
        assert out["bytes_gathered"] == full_bytes
        assert out["storage_released"] == 0
        assert out["base_released"] == 0
        assert out["bytes_released"] == 0
        assert out["state_released"] == "released"
        assert out["after_first_of_two"] == full_bytes
        assert out["after_second_of_two"] == 0
        assert out["persistent_bytes"] == full_bytes
        assert out["persistent_same_storage"]
        assert out["peak"] == full_bytes


def _release_modes(rank, world):
    import sharc
    from sharc.api import sharded_root

    lin = torch.nn.Linear(5, 3)
    sharc.shard(lin)
    rt = sharded_root(lin).runtime
    out = {}
    # "free": the bytes go in place, even under a live reference.
    kept = rt.gather(0)
    out["free"] = (rt.release(0, "free"), kept.untyped_storage().nbytes())
    # "free_or_hand_over": a live handed-out tensor keeps the buffer ...
    kept = rt.gather(0)
    base = rt.padded_base(0).untyped_storage().data_ptr()
    out["kept"] = (rt.release(0, "free_or_hand_over"), kept.untyped_storage().nbytes(),
                   rt.padded_base(0).untyped_storage().data_ptr() != base)
    del kept
    # ... and without one the bytes go.
    rt.gather(0)
    out["dropped"] = (rt.release(0, "free_or_hand_over"),
                      rt.padded_base(0).untyped_storage().nbytes())
    # "hand_over": the last hold always hands the buffer over.
    rt.gather(0)
    rt.gather(0)
    out["hand_over"] = (rt.release(0, "hand_over"), rt.release(0, "hand_over"))
    out["gathered_bytes"] = sharc.memory_stats()["gathered_bytes"]
    return out


def test_release_modes():
    for out in run_ranks(_release_modes, 2):
        assert out["free"] == (False, 0)
        assert out["kept"] == (True, 16 * 4, True)
        assert out["dropped"] == (False, 0)
        assert out["hand_over"] == (False, True)
        assert out["gathered_bytes"] == 0


def _stale_read(rank, world):
    import torch.distributed as dist

    from sharc._library import Runtime
    from sharc.debug import ReleasedParameterRead, released_reads_raise

    rt = Runtime.for_group(dist.group.WORLD.group_name)
    pid = rt.register_param(torch.ones(4, 4), "w")
    kept = rt.gather(pid)  # released in place below, as compiled graphs release
    rt.release(pid, "free")
    assert kept.untyped_storage().nbytes() == 0
    with released_reads_raise():
        try:
            kept + 1
        except ReleasedParameterRead as e:
            return str(e)
    return None


def test_debug_mode_reports_reads_of_released_parameters():
    for message in run_ranks(_stale_read, 2):
        assert message is not None and "released by sharc" in message
