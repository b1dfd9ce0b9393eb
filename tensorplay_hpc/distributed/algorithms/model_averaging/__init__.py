"""Model averaging: ``averagers``, ``hierarchical_model_averager`` and ``utils``."""
