"""What several stages share: CUDA headers (*.cuh) and the launch of the fused attention kernel."""
