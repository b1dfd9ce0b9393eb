"""Model averaging: ``averagers``, ``hierarchical_model_averager`` and ``utils``."""

__all__ = ["averagers", "hierarchical_model_averager", "utils"]
