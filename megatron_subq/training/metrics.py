"""The trainer's logs: Megatron-LM's log line, validation lines, TensorBoard, W&B, a JSONL file.

Every ``--log-interval`` iterations the last rank (which holds the loss: last pipeline stage)
prints, averaged over the interval::

     [2026-01-01 12:00:00] iteration       20/     200 | consumed samples:          320 |
     elapsed time per iteration (ms): 812.3 | learning rate: 2.000000E-04 |
     global batch size:    16 | lm loss: 7.112233E+00 | loss scale: 1.0 | grad norm: 1.234 |
     number of skipped iterations:   0 | number of nan iterations:   0 |
     tokens per second per GPU: 20171.2 | throughput per GPU (TFLOP/s/GPU): 123.4 | MFU: 12.5% |
     peak memory (GB): 12.34 |

(one line). Every validation prints ``validation loss at iteration N | lm loss value: ... |
lm loss PPL: ... |``. ``--metrics-file`` gets one JSON object per iteration and per validation
with exact floats (resume tests compare them bitwise). TensorBoard scalars go to
``--tensorboard-dir`` when the ``tensorboard`` package is installed; W&B only with
``--wandb-project`` and ``wandb`` installed.
"""

from __future__ import annotations

import json
import math
import os
import resource
from datetime import datetime
from typing import Dict, Optional

import torch
import torch.distributed as dist


def peak_memory_gb() -> float:
    """Peak accelerator memory of this process (GB); the CPU run's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KB on Linux


def _is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


class MetricsLogger:
    def __init__(self, args, flops_per_iteration: float, peak_tflops: Optional[float]):
        self.args = args
        self.flops_per_iteration = flops_per_iteration
        self.peak_tflops = peak_tflops
        self.last = _is_last_rank()
        self._reset()
        self.skipped_total = self.nan_total = 0
        self.metrics_file = None
        self.tb = None
        self.wandb = None
        if not self.last:
            return
        if args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
            self.metrics_file = open(args.metrics_file, "a", encoding="utf-8")
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

                self.tb = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)
            except ImportError:
                print("> note: --tensorboard-dir given but tensorboard is not installed; "
                      "no TensorBoard scalars (pip install tensorboard)", flush=True)
        if args.wandb_project:
            try:
                import wandb  # noqa: PLC0415

                self.wandb = wandb.init(
                    project=args.wandb_project, name=args.wandb_exp_name,
                    dir=args.wandb_save_dir or args.save or None,
                    config={k: v for k, v in vars(args).items() if not k.startswith("_")})
            except ImportError:
                print("> note: --wandb-project given but wandb is not installed; no W&B logging",
                      flush=True)

    def _reset(self):
        self.iters = 0
        self.time = 0.0
        self.loss_sum = 0.0
        self.loss_count = 0
        self.extra_sums = {}
        self.skipped = self.nans = 0

    # ------------------------------------------------------------------------------------------
    def log_iteration(self, iteration: int, consumed: int, elapsed: float, lr: float,
                      loss: Optional[float], grad_norm, skipped: bool, loss_scale,
                      extra: Optional[Dict[str, float]] = None) -> None:
        """One iteration; ``extra`` are further losses to log (the MoE load-balancing loss),
        averaged over the log interval like the LM loss."""
        args = self.args
        extra = extra or {}
        grad_norm = float(grad_norm) if grad_norm is not None else None
        is_nan = loss is not None and not math.isfinite(loss)
        # counts must agree on every rank (they are printed by the last one only)
        self.iters += 1
        self.time += elapsed
        self.skipped += int(skipped)
        self.nans += int(is_nan)
        self.skipped_total += int(skipped)
        self.nan_total += int(is_nan)
        if loss is not None and not skipped and not is_nan:
            self.loss_sum += loss
            self.loss_count += 1
        for name, value in extra.items():
            total, count = self.extra_sums.get(name, (0.0, 0))
            self.extra_sums[name] = (total + value, count + 1)
        memory = None
        if iteration % args.log_interval == 0:
            memory = torch.tensor([peak_memory_gb()], dtype=torch.float64,
                                  device="cuda" if torch.cuda.is_available() else "cpu")
            if dist.is_initialized():
                dist.all_reduce(memory, op=dist.ReduceOp.MAX)
            memory = memory.item()
        if not self.last:
            if memory is not None:
                self._reset()
            return
        tokens_per_gpu = args.global_batch_size * args.seq_length / elapsed / args.world_size
        tflops = self.flops_per_iteration / elapsed / args.world_size / 1e12
        record = {"iteration": iteration, "consumed_samples": consumed, "lm_loss": loss,
                  "grad_norm": grad_norm, "lr": lr, "skipped": bool(skipped),
                  "time_s": elapsed, "tokens_per_sec_per_gpu": tokens_per_gpu,
                  "tflops_per_gpu": tflops, **extra}
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.tb is not None:
            for key, value in (("lm loss", loss), ("learning-rate", lr), ("grad-norm", grad_norm),
                               ("tokens-per-sec-per-gpu", tokens_per_gpu),
                               ("throughput-tflops-per-gpu", tflops), *extra.items()):
                if value is not None:
                    self.tb.add_scalar(key, value, iteration)
            if loss is not None:
                self.tb.add_scalar("lm loss vs samples", loss, consumed)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if v is not None}, step=iteration)
        if memory is None:
            return

        mean_time = self.time / self.iters
        tok = args.global_batch_size * args.seq_length / mean_time / args.world_size
        tf = self.flops_per_iteration / mean_time / args.world_size / 1e12
        parts = [f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
                 f" iteration {iteration:8d}/{args.train_iters or 0:8d}",
                 f"consumed samples: {consumed:12d}",
                 f"elapsed time per iteration (ms): {mean_time * 1000:.1f}",
                 f"learning rate: {lr:.6E}",
                 f"global batch size: {args.global_batch_size:5d}"]
        if self.loss_count:
            parts.append(f"lm loss: {self.loss_sum / self.loss_count:.6E}")
        for name, (total, count) in sorted(self.extra_sums.items()):
            parts.append(f"{name}: {total / max(count, 1):.6E}")
        parts.append(f"loss scale: {float(loss_scale):.1f}")
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        parts += [f"number of skipped iterations: {self.skipped:3d}",
                  f"number of nan iterations: {self.nans:3d}",
                  f"tokens per second per GPU: {tok:.1f}",
                  f"throughput per GPU (TFLOP/s/GPU): {tf:.3f}"]
        if self.peak_tflops:
            mfu = 100.0 * tf / self.peak_tflops
            parts.append(f"MFU: {mfu:.2f}%")
            if self.tb is not None:
                self.tb.add_scalar("mfu", mfu, iteration)
        label = "peak memory (GB)" if torch.cuda.is_available() else "peak CPU RSS (GB)"
        parts.append(f"{label}: {memory:.2f}")
        if self.tb is not None:
            self.tb.add_scalar("mem-max-allocated-gigabytes", memory, iteration)
        print(" | ".join(parts) + " |", flush=True)
        self._reset()

    def log_validation(self, iteration: int, loss: Optional[float]) -> None:
        if not self.last or loss is None:
            return
        ppl = math.exp(min(20.0, loss))
        line = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} |")
        print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
        if self.metrics_file:
            self.metrics_file.write(json.dumps({"iteration": iteration, "valid_loss": loss,
                                                "valid_ppl": ppl}) + "\n")
            self.metrics_file.flush()
        if self.tb is not None:
            self.tb.add_scalar("lm loss validation", loss, iteration)
            self.tb.add_scalar("lm loss validation ppl", ppl, iteration)
        if self.wandb is not None:
            self.wandb.log({"valid_loss": loss, "valid_ppl": ppl}, step=iteration)

    def close(self) -> None:
        if self.metrics_file:
            self.metrics_file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
