"""Generated gRPC stubs for kubelet's PodResources v1 API (``make protos``)."""
