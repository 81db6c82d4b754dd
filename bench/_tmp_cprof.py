import cProfile, pstats, os, sys, io, collections
import torch, torch.distributed as dist
import sharc
from _common import adamw, fresh_model
from compare import SIZES
from sharc.data import CharDataset
from sharc.launch import launch

WHICH = os.environ.get("WHICH", "sharc")

def main():
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SIZES["switch"]; data = CharDataset()
    model = fresh_model(cfg)
    if WHICH == "sharc":
        group = dist.new_group()
        sharc.shard(model, group, config=sharc.ShardConfig(gather_units=model.gather_units))
        fn = torch.compile(model, backend="sharc")
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, find_unused_parameters=True); fn = torch.compile(model)
    opt = adamw(model)
    def step(i):
        x, y = data.rank_batch(i, 4, cfg.block_size, rank, world)
        loss = fn(x, y); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for i in range(4): step(i)
    dist.barrier()
    pr = cProfile.Profile()
    pr.enable()
    for i in range(10): step(4 + i)
    pr.disable()
    if rank == 0:
        st = pstats.Stats(pr)
        by_file = collections.Counter()
        for (f, l, fn_), (cc, nc, tt, ct, callers) in st.stats.items():
            key = f.split("site-packages/")[-1].split("/")[0] if "site-packages" in f else ("sharc" if "/python/sharc/" in f else f[:60])
            by_file[key] += tt
        print(WHICH, "total", sum(by_file.values())/10*1e3, "ms/step")
        for k, v in by_file.most_common(15): print(f"  {k:60s} {v/10*1e3:8.2f} ms/step")
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40); print(s.getvalue()[:9000])

if __name__ == "__main__":
    launch(main, nproc=2)
