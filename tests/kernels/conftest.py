"""SPECDOCTOR_KERNEL_DEVICE=cuda (with TRITON_INTERPRET=0, on a machine with a GPU): every test here runs the
compiled kernels on the GPU. The tests build their inputs on the CPU; each kernel call takes them to the GPU and
its results back, so the references they are compared with stay the CPU's torch ones."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

KERNEL_DEVICE = os.environ.get("SPECDOCTOR_KERNEL_DEVICE", "cpu")


def to_device(value, device: str):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(item, device) for item in value)
    return value


def on_device(kernel, device: str):
    def run(*args, **options):
        return to_device(kernel(*to_device(args, device), **options), "cpu")

    return run


@pytest.fixture(autouse=True)
def kernels_on_device(monkeypatch):
    """The public launchers of every Triton module (those with a torch reference) wrapped to run on the device."""
    if KERNEL_DEVICE == "cpu":
        return
    if os.environ.get("TRITON_INTERPRET", "0") != "0" or not torch.cuda.is_available():
        pytest.fail(f"SPECDOCTOR_KERNEL_DEVICE={KERNEL_DEVICE} needs a CUDA GPU and TRITON_INTERPRET=0")
    from specdoctor.kernels import reference, triton_mtp, triton_quant, triton_stats, triton_verify

    for module in (triton_mtp, triton_quant, triton_stats, triton_verify):
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__ and hasattr(reference, name):
                monkeypatch.setattr(module, name, on_device(function, KERNEL_DEVICE))
