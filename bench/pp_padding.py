"""What pipeline parallelism's fixed micro-batch shapes cost: token positions computed per training step.

    python bench/pp_padding.py

torch's pipeline schedule fixes a stage's shapes at its first step, so under --train-pp all micro-batches of a step
share one shape: T = the step's longest row rounded up to a multiple of pipeline.SHAPE_STEP (a schedule per shape);
the naive choice, every row padded to the longest possible (the longest prompt + the response budget, 74 tokens by
default), is shown beside it. Without PP, grpo.py cuts the batch into length-sorted micro-batches, each padded to its
own longest row. Over 50 batches of the default run's shape (16 prompts x 8 responses, prompts drawn by the task's
own law, each response the answer's length, as a trained policy gives), this prints the positions each computes
against the real tokens, and last one JSON object. A compute-bound step pays about these ratios in training time.
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import grpo  # noqa: E402
import pipeline  # noqa: E402
import task  # noqa: E402


def positions(max_digits=32, max_new_tokens=40, prompts=16, group=8, micro_batches=4, batches=50, seed=0):
    rng, out = np.random.default_rng(seed), []
    for _ in range(batches):
        rows = [p for p in task.make_prompts(rng, prompts, max_digits) for _ in range(group)]
        lengths = [len(p) + len(task.answer(p)) for p in rows]                    # prompt + response tokens
        chunks = grpo.length_chunks(range(len(rows)), lengths, micro_batches)
        sorted_ = sum(len(c) * (max(lengths[i] for i in c) - 1) for c, _ in chunks)  # forward over tokens[:, :-1]
        longest = max_digits + 2 + max_new_tokens
        T = min(longest, -(-max(lengths) // pipeline.SHAPE_STEP) * pipeline.SHAPE_STEP)  # pipeline.padded_length
        out.append((len(rows) * T, sorted_, sum(n - 1 for n in lengths), len(rows) * longest))
    return np.array(out, dtype=float)                                             # (batches, 4)


if __name__ == "__main__":
    p = positions()
    pp_over_sorted, sorted_over_real, pp_over_real = p[:, 0] / p[:, 1], p[:, 1] / p[:, 2], p[:, 0] / p[:, 2]
    naive_over_sorted = p[:, 3] / p[:, 1]
    print(f"positions per step: PP {p[:, 0].mean():.0f} (naive, every row 74 long: {p[:, 3].mean():.0f}), "
          f"length-sorted {p[:, 1].mean():.0f}, real tokens {p[:, 2].mean():.0f}")
    print(f"naive PP / length-sorted: {naive_over_sorted.mean():.2f}")
    print(f"PP / length-sorted: {pp_over_sorted.mean():.2f} (from {pp_over_sorted.min():.2f} to "
          f"{pp_over_sorted.max():.2f}); length-sorted / real {sorted_over_real.mean():.2f}; PP / real "
          f"{pp_over_real.mean():.2f}")
    print(json.dumps({"pp_over_sorted_mean": round(pp_over_sorted.mean(), 3),
                      "pp_over_sorted_min": round(pp_over_sorted.min(), 3),
                      "pp_over_sorted_max": round(pp_over_sorted.max(), 3),
                      "sorted_over_real_mean": round(sorted_over_real.mean(), 3),
                      "pp_over_real_mean": round(pp_over_real.mean(), 3),
                      "naive_pp_over_sorted_mean": round(naive_over_sorted.mean(), 3)}))
