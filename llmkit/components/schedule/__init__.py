"""Built-in learning-rate schedules.

Each module has an ``Options`` model and ``build(options, *, total_steps)`` returning the lr
factor (1.0 = the optimizer's base lr, reached at the end of warmup) for a 0-based step.
"""
