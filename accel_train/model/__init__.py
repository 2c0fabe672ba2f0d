"""The model a run trains: timm's by name or your own callable, the CIFAR stem, weights to start
from, and the parameters that stay frozen.

Modules: create (the model, its stem, --init_from), own_model (--model module.path:callable, its
checks, --trust_model_code), freeze (--freeze), pretrained (--pretrained: timm's weights on disk).
"""
