"""The anchor and the outer optimizer: the global model each rank keeps, and how an averaging moves it.

Rule, on this rank's local shards (the anchor is the shard of the global model after the previous averaging)::

    Δ_g = anchor − local_g;   anchor ← OuterSGD(anchor, grad = mean_g Δ_g);   local_g ← anchor

``fedavg``: OuterSGD is SGD with lr 1 and no momentum, so anchor ← mean_g local_g (today's parameter average, to
fp32 rounding). ``nesterov``: ``torch.optim.SGD(lr, momentum, nesterov=True)`` (DiLoCo; 0.7 and 0.9 by default,
as DiLoCo, torchft and OpenDiLoCo). The anchor and the momentum are fp32 whatever the parameters' dtype; they
are equal in every group, since every group applies the same mean Δ to the same anchor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

OUTER_OPTIMIZERS = ("fedavg", "nesterov")
NESTEROV_DEFAULTS = {"lr": 0.7, "momentum": 0.9}


def outer_hyperparameters(name: str, lr: float | None, momentum: float | None) -> tuple[float, float]:
    """(lr, momentum) of the outer SGD: fedavg's fixed (1, 0), or nesterov's with its defaults filled in."""
    if name == "fedavg":
        return 1.0, 0.0
    return (
        NESTEROV_DEFAULTS["lr"] if lr is None else lr,
        NESTEROV_DEFAULTS["momentum"] if momentum is None else momentum,
    )


def outer_state_device(tensors: Sequence[torch.Tensor], on_device: bool) -> torch.device:
    """Where the anchor and momentum live: pinned CPU memory for CUDA shards unless ``on_device``, else theirs."""
    device = tensors[0].device if tensors else torch.device("cpu")
    return device if on_device or device.type != "cuda" else torch.device("cpu")


class OuterOptimizer:
    """This rank's anchor (fp32 copies of its local shards) and the SGD that steps it with mean Δ.

    Args:
        tensors: the local shards that averagings move (trainable parameters), in a fixed order.
        lr, momentum: the outer SGD's; Nesterov momentum whenever ``momentum > 0``.
        device: where the anchor and momentum live (`outer_state_device`); CPU copies of CUDA shards are pinned,
            so the copies to and from the device are asynchronous. Default: the shards' device.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], lr: float = 1.0, momentum: float = 0.0, device=None) -> None:
        self.anchor = [self._hold(t.detach().float(), device) for t in tensors]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @staticmethod
    def _hold(tensor: torch.Tensor, device) -> torch.Tensor:
        device = torch.device(device or tensor.device)
        pinned = device.type == "cpu" and tensor.is_cuda
        return torch.empty_like(tensor, device=device, pin_memory=pinned).copy_(tensor)

    @property
    def nbytes(self) -> int:
        """Bytes of the anchor and the outer momentum (allocated at the first outer step)."""
        momentum = 2 if self.optimizer.defaults["momentum"] > 0 else 1
        return momentum * sum(a.numel() * a.element_size() for a in self.anchor)

    @torch.no_grad()
    def deltas(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Δ = anchor − local, in fp32 on the shards' device: what this group moved since the last averaging."""
        return [a.to(t.device, non_blocking=True) - t.float() for a, t in zip(self.anchor, tensors, strict=True)]

    @torch.no_grad()
    def step(
        self,
        mean_deltas: Sequence[torch.Tensor],
        tensors: Sequence[torch.Tensor],
        snapshots: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Step the anchor with mean Δ as its gradient, then move the local shards onto it.

        With ``snapshots`` (the fp32 local shards Δ was taken from, τ steps ago) the local progress since is
        kept: local ← anchor + (local − snapshot).
        """
        for anchor, delta in zip(self.anchor, mean_deltas, strict=True):
            anchor.grad = delta.to(anchor.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for i, (anchor, tensor) in enumerate(zip(self.anchor, tensors, strict=True)):
            new = anchor.to(tensor.device, non_blocking=True)
            tensor.copy_(new if snapshots is None else new + (tensor.float() - snapshots[i]))

    @torch.no_grad()
    def move_anchor(self, tensors: Sequence[torch.Tensor]) -> None:
        """Set the anchor to ``tensors`` (step 0's average: the first global model)."""
        for anchor, tensor in zip(self.anchor, tensors, strict=True):
            anchor.copy_(tensor.detach().float())

    @torch.no_grad()
    def restart(self, tensors: Sequence[torch.Tensor]) -> None:
        """Move the local shards onto the anchor (a diverged group's restart from the global model)."""
        for anchor, tensor in zip(self.anchor, tensors, strict=True):
            tensor.copy_(anchor.to(tensor.device))

    def state_dict(self) -> dict:
        """The anchor and the outer momentum: what a checkpoint needs to continue exactly."""
        return {"anchor": self.anchor, "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's anchor and momentum buffer, stepped with this optimizer's own lr and momentum.

        `torch.optim.Optimizer.load_state_dict` would restore the checkpoint's hyperparameters too, silently undoing
        settings changed at a resume (`hf_fedshard.engine.settings_history`). Without momentum the buffer is dropped.
        """
        for anchor, saved in zip(self.anchor, state["anchor"], strict=True):
            anchor.copy_(saved)
        group = self.optimizer.param_groups[0]
        own = {key: group[key] for key in ("lr", "momentum", "nesterov")}
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.param_groups[0].update(own)
        if own["momentum"] == 0:
            self.optimizer.state.clear()


def fragments_from_flat(flat: dict, ranges: Sequence[tuple[int, int]], optimizers: Sequence[OuterOptimizer]) -> dict:
    """A checkpoint's outer state held by parameter (``anchor``: a tensor per trainable parameter, ``momentum``: a
    tensor or ``None`` each) as `FederatedAverager.state_dict`'s ``outer``, cut at this averager's fragments
    ``ranges``; the param groups are ``optimizers``' own (their hyperparameters win at a load anyway)."""
    fragments = []
    for (start, stop), optimizer in zip(ranges, optimizers, strict=True):
        momenta = flat["momentum"][start:stop]
        state = {i: {"momentum_buffer": m} for i, m in enumerate(momenta) if m is not None}
        param_groups = optimizer.optimizer.state_dict()["param_groups"]
        fragments.append(
            {"anchor": flat["anchor"][start:stop], "optimizer": {"state": state, "param_groups": param_groups}}
        )
    return {"fragments": fragments}
