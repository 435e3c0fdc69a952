"""Device kernels, each with a pure-PyTorch reference twin (installed as batchmaker.kernels)."""
