"""The CUDA path (issue 12): skipped, saying why, where no GPU is present.

On a GPU machine run `bash scripts/gpu_check.sh`, which builds sharc against
the installed CUDA torch and runs this file (with pytest, or without it as
`python tests/python/test_cuda.py`). What it checks, with a real NCCL
process group of world size 1:
- sharded training matches unsharded training, eager and compiled;
- a release frees device memory for real, and the allocator reuses it;
- the same losses with and without CUDA_LAUNCH_BLOCKING (no use of a buffer
  before its collective's wait is ordered on the compute stream);
- a bf16 gather is bitwise the cast shard, gathered.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU and a CUDA build of torch: run scripts/gpu_check.sh on one")

STEPS = 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 1)).cuda()


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 64, generator=g).cuda()


def _train(rank, world, mode):
    """Losses and final parameters: unsharded ("plain") or sharded."""
    import sharc

    model = _model()
    if mode != "plain":
        sharc.shard(model)
    step_fn = torch.compile(model, backend="sharc") if mode == "compiled" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        loss = step_fn(_batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = sharc.full_state_dict(model) if mode != "plain" else model.state_dict()
    return losses, {k: v.detach().cpu() for k, v in state.items()}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_sharded_training_matches_unsharded_on_one_gpu(mode):
    [(plain_losses, plain_state)] = run_ranks(_train, 1, "plain", backend="nccl")
    [(losses, state)] = run_ranks(_train, 1, mode, backend="nccl", timeout=600)
    assert losses == pytest.approx(plain_losses, rel=1e-4)
    for name, value in plain_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)


def _release_frees(rank, world):
    import sharc
    from sharc.api import sharded_root

    lin = torch.nn.Linear(1024, 1024, bias=False).cuda()
    sharc.shard(lin)
    runtime = sharded_root(lin).runtime
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    full = runtime.gather(0)
    torch.cuda.synchronize()
    gathered = torch.cuda.memory_allocated()
    del full
    runtime.release(0)
    torch.cuda.synchronize()
    released = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    again = torch.empty(1024 * 1024, device="cuda")  # the same size: reuses the block
    reused = torch.cuda.memory_reserved() == reserved
    del again
    return gathered - before, gathered - released, reused


def test_release_frees_device_memory():
    [(grown, freed, reused)] = run_ranks(_release_frees, 1, backend="nccl")
    assert grown == 1024 * 1024 * 4
    assert freed == grown
    assert reused


def test_losses_do_not_depend_on_launch_blocking():
    """Run in subprocesses: CUDA_LAUNCH_BLOCKING must be set before CUDA starts."""
    results = []
    for blocking in ("0", "1"):
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING=blocking)
        out = subprocess.run([sys.executable, __file__, "--print-losses"], env=env,
                             capture_output=True, text=True, timeout=600, check=True)
        results.append(out.stdout.strip().splitlines()[-1])
    assert results[0] == results[1]


def _bf16_gather(rank, world):
    import sharc
    from sharc.api import sharded_root

    lin = torch.nn.Linear(33, 17).cuda()  # odd sizes: padding
    full = lin.weight.detach().clone()
    sharc.shard(lin, config=sharc.ShardConfig(
        mixed_precision=sharc.MixedPrecision(param_dtype=torch.bfloat16)))
    gathered = sharded_root(lin).runtime.gather(0).clone()
    sharded_root(lin).runtime.release(0)
    return torch.equal(gathered.cpu(), full.to(torch.bfloat16).cpu()), gathered.dtype


def test_bf16_gather_is_the_cast_shard_gathered():
    [(equal, dtype)] = run_ranks(_bf16_gather, 1, backend="nccl")
    assert dtype == torch.bfloat16
    assert equal


def _main() -> int:
    """Without pytest: `--print-losses` prints one compiled run's losses (for
    the launch-blocking test); otherwise every test runs and is reported."""
    if "--print-losses" in sys.argv:
        [(losses, _)] = run_ranks(_train, 1, "compiled", backend="nccl", timeout=600)
        print(" ".join(f"{v:.8e}" for v in losses))
        return 0
    if not torch.cuda.is_available():
        print("test_cuda: no CUDA GPU; nothing to run")
        return 1
    failed = 0
    cases = [(test_sharded_training_matches_unsharded_on_one_gpu, ("eager",)),
             (test_sharded_training_matches_unsharded_on_one_gpu, ("compiled",)),
             (test_release_frees_device_memory, ()), (test_losses_do_not_depend_on_launch_blocking, ()),
             (test_bf16_gather_is_the_cast_shard_gathered, ())]
    for test, args in cases:
        try:
            test(*args)
            print(f"PASSED {test.__name__}{args}")
        except Exception as e:  # noqa: BLE001  (reported, counted)
            failed += 1
            print(f"FAILED {test.__name__}{args}: {e!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(_main())
