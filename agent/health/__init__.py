"""GPU health as the cluster sees it: faults, and the device taints they become."""
