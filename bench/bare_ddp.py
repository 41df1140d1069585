"""A bare, hand-written DDP training loop: the reference the job's loop is compared against (issue: within 2 %).

torchrun --standalone --nproc-per-node 2 bench/bare_ddp.py --batch 256 --precision bf16 --channels-last --out r.json

Synthetic data made once on the GPU, so only the loop itself is compared. Nothing here is shared with trainer/:
the point is an independent implementation. Timing: warm-up steps discarded, then windows of fixed step count
between device synchronizations; throughput = images of all ranks / slowest rank's time; median of the windows.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torchvision


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--window-steps", type=int, default=40)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    dist.init_process_group("nccl", device_id=device)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    model = torchvision.models.get_model(args.model, num_classes=1000).to(device, memory_format=fmt)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(args.batch, 3, 224, 224, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler("cuda") if args.precision == "fp16" else None

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    rates = []
    for _ in range(args.windows):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.window_steps):
            step()
        torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        rates.append(args.window_steps * args.batch * dist.get_world_size() / dt.item())
    if dist.get_rank() == 0:
        result = {"imgs_per_s": statistics.median(rates), "windows": rates,
                  "spread": (max(rates) - min(rates)) / statistics.median(rates), **vars(args)}
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
