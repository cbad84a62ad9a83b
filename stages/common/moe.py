"""What the MoE stages' launches share: the limits of their kernels, moe.cuh's MAX_EXPERTS and
MAX_TOP_K (the grader checks these values against it when it compiles a stage that declares them),
and the parameter structs of the kernels that several stages compile, as moe.cuh's structs hold them
(a stage that launches one lists it in its param_structs: the grader checks the layout)."""
from stages.common.launcher import param_struct

MAX_EXPERTS = 256  # a lane of a warp holds at most MAX_EXPERTS / 32 logits of a token
MAX_TOP_K = 8

# stage 5's moe_topk and moe_align (routing.cu)
TopkParams = param_struct("TopkParams", [
    ("logits", "const float*"), ("topk_ids", "int*"), ("topk_weights", "float*"), ("rank", "int*"),
    ("expert_counts", "int*"), ("prob_sums", "float*"), ("tokens", "int"), ("experts", "int"), ("top_k", "int"),
    ("group", "int"), ("tokens_per_group", "int")])
AlignParams = param_struct("AlignParams", [
    ("counts", "const int*"), ("prob_sums", "const float*"), ("expert_counts", "int*"), ("expert_offsets", "int*"),
    ("source_token", "int*"), ("aux_loss", "float*"), ("usage_var", "float*"), ("tokens", "int"), ("experts", "int"),
    ("top_k", "int"), ("block", "int"), ("rows", "int"), ("alpha", "float")])

# stage 6's grouped GEMMs, the up and the down kernel alike (experts.cu, ladder/grouped.cuh)
ExpertParams = param_struct("ExpertParams", [
    ("offsets", "const int*"), ("experts", "int"), ("inter", "int"), ("hidden", "int")])

# stage 7's router_logits (layer.cu)
RouterParams = param_struct("RouterParams", [
    ("x", "const elem_t*"), ("wr", "const elem_t*"), ("bias", "const float*"), ("out", "float*"), ("tokens", "int"),
    ("hidden", "int"), ("experts", "int"), ("per_split", "int")])
