"""An OpenAI-compatible HTTP server over the pipeline (`mirror-sd serve`): serve/app.py."""
