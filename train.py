"""dpt: train a model with `single`, `dp` or `ddp` from one Hydra config (the same as `dpt`).

python train.py                          # single process, synthetic data, MLP
python train.py strategy=ddp             # 2 CPU workers, or one per GPU
torchrun --standalone --nproc_per_node=2 train.py strategy=ddp launcher=torchrun
"""

from dpt.cli import main

if __name__ == "__main__":
    main()
