"""dpt: train a model with `single`, `dp` or `ddp` from one Hydra config.

python train.py                          # single process, synthetic data, MLP
python train.py strategy=ddp             # 2 CPU workers, or one per GPU
torchrun --standalone --nproc_per_node=2 train.py strategy=ddp launcher=torchrun
"""

from typing import Any

import hydra
from omegaconf import DictConfig

from dpt.cli import run, task


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Any:
    return task(cfg)


if __name__ == "__main__":
    run(main)
