"""Built-in optimizers.

Each module has an ``Options`` model (a :class:`llmkit.optim.OptimizerOptions`, defined in
the torch-free :mod:`llmkit.components.optimizer.options`) and ``build(model, options)``
returning a ``torch.optim.Optimizer`` over :func:`llmkit.optim.param_groups`, with
``initial_lr`` set on every group.
"""
