"""The models ``benchmarks/hook_trace.py`` traces, one per scenario (its docstring lists them), built inside a
rank before sharding, and the meta scenario's eager twin (``--show-rng`` compares the two).
"""

from __future__ import annotations

META_CONFIG = {"n_layer": 2}  # the meta scenario's GPT (and --show-rng's eager twin of it)


def _eager_meta_model():
    """The meta scenario's model built eagerly on the CPU (--show-rng seeds the RNG first)."""
    from fsdp_assignment.support.models import GPT, GPTConfig
    return GPT(GPTConfig(**META_CONFIG))


def _twice_model():
    """A block applied twice in one forward: one unit, two uses (its backward runs twice too)."""
    import torch.nn as nn
    from fsdp_assignment.support.models import ScaledResidual

    class RunTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(7, 13)
            self.block = ScaledResidual(13, 17)
            self.head = nn.Linear(13, 5)

        def forward(self, x):
            return self.head(self.block(self.block(self.embed(x))))

    return RunTwice()


def _build(scenario: str, freeze_embedding: bool = False):
    """(model, unit modules children first and the root last, a function of the step returning the loss)."""
    import torch
    from fsdp_assignment.support.models import GPT, GPTConfig, LoRAConfig, LoRAModel, gpt_batch, gpt_loss

    torch.manual_seed(0)
    if scenario == "meta":  # built on meta: materialize_meta_module gives it values after sharding
        cfg = GPTConfig(**META_CONFIG)
        with torch.device("meta"):
            model = GPT(cfg)
        return model, [*model.blocks, model], lambda step: gpt_loss(model, *gpt_batch(cfg, 2, seed=step))
    if scenario == "lora":
        cfg = LoRAConfig(n_layer=2, freeze_embedding=freeze_embedding)
        model = LoRAModel(cfg)
        return model, [*model.blocks, model], lambda step: gpt_loss(model, *gpt_batch(cfg, 2, seed=step))
    if scenario == "reentrant":
        cfg = GPTConfig(n_layer=2, checkpoint="block", checkpoint_reentrant=True)
        model = GPT(cfg)
        return model, [*model.blocks, model], lambda step: gpt_loss(model, *gpt_batch(cfg, 2, seed=step))
    model = _twice_model()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g)
    return model, [model.block, model], lambda step: model(x + step).pow(2).mean()
