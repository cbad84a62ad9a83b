"""What the MoE stages' launches share: the limits of their kernels, moe.cuh's MAX_EXPERTS and
MAX_TOP_K (the grader checks these values against it when it compiles a stage that declares them)."""
MAX_EXPERTS = 256  # a lane of a warp holds at most MAX_EXPERTS / 32 logits of a token
MAX_TOP_K = 8
