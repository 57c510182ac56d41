"""Our own forward passes (attention through kernels/), plus weight loading."""
