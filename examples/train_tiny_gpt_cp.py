"""Train examples/train_tiny_gpt.py's model with context parallelism: every rank holds a shard of each sequence.

Each rank builds the same model and draws the same batches (same seed); it keeps its zigzag shard of
every sequence (``flashtile.distributed.shard``) with the tokens' global positions, and attention runs
as ``flashtile.distributed.ring_attention`` (``--cp ring``) or ``ulysses_attention`` (``--cp ulysses``)
over the ranks. The loss is each rank's share of the whole batch's mean and the parameter gradients are
summed over the ranks (an all-reduce, as data parallelism does), so every step is the single-process step:
``--compare`` trains the single-process model too and prints both loss curves.

    python examples/train_tiny_gpt_cp.py --nproc 2 --compare       # CPU: spawns 2 gloo processes
    torchrun --nproc-per-node 2 examples/train_tiny_gpt_cp.py --compare
    torchrun --nproc-per-node 2 examples/train_tiny_gpt_cp.py --device cuda --dtype bfloat16 \\
        --seqlen 4096 --layers 6 --width 384 --heads 6 --steps 200    # GPUs (NCCL)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import flashtile  # noqa: E402
from flashtile.distributed import exit_rank, ring_attention, shard, ulysses_attention  # noqa: E402

_spec = importlib.util.spec_from_file_location("train_tiny_gpt", pathlib.Path(__file__).with_name("train_tiny_gpt.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


class ContextParallelAttention(base.CausalSelfAttention):
    """The example's attention with the sequence sharded over the default process group."""

    method = "ring"

    def forward(self, x):
        batch, seqlen, width = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        attend = ring_attention if self.method == "ring" else ulysses_attention
        out = attend(q, k, v, causal=True)  # <- the shard attends to the whole sequence
        return self.proj(out.reshape(batch, seqlen, width))


def forward_shard(model, idx, positions):
    """``TinyGPT.forward`` on a shard of tokens ``idx`` at global ``positions``."""
    x = model.tok(idx) + model.pos(positions)
    return model.head(model.norm(model.blocks(x)))


def train_cp(args, train_data, vocab):
    """This rank's run; returns the loss of every step (the whole batch's mean, the same on every rank)."""
    device, dtype = torch.device(args.device), base.DTYPES[args.dtype]
    torch.manual_seed(args.seed)  # the same initial weights on every rank (and as the single-process run)
    model = base.TinyGPT(vocab, args.seqlen, args.width, args.layers, args.heads, "flashtile").to(device)
    ContextParallelAttention.method = args.cp
    for block in model.blocks:
        block.attn.__class__ = ContextParallelAttention
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + base.math.cos(base.math.pi * step / args.steps)))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    positions = shard(torch.arange(args.seqlen, device=device)[None], dim=1)[0]
    losses, start, rank = [], time.perf_counter(), dist.get_rank()
    for step, (x, y) in zip(range(args.steps), base.batches(train_data, args.batch, args.seqlen, args.seed)):
        x, y = shard(x.to(device), dim=1), shard(y.to(device), dim=1)
        with autocast:
            logits = forward_shard(model, x, positions)
        # This rank's share of the mean over every token of the batch.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / (args.batch * args.seqlen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the ranks' shares of each gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    return losses


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    parser.add_argument("--cp", choices=["ring", "ulysses"], default="ring")
    parser.add_argument("--compare", action="store_true", help="also train in one process and compare the losses")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(base.DTYPES), default="float32")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    return parser.parse_args(argv)


def _data():
    text = base.TEXT.read_text()
    chars = sorted(set(text))
    encode = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([encode[c] for c in text])
    return data[:int(0.9 * len(data))], len(chars)


def _run_rank(args, out_file=None):
    if args.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        args.device = f"cuda:{torch.cuda.current_device()}"
    train_data, vocab = _data()
    losses = train_cp(args, train_data, vocab)
    if out_file is not None and dist.get_rank() == 0:
        torch.save(losses, out_file)
    return losses


def _spawned(rank, world, init_file, args, out_file):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    try:
        _run_rank(args, out_file)
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()
    exit_rank()  # skips the interpreter's teardown, where a gloo thread may abort the finished rank


def main(argv=None):
    """Run the example; returns ``{"losses": {"cp": [...], "single": [...] (with --compare)}, "max_diff"}``."""
    args = parse_args(argv)
    if "RANK" in os.environ:
        if args.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL picks a device
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        losses = _run_rank(args)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return None
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "losses.pt")
            mp.spawn(_spawned, args=(args.nproc, os.path.join(tmp, "init"), args, out_file), nprocs=args.nproc)
            losses = torch.load(out_file)
    result = {"losses": {"cp": losses}, "max_diff": None}
    if args.compare:
        train_data, vocab = _data()
        single = base.parse_args(["--steps", str(args.steps), "--device", args.device.split(":")[0], "--dtype",
                                  args.dtype, "--seqlen", str(args.seqlen), "--layers", str(args.layers), "--width",
                                  str(args.width), "--heads", str(args.heads), "--batch", str(args.batch), "--lr",
                                  str(args.lr), "--seed", str(args.seed), "--log-every", str(args.log_every)])
        _, result["losses"]["single"], _ = base.train(single, "flashtile", train_data, train_data, vocab)
        result["max_diff"] = max(abs(a - b) for a, b in zip(losses, result["losses"]["single"]))
        print(f"\n{'step':>5}  {'cp':>9}  {'single':>9}  {'|diff|':>8}")
        for step in sorted({*range(0, args.steps, args.log_every), args.steps - 1}):
            a, b = losses[step], result["losses"]["single"][step]
            print(f"{step:5d}  {a:9.4f}  {b:9.4f}  {abs(a - b):8.1e}")
        print(f"max |loss difference| over {args.steps} steps: {result['max_diff']:.2e}")
    print("flashtile.stats() of this process:", flashtile.stats())
    return result


if __name__ == "__main__":
    main()
