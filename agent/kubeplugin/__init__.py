"""The kubelet DRA plugin process (``gpu-agent kubelet-plugin``)."""
