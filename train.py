"""dpt: train a model from one Hydra config, on one process or many (the same as `dpt`): single,
dp, ddp, fsdp or pipeline, here, under torchrun or on SLURM.

python train.py                          # single process, synthetic data, MLP
python train.py strategy=ddp             # 2 CPU workers, or one per GPU
torchrun --standalone --nproc_per_node=2 train.py strategy=ddp launcher=torchrun
"""

if __name__ == "__main__":
    # Imported here, not above: each rank of a local world runs this file again (as
    # `__mp_main__`, multiprocessing's way to find the main module) and needs none of the CLI.
    from dpt.launch.cli import entry

    entry()
