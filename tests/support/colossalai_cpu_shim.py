"""Test-support shim: give ColossalAI's ``CpuAccelerator`` working CPU methods.

This module is TEST SUPPORT ONLY. It is not part of the shipped
``hf_ckpt_integrations`` package, and nothing outside ``tests/`` should import
it. It exists so that the ColossalAI checkpoint tests can run on CPU-only
machines (developer laptops, CI) with ``torch.distributed``'s ``gloo`` backend,
where ColossalAI would otherwise pick ``CpuAccelerator`` and crash on the first
RNG or memory call.

Importing this module patches nothing. Call :func:`install` (idempotent: a
second call is a no-op) before ``colossalai.launch_from_torch(...)``.

Why each method is patched (ColossalAI 0.5.0, ``colossalai/accelerator/cpu_accelerator.py``):

``get_rng_state(device=None)``
    Ships as ``torch.get_rng_state(device)``, but ``torch.get_rng_state`` takes
    no argument, so it raises ``TypeError: get_rng_state() takes 0 positional
    arguments but 1 was given``. Called by shardformer's ``Randomizer``
    (``colossalai/shardformer/layer/utils.py``), which the tensor-parallel
    layers (``VocabParallelEmbedding1D``, ``Linear1D_Col``/``Row``, dropout)
    create while ``HybridParallelPlugin`` boosts a model; without the patch
    boosting fails with "Failed to replace embed_tokens of type Embedding with
    VocabParallelEmbedding1D". CPU meaning: ``torch.get_rng_state()``
    (``device`` is ignored).

``set_rng_state(new_state, device=None)``
    The other half of the same ``Randomizer`` dance. The shipped version
    already calls ``torch.set_rng_state``; it is redefined here so that the
    get/set pair has one definition, in one place, with the same signature.
    CPU meaning: ``torch.set_rng_state(new_state)``.

``manual_seed(seed)``
    Ships raising ``RuntimeError("this method is not supported for cpu
    accelerator")``; ``Randomizer.__init__`` calls it, so boosting fails
    without it. CPU meaning: ``torch.manual_seed(seed)``.

``manual_seed_all(seed)``
    Ships raising. Not on the boost/save path in 0.5.0, but it is the
    "seed every device" call that ColossalAI-style test code uses; on CPU
    there is a single generator, so it means ``torch.manual_seed(seed)``.

``synchronize(device=None)``
    Ships raising. Called by ``checkpoint_io.utils`` when loading sharded
    optimizer states, by the low-level ZeRO optimizer, and by
    ``colossalai.testing.clear_cache_before_run``. CPU kernels are synchronous,
    so the CPU meaning is a no-op.

``empty_cache()``
    Ships raising. Called by ``colossalai.testing.clear_cache_before_run``.
    There is no caching allocator to flush on CPU: a no-op.

Nothing else is patched; every other ``CpuAccelerator`` method keeps its
shipped behaviour.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["install", "is_installed"]

_MARKER = "_hf_ckpt_integrations_cpu_shim"


def _get_rng_state(self, device=None):
    import torch

    return torch.get_rng_state()


def _set_rng_state(self, new_state, device: Optional[str] = None) -> None:
    import torch

    torch.set_rng_state(new_state)


def _manual_seed(self, seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _manual_seed_all(self, seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _synchronize(self, device=None) -> None:
    return None


def _empty_cache(self) -> None:
    return None


_PATCHES = {
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed_all,
    "synchronize": _synchronize,
    "empty_cache": _empty_cache,
}


def is_installed() -> bool:
    """Return True if :func:`install` has already patched ``CpuAccelerator``."""
    from colossalai.accelerator import CpuAccelerator

    return bool(getattr(CpuAccelerator, _MARKER, False))


def install() -> None:
    """Patch ``colossalai.accelerator.CpuAccelerator`` with CPU meanings.

    Patches the class (so instances already created by
    ``colossalai.accelerator.get_accelerator()`` see the change too). Safe to
    call any number of times; only the first call changes anything.
    """
    from colossalai.accelerator import CpuAccelerator

    if getattr(CpuAccelerator, _MARKER, False):
        return
    for name, func in _PATCHES.items():
        setattr(CpuAccelerator, name, func)
    setattr(CpuAccelerator, _MARKER, True)
