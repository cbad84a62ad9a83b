"""What the MoE stages' launches share: the limits of their kernels, moe.cuh's MAX_EXPERTS and
MAX_TOP_K (the grader checks these values against it when it compiles a stage that declares them)."""
MAX_EXPERTS = 256  # a lane of a warp holds at most MAX_EXPERTS / 32 logits of a token
MAX_TOP_K = 8
# hidden and inter at least: one k-step of the experts' GEMMs (stage 6's BLOCK_K, the rows of a TMA box)
MIN_DIM = 64


def dims_problem(hidden: int, inter: int) -> str | None:
    """Why the experts' GEMMs (stages 6 and 14, and so the MoE op) cannot take these sizes, or None: rows
    must be whole 16-byte units (TMA's strides) and at least one k-step wide."""
    if hidden % 8 or inter % 8 or min(hidden, inter) < MIN_DIM:
        return f"hidden and I must be multiples of 8, at least {MIN_DIM}; got hidden {hidden}, I {inter}"
    return None
