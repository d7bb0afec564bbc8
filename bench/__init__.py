"""Side-by-side benchmark: the project's ar / sd / mirror against transformers and OpenVINO GenAI (make bench)."""
