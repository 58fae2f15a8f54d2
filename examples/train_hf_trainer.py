"""Hugging Face ``Trainer`` with DeepSpeed ZeRO-2 (bf16) and hierarchical averaging from the config alone.

A small ``LlamaForCausalLM`` built from a config (no download) learns the bytes of the Python
standard library's source (``examples/chars_common.py``: every tenth file held out for validation).
Nothing in this script knows about hierarchical averaging: the ``"hierarchical_averaging"`` section
of ``ds_configs/hf_zero2_bf16.json`` does it, once the module runner has installed the hook::

    torchrun --standalone --nproc_per_node 4 -m hieravg_optim.run examples/train_hf_trainer.py

4 ranks, 2 replicas of 2 (ZeRO-2 partitions within each replica), the replicas averaging their fp32
master partitions every 8 optimizer steps. The ``Trainer`` gives each rank its own windows of the
text (its ``DistributedSampler`` runs over all 4 ranks). On a machine without GPUs, ``use_cpu`` is set:
without it, transformers 5.24 / accelerate 1.16 treat a 4-rank CPU launch as a world of 1 (see
``docs/integrations.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chars_common import load_char_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 64


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of ``CONTEXT`` bytes of a stream, as causal LM samples (labels = inputs)."""

    def __init__(self, stream: torch.Tensor) -> None:
        self.windows = stream[: len(stream) // CONTEXT * CONTEXT].view(-1, CONTEXT)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.windows[i]
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default=os.path.join(ROOT, "ds_configs", "hf_zero2_bf16.json"))
    parser.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "hf_trainer"))
    parser.add_argument("--max-steps", type=int, default=161, help="optimizer steps (counts 0..160: the last averages)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    args = parser.parse_args()
    start = time.perf_counter()

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import hieravg_optim.deepspeed as hds

    shard = load_char_shard(0, 1, context=CONTEXT)  # the whole training stream; the Trainer shards it
    train, validation = Windows(shard.train), Windows(shard.val_windows[:, :CONTEXT].reshape(-1))
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=CONTEXT,
        )  # fmt: skip
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        learning_rate=2e-3, warmup_steps=4, weight_decay=0.01, bf16=True, use_cpu=not torch.cuda.is_available(),
        logging_steps=40, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=validation)
    result = trainer.train()
    metrics = trainer.evaluate()
    engine = trainer.model_wrapped
    state = hds.get_averaging(engine)
    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, flat)
    identical = all(f.equal(everyone[0]) for f in everyone)
    if dist.get_rank() == 0:
        rounds = {str(period): m["rounds"] for period, m in state.metrics().items()} if state else None
        print(
            f"steps {trainer.state.global_step}  train loss {result.training_loss:.4f}  validation loss "
            f"{metrics['eval_loss']:.4f}  averaging rounds per period {rounds}  replicas identical {identical}  "
            f"({time.perf_counter() - start:.1f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
