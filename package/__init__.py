"""NPU packages: static-shape OpenVINO IR, NNCF-compressed weights, checked bounds and checksums (make package)."""
