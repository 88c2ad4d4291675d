"""Built-in experiment trackers (kind ``logger``, chosen in ``train.loggers``): CSV and
TensorBoard files in the run directory, and Weights & Biases and MLflow in offline mode
(their packages are optional extras). ``metrics.jsonl`` is always written besides them."""
