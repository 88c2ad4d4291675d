"""Serving a model behind the OpenAI API: the continuous-batching engine
(:mod:`~llmkit.serving.engine`), the per-request state and token choice
(:mod:`~llmkit.serving.sequences`), the API's request and response bodies
(:mod:`~llmkit.serving.protocol`) and the ASGI application (:mod:`~llmkit.serving.app`)."""

from llmkit.serving.engine import Engine
from llmkit.serving.sequences import Event, Request, SamplingParams, Token

__all__ = ["Engine", "Event", "Request", "SamplingParams", "Token"]
