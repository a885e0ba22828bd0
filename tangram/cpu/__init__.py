"""CPU: the node pools with their light lane, the CPU manager (allocate-on-execution,
paper 5.2), memory admission, and the Kubernetes pod baseline."""
