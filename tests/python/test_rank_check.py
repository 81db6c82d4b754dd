"""Calls that are collective although they look local (a read outside
forward, full_state_dict, load_full_state_dict, unsharded) check on a side
group that every rank made them with the same input: a rank alone raises
after ShardConfig.rank_check_timeout_s, naming the call; ranks that load
different values all raise before anything changes."""

import pytest
import torch

from dist_harness import run_ranks

from sharc._rank_check import checksum


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _lone_call(rank, world, call):
    import sharc

    model = _model()
    sharc.shard(model, config=sharc.ShardConfig(rank_check_timeout_s=2))
    before = sharc.full_state_dict(model)
    shards = [p.detach().clone() for p in model.parameters()]
    message = "no error"
    if rank == 0:
        try:
            if call == "full_state_dict":
                sharc.full_state_dict(model)
            elif call == "load_full_state_dict":
                sharc.load_full_state_dict(model, {k: v * 0 for k, v in before.items()})
            elif call == "state_dict()":  # torch.save(model.state_dict()) on rank 0
                model.state_dict()
            else:
                with sharc.unsharded(model):
                    pass
        except RuntimeError as e:
            message = str(e)
    model(torch.ones(2, 4)).sum().backward()  # the model's group is in step: training goes on
    return message, all(torch.equal(a, b) for a, b in zip(shards, model.parameters()))


@pytest.mark.parametrize("call, what", [
    ("full_state_dict", "sharc.full_state_dict"),
    ("load_full_state_dict", "sharc.load_full_state_dict"),
    ("unsharded", "sharc.unsharded"),
    ("state_dict()", "state_dict() of a sharded module ('0.weight')")])
def test_a_collective_call_on_one_rank_raises_there(call, what):
    (first, same0), (second, same1) = run_ranks(_lone_call, 2, call, timeout=120)
    assert f"sharc: {what} is collective" in first
    assert "not every rank did within 2 s" in first
    assert second == "no error"
    assert same0 and same1  # nothing was loaded on either rank


def _load_different(rank, world, swap):
    import sharc

    model = _model()
    sharc.shard(model)
    state = sharc.full_state_dict(model)
    given = {k: v + 1 for k, v in state.items()}
    if rank == 1:
        if swap:  # two elements of one tensor swapped: a sum would not see it
            w = given["0.weight"].clone().view(-1)
            w[0], w[1] = w[1].clone(), w[0].clone()
            given["0.weight"] = w.view(4, 4)
        else:
            given["1.bias"] = given["1.bias"] + 1
    try:
        sharc.load_full_state_dict(model, given)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    after = sharc.full_state_dict(model)
    return message, all(torch.equal(state[k], after[k]) for k in state)


@pytest.mark.parametrize("swap", [False, True], ids=["changed", "swapped"])
def test_ranks_loading_different_state_dicts_all_raise_before_loading(swap):
    for message, unchanged in run_ranks(_load_different, 2, swap, timeout=120):
        assert "the ranks disagree at sharc.load_full_state_dict" in message
        assert "rank 0 is at sharc.load_full_state_dict" in message
        assert unchanged


def test_checksum_is_order_and_value_sensitive():
    a = {"x": torch.arange(4.0), "y": torch.ones(2)}
    assert checksum(a) == checksum({k: v.clone() for k, v in a.items()})
    assert checksum(a) != checksum({"y": a["y"], "x": a["x"]})
    assert checksum(a) != checksum({"x": torch.tensor([1.0, 0.0, 2.0, 3.0]), "y": a["y"]})
    assert checksum(a) != checksum({"x": a["x"].double(), "y": a["y"]})
    assert checksum({"b": torch.zeros(2, dtype=torch.bfloat16)}) >= 0
