"""A realistic RL fine-tuning update, for tests and the bench: fp32 master weights, Adam on
noisy gradients at a small learning rate, and the bf16 copy rollout runs."""

from __future__ import annotations


class AdamLikeTrainer:
    """fp32 master weights of `sizes` stepped by Adam on unit-variance noise gradients."""

    def __init__(self, sizes: dict[str, int], lr: float = 1e-5, seed: int = 0, std: float = 0.02, device: str = "cpu"):
        import torch

        self.device = torch.device(device)  # a trainer's GPU: its weights never leave it
        self.g = torch.Generator(device=self.device).manual_seed(seed)
        self.lr, self.b1, self.b2, self.eps, self.t = lr, 0.9, 0.999, 1e-8, 0
        self.w = {n: torch.randn(s, generator=self.g, device=self.device) * std for n, s in sizes.items()}
        self.m = {n: torch.zeros(s, device=self.device) for n, s in sizes.items()}
        self.v = {n: torch.zeros(s, device=self.device) for n, s in sizes.items()}

    def step(self) -> None:
        import torch

        self.t += 1
        c1, c2 = 1 - self.b1**self.t, 1 - self.b2**self.t
        for n, w in self.w.items():
            g = torch.randn(w.shape, generator=self.g, device=self.device)
            self.m[n].mul_(self.b1).add_(g, alpha=1 - self.b1)
            self.v[n].mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            denom = (self.v[n] / c2).sqrt_().add_(self.eps)
            w.addcdiv_(self.m[n], denom, value=-self.lr / c1)

    def bf16(self) -> dict:
        import torch

        return {n: w.to(torch.bfloat16) for n, w in self.w.items()}
