"""Finding a model's weights on disk and turning them into a Hugging Face directory."""

from pagefleet.engine.loader.source import resolve_model_dir

__all__ = ["resolve_model_dir"]
