"""The first program of every training-loop tutorial, copied unchanged: a one-logit net and a
random binary data set. dpt trains them with `task=binary` (BCEWithLogitsLoss) from the YAML
files in conf/, which hold their own keys and nothing of dpt's."""

import torch
from torch import nn
from torch.utils.data import Dataset


class SimpleNet(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, output_dim))
    def forward(self, x): return self.net(x)

class RandomDataset(Dataset):
    def __init__(self, n_samples: int, input_dim: int) -> None:
        self.X = torch.randn(n_samples, input_dim)
        self.y = (self.X.sum(dim=1, keepdim=True) > 0).float()  # Simple binary target
    def __len__(self): return self.X.shape[0]
    def __getitem__(self, idx): return self.X[idx], self.y[idx]
