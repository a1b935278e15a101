"""Scripts that drive a launched app through gradio_client, run from the repository root as
``python -m tools.<name>``."""
