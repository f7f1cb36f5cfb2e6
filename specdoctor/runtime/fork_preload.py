"""What the fork server the ranks start from (launch.rank_context) imports once: the runtime, and the parts
of torch that building a module on the meta device imports on first use (its reference ops and sympy:
about 1.6 s a process otherwise). Only that server imports this module."""

import torch

import specdoctor.runtime.worker  # noqa: F401

with torch.device("meta"):
    torch.nn.Linear(2, 2), torch.nn.Embedding(2, 2)  # kaiming_uniform_ and normal_: two import paths
