"""Training steps end to end: forward + backward of a Llama-shaped causal LM through transformers, with
``attn_implementation`` = flashtile and sdpa, the same seeded weights, the same token batch.

Two models: ``8b`` is Llama-3-8B's layer shape (hidden 4096, 32/8 heads, MLP 14336, vocab 128256) with
few layers; ``small`` keeps head dim 128 and GQA but is 1024 wide (8/2 heads, MLP 3584, vocab 32000),
the size where a step is short and the host's time per call shows. A step is
``model(input_ids, labels=input_ids).loss.backward()`` with the gradients dropped before it (no
optimizer). Each round times ``--runs`` steps of each implementation in turn (the host's speed drifts
between rounds); ms per step is the median of the rounds' medians, the device synchronized after each step.

    PYTHONPATH=. python benchmarks/train_step.py --label after   -> $OUT (default /tmp)/h200-train-step-<label>.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from flashtile.bench import e2e

IMPLEMENTATIONS = ("flashtile", "sdpa")
MODELS = {
    "8b": dict(layers=4, overrides={}),
    "small": dict(layers=8, overrides=dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                           num_key_value_heads=2, head_dim=128, vocab_size=32000)),
}


def step_ms(model, ids, runs):
    """Median and best wall-clock ms of ``runs`` training steps, and the last loss."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), float(loss.detach())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="run")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--shapes", nargs="+", default=["1x512", "4x512", "1x2048"], help="batch x seqlen")
    parser.add_argument("--runs", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each implementation in turn (host noise)")
    opts = parser.parse_args()
    rows = []
    for name in opts.models:
        spec = MODELS[name]
        models = {impl: e2e.build_model(impl, spec["layers"], torch.bfloat16, "cuda", **spec["overrides"]).train()
                  for impl in IMPLEMENTATIONS}
        for shape in opts.shapes:
            batch, seqlen = map(int, shape.split("x"))
            gen = torch.Generator().manual_seed(seqlen)
            vocab = models["sdpa"].config.vocab_size
            ids = torch.randint(100, vocab - 100, (batch, seqlen), generator=gen).cuda()
            rounds = {impl: [] for impl in models}
            for model in models.values():
                step_ms(model, ids, 3)  # warm-up: compiles, records
            for _ in range(opts.rounds):
                for impl, model in models.items():
                    rounds[impl].append(step_ms(model, ids, opts.runs))
            for impl, results in rounds.items():
                medians = [median for median, _, _ in results]
                row = dict(model=name, layers=spec["layers"], impl=impl, batch=batch, seqlen=seqlen,
                           step_ms=round(statistics.median(medians), 3),
                           round_medians_ms=[round(m, 3) for m in medians],
                           best_ms=round(min(best for _, best, _ in results), 3), loss=round(results[-1][2], 4))
                rows.append(row)
                print(json.dumps(row), flush=True)
        del models
        torch.cuda.empty_cache()
    import triton
    import transformers
    meta = dict(label=opts.label, commit=os.environ.get("FLASHTILE_GIT_COMMIT", ""), torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__, gpu=torch.cuda.get_device_name(),
                command="python benchmarks/train_step.py " + " ".join(sys.argv[1:]))
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"h200-train-step-{opts.label}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
