"""Adapters for parameter-efficient fine-tuning (the ``adapter`` kind, ``model.adapter``)."""
