"""A Lightning DDP training script with no line about hierarchical averaging, for ``tests/test_lightning.py``.

Run as ``python tests/lightning_train.py`` (Lightning starts the 4 ranks) with ``HIERAVG_LIGHTNING_CONFIG``
set: the ``Trainer`` finds the callback through the ``lightning.pytorch.callbacks_factory`` entry point. Each
rank prints one line with the global step and, read from the callbacks the ``Trainer`` holds, the averaging
count and rounds.
"""

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import nn


class Regression(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(80, 8, generator=gen)
        y = x @ torch.randn(8, 1, generator=gen)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


if __name__ == "__main__":
    trainer = Trainer(
        accelerator="cpu", devices=4, strategy="ddp", max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(Regression())
    found = [cb for cb in trainer.callbacks if type(cb).__name__ == "HierarchicalAveraging"]
    opt = found[0].optimizer if found else None
    rounds = None if opt is None else {period: m["rounds"] for period, m in opt.metrics().items()}
    count = None if opt is None else opt.averaging_step
    print(f"rank {dist.get_rank()}: global step {trainer.global_step}, count {count}, rounds {rounds}", flush=True)
