"""Parallelism beyond data parallel: the device-mesh layout, tensor, pipeline and context
parallelism, and planning a layout on paper."""
